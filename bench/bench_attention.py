"""The attention engine on one GPU against torch SDPA's best backend.

    python3 bench/bench_attention.py --mode check|bench [--json FILE]

Shapes of issue 31 (B, H, H_kv, S, D): (1, 32, 32, 8192, 128), (1, 32, 8, 16384, 128),
(4, 16, 16, 4096, 128), (2, 32, 8, 4096, 128), (8, 16, 16, 1024, 128), (1, 32, 32, 2048, 64),
(4, 16, 16, 8192, 64), causal and not (S_q = S_kv, so bottom-right and top-left causal agree).
Columns (../shared/BENCH_SCHEMA.md, attention):
  mkernel     mkernel.attention (q, k, v [B, S, H, D])
  torch_sdpa  torch.nn.functional.scaled_dot_product_attention on the same tensors (transposed
              views [B, H, S, D], as flash-attn layouts are passed to it), the fastest of its
              backends (flash, cuDNN, memory-efficient) that run the shape; which one is recorded
  sequential  null (one GPU: no ring)
limit_ms = torch_sdpa; tflops = 4 B H S^2 D (halved for causal) / mkernel.
Timing: CUDA graphs of several calls, events around replays, the median of rounds, the ops
interleaved (bench_grouped.py's time_ops). Correctness at every point: on batch 0's first two
heads and 256 sampled query rows, against SDPA's math in fp32, within twice SDPA's own error
plus 1e-5.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import mkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped import bench_args, bench_seed, time_ops, write_results  # noqa: E402

SHAPES = [(1, 32, 32, 8192, 128), (1, 32, 8, 16384, 128), (4, 16, 16, 4096, 128),
          (2, 32, 8, 4096, 128), (8, 16, 16, 1024, 128), (1, 32, 32, 2048, 64),
          (4, 16, 16, 8192, 64)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_fn(q, k, v, causal, backend):
    """SDPA on [B, H, S, D] views of the [B, S, H, D] tensors with one backend."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def fn():
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    return fn


def sampled_errors(q, k, v, causal, ours, theirs, gen):
    """max |x - exact| for ours and SDPA's ([B, S, H, D] and [B, H, S, D]) over batch 0, heads
    0 and 1, 256 sampled query rows; exact = fp32 math."""
    s, h, h_kv, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    rows = torch.unique(torch.cat([torch.arange(min(s, 64), device=q.device),
                                   torch.randint(0, s, (192,), device=q.device, generator=gen)]))
    errs = [0.0, 0.0]
    for head in (0, 1):
        kvh = head // (h // h_kv)
        qh = q[0, rows, head].float()
        kh, vh = k[0, :, kvh].float(), v[0, :, kvh].float()
        scores = qh @ kh.T / math.sqrt(d)
        if causal:
            j = torch.arange(s, device=q.device)[None, :]
            scores = scores.masked_fill(j > rows[:, None], float("-inf"))
        exact = torch.softmax(scores, dim=-1) @ vh
        errs[0] = max(errs[0], (ours[0, rows, head].float() - exact).abs().max().item())
        errs[1] = max(errs[1], (theirs[0, head, rows].float() - exact).abs().max().item())
    return errs


def run_point(shape, causal, gen, mode):
    b, h, h_kv, s, d = shape
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def ours():
        return mkernel.attention(q, k, v, causal=causal)

    backends = {}
    for name in BACKENDS:
        fn = sdpa_fn(q, k, v, causal, name)
        try:
            fn()
            torch.cuda.synchronize()
            backends[name] = fn
        except RuntimeError:
            continue
    out = ours()
    ref_name = next(iter(backends))
    err, err_sdpa = sampled_errors(q, k, v, causal, out, backends[ref_name](), gen)
    correct = err <= 2 * err_sdpa + 1e-5
    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    iters = max(3, min(50, int(3e12 / flops)))
    fns = {"mkernel": ours}
    fns.update({f"sdpa_{name}": fn for name, fn in backends.items()})
    ms = time_ops(fns, iters, 7 if mode == "bench" else 3)
    best = min(backends, key=lambda n: ms[f"sdpa_{n}"])
    return ms, best, flops, correct, (err, err_sdpa)


def main():
    args = bench_args(__doc__, quick=False)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU", file=sys.stderr)
        return 2
    seed = bench_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"bench_attention {args.mode}: seed {seed}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    print(f"{'B':>2} {'H':>3} {'Hkv':>3} {'S':>6} {'D':>4} {'causal':>6} {'mkernel':>9} "
          f"{'TFLOP/s':>8} {'sdpa':>9} {'backend':>9} {'TFLOP/s':>8} {'x sdpa':>7}  check",
          flush=True)
    results, all_ok = [], True
    for shape in SHAPES:
        for causal in (False, True):
            ms, best, flops, ok, errs = run_point(shape, causal, gen, args.mode)
            all_ok &= ok
            b, h, h_kv, s, d = shape
            sdpa = ms[f"sdpa_{best}"]
            print(f"{b:2} {h:3} {h_kv:3} {s:6} {d:4} {str(causal):>6} {ms['mkernel']:9.4f} "
                  f"{flops / ms['mkernel'] * 1e-9:8.1f} {sdpa:9.4f} {best:>9} "
                  f"{flops / sdpa * 1e-9:8.1f} {sdpa / ms['mkernel']:7.3f}  "
                  f"{'ok' if ok else 'WRONG'} (err {errs[0]:.2e}, sdpa {errs[1]:.2e})", flush=True)
            results.append({
                "shape": {"batch": b, "heads": h, "kv_heads": h_kv, "seq_local": s,
                          "head_dim": d, "causal": causal, "world": 1},
                "dtype": "bf16",
                "ms": {"mkernel": ms["mkernel"], "torch_sdpa": sdpa, "sequential": None,
                       **{f"sdpa_{n}": ms[f"sdpa_{n}"] for n in BACKENDS if f"sdpa_{n}" in ms}},
                "sdpa_backend": best,
                "limit_ms": sdpa,
                "ratio_to_limit": ms["mkernel"] / sdpa,
                "speedup_vs_sdpa": sdpa / ms["mkernel"],
                "tflops": flops / ms["mkernel"] * 1e-9,
                "sdpa_tflops": flops / sdpa * 1e-9,
                "correct": bool(ok),
            })
            torch.cuda.empty_cache()
    logs = [math.log(r["speedup_vs_sdpa"]) for r in results]
    print(f"geometric mean vs SDPA: {math.exp(sum(logs) / len(logs)):.3f}, "
          f"worst {math.exp(min(logs)):.3f}", flush=True)
    if args.json and args.mode == "bench":
        write_results(args.json, "attention", results)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
