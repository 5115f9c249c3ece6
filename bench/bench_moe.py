"""MoE dispatch / combine and moe_dispatch_gemm on one GPU, against torch._grouped_mm.

    python3 bench/bench_moe.py --mode check|bench [--json FILE] [--quick]
                               [--points MODEL:T,...] [--repeat N]

World 1 (every expert local: the dispatch is the routing and the expert-major copy), the shapes
of issue 29: DeepSeek-V3 (H 7168, N 2048, 256 experts, top-8), Qwen3-235B (4096, 1536, 128,
top-8) and Mixtral (4096, 14336, 8, top-2) at 128, 1024, 4096 and 8192 tokens, uniform random
routing. Columns (../shared/BENCH_SCHEMA.md, moe_dispatch_gemm):
  dispatch_alone  mkernel.moe_dispatch (padded layout)
  combine_alone   mkernel.moe_combine of the dispatched rows (H wide)
  gemm_alone      torch._grouped_mm on the same routed rows (back to back, offsets)
  mkernel_gemm    mkernel.grouped_gemm on the dispatch's padded layout
  mkernel_sequential  moe_dispatch, then mkernel.grouped_gemm (two ops)
  mkernel         mkernel.moe_dispatch_gemm: the two in one launch, each tile multiplied as soon
                  as its rows have landed
  nccl_dispatch, sequential: null (one GPU: no NCCL all-to-all)
limit_ms = max(gemm_alone, dispatch_alone); tflops = 2 x routed rows x N x H / mkernel.
Timing: CUDA graphs of several calls, events around replays, the median of rounds, the ops
interleaved (bench_grouped.py's time_ops). check: the dispatched rows bitwise against a torch
gather of the routing, the combine against its fp32 sum, the GEMM within twice torch's error.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

import mkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped import (bench_args, bench_seed, chosen_points, time_ops,  # noqa: E402
                           world1_comm, write_results)

MODELS = {  # hidden, N (the expert's intermediate), experts, top-k
    "deepseek_v3": (7168, 2048, 256, 8),
    "qwen3_235b": (4096, 1536, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
TOKENS = (128, 1024, 4096, 8192)


def routing(tokens, experts, top_k, gen):
    """Distinct experts per token, uniformly at random (int64 [T, k])."""
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    return scores.topk(top_k, dim=1).indices


def run_point(comm, model, tokens, gen, mode):
    hidden, n, experts, top_k = MODELS[model]
    dev = torch.device("cuda")
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    idx = routing(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, device=dev, generator=gen)
    w = torch.randn(experts, n, hidden, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    wt = w.transpose(-2, -1)
    # torch's form of the routed rows: by expert, then token and slot (the contract's order)
    flat = idx.flatten()
    order = torch.sort(flat, stable=True).indices
    rows_torch = x[order // top_k].contiguous()
    counts = torch.bincount(flat, minlength=experts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)

    def dispatch():
        return mkernel.moe_dispatch(x, idx, comm, experts)

    recv, expert_rows, handle = dispatch()
    torch.cuda.synchronize()

    def ours_gemm():
        return mkernel.grouped_gemm(recv, w, expert_rows, padded=True)

    def combine():
        return mkernel.moe_combine(recv, weights, handle, comm)

    def sequential():
        r, e, _ = dispatch()
        return mkernel.grouped_gemm(r, w, e, padded=True)

    def ours():
        return mkernel.moe_dispatch_gemm(x, idx, w, comm, experts)[0]

    def theirs():
        return torch._grouped_mm(rows_torch, wt, offs=offs)

    # Checked at every point, in both modes (cheap next to the timing).
    correct = True
    if tokens > 0:
        starts = torch.cumsum((counts + 127) // 128 * 128, 0) - (counts + 127) // 128 * 128
        pos = torch.cat([torch.arange(int(c), device=dev) + int(s)
                         for c, s in zip(counts.tolist(), starts.tolist())])
        correct &= torch.equal(expert_rows.long(), counts)
        correct &= torch.equal(recv[pos], rows_torch)
        y_ours, y_torch = ours_gemm(), theirs()
        picks = torch.unique(torch.randint(0, len(pos), (64,), device=dev, generator=gen))
        rows_e = torch.searchsorted(offs, picks, right=True)
        exact = torch.stack([rows_torch[p].double() @ w[e].double().T
                             for p, e in zip(picks.tolist(), rows_e.tolist())])
        err = (y_ours[pos[picks]].double() - exact).abs().max().item()
        err_torch = (y_torch[picks].double() - exact).abs().max().item()
        correct &= err <= 2 * err_torch + 1e-6
        out = combine()
        want = (x.float() * weights.sum(1, keepdim=True)).to(torch.bfloat16)  # identity experts
        correct &= (out.float() - want.float()).abs().max().item() <= \
            2 * want.float().abs().max().item() / 128
        y_fused = ours()
        err_fused = (y_fused[pos[picks]].double() - exact).abs().max().item()
        correct &= err_fused <= 2 * err_torch + 1e-6
    flops = 2.0 * tokens * top_k * n * hidden
    iters = max(3, min(100, int(2e11 / max(flops, 1.0))))
    fns = {"dispatch_alone": dispatch, "combine_alone": combine, "gemm_alone": theirs,
           "mkernel_gemm": ours_gemm, "mkernel_sequential": sequential, "mkernel": ours}
    ms = time_ops(fns, iters, 7 if mode == "bench" else 3)
    routed_bytes = tokens * top_k * hidden * 2
    return ms, flops, routed_bytes, correct


def main():
    args = bench_args(__doc__, points=True)
    if not torch.cuda.is_available():
        print("bench_moe: no CUDA GPU", file=sys.stderr)
        return 2
    comm = world1_comm()
    seed = bench_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens_list = (128, 4096) if (args.quick or args.mode == "check") else TOKENS
    print(f"bench_moe {args.mode}: seed {seed}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    print(f"{'model':12} {'T':>5} {'dispatch':>9} {'GB/s':>6} {'combine':>9} {'GB/s':>6} "
          f"{'torch mm':>9} {'our mm':>9} {'disp+mm':>9} {'fused':>9} {'x torch':>8}  check",
          flush=True)
    points = chosen_points(args, MODELS, tokens_list, "bench_moe")
    if points is None:
        return 2
    results, logs, all_ok = [], [], True
    for model, tokens in points:
        for _ in range(args.repeat):
            ms, flops, routed, ok = run_point(comm, model, tokens, gen, args.mode)
            all_ok &= ok
            ratio = ms["gemm_alone"] / ms["mkernel"]
            logs.append(math.log(ratio))
            print(f"{model:12} {tokens:5} {ms['dispatch_alone']:9.4f} "
                  f"{routed / ms['dispatch_alone'] * 1e-6:6.0f} {ms['combine_alone']:9.4f} "
                  f"{routed / ms['combine_alone'] * 1e-6:6.0f} {ms['gemm_alone']:9.4f} "
                  f"{ms['mkernel_gemm']:9.4f} {ms['mkernel_sequential']:9.4f} "
                  f"{ms['mkernel']:9.4f} {ratio:8.3f}  "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
            hidden, n, experts, top_k = MODELS[model]
            limit = max(ms["gemm_alone"], ms["dispatch_alone"])
            results.append({
                "shape": {"tokens_per_rank": tokens, "hidden": hidden, "N": n,
                          "experts": experts, "top_k": top_k, "model": model},
                "dtype": "bf16",
                "ms": {"mkernel": ms["mkernel"], "dispatch_alone": ms["dispatch_alone"],
                       "combine_alone": ms["combine_alone"], "nccl_dispatch": None,
                       "gemm_alone": ms["gemm_alone"], "mkernel_gemm": ms["mkernel_gemm"],
                       "mkernel_sequential": ms["mkernel_sequential"], "sequential": None},
                "limit_ms": limit,
                "ratio_to_limit": ms["mkernel"] / limit,
                "speedup_vs_torch_grouped_mm": ratio,
                "dispatch_gbps": routed / ms["dispatch_alone"] * 1e-6,
                "combine_gbps": routed / ms["combine_alone"] * 1e-6,
                "tflops": flops / ms["mkernel"] * 1e-9,
                "correct": bool(ok),
            })
            torch.cuda.empty_cache()
    print(f"geometric mean (moe_dispatch_gemm) vs torch._grouped_mm alone: "
          f"{math.exp(sum(logs) / len(logs)):.3f}, worst {math.exp(min(logs)):.3f}", flush=True)
    if args.json and args.mode == "bench":
        write_results(args.json, "moe_dispatch_gemm", results)
    comm.synchronize()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
