"""bench/plot.py on synthetic results files: a GEMM-family kernel (one null baseline, one wrong
row), the standalone collectives, and a file that does not parse. Needs matplotlib only (no GPU,
no mkernel package); skips without it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402

PLOT = Path(__file__).resolve().parents[2] / "bench" / "plot.py"
HEADER = {"commit": "0123456789abcdef0123456789abcdef01234567", "date": "2026-12-01T10:00:00Z",
          "device": "NVIDIA H200", "world_size": 2, "num_nodes": 1, "transport": "nvlink"}


def gemm_row(m, n, k, *, async_tp, correct):
    gemm, comm = 2 * m * n * k / 700e9, m * k * 2 / 350e6
    seq, fused = gemm + comm, max(gemm, comm) * 1.05
    return {"shape": {"M": m, "N": n, "K": k}, "dtype": "bf16",
            "ms": {"mkernel": fused, "gemm_alone": gemm, "comm_alone": comm, "sequential": seq,
                   "torch_async_tp": async_tp},
            "limit_ms": max(gemm, comm), "ratio_to_limit": 1.05,
            "speedup_vs_sequential": seq / fused,
            "tflops": 2 * m * n * k / fused / 1e9, "correct": correct}


def coll_row(op, mib, *, correct=True):
    b = mib << 20
    ms = {"mkernel": b / 350e6, "nccl": b / 260e6, "peer_copy": b / 390e6}
    return {"op": op, "shape": {"bytes_per_rank": b}, "dtype": "bf16", "ms": ms,
            "busbw_gbps": {"mkernel": 350.0, "nccl": 260.0, "peer_copy_one_way": 390.0},
            "speedup_vs_nccl": ms["nccl"] / ms["mkernel"], "correct": correct}


def run_plot(results, out):
    return subprocess.run([sys.executable, str(PLOT), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def check_png(path):
    assert path.is_file(), path
    assert path.stat().st_size > 10_000, f"{path} is suspiciously small"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500, img.shape
    assert img.std() > 0.01, f"{path} is blank"


def test_plots_gemm_and_collectives(tmp_path):
    results, out = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    ag = dict(HEADER, kernel="ag_gemm", rows=[
        gemm_row(1024, 8192, 8192, async_tp=0.3, correct=True),
        gemm_row(4096, 8192, 8192, async_tp=None, correct=True),  # baseline missing
        gemm_row(8192, 8192, 8192, async_tp=2.0, correct=False),  # wrong output
    ])
    coll = dict(HEADER, kernel="collectives", baseline="NCCL 22809", rows=[
        coll_row(op, mib, correct=not (op == "reduce_scatter" and mib == 64))
        for mib in (8, 64) for op in ("all_gather", "reduce_scatter", "all_reduce")
    ])
    (results / "ag_gemm-h200-w2.json").write_text(json.dumps(ag))
    (results / "collectives-h200-w2.json").write_text(json.dumps(coll))
    (results / "broken-h200-w2.json").write_text("{not json")

    proc = run_plot(results, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken-h200-w2.json skipped" in proc.stderr
    for name in ("ag_gemm-h200-w2.png", "collectives-h200-w2.png", "overview.png"):
        check_png(out / name)
        assert name in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "ag_gemm-h200-w2.png", "collectives-h200-w2.png", "overview.png"]


def test_plots_engine_sweeps(tmp_path):
    """gemm and grouped_gemm files with many rows: one panel per (N, K) (and experts), a line per
    layout, the speedup over the library against M (rows); the overview takes their geomeans."""
    results, out = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    gemm_rows = []
    for n, k in ((8192, 8192), (2048, 7168)):
        for m in (1, 64, 512, 4096):
            for layout in ("nk", "kn"):
                blas = 2 * m * n * k / 650e9 + 0.01
                gemm_rows.append({"shape": {"M": m, "N": n, "K": k}, "b_layout": layout,
                                  "dtype": "bf16", "ms": {"mkernel": blas * (0.9 + m / 8192),
                                                          "gemm_alone": blas},
                                  "correct": not (m == 64 and layout == "kn")})
    gemm_rows *= 2  # more than a panel view's worth of rows
    grouped_rows = []
    for experts in (8, 32):
        for rows in (128, 4096, 65536):
            for layout in ("contiguous", "masked"):
                for skew in ("balanced", "zipf"):
                    t = 2 * rows * 4096 * 7168 / 600e9 + 0.02
                    grouped_rows.append({"shape": {"experts": experts, "rows": rows, "N": 4096,
                                                   "K": 7168, "skew": skew, "layout": layout},
                                         "dtype": "bf16",
                                         "ms": {"mkernel": t, "torch_grouped_mm": t * 1.1},
                                         "correct": True})
    (results / "gemm-h200-w1.json").write_text(
        json.dumps(dict(HEADER, kernel="gemm", world_size=1, rows=gemm_rows)))
    (results / "grouped_gemm-h200-w1.json").write_text(
        json.dumps(dict(HEADER, kernel="grouped_gemm", world_size=1, rows=grouped_rows)))
    proc = run_plot(results, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("gemm-h200-w1.png", "grouped_gemm-h200-w1.png", "overview.png"):
        check_png(out / name)


def test_plots_moe_layer_one_gpu(tmp_path):
    """A moe_layer file of one GPU: the layer against the plain PyTorch layer, its two parts
    alone as extra series; no warning that rows lack a baseline."""
    results, out = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    rows = []
    for model, (h, i, e, k) in {"deepseek_v3": (7168, 2048, 256, 8),
                                "mixtral": (4096, 14336, 8, 2)}.items():
        for tokens in (128, 4096):
            flops = 6 * tokens * k * h * i
            ours = flops / 500e9 + 0.05
            rows.append({"shape": {"tokens_per_rank": tokens, "hidden": h, "intermediate": i,
                                   "experts": e, "top_k": k, "model": model},
                         "dtype": "bf16",
                         "ms": {"mkernel": ours, "torch_reference": ours * 1.3,
                                "compute_alone": ours * 0.9, "dispatch_combine_alone": 0.04,
                                "sequential": None},
                         "limit_ms": ours * 0.9, "ratio_to_limit": 1 / 0.9,
                         "speedup_vs_torch_reference": 1.3, "tflops": flops / ours / 1e9,
                         "correct": tokens != 128 or model != "mixtral"})
    (results / "moe_layer-h200-w1.json").write_text(
        json.dumps(dict(HEADER, kernel="moe_layer", world_size=1, rows=rows)))
    proc = run_plot(results, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no row has a baseline" not in proc.stderr, proc.stderr
    for name in ("moe_layer-h200-w1.png", "overview.png"):
        check_png(out / name)


def test_fails_when_nothing_plots(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "bad.json").write_text(json.dumps({"kernel": "x", "rows": []}))
    proc = run_plot(results, tmp_path / "plots")
    assert proc.returncode != 0
    assert "bad.json skipped" in proc.stderr
