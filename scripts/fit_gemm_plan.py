#!/usr/bin/env python3
"""The GEMM plan's cost model (src/gemm/plan.cpp) against measured candidates, and its refit.

    python3 scripts/fit_gemm_plan.py                 # how the constants of plan.cpp choose
    python3 scripts/fit_gemm_plan.py --fit [--generations 60]   # refit them (needs scipy)
    python3 scripts/fit_gemm_plan.py --data bench/data/gemm_candidates-h200.csv,bench/data/gemm_candidates-h100.csv

The data: bench/data/gemm_candidates-<card>.csv (default the H200's; several comma-separated,
weighed alike by a refit), from `bench_gemm --candidates --layouts nk` (every distinct plan of
each shape timed side by side, cuBLAS in the same run; its output becomes the CSV through
scripts/candidates_csv.py). For each shape the script plans as plan.cpp does - the height rule
(64 rows for M <= 64; past it the model's lowest of 192 rows for M 129..192, 128, and 64 rows
with K whole up to MAX_M_64), K whole at pick_block_n's width (the model's at 192 rows), a step
width (80-224, B [N, K], 128 rows, K whole) where the model finds it STEP_GAIN faster - once the
data has step-width candidates -, the library's splits - and reports the plan's measured time
against the fastest candidate measured and against cuBLAS. The model here mirrors plan.cpp line
for line; a change there belongs here. The refit minimises the plans' loss against the fastest
candidate (geomean) plus a weak pull toward predicting the measured times (0.02 x rms of
log(model / measured)).
"""
import argparse
import collections
import csv
import math
import os

SMS = 132
CLUSTERS = {2: 132, 3: 117, 4: 120, 5: 110, 6: 102, 7: 105, 8: 120}  # the H200's, 227 KB a CTA
MAX_WAVES_BEFORE_SPLIT, MIN_K_BLOCKS, SPLIT_GAIN, STEP_GAIN = 3, 8, 1.05, 1.05
STEP_WIDTHS = (80, 96, 112, 144, 160, 224)  # gemm_internal.h's kStepWidths

# plan.cpp's constants.
PLAN_CPP = dict(wgmma=5.5e12, l2=15e12, l2_cta=110e9, hbm=3.75e12, hbm_cta_64=35e9,
                hbm_cta=72e9, cluster_s=2.8e-6, peer_bytes=26e9, launch_s=1.4e-6,
                eff_64=0.77, eff_128=0.95, eff_192=0.97, rows64=0.86)
BOUNDS = dict(wgmma=(3e12, 8e12), l2=(5e12, 20e12), l2_cta=(40e9, 300e9), hbm=(2.5e12, 4.8e12),
              hbm_cta_64=(10e9, 80e9), hbm_cta=(10e9, 80e9), cluster_s=(0, 5e-6),
              peer_bytes=(5e9, 200e9), launch_s=(0, 6e-6), eff_64=(0.5, 1.05),
              eff_128=(0.7, 1.05), eff_192=(0.8, 1.05), rows64=(0.6, 1.1))
MAX_M_64 = 512  # the height rule: 64-row tiles weighed against the others up to this M


def tiles(m, n, bm, bn):
    return -(-m // bm) * -(-n // bn)


def efficiency(p, bn):
    """plan.cpp's wgmma_efficiency: measured at the multiples of 64, linear in 1 / width between."""
    widths, rates = (64, 128, 192, 256), (p["eff_64"], p["eff_128"], p["eff_192"], 1.0)
    if bn <= 64:
        return rates[0]
    for i in range(1, 4):
        if bn <= widths[i]:
            lo, hi = 1 / widths[i - 1], 1 / widths[i]
            return rates[i - 1] + (lo - 1 / bn) / (lo - hi) * (rates[i] - rates[i - 1])
    return rates[3]


def estimate(p, m, n, k, bm, bn, ctas, whole, pieces):
    """plan.cpp's estimate_seconds."""
    t, kb, a_rows = tiles(m, n, bm, bn), -(-k // 64), min(m, bm)
    eff = efficiency(p, bn) * (p.get("rows64", 1.0) if bm == 64 else 1.0)

    def k_block(active):
        rate = min(p["l2_cta"], p["l2"] / active)
        return max((a_rows + bn) * 128 / rate, bm * bn * 64 * 2 / (p["wgmma"] * eff))

    compute, split = whole // ctas * kb * k_block(ctas), 0.0
    if pieces > 1:
        compute += -(-kb // pieces) * k_block((t - whole) * pieces)
        split = p["cluster_s"] + a_rows * bn * 4 / p["peer_bytes"]
    elif t % ctas:
        compute += kb * k_block(t % ctas)
    hbm_cta = p["hbm_cta"] if bn >= 128 else (
        p["hbm_cta_64"] + (p["hbm_cta"] - p["hbm_cta_64"]) * (bn - 64) / 64)
    hbm = 2.0 * (m * k + n * k + m * n) / min(p["hbm"], ctas * hbm_cta)
    return max(compute, hbm) + split + p["launch_s"]


def pick_block_n(m, n, bm):
    """gemm.cu's pick_block_n: the fewest tile-waves, weighted by width."""
    best, width = None, 0
    for w, e in ((256, 1.0), (192, 0.97), (128, 0.9), (64, 0.75)):
        cost = -(-tiles(m, n, bm, w) // SMS) * w / e
        if width == 0 or cost < best:
            width, best = w, cost
    return width


def best_at(p, m, n, k, bm, steps, whole_only=False):
    """plan.cpp's best_at (B [N, K]; `steps`: the step widths considered; `whole_only`: K whole):
    (score, block_m, block_n, pieces, ctas)."""
    kb = -(-k // 64)
    widths = (128, 64) if bm == 192 else (256, 192, 128, 64)  # plan.cpp's order (ties)
    whole = None
    for bn in (widths if bm == 192 else (pick_block_n(m, n, bm),)):
        t = tiles(m, n, bm, bn)
        c = (estimate(p, m, n, k, bm, bn, min(SMS, t), t, 1), bm, bn, 1, min(SMS, t))
        if whole is None or c[0] < whole[0]:
            whole = c
    if steps and bm == 128:
        step = None
        for bn in STEP_WIDTHS:
            t = tiles(m, n, bm, bn)
            c = (estimate(p, m, n, k, bm, bn, min(SMS, t), t, 1), bm, bn, 1, min(SMS, t))
            if step is None or c[0] < step[0]:
                step = c
        if step[0] * STEP_GAIN < whole[0]:  # its 5% carried into every later comparison
            whole = (step[0] * STEP_GAIN,) + step[1:]
    split = None
    for bn in () if whole_only else widths:
        t = tiles(m, n, bm, bn)
        for pieces in range(8, 1, -1):
            cap = CLUSTERS[pieces]
            last = t % cap
            if pieces > kb or last == 0 or last * pieces > cap:
                continue
            if last * 2 > cap or t // cap > MAX_WAVES_BEFORE_SPLIT or kb // pieces < MIN_K_BLOCKS:
                continue
            ctas = cap if t >= cap else last * pieces
            c = (estimate(p, m, n, k, bm, bn, ctas, t - last, pieces), bm, bn, pieces, ctas)
            if split is None or c[0] <= split[0]:  # ties: fewer pieces
                split = c
    if split is not None and split[0] * SPLIT_GAIN <= whole[0]:
        return (split[0] * SPLIT_GAIN,) + split[1:]
    return whole


def plan(p, m, n, k, steps):
    if m <= 64:
        return best_at(p, m, n, k, 64, steps)[1:]
    # 192 rows (M 129..192), 128, then 64 rows K whole (M up to MAX_M_64); ties to the earlier
    choices = ([best_at(p, m, n, k, 192, steps)] if 128 < m <= 192 else [])
    choices.append(best_at(p, m, n, k, 128, steps))
    if m <= MAX_M_64:
        choices.append(best_at(p, m, n, k, 64, steps, whole_only=True))
    best = choices[0]
    for c in choices[1:]:
        if c[0] < best[0]:
            best = c
    return best[1:]


def load(path):
    shapes = collections.OrderedDict()
    with open(path) as f:
        for r in csv.DictReader(f):
            key = (int(r["m"]), int(r["n"]), int(r["k"]))
            s = shapes.setdefault(key, {"cublas": float(r["cublas_us"]), "measured": {}})
            s["measured"][(int(r["block_m"]), int(r["block_n"]), int(r["split_k"]),
                           int(r["ctas"]))] = float(r["measured_us"])
    return shapes


def has_steps(shapes):
    """Whether the data has step-width candidates (bench_gemm --candidates after 2026-12-05)."""
    return any(bn in STEP_WIDTHS for s in shapes.values() for (_, bn, _, _) in s["measured"])


def evaluate(p, shapes, verbose=False):
    """(geomean of the plan's time over the fastest candidate's, geomean of cuBLAS over plan)."""
    loss = vs_cublas = 0.0
    steps, counted = has_steps(shapes), 0
    for (m, n, k), s in shapes.items():
        chosen = plan(p, m, n, k, steps)
        best = min(s["measured"].values())
        if chosen in s["measured"]:
            t = s["measured"][chosen]
        elif steps:  # a plan the data could have timed: counted as the slowest candidate, so
            t = max(s["measured"].values())  # that a fit gains nothing by choosing untimed plans
            if verbose:
                print(f"  {m}x{n}x{k}: plan {chosen[:3]} not measured: taken as the slowest")
        else:  # (data measured before a kind of plan existed)
            if verbose:
                print(f"  {m}x{n}x{k}: plan {chosen[:3]} is not among the candidates measured")
            continue
        counted += 1
        loss += math.log(t / best)
        vs_cublas += math.log(s["cublas"] / t)
        if verbose and t > 1.03 * best:
            fastest = min(s["measured"], key=s["measured"].get)
            print(f"  {m}x{n}x{k}: plan {chosen[:3]} {t:.1f} us, fastest {fastest[:3]} {best:.1f}")
    return math.exp(loss / max(counted, 1)), math.exp(vs_cublas / max(counted, 1))


def rms_log_error(p, shapes):
    errs = []
    for (m, n, k), s in shapes.items():
        for (bm, bn, pc, ctas), t in s["measured"].items():
            whole = tiles(m, n, bm, bn)
            if pc > 1:
                whole -= whole % CLUSTERS[pc]  # the last wave's tiles go in pieces
            errs.append(math.log(estimate(p, m, n, k, bm, bn, ctas, whole, pc) * 1e6 / t))
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(here, "..", "bench", "data",
                                                   "gemm_candidates-h200.csv"),
                    help="the candidates' CSV, or several, comma-separated (fitted together)")
    ap.add_argument("--fit", action="store_true", help="refit the constants (scipy)")
    ap.add_argument("--generations", type=int, default=60)
    ap.add_argument("--max-m-64", type=int, default=MAX_M_64,
                    help="weigh 64-row tiles against the others up to this M")
    args = ap.parse_args()
    globals()["MAX_M_64"] = args.max_m_64
    sets = {os.path.basename(path): load(path) for path in args.data.split(",")}
    for name, shapes in sets.items():
        if not has_steps(shapes):
            print(f"({name}: no step-width candidates in the data: planned with the four widths, "
                  "as for B [K, N])")
        loss, vs = evaluate(PLAN_CPP, shapes, verbose=True)
        print(f"plan.cpp on {name}: {len(shapes)} shapes, plans {100 * (loss - 1):.2f}% over the "
              f"fastest measured (geomean), {vs:.4f} of cuBLAS; rms model error "
              f"{100 * rms_log_error(PLAN_CPP, shapes):.1f}%")
    if not args.fit:
        return
    from scipy.optimize import differential_evolution  # a development tool's dependency
    keys = list(BOUNDS)

    def objective(x):  # every data set alike
        p = dict(zip(keys, x))
        return sum(math.log(evaluate(p, shapes)[0]) + 0.02 * rms_log_error(p, shapes)
                   for shapes in sets.values())

    r = differential_evolution(objective, [BOUNDS[k] for k in keys], maxiter=args.generations,
                               seed=4, polish=False, tol=1e-9,
                               x0=[PLAN_CPP[k] for k in keys])
    p = dict(zip(keys, r.x))
    for name, shapes in sets.items():
        loss, vs = evaluate(p, shapes, verbose=True)
        print(f"refit on {name}: plans {100 * (loss - 1):.2f}% over the fastest, {vs:.4f} of "
              f"cuBLAS; rms {100 * rms_log_error(p, shapes):.1f}%")
    print({k: float(f"{v:.3g}") for k, v in p.items()})


if __name__ == "__main__":
    main()
