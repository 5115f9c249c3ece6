// The C++ entry points' input checks, fuzzed on the GPU (the Python package's are fuzzed by
// tests/python/test_torch_dist.py, the plans' on the CPU by tests/cpu/test_fused_plans.cpp).
// Random calls of every op: shapes valid or not; a pointer that is null, pageable or pinned host
// memory, misaligned, plain device memory where a symmetric buffer is required, a symmetric
// range running past its buffer, an output overlapping another argument; out-of-range
// configurations and unknown enums. The same cases on every rank (the seed is shared, the data
// is each rank's). Each call either runs and matches its reference, or throws mk::Error before
// launch naming the op and the argument - and then every output is still poisoned.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collective_checks.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/collectives.h"
#include "mkernel/fused.h"
#include "mkernel/gemm.h"
#include "reduce_checks.h"

namespace mk::test {
namespace {

enum class Op {
  kGemm,
  kGroupedGemm,
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAgGemm,
  kGemmRs,
  kGemmAr
};
constexpr int kOps = 8;
const char* op_name(Op op) {
  static const char* names[] = {"gemm",       "grouped_gemm", "all_gather", "reduce_scatter",
                                "all_reduce", "ag_gemm",      "gemm_rs",    "gemm_ar"};
  return names[static_cast<int>(op)];
}

enum class Fault {
  kNone,
  kNull,
  kPageable,
  kPinned,
  kMisaligned,
  kNotSymmetric,  // a symmetric argument in plain device memory (the others: in a symmetric one)
  kPastTheEnd,    // a symmetric argument whose range runs past its buffer
  kOverlap,       // an output at the address of another argument
  kConfig,        // a configuration field out of range
  kEnum,          // an unknown dtype or B layout
};
constexpr int kFaults = 10;
const char* fault_name(Fault f) {
  static const char* names[] = {"none",       "null",          "pageable host", "pinned host",
                                "misaligned", "not symmetric", "past the end",  "overlap",
                                "config",     "enum"};
  return names[static_cast<int>(f)];
}

// Words a refusal must contain one of (as a word): the argument or the rule it broke.
const char* const kArgumentWords[] = {
    "A",          "B",          "C",       "input",     "output",     "out", "workspace", "a_shard",
    "gathered_a", "group_rows", "groups",  "rows",      "max_rows",   "M",   "N",         "K",
    "K_r",        "count",      "block_n", "comm_ctas", "piece_rows", "sms", "channels",  "threads",
    "dtype",      "b_layout",   "layout",  "symmetric", "stream"};

bool has_word(const std::string& text, const std::string& word) {
  const auto is_word = [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
  };
  for (std::size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool starts = at == 0 || !is_word(text[at - 1]);
    const bool ends = at + word.size() == text.size() || !is_word(text[at + word.size()]);
    if (starts && ends) return true;
  }
  return false;
}

// One argument of a call: its name (as the op's messages say it), size, kind.
struct Arg {
  std::string name;
  std::size_t bytes = 0;
  bool symmetric = false;  // must lie in a symmetric buffer
  bool output = false;     // written by the op: poisoned, and checked after a refusal
  bool zero = false;       // a workspace that must be zero before the call
  bool checked = true;     // poisoned and checked (not when it aliases another argument)
  char* ptr = nullptr;     // what the call gets
  char* base = nullptr;    // the arena memory behind it (nullptr: not in an arena)
  std::size_t span = 0;    // bytes at base the call may touch
};

// Each rank's memory for every case, allocated before the cases run: ranks sharing a GPU in one
// process must not cudaMalloc while a peer's kernel waits for them.
struct Arenas {
  static constexpr std::size_t kBytes = std::size_t{48} << 20;
  SymmetricBuffer sym;
  char* dev = nullptr;
  char* pinned = nullptr;
  std::vector<char> pageable = std::vector<char>(1 << 20);
  std::size_t sym_used = 0, dev_used = 0;

  explicit Arenas(Communicator& comm) : sym(comm.alloc(kBytes)) {
    cudaMalloc(reinterpret_cast<void**>(&dev), kBytes);
    cudaMallocHost(reinterpret_cast<void**>(&pinned), 1 << 20);
  }
  ~Arenas() {
    cudaFree(dev);
    cudaFreeHost(pinned);
  }
  // Bytes from the symmetric or the plain arena (nullptr when the case does not fit).
  char* take(bool symmetric, std::size_t bytes) {
    std::size_t& used = symmetric ? sym_used : dev_used;
    const std::size_t need = (bytes + 16 + 255) / 256 * 256;  // room for a misaligned copy
    if (used + need > kBytes) return nullptr;
    char* p = (symmetric ? static_cast<char*>(sym.data()) : dev) + used;
    used += need;
    return p;
  }
};

struct Case {
  Op op;
  Fault fault;
  int64_t m = 0, n = 0, k = 0;  // k: K_r for gemm_rs / gemm_ar
  std::size_t count = 0;        // collectives
  int groups = 0;               // grouped_gemm
  bool masked = false;          // grouped_gemm: each group in a block of m rows
  std::vector<int32_t> group_rows;
  DType dtype = DType::kBF16;
  BLayout layout = BLayout::kNK;
  bool gathered = false;  // ag_gemm writes gathered_a
  FusedGemmConfig fused;
  GemmConfig plain;
  CollectiveConfig coll;
  std::string config_text;
  std::vector<Arg> args;

  std::string describe() const {
    std::string s = std::string(op_name(op)) + " M " + std::to_string(m) + " N " +
                    std::to_string(n) + " K " + std::to_string(k) + " count " +
                    std::to_string(count) + " groups " + std::to_string(groups) +
                    (masked ? " masked" : "") + " dtype " +
                    std::to_string(static_cast<int>(dtype)) + " layout " +
                    std::to_string(static_cast<int>(layout)) + ", fault " + fault_name(fault);
    return s + (config_text.empty() ? "" : " (" + config_text + ")");
  }
};

int64_t pick_dim(std::mt19937_64& rng, int64_t max_blocks) {
  const int r = static_cast<int>(rng() % 100);
  const int64_t d = 8 * (1 + static_cast<int64_t>(rng() % max_blocks));
  if (r < 88) return d;
  if (r < 96) return d + 4;  // not a multiple of 8
  return r < 98 ? 0 : -8;
}

int64_t pick_rows(std::mt19937_64& rng, int world, bool divisible) {
  const int r = static_cast<int>(rng() % 100);
  int64_t m = 1 + static_cast<int64_t>(rng() % 300);
  if (divisible && r < 85) m = world * (1 + static_cast<int64_t>(rng() % 150));
  if (r >= 94) m = r < 97 ? 0 : -world;
  return m;
}

// The op's arguments for the case's shapes (sizes clamped where the shapes are invalid).
std::vector<Arg> arguments(const Case& c, Communicator& comm) {
  const int world = comm.world_size();
  const auto clamp = [](int64_t v) {
    return static_cast<std::size_t>(std::clamp<int64_t>(v, 1, int64_t{1} << 24));
  };
  const std::size_t m = clamp(c.m), n = clamp(c.n), k = clamp(c.k);
  const std::size_t es = c.dtype == DType::kF32 ? 4 : 2;
  const std::size_t count = std::max<std::size_t>(c.count, 1);
  const auto bytes_or = [](auto&& fn, std::size_t fallback) {
    try {
      return std::max<std::size_t>(fn(), 16);
    } catch (const Error&) {
      return fallback;
    }
  };
  switch (c.op) {
    case Op::kGemm:
      return {{"A", m * k * 2}, {"B", n * k * 2}, {"C", m * n * 2, false, true}};
    case Op::kGroupedGemm: {
      const std::size_t rows =
          c.masked ? m * static_cast<std::size_t>(std::clamp(c.groups, 1, 6)) : m;
      return {{"A", rows * k * 2},
              {"B", static_cast<std::size_t>(c.groups) * n * k * 2},
              {"C", rows * n * 2, false, true},
              {"group_rows", static_cast<std::size_t>(c.groups) * 4}};
    }
    case Op::kAllGather:
      return {{"input", count * es}, {"output", world * count * es, true, true}};
    case Op::kReduceScatter:
      return {{"input", world * count * es, true}, {"output", count * es, false, true}};
    case Op::kAllReduce:
      return {{"input", count * es, true}, {"output", count * es, true, true}};
    case Op::kAgGemm: {
      std::vector<Arg> a = {{"a_shard", std::max<std::size_t>(m / world, 1) * k * 2},
                            {"B", n * k * 2},
                            {"C", m * n * 2, false, true},
                            {"workspace", ag_gemm_workspace_bytes(m, k), true, true}};
      if (c.gathered) a.push_back({"gathered_a", m * k * 2, false, true});
      return a;
    }
    case Op::kGemmRs:
      return {{"A", m * k * 2},
              {"B", n * k * 2},
              {"out", std::max<std::size_t>(m / world, 1) * n * 2, false, true},
              {"workspace", bytes_or([&] { return gemm_rs_workspace_bytes(comm, c.m, c.n); }, 4096),
               true, false, true}};
    case Op::kGemmAr:
      return {
          {"A", m * k * 2},
          {"B", n * k * 2},
          {"out", m * n * 2, true, true},
          {"workspace",
           bytes_or([&] { return gemm_ar_workspace_bytes(comm, c.m, c.n, c.k, c.fused); }, 4096),
           true, false, true}};
  }
  return {};
}

Case random_case(std::mt19937_64& rng, Communicator& comm) {
  const int world = comm.world_size();
  Case c;
  c.op = static_cast<Op>(rng() % kOps);
  c.fault = rng() % 100 < 35 ? Fault::kNone : static_cast<Fault>(1 + rng() % (kFaults - 1));
  const bool rows_divisible = c.op == Op::kAgGemm || c.op == Op::kGemmRs;
  c.m = pick_rows(rng, world, rows_divisible);
  c.n = pick_dim(rng, 48);
  c.k = pick_dim(rng, 48);
  c.layout = rng() % 2 ? BLayout::kKN : BLayout::kNK;
  c.gathered = rng() % 2;
  const int r = static_cast<int>(rng() % 100);
  c.count = r < 4 ? 0 : 1 + rng() % (r < 50 ? 64 : 6000);
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  c.dtype = dtypes[rng() % 3];
  if (c.op == Op::kGroupedGemm) {
    c.groups = static_cast<int>(1 + rng() % 6);
    if (c.fault == Fault::kConfig && rng() % 2) c.groups = rng() % 2 ? 0 : 70000;
    c.masked = rng() % 2;
    const int64_t rows = std::max<int64_t>(c.m, 0);
    int64_t left = rows;
    for (int g = 0; g < std::clamp(c.groups, 0, 6); ++g) {
      int64_t take = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % (left + 1));
      if (c.masked) {  // any count: past the capacity (clamped) or negative now and then
        take = rng() % 5 == 0 ? -3 : static_cast<int64_t>(rng() % (rows + 20));
      }
      c.group_rows.push_back(static_cast<int32_t>(take));
      if (!c.masked) left -= take;
    }
  }
  if (c.fault == Fault::kEnum) {
    if (c.op == Op::kAllGather || c.op == Op::kReduceScatter || c.op == Op::kAllReduce) {
      c.dtype = static_cast<DType>(7);
    } else {
      c.layout = static_cast<BLayout>(5);
    }
  }
  if (c.fault == Fault::kConfig) {
    const int which = static_cast<int>(rng() % 4);
    const int big = rng() % 2;
    if (c.op == Op::kGemm || c.op == Op::kGroupedGemm) {
      if (which < 2) {
        c.plain.block_n = big ? 512 : 100;
      } else {
        c.plain.sms = big ? 100000 : -3;
      }
      c.config_text =
          "block_n " + std::to_string(c.plain.block_n) + " sms " + std::to_string(c.plain.sms);
    } else if (c.op == Op::kAllGather || c.op == Op::kReduceScatter || c.op == Op::kAllReduce) {
      if (which < 2) {
        c.coll.channels = big ? 100000 : -1;
      } else {
        c.coll.threads = big ? 2048 : 100;
      }
      c.config_text = "channels " + std::to_string(c.coll.channels) + " threads " +
                      std::to_string(c.coll.threads);
    } else {
      if (which == 0) c.fused.block_n = big ? 512 : 100;
      if (which == 1) c.fused.comm_ctas = big ? 1000000 : -1;
      if (which == 2) c.fused.piece_rows = big ? (1 << 30) : -5;
      if (which == 3) c.fused.sms = big ? 100000 : -3;
      c.config_text = "block_n " + std::to_string(c.fused.block_n) + " comm_ctas " +
                      std::to_string(c.fused.comm_ctas) + " piece_rows " +
                      std::to_string(c.fused.piece_rows) + " sms " + std::to_string(c.fused.sms);
    }
  }
  c.args = arguments(c, comm);
  return c;
}

// Places the arguments in the arenas and applies the case's pointer fault to one of them (the
// same one on every rank). False when the case does not fit the arenas (skipped).
bool place(Case& c, Arenas& arenas, std::mt19937_64& rng, const Communicator& comm) {
  arenas.sym_used = arenas.dev_used = 0;
  for (Arg& a : c.args) {
    a.base = arenas.take(a.symmetric, a.bytes);
    if (a.base == nullptr) return false;
    a.ptr = a.base;
    a.span = a.bytes + 16;
  }
  Arg& victim = c.args[rng() % c.args.size()];
  switch (c.fault) {
    case Fault::kNull:
      victim.ptr = victim.base = nullptr;
      break;
    case Fault::kPageable:
      victim.ptr = arenas.pageable.data();
      victim.base = nullptr;
      break;
    case Fault::kPinned:
      victim.ptr = arenas.pinned;
      victim.base = nullptr;
      break;
    case Fault::kMisaligned:
      victim.ptr = victim.base + 2;
      break;
    case Fault::kNotSymmetric:
      victim.ptr = victim.base = arenas.take(!victim.symmetric, victim.bytes);
      if (victim.base == nullptr) return false;
      break;
    case Fault::kPastTheEnd: {
      std::vector<Arg*> symmetric;
      for (Arg& a : c.args) {
        if (a.symmetric) symmetric.push_back(&a);
      }
      if (symmetric.empty()) break;
      Arg& s = *symmetric[rng() % symmetric.size()];
      const std::size_t half = (s.bytes / 2 + 255) / 256 * 256;
      s.ptr = s.base = static_cast<char*>(arenas.sym.data()) + Arenas::kBytes - half;
      s.span = half;
      break;
    }
    case Fault::kOverlap: {
      if (c.op == Op::kAllGather) {
        // Its input may be this rank's own slot of the output (in place); the next rank's slot
        // is the same mistake on every rank.
        Arg& in = c.args[0];
        Arg& out = c.args[1];
        in.ptr = in.base = out.ptr + ((comm.rank() + 1) % comm.world_size()) * in.bytes;
        in.span = in.bytes;
        out.checked = false;
        break;
      }
      std::vector<Arg*> outputs;
      for (Arg& a : c.args) {
        if (a.output) outputs.push_back(&a);
      }
      Arg& out = *outputs[rng() % outputs.size()];
      Arg* other = &c.args[rng() % c.args.size()];
      if (other == &out) other = &c.args[0] == &out ? &c.args[1] : &c.args[0];
      out.ptr = other->ptr;
      out.base = other->base;
      out.span = std::min(out.span, other->span);
      out.checked = false;
      break;
    }
    default:
      break;
  }
  return true;
}

bool on_device(const Arg& a) { return a.base != nullptr; }

// Poisons the outputs, zeroes the workspaces, and fills the inputs with this rank's data.
void prepare(const Case& c, Communicator& comm, uint64_t seed, cudaStream_t s) {
  for (const Arg& a : c.args) {
    if (!on_device(a)) continue;
    if (a.output && a.checked) cudaMemsetAsync(a.base, 0xFF, a.span, s);
  }
  for (std::size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (!on_device(a) || a.output) continue;
    if (a.zero) {
      cudaMemsetAsync(a.base, 0, a.span, s);
    } else if (a.name == "group_rows") {
      cudaMemcpyAsync(a.ptr, c.group_rows.data(), c.group_rows.size() * 4, cudaMemcpyHostToDevice,
                      s);
    } else {  // (only what lies in its arena memory: a range past the end stops there)
      const std::size_t bytes = std::min(a.bytes, a.span - (a.ptr - a.base));
      fill_random_bf16(a.ptr, static_cast<int64_t>(bytes / 2),
                       rank_seed(seed, comm.rank(), static_cast<int>(i)), s);
    }
  }
}

void call(const Case& c, Communicator& comm, cudaStream_t s) {
  const auto p = [&](int i) { return static_cast<void*>(c.args[i].ptr); };
  switch (c.op) {
    case Op::kGemm:
      gemm(p(0), p(1), p(2), c.m, c.n, c.k, c.layout, s, c.plain);
      break;
    case Op::kGroupedGemm:
      grouped_gemm(p(0), p(1), p(2), static_cast<const int32_t*>(p(3)), c.groups, c.m, c.n, c.k,
                   c.layout, s, c.plain,
                   c.masked ? GroupedLayout::kMasked : GroupedLayout::kContiguous);
      break;
    case Op::kAllGather:
      all_gather(comm, p(0), p(1), c.count, c.dtype, s, c.coll);
      break;
    case Op::kReduceScatter:
      reduce_scatter(comm, p(0), p(1), c.count, c.dtype, s, c.coll);
      break;
    case Op::kAllReduce:
      all_reduce(comm, p(0), p(1), c.count, c.dtype, s, c.coll);
      break;
    case Op::kAgGemm:
      ag_gemm(comm, p(0), p(1), p(2), c.m, c.n, c.k, c.layout, p(3), s, c.fused,
              c.gathered ? p(4) : nullptr);
      break;
    case Op::kGemmRs:
      gemm_rs(comm, p(0), p(1), p(2), c.m, c.n, c.k, c.layout, p(3), s, c.fused);
      break;
    case Op::kGemmAr:
      gemm_ar(comm, p(0), p(1), p(2), c.m, c.n, c.k, c.layout, p(3), s, c.fused);
      break;
  }
}

std::vector<unsigned char> download(const void* p, std::size_t bytes) {
  std::vector<unsigned char> h(bytes);
  cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost);
  return h;
}

// After a refusal: every output the call could have written still holds the poison.
void expect_poisoned(const Case& c) {
  for (const Arg& a : c.args) {
    if (!a.output || !a.checked || !on_device(a)) continue;
    const auto h = download(a.base, a.span);
    const auto bad = std::count_if(h.begin(), h.end(), [](unsigned char b) { return b != 0xFF; });
    EXPECT_EQ(bad, 0) << a.name << ": " << bad
                      << " bytes written by a call that was refused (or had nothing to do)";
  }
}

// Builds, in `dst`, what rank `src`'s input i holds (the fill of prepare()).
void fill_as(void* dst, std::size_t bytes, uint64_t seed, int src, int i, cudaStream_t s) {
  fill_random_bf16(dst, static_cast<int64_t>(bytes / 2), rank_seed(seed, src, i), s);
}

void expect_gemm_rows(const void* c, const void* a, const void* b, int64_t rows, int64_t n,
                      int64_t k, bool kn, void* c_blas, cublasHandle_t blas, uint64_t seed,
                      cudaStream_t s, const std::string& what) {
  cublas_gemm(blas, a, b, c_blas, rows, n, k, kn);
  const SampledErrors err = sampled_errors(c, c_blas, a, b, rows, n, k, kn, seed, s);
  EXPECT_LE(err.ours, 2 * err.cublas + 1e-6)
      << what << ": error " << err.ours << ", cuBLAS " << err.cublas;
  EXPECT_EQ(count_nans_bf16(c, rows * n, s), 0u) << what << ": elements unwritten (or NaN)";
}

// After a call that ran: its outputs against the references (scratch from the plain arena).
void expect_correct(const Case& c, Communicator& comm, Arenas& arenas, cublasHandle_t blas,
                    uint64_t seed, cudaStream_t s) {
  const int world = comm.world_size(), rank = comm.rank();
  const bool kn = c.layout == BLayout::kKN;
  const auto scratch = [&](std::size_t bytes) {
    char* p = arenas.take(false, bytes);
    EXPECT_NE(p, nullptr) << "the plain arena is too small for the references";
    return p;
  };
  const auto ptr = [&](int i) { return c.args[i].ptr; };
  const bool collective =
      c.op == Op::kAllGather || c.op == Op::kReduceScatter || c.op == Op::kAllReduce;
  if (collective && c.count == 0) {  // nothing to move: nothing written
    expect_poisoned(c);
    return;
  }
  switch (c.op) {
    case Op::kGemm:
      expect_gemm_rows(ptr(2), ptr(0), ptr(1), c.m, c.n, c.k, kn, scratch(c.m * c.n * 2), blas,
                       seed, s, "gemm");
      break;
    case Op::kGroupedGemm: {
      char* ref = scratch(c.m * c.n * 2);
      if (c.masked) {  // group g in rows [g m, g m + its clamped count)
        for (int g = 0; g < c.groups; ++g) {
          const int64_t rows = std::clamp<int64_t>(c.group_rows[g], 0, c.m);
          char* out_g = ptr(2) + g * c.m * c.n * 2;
          if (rows > 0) {
            expect_gemm_rows(out_g, ptr(0) + g * c.m * c.k * 2,
                             ptr(1) + static_cast<int64_t>(g) * c.n * c.k * 2, rows, c.n, c.k, kn,
                             ref, blas, seed + g, s,
                             "grouped_gemm (masked) group " + std::to_string(g));
          }
          const auto tail = download(out_g + rows * c.n * 2, (c.m - rows) * c.n * 2);
          EXPECT_TRUE(
              std::all_of(tail.begin(), tail.end(), [](unsigned char b) { return b == 0xFF; }))
              << "grouped_gemm (masked) wrote rows of group " << g << " past its count " << rows;
        }
        break;
      }
      int64_t row = 0;
      for (int g = 0; g < c.groups; ++g) {
        const int64_t rows = std::min<int64_t>(std::max(c.group_rows[g], 0), c.m - row);
        if (rows <= 0) continue;
        expect_gemm_rows(ptr(2) + row * c.n * 2, ptr(0) + row * c.k * 2,
                         ptr(1) + static_cast<int64_t>(g) * c.n * c.k * 2, rows, c.n, c.k, kn, ref,
                         blas, seed + g, s, "grouped_gemm group " + std::to_string(g));
        row += rows;
      }
      // Rows past the groups' total are not written.
      const auto tail = download(ptr(2) + row * c.n * 2, (c.m - row) * c.n * 2);
      EXPECT_TRUE(std::all_of(tail.begin(), tail.end(), [](unsigned char b) { return b == 0xFF; }))
          << "grouped_gemm wrote rows past the groups' total " << row;
      break;
    }
    case Op::kAllGather: {
      std::vector<unsigned char> want;
      char* img = scratch(c.args[0].bytes);
      for (int src = 0; src < world; ++src) {
        fill_as(img, c.args[0].bytes, seed, src, 0, s);
        cudaStreamSynchronize(s);
        const auto h = download(img, c.args[0].bytes);
        want.insert(want.end(), h.begin(), h.end());
      }
      EXPECT_EQ(download(ptr(1), want.size()), want) << "all_gather output";
      break;
    }
    case Op::kReduceScatter:
    case Op::kAllReduce: {
      std::vector<std::vector<unsigned char>> inputs;
      char* img = scratch(c.args[0].bytes);
      for (int src = 0; src < world; ++src) {
        fill_as(img, c.args[0].bytes, seed, src, 0, s);
        cudaStreamSynchronize(s);
        inputs.push_back(download(img, c.args[0].bytes));
      }
      const std::size_t es = c.dtype == DType::kF32 ? 4 : 2;
      const auto got = download(ptr(1), c.count * es);
      std::size_t first = 0;
      const std::size_t offset = c.op == Op::kReduceScatter ? rank * c.count : 0;
      EXPECT_EQ(count_bad_sums(got, inputs, offset, c.count, c.dtype, &first), 0u)
          << op_name(c.op) << ": first bad element " << first;
      break;
    }
    case Op::kAgGemm: {
      const int64_t shard = c.m / world;
      const std::size_t shard_bytes = shard * c.k * 2;
      char* a_full = scratch(c.m * c.k * 2);
      for (int src = 0; src < world; ++src) {
        fill_as(a_full + src * shard_bytes, c.args[0].bytes, seed, src, 0, s);
      }
      expect_gemm_rows(ptr(2), a_full, ptr(1), c.m, c.n, c.k, kn, scratch(c.m * c.n * 2), blas,
                       seed, s, "ag_gemm");
      if (c.gathered && ptr(4) != nullptr) {  // (a null gathered_a is no output)
        EXPECT_EQ(count_different_bytes16(ptr(4), a_full, c.m * c.k * 2, s), 0u)
            << "ag_gemm gathered_a";
      }
      break;
    }
    case Op::kGemmRs:
    case Op::kGemmAr: {
      // The sum over ranks is the product of the operands concatenated along K.
      const int64_t kk = c.k * world;
      char* a_cat = scratch(c.m * kk * 2);
      char* b_cat = scratch(c.n * kk * 2);
      char* img = scratch(std::max(c.args[0].bytes, c.args[1].bytes));
      for (int src = 0; src < world; ++src) {
        fill_as(img, c.args[0].bytes, seed, src, 0, s);
        cudaMemcpy2DAsync(a_cat + src * c.k * 2, kk * 2, img, c.k * 2, c.k * 2, c.m,
                          cudaMemcpyDefault, s);
        fill_as(img, c.args[1].bytes, seed, src, 1, s);
        if (kn) {
          cudaMemcpyAsync(b_cat + src * c.k * c.n * 2, img, c.k * c.n * 2, cudaMemcpyDefault, s);
        } else {
          cudaMemcpy2DAsync(b_cat + src * c.k * 2, kk * 2, img, c.k * 2, c.k * 2, c.n,
                            cudaMemcpyDefault, s);
        }
      }
      const int64_t first = c.op == Op::kGemmRs ? rank * (c.m / world) : 0;
      const int64_t rows = c.op == Op::kGemmRs ? c.m / world : c.m;
      expect_gemm_rows(ptr(2), a_cat + first * kk * 2, b_cat, rows, c.n, kk, kn,
                       scratch(rows * c.n * 2), blas, seed, s, op_name(c.op));
      break;
    }
  }
  cudaStreamSynchronize(s);
}

void expect_refusal_named(const Case& c, const Error& e) {
  const std::string what = e.what();
  EXPECT_TRUE(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kOutOfMemory ||
              e.code() == ErrorCode::kUnsupported)
      << what;
  const std::string prefix = std::string(to_string(e.code())) + ": " + op_name(c.op) + ": ";
  EXPECT_EQ(what.rfind(prefix, 0), 0u) << "not named by its op: " << what;
  EXPECT_TRUE(std::any_of(std::begin(kArgumentWords), std::end(kArgumentWords),
                          [&](const char* w) { return has_word(what, w); }))
      << "names no argument: " << what;
}

struct Tally {
  int ran = 0, refused = 0, skipped = 0;
};

void fuzz(Communicator& comm, int cases, Tally* tally) {
  const uint64_t seed = shared_seed(comm);
  std::mt19937_64 rng(seed);
  Arenas arenas(comm);
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, s);
  cudaDeviceSynchronize();
  for (int i = 0; i < cases; ++i) {
    Case c = random_case(rng, comm);
    if (!place(c, arenas, rng, comm)) {
      ++tally->skipped;
      continue;
    }
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.describe() + ", rank " +
                 std::to_string(comm.rank()));
    prepare(c, comm, seed + i, s);
    ready(comm, s);
    bool refused = false;
    try {
      call(c, comm, s);
    } catch (const Error& e) {
      refused = true;
      expect_refusal_named(c, e);
    }
    // Every rank decides alike (a lone launch would wait for the others until the time limit).
    const int mine = refused;
    std::vector<int> all(comm.world_size());
    comm.bootstrap().allgather(&mine, all.data(), sizeof(int));
    for (int r = 0; r < comm.world_size(); ++r) {
      ASSERT_EQ(all[r], mine) << "rank " << r << (all[r] ? " refused" : " ran") << " the call";
    }
    if (refused) {
      ++tally->refused;
      expect_poisoned(c);
    } else {
      ++tally->ran;
      finished(comm, s);
      expect_correct(c, comm, arenas, blas, seed + i, s);
    }
    comm.bootstrap().barrier();
  }
  cublasDestroy(blas);
  cudaStreamDestroy(s);
}

class EntryPoints : public ::testing::TestWithParam<int> {};

TEST_P(EntryPoints, RandomArgumentsRunCorrectlyOrAreRefusedBeforeLaunch) {
  MKT_REQUIRE_GPU();
  const int world = GetParam();
  const int cases = world == 2 ? 240 : 100;
  std::vector<Tally> tallies(world);
  CommOptions options;
  options.timeout_seconds = 20;
  run_in_process(
      world, [&](Communicator& comm) { fuzz(comm, cases, &tallies[comm.rank()]); }, options);
  std::printf(
      "[entry points] world %d: %d cases, %d ran and matched, %d refused before launch, "
      "%d did not fit the arenas\n",
      world, cases, tallies[0].ran, tallies[0].refused, tallies[0].skipped);
}

INSTANTIATE_TEST_SUITE_P(World, EntryPoints, ::testing::Values(2, 4),
                         [](const auto& info) { return "World" + std::to_string(info.param); });

}  // namespace
}  // namespace mk::test
