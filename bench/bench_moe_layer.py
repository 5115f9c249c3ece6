"""The MoE layer on one GPU (world 1), against the plain PyTorch layer on torch._grouped_mm.

    python3 bench/bench_moe_layer.py --mode check|bench [--json FILE] [--quick] [--kernels]
                                     [--points MODEL:T,...] [--repeat N]

--kernels also prints, per point, the GPU time of every kernel of mkernel.moe_layer and of
compute_alone (torch.profiler): where the layer's time goes.

Shapes of issue 30 (hidden, intermediate, experts, top-k): DeepSeek-V3-like (7168, 2048, 256, 8),
Qwen3-235B-like (4096, 1536, 128, 8), Mixtral (4096, 14336, 8, 2), every expert local, at 128,
1024, 4096 and 8192 tokens, uniform random routing, weights of nn.Linear scale. Columns
(../shared/BENCH_SCHEMA.md, moe_layer):
  mkernel          mkernel.moe_layer
  torch_reference  the plain PyTorch layer: sort the slots by expert, gather x, grouped gate/up
                   (torch._grouped_mm), silu(gate) * up, grouped down, rows back in token order
                   and each token's rows summed with its weights by one bmm
  compute_alone    mkernel.grouped_gemm of the dispatched rows with w13, then with w2 (the
                   layer's two GEMMs on our engine, nothing else)
  dispatch_combine_alone  mkernel.moe_dispatch, then mkernel.moe_combine of its rows
  sequential: null (one GPU: no NCCL all-to-all)
limit_ms = max(compute_alone, dispatch_combine_alone); tflops = 6 x routed rows x H x I /
mkernel. Timing: CUDA graphs of several calls, events around replays, the median of rounds, the
ops interleaved (bench_grouped.py's time_ops). Checked at every point: 16 sampled tokens against
the fp64 layer, within twice the torch layer's error plus 1e-3 of the output's scale.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped import (bench_args, bench_seed, chosen_points, kernel_times,  # noqa: E402
                           time_ops, world1_comm, write_results)

MODELS = {  # hidden, intermediate, experts, top-k
    "deepseek_v3": (7168, 2048, 256, 8),
    "qwen3_235b": (4096, 1536, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
TOKENS = (128, 1024, 4096, 8192)


def torch_layer(x, idx, weights, w13_t, w2_t, experts):
    """The plain PyTorch layer (w13_t [E, H, 2I], w2_t [E, I, H]: torch._grouped_mm's B)."""
    tokens, top_k = idx.shape
    inter = w2_t.shape[1]
    flat = idx.flatten()
    order = torch.sort(flat, stable=True).indices
    rows = x[order // top_k]
    # Counted with scatter_add_ (torch.bincount reads its size back to the host: no graph).
    counts = torch.zeros(experts, device=x.device, dtype=torch.int64)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up = torch._grouped_mm(rows, w13_t, offs=offs)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch._grouped_mm(h, w2_t, offs=offs)
    # Back in token order, then each token's top-k rows summed with their weights in one batched
    # product (fp32 accumulation; the weights in bf16, as the models' own layers cast them).
    y_tok = torch.empty_like(y)
    y_tok[order] = y
    return torch.bmm(weights.to(y.dtype).view(tokens, 1, top_k),
                     y_tok.view(tokens, top_k, -1)).view(tokens, -1)


def exact_rows(x, idx, weights, w13, w2, picks):
    """The fp64 layer on tokens `picks`."""
    inter = w2.shape[2]
    out = []
    for t in picks:
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for j, e in enumerate(idx[t].tolist()):
            xt = x[t].double()
            g = w13[e, :inter].double() @ xt
            u = w13[e, inter:].double() @ xt
            acc += float(weights[t, j]) * (w2[e].double() @ (F.silu(g) * u))
        out.append(acc)
    return torch.stack(out)


def run_point(comm, model, tokens, gen, mode, kernels=False):
    hidden, inter, experts, top_k = MODELS[model]
    dev = torch.device("cuda")
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    idx = torch.rand(tokens, experts, device=dev, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device=dev, generator=gen)
    weights = weights / weights.sum(dim=1, keepdim=True)
    # Drawn in bf16 and scaled in place: DeepSeek-V3's w13 is 14 GiB, and drawing it in fp32 and
    # scaling a copy (two 28 GiB temporaries) did not fit an 80 GB H100.
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16,
                      generator=gen).mul_(hidden ** -0.5)
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16,
                     generator=gen).mul_(inter ** -0.5)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)

    def ours():
        return mkernel.moe_layer(x, idx, weights, w13, w2, comm, experts)

    def theirs():
        return torch_layer(x, idx, weights, w13_t, w2_t, experts)

    recv, expert_rows, handle = mkernel.moe_dispatch(x, idx, comm, experts)
    # Random, of the intermediate's size (zeros would flatter the GEMM: less power, higher clocks).
    h_rows = (torch.randn(recv.shape[0], inter, device=dev, generator=gen) * 0.5).to(torch.bfloat16)

    def compute():
        mkernel.grouped_gemm(recv, w13, expert_rows, padded=True)
        return mkernel.grouped_gemm(h_rows, w2, expert_rows, padded=True)

    def dispatch_combine():
        r, _, hd = mkernel.moe_dispatch(x, idx, comm, experts)
        return mkernel.moe_combine(r, weights, hd, comm)

    out, ref = ours(), theirs()
    comm.synchronize()
    picks = torch.unique(torch.randint(0, tokens, (16,), device=dev, generator=gen)).tolist()
    exact = exact_rows(x, idx, weights, w13, w2, picks)
    err = (out[picks].double() - exact).abs().max().item()
    err_torch = (ref[picks].double() - exact).abs().max().item()
    correct = err <= 2 * err_torch + 1e-3 * exact.abs().max().item()
    flops = 6.0 * tokens * top_k * hidden * inter
    iters = max(3, min(50, int(2e11 / max(flops, 1.0))))
    fns = {"mkernel": ours, "torch_reference": theirs, "compute_alone": compute,
           "dispatch_combine_alone": dispatch_combine}
    ms = time_ops(fns, iters, 7 if mode == "bench" else 3)
    if kernels:
        for name in ("mkernel", "compute_alone"):
            for t, count, kernel in kernel_times(fns[name]):
                print(f"    {name:14} {t:9.4f} ms  x{count:<2} {kernel[:100]}", flush=True)
    return ms, flops, correct, err, err_torch


def main():
    args = bench_args(__doc__, kernels=True, points=True)
    if not torch.cuda.is_available():
        print("bench_moe_layer: no CUDA GPU", file=sys.stderr)
        return 2
    comm = world1_comm()
    seed = bench_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens_list = (128, 4096) if (args.quick or args.mode == "check") else TOKENS
    print(f"bench_moe_layer {args.mode}: seed {seed}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    print(f"{'model':12} {'T':>5} {'mkernel':>9} {'torch':>9} {'compute':>9} {'disp+comb':>9} "
          f"{'x torch':>8} {'TFLOP/s':>8}  check", flush=True)
    points = chosen_points(args, MODELS, tokens_list, "bench_moe_layer")
    if points is None:
        return 2
    results, logs, all_ok = [], [], True
    for model, tokens in points:
        for _ in range(args.repeat):
            ms, flops, ok, err, err_torch = run_point(comm, model, tokens, gen, args.mode,
                                                      args.kernels)
            all_ok &= ok
            ratio = ms["torch_reference"] / ms["mkernel"]
            logs.append(math.log(ratio))
            print(f"{model:12} {tokens:5} {ms['mkernel']:9.4f} {ms['torch_reference']:9.4f} "
                  f"{ms['compute_alone']:9.4f} {ms['dispatch_combine_alone']:9.4f} "
                  f"{ratio:8.3f} {flops / ms['mkernel'] * 1e-9:8.1f}  "
                  f"{'ok' if ok else f'WRONG (error {err:.3g}, torch {err_torch:.3g})'}",
                  flush=True)
            hidden, inter, experts, top_k = MODELS[model]
            limit = max(ms["compute_alone"], ms["dispatch_combine_alone"])
            results.append({
                "shape": {"tokens_per_rank": tokens, "hidden": hidden, "intermediate": inter,
                          "experts": experts, "top_k": top_k, "model": model},
                "dtype": "bf16",
                "ms": {"mkernel": ms["mkernel"], "torch_reference": ms["torch_reference"],
                       "compute_alone": ms["compute_alone"],
                       "dispatch_combine_alone": ms["dispatch_combine_alone"],
                       "sequential": None},
                "limit_ms": limit,
                "ratio_to_limit": ms["mkernel"] / limit,
                "speedup_vs_torch_reference": ratio,
                "tflops": flops / ms["mkernel"] * 1e-9,
                "correct": bool(ok),
            })
            torch.cuda.empty_cache()
    print(f"geometric mean vs the torch layer: {math.exp(sum(logs) / len(logs)):.3f}, worst "
          f"{math.exp(min(logs)):.3f}", flush=True)
    if args.json and args.mode == "bench":
        write_results(args.json, "moe_layer", results)
    comm.synchronize()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
