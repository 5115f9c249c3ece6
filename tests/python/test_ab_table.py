"""scripts/ab_table.py on a synthetic A/B tree (two variants, two rounds, a wrong row) and its
tarball: the best time per variant, the ratio to variant 0, the spread, WRONG, the geomean. No
GPU, no third-party packages."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "scripts" / "ab_table.py"


def write(root: Path, variant: int, rnd: int, rows):
    d = root / f"v{variant}-r{rnd}"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"kernel": "moe_layer", "rows": [
        {"shape": {"model": m, "tokens": t}, "ms": {"mkernel": ms}, "correct": ok}
        for m, t, ms, ok in rows]}
    (d / "moe_layer-h200-w1.json").write_text(json.dumps(doc))


def run(arg) -> str:
    out = subprocess.run([sys.executable, str(TABLE), str(arg)], capture_output=True, text=True,
                         check=True)
    return out.stdout


def test_ratios_spread_wrong_and_geomean(tmp_path):
    root = tmp_path / "ab"
    write(root, 0, 1, [("a", 1, 2.0, True), ("b", 2, 4.0, True)])
    write(root, 0, 2, [("a", 1, 2.2, True), ("b", 2, 4.0, True)])
    write(root, 1, 1, [("a", 1, 1.0, True), ("b", 2, 5.0, False)])
    write(root, 1, 2, [("a", 1, 1.5, True), ("b", 2, 4.0, True)])
    text = run(root)
    assert "v0 2.0000 1.000 (1.100)" in text  # best of 2.0 / 2.2, spread 1.1
    assert "v1 1.0000 0.500 (1.500)" in text
    assert "v1 4.0000 1.000 (1.250) WRONG" in text  # one round wrong: flagged
    assert "geomean of the ratios: v0 1.0000 v1 0.7071" in text  # sqrt(0.5 x 1.0)
    tarball = tmp_path / "ab-results.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(root, arcname=".")
    assert run(tarball) == text


def test_usage_without_an_argument():
    out = subprocess.run([sys.executable, str(TABLE)], capture_output=True, text=True)
    assert out.returncode == 2 and "ab_variants.sh" in out.stderr
