"""scripts/ab_prebuilt.sh on stand-in executables (no GPU): every variant's benchmarks run in
every round, interleaved, each writing its results where scripts/ab_table.py reads them; the
tests run per variant and a failing one fails the script; the deadline stops new runs."""

import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A stand-in for a benchmark or the test binary: logs its call and arguments, writes one row with
# --json.
FAKE = """#!/usr/bin/env bash
json="" args="$*"
while [[ $# -gt 0 ]]; do [[ "$1" == --json ]] && json="$2"; shift; done
echo "$(basename "$0") {variant} $args" >> "{calls}"
if [[ -n "$json" ]]; then
  echo '{{"rows": [{{"shape": {{"M": 1}}, "ms": {{"mkernel": {ms}}}, "correct": true}}]}}' > "$json"
fi
exit {rc}
"""


def make_tree(tmp_path, variants):
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("ab_prebuilt.sh", "unpack_prebuilt.sh", "ab_table.py"):
        shutil.copy2(REPO / "scripts" / name, tree / "scripts" / name)
    calls = tmp_path / "calls.txt"
    for name, (ms, test_rc) in variants.items():
        d = tree / f"prebuilt-{name}"
        d.mkdir()
        (d / "COMMIT").write_text("abc1234\n")
        for exe in ("bench_moe_ranks", "bench_gemm", "bench_ring_attention", "mkernel_gpu_tests"):
            rc = test_rc if exe == "mkernel_gpu_tests" else 0
            (d / exe).write_text(FAKE.format(variant=name, calls=calls, ms=ms, rc=rc))
            (d / exe).chmod((d / exe).stat().st_mode | stat.S_IEXEC)
    return tree, calls


def run(tree, tmp_path, *args, **env):
    out = tmp_path / "out"
    return subprocess.run(["bash", "scripts/ab_prebuilt.sh", *args], cwd=tree, text=True,
                          capture_output=True, env={**os.environ, "OUT": str(out),
                                                    "MKERNEL_BENCH_SEED": "7", **env}), out


def test_rounds_interleave_and_results_land_where_ab_table_reads(tmp_path):
    tree, calls = make_tree(tmp_path, {"a": (2.0, 0), "b": (1.0, 0)})
    r, out = run(tree, tmp_path, "2", "a", "b", AB_TESTS="*Moe*")
    assert r.returncode == 0, r.stdout + r.stderr
    order = [line.split()[1] for line in calls.read_text().splitlines()
             if not line.startswith("mkernel_gpu_tests")]
    # moe (two ranks, then the world-1 prefix), gemm, ring per variant; a b a b by round
    assert order == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4
    with tarfile.open(out / "ab-results.tar.gz") as t:
        names = {Path(n).as_posix().lstrip("./") for n in t.getnames()}
    for v in ("v0", "v1"):
        for rnd in ("r1", "r2"):
            for f in ("moe_dispatch_gemm-ab-w2-one-gpu.json", "moe_dispatch_gemm-ab-w1-prefix.json",
                      "gemm-ab-w1.json", "ring_attention-ab-w1.json"):
                assert f"{v}-{rnd}/{f}" in names
    assert "a tests (*Moe*): PASS" in r.stdout and "b tests (*Moe*): PASS" in r.stdout
    assert "v1 1.0000 0.500" in r.stdout  # ab_table's ratio of b to a


def test_a_failing_test_fails_the_script(tmp_path):
    tree, _ = make_tree(tmp_path, {"a": (1.0, 0), "b": (1.0, 1)})
    r, _ = run(tree, tmp_path, "1", "a", "b", AB_TESTS="*", AB_RUNS="gemm")
    assert r.returncode == 1
    assert "b tests (*): FAIL (rc 1)" in r.stdout


def test_past_the_deadline_nothing_new_starts(tmp_path):
    tree, calls = make_tree(tmp_path, {"a": (1.0, 0)})
    r, _ = run(tree, tmp_path, "3", "a", AB_DEADLINE="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not calls.exists() or calls.read_text() == ""
    assert "past the deadline" in r.stdout


def test_attention_runs_only_where_the_variant_has_its_module(tmp_path):
    tree, calls = make_tree(tmp_path, {"a": (2.0, 0)})
    r, out = run(tree, tmp_path, "1", "a", AB_RUNS="attention ring")
    assert r.returncode == 0, r.stdout + r.stderr
    # no _C*.so in prebuilt-a: the attention run is skipped, the ring run is not
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["bench_ring_attention"]


def test_gemm_sweep_runs_bench_gemms_own_points(tmp_path):
    tree, calls = make_tree(tmp_path, {"a": (2.0, 0)})
    r, _ = run(tree, tmp_path, "1", "a", AB_RUNS="gemm", AB_GEMM_SHAPES="sweep")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = calls.read_text().splitlines()
    assert "--layouts nk,kn" in line and "--shapes" not in line
    r, _ = run(tree, tmp_path, "1", "a", AB_RUNS="gemm", AB_GEMM_SHAPES="8x8x8")
    assert "--shapes 8x8x8" in calls.read_text().splitlines()[-1]


def test_module_runs_skip_a_variant_without_its_module(tmp_path):
    # attention and grouped run on a variant's Python module (_C*.so), which these have not.
    tree, calls = make_tree(tmp_path, {"a": (1.0, 0)})
    r, _ = run(tree, tmp_path, "1", "a", AB_RUNS="attention grouped")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not calls.exists() or calls.read_text() == ""
    r, _ = run(tree, tmp_path, "1", "a", AB_RUNS="groupd")
    assert r.returncode == 2 and "(moe, gemm, ring, attention, grouped)" in r.stdout
