// The engine's Fusion contract (gemm_kernel.cuh): a policy declares its optional hooks in kTraits
// and check_fusion holds the declaration against its members - a hook misspelt, missing, present
// but undeclared, or with another signature does not compile. Checked here at compile time on
// small policies (the static_asserts below are the test; the TEST reports that they compiled).
#include <gtest/gtest.h>

#include "gemm/gemm_kernel.cuh"

namespace mk::gemm_engine {
namespace {

using Cfg = TileConfig<128>;

// The required hooks and store(), without a declaration or A's loads: each policy below adds
// its kTraits (and load_a, or a_row).
struct RequiredNoA {
  struct ConsumerState {};
  __device__ int num_tiles() const { return 0; }
  __device__ Tile tile(int) const { return {}; }
  __device__ void wait_operands(const Tile&) const {}
  __device__ void consumer_done(ConsumerState&) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};
struct Required : RequiredNoA {
  __device__ void load_a(void*, uint64_t*, const Tile&, int) const {}
};
struct PlainNoA : RequiredNoA {
  template <int kRegs>
  __device__ void store(const float (&)[kRegs], const Tile&, int, uint8_t*, ConsumerState&) const {}
};
struct Plain : PlainNoA {
  __device__ void load_a(void*, uint64_t*, const Tile&, int) const {}
};

struct Minimal : Plain {
  static constexpr FusionTraits kTraits{};
};
// mid_tile declared and spelt right; declared and misspelt; spelt right and not declared.
struct MidTile : Plain {
  static constexpr FusionTraits kTraits{.mid_tile = true};
  __device__ void mid_tile(ConsumerState&) const {}
};
struct MidTileMisspelt : Plain {
  static constexpr FusionTraits kTraits{.mid_tile = true};
  __device__ void mid_tiel(ConsumerState&) const {}
};
struct MidTileUndeclared : Plain {
  static constexpr FusionTraits kTraits{};
  __device__ void mid_tile(ConsumerState&) const {}
};
// a_rows with another return type.
struct ARowsWrongSignature : Plain {
  static constexpr FusionTraits kTraits{.a_rows = true};
  __device__ bool a_rows(const Tile&) const { return true; }
};
// Ring operands declared, but store() without the ring.
struct RingWithoutRingStore : Plain {
  static constexpr FusionTraits kTraits{.epilogue_loads = true};
  __device__ int epilogue_loads(const Tile&) const { return 0; }
  __device__ void load_epilogue(void*, uint64_t*, const Tile&, int) const {}
};
// load_b declared and provided; declared without the hook; provided and not declared.
struct LoadB : Plain {
  static constexpr FusionTraits kTraits{.load_b = true};
  __device__ void load_b(void*, uint64_t*, const Tile&, int) const {}
};
struct LoadBMissing : Plain {
  static constexpr FusionTraits kTraits{.load_b = true};
};
struct LoadBUndeclared : Plain {
  static constexpr FusionTraits kTraits{};
  __device__ void load_b(void*, uint64_t*, const Tile&, int) const {}
};
// dynamic_tiles declared with the counter; without it; the counter not declared.
struct DynamicTiles : Plain {
  static constexpr FusionTraits kTraits{.dynamic_tiles = true};
  __device__ int* tile_counter() const { return nullptr; }
};
struct DynamicTilesNoCounter : Plain {
  static constexpr FusionTraits kTraits{.dynamic_tiles = true};
};
struct TileCounterUndeclared : Plain {
  static constexpr FusionTraits kTraits{};
  __device__ int* tile_counter() const { return nullptr; }
};
// consumer_prologue declared with the hook; without it; the hook not declared.
struct ConsumerPrologue : Plain {
  static constexpr FusionTraits kTraits{.consumer_prologue = true};
  __device__ void consumer_prologue(int, int) const {}
};
struct ConsumerPrologueMissing : Plain {
  static constexpr FusionTraits kTraits{.consumer_prologue = true};
};
struct ConsumerPrologueUndeclared : Plain {
  static constexpr FusionTraits kTraits{};
  __device__ void consumer_prologue(int, int) const {}
};
struct ConsumerPrologueWrongSignature : Plain {
  static constexpr FusionTraits kTraits{.consumer_prologue = true};
  __device__ void consumer_prologue(int) const {}
};
// A gathered A: a_row declared and provided, without load_a, with dynamic tiles (the side warps
// take the tiles from the ring); declared with a load_a too; not declared; neither (no way to
// load A); with a_rows (no box to shorten); without dynamic tiles.
struct GatherA : PlainNoA {
  static constexpr FusionTraits kTraits{.dynamic_tiles = true, .gather_a = true};
  __device__ const __nv_bfloat16* a_row(const Tile&, int) const { return nullptr; }
  __device__ int* tile_counter() const { return nullptr; }
};
struct GatherAStaticTiles : PlainNoA {
  static constexpr FusionTraits kTraits{.gather_a = true};
  __device__ const __nv_bfloat16* a_row(const Tile&, int) const { return nullptr; }
};
struct GatherAWithLoadA : Plain {
  static constexpr FusionTraits kTraits{.dynamic_tiles = true, .gather_a = true};
  __device__ const __nv_bfloat16* a_row(const Tile&, int) const { return nullptr; }
  __device__ int* tile_counter() const { return nullptr; }
};
struct GatherAUndeclared : PlainNoA {
  static constexpr FusionTraits kTraits{};
  __device__ const __nv_bfloat16* a_row(const Tile&, int) const { return nullptr; }
};
struct NoLoadA : PlainNoA {
  static constexpr FusionTraits kTraits{};
};
struct GatherAWithARows : PlainNoA {
  static constexpr FusionTraits kTraits{.a_rows = true, .dynamic_tiles = true, .gather_a = true};
  __device__ const __nv_bfloat16* a_row(const Tile&, int) const { return nullptr; }
  __device__ int a_rows(const Tile&) const { return 128; }
  __device__ int* tile_counter() const { return nullptr; }
};
// A register split the CTA cannot give.
struct TooManyRegisters : Plain {
  static constexpr FusionTraits kTraits{.producer_regs = 64, .consumer_regs = 232};
};
// No store() at all.
struct NoStore : Required {
  static constexpr FusionTraits kTraits{};
};
// No declaration at all.
struct Undeclared : Plain {};

static_assert(fusion_matches<Cfg, Minimal>());
static_assert(fusion_matches<Cfg, MidTile>());
static_assert(!fusion_matches<Cfg, MidTileMisspelt>());
static_assert(!fusion_matches<Cfg, MidTileUndeclared>());
static_assert(!fusion_matches<Cfg, ARowsWrongSignature>());
static_assert(!fusion_matches<Cfg, RingWithoutRingStore>());
static_assert(fusion_matches<Cfg, LoadB>());
static_assert(!fusion_matches<Cfg, LoadBMissing>());
static_assert(!fusion_matches<Cfg, LoadBUndeclared>());
static_assert(fusion_matches<Cfg, GatherA>());
static_assert(!fusion_matches<Cfg, GatherAWithLoadA>());
static_assert(!fusion_matches<Cfg, GatherAStaticTiles>());
static_assert(!fusion_matches<Cfg, GatherAUndeclared>());
static_assert(!fusion_matches<Cfg, NoLoadA>());
static_assert(!fusion_matches<Cfg, GatherAWithARows>());
static_assert(!fusion_matches<Cfg, TooManyRegisters>());
static_assert(fusion_matches<Cfg, DynamicTiles>());
static_assert(!fusion_matches<Cfg, DynamicTilesNoCounter>());
static_assert(!fusion_matches<Cfg, TileCounterUndeclared>());
static_assert(fusion_matches<Cfg, ConsumerPrologue>());
static_assert(!fusion_matches<Cfg, ConsumerPrologueMissing>());
static_assert(!fusion_matches<Cfg, ConsumerPrologueUndeclared>());
static_assert(!fusion_matches<Cfg, ConsumerPrologueWrongSignature>());
static_assert(!fusion_matches<Cfg, NoStore>());
static_assert(!fusion_matches<Cfg, Undeclared>());

TEST(FusionTraits, DeclarationsAreCheckedAtCompileTime) {
  SUCCEED() << "the static_asserts of tests/gpu/test_fusion_traits.cu compiled";
}

}  // namespace
}  // namespace mk::gemm_engine
