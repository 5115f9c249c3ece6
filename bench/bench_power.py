"""Sustained time, SM clock and board power of our GEMMs beside the vendor's, one GPU.

    python3 bench/bench_power.py [SHAPE...] [--seconds S] [--rounds R]

Short timings (a few dozen calls) run at whatever clock the card has in hand; a large GEMM run
for seconds reaches the board's power limit (700 W on the H100 SXM and the H200), and from then
on its rate is its clock, which the limit sets from the energy each cycle spends. Two kernels
that take the same cycles can then differ in time. For each shape and op this runs the op for
1 s to reach that steady state, then for --seconds more while a thread samples the SM clock and
the power every 50 ms (torch.cuda.clock_rate / power_draw, NVML), and prints the time per call
(CUDA events over the whole run), TFLOP/s, the mean clock and the mean power. The ops
alternate, --rounds times. Shapes (default: all):

    mixtral4096 / mixtral8192   grouped, 8 experts, 8192 / 16384 rows, N 14336, K 4096
    qwen4096                    grouped, 128 experts, 32768 rows, N 1536, K 4096
    dense8192                   dense 8192 x 8192 x 8192 ('nk')
    dense8192x28672             dense 8192 x 28672 x 8192 ('nk')

Grouped: mkernel.grouped_gemm against torch._grouped_mm on the same rows (multinomial counts);
dense: mkernel.gemm against torch's matmul (cuBLAS). Not a results file: the journal quotes it
(docs/PERFORMANCE.md, 2026-12-07).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

import mkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped import bench_seed  # noqa: E402

GROUPED = {  # name: experts, rows, N, K
    "mixtral4096": (8, 8192, 14336, 4096),
    "mixtral8192": (8, 16384, 14336, 4096),
    "qwen4096": (128, 32768, 1536, 4096),
}
DENSE = {"dense8192": (8192, 8192, 8192), "dense8192x28672": (8192, 28672, 8192)}


def make_ops(name, dev):
    """(flops, {label: fn}) for a shape: ours first, the vendor's second."""
    if name in DENSE:
        m, n, k = DENSE[name]
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        return 2.0 * m * n * k, {"mkernel": lambda: mkernel.gemm(a, b),
                                 "cublas": lambda: a @ b.t()}
    experts, rows, n, k = GROUPED[name]
    counts = torch.distributions.Multinomial(rows, torch.ones(experts)).sample().int()
    group_rows = counts.to(dev)
    offs = torch.cumsum(group_rows, 0, dtype=torch.int32)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.05
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    wt = w.transpose(-2, -1)
    return 2.0 * rows * n * k, {"mkernel": lambda: mkernel.grouped_gemm(a, w, group_rows),
                                "torch_grouped_mm": lambda: torch._grouped_mm(a, wt, offs=offs)}


def run_for(fn, seconds):
    """Calls fn in batches of 10 for about `seconds`; returns the number of calls."""
    calls, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            fn()
        calls += 10
        if calls % 50 == 0:
            torch.cuda.synchronize()  # keep the queue short: the clock reads the present
    return calls


def sustained(fn, seconds):
    """(ms a call, mean SM MHz, mean W) of fn run for `seconds` after a second's warm-up."""
    run_for(fn, 1.0)
    torch.cuda.synchronize()
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000.0))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sampler.start()
    start.record()
    calls = run_for(fn, seconds)
    end.record()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    n = max(len(samples), 1)
    return (start.elapsed_time(end) / calls, sum(c for c, _ in samples) / n,
            sum(p for _, p in samples) / n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = ", ".join([*GROUPED, *DENSE])
    parser.add_argument("shapes", nargs="*", help=f"of {names} (default: all)")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds an op")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    unknown = [s for s in args.shapes if s not in GROUPED and s not in DENSE]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}: {names}")
    seed = bench_seed()
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: sustained time, SM clock and power (seed {seed})",
          flush=True)
    for name in args.shapes or [*GROUPED, *DENSE]:
        flops, ops = make_ops(name, dev)
        for r in range(args.rounds):
            for label, fn in ops.items():
                ms, mhz, watts = sustained(fn, args.seconds)
                print(f"{name:16s} round {r} {label:16s} {ms:8.4f} ms {flops / ms / 1e9:5.0f} "
                      f"TFLOP/s  SM {mhz:5.0f} MHz  {watts:4.0f} W", flush=True)


if __name__ == "__main__":
    main()
