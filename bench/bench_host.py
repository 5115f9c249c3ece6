"""Host time per call of the Python ops, layer by layer: what a decode step pays on the CPU.

    torchrun --standalone --nproc-per-node=<ranks> bench/bench_host.py [--shapes MxNxK,...]

A small-M fused op runs on the GPU in tens of microseconds; if issuing it costs the host as
long, the GPU waits for the host and the op cannot be faster than the host path. For each
layer this prints the host microseconds per call (perf_counter around `calls` back-to-back
calls, no synchronisation inside, the GPU queue far from full) and, for the whole op, the GPU
time per call in eager mode and replayed from a CUDA graph (no host in the loop):
  torch.ops.mkernel.<op>   the custom op through PyTorch's dispatcher (what torch.compile sees)
  mkernel.<op>             the public function (eager)
  _C.<op>                  the C++ entry alone, arguments prepared (plan, checks, launch)
  torch matmul / NCCL      the sequential baseline's pieces, for scale
Ranks may share a GPU (then NCCL is skipped: it refuses two ranks on one GPU, and the GPU
times mean little). Rank 0 prints a table.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    import mkernel
    from mkernel import _C
except ImportError as e:  # pragma: no cover
    sys.exit(f"bench_host.py: cannot import mkernel ({e}); run `pip install .` first")


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def host_us(fn, calls):
    """Host microseconds per call of `calls` back-to-back calls (median of three rounds)."""
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[1]


def gpu_us(fn, calls, graph):
    """GPU microseconds per call: events around `calls` eager calls, or one replay of a graph
    holding them."""
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture (workspace allocation)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128x8192x8192,1024x8192x8192",
                   help="gemm_ar / gemm_rs shapes MxNxK (K: the whole K; each rank has K / world)")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > gpus
    if shared:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl",
                                device_id=torch.device("cuda", local_rank))
    comm = mkernel.init()
    world = dist.get_world_size()
    log(f"bench_host: {world} ranks on {gpus} GPU(s){' (shared: no NCCL)' if shared else ''}; "
        f"torch {torch.__version__}; {args.calls} calls a round")
    rows = []
    for spec in args.shapes.split(","):
        m, n, k = (int(x) for x in spec.split("x"))
        kl = k // world
        g = torch.Generator(device="cuda").manual_seed(7 + dist.get_rank())
        a = torch.rand((m, kl), device="cuda", generator=g).sub_(0.5).to(torch.bfloat16)
        b = torch.rand((n, kl), device="cuda", generator=g).sub_(0.5).to(torch.bfloat16)
        out = comm.alloc_tensor((m, n), torch.bfloat16)
        mkernel.gemm_ar(a, b, comm, out)  # the workspace
        ws = comm._workspace(_C.gemm_ar_workspace_bytes(comm._impl, m, n, kl, 0), "gemm_ar",
                             "accumulate")
        stream = comm._stream()
        c_args = (comm._impl, a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, kl, "nk",
                  ws.data_ptr(), stream, 0, False)
        partial = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        layers = {
            "torch.ops.mkernel.gemm_ar": lambda: torch.ops.mkernel.gemm_ar(
                a, b, out, "nk", comm._id, 0, False),
            "mkernel.gemm_ar": lambda: mkernel.gemm_ar(a, b, comm, out),
            "_C.gemm_ar": lambda: _C.gemm_ar(*c_args),
            "_C.gemm_ar_workspace_bytes": lambda: _C.gemm_ar_workspace_bytes(
                comm._impl, m, n, kl, 0),
            "mkernel.gemm_rs": lambda: mkernel.gemm_rs(a, b, comm),
            "mkernel.ag_gemm": lambda: mkernel.ag_gemm(a[: m // world], b, comm),
            "mkernel.gemm": lambda: mkernel.gemm(a, b),
            "torch matmul": lambda: torch.matmul(a, b.T, out=partial),
        }
        if not shared:
            layers["NCCL all_reduce"] = lambda: dist.all_reduce(partial)
        for name, fn in layers.items():
            for _ in range(3):
                fn()
            us = torch.tensor([host_us(fn, args.calls)], device="cuda")
            if not shared:
                dist.all_reduce(us, op=dist.ReduceOp.MAX)
            rows.append((spec, name, us.item()))
            log(f"  {spec:16s} {name:28s} host {us.item():7.1f} us/call")
        fused = lambda: mkernel.gemm_ar(a, b, comm, out)  # noqa: E731
        eager, graphed = gpu_us(fused, args.calls, False), gpu_us(fused, args.calls, True)
        log(f"  {spec:16s} {'mkernel.gemm_ar GPU':28s} eager {eager:7.1f} us/call, "
            f"CUDA graph {graphed:7.1f} us/call")
        del out
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
