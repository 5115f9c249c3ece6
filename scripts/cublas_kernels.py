#!/usr/bin/env python3
"""Which cuBLAS kernel torch.matmul runs for each GEMM shape, and its time: the kernel's name
carries cuBLAS's choices (tile, cluster, split-K / stream-K), the reference issue 28's plans are
measured against. Needs torch and a GPU; no build of ours.

    python3 scripts/cublas_kernels.py [M,N,K ...]     (default: the bench_gemm points below 0.95
                                                       of cuBLAS in bench/results/gemm-h200-w1.json)

B [N, K] ('nk': a @ b.T) and B [K, N] ('kn': a @ b), bf16 in, bf16 out, fp32 accumulate."""
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]


def shapes_from_args():
    if len(sys.argv) > 1:
        return [(tuple(int(v) for v in a.split(",")), layout) for a in sys.argv[1:]
                for layout in ("nk", "kn")]
    rows = json.loads((REPO / "bench/results/gemm-h200-w1.json").read_text())["rows"]
    return [((r["shape"]["M"], r["shape"]["N"], r["shape"]["K"]), r["b_layout"]) for r in rows
            if r["tflops"] / r["tflops_cublas"] < 0.95]


def main():
    # bench_gemm's cuBLAS call (cublasGemmEx, fp32 compute, CUBLAS_DEFAULT_MATH) lets cuBLAS reduce
    # split-K partial sums in bf16, as torch's default does: keep that default, so that the
    # kernels named here are the ones the results file timed.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    for (m, n, k), layout in shapes_from_args():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k) if layout == "nk" else (k, n), device="cuda", dtype=torch.bfloat16)
        run = (lambda: a @ b.t()) if layout == "nk" else (lambda: a @ b)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = kernels.setdefault(e.name, [0, 0.0])
                t[0] += 1
                t[1] += e.device_time
        parts = [f"{name} x{c // 5} {us / c:.1f} us" for name, (c, us) in kernels.items()]
        print(f"{m} x {n} x {k} {layout}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
