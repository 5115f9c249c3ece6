"""The expert- and sequence-parallel kernels across GPUs against their NCCL baselines, in one run.

    torchrun --standalone --nproc-per-node=<GPUs> bench/bench_dist.py \\
        --kernel moe_dispatch_gemm|moe_layer|ring_attention --mode bench|check [--json FILE] \\
        [--points ...] [--iters N] [--rounds N]

(bench/run.sh starts it this way on a machine with several GPUs, or across nodes.) One rank per
GPU. The baselines are bench/dist_baselines.py's (NCCL for the communication, torch for the
compute; tests/python/test_dist_baselines.py holds them to references). Columns
(../shared/BENCH_SCHEMA.md):
  moe_dispatch_gemm  points MODEL:TOKENS a rank (DeepSeek-V3, Qwen3-235B, Mixtral; 128, 1024, 4096
                     and 8192 tokens a rank, uniform routing, every expert somewhere)
    mkernel          mkernel.moe_dispatch_gemm (padded layout)
    dispatch_alone   mkernel.moe_dispatch;  combine_alone: mkernel.moe_combine of its rows
    nccl_dispatch    the routed tokens by all_to_all_single (counts, split sizes on the host,
                     rows, routing)
    gemm_alone       torch._grouped_mm on the dispatched rows, expert-major
    sequential       nccl_dispatch, the rows expert-major, torch._grouped_mm
    limit = max(gemm_alone, the faster dispatch); dispatch_gbps / combine_gbps: the bytes of the
    rows that cross between ranks (dispatch: received from the others, one row a token and rank;
    combine: sent back to them, one row a token and slot) per rank, over the op's time
  moe_layer          the same points (H, I = the expert's intermediate)
    mkernel          mkernel.moe_layer
    sequential       NCCL dispatch, grouped gate / up, SwiGLU, grouped down, each token's rows
                     summed per rank with their weights, back by all_to_all_single, summed
    compute_alone    the sequential's GEMMs and SwiGLU on the dispatched rows
    dispatch_combine_alone  mkernel.moe_dispatch + moe_combine;  nccl_dispatch_combine: the
                     sequential's communication alone (its dispatch, then its combine of the rows)
    limit = max(compute_alone, the faster dispatch + combine); torch_reference: null (the
    one-GPU file has it)
  ring_attention     points B:H:H_kv:S_local:D:causal (default S_local 4096 and 8192, D 128,
                     (1, 32, 8) and (4, 16, 16), zigzag causal and contiguous non-causal)
    mkernel          mkernel.ring_attention
    torch_sdpa       SDPA of this rank's queries against every key (the keys gathered before) on
                     its fastest backend of flash, cuDNN and memory-efficient, which the row
                     names; causal: each zigzag chunk as torch's context parallelism does it (the
                     keys before it unmasked, its own keys causal, merged by log-sum-exp)
    comm_alone       NCCL's all-gather of K and V (all_gather_into_tensor): the ring's traffic;
                     mkernel_all_gather: mkernel's (Communicator.all_gather; one node)
    sequential       NCCL's all-gather of K and V, in sequence order, then SDPA
    limit = max(torch_sdpa, the faster all-gather)
mkernel_graph (every kernel): the fused op replayed from a CUDA graph of one call. Check mode:
the correctness at smaller points (128 and 4096 tokens; S_local 4096, causal and not), and every
variant run once.
Times: bench_fused.py's (each variant `iters` times back to back between CUDA events, rounds
interleaved, the median round, the maximum over ranks). Correct: mkernel against the sequential
baseline - moe_dispatch_gemm's rows in the same (source, token, slot) order and within 2 bf16 ulps
of the largest; moe_layer's output within 3; ring_attention's within 2^-6 of the largest.
"""

import argparse
import math
import os
import random
import sys

import torch
import torch.distributed as dist

try:
    import mkernel
except ImportError as e:  # pragma: no cover
    sys.exit(f"bench_dist.py: cannot import mkernel ({e}); run `pip install .` first")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_baselines as base  # noqa: E402
from bench_fused import (agree_on_run, finish, graphed, log, time_variants,  # noqa: E402
                         write_results)

MOE_MODELS = {  # hidden, N / intermediate, experts, top-k
    "deepseek_v3": (7168, 2048, 256, 8),
    "qwen3_235b": (4096, 1536, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
MOE_TOKENS = (128, 1024, 4096, 8192)
RING_POINTS = [(b, h, h_kv, s, 128, causal) for s in (4096, 8192) for causal in (True, False)
               for b, h, h_kv in ((1, 32, 8), (4, 16, 16))]


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed % (1 << 62))


def _bf16(g, shape, scale=1.0):
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def _close(got, want, ulps):
    diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    mag = want.float().abs().max().item() if want.numel() else 0.0
    return diff <= ulps * mag / 128, diff, mag


def _moe_inputs(seed, rank, model, tokens):
    hidden, n, experts, top_k = MOE_MODELS[model]
    g = _gen(seed * 7919 + rank)
    x = _bf16(g, (tokens, hidden))
    idx = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return x, idx, weights, g


def _iters(flops):
    return max(3, min(50, int(2e11 / max(flops, 1.0))))


def _mean_over_ranks(value):
    t = torch.tensor([float(value)], device="cuda")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def moe_dispatch_gemm_point(comm, seed, model, tokens, mode):
    hidden, n, experts, top_k = MOE_MODELS[model]
    rank, world = dist.get_rank(), dist.get_world_size()
    e_local = experts // world
    x, idx, weights, g = _moe_inputs(seed, rank, model, tokens)
    w = _bf16(g, (e_local, n, hidden), 0.02)
    w_t = w.transpose(1, 2)
    y, expert_rows, handle = mkernel.moe_dispatch_gemm(x, idx, w, comm, experts)
    y_seq, em = base.moe_gemm_seq(x, idx, w_t, experts)
    comm.synchronize()
    placed = handle.rows[:, 0] >= 0
    ok = torch.equal(handle.rows[placed].long(), em.who)  # (False on a row count mismatch too)
    diff, mag = math.inf, 0.0
    if ok:
        ok, diff, mag = _close(y[placed], y_seq, 2)
    d = base.nccl_dispatch(x, idx, experts)
    rows_em = d.recv.index_select(0, em.row)
    recv, _, hd = mkernel.moe_dispatch(x, idx, comm, experts)
    variants = {
        "mkernel": lambda: mkernel.moe_dispatch_gemm(x, idx, w, comm, experts),
        "dispatch_alone": lambda: mkernel.moe_dispatch(x, idx, comm, experts),
        "combine_alone": lambda: mkernel.moe_combine(recv, weights, hd, comm),
        "nccl_dispatch": lambda: base.nccl_dispatch(x, idx, experts),
        "gemm_alone": lambda: base.grouped_mm(rows_em, w_t, em.offs),
        "sequential": lambda: base.moe_gemm_seq(x, idx, w_t, experts),
    }
    crossing_in = sum(d.recv_splits) - d.recv_splits[rank]  # rows from the other ranks
    crossing_back = int(((hd.rows[:, 0] >= 0) & (hd.rows[:, 0] != rank)).sum().item())
    info = {
        "shape": {"tokens_per_rank": tokens, "hidden": hidden, "N": n, "experts": experts,
                  "top_k": top_k, "model": model},
        "flops": 2.0 * int(expert_rows.sum().item()) * n * hidden,  # this rank's routed rows
        "bytes_in": _mean_over_ranks(crossing_in * hidden * 2),
        "bytes_back": _mean_over_ranks(crossing_back * hidden * 2),
    }
    return bool(ok), diff, mag, variants, info


def moe_dispatch_gemm_row(ms, info):
    limit = max(ms["gemm_alone"], min(ms["dispatch_alone"], ms["nccl_dispatch"]))
    return {
        "ms": {k: ms.get(k) for k in ("mkernel", "dispatch_alone", "combine_alone",
                                      "nccl_dispatch", "gemm_alone", "sequential",
                                      "mkernel_graph")},
        "limit_ms": limit,
        "ratio_to_limit": ms["mkernel"] / limit,
        "speedup_vs_sequential": ms["sequential"] / ms["mkernel"],
        "dispatch_gbps": info["bytes_in"] / ms["dispatch_alone"] * 1e-6,
        "combine_gbps": info["bytes_back"] / ms["combine_alone"] * 1e-6,
    }


def moe_layer_point(comm, seed, model, tokens, mode):
    hidden, inter, experts, top_k = MOE_MODELS[model]
    rank, world = dist.get_rank(), dist.get_world_size()
    e_local = experts // world
    x, idx, weights, g = _moe_inputs(seed, rank, model, tokens)
    w13 = _bf16(g, (e_local, 2 * inter, hidden), hidden ** -0.5)
    w2 = _bf16(g, (e_local, hidden, inter), inter ** -0.5)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    out = mkernel.moe_layer(x, idx, weights, w13, w2, comm, experts)
    out_seq = base.moe_layer_seq(x, idx, weights, w13_t, w2_t, experts)
    comm.synchronize()
    ok, diff, mag = _close(out, out_seq, 3)
    d = base.nccl_dispatch(x, idx, experts, weights=weights)
    em = base.expert_major(d, rank, e_local)
    rows_em = d.recv.index_select(0, em.row)

    def compute():
        gate_up = base.grouped_mm(rows_em, w13_t, em.offs)
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return base.grouped_mm(h, w2_t, em.offs)

    def mk_comm():
        r, _, hd = mkernel.moe_dispatch(x, idx, comm, experts)
        return mkernel.moe_combine(r, weights, hd, comm)

    def nccl_comm():
        dd = base.nccl_dispatch(x, idx, experts, weights=weights)
        ee = base.expert_major(dd, rank, e_local)
        return base.moe_combine_seq(dd.recv.index_select(0, ee.row), dd, ee, tokens)

    variants = {
        "mkernel": lambda: mkernel.moe_layer(x, idx, weights, w13, w2, comm, experts),
        "sequential": lambda: base.moe_layer_seq(x, idx, weights, w13_t, w2_t, experts),
        "compute_alone": compute,
        "dispatch_combine_alone": mk_comm,
        "nccl_dispatch_combine": nccl_comm,
    }
    info = {
        "shape": {"tokens_per_rank": tokens, "hidden": hidden, "intermediate": inter,
                  "experts": experts, "top_k": top_k, "model": model},
        "flops": 6.0 * int(em.counts.sum().item()) * hidden * inter,
    }
    return bool(ok), diff, mag, variants, info


def moe_layer_row(ms, info):
    limit = max(ms["compute_alone"],
                min(ms["dispatch_combine_alone"], ms["nccl_dispatch_combine"]))
    return {
        "ms": {k: ms.get(k) for k in ("mkernel", "sequential", "compute_alone",
                                      "dispatch_combine_alone", "nccl_dispatch_combine",
                                      "mkernel_graph")} | {"torch_reference": None},
        "limit_ms": limit,
        "ratio_to_limit": ms["mkernel"] / limit,
        "speedup_vs_sequential": ms["sequential"] / ms["mkernel"],
    }


def ring_attention_point(comm, seed, point, mode):
    b, h, h_kv, s_local, d, causal = point
    rank, world = dist.get_rank(), dist.get_world_size()
    g = _gen(seed * 7919 + rank)
    q = _bf16(g, (b, s_local, h, d))
    k = _bf16(g, (b, s_local, h_kv, d))
    v = _bf16(g, (b, s_local, h_kv, d))
    out = mkernel.ring_attention(q, k, v, comm, causal=causal)
    k_seq, v_seq = base.gather_kv(k, v, causal)
    out_seq = base.sdpa_local(q, k_seq, v_seq, causal, rank, world)
    comm.synchronize()
    diff = (out.float() - out_seq.float()).abs().max().item()
    mag = out_seq.float().abs().max().item()
    # Each row within 4 bf16 steps of its own largest |O|: a causal sequence's first rows dwarf
    # its last ones, so a bound on the whole tensor's largest |O| would not see wrong late rows.
    row_diff = (out.float() - out_seq.float()).abs().amax(dim=-1)
    row_mag = out_seq.float().abs().amax(dim=-1)
    ok = bool((row_diff <= row_mag / 64 + 1e-4).all().item())
    k_parts = k.new_empty(world * b, *k.shape[1:])
    v_parts = torch.empty_like(k_parts)
    backend = best_sdpa_backend(q, k_seq, v_seq, causal, rank, world)

    def nccl_gather():
        dist.all_gather_into_tensor(k_parts, k)
        dist.all_gather_into_tensor(v_parts, v)

    def sequential():
        ks, vs = base.gather_kv(k, v, causal)
        return base.sdpa_local(q, ks, vs, causal, rank, world, backend)

    variants = {
        "mkernel": lambda: mkernel.ring_attention(q, k, v, comm, causal=causal),
        "torch_sdpa": lambda: base.sdpa_local(q, k_seq, v_seq, causal, rank, world, backend),
        "comm_alone": nccl_gather,
        "sequential": sequential,
    }
    if comm.num_nodes == 1:  # (mkernel's collectives: one node, outputs in symmetric memory)
        k_sym = comm.alloc_tensor(tuple(k_parts.shape), k.dtype)
        v_sym = comm.alloc_tensor(tuple(k_parts.shape), k.dtype)

        def mk_gather():
            comm.all_gather(k, k_sym)
            comm.all_gather(v, v_sym)

        variants["mkernel_all_gather"] = mk_gather
    s_total = world * s_local
    flops = 4.0 * b * h * s_local * s_total * d * (0.5 if causal else 1.0)
    info = {
        "shape": {"batch": b, "heads": h, "kv_heads": h_kv, "seq_local": s_local,
                  "head_dim": d, "causal": causal, "world": world},
        "flops": flops,
        "sdpa_backend": backend.name.lower() + (" (chunks merged by log-sum-exp)"
                                                if causal else ""),
    }
    return bool(ok), diff, mag, variants, info


def best_sdpa_backend(q, k_seq, v_seq, causal, rank, world):
    """SDPA's fastest backend for sdpa_local among flash, cuDNN and memory-efficient (rank 0's
    timing, the same on every rank)."""
    from torch.nn.attention import SDPBackend
    times = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        try:
            fn = lambda: base.sdpa_local(q, k_seq, v_seq, causal, rank, world, backend)  # noqa
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            end.synchronize()
            times[backend] = start.elapsed_time(end)
        except RuntimeError:  # the backend does not run this shape here
            continue
    pick = [min(times, key=times.get) if times else None]
    dist.broadcast_object_list(pick, src=0)
    return pick[0]


def ring_attention_row(ms, info):
    limit = max(ms["torch_sdpa"], min(ms["comm_alone"], ms.get("mkernel_all_gather", math.inf)))
    return {
        "sdpa_backend": info["sdpa_backend"],
        "ms": {k: ms.get(k) for k in ("mkernel", "torch_sdpa", "comm_alone", "mkernel_all_gather",
                                      "sequential", "mkernel_graph")},
        "limit_ms": limit,
        "ratio_to_limit": ms["mkernel"] / limit,
        "speedup_vs_sequential": ms["sequential"] / ms["mkernel"],
        "speedup_vs_torch_sdpa": ms["torch_sdpa"] / ms["mkernel"],
    }


KERNELS = {
    "moe_dispatch_gemm": (moe_dispatch_gemm_point, moe_dispatch_gemm_row),
    "moe_layer": (moe_layer_point, moe_layer_row),
    "ring_attention": (ring_attention_point, ring_attention_row),
}


def points_of(kernel, text, mode):
    if kernel == "ring_attention":
        if text:
            pts = []
            for p in text.split(","):
                b, h, h_kv, s, d, c = p.split(":")
                pts.append((int(b), int(h), int(h_kv), int(s), int(d), c in ("1", "true", "causal")))
            return pts
        return [RING_POINTS[0], RING_POINTS[2]] if mode == "check" else RING_POINTS
    if text:
        pts = [(p.split(":")[0], int(p.split(":")[1])) for p in text.split(",")]
        unknown = [m for m, _ in pts if m not in MOE_MODELS]
        if unknown:
            sys.exit(f"bench_dist.py: unknown model {unknown[0]} (known: {', '.join(MOE_MODELS)})")
        return pts
    tokens = (128, 4096) if mode == "check" else MOE_TOKENS
    world = dist.get_world_size()
    models = [m for m, (_, _, experts, _) in MOE_MODELS.items() if experts % world == 0]
    if len(models) < len(MOE_MODELS):
        log(f"bench_dist.py: world {world}: left out "
            f"{', '.join(m for m in MOE_MODELS if m not in models)} (experts not a multiple)")
    return [(m, t) for m in models for t in tokens]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", required=True, choices=sorted(KERNELS))
    ap.add_argument("--mode", choices=["check", "bench"], default="bench")
    ap.add_argument("--json")
    ap.add_argument("--points", help="MODEL:TOKENS,... (MoE) or B:H:H_kv:S_local:D:causal,...")
    ap.add_argument("--iters", type=int, default=0, help="calls a timing (0: from the FLOPs)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        sys.exit(f"bench_dist.py: {local_world} ranks on {gpus} GPU(s): one GPU per rank (the "
                 "baselines are NCCL's; ranks sharing a GPU: bench_moe_ranks, "
                 "bench_ring_attention)")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    pinned = os.environ.get("MKERNEL_BENCH_SEED", "")
    seed, with_graph = agree_on_run(int(pinned) if pinned else random.randrange(1 << 31))
    comm = mkernel.init()
    world = dist.get_world_size()
    point_fn, row_fn = KERNELS[args.kernel]
    points = points_of(args.kernel, args.points, args.mode)
    log(f"{args.kernel} {args.mode}: world {world} ({comm.num_nodes} node(s)), "
        f"{torch.cuda.get_device_name()}, seed {seed}, mkernel {mkernel.__version__}, "
        f"torch {torch.__version__}")
    rows, all_ok, logs = [], True, []
    for i, point in enumerate(points):
        ok, diff, mag, variants, info = point_fn(comm, seed + i, *(
            point if args.kernel != "ring_attention" else (point,)), args.mode)
        ok_all = torch.tensor([1 if ok else 0], device="cuda")
        dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
        ok = bool(ok_all.item())
        all_ok &= ok
        label = ":".join(str(p) for p in (point if isinstance(point, tuple) else (point,)))
        if args.mode == "check":  # (every variant once: bench mode must not be the first run)
            for fn in variants.values():
                fn()
            torch.cuda.synchronize()
            log(f"[{i + 1}/{len(points)}] {label:<28} max |mkernel - sequential| {diff:.4g} "
                f"(max {mag:.4g})  {'ok' if ok else 'WRONG'}")
            continue
        replay = graphed(variants["mkernel"]) if with_graph else None
        if replay is not None:
            variants["mkernel_graph"] = replay
        flops = _mean_over_ranks(info["flops"])
        ms, spread = time_variants(variants, args.iters or _iters(flops), args.rounds)
        row = {"shape": info["shape"], "dtype": "bf16"} | row_fn(ms, info) | {
            "tflops": flops / ms["mkernel"] * 1e-9,
            "spread": {key: round(value, 4) for key, value in spread.items()},
            "correct": ok,
        }
        rows.append(row)
        logs.append(math.log(row["speedup_vs_sequential"]))
        parts = ", ".join(f"{key} {value:.3f}" for key, value in row["ms"].items()
                          if value is not None)
        log(f"[{len(rows)}/{len(points)}] {label}: {parts}; ratio_to_limit "
            f"{row['ratio_to_limit']:.3f}, vs sequential {row['speedup_vs_sequential']:.3f}"
            + (f", dispatch {row['dispatch_gbps']:.0f} / combine {row['combine_gbps']:.0f} GB/s"
               if "dispatch_gbps" in row else "") + f"  {'ok' if ok else 'WRONG'}")
        torch.cuda.empty_cache()
    if logs:
        log(f"geometric mean vs sequential {math.exp(sum(logs) / len(logs)):.3f}, worst "
            f"{math.exp(min(logs)):.3f}")
    if args.json and rows:
        write_results(args.json, args.kernel, comm, rows, seed=seed)
    return finish(comm, all_ok)


if __name__ == "__main__":
    sys.exit(main())
