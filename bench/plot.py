#!/usr/bin/env python3
"""Turn the benchmark results (bench/results/*.json, ../shared/BENCH_SCHEMA.md) into PNG charts.

    python3 bench/plot.py [--results DIR] [--out DIR]     (make plots runs it with the defaults)

Writes, under --out (default: plots/ at the repository root):
  <results file stem>.png  one chart per results file (a kernel on one GPU type and world size):
      - GEMM-family and other fused kernels: time per call (ms, lower is better) of mkernel and
        every baseline in the file, one panel per shape, with the ideal
        limit_ms = max(compute alone, communication alone) as a dashed line;
      - standalone collectives: bus bandwidth (GB/s, higher is better) per op and size for
        mkernel and NCCL, with the peer-copy ceiling as a dashed line;
      - sweeps of an engine alone (gemm, grouped_gemm with more than 24 rows): mkernel's speedup
        over its library (cuBLAS, torch._grouped_mm) against M or the routed rows, one panel per
        (N, K) (and expert count), one line per B layout (or layout and skew).
  overview.png  mkernel's speedup over the unfused baseline (the sequential composition, NCCL for
      the collectives, the library for an engine alone) for every row of every file (a sweep:
      the geomean of each of its lines; grouped_gemm: of each (N, K) and layout), with a line
      at 1.0.

Rows whose output was wrong (correct: false) are drawn hatched and labelled WRONG. Files that do
not parse or do not follow the schema are skipped with a warning; the exit status is non-zero only
when no file at all could be plotted. Needs matplotlib (Agg backend, no display).
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Known series: display name and colour. mkernel stands out; the libraries are muted.
SERIES = {
    "mkernel": ("mkernel (fused)", "#1f77b4"),
    "gemm_alone": ("GEMM alone (cuBLAS)", "#9e9e9e"),
    "comm_alone": ("communication alone (NCCL)", "#c7c7c7"),
    "sequential": ("sequential: NCCL, then cuBLAS (or the reverse)", "#ff7f0e"),
    "torch_async_tp": ("PyTorch async-TP (symmetric memory)", "#2ca02c"),
    "nccl": ("NCCL", "#ff7f0e"),
    "mkernel_gemm": ("mkernel's GEMM engine alone (reference)", "#9467bd"),
    "mkernel_graph": ("mkernel replayed from a CUDA graph (no host work per call)", "#aec7e8"),
    "torch_sdpa": ("torch SDPA (its fastest backend)", "#9e9e9e"),
    "engine_same_work": ("attention engine on the same work and SMs (ranks side by side)",
                         "#9e9e9e"),
    "engine_alone": ("attention engine on the same work and SMs (alone)", "#c7c7c7"),
    "engine_same_flops": ("attention engine, causal's FLOPs unmasked (one problem)", "#dbdbdb"),
    "torch_reference": ("the plain PyTorch layer (torch._grouped_mm)", "#9e9e9e"),
}
SERIES_ORDER = ["mkernel", "gemm_alone", "comm_alone", "sequential", "torch_async_tp"]
EXTRA_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
WRONG_COLOR = "#d62728"
LIMIT_COLOR = "#222222"
KERNEL_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#7f7f7f", "#d62728"]
OP_ORDER = ["all_gather", "reduce_scatter", "all_reduce"]


class SchemaError(ValueError):
    pass


def warn(msg):
    print(f"plot.py: warning: {msg}", file=sys.stderr)


# ---- reading and checking ----------------------------------------------------------------------

def number(v):
    """A positive finite float, or None (null, missing, not a number, zero, negative)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def is_collectives(rows):
    return all("op" in r and "bytes_per_rank" in r["shape"] for r in rows)


def load(path):
    """Returns (kind, doc, rows) with kind 'collectives' or 'timed'; raises SchemaError."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemaError(f"does not parse as JSON ({e})")
    if not isinstance(doc, dict):
        raise SchemaError("top level is not an object")
    if not isinstance(doc.get("kernel"), str) or not doc["kernel"]:
        raise SchemaError('no "kernel" name')
    raw = doc.get("rows")
    if not isinstance(raw, list) or not raw:
        raise SchemaError('no "rows" list (or it is empty)')
    rows = []
    for i, r in enumerate(raw):
        problem = None
        if not isinstance(r, dict):
            problem = "not an object"
        elif not isinstance(r.get("shape"), dict) or not r["shape"]:
            problem = 'no "shape" object'
        elif not isinstance(r.get("ms"), dict):
            problem = 'no "ms" object'
        elif number(r["ms"].get("mkernel")) is None:
            problem = 'no positive "ms.mkernel"'
        if problem:
            warn(f"{path.name}: row {i} skipped: {problem}")
        else:
            rows.append(r)
    if not rows:
        raise SchemaError("no usable row")
    kind = "collectives" if is_collectives(rows) else "timed"
    if kind == "collectives":
        for r in rows:
            if number(r["shape"]["bytes_per_rank"]) is None:
                raise SchemaError('a collectives row has no positive "shape.bytes_per_rank"')
    return kind, doc, rows


# ---- labels ------------------------------------------------------------------------------------

def fmt_bytes(n):
    n = int(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def shape_label(shape):
    if all(k in shape for k in ("M", "N", "K")):
        return f"{shape['M']}x{shape['N']}x{shape['K']}"
    if "bytes_per_rank" in shape:
        return fmt_bytes(shape["bytes_per_rank"])
    if all(k in shape for k in ("batch", "heads", "kv_heads", "seq_local", "head_dim")):
        return (f"B{shape['batch']} H{shape['heads']}/{shape['kv_heads']} S{shape['seq_local']} "
                f"D{shape['head_dim']}" + (" causal" if shape.get("causal") else "")
                + (f" w{shape['world']}" if shape.get("world", 1) > 1 else ""))
    if all(k in shape for k in ("tokens_per_rank", "hidden", "intermediate", "experts", "top_k")):
        return (f"{shape.get('model', 'MoE')} T{shape['tokens_per_rank']}: H{shape['hidden']} "
                f"I{shape['intermediate']} E{shape['experts']} top-{shape['top_k']}")
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def fmt_value(v):
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def baseline_name(doc):
    """'NCCL 22809' (NCCL's version code) reads as 'NCCL 2.28.9'."""
    b = doc.get("baseline")
    if not isinstance(b, str):
        return None
    m = re.fullmatch(r"NCCL (\d)(\d\d)(\d\d)", b.strip())
    return f"NCCL {m[1]}.{int(m[2])}.{int(m[3])}" if m else b


def gpu_short(device):
    return re.sub(r"^NVIDIA\s+", "", device) if device else "?"


def provenance(doc, rows):
    """'2x NVIDIA H200, 1 node, nvlink' and 'commit 94cdea8, 2026-11-30 06:14 UTC, bf16'."""
    world = doc.get("world_size")
    nodes = doc.get("num_nodes")
    gpus = doc.get("gpus", world)  # ranks sharing GPUs (in-process): fewer GPUs than ranks
    where = f"{gpus}x " if isinstance(gpus, int) else ""
    where += str(doc.get("device") or "unknown device")
    if isinstance(world, int):
        where += f" (world size {world}"
        if isinstance(nodes, int):
            where += f", {nodes} node{'s' if nodes != 1 else ''}"
        if doc.get("transport"):
            where += f", {doc['transport']}"
        where += ")"
    commit = doc.get("commit")
    when = str(doc.get("date") or "date ?")
    m = re.fullmatch(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)(:\d\d(\.\d+)?)?Z?", when)
    if m:
        when = f"{m[1]} {m[2]} UTC"
    dtypes = sorted({str(r["dtype"]) for r in rows if r.get("dtype")})
    what = [f"commit {commit[:7]}" if isinstance(commit, str) and commit else "commit ?", when]
    if dtypes:
        what.append("/".join(dtypes))
    base = baseline_name(doc)
    if base:
        what.append(f"baseline {base}")
    return where, ", ".join(what)


def correctness(r):
    """True, False, or None (not reported)."""
    c = r.get("correct")
    return c if isinstance(c, bool) else None


def series_style(key, extras, gemm=True):
    if key == "sequential" and not gemm:
        return "sequential (the unfused parts, one after the other)", SERIES[key][1]
    if key == "gemm_alone" and not gemm:  # MoE: the experts' grouped GEMM alone
        return "GEMM alone (torch._grouped_mm)", SERIES[key][1]
    if key in SERIES:
        return SERIES[key]
    if key not in extras:
        extras[key] = EXTRA_COLORS[len(extras) % len(EXTRA_COLORS)]
    return key.replace("_", " "), extras[key]


# ---- one file: kernels timed against baselines ------------------------------------------------

def limit_of(r):
    lim = number(r.get("limit_ms"))
    if lim is None:
        parts = [number(r["ms"].get(k)) for k in ("gemm_alone", "comm_alone")]
        if all(parts):
            lim = max(parts)
    return lim


def plot_timed(path, doc, rows, out):
    """One panel per shape: bars of ms per series, dashed line at the ideal limit."""
    keys = []
    for r in rows:
        for k, v in r["ms"].items():
            if number(v) is not None and k not in keys:
                keys.append(k)
    order = [k for k in SERIES_ORDER if k in keys]
    order += sorted(k for k in keys if k not in SERIES_ORDER)
    absent = sorted({k for r in rows for k in r["ms"]} - set(order))
    extras = {}
    multi_dtype = len({r.get("dtype") for r in rows}) > 1
    gemm = all(all(k in r["shape"] for k in "MNK") for r in rows)
    has_limit = any(limit_of(r) for r in rows)

    n = len(rows)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    panel_w = max(3.9, 0.62 * len(order) + 0.8)
    legend_rows = math.ceil((len(order) + 1 + any(correctness(r) is False for r in rows)) / 3)
    bottom_in = 0.3 + 0.22 * legend_rows + 0.2  # legend rows and the footnote, in inches
    fig_h = 3.8 * nrows + 1.3 + bottom_in
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(panel_w * ncols + 0.8, 10), fig_h),
                             squeeze=False)
    wrong_rows, any_na = 0, False
    for idx, r in enumerate(rows):
        ax = axes[idx // ncols][idx % ncols]
        ok = correctness(r)
        lim = limit_of(r)
        top = 0.0
        for j, k in enumerate(order):
            v = number(r["ms"].get(k))
            color = series_style(k, extras)[1]
            if v is None:
                ax.text(j, 0, "n/a", ha="center", va="bottom", fontsize=8, color="#777777")
                any_na = True
                continue
            wrong = k == "mkernel" and ok is False
            ax.bar(j, v, width=0.8, color="white" if wrong else color,
                   edgecolor=WRONG_COLOR if wrong else "none", hatch="///" if wrong else None,
                   linewidth=1.5 if wrong else 0)
            ax.text(j, v, fmt_value(v) + ("\nWRONG" if wrong else ""), ha="center", va="bottom",
                    fontsize=8, color=WRONG_COLOR if wrong else "black", zorder=4,
                    fontweight="bold" if wrong or k == "mkernel" else "normal",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.75, pad=0.3))
            top = max(top, v)
        if lim is not None:
            ax.axhline(lim, color=LIMIT_COLOR, linestyle="--", linewidth=1.2, zorder=3)
            top = max(top, lim)
        ax.set_ylim(0, top * 1.28 if top > 0 else 1)
        ax.set_xlim(-0.6, len(order) - 0.4)
        ax.set_xticks([])
        label = shape_label(r["shape"])
        if r.get("op"):
            label = f"{r['op']}  {label}"
        if multi_dtype and r.get("dtype"):
            label += f" ({r['dtype']})"
        if r.get("b_layout") == "kn":
            label += " B[K,N]"
        m = number(r["ms"]["mkernel"])
        seq = number(r["ms"].get("sequential"))
        sp = number(r.get("speedup_vs_sequential")) or (seq / m if seq else None)
        tf = number(r.get("tflops"))
        lines = [label + ("  OUTPUT WRONG" if ok is False else "")]
        facts = [f"{sp:.2f}x speedup vs sequential" if sp else None,
                 f"{tf:.0f} TFLOP/s" if tf else None]
        if any(facts):
            lines.append("mkernel: " + ", ".join(f for f in facts if f))
        if lim:
            lines.append(f"ideal {fmt_value(lim)} ms; mkernel takes {m / lim:.2f}x that")
        if ok is False:
            wrong_rows += 1
        ax.set_title("\n".join(lines), fontsize=9, color=WRONG_COLOR if ok is False else "black")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        if idx % ncols == 0:
            ax.set_ylabel("time per call (ms)")
    for idx in range(n, nrows * ncols):
        axes[idx // ncols][idx % ncols].axis("off")

    where, what = provenance(doc, rows)
    fig.suptitle(f"{doc['kernel']}: time per call on {where}, lower is better\n"
                 f"{what}; one panel per shape{' (M x N x K)' if gemm else ''}; median over "
                 f"iterations, max over ranks", fontsize=11)
    handles = [Patch(color=series_style(k, extras, gemm)[1], label=series_style(k, extras, gemm)[0])
               for k in order]
    if has_limit:
        handles.append(Line2D([], [], color=LIMIT_COLOR, linestyle="--",
                              label="ideal: max(compute alone, comm alone)"))
    if wrong_rows:
        handles.append(Patch(facecolor="white", edgecolor=WRONG_COLOR, hatch="///",
                             label="mkernel output WRONG in that run"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3 if ncols < 3 else 4),
               fontsize=8.5,
               frameon=False, bbox_to_anchor=(0.5, 0.22 / fig_h))
    notes = ["n/a: that baseline was not measured for that shape"] if any_na else []
    if absent:
        names = ", ".join(series_style(k, extras)[0] for k in absent)
        notes.append(f"not measured for any shape in this run (null): {names}")
    note = "; ".join(notes)
    fig.text(0.5, 0.05 / fig_h, note, fontsize=8, color="#555555", va="bottom", ha="center")
    fig.tight_layout(rect=(0, bottom_in / fig_h, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- one file: standalone collectives ----------------------------------------------------------

def bus_bw(r, key, world):
    """GB/s from busbw_gbps, else from ms with nccl-tests' bus bandwidth definition."""
    bw = r.get("busbw_gbps")
    if isinstance(bw, dict):
        if key == "peer_copy":
            v = number(bw.get("peer_copy_one_way")) or number(bw.get("peer_copy"))
        else:
            v = number(bw.get(key))
        if v is not None:
            return v
    ms = number(r["ms"].get(key))
    if ms is None:
        return None
    nbytes = float(r["shape"]["bytes_per_rank"])
    if key != "peer_copy" and isinstance(world, int) and world > 1:
        gather_or_scatter = r["op"] in ("all_gather", "reduce_scatter")
        nbytes *= (world - 1) if gather_or_scatter else 2 * (world - 1) / world
    return nbytes / (ms * 1e-3) / 1e9


def plot_collectives(path, doc, rows, out):
    ops = [o for o in OP_ORDER if any(r["op"] == o for r in rows)]
    ops += sorted({r["op"] for r in rows} - set(ops))
    world = doc.get("world_size")
    series = [("mkernel", "mkernel", SERIES["mkernel"][1]),
              ("nccl", baseline_name(doc) or "NCCL", SERIES["nccl"][1])]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.6 * len(ops) + 0.6, 5.6), squeeze=False,
                             sharey=True)
    wrong_rows, top = 0, 0.0
    have_ceiling = False
    for ax, op in zip(axes[0], ops):
        op_rows = sorted((r for r in rows if r["op"] == op),
                         key=lambda r: r["shape"]["bytes_per_rank"])
        width = 0.38
        ticks = []
        for i, r in enumerate(op_rows):
            ok = correctness(r)
            for j, (key, _, color) in enumerate(series):
                x = i + (j - 0.5) * width
                v = bus_bw(r, key, world)
                if v is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8, color="#777777")
                    continue
                wrong = key == "mkernel" and ok is False
                ax.bar(x, v, width=width * 0.95, color="white" if wrong else color,
                       edgecolor=WRONG_COLOR if wrong else "none", hatch="///" if wrong else None,
                       linewidth=1.5 if wrong else 0)
                ax.text(x, v, f"{v:.0f}" + ("\nWRONG" if wrong else ""), ha="center", va="bottom",
                        fontsize=8.5, color=WRONG_COLOR if wrong else "black",
                        fontweight="bold" if wrong or key == "mkernel" else "normal")
                top = max(top, v)
            ceiling = bus_bw(r, "peer_copy", world)
            if ceiling is not None:
                have_ceiling = True
                ax.hlines(ceiling, i - width * 1.15, i + width * 1.15, colors=LIMIT_COLOR,
                          linestyles="--", linewidth=1.4, zorder=3)
                mk = bus_bw(r, "mkernel", world)
                text = f"ceiling {ceiling:.0f}" + (f"\nmkernel at {mk / ceiling:.0%}" if mk else "")
                ax.text(i, ceiling * 1.012, text, ha="center", va="bottom", fontsize=7.5,
                        color=LIMIT_COLOR)
                top = max(top, ceiling * 1.09)
            tick = fmt_bytes(r["shape"]["bytes_per_rank"])
            m, nc = number(r["ms"]["mkernel"]), number(r["ms"].get("nccl"))
            sp = number(r.get("speedup_vs_nccl")) or (nc / m if nc else None)
            if sp:
                tick += f"\n{sp:.2f}x vs NCCL"
            if ok is False:
                wrong_rows += 1
                tick += "\nOUTPUT WRONG"
            ticks.append(tick)
        ax.set_xticks(range(len(op_rows)))
        ax.set_xticklabels(ticks, fontsize=9)
        for lbl, r in zip(ax.get_xticklabels(), op_rows):
            if correctness(r) is False:
                lbl.set_color(WRONG_COLOR)
        ax.set_xlim(-0.6, len(op_rows) - 0.4)
        ax.set_title(op, fontsize=11, fontweight="bold")
        ax.set_xlabel("bytes per rank")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][0].set_ylim(0, top * 1.12 if top > 0 else 1)

    where, what = provenance(doc, rows)
    fig.suptitle(f"{doc['kernel']}: bus bandwidth on {where}, higher is better\n{what}; bus "
                 f"bandwidth as nccl-tests defines it; median over iterations, max over ranks",
                 fontsize=11)
    handles = [Patch(color=c, label=lbl) for _, lbl, c in series]
    if have_ceiling:
        handles.append(Line2D([], [], color=LIMIT_COLOR, linestyle="--",
                              label="ceiling: one-way peer copy (copy engine), same run"))
    if wrong_rows:
        handles.append(Patch(facecolor="white", edgecolor=WRONG_COLOR, hatch="///",
                             label="mkernel output WRONG in that run"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- sweeps (the engines alone over many shapes) -------------------------------------------------

# Files of a kernel with more rows than this are drawn as sweeps: one panel per (panel keys), the
# speedup over the library baseline against the x key (log scale), one line per (line keys).
SWEEP_ROWS = 24
SWEEPS = {
    "gemm": {"panel": ("N", "K"), "x": "M", "lines": ("b_layout",), "baseline": "gemm_alone",
             "against": "cuBLAS", "floor": 0.95},
    "grouped_gemm": {"panel": ("N", "K", "experts"), "x": "rows", "lines": ("layout", "skew"),
                     "baseline": "torch_grouped_mm", "against": "torch._grouped_mm",
                     "overview": (("N", "K"), ("layout",))},  # one bar per expert shape, layout
}


def sweep_spec(doc, rows):
    spec = SWEEPS.get(doc.get("kernel"))
    if spec is None or len(rows) <= SWEEP_ROWS:
        return None
    need = set(spec["panel"]) | {spec["x"]}
    return spec if all(need <= set(r["shape"]) for r in rows) else None


def row_value(r, key):
    return r["shape"].get(key, r.get(key))


def sweep_points(spec, rows):
    """{panel: {line: [(x, speedup, correct)]}} in a stable order."""
    panels = {}
    for r in rows:
        base = number(r["ms"].get(spec["baseline"]))
        m = number(r["ms"]["mkernel"])
        if base is None or m is None:
            continue
        panel = tuple(r["shape"][k] for k in spec["panel"])
        line = tuple(str(row_value(r, k)) for k in spec["lines"] if row_value(r, k) is not None)
        panels.setdefault(panel, {}).setdefault(line, []).append(
            (row_value(r, spec["x"]), base / m, correctness(r)))
    for lines in panels.values():
        for pts in lines.values():
            pts.sort()
    return panels


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def plot_sweep(path, doc, rows, out, spec):
    panels = sweep_points(spec, rows)
    if not panels:
        raise SchemaError(f"no row has both mkernel and {spec['baseline']}")
    n = len(panels)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows + 1.4), squeeze=False)
    styles = ["-", "--", "-.", ":"]
    wrong_any = False
    all_speedups = []
    for i, (panel, lines) in enumerate(panels.items()):
        ax = axes[i // ncols][i % ncols]
        for j, (line, pts) in enumerate(lines.items()):
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            all_speedups += ys
            color = KERNEL_COLORS[j % len(KERNEL_COLORS)]
            ax.plot(xs, ys, styles[j % len(styles)], marker="o", markersize=3.5, color=color,
                    label=" ".join(line) or "mkernel")
            bad = [(x, y) for x, y, ok in pts if ok is False]
            if bad:
                wrong_any = True
                ax.plot([b[0] for b in bad], [b[1] for b in bad], "x", color=WRONG_COLOR,
                        markersize=9, markeredgewidth=2)
        ax.axhline(1.0, color=LIMIT_COLOR, linestyle="--", linewidth=1)
        if spec.get("floor"):  # the engine's target at every point
            ax.axhline(spec["floor"], color=WRONG_COLOR, linestyle=":", linewidth=1,
                       label=f"target: >= {spec['floor']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(spec["x"])
        ax.set_ylabel(f"speedup vs {spec['against']}")
        g = geomean([p[1] for pts in lines.values() for p in pts])
        title = ", ".join(f"{k} {v}" for k, v in zip(spec["panel"], panel))
        ax.set_title(f"{title}  (geomean {g:.2f}x)" if g else title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # after the target line, so that it is listed
    for i in range(n, nrows * ncols):
        axes[i // ncols][i % ncols].axis("off")
    where, what = provenance(doc, rows)
    g = geomean(all_speedups)
    fig.suptitle(f"{doc['kernel']}: mkernel against {spec['against']} (higher is better; "
                 f"geomean {g:.3f}x, worst {min(all_speedups):.3f}x over {len(all_speedups)} "
                 f"points)\n{where}; {what}" + ("; red x: output WRONG" if wrong_any else ""),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ---- overview ----------------------------------------------------------------------------------

def overview_rows(kind, doc, rows):
    """(label, speedup, correct) per row against the file's unfused baseline (a sweep: the
    geomean per panel and line)."""
    spec = sweep_spec(doc, rows)
    if spec is not None:
        if "overview" in spec:  # coarser than the plot's panels and lines
            spec = dict(spec, panel=spec["overview"][0], lines=spec["overview"][1])
        res = []
        for panel, lines in sweep_points(spec, rows).items():
            for line, pts in lines.items():
                label = " ".join(f"{k} {v}" for k, v in zip(spec["panel"], panel))
                label += (" " + " ".join(line) if line else "") + f", geomean of {len(pts)}"
                res.append((label, geomean([p[1] for p in pts]),
                            False if any(p[2] is False for p in pts) else None))
        return res
    res = []
    if kind == "collectives":
        order = {o: i for i, o in enumerate(OP_ORDER)}
        rows = sorted(rows, key=lambda r: (order.get(r["op"], len(order)), r["op"],
                                           r["shape"]["bytes_per_rank"]))
    for r in rows:
        m = number(r["ms"]["mkernel"])
        if kind == "collectives":
            nc = number(r["ms"].get("nccl"))
            sp = number(r.get("speedup_vs_nccl")) or (nc / m if nc else None)
            label = f"{r['op']} {fmt_bytes(r['shape']['bytes_per_rank'])}"
        elif doc.get("kernel") in ("gemm", "grouped_gemm"):  # an engine alone: its library
            base = number(r["ms"].get("gemm_alone" if doc["kernel"] == "gemm"
                                      else "torch_grouped_mm"))
            sp = base / m if base and m else None
            label = shape_label(r["shape"])
        elif doc.get("kernel") in ("attention", "ring_attention") and \
                r["ms"].get("sequential") is None:
            # one GPU: against torch SDPA (attention) or the engine on the same work (ring)
            base = number(r["ms"].get("torch_sdpa" if doc["kernel"] == "attention"
                                      else "engine_same_work"))
            sp = base / m if base and m else None
            label = shape_label(r["shape"])
        elif doc.get("kernel") == "moe_dispatch_gemm" and r["ms"].get("sequential") is None:
            # one GPU (no NCCL all-to-all): against torch._grouped_mm on the routed rows
            base = number(r["ms"].get("gemm_alone"))
            sp = base / m if base and m else None
            label = shape_label(r["shape"])
        elif doc.get("kernel") == "moe_layer" and r["ms"].get("sequential") is None:
            # one GPU: against the plain PyTorch layer (torch._grouped_mm), or (ranks sharing the
            # GPU) against the layer at world 1 on the same work
            base = number(r["ms"].get("world1_same_work") or r["ms"].get("torch_reference"))
            sp = base / m if base and m else None
            label = shape_label(r["shape"])
        else:
            seq = number(r["ms"].get("sequential"))
            sp = number(r.get("speedup_vs_sequential")) or (seq / m if seq else None)
            label = (f"{r['op']} " if r.get("op") else "") + shape_label(r["shape"])
        if r.get("dtype") and len({x.get("dtype") for x in rows}) > 1:
            label += f" {r['dtype']}"
        if sp is not None:
            res.append((label, sp, correctness(r)))
    return res


def plot_overview(files, out):
    groups = []
    for path, kind, doc, rows in files:
        entries = overview_rows(kind, doc, rows)
        if not entries:
            warn(f"{path.name}: no row has a baseline to compare with; left out of the overview")
            continue
        world, nodes = doc.get("world_size"), doc.get("num_nodes")
        commit = doc.get("commit")
        one_gpu = all(r["ms"].get("sequential") is None for r in rows)
        against = ("NCCL" if kind == "collectives" else
                   "cuBLAS" if doc.get("kernel") == "gemm" else
                   "torch._grouped_mm" if doc.get("kernel") == "grouped_gemm" else
                   "torch._grouped_mm alone" if doc.get("kernel") == "moe_dispatch_gemm"
                   and one_gpu else
                   "world 1 on the same work" if doc.get("kernel") == "moe_layer" and one_gpu
                   and any(r["ms"].get("world1_same_work") is not None for r in rows) else
                   "the PyTorch layer" if doc.get("kernel") == "moe_layer" and one_gpu else
                   "torch SDPA" if doc.get("kernel") == "attention" and one_gpu else
                   "the engine on the same work" if doc.get("kernel") == "ring_attention"
                   and one_gpu else "sequential")
        gpus = doc.get("gpus")
        ranks = (f"{world} ranks on {gpus} GPU" if isinstance(gpus, int) and gpus != world
                 else f"world {world if world is not None else '?'}")
        header = (f"{doc['kernel']} vs {against}: "
                  f"{gpu_short(doc.get('device'))}, {ranks}"
                  + (f", {nodes} nodes" if isinstance(nodes, int) and nodes > 1 else "")
                  + f"; commit {commit[:7] if isinstance(commit, str) else '?'}, "
                  + str(doc.get("date") or "?")[:10])
        groups.append((kind, header, entries))
    if not groups:
        return False
    n = sum(len(g[2]) for g in groups) + len(groups)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.3 * n))
    y, yticks, ylabels = 0, [], []
    xmax, wrong_any = 1.0, False
    for gi, (_, header, entries) in enumerate(groups):
        color = KERNEL_COLORS[gi % len(KERNEL_COLORS)]
        ax.text(0.01, y + 0.15, header, fontsize=9.5, fontweight="bold", color=color, va="center",
                transform=ax.get_yaxis_transform(), zorder=4,
                bbox=dict(facecolor="white", edgecolor="none", pad=1))
        y += 1
        for label, sp, ok in entries:
            wrong = ok is False
            wrong_any |= wrong
            ax.barh(y, sp, height=0.72, color="white" if wrong else color,
                    edgecolor=WRONG_COLOR if wrong else "none", hatch="///" if wrong else None,
                    linewidth=1.5 if wrong else 0)
            ax.text(sp, y, f" {sp:.2f}x" + ("  WRONG" if wrong else ""), va="center", fontsize=9,
                    color=WRONG_COLOR if wrong else "black",
                    fontweight="bold" if wrong else "normal", zorder=4,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=0.2))
            yticks.append(y)
            ylabels.append(label)
            xmax = max(xmax, sp)
            y += 1
        y += 0.3
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=9)
    ax.set_ylim(y - 0.5, -0.6)
    ax.axvline(1.0, color=LIMIT_COLOR, linestyle="--", linewidth=1.3)
    ax.text(1.0, 1.0, "1.0 = as fast as the baseline", transform=ax.get_xaxis_transform(),
            ha="center", va="bottom", fontsize=8.5, color=LIMIT_COLOR)
    ax.set_xlim(0, xmax * 1.2)
    ax.set_xlabel("speedup of mkernel = baseline time / mkernel time (higher is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if wrong_any:
        wrong_patch = Patch(facecolor="white", edgecolor=WRONG_COLOR, hatch="///",
                            label="mkernel output WRONG in that run (speedup does not count)")
        ax.legend(handles=[wrong_patch],
                  loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.4 + 0.3 * n)),
                  fontsize=8.5, frameon=False)
    kinds = {g[0] for g in groups}
    against = []
    if "timed" in kinds:
        against.append("fused kernels vs the sequential composition (NCCL + cuBLAS)")
    if "collectives" in kinds:
        against.append("collectives vs NCCL")
    if any(h.startswith("gemm vs cuBLAS") for _, h, _ in groups):
        against.append("GEMM engine vs cuBLAS")
    ax.set_title("mkernel speedup over the baseline, every benchmarked shape\n"
                 + "; ".join(against), fontsize=11, pad=18)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return True


# ---- main --------------------------------------------------------------------------------------

def shown(p):
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                    help="directory of results files (default: bench/results)")
    ap.add_argument("--out", type=Path, default=REPO / "plots",
                    help="directory for the PNGs (default: plots/)")
    args = ap.parse_args(argv)

    paths = sorted(args.results.glob("*.json")) if args.results.is_dir() else []
    if not paths:
        print(f"plot.py: error: no results files (*.json) in {args.results}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    written, plotted = [], []
    for path in paths:
        try:
            kind, doc, rows = load(path)
        except SchemaError as e:
            warn(f"{path.name} skipped: {e}")
            continue
        stem = path.stem if path.stem != "overview" else "overview-results"
        out = args.out / f"{stem}.png"
        try:
            spec = sweep_spec(doc, rows) if kind != "collectives" else None
            if spec is not None:
                plot_sweep(path, doc, rows, out, spec)
            else:
                (plot_collectives if kind == "collectives" else plot_timed)(path, doc, rows, out)
        except Exception as e:  # a file the schema check let through but that cannot be drawn
            plt.close("all")
            warn(f"{path.name} skipped: cannot plot it ({type(e).__name__}: {e})")
            continue
        written.append(out)
        plotted.append((path, kind, doc, rows))
    if not plotted:
        print("plot.py: error: no results file could be plotted", file=sys.stderr)
        return 1
    overview = args.out / "overview.png"
    if plot_overview(plotted, overview):
        written.append(overview)
    else:
        warn("no row of any file has a baseline to compare with; overview.png not written")
    print("wrote:")
    for p in written:
        print(f"  {shown(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
