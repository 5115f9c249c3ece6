// Where does ring attention's time over the engine go at world 1? (issue 32; ring_bisect.cuh has
// the variants.) One GPU, one rank: the plain engine (PlainAttention), the ring kernel as the
// library builds it (RingAttention at world 1), and the ring with one piece of its policy at a
// time replaced by the engine's - each piece computes the same thing at world 1 - then with all
// of them, and with all but one. Every variant's O is checked: each element within 4 bf16 steps
// of the engine's, and bit for bit the ring's where the variant visits the ring's blocks in the
// ring's order (all but engine_blocks on causal problems). Times are medians over rounds in
// which the variants alternate, CUDA events around `iters` launches, kernels only (the library's
// ring call also zeroes its counters first).
//   bench_ring_bisect [--seq 4096,8192] [--batches 1x32x8,4x16x16] [--causal 0,1] [--sms N]
//                     [--iters 10] [--rounds 7]
// (--batches: B x H x H_kv; D is 128, the issue's; --sms: CTAs of every launch, default every SM.)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "attention/attention_internal.h"
#include "bench_check.h"
#include "bench_inprocess.h"
#include "bench_kernels.h"
#include "mkernel/mkernel.h"
#include "ring_bisect.cuh"

namespace mk::bench::ring_bisect {

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

namespace {

constexpr int kHeadDim = 128;

// 16-byte vectors where a and b differ.
unsigned long long count_diff(const void* a, const void* b, int64_t n, unsigned long long* scratch,
                              cudaStream_t stream) {
  CK(cudaMemsetAsync(scratch, 0, sizeof(unsigned long long), stream));
  mk::bench::launch_count_diff(a, b, static_cast<std::size_t>(n * 2 / 16), scratch, stream);
  unsigned long long diffs = 0;
  CK(cudaMemcpyAsync(&diffs, scratch, sizeof(diffs), cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  return diffs;
}

struct Point {
  int64_t batch, heads, kv_heads, seq;
  bool causal;
};

std::string name_of(int bits) {
  if (bits == kEngine) return "engine";
  if (bits == kOneRoundRing) return "ring, one-round kernel";
  if (bits == 0) return "ring";
  static const char* names[] = {"engine_regs", "engine_order", "one_step",
                                "closed_walk", "engine_mask",  "no_carry",
                                "no_side",     "maps_4d",      "engine_blocks"};
  // Most of the pieces: named by what is left out.
  const int pieces = kAllBits & ~kEngineRegs;
  const bool most = __builtin_popcount(bits & pieces) >= 4;
  std::string s = most ? "all" : "";
  for (int b = 0; b < 9; ++b) {
    const bool in = (bits & (1 << b)) != 0;
    if (most && b > 0 && !in) s += std::string(" but ") + names[b];
    if (!most && in) s += (s.empty() ? "" : "+") + std::string(names[b]);
  }
  if (most && (bits & kEngineRegs) != 0) s += " +engine_regs";
  return s;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t end = std::min(s.find(sep, at), s.size());
    if (end > at) out.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

// The ring policy's fields at world 1 (as ring_attention.cu fills them: one round, one step, the
// slots unused) and the engine's, over the same tensors.
Setup setup_of(const Point& p, const DeviceComm& dc, uint8_t* const* peers, const void* q,
               const void* k, const void* v, void* o, int sms) {
  using attention_host::make_map;
  using attention_host::make_map_parts;
  const attention_host::Strides sq{p.seq * p.heads * kHeadDim, p.heads * kHeadDim, kHeadDim};
  const attention_host::Strides sk{p.seq * p.kv_heads * kHeadDim, p.kv_heads * kHeadDim, kHeadDim};
  const int parts = p.causal ? 2 : 1;
  const int64_t part_len = p.seq / parts;
  const int64_t tiles_per_part = (part_len + 127) / 128;
  const int64_t items = p.batch * p.heads * parts * tiles_per_part;
  Setup s{};
  auto& r = s.ring;
  r.comm = dc;
  r.q = make_map_parts(q, sq, p.batch, parts, part_len, p.heads, kHeadDim, 128);
  r.o = make_map_parts(o, sq, p.batch, parts, part_len, p.heads, kHeadDim, 64);
  r.k_local = make_map_parts(k, sk, p.batch, parts, part_len, p.kv_heads, kHeadDim, 128);
  r.v_local = make_map_parts(v, sk, p.batch, parts, part_len, p.kv_heads, kHeadDim, 128);
  for (int i = 0; i < attention_engine::kRingSlots; ++i) {  // (unused at world 1)
    r.k_slot[i] = r.k_local;
    r.v_slot[i] = r.v_local;
  }
  r.lse = nullptr;
  r.peers = peers;
  r.offset = 0;
  r.slots = r.state_o = r.state_ml = r.counters = 0;  // only the done counters are written
  r.k_src = static_cast<const __nv_bfloat16*>(k);
  r.v_src = static_cast<const __nv_bfloat16*>(v);
  r.kv_stride_batch = sk.batch;
  r.kv_stride_seq = sk.seq;
  r.kv_stride_head = sk.head;
  r.chunk_vectors = p.batch * p.seq * p.kv_heads * kHeadDim / 8;
  r.unit_vectors = static_cast<int>(p.seq * kHeadDim / 8);
  r.units = static_cast<int>(p.batch * p.kv_heads);
  r.batch = static_cast<int>(p.batch);
  r.heads = static_cast<int>(p.heads);
  r.kv_heads = static_cast<int>(p.kv_heads);
  r.group = static_cast<int>(p.heads / p.kv_heads);
  r.seq_local = static_cast<int>(p.seq);
  r.parts = parts;
  r.part_len = static_cast<int>(part_len);
  r.tiles_per_part = static_cast<int>(tiles_per_part);
  r.blocks_per_part = static_cast<int>((part_len + 127) / 128);
  r.items = static_cast<int>(items);
  r.rounds = attention_engine::ring_rounds(1);
  r.causal = p.causal;
  r.world = 1;
  r.carry_first = r.carry_last = false;
  s.q4 = make_map(q, sq, p.batch, p.seq, p.heads, kHeadDim, 128);
  s.k4 = make_map(k, sk, p.batch, p.seq, p.kv_heads, kHeadDim, 128);
  s.v4 = make_map(v, sk, p.batch, p.seq, p.kv_heads, kHeadDim, 128);
  s.o4 = make_map(o, sq, p.batch, p.seq, p.heads, kHeadDim, 64);
  auto& e = s.plain;
  e.q = s.q4;
  e.k = s.k4;
  e.v = s.v4;
  e.o = s.o4;
  e.lse = nullptr;
  e.heads = static_cast<int>(p.heads);
  e.group = static_cast<int>(p.heads / p.kv_heads);
  e.seq_q = e.seq_kv = static_cast<int>(p.seq);
  e.m_tiles = static_cast<int>((p.seq + 127) / 128);
  e.kv_blocks = e.m_tiles;
  e.items = static_cast<int>(p.batch * p.heads * e.m_tiles);
  e.causal = p.causal;
  AttentionProblem ap;
  ap.batch = p.batch;
  ap.seq_q = ap.seq_kv = p.seq;
  ap.heads = p.heads;
  ap.kv_heads = p.kv_heads;
  ap.head_dim = kHeadDim;
  ap.causal = p.causal;
  s.scale_log2 = attention_host::scale_log2(ap);
  s.ctas = static_cast<int>(std::min<int64_t>(sms, items));
  return s;
}

}  // namespace
}  // namespace mk::bench::ring_bisect

int main(int argc, char** argv) {
  using namespace mk;
  using namespace mk::bench::ring_bisect;
  std::vector<int64_t> seqs = {4096, 8192};
  std::vector<std::array<int64_t, 3>> batches = {{1, 32, 8}, {4, 16, 16}};
  std::vector<int> causals = {0, 1};
  int sms = 0, iters = 10, rounds = 7;
  const auto usage = [&] {
    std::fprintf(stderr,
                 "usage: %s [--seq 4096,8192] [--batches 1x32x8,4x16x16] [--causal 0,1] "
                 "[--sms N] [--iters 10] [--rounds 7]\n",
                 argv[0]);
    return 2;
  };
  try {
    for (int i = 1; i < argc; i += 2) {
      const std::string key = argv[i];
      if (i + 1 >= argc) return usage();
      const std::string value = argv[i + 1];
      if (key == "--seq") {
        seqs.clear();
        for (const auto& v : split(value, ',')) seqs.push_back(std::stoll(v));
      } else if (key == "--batches") {
        batches.clear();
        for (const auto& v : split(value, ',')) {
          const auto f = split(v, 'x');
          if (f.size() != 3) return usage();
          batches.push_back({std::stoll(f[0]), std::stoll(f[1]), std::stoll(f[2])});
        }
      } else if (key == "--causal") {
        causals.clear();
        for (const auto& v : split(value, ',')) causals.push_back(std::stoi(v));
      } else if (key == "--sms") {
        sms = std::stoi(value);
      } else if (key == "--iters") {
        iters = std::stoi(value);
      } else if (key == "--rounds") {
        rounds = std::stoi(value);
      } else {
        return usage();
      }
    }
  } catch (const std::exception&) {
    return usage();
  }
  if (iters < 1 || rounds < 1 || sms < 0) return usage();
  for (const auto& b : batches) {
    if (b[0] < 1 || b[1] < 1 || b[2] < 1 || b[1] % b[2] != 0) {
      std::fprintf(stderr, "%s: --batches: B, H, H_kv >= 1 and H a multiple of H_kv\n", argv[0]);
      return 2;
    }
  }
  for (const int64_t seq : seqs) {
    if (seq < 256 || seq % 256 != 0) {
      std::fprintf(stderr, "%s: --seq: multiples of 256 (a zigzag half of whole blocks)\n",
                   argv[0]);
      return 2;
    }
  }
  auto& entries = registry();
  // The engine, the ring, then the rest by their bits.
  const auto order = [](int bits) {
    return bits == kEngine ? -3 : bits == 0 ? -2 : bits == kOneRoundRing ? -1 : bits;
  };
  std::sort(entries.begin(), entries.end(),
            [&](const Entry& a, const Entry& b) { return order(a.bits) < order(b.bits); });
  if (entries.size() < 2 || entries[0].bits != kEngine || entries[1].bits != 0) {
    std::fprintf(stderr, "%s: the engine's and the ring's variants are not linked in\n", argv[0]);
    return 2;
  }
  CK(cudaSetDevice(0));
  if (sms == 0) CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  InProcessGroup group(1);
  auto comm = Communicator::create(group.bootstrap(0));
  const DeviceComm dc = comm->device_comm();
  uint8_t** peers = nullptr;  // the one rank's workspace: the done counters step_done adds to
  unsigned long long* scratch = nullptr;
  CK(cudaMalloc(&peers, sizeof(uint8_t*)));
  CK(cudaMalloc(&scratch, sizeof(unsigned long long)));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const uint64_t seed = mk::bench::bench_seed();
  std::printf("ring_bisect: world 1, D %d, %d CTAs at most, %d rounds of %d launches, seed %llu\n",
              kHeadDim, sms, rounds, iters, static_cast<unsigned long long>(seed));
  bool all_correct = true;
  for (const auto& b : batches) {
    for (const int64_t seq : seqs) {
      for (const int causal : causals) {
        const Point p{b[0], b[1], b[2], seq, causal != 0};
        const int64_t q_n = p.batch * p.seq * p.heads * kHeadDim;
        const int64_t kv_n = p.batch * p.seq * p.kv_heads * kHeadDim;
        void *q, *k, *v, *o, *o_engine, *o_ring;
        uint8_t* counters;  // arrive[kRingSlots][units], done[1]
        const std::size_t counters_bytes =
            (attention_engine::kRingSlots * p.batch * p.kv_heads + 1) * 8;
        CK(cudaMalloc(&q, q_n * 2));
        CK(cudaMalloc(&k, kv_n * 2));
        CK(cudaMalloc(&v, kv_n * 2));
        CK(cudaMalloc(&o, q_n * 2));
        CK(cudaMalloc(&o_engine, q_n * 2));
        CK(cudaMalloc(&o_ring, q_n * 2));
        CK(cudaMalloc(&counters, counters_bytes));
        CK(cudaMemset(counters, 0, counters_bytes));
        CK(cudaMemcpy(peers, &counters, sizeof(uint8_t*), cudaMemcpyHostToDevice));
        mk::bench::launch_fill(q, q_n, seed, 0, stream);
        mk::bench::launch_fill(k, kv_n, seed, 1, stream);
        mk::bench::launch_fill(v, kv_n, seed, 2, stream);
        const Setup s = setup_of(p, dc, peers, q, k, v, o, sms);
        entries[0].launch(setup_of(p, dc, peers, q, k, v, o_engine, sms), stream);
        entries[1].launch(setup_of(p, dc, peers, q, k, v, o_ring, sms), stream);
        CK(cudaStreamSynchronize(stream));
        CK(cudaGetLastError());
        // Every variant within 4 bf16 steps of the engine's O at each element; those that visit
        // the ring's blocks in the ring's order (all but engine_blocks on a causal problem) bit
        // for bit the ring's.
        std::vector<unsigned long long> far(entries.size()), diff(entries.size());
        std::vector<bool> ok(entries.size());
        for (std::size_t i = 0; i < entries.size(); ++i) {
          CK(cudaMemsetAsync(o, 0xff, q_n * 2, stream));  // NaNs where nothing is written
          entries[i].launch(s, stream);
          CK(cudaStreamSynchronize(stream));
          CK(cudaGetLastError());
          far[i] = mk::bench::count_far(o, o_engine, q_n, stream);
          diff[i] = count_diff(o, o_ring, q_n, scratch, stream);
          const int bits = entries[i].bits;
          const bool ring_order =
              bits == kOneRoundRing || (bits >= 0 && !(p.causal && (bits & kEngineBlocks) != 0));
          ok[i] = far[i] == 0 && (!ring_order || diff[i] == 0);
          all_correct = all_correct && ok[i];
        }
        std::vector<std::vector<double>> ms(entries.size());
        for (int round = 0; round < rounds; ++round) {
          for (std::size_t i = 0; i < entries.size(); ++i) {
            entries[i].launch(s, stream);  // warm
            CK(cudaEventRecord(e0, stream));
            for (int it = 0; it < iters; ++it) entries[i].launch(s, stream);
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            float t = 0;
            CK(cudaEventElapsedTime(&t, e0, e1));
            ms[i].push_back(t / iters);
          }
        }
        CK(cudaGetLastError());
        std::printf("\nB%lld H%lld/%lld S%lld D%d %s, %d CTAs:\n", static_cast<long long>(p.batch),
                    static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
                    static_cast<long long>(p.seq), kHeadDim, p.causal ? "causal" : "non-causal",
                    s.ctas);
        const double engine = mk::bench::median(ms[0]), ring = mk::bench::median(ms[1]);
        std::printf("  %-46s %9s %8s %8s %10s %10s\n", "variant", "ms", "/engine", "/ring",
                    "far (eng)", "diff (ring)");
        for (std::size_t i = 0; i < entries.size(); ++i) {
          const double t = mk::bench::median(ms[i]);
          std::printf("  %-46s %9.4f %8.4f %8.4f %10llu %10llu%s\n",
                      name_of(entries[i].bits).c_str(), t, t / engine, t / ring, far[i], diff[i],
                      ok[i] ? "" : "  WRONG");
        }
        for (void* ptr : {q, k, v, o, o_engine, o_ring}) CK(cudaFree(ptr));
        CK(cudaFree(counters));
      }
    }
  }
  std::printf("\nring_bisect: %s\n", all_correct ? "every variant's O is right"
                                                 : "WRONG: some variant's O differs (rows marked)");
  return all_correct ? 0 : 1;
}
