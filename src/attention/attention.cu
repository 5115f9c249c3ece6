// Host side of the attention engine: validate -> plan -> tensor maps -> launch.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "attention/attention_internal.h"
#include "attention/attention_kernel.cuh"
#include "attention/attention_launch.cuh"
#include "attention/split_attention.cuh"
#include "gemm/gemm_internal.h"
#include "mkernel/attention.h"
#include "mkernel/error.h"
#include "runtime/cuda_check.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "attention";
constexpr int64_t kMax32 = int64_t{1} << 31;

[[noreturn]] void invalid(const char* op, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
}

template <int kHeadDim>
using Cfg = attention_engine::AttentionConfig<kHeadDim>;

// Calls fn.template operator()<kHeadDim>() for the run-time head dim (checked: 64 or 128).
template <class Fn>
decltype(auto) dispatch_head_dim(int64_t head_dim, Fn&& fn) {
  if (head_dim == 64) return fn.template operator()<64>();
  return fn.template operator()<128>();
}

}  // namespace

void attention_host::require_problem(const AttentionProblem& p, const char* op) {
  if (p.head_dim != 64 && p.head_dim != 128) {
    invalid(op, "head_dim = " + std::to_string(p.head_dim) + "; expected 64 or 128");
  }
  if (p.batch < 1 || p.seq_q < 1 || p.seq_kv < 1 || p.heads < 1 || p.kv_heads < 1) {
    invalid(op, "batch " + std::to_string(p.batch) + ", seq_q " + std::to_string(p.seq_q) +
                    ", seq_kv " + std::to_string(p.seq_kv) + ", heads " + std::to_string(p.heads) +
                    ", kv_heads " + std::to_string(p.kv_heads) + "; expected each >= 1");
  }
  if (p.heads % p.kv_heads != 0) {
    invalid(op, "heads = " + std::to_string(p.heads) +
                    " is not a multiple of kv_heads = " + std::to_string(p.kv_heads));
  }
  // (In this order, so that no product wraps: each factor is below 2^31 when it is taken.)
  if (p.batch >= kMax32 || p.seq_q >= kMax32 || p.seq_kv >= kMax32 || p.heads >= kMax32 ||
      p.batch * p.heads >= kMax32 || p.batch * p.heads * ((p.seq_q + 127) / 128) >= kMax32 ||
      p.batch * p.heads * p.seq_kv >= (int64_t{1} << 40)) {
    invalid(op,
            "the problem is too large (batch x heads x query tiles must be < 2^31, batch x heads x "
            "seq_kv < 2^40)");
  }
  if (!(p.softmax_scale >= 0) || !std::isfinite(p.softmax_scale)) {
    invalid(op, "softmax_scale = " + std::to_string(p.softmax_scale) +
                    "; expected a finite value > 0 (0: 1 / sqrt(head_dim))");
  }
}

attention_host::Strides attention_host::require_tensor(const AttentionTensor& t, const char* op,
                                                       const char* name, int64_t seq, int64_t heads,
                                                       int64_t batch, int64_t head_dim, int device,
                                                       std::size_t& bytes) {
  gemm_engine::require_device_pointer(t.data, op, name, device);
  Strides s{t.stride_batch != 0 ? t.stride_batch : seq * heads * head_dim,
            t.stride_seq != 0 ? t.stride_seq : heads * head_dim,
            t.stride_head != 0 ? t.stride_head : head_dim};
  for (const auto& [what, value] :
       {std::pair{"batch", s.batch}, std::pair{"seq", s.seq}, std::pair{"head", s.head}}) {
    if (value < 0 || value % 8 != 0 || value >= (int64_t{1} << 38)) {
      invalid(
          op,
          std::string(name) + "'s " + what + " stride = " + std::to_string(value) +
              " elements; expected a multiple of 8 (16 bytes: the tensor copy engine) below 2^38");
    }
  }
  bytes = static_cast<std::size_t>(
      ((batch - 1) * s.batch + (seq - 1) * s.seq + (heads - 1) * s.head + head_dim) * 2);
  return s;
}

CUtensorMap attention_host::make_map(const void* base, const Strides& s, int64_t batch, int64_t seq,
                                     int64_t heads, int64_t head_dim, int box_rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(s.head) * 2,
                                 static_cast<cuuint64_t>(s.seq) * 2,
                                 static_cast<cuuint64_t>(s.batch) * 2};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  return gemm_engine::encode_map(base, 4, dims, strides, box);
}

CUtensorMap attention_host::make_map_parts(const void* base, const Strides& s, int64_t batch,
                                           int64_t parts, int64_t part_len, int64_t heads,
                                           int64_t head_dim, int box_rows) {
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(part_len), static_cast<cuuint64_t>(parts),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[4] = {
      static_cast<cuuint64_t>(s.head) * 2, static_cast<cuuint64_t>(s.seq) * 2,
      static_cast<cuuint64_t>(s.seq * part_len) * 2, static_cast<cuuint64_t>(s.batch) * 2};
  const cuuint32_t box[5] = {64, 1, static_cast<cuuint32_t>(box_rows), 1, 1};
  return gemm_engine::encode_map(base, 5, dims, strides, box);
}

attention_host::Operands attention_host::require_operands(
    const AttentionProblem& p, const AttentionTensor& q, const AttentionTensor& k,
    const AttentionTensor& v, void* o, float* lse, const char* op, int device,
    const void* workspace, std::size_t workspace_bytes) {
  std::size_t q_bytes = 0, k_bytes = 0, v_bytes = 0;
  const Operands io{
      require_tensor(q, op, "q", p.seq_q, p.heads, p.batch, p.head_dim, device, q_bytes),
      require_tensor(k, op, "k", p.seq_kv, p.kv_heads, p.batch, p.head_dim, device, k_bytes),
      require_tensor(v, op, "v", p.seq_kv, p.kv_heads, p.batch, p.head_dim, device, v_bytes)};
  gemm_engine::require_device_pointer(o, op, "o", device);
  if (lse != nullptr) gemm_engine::require_device_pointer(lse, op, "lse", device, 4);
  const std::size_t o_bytes =
      static_cast<std::size_t>(p.batch * p.seq_q * p.heads * p.head_dim) * 2;
  const std::size_t lse_bytes = static_cast<std::size_t>(p.batch * p.heads * p.seq_q) * 4;
  detail::require_disjoint(op, {{"q", q.data, q_bytes, false},
                                {"k", k.data, k_bytes, false},
                                {"v", v.data, v_bytes, false},
                                {"o", o, o_bytes, true},
                                {"lse", lse, lse_bytes, true},
                                {"workspace", workspace, workspace_bytes, true}});
  return io;
}

float attention_host::scale_log2(const AttentionProblem& p) {
  const float scale =
      p.softmax_scale > 0 ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  return scale * 1.4426950408889634f;
}

namespace {

int device_sms(const AttentionConfig& config) {
  int sms = config.sms;
  if (sms <= 0) {
    int device = 0;
    MK_CUDA_CHECK(cudaGetDevice(&device));
    MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  }
  return sms;
}

}  // namespace

std::string AttentionPlan::describe() const {
  std::string split;
  if (split_items > 0) {
    split = " (the last " + std::to_string(split_items) + " split into " +
            std::to_string(split_pieces) + " pieces each, one CTA a piece, then merged)";
  }
  return "D " + std::to_string(head_dim) + ", tiles " + std::to_string(block_m) + " queries x " +
         std::to_string(block_n) + " keys, " + std::to_string(stages) + " KV stages, " +
         std::to_string(items) + " work items" + split + " on " + std::to_string(ctas) +
         " persistent CTAs, " + std::to_string(smem_bytes) + " B shared memory";
}

namespace {

// KV blocks plain work item t visits (PlainAttention::item's count).
int64_t item_blocks(const AttentionProblem& p, int64_t t, int block_m, int block_n) {
  const int64_t m_tiles = (p.seq_q + block_m - 1) / block_m;
  const int64_t in_head = t % m_tiles;
  const int64_t m = p.causal ? m_tiles - 1 - in_head : in_head;
  const int64_t last_row = std::min(p.seq_q, (m + 1) * block_m) - 1;
  const int64_t last_key =
      p.causal ? std::min(p.seq_kv - 1, last_row + p.seq_kv - p.seq_q) : p.seq_kv - 1;
  return last_key < 0 ? 0 : last_key / block_n + 1;
}

// The last wave split (split_attention.cuh) when its items fill at most half of it and are long
// enough that a piece of kMinPieceBlocks pays for the two extra launches (each piece also
// repeats the item's Q load and first, unoverlapped block).
constexpr int64_t kMinPieceBlocks = 8;

void plan_split(const AttentionProblem& p, AttentionPlan& plan) {
  const int64_t g = plan.ctas, n = plan.items;  // (ctas: every CTA the config allows)
  const int64_t tail = n - (n - 1) / g * g;     // items in the last wave, 1 .. g
  if (tail * 2 > g) return;
  int64_t most = 0;
  for (int64_t t = n - tail; t < n; ++t) {
    most = std::max(most, item_blocks(p, t, plan.block_m, plan.block_n));
  }
  const int64_t pieces = std::min(g / tail, most / kMinPieceBlocks);
  if (pieces < 2) return;
  plan.split_items = tail;
  plan.split_pieces = static_cast<int>(pieces);
}

}  // namespace

AttentionPlan attention_host::plan(const AttentionProblem& problem, int sms) {
  return dispatch_head_dim(problem.head_dim, [&]<int kHeadDim>() {
    using C = Cfg<kHeadDim>;
    AttentionPlan plan;
    plan.head_dim = kHeadDim;
    plan.block_m = C::kBlockM;
    plan.block_n = C::kBlockN;
    plan.stages = C::kStages;
    plan.items = problem.batch * problem.heads * ((problem.seq_q + C::kBlockM - 1) / C::kBlockM);
    plan.ctas = sms;
    plan.smem_bytes = C::kSmemBytes;
    return plan;
  });
}

AttentionPlan attention_plan(const AttentionProblem& problem, const AttentionConfig& config) {
  attention_host::require_problem(problem, kOp);
  if (config.sms < 0)
    invalid(kOp, "config.sms = " + std::to_string(config.sms) + "; expected >= 0");
  AttentionPlan plan = attention_host::plan(problem, device_sms(config));
  plan_split(problem, plan);  // on every CTA allowed: fewer items than CTAs may split too
  plan.ctas = static_cast<int>(std::min<int64_t>(plan.ctas, plan.items));
  return plan;
}

void attention(const AttentionProblem& problem, const AttentionTensor& q, const AttentionTensor& k,
               const AttentionTensor& v, void* o, float* lse, cudaStream_t stream,
               const AttentionConfig& config) {
  const AttentionPlan plan = attention_plan(problem, config);  // the problem checked first
  const AttentionProblem& p = problem;
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  detail::require_stream(device, stream, kOp);
  const attention_host::Operands io =
      attention_host::require_operands(p, q, k, v, o, lse, kOp, device);
  if (detail::process_overrides().print_config) {
    std::fprintf(stderr, "[mkernel] attention B%lld H%lld/%lld S%lld/%lld%s: %s\n",
                 static_cast<long long>(p.batch), static_cast<long long>(p.heads),
                 static_cast<long long>(p.kv_heads), static_cast<long long>(p.seq_q),
                 static_cast<long long>(p.seq_kv), p.causal ? " causal" : "",
                 plan.describe().c_str());
  }
  const float scale_log2 = attention_host::scale_log2(p);
  const attention_host::Strides so{p.seq_q * p.heads * p.head_dim, p.heads * p.head_dim,
                                   p.head_dim};
  dispatch_head_dim(p.head_dim, [&]<int kHeadDim>() {
    using C = Cfg<kHeadDim>;
    using Policy = attention_engine::PlainAttention<kHeadDim>;
    Policy policy{};
    using attention_host::make_map;
    policy.q = make_map(q.data, io.q, p.batch, p.seq_q, p.heads, kHeadDim, C::kBlockM);
    policy.k = make_map(k.data, io.k, p.batch, p.seq_kv, p.kv_heads, kHeadDim, C::kBlockN);
    policy.v = make_map(v.data, io.v, p.batch, p.seq_kv, p.kv_heads, kHeadDim, C::kBlockN);
    policy.o = make_map(o, so, p.batch, p.seq_q, p.heads, kHeadDim, 64);
    policy.lse = lse;
    policy.heads = static_cast<int>(p.heads);
    policy.group = static_cast<int>(p.heads / p.kv_heads);
    policy.seq_q = static_cast<int>(p.seq_q);
    policy.seq_kv = static_cast<int>(p.seq_kv);
    policy.m_tiles = static_cast<int>((p.seq_q + C::kBlockM - 1) / C::kBlockM);
    policy.kv_blocks = static_cast<int>((p.seq_kv + C::kBlockN - 1) / C::kBlockN);
    policy.causal = p.causal;
    auto launched = [] {
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) {
        throw Error(ErrorCode::kCuda,
                    std::string(kOp) + ": launch failed: " + cudaGetErrorString(err));
      }
    };
    // The whole waves (all the items unless the last wave is split), then the last wave's items
    // in pieces and their merge (split_attention.cuh). Everything that can fail on the host -
    // the pieces' scratch, loading the kernels - comes before the first launch, so that a
    // refusal leaves o unwritten.
    const int64_t whole = plan.items - plan.split_items;
    using Split = attention_engine::SplitAttention<kHeadDim>;
    Split split{};
    std::optional<gemm_engine::StreamScratch> scratch;
    const int64_t slots = plan.split_items * plan.split_pieces;
    if (plan.split_items > 0) {
      split.first = static_cast<int>(whole);
      split.tail = static_cast<int>(plan.split_items);
      split.pieces = plan.split_pieces;
      const std::size_t o_bytes = static_cast<std::size_t>(slots) * 2 * 128 * (C::kORegs / 4) * 16;
      scratch.emplace(o_bytes + static_cast<std::size_t>(slots) * 2 * 128 * 16, stream);
      auto* base = static_cast<uint8_t*>(scratch->get());
      split.state = {reinterpret_cast<float4*>(base), reinterpret_cast<float4*>(base + o_bytes)};
    }
    auto kernel = attention_host::prepared<C, Policy>();
    auto pieces = plan.split_items > 0 ? attention_host::prepared<C, Split>() : nullptr;
    if (whole > 0) {
      policy.items = static_cast<int>(whole);
      kernel<<<plan.ctas, C::kThreads, C::kSmemBytes, stream>>>(policy, scale_log2);
      launched();
    }
    if (plan.split_items == 0) return;
    split.plain = policy;
    pieces<<<static_cast<int>(slots), C::kThreads, C::kSmemBytes, stream>>>(split, scale_log2);
    launched();
    const dim3 grid(static_cast<unsigned>(plan.split_items),
                    kHeadDim / 8 / attention_engine::kMergeGroups);
    attention_engine::merge_pieces_kernel<kHeadDim>
        <<<grid, 256, 0, stream>>>(split, static_cast<__nv_bfloat16*>(o), scale_log2);
    launched();
  });
}

std::vector<GemmKernelResources> detail::attention_kernel_resources() {
  std::vector<GemmKernelResources> out;
  auto add = [&]<int kHeadDim>() {
    using C = Cfg<kHeadDim>;
    using Policy = attention_engine::PlainAttention<kHeadDim>;
    out.push_back(
        kernel_resources("attention D" + std::to_string(kHeadDim),
                         reinterpret_cast<const void*>(attention_host::prepared<C, Policy>())));
    using Split = attention_engine::SplitAttention<kHeadDim>;
    out.push_back(
        kernel_resources("attention pieces D" + std::to_string(kHeadDim),
                         reinterpret_cast<const void*>(attention_host::prepared<C, Split>())));
    out.push_back(kernel_resources(
        "attention merge D" + std::to_string(kHeadDim),
        reinterpret_cast<const void*>(attention_engine::merge_pieces_kernel<kHeadDim>)));
  };
  add.template operator()<64>();
  add.template operator()<128>();
  add_ring_attention_resources(out);
  return out;
}

}  // namespace mk
