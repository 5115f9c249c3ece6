#!/usr/bin/env python3
"""bench_gemm --candidates output (its `cand` lines) as the CSV scripts/fit_gemm_plan.py reads.

    bench_gemm --candidates --layouts nk --shapes ... > cand.log
    python3 scripts/candidates_csv.py cand.log --commit abc1234 > bench/data/gemm_candidates-h200.csv

One row a candidate: the shape, the tile (block_m x block_n), its pieces of K, its CTAs, the plan
model's estimate (a column named for the commit whose model it is), the measured time and cuBLAS's
time of the same shape in the same run. Only B [N, K] ('nk'): the plan's fit is made on it. A
shape whose cuBLAS line is missing (a run cut short) is left out, with a note on stderr.
"""
import argparse
import re
import sys

CAND = re.compile(r"^\s*cand (\d+)x(\d+)x(\d+)( kn)?\s+(\d+)x(\d+)\s+s(\d+)\s+(\d+) CTAs"
                  r"\s+model\s+([\d.]+) us\s+measured\s+([\d.]+) us")
CUBLAS = re.compile(r"^\s*cand (\d+)x(\d+)x(\d+)( kn)?\s+cuBLAS ([\d.]+) us")


def rows(lines):
    """(shape, candidates, cuBLAS us) of each 'nk' shape, in the order of the log."""
    pending, shapes = {}, []
    for line in lines:
        c = CAND.match(line)
        if c and not c.group(4):
            shape = tuple(int(x) for x in c.group(1, 2, 3))
            pending.setdefault(shape, []).append(
                (int(c.group(5)), int(c.group(6)), int(c.group(7)), int(c.group(8)),
                 float(c.group(9)), float(c.group(10))))
            continue
        b = CUBLAS.match(line)
        if b and not b.group(4):
            shape = tuple(int(x) for x in b.group(1, 2, 3))
            shapes.append((shape, pending.pop(shape, []), float(b.group(5))))
    for shape in pending:
        print(f"candidates_csv: {'x'.join(map(str, shape))} has no cuBLAS line: left out",
              file=sys.stderr)
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="bench_gemm --candidates output ('-': stdin)")
    ap.add_argument("--commit", required=True, help="the commit whose plan model estimated")
    args = ap.parse_args()
    with (sys.stdin if args.log == "-" else open(args.log)) as f:
        shapes = rows(f)
    out = sys.stdout
    out.write(f"m,n,k,block_m,block_n,split_k,ctas,model_us_at_{args.commit},measured_us,"
              "cublas_us\n")
    for (m, n, k), cands, cublas in shapes:
        for bm, bn, pieces, ctas, model, measured in cands:
            out.write(f"{m},{n},{k},{bm},{bn},{pieces},{ctas},{model:.1f},{measured:.1f},"
                      f"{cublas:.1f}\n")
    if not shapes:
        print("candidates_csv: no 'nk' candidates in the log", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
