"""mkernel.grouped_gemm against torch._grouped_mm on MoE expert shapes, one GPU.

    python3 bench/bench_grouped.py --mode check|bench [--json FILE] [--quick]

The sweep (issue 28): local experts {8, 32, 128, 256} x routed rows {128, 1024, 4096, 16384,
65536} x (N, K) of DeepSeek-V3 (4096 x 7168, 7168 x 2048), Qwen3-235B (3072 x 4096,
4096 x 1536) and Mixtral (28672 x 4096, 4096 x 14336), counts balanced or Zipf-skewed (some
experts empty), in both of mkernel's layouts: contiguous ([rows, K], prefill) and masked
([E, capacity, K], decode; capacity = the largest count). torch._grouped_mm runs the same rows
and counts in the contiguous form (offsets), which is what it takes for both. Points whose
weights do not fit the memory cap are skipped (printed).

Timing: each op's calls captured in a CUDA graph (as a serving loop runs them: no Python or launch
overhead in the numbers), CUDA events around its replays, the median of rounds, the ops
interleaved in each round. check: fewer points, each group checked against the fp64 product on sampled rows (the
tolerance rule: within twice torch's error plus 1e-6); bench: every point, mkernel within two
bf16 ulps of the largest output of torch._grouped_mm.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

import mkernel

EXPERTS = (8, 32, 128, 256)
ROWS = (128, 1024, 4096, 16384, 65536)
SHAPES = {  # model: (N, K) pairs of its expert GEMMs
    "deepseek_v3": ((4096, 7168), (7168, 2048)),
    "qwen3_235b": ((3072, 4096), (4096, 1536)),
    "mixtral": ((28672, 4096), (4096, 14336)),
}
WEIGHT_CAP_BYTES = 24 << 30  # B = E x N x K bf16 above this is skipped
MASKED_CAP_BYTES = 16 << 30  # the masked A = E x capacity x K (and its C) above this: no masked


def counts_for(experts, rows, skew, cpu_gen):
    """Row counts summing to `rows`: equal shares, or Zipf(1.2) shares over a random expert
    order with the smallest shares rounded to zero (empty experts)."""
    if skew == "balanced":
        base = [rows // experts] * experts
        for i in range(rows - sum(base)):
            base[i] += 1
        return base
    weights = [1.0 / (r + 1) ** 1.2 for r in range(experts)]
    order = torch.randperm(experts, generator=cpu_gen).tolist()
    total = sum(weights)
    counts = [0] * experts
    for rank, e in enumerate(order):
        counts[e] = int(rows * weights[rank] / total)
    counts[order[0]] += rows - sum(counts)  # the largest share takes the rounding
    return counts


def write_results(path, kernel, rows):
    """A one-GPU results file (../shared/BENCH_SCHEMA.md) stamped with MKERNEL_COMMIT, the date
    and this GPU."""
    doc = {
        "kernel": kernel,
        "commit": os.environ.get("MKERNEL_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(),
        "world_size": 1,
        "num_nodes": 1,
        "transport": "none",
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def time_ops(fns, iters, rounds):
    """{name: ms per call}: `iters` calls of each op captured in one CUDA graph, the median over
    rounds of a replay's events."""
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graphs[name] = graph
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    del graphs
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def sampled_error(out_rows, a_rows, w, picks):
    """max |out - exact| over the sampled rows (fp64 exact), for out_rows = a_rows @ w.T."""
    exact = a_rows[picks].double() @ w.double().t()
    return (out_rows[picks].double() - exact).abs().max().item()


def run_point(experts, rows, n, k, skew, gen, cpu_gen, mode):
    counts = counts_for(experts, rows, skew, cpu_gen)
    capacity = max(max(counts), 1)
    dev = torch.device("cuda")
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.05
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
    group_rows = torch.tensor(counts, dtype=torch.int32, device=dev)
    offs = torch.cumsum(group_rows, 0, dtype=torch.int32)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    # The masked form of the same rows: group e's rows first in its block.
    masked = experts * capacity * max(n, k) * 2 <= MASKED_CAP_BYTES
    a_masked = None
    if masked:
        a_masked = torch.zeros(experts, capacity, k, device=dev, dtype=torch.bfloat16)
        for e, c in enumerate(counts):
            if c:
                a_masked[e, :c] = a[starts[e]:starts[e] + c]
    wt = w.transpose(-2, -1)  # [E, K, N], K-major: what torch._grouped_mm takes for x @ w.T

    def ours():
        return mkernel.grouped_gemm(a, w, group_rows)

    def ours_masked():
        return mkernel.grouped_gemm(a_masked, w, group_rows)

    def theirs():
        return torch._grouped_mm(a, wt, offs=offs)

    got, want = ours(), theirs()
    got_masked = ours_masked() if masked else None
    torch.cuda.synchronize()
    correct = {"contiguous": True, "masked": masked}  # (no masked run: not correct either)
    if mode == "check":
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows_e = slice(starts[e], starts[e] + c)
            picks = torch.unique(torch.tensor([0, c - 1, c // 2], device=dev))
            err_torch = sampled_error(want[rows_e], a[rows_e], w[e], picks)
            outs = [("contiguous", got[rows_e])]
            if masked:
                outs.append(("masked", got_masked[e, :c]))
            for name, out_e in outs:
                err = sampled_error(out_e, a[rows_e], w[e], picks)
                if not err <= 2 * err_torch + 1e-6:
                    print(f"  expert {e} ({c} rows), {name}: error {err:.4g}, torch "
                          f"{err_torch:.4g}", flush=True)
                    correct[name] = False
    else:
        mag = want.abs().max().item()
        outs = [("contiguous", got)]
        if masked:
            outs.append(("masked",
                         torch.cat([got_masked[e, :c] for e, c in enumerate(counts) if c])))
        for name, out in outs:
            if (out.float() - want.float()).abs().max().item() > 2 * mag / 128:
                correct[name] = False
    flops = 2.0 * rows * n * k
    iters = max(3, min(200, int(2e11 / max(flops, 1.0))))
    fns = {"mkernel": ours, "torch_grouped_mm": theirs}
    if masked:
        fns["mkernel_masked"] = ours_masked
    ms = time_ops(fns, iters, 7 if mode == "bench" else 3)
    return counts, ms, flops, correct


def bench_args(doc, quick=True, kernels=False, points=False):
    """The one-GPU benchmarks' command line: --mode check|bench, --json FILE[, --quick]
    [, --kernels][, --points MODEL:T,... --repeat N]."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("check", "bench"), default="bench")
    parser.add_argument("--json", help="results file (bench mode)")
    if quick:
        parser.add_argument("--quick", action="store_true", help="a few points only")
    if kernels:
        parser.add_argument("--kernels", action="store_true",
                            help="also print each op's kernels and their GPU time (profiler)")
    if points:
        parser.add_argument("--points", help="only these points, MODEL:TOKENS,... "
                            "(e.g. deepseek_v3:8192)")
        parser.add_argument("--repeat", type=int, default=1,
                            help="measure each point N times, on fresh data each time")
    return parser.parse_args()


def chosen_points(args, models, tokens_list, name):
    """The (model, tokens) points to run: --points, else every model at every token count.
    None (after a message) on an unknown model."""
    if not args.points:
        return [(model, tokens) for model in models for tokens in tokens_list]
    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",")]
    unknown = [m for m, _ in points if m not in models]
    if unknown:
        print(f"{name}: unknown model {unknown[0]} (known: {', '.join(models)})", file=sys.stderr)
        return None
    return points


def kernel_times(fn, calls=5):
    """[(ms per call, launches per call, kernel name)] of fn's GPU kernels, by torch.profiler,
    after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out.append((t / calls / 1000.0, e.count // calls, e.key))
    return out


def bench_seed():
    """The data's seed: MKERNEL_BENCH_SEED when set (the same routing and values in every variant
    of an A/B - scripts/ab_variants.sh sets it - or a results file's run again), else fresh."""
    pinned = os.environ.get("MKERNEL_BENCH_SEED", "")
    return int(pinned) if pinned else int.from_bytes(os.urandom(4), "little")


def world1_comm():
    """A communicator of this process alone: torch.distributed (gloo) of world 1, then
    mkernel.init(). The caller ends it with torch.distributed.destroy_process_group()."""
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    return mkernel.init()


def main():
    args = bench_args(__doc__)
    if not torch.cuda.is_available():
        print("bench_grouped: no CUDA GPU", file=sys.stderr)
        return 2
    seed = bench_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)  # the data
    cpu_gen = torch.Generator().manual_seed(seed)  # the experts' order in a Zipf skew
    experts_list, rows_list = EXPERTS, ROWS
    if args.mode == "check" or args.quick:
        experts_list, rows_list = (8, 128), (128, 4096)
    points = []
    for model, pairs in SHAPES.items():
        for n, k in pairs:
            for experts in experts_list:
                for rows in rows_list:
                    for skew in ("balanced", "zipf"):
                        points.append((model, experts, rows, n, k, skew))
    print(f"bench_grouped {args.mode}: {len(points)} points, seed {seed}, "
          f"{torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    print(f"{'model':12} {'E':>4} {'rows':>6} {'N':>6} {'K':>6} {'skew':9} {'mkernel':>9} "
          f"{'masked':>9} {'torch':>9} {'x torch':>8} {'x (m)':>7}  check", flush=True)
    results, logs, all_ok = [], [], True
    for model, experts, rows, n, k, skew in points:
        if experts * n * k * 2 > WEIGHT_CAP_BYTES:
            print(f"{model:12} {experts:4} {rows:6} {n:6} {k:6} {skew:9} skipped: weights "
                  f"{experts * n * k * 2 / 2**30:.0f} GiB", flush=True)
            continue
        counts, ms, flops, correct = run_point(experts, rows, n, k, skew, gen, cpu_gen, args.mode)
        ok = correct["contiguous"] and ("mkernel_masked" not in ms or correct["masked"])
        all_ok &= ok
        layouts = [("contiguous", "mkernel")]
        if "mkernel_masked" in ms:
            layouts.append(("masked", "mkernel_masked"))
        ratios = {key: ms["torch_grouped_mm"] / ms[key] for _, key in layouts}
        logs += [math.log(r) for r in ratios.values()]
        masked_ms = f"{ms['mkernel_masked']:9.4f}" if "mkernel_masked" in ms else f"{'-':>9}"
        masked_x = f"{ratios['mkernel_masked']:7.3f}" if "mkernel_masked" in ratios else f"{'-':>7}"
        print(f"{model:12} {experts:4} {rows:6} {n:6} {k:6} {skew:9} {ms['mkernel']:9.4f} "
              f"{masked_ms} {ms['torch_grouped_mm']:9.4f} {ratios['mkernel']:8.3f} {masked_x}  "
              f"{'ok' if ok else 'WRONG'}", flush=True)
        for layout, key in layouts:
            results.append({
                "shape": {"experts": experts, "rows": rows, "N": n, "K": k, "skew": skew,
                          "layout": layout, "model": model, "empty_experts": counts.count(0)},
                "dtype": "bf16",
                "ms": {"mkernel": ms[key], "torch_grouped_mm": ms["torch_grouped_mm"]},
                "limit_ms": ms["torch_grouped_mm"],
                "ratio_to_limit": ms[key] / ms["torch_grouped_mm"],
                "tflops": flops / ms[key] * 1e-9,
                "correct": correct[layout],
            })
        torch.cuda.empty_cache()
    if logs:
        print(f"geometric mean vs torch._grouped_mm (both layouts): "
              f"{math.exp(sum(logs) / len(logs)):.3f}, worst {math.exp(min(logs)):.3f}",
              flush=True)
    if args.json and args.mode == "bench":
        write_results(args.json, "grouped_gemm", results)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
