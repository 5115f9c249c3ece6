"""Benchmark and check of the fused GEMM kernels against their baselines, in one run.

    torchrun --standalone --nproc-per-node=<GPUs> bench/bench_fused.py --kernel ag_gemm \\
        --mode bench|check [--json FILE] [--shapes MxNxK,...] [--iters N]

(bench/run.sh starts it this way.) One rank per GPU. For each shape (M, N, K), every variant
runs on the same fresh random inputs:
  mkernel         the fused op (mkernel.ag_gemm, mkernel.gemm_rs, mkernel.gemm_ar)
  gemm_alone      the GEMM alone through torch (cuBLAS), on the full operands
  comm_alone      the collective alone through torch.distributed (NCCL)
  sequential      the collective, then the GEMM (NCCL then cuBLAS)
  torch_async_tp  PyTorch's symmetric-memory fused op (torch.ops.symm_mem.*), where it exists
  mkernel_gemm    mkernel's GEMM engine alone (for reference)
  mkernel_graph   the fused op replayed from a CUDA graph of one call: the GPU's time without
                  the host's per-call work (Python, checks, launch), as in a graph-captured step
                  (BENCH_GRAPH=0 leaves it out)
Times: each variant runs `iters` times back to back between CUDA events (ranks keep themselves
in step through the collective, as in a training step), five rounds (--rounds) interleaved
across the variants; the median round, the maximum over ranks. limit = max(gemm_alone, comm_alone).
Correct: ag_gemm's output matches the sequential one within 2 bf16 ulps of its largest value
(and, check mode, the gathered A is bitwise NCCL's); gemm_rs's error against an fp32
reduce-scatter of fp32 products is at most twice the sequential one's (or one bf16 ulp).
Results (bench mode) go to --json per ../shared/BENCH_SCHEMA.md; rank 0 prints a table.
"""

import argparse
import datetime
import json
import os
import random
import sys

import torch
import torch.distributed as dist

try:
    import mkernel
except ImportError as e:  # pragma: no cover
    sys.exit(f"bench_fused.py: cannot import mkernel ({e}); run `pip install .` first")

SHAPES = {
    "ag_gemm": [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 2048, 8192),
                (8192, 28672, 8192), (2048, 8192, 8192)],
    "gemm_rs": [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 2048, 8192),
                (8192, 28672, 8192), (2048, 8192, 8192)],
    "gemm_ar": [(128, 8192, 8192), (1024, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 8192),
                (16384, 8192, 8192), (8192, 2048, 8192), (8192, 28672, 8192)],
}


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def time_variants(variants, iters, rounds):
    """({name: ms per call}, {name: spread}): the median over rounds of (events around `iters`
    back-to-back calls), max over ranks; spread = (slowest - fastest round) / median, max over
    ranks - how far one run can be trusted (the H200 host drifts by a few percent)."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    med = [sorted(t)[len(t) // 2] for t in times.values()]
    stats = torch.tensor(med + [(max(t) - min(t)) / m for t, m in zip(times.values(), med)],
                         device="cuda")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    n = len(times)
    values = stats.tolist()
    return dict(zip(times, values[:n])), dict(zip(times, values[n:]))


_RUN_SEED = 0  # drawn by rank 0 in main(): fresh inputs every run


def _rand(seed, shape):
    """A uniform [-0.5, 0.5) bf16 tensor on this GPU from `seed` (any rank can rebuild any
    rank's inputs: check mode's references need no collective)."""
    g = torch.Generator(device="cuda").manual_seed(seed % (1 << 62))
    return torch.rand(shape, device="cuda", generator=g).sub_(0.5).to(torch.bfloat16)


def _operands(base, rank, m, n, k, a_shape, b_shape):
    seed = (_RUN_SEED * 1000003 + base + 17 * rank + m + n + k)
    return _rand(seed, a_shape), _rand(seed + 1, b_shape)


def _reduced_reference(a_of, b_of, world, rows):
    """(fp32 sum over ranks of a_r @ b_r^T, and the sequential baseline: each rank's bf16 cuBLAS
    partial, summed in fp32 and rounded once, as NCCL sums them), rows `rows`, built here."""
    exact = sum(a_of(r).float()[rows] @ b_of(r).float().T for r in range(world))
    seq = sum((a_of(r)[rows] @ b_of(r).T).float() for r in range(world)).to(torch.bfloat16)
    return exact, seq


def close(got, want):
    """|got - want| <= 2 bf16 ulps of max |want| (both bf16 results of fp32-accumulated GEMMs)."""
    diff = (got.float() - want.float()).abs().max().item()
    mag = want.float().abs().max().item()
    return diff <= 2 * mag / 128, diff, mag


def ag_gemm_case(comm, m, n, k, mode, iters, sweep=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = m // world
    a_shard, b = _operands(1234, rank, m, n, k, (shard, k), (n, k))
    a_full = torch.empty((m, k), device="cuda", dtype=torch.bfloat16)

    def sequential():
        dist.all_gather_into_tensor(a_full, a_shard)
        return a_full @ b.T

    log(f"  {m}x{n}x{k}: {mkernel._C.ag_gemm_plan(comm._impl, m, n, k)}")
    ours, gathered = mkernel.ag_gemm(a_shard, b, comm, return_gathered=True)
    if mode == "check":  # the gathered A rebuilt here, bitwise; the product within 2 ulps
        a_ref = torch.cat([_operands(1234, r, m, n, k, (shard, k), (n, k))[0]
                           for r in range(world)])
        ok, diff, mag = close(ours, a_ref @ b.T)
        ok = ok and torch.equal(gathered.view(torch.int16), a_ref.view(torch.int16))
    else:
        ok, diff, mag = close(ours, sequential())
    variants = {
        "mkernel": lambda: mkernel.ag_gemm(a_shard, b, comm),
        "gemm_alone": lambda: a_full @ b.T,
        "comm_alone": lambda: dist.all_gather_into_tensor(a_full, a_shard),
        "sequential": sequential,
        "mkernel_gemm": lambda: mkernel.gemm(a_full, b),
    }
    async_tp = torch_async_tp_ag(a_shard, b) if mode == "bench" else None
    if async_tp is not None:
        variants["torch_async_tp"] = async_tp
    if sweep:  # configurations of the fused op, printed only
        for name, kw in (("pieces 16", {"piece_rows": 16}), ("pieces 64", {"piece_rows": 64}),
                         ("16 pushers", {"comm_ctas": 16}), ("32 pushers", {"comm_ctas": 32}),
                         ("64 pushers", {"comm_ctas": 64}), ("all push", {"comm_ctas": 1000})):
            variants["sweep: " + name] = (lambda kw=kw: mkernel.ag_gemm(a_shard, b, comm, **kw))
    return ok, diff, mag, variants


def gemm_rs_case(comm, m, n, k, mode, iters, sweep=False):
    """(M, N, K): K is the full reduction length; each rank holds A_r [M, K / w], B_r [N, K / w]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kl = k // world
    log(f"  {m}x{n}x{k}: {mkernel._C.gemm_rs_plan(comm._impl, m, n, kl)}")
    a, b = _operands(4321, rank, m, n, k, (m, kl), (n, kl))
    out = torch.empty((m // world, n), device="cuda", dtype=torch.bfloat16)

    def sequential():
        dist.reduce_scatter_tensor(out, a @ b.T)
        return out

    ours = mkernel.gemm_rs(a, b, comm)
    if mode == "check":  # references built here from every rank's operands, no collective
        rows = slice(rank * (m // world), (rank + 1) * (m // world))
        ops = [_operands(4321, r, m, n, k, (m, kl), (n, kl)) for r in range(world)]
        ref, seq = _reduced_reference(lambda r: ops[r][0], lambda r: ops[r][1], world, rows)
    else:
        seq = sequential().clone()
        # fp32 reference: fp32 partial products reduce-scattered in fp32.
        ref = torch.empty((m // world, n), device="cuda", dtype=torch.float32)
        dist.reduce_scatter_tensor(ref, a.float() @ b.float().T)
    err = (ours.float() - ref).abs().max().item()
    err_seq = (seq.float() - ref).abs().max().item()
    mag = ref.abs().max().item()
    ok = err <= max(2 * err_seq, mag / 256)  # within twice NCCL-then-cuBLAS's error, or 1 ulp
    partial = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    variants = {
        "mkernel": lambda: mkernel.gemm_rs(a, b, comm),
        "gemm_alone": lambda: torch.matmul(a, b.T, out=partial),
        "comm_alone": lambda: dist.reduce_scatter_tensor(out, partial),
        "sequential": sequential,
        "mkernel_gemm": lambda: mkernel.gemm(a, b),
    }
    async_tp = torch_async_tp_rs(a, b) if mode == "bench" else None
    if async_tp is not None:
        variants["torch_async_tp"] = async_tp
    if sweep:
        for name, kw in (("n128", {"block_n": 128}), ("n192", {"block_n": 192}),
                         ("n256", {"block_n": 256})):
            variants["sweep: " + name] = (lambda kw=kw: mkernel.gemm_rs(a, b, comm, **kw))
        if world == 2:
            # The opt-in bf16 partials (one workspace for both formats: one partial per slice,
            # nothing to zero between them)
            variants["sweep: bf16 partials"] = (
                lambda: mkernel.gemm_rs(a, b, comm, bf16_partials=True))
            # A busy staging slot waited for, instead of the slice sent straight by TMA stores
            variants["sweep: tma_sends0"] = (lambda: mkernel.gemm_rs(a, b, comm, tma_sends=False))
    return ok, err, mag, variants


_ASYNC_TP_NOTE = None
_NUM_NODES = 1  # the communicator's (virtual) nodes, set in main()


def gemm_ar_case(comm, m, n, k, mode, iters, sweep=False):
    """(M, N, K): K is the full reduction length; each rank holds A_r [M, K / w], B_r [N, K / w];
    every rank ends with the [M, N] sum. No PyTorch async-TP op exists for this one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kl = k // world
    log(f"  {m}x{n}x{k}: {mkernel._C.gemm_ar_plan(comm._impl, m, n, kl)}")
    a, b = _operands(5555, rank, m, n, k, (m, kl), (n, kl))
    out = comm.alloc_tensor((m, n), torch.bfloat16)
    partial = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)

    def sequential():
        torch.matmul(a, b.T, out=partial)
        dist.all_reduce(partial)
        return partial

    mkernel.gemm_ar(a, b, comm, out)
    if mode == "check":  # references built here from every rank's operands, no collective
        ops = [_operands(5555, r, m, n, k, (m, kl), (n, kl)) for r in range(world)]
        ref, seq = _reduced_reference(lambda r: ops[r][0], lambda r: ops[r][1], world,
                                      slice(0, m))
    else:
        seq = sequential().clone()
        ref = a.float() @ b.float().T
        dist.all_reduce(ref)
    err = (out.float() - ref).abs().max().item()
    err_seq = (seq.float() - ref).abs().max().item()
    mag = ref.abs().max().item()
    ok = err <= max(2 * err_seq, mag / 256)  # within twice NCCL-then-cuBLAS's error, or 1 ulp
    variants = {
        "mkernel": lambda: mkernel.gemm_ar(a, b, comm, out),
        "gemm_alone": lambda: torch.matmul(a, b.T, out=partial),
        "comm_alone": lambda: dist.all_reduce(partial),
        "sequential": sequential,
        "mkernel_gemm": lambda: mkernel.gemm(a, b),
    }
    if sweep:
        for name, kw in (("n64", {"block_n": 64}), ("n128", {"block_n": 128}),
                         ("n256", {"block_n": 256})):
            variants["sweep: " + name] = (lambda kw=kw: mkernel.gemm_ar(a, b, comm, out, **kw))
        if world == 2:
            variants["sweep: bf16 partials"] = (
                lambda: mkernel.gemm_ar(a, b, comm, out, bf16_partials=True))
            # The threads' stores (no outbox) or the side threads (outbox) instead of TMA sends
            variants["sweep: tma_sends0"] = (
                lambda: mkernel.gemm_ar(a, b, comm, out, tma_sends=False))
    return ok, err, mag, variants


def torch_async_tp(make_call):
    """PyTorch's symmetric-memory fused op as a callable (make_call(group_name) -> call), run
    once to check it works here; None (with the reason noted in the results) when it does not."""
    global _ASYNC_TP_NOTE
    if _NUM_NODES > 1:  # symmetric memory spans one node; across nodes there is no such op
        _ASYNC_TP_NOTE = f"torch async-TP: intra-node only (this run spans {_NUM_NODES} nodes)"
        return None
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401 - registers the ops
        run = make_call(dist.group.WORLD.group_name)
        run()
        torch.cuda.synchronize()
        return run
    except Exception as e:  # noqa: BLE001 - any failure: the baseline is reported as missing
        _ASYNC_TP_NOTE = f"torch async-TP unavailable: {type(e).__name__}: {e}"
        log(_ASYNC_TP_NOTE)
        return None


def torch_async_tp_ag(a_shard, b):
    bt = b.T
    return torch_async_tp(lambda group: lambda: torch.ops.symm_mem.fused_all_gather_matmul(
        a_shard, [bt], gather_dim=0, group_name=group))


def torch_async_tp_rs(a, b):
    bt = b.T
    return torch_async_tp(lambda group: lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
        a, bt, "sum", scatter_dim=0, group_name=group))


CASES = {"ag_gemm": ag_gemm_case, "gemm_rs": gemm_rs_case, "gemm_ar": gemm_ar_case}


ROW_KEYS = ("mkernel", "gemm_alone", "comm_alone", "sequential", "torch_async_tp", "mkernel_gemm",
            "mkernel_graph")


def row_keys(ms):
    return [key for key in ROW_KEYS if key in ms]


def agree_on_run(seed):
    """(seed, whether to time the graph replay) as rank 0 has them, so that every rank runs the
    same collectives (the other nodes do not see this one's BENCH_GRAPH)."""
    chosen = [seed, os.environ.get("BENCH_GRAPH", "1") != "0"]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0], chosen[1]


def graphed(fn):
    """fn's one call captured into a CUDA graph, as its replay; None on every rank if capture
    failed on any (the ranks must time the same variants: the op waits for its peers)."""
    replay, why = None, ""
    try:
        fn()  # warm: workspaces are allocated before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        replay = graph.replay
    except Exception as e:  # noqa: BLE001 - any failure: the variant is left out, with the reason
        why = f"{type(e).__name__}: {e}"
    ok = torch.tensor([0 if replay is None else 1], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        log(f"  mkernel_graph left out: capture failed on a rank{' (' + why + ')' if why else ''}")
        return None
    return replay


def parse_shapes(text):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", required=True, choices=sorted(CASES))
    ap.add_argument("--mode", choices=["check", "bench"], default="bench")
    ap.add_argument("--json")
    ap.add_argument("--shapes", help="MxNxK,... (default: the kernel's issue list)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true",
                    help="also time other configurations of the fused op - tile widths; ag_gemm "
                         "pieces and pushers; gemm_rs / gemm_ar with two ranks bf16 partials and "
                         "tma_sends=False (printed, not saved)")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    shared = local_world > gpus  # ranks share GPUs: NCCL refuses them, timings say nothing
    device = local_rank % gpus
    torch.cuda.set_device(device)
    if shared and args.mode == "bench":
        sys.exit(f"bench_fused.py: {local_world} ranks on {gpus} GPU(s): timings need one GPU "
                 "per rank (check mode runs with ranks sharing GPUs)")
    if shared:  # check mode: its references are built without collectives
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", device))
    global _RUN_SEED
    _RUN_SEED, with_graph = agree_on_run(random.randrange(1 << 31))
    comm = mkernel.init()
    world = dist.get_world_size()
    global _NUM_NODES
    _NUM_NODES = comm.num_nodes
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES[args.kernel]
    if args.mode == "check":
        shapes = [(max(world, m // 8 // world * world), n // 4, k // 4) for m, n, k in shapes]
    log(f"{args.kernel} {args.mode}: world {world} ({comm.num_nodes} node(s)"
        f"{f', {local_world} ranks on {gpus} GPU(s)' if shared else ''}), "
        f"{torch.cuda.get_device_name()}, seed {_RUN_SEED}, "
        f"mkernel {mkernel.__version__}, torch {torch.__version__}")
    rows, all_ok = [], True
    header = (f"{'shape (MxNxK)':<20} {'mkernel':>8} {'gemm':>8} {'comm':>8} {'seq':>8} "
              f"{'asyncTP':>8} {'limit':>8} {'ratio':>6} {'vs seq':>6} {'vs aTP':>6}  check")
    for i, (m, n, k) in enumerate(shapes):
        ok, diff, mag, variants = CASES[args.kernel](comm, m, n, k, args.mode, args.iters,
                                                     args.sweep)
        # Every rank checked its own output (gemm_rs: its slice): correct only if all are.
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
        all_ok &= ok
        label = f"{m}x{n}x{k}"
        if args.mode == "check":
            log(f"[{i + 1}/{len(shapes)}] {label:<20} max |mkernel - sequential| {diff:.4g} "
                f"(max |C| {mag:.4g})  {'ok' if ok else 'WRONG'}")
            continue
        replay = graphed(variants["mkernel"]) if with_graph else None
        if replay is not None:
            variants["mkernel_graph"] = replay
        ms, spread = time_variants(variants, args.iters, args.rounds)
        limit = max(ms["gemm_alone"], ms["comm_alone"])
        row = {
            "shape": {"M": m, "N": n, "K": k}, "dtype": "bf16",
            "ms": {key: ms.get(key) for key in ROW_KEYS},
            "limit_ms": limit,
            "ratio_to_limit": ms["mkernel"] / limit,
            "speedup_vs_sequential": ms["sequential"] / ms["mkernel"],
            "speedup_vs_torch_async_tp": (ms["torch_async_tp"] / ms["mkernel"]
                                          if "torch_async_tp" in ms else None),
            # A GPU's share: ag_gemm multiplies all of K on every rank; gemm_rs and gemm_ar
            # reduce over K, each rank multiplying its K / world.
            "tflops": 2 * m * n * (k if args.kernel == "ag_gemm" else k // world)
                      / ms["mkernel"] * 1e-9,
            "spread": {key: round(spread[key], 4) for key in row_keys(ms)},
            "correct": bool(ok),
        }
        rows.append(row)
        if i == 0:
            log(header)
        atp = ms.get("torch_async_tp")
        log(f"{label:<20} {ms['mkernel']:8.3f} {ms['gemm_alone']:8.3f} {ms['comm_alone']:8.3f} "
            f"{ms['sequential']:8.3f} {atp if atp else float('nan'):8.3f} {limit:8.3f} "
            f"{row['ratio_to_limit']:6.3f} {row['speedup_vs_sequential']:6.3f} "
            f"{row['speedup_vs_torch_async_tp'] or float('nan'):6.3f}  {'ok' if ok else 'WRONG'}"
            f"  [{len(rows)}/{len(shapes)}]")
        if "mkernel_graph" in ms:
            log(f"  {label}: mkernel from a CUDA graph {ms['mkernel_graph']:.3f} (eager "
                f"{ms['mkernel']:.3f}; the difference is the host's per-call work)")
        sweep = [f"{key[7:]} {v:.3f}" for key, v in ms.items() if key.startswith("sweep: ")]
        if sweep:
            log(f"  sweep {label}: mkernel {ms['mkernel']:.3f}, engine alone "
                f"{ms['mkernel_gemm']:.3f}, " + ", ".join(sweep))
    if rows:
        worst = max(max(r["spread"].values()) for r in rows)
        log(f"spread between rounds (max over variants and shapes): {100 * worst:.1f}%")
        log("summary: ratio_to_limit " + ", ".join(f"{r['ratio_to_limit']:.3f}" for r in rows) +
            "; speedup vs sequential " +
            ", ".join(f"{r['speedup_vs_sequential']:.2f}" for r in rows))
    if args.json and rows:
        write_results(args.json, args.kernel, comm, rows, notes=_ASYNC_TP_NOTE)
    return finish(comm, all_ok)


def write_results(path, kernel, comm, rows, **extra):
    """Rank 0 writes the results file (../shared/BENCH_SCHEMA.md): the run's header, `extra`'s
    fields, the rows."""
    if dist.get_rank() != 0:
        return
    doc = {
        "kernel": kernel,
        "commit": os.environ.get("MKERNEL_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(),
        "world_size": dist.get_world_size(),
        "num_nodes": comm.num_nodes,
        "transport": ("nvlink" if comm.num_nodes == 1 else
                      "nvlink+" + os.environ.get("MKERNEL_TRANSPORT", "default backend")),
    } | extra | {"rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    log(f"wrote {path}")


def finish(comm, all_ok):
    """The run's end on every rank (the kernels done, the group gone): the exit status."""
    comm.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
