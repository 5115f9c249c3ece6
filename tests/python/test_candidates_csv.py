"""scripts/candidates_csv.py on lines in bench_gemm's --candidates format: every 'nk' candidate
becomes a row with its shape's cuBLAS time, 'kn' lines and a shape cut short are left out, and
scripts/fit_gemm_plan.py reads the result."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import fit_gemm_plan  # noqa: E402


def cand(label, bm, bn, s, ctas, model, measured, chosen=False):
    # bench_gemm.cpp's printf: "  cand %-14s %3dx%-3d s%d %3d CTAs  model %8.1f us  measured
    # %8.1f us%s\n"
    return (f"  cand {label:<14} {bm:3d}x{bn:<3d} s{s} {ctas:3d} CTAs  model {model:8.1f} us  "
            f"measured {measured:8.1f} us{'  <- plan' if chosen else ''}\n")


LOG = "".join([
    "640x2048x7168            0.036      0.027     525.0     700.0   0.757  ok\n",
    cand("640x2048x7168", 128, 80, 1, 130, 33.1, 35.7, chosen=True),
    cand("640x2048x7168", 128, 128, 2, 128, 41.0, 40.2),
    "  cand 640x2048x7168  cuBLAS 27.0 us\n",
    cand("640x2048x7168 kn", 128, 192, 2, 110, 40.0, 38.5),
    "  cand 640x2048x7168 kn cuBLAS 27.1 us\n",
    cand("1x8192x8192", 64, 64, 1, 128, 37.1, 36.1),
    "  cand 1x8192x8192    cuBLAS 34.0 us\n",
    cand("8x8192x8192", 64, 64, 1, 128, 37.3, 35.5),  # the run ended here
])


def test_rows_and_the_fit_reads_them(tmp_path):
    log = tmp_path / "cand.log"
    log.write_text(LOG)
    p = subprocess.run([sys.executable, str(REPO / "scripts/candidates_csv.py"), str(log),
                        "--commit", "abc1234"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines == [
        "m,n,k,block_m,block_n,split_k,ctas,model_us_at_abc1234,measured_us,cublas_us",
        "640,2048,7168,128,80,1,130,33.1,35.7,27.0",
        "640,2048,7168,128,128,2,128,41.0,40.2,27.0",
        "1,8192,8192,64,64,1,128,37.1,36.1,34.0",
    ]
    assert "8x8192x8192 has no cuBLAS line" in p.stderr
    csv = tmp_path / "c.csv"
    csv.write_text(p.stdout)
    shapes = fit_gemm_plan.load(csv)
    assert shapes[(640, 2048, 7168)] == {"cublas": 27.0,
                                         "measured": {(128, 80, 1, 130): 35.7,
                                                      (128, 128, 2, 128): 40.2}}
    assert fit_gemm_plan.has_steps(shapes)


def test_a_log_without_candidates_fails(tmp_path):
    log = tmp_path / "cand.log"
    log.write_text("geometric mean of TFLOP/s vs cuBLAS: 0.972, worst 0.704\n")
    p = subprocess.run([sys.executable, str(REPO / "scripts/candidates_csv.py"), str(log),
                        "--commit", "abc1234"], capture_output=True, text=True)
    assert p.returncode == 1
    assert "no 'nk' candidates" in p.stderr
