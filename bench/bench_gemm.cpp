// The GEMM engine against cuBLAS, one GPU:
//   bench_gemm [--json FILE] [--iters 20] [--check] [--sweep] [--shapes MxNxK,...] [--layouts
//   nk,kn] [--splits 1,2,4,...]
// By default issue 28's sweep (M 1..8192 on six model-like (N, K)), both B layouts. Same random
// inputs for both; times are per call, medians over replays of CUDA graphs of 10 calls (the
// GPU's time, without the host's launch cost), the calls alternating between two input sets (so
// operands do not stay in L2 from one call to the next for the smaller shapes). Correct = |mkernel
// - cuBLAS| <= 2 bf16 ulps of the largest output (the exact fp64 check lives in
// tests/gpu/test_gemm.cpp).
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_kernels.h"
#include "graph_nodes.h"
#include "mkernel/gemm.h"

namespace {

// (bench_check.h's, for cuBLAS statuses as well as CUDA errors.)
#undef CK
#define CK(x)                                                                               \
  do {                                                                                      \
    auto e_ = (x);                                                                          \
    if (e_ != decltype(e_){}) {                                                             \
      std::fprintf(stderr, "%s failed (%d) at %s:%d\n", #x, static_cast<int>(e_), __FILE__, \
                   __LINE__);                                                               \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

struct Shape {
  int64_t m, n, k;
};

// Each op's time: medians over `iters` replays of a CUDA graph of kCalls calls (alternating
// the two input sets), per call. Graphs take the host out: this host needs 3-5 us to launch a
// kernel, as long as the smallest GEMMs run, so an eagerly launched op would time the host
// (bench_launch and bench_host.py time that side). The ops' replays run interleaved
// (a b c a b c ...), so that clock and temperature drift during the run hits them alike.
constexpr int kCalls = 10;

// The widths between the multiples of 64 that B [K, N] takes too (gemm_internal.h's
// kKnStepWidths: not 80 or 112).
constexpr bool kn_step_width(int width) { return width % 64 != 0 && width != 80 && width != 112; }
std::vector<double> median_ms(int iters, cudaStream_t s,
                              const std::vector<std::function<void(int)>>& ops) {
  const std::size_t n = ops.size();
  std::vector<cudaGraphExec_t> graphs(n);
  for (std::size_t o = 0; o < n; ++o) {
    ops[o](0);  // first-call setup (kernel attributes) outside the capture
    CK(cudaStreamSynchronize(s));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kCalls; ++i) ops[o](i);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&graphs[o], g, 0));
    CK(cudaGraphDestroy(g));
  }
  for (int i = 0; i < 2; ++i)
    for (auto& g : graphs) CK(cudaGraphLaunch(g, s));
  CK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * iters * n);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    for (std::size_t o = 0; o < n; ++o) {
      CK(cudaEventRecord(ev[2 * (i * n + o)], s));
      CK(cudaGraphLaunch(graphs[o], s));
      CK(cudaEventRecord(ev[2 * (i * n + o) + 1], s));
    }
  }
  CK(cudaStreamSynchronize(s));
  std::vector<double> medians;
  for (std::size_t o = 0; o < n; ++o) {
    std::vector<float> t(iters);
    for (int i = 0; i < iters; ++i) {
      CK(cudaEventElapsedTime(&t[i], ev[2 * (i * n + o)], ev[2 * (i * n + o) + 1]));
    }
    std::sort(t.begin(), t.end());
    medians.push_back(t[iters / 2] / kCalls);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  for (auto& g : graphs) cudaGraphExecDestroy(g);
  return medians;
}

// The names of the kernels one call of `op` launches (the kernel nodes of a CUDA graph of the
// call), joined by " + ": which kernel cuBLAS picks for a shape - its name carries the tile, the
// cluster and any split or stream-K, and it is the kernel timed beside ours. "?" where the driver
// cannot name one (cuFuncGetName / cuKernelGetName: CUDA 12.3).
std::string kernel_names(cudaStream_t s, const std::function<void(int)>& op) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  op(0);
  CK(cudaStreamEndCapture(s, &g));
  std::string names;
  for (cudaGraphNode_t node : mk::bench::nodes_in_order(g)) {
    cudaGraphNodeType type{};
    CK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    names += (names.empty() ? "" : " + ") + mk::bench::node_name(node);
  }
  CK(cudaGraphDestroy(g));
  // (For the JSON: kernel names hold no quote or backslash, but nothing relies on it.)
  for (char& ch : names) {
    if (ch == '"' || ch == '\\') ch = '_';
  }
  return names.empty() ? "?" : names;
}

std::vector<Shape> parse_shapes(const std::string& text) {
  std::vector<Shape> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    Shape s{};
    if (std::sscanf(text.substr(pos, end - pos).c_str(), "%ldx%ldx%ld", &s.m, &s.n, &s.k) != 3) {
      std::fprintf(stderr, "bad shape '%s' (expected MxNxK)\n",
                   text.substr(pos, end - pos).c_str());
      std::exit(2);
    }
    out.push_back(s);
    pos = end + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  int iters = 20;
  bool check_only = false;
  bool sweep = false;
  bool candidates = false;  // --candidates: every distinct plan, measured beside the model
  std::vector<int> splits;  // --splits: the plan's width in each of these pieces of K
  mk::GemmConfig base;      // --block-m: every op's tile height (0: the library's choice)
  // The default sweep (issue 28): decode, gemm_ar's and MoE's M up to large M, on model-like N
  // and K (Llama-70B's projections, DeepSeek-V3's expert shapes, a square one).
  std::vector<Shape> shapes;
  for (const auto [n, k] : {std::pair<int64_t, int64_t>{8192, 8192},
                            {14336, 4096},
                            {4096, 14336},
                            {7168, 2048},
                            {2048, 7168},
                            {28672, 8192}}) {
    for (int64_t m :
         {1, 8, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 8192}) {
      shapes.push_back({m, n, k});
    }
  }
  std::vector<bool> layouts = {false, true};  // B [N, K], then B [K, N]
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--check")
      check_only = true;
    else if (a == "--sweep")
      sweep = true;
    else if (a == "--candidates")
      candidates = true;
    else if (a == "--block-m" && i + 1 < argc)
      base.block_m = std::atoi(argv[++i]);
    else if (a == "--splits" && i + 1 < argc) {
      const std::string v = argv[++i];
      for (std::size_t p = 0; p < v.size();) {
        splits.push_back(std::atoi(v.c_str() + p));
        p = v.find(',', p);
        p = p == std::string::npos ? v.size() : p + 1;
      }
    } else if (a == "--shapes" && i + 1 < argc)
      shapes = parse_shapes(argv[++i]);
    else if (a == "--layouts" && i + 1 < argc) {
      const std::string v = argv[++i];
      layouts.clear();
      if (v.find("nk") != std::string::npos) layouts.push_back(false);
      if (v.find("kn") != std::string::npos) layouts.push_back(true);
      if (layouts.empty()) {
        std::fprintf(stderr, "bad --layouts '%s' (expected nk, kn or nk,kn)\n", v.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json FILE] [--iters N] [--check] [--sweep] [--shapes MxNxK,...] "
                   "[--layouts nk,kn] [--splits 1,2,4,...] [--block-m 64|128|192] [--candidates]\n"
                   "  --sweep: also time every tile width (64, 128, 192, 256; at 128 rows also\n"
                   "  80, 96, 112, 144, 160, 224 - B [K, N] not 80, 112) per shape (K whole\n"
                   "  where the plan does not split it), and the plan's width with K whole\n"
                   "  --splits: also time the plan's width with the last wave in each of these\n"
                   "  numbers of pieces of K (1: K whole)\n"
                   "  --block-m: the tile height of every op timed (default: the plan's)\n"
                   "  --candidates: also time every distinct plan gemm_plan makes for the shape\n"
                   "  (heights, widths - the step widths K whole -, 1-8 pieces), each with the\n"
                   "  plan model's estimate: the data to refit src/gemm/plan.cpp against\n",
                   argv[0]);
      return 2;
    }
  }
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h;
  CK(cublasCreate(&h));
  CK(cublasSetStream(h, s));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  unsigned int* d_stat;
  CK(cudaMalloc(reinterpret_cast<void**>(&d_stat), 2 * sizeof(unsigned int)));
  std::ostringstream rows;
  bool all_correct = true;
  double log_ratio_sum = 0, worst_ratio = 1e9;
  std::printf("%-22s %10s %10s %9s %9s %7s  %s\n", "shape (MxNxK)", "mkernel ms", "cuBLAS ms",
              "TFLOP/s", "cuBLAS", "ratio", "check");
  int cases = 0;
  for (const Shape& sh : shapes) {
    for (const bool kn : layouts) {
      ++cases;
      const mk::BLayout layout = kn ? mk::BLayout::kKN : mk::BLayout::kNK;
      void *a[2], *b[2], *c, *c_blas;
      for (int i = 0; i < 2; ++i) {
        CK(cudaMalloc(&a[i], sh.m * sh.k * 2));
        CK(cudaMalloc(&b[i], sh.n * sh.k * 2));
        mk::bench::launch_fill(a[i], sh.m * sh.k, 17 + i, 0, s);
        mk::bench::launch_fill(b[i], sh.n * sh.k, 29 + i, 1, s);
      }
      CK(cudaMalloc(&c, sh.m * sh.n * 2));
      CK(cudaMalloc(&c_blas, sh.m * sh.n * 2));
      const float one = 1.f, zero = 0.f;
      auto ours = [&](int i) {
        mk::gemm(a[i & 1], b[i & 1], c, sh.m, sh.n, sh.k, layout, s, base);
      };
      auto theirs = [&](int i) {  // column-major C^T = op(B) A^T
        CK(cublasGemmEx(h, kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, sh.n, sh.m, sh.k, &one,
                        b[i & 1], CUDA_R_16BF, kn ? sh.n : sh.k, a[i & 1], CUDA_R_16BF, sh.k, &zero,
                        c_blas, CUDA_R_16BF, sh.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      ours(0);
      theirs(0);
      CK(cudaMemsetAsync(d_stat, 0, 2 * sizeof(unsigned int), s));
      mk::bench::launch_max_diff_bf16(c, c_blas, sh.m * sh.n, d_stat, s);
      unsigned int stat[2];
      CK(cudaMemcpyAsync(stat, d_stat, sizeof(stat), cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      float diff, mag;
      std::memcpy(&diff, &stat[0], 4);
      std::memcpy(&mag, &stat[1], 4);
      const bool correct = diff <= 2 * mag / 128.f;  // 2 bf16 ulps of the largest value
      all_correct = all_correct && correct;
      const std::string label = std::to_string(sh.m) + "x" + std::to_string(sh.n) + "x" +
                                std::to_string(sh.k) + (kn ? " kn" : "");
      if (check_only) {
        std::printf("%-22s max |mkernel - cuBLAS| %.4g (max |C| %.4g)  %s\n", label.c_str(), diff,
                    mag, correct ? "ok" : "WRONG");
      } else {
        const std::vector<double> both = median_ms(iters, s, {ours, theirs});
        const double ms = both[0], ms_blas = both[1];
        const double flops = 2.0 * sh.m * sh.n * sh.k;
        const double ratio = ms_blas / ms;  // TFLOP/s relative to cuBLAS
        log_ratio_sum += std::log(ratio);
        worst_ratio = std::min(worst_ratio, ratio);
        std::printf("%-22s %10.3f %10.3f %9.1f %9.1f %7.3f  %s\n", label.c_str(), ms, ms_blas,
                    flops / ms * 1e-9, flops / ms_blas * 1e-9, ratio, correct ? "ok" : "WRONG");
        const std::string blas_kernel = kernel_names(s, theirs);
        std::printf("  cuBLAS %-15s %s\n", label.c_str(), blas_kernel.c_str());
        rows << (rows.tellp() > 0 ? ",\n" : "") << "    {\"shape\": {\"M\": " << sh.m
             << ", \"N\": " << sh.n << ", \"K\": " << sh.k << "}, \"b_layout\": \""
             << (kn ? "kn" : "nk") << "\", \"plan\": \""
             << mk::gemm_plan(sh.m, sh.n, sh.k, base, layout).describe()
             << "\", \"dtype\": \"bf16\", \"ms\": {\"mkernel\": " << ms
             << ", \"gemm_alone\": " << ms_blas << "}, \"limit_ms\": " << ms_blas
             << ", \"ratio_to_limit\": " << ms / ms_blas << ", \"tflops\": " << flops / ms * 1e-9
             << ", \"tflops_cublas\": " << flops / ms_blas * 1e-9 << ", \"cublas_kernel\": \""
             << blas_kernel << "\""
             << ", \"correct\": " << (correct ? "true" : "false") << "}";
      }
      if (sweep && !check_only) {
        std::vector<std::function<void(int)>> widths;
        std::vector<int> w;  // the widths of the height timed
        // The step widths (between the multiples of 64): 128-row tiles only (B [K, N]: not 80, 112)
        // - timed where the four widths run at 128 rows too.
        const bool steps = mk::gemm_plan(sh.m, sh.n, sh.k, base, layout).block_m == 128;
        for (int width : {64, 80, 96, 112, 128, 144, 160, 192, 224, 256}) {
          if (base.block_m == 192 && width > 128) continue;
          if (width % 64 != 0 && (!steps || (kn && !kn_step_width(width)))) continue;
          w.push_back(width);
          widths.push_back([&, width](int i) {
            mk::GemmConfig config = base;
            config.block_n = width;
            mk::gemm(a[i & 1], b[i & 1], c, sh.m, sh.n, sh.k, layout, s, config);
          });
        }
        // The plan's width with K whole: what its split of the last wave buys.
        const mk::GemmPlan plan = mk::gemm_plan(sh.m, sh.n, sh.k, base, layout);
        widths.push_back([&](int i) {
          mk::GemmConfig config = base;
          config.block_n = plan.block_n;
          config.split_k = 1;
          mk::gemm(a[i & 1], b[i & 1], c, sh.m, sh.n, sh.k, layout, s, config);
        });
        widths.push_back(theirs);
        const std::vector<double> t = median_ms(iters, s, widths);
        std::printf("  sweep %-14s", label.c_str());
        for (std::size_t i = 0; i < w.size(); ++i) std::printf("  n%d %.3f", w[i], t[i]);
        std::printf("  cuBLAS %.3f ms\n", t.back());
        std::printf("  plan  %-14s  %s; n%d with K whole %.3f ms\n", label.c_str(),
                    plan.describe().c_str(), plan.block_n, t[w.size()]);
      }
      const int plan_width = mk::gemm_plan(sh.m, sh.n, sh.k, base, layout).block_n;
      if (!splits.empty() && !check_only && plan_width % 64 != 0) {
        std::printf("  splits %-13s the plan's width %d keeps K whole: no splits timed\n",
                    label.c_str(), plan_width);
      }
      if (!splits.empty() && !check_only && plan_width % 64 == 0) {
        const mk::GemmPlan plan = mk::gemm_plan(sh.m, sh.n, sh.k, base, layout);
        std::vector<mk::GemmConfig> configs(splits.size(), base);
        std::vector<std::function<void(int)>> ops;
        for (std::size_t i = 0; i < splits.size(); ++i) {
          configs[i].block_n = plan.block_n;
          configs[i].split_k = splits[i];
          ops.push_back([&, i](int j) {
            mk::gemm(a[j & 1], b[j & 1], c, sh.m, sh.n, sh.k, layout, s, configs[i]);
          });
        }
        ops.push_back(theirs);
        const std::vector<double> t = median_ms(iters, s, ops);
        std::printf("  splits %-13s %dx%d:", label.c_str(), plan.block_m, plan.block_n);
        for (std::size_t i = 0; i < splits.size(); ++i) {  // asked: pieces/CTAs it got, ms
          const mk::GemmPlan got = mk::gemm_plan(sh.m, sh.n, sh.k, configs[i], layout);
          std::printf("  %d:%d/%d %.4f", splits[i], got.split_k, got.ctas, t[i]);
        }
        std::printf("  cuBLAS %.4f ms\n", t.back());
      }
      if (candidates && !check_only) {
        // Every plan the config space reaches (deduplicated), timed in one interleaved set.
        std::vector<mk::GemmConfig> configs;
        std::vector<mk::GemmPlan> plans;
        for (int height : {64, 128, 192}) {
          // 64-row tiles up to M 1024: cuBLAS runs 64 x 64 tiles at 192 / 256 x 2048 x 7168,
          // where our best candidate reaches 0.80 / 0.89 of it on the H100, and 64 x 128 ones
          // (its 128x64 kernels, its M being our N) in pairs at 512 x 2048 x 7168 and 128 x 8192
          // x 8192. Past M 256 K whole only: one consumer warpgroup a tile, more tile-rows.
          if ((height == 64 && sh.m > 1024) || (height == 192 && sh.m > 384)) continue;
          for (int width : {64, 80, 96, 112, 128, 144, 160, 192, 224, 256}) {
            if (height == 192 && width > 128) continue;
            const bool step = width % 64 != 0;  // 128 rows, K whole only
            if (step && ((kn && !kn_step_width(width)) || height != 128)) continue;
            for (int pieces = 1; pieces <= (step || (height == 64 && sh.m > 256) ? 1 : 8);
                 ++pieces) {
              mk::GemmConfig config;
              config.block_m = height;
              config.block_n = width;
              config.split_k = pieces;
              const mk::GemmPlan p = mk::gemm_plan(sh.m, sh.n, sh.k, config, layout);
              const bool seen = std::any_of(plans.begin(), plans.end(), [&](const mk::GemmPlan& q) {
                return q.block_m == p.block_m && q.block_n == p.block_n && q.split_k == p.split_k &&
                       q.ctas == p.ctas;
              });
              if (!seen) configs.push_back(config), plans.push_back(p);
            }
          }
        }
        std::vector<std::function<void(int)>> ops;
        for (std::size_t i = 0; i < configs.size(); ++i) {
          ops.push_back([&, i](int j) {
            mk::gemm(a[j & 1], b[j & 1], c, sh.m, sh.n, sh.k, layout, s, configs[i]);
          });
        }
        ops.push_back(theirs);
        const std::vector<double> t = median_ms(iters, s, ops);
        const mk::GemmPlan chosen = mk::gemm_plan(sh.m, sh.n, sh.k, {}, layout);
        for (std::size_t i = 0; i < plans.size(); ++i) {
          const mk::GemmPlan& p = plans[i];
          const bool is_chosen = p.block_m == chosen.block_m && p.block_n == chosen.block_n &&
                                 p.split_k == chosen.split_k && p.ctas == chosen.ctas;
          std::printf("  cand %-14s %3dx%-3d s%d %3d CTAs  model %8.1f us  measured %8.1f us%s\n",
                      label.c_str(), p.block_m, p.block_n, p.split_k, p.ctas, p.estimate_us,
                      t[i] * 1e3, is_chosen ? "  <- plan" : "");
        }
        std::printf("  cand %-14s cuBLAS %.1f us\n", label.c_str(), t.back() * 1e3);
      }
      for (int i = 0; i < 2; ++i) cudaFree(a[i]), cudaFree(b[i]);
      cudaFree(c), cudaFree(c_blas);
    }
  }
  if (!check_only) {
    std::printf("geometric mean of TFLOP/s vs cuBLAS: %.3f, worst %.3f\n",
                std::exp(log_ratio_sum / cases), worst_ratio);
  }
  if (!json.empty() && !check_only) {
    std::time_t t = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
    const char* commit = std::getenv("MKERNEL_COMMIT");
    FILE* f = std::fopen(json.c_str(), "w");
    std::fprintf(f,
                 "{\n  \"kernel\": \"gemm\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
                 "  \"device\": \"%s\",\n  \"world_size\": 1,\n  \"num_nodes\": 1,\n"
                 "  \"transport\": \"none\",\n  \"rows\": [\n%s\n  ]\n}\n",
                 commit ? commit : "unknown", date, prop.name, rows.str().c_str());
    std::fclose(f);
  }
  return all_correct ? 0 : 1;
}
