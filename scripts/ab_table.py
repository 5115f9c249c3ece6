#!/usr/bin/env python3
"""The table of an A/B run (scripts/ab_variants.sh): per results file and shape, each variant's
best time over the rounds, its ratio to variant 0, the spread of its rounds and whether every
round was correct; a geomean of the ratios per file.

    python3 scripts/ab_table.py ab-results.tar.gz      (or the folder it was unpacked into)

Rows are keyed by their shape (and B layout); `ms.mkernel` is the time compared.
"""
import json
import math
import re
import sys
import tarfile
import tempfile
from pathlib import Path


def load(root: Path):
    """{file: {variant: {shape key: [(ms, correct), ...]}}} from v<variant>-r<round>/<file>."""
    runs = {}
    for path in sorted(root.glob("v*-r*/*.json")):
        m = re.fullmatch(r"v(\d+)-r(\d+)", path.parent.name)
        if not m:
            continue
        variant = int(m.group(1))
        doc = json.loads(path.read_text())
        for row in doc.get("rows", []):
            ms = (row.get("ms") or {}).get("mkernel")
            if ms is None:
                continue
            shape = dict(row.get("shape", {}))
            if "b_layout" in row:  # bench_gemm's rows: one shape in both B layouts
                shape["b_layout"] = row["b_layout"]
            key = json.dumps(shape, sort_keys=True)
            per = runs.setdefault(path.name, {}).setdefault(variant, {})
            per.setdefault(key, []).append((ms, bool(row.get("correct", True))))
    return runs


def label(key: str) -> str:
    shape = json.loads(key)
    return " ".join(f"{k}={v}" for k, v in shape.items())


def table(runs) -> str:
    out = []
    for name, variants in sorted(runs.items()):
        order = sorted(variants)
        base = variants[order[0]]
        out.append(f"== {name}: best ms of each variant, ratio to v{order[0]} (spread of rounds)")
        logs = {v: [] for v in order}
        for key in sorted(base):
            cells = []
            for v in order:
                times = variants[v].get(key)
                if not times:
                    cells.append(f"v{v} -")
                    continue
                best = min(t for t, _ in times)
                spread = max(t for t, _ in times) / best
                ratio = best / min(t for t, _ in base[key])
                logs[v].append(math.log(ratio))
                wrong = "" if all(ok for _, ok in times) else " WRONG"
                cells.append(f"v{v} {best:.4f} {ratio:.3f} ({spread:.3f}){wrong}")
            out.append(f"  {label(key)}\n    " + " | ".join(cells))
        means = " ".join(
            f"v{v} {math.exp(sum(l) / len(l)):.4f}" for v, l in logs.items() if l)
        out.append(f"  geomean of the ratios: {means}")
    return "\n".join(out)


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src = Path(argv[1])
    if src.is_dir():
        print(table(load(src)))
        return 0
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(src) as tar:
        tar.extractall(tmp, filter="data")
        print(table(load(Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
