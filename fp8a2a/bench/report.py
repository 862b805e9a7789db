"""The all-to-all benchmark's statistics and outputs: percentiles, nccl-tests bandwidths, the
FP8/BF16 crossover and the bf16_below_bytes it recommends; the table, JSON, CSV and PNG writers.
Pure functions of the records the sweep produces (no process group, no device).

A record holds, per variant v and mode m (MODES: "train", the training step and the headline;
"infer", inference, the forward alone), `{v}_{m}_ms` (the whole call) and `{v}_{m}_{phase}_ms`
(PHASES[m]), each with _p10/_p90/_min/_max, `{v}_{m}_host_us`, `{v}_{m}_algbw_GBps`/`_busbw_GBps`
(of that mode's dispatch phase) and the GPU counts `{v}_{m}_launches`/`_copies`/`_syncs`/`_d2h`;
`{v}_wire_bytes`/`{v}_combine_wire_bytes` (the forward's); and the SPEEDUP_KEYS."""
import csv
import json
import math
import os
import sys
import textwrap
from typing import Dict, Optional, Sequence

from .. import DispatcherConfig

DEFAULT_BF16_BELOW_BYTES = DispatcherConfig().bf16_below_bytes
VARIANTS = ("megatron_bf16", "fp8a2a_bf16", "fp8a2a_fp8")
# What the table, summary and plot call each variant (the JSON and CSV keep the keys above).
NAMES = {"megatron_bf16": "megatron", "fp8a2a_bf16": "fp8a2a-bf16", "fp8a2a_fp8": "fp8a2a-fp8"}
LEGEND = ("megatron     megatron-core's `alltoall` dispatcher path in BF16 (the baseline)",
          "fp8a2a-bf16  fp8a2a.Dispatcher sending BF16 rows (what bf16_below_bytes falls back to)",
          "fp8a2a-fp8   fp8a2a.Dispatcher sending FP8 rows")
MODES = ("train", "infer")  # the training step (the headline), then inference (forward only)
PHASES = {"train": ("dispatch", "combine", "backward"), "infer": ("dispatch", "combine")}
SPEEDUP_KEYS = ("speedup_train", "speedup_train_vs_bf16_wire", "speedup_infer", "speedup_infer_dispatch",
                "speedup_infer_vs_bf16_wire_dispatch")
# the plot's panels, headline first
PLOT_TITLES = {"speedup_train": "training step (fwd + bwd): megatron / fp8a2a-fp8",
               "speedup_train_vs_bf16_wire": "training step (fwd + bwd): fp8a2a-bf16 / fp8a2a-fp8",
               "speedup_infer": "inference (fwd only), dispatch + combine: megatron / fp8a2a-fp8"}

# ------------------------------------------------------------------------------------------
# statistics, bandwidth, crossover (pure functions: tested on synthetic data)

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    vals = [float(v) for v in values]
    return {"median": percentile(vals, 50), "p10": percentile(vals, 10), "p90": percentile(vals, 90),
            "mean": sum(vals) / len(vals) if vals else float("nan"),
            "min": min(vals) if vals else float("nan"), "max": max(vals) if vals else float("nan"),
            "n": len(vals)}


def algbw_gbps(bytes_per_rank: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: bytes a rank sends (its whole send buffer) / time, GB/s."""
    return bytes_per_rank / seconds / 1e9 if seconds > 0 else float("nan")


def busbw_gbps(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth for alltoall: algbw * (n - 1) / n."""
    return algbw * (world - 1) / world if world > 0 else float("nan")


def find_crossover(sizes: Sequence[float], speedups: Sequence[Optional[float]], threshold: float = 1.0) -> dict:
    """Smallest message size from which FP8 wins (speedup >= threshold) at every larger size.

    status: 'crosses' (crossover_bytes interpolated in log(size) between the last losing and the
    first winning size), 'fp8_always_wins' (crossover_bytes: the smallest size measured, an upper
    bound), 'bf16_always_wins' (FP8 never wins for good: crossover above the largest size; None)
    or 'no_data'."""
    pts = sorted((float(s), float(v)) for s, v in zip(sizes, speedups)
                 if v is not None and not math.isnan(float(v)))
    if not pts:
        return {"status": "no_data", "crossover_bytes": None, "last_loss_bytes": None, "first_win_bytes": None}
    k = len(pts)
    while k > 0 and pts[k - 1][1] >= threshold:
        k -= 1
    if k == 0:
        return {"status": "fp8_always_wins", "crossover_bytes": pts[0][0], "last_loss_bytes": None,
                "first_win_bytes": pts[0][0]}
    if k == len(pts):
        return {"status": "bf16_always_wins", "crossover_bytes": None, "last_loss_bytes": pts[-1][0],
                "first_win_bytes": None}
    (s0, v0), (s1, v1) = pts[k - 1], pts[k]
    t = (threshold - v0) / (v1 - v0) if v1 != v0 else 0.5
    cross = math.exp(math.log(s0) + min(max(t, 0.0), 1.0) * (math.log(s1) - math.log(s0)))
    return {"status": "crosses", "crossover_bytes": cross, "last_loss_bytes": s0, "first_win_bytes": s1}


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def recommend_threshold(crossovers: Dict[str, dict], default: int = DEFAULT_BF16_BELOW_BYTES) -> dict:
    """One `bf16_below_bytes` for all series: the largest crossover, rounded up to a power of two
    (so FP8 wins above it in every series that crosses)."""
    crossing = {k: c for k, c in crossovers.items() if c["status"] == "crosses"}
    never = sorted(k for k, c in crossovers.items() if c["status"] == "bf16_always_wins")
    always = {k: c for k, c in crossovers.items() if c["status"] == "fp8_always_wins"}
    notes = []
    if never:
        notes.append(f"fp8a2a-fp8 did not beat fp8a2a-bf16 for good at any measured size in: {', '.join(never)}")
    if crossing:
        worst = max(crossing, key=lambda k: crossing[k]["crossover_bytes"])
        value = _pow2_ceil(crossing[worst]["crossover_bytes"])
        text = (f"recommended bf16_below_bytes = {value} ({fmt_bytes(value)}): the largest crossover "
                f"({worst}, {fmt_bytes(crossing[worst]['crossover_bytes'])}) rounded up to a power of two")
    elif always:
        smallest = min(c["crossover_bytes"] for c in always.values())
        value = min(default, int(smallest))
        text = (f"fp8a2a-fp8 beat fp8a2a-bf16 at every size measured (down to {fmt_bytes(smallest)}): keep "
                f"bf16_below_bytes <= {fmt_bytes(smallest)}; recommended {value} ({fmt_bytes(value)})")
    else:
        value = None
        text = (f"no crossover found: fp8a2a-fp8 never beat fp8a2a-bf16 for good in this sweep; no "
                f"bf16_below_bytes to recommend (keep the default {fmt_bytes(default)} or measure larger sizes)")
    return {"recommended_bytes": value, "text": "; ".join([text] + notes), "default_bytes": default}


def fmt_bytes(n) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def analyse(records, default=DEFAULT_BF16_BELOW_BYTES):
    """Crossovers per series (FP8 vs the BF16 wire of the same dispatcher, which is what
    bf16_below_bytes falls back to, and FP8 vs the Megatron baseline) and the threshold, of the
    training step (the headline: the whole step, whose dispatch forward and combine backward follow
    the format); under "inference", of the forward alone (the dispatch against the BF16 wire,
    dispatch + combine against Megatron)."""
    def crossovers(wire_key, mega_key):
        vs_wire, vs_mega = {}, {}
        for name, rs in _by_series(records).items():
            sizes = [r["msg_bytes"] for r in rs]
            vs_wire[name] = find_crossover(sizes, [r.get(wire_key) for r in rs])
            vs_mega[name] = find_crossover(sizes, [r.get(mega_key) for r in rs])
        return {"crossover_vs_bf16_wire": vs_wire, "crossover_vs_megatron": vs_mega,
                "recommendation": recommend_threshold(vs_wire, default)}
    out = crossovers("speedup_train_vs_bf16_wire", "speedup_train")
    out["inference"] = crossovers("speedup_infer_vs_bf16_wire_dispatch", "speedup_infer")
    return out


_CSV_STEP = ("ms", "ms_p10", "ms_p90", "ms_min", "ms_max")
CSV_COLUMNS = ["series", "hidden", "experts", "topk", "granularity", "tokens", "world", "msg_bytes"] + [
    f"{v}_{m}_{k}" for v in VARIANTS for m in MODES for k in _CSV_STEP + tuple(
        f"{ph}_ms{q}" for ph in PHASES[m] for q in ("", "_p10", "_p90")) + (
        "host_us", "algbw_GBps", "busbw_GBps", "launches", "copies", "syncs", "d2h")] + [
    f"{v}_{k}" for v in VARIANTS for k in ("wire_bytes", "combine_wire_bytes")] + [
    s + q for s in SPEEDUP_KEYS for q in ("", "_min", "_max")] + ["wire_ratio_dispatch"]


def _clean(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json(path, records, meta, analysis):
    doc = {"benchmark": "fp8a2a all-to-all (python -m fp8a2a.bench)", "functional_only": meta["functional_only"],
           "meta": meta, "analysis": analysis, "records": records}
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1)


def write_csv(path, records):
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in records:
            wr.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})


def write_plot(path, records, meta, analysis=None) -> Optional[str]:
    """PNG of three speedups against message size (PLOT_TITLES: the training step's first), one line per
    series (the ratio of the medians)
    in a band from the smallest to the largest per-iteration ratio, one legend for all panels;
    returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=True)
    rec = (analysis or {}).get("recommendation", {}).get("recommended_bytes")
    handles = {}
    for ax, key in zip(axes, PLOT_TITLES):
        for i, (name, rs) in enumerate(_by_series(records).items()):
            pts = sorted((r["msg_bytes"], r[key], r.get(f"{key}_min"), r.get(f"{key}_max"))
                         for r in rs if r.get(key) is not None)
            if not pts:
                continue
            color = f"C{i % 10}"
            x = [p[0] for p in pts]
            (line,) = ax.plot(x, [p[1] for p in pts], marker="o", color=color)
            handles.setdefault(name, line)
            if all(p[2] is not None and p[3] is not None for p in pts):
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], color=color, alpha=0.2, linewidth=0)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        if rec and key == "speedup_train_vs_bf16_wire":
            handles[f"recommended bf16_below_bytes ({fmt_bytes(rec)})"] = ax.axvline(
                rec, color="red", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v).replace(".0 ", " ")))
        ax.set_xlabel("BF16 input per rank (tokens x hidden x 2 B)")
        ax.set_title(PLOT_TITLES[key], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup (> 1: fp8a2a-fp8 faster)")
    handles["min-max over iterations"] = Patch(color="gray", alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4), fontsize=9,
               frameon=False)
    label = "FUNCTIONAL ONLY (CPU, gloo)" if meta["functional_only"] else meta["device"]
    fig.suptitle(f"fp8a2a all-to-all: {label}, world size {meta['world']}; line: ratio of medians; "
                 "training step: x and router weights requiring grad")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(handles) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _by_series(records):
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    return by


def _num(v, spec=None):
    """A figure with three significant digits (no exponent), or '-' where there is none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec:
        return format(v, spec)
    a = abs(v)
    return format(v, ".0f" if a >= 100 else ".1f" if a >= 10 else ".2f" if a >= 1 else ".3f")


def _size(n):
    """A compact byte size for the table: 64 KiB, 1.5 MiB, 14 MiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            break
        n /= 1024
    text = f"{n:.1f}" if n < 10 and unit != "B" else f"{n:.0f}"
    return f"{text[:-2] if text.endswith('.0') else text} {unit}"


def _pair(r, key, spec, mode="train"):
    """megatron's figure/fp8a2a-fp8's, of one mode (host_ms: from the records' host_us)."""
    a, b = (r.get(f"{v}_{mode}_host_us") / 1e3 if key == "host_ms" and r.get(f"{v}_{mode}_host_us") is not None
            else r.get(f"{v}_{mode}_{key}") for v in ("megatron_bf16", "fp8a2a_fp8"))
    return "-" if a is None and b is None else f"{_num(a, spec)}/{_num(b, spec)}"


def table_columns(gpu: bool):
    """(group, header, width, cell(record)) per column: the training step first (the headline),
    inference in one column; the GPU-only counts (of the training step) only with gpu."""
    m, f = "megatron_bf16", "fp8a2a_fp8"
    cols = [("", "tokens", 6, lambda r: str(r["tokens"])),
            ("", "msg/rank", 9, lambda r: _size(r["msg_bytes"])),
            ("train step ms", NAMES[m], 9, lambda r: _num(r.get(f"{m}_train_ms"))),
            ("train step ms", NAMES[f], 11, lambda r: _num(r.get(f"{f}_train_ms"))),
            ("speedup x", "train", 6, lambda r: _num(r.get("speedup_train"), ".2f")),
            ("speedup x", "vs-bf16", 8, lambda r: _num(r.get("speedup_train_vs_bf16_wire"), ".2f")),
            ("speedup x", "infer", 6, lambda r: _num(r.get("speedup_infer"), ".2f")),
            ("wire", "fp8/meg", 8, lambda r: _num(r.get("wire_ratio_dispatch"), ".3f"))]
    if gpu:
        cols += [("GPU", "host ms", 10, lambda r: _pair(r, "host_ms", None)),
                 ("GPU", "busbw", 6, lambda r: _num(r.get(f"{f}_train_busbw_GBps"))),
                 ("GPU", "kernels", 7, lambda r: _pair(r, "launches", "d")),
                 ("GPU", "syncs", 5, lambda r: _pair(r, "syncs", "d"))]
    return cols


def format_table(records, gpu: bool = False) -> str:
    """The sweep's table: one row per point, two header lines (the column groups, then the columns)."""
    cols = table_columns(gpu)
    w0 = max([len("series")] + [len(r["series"]) for r in records])
    groups, heads = [" " * w0], [f"{'series':<{w0}}"]
    for i, (group, head, width, _) in enumerate(cols):
        heads.append(f" {head:>{width}}")
        if i and cols[i - 1][0] == group:
            continue
        span = sum(c[2] + 1 for c in cols[i:] if c[0] == group) - 1  # the group's columns are adjacent
        groups.append(" " + (f"{' ' + group + ' ':-^{span}}" if group else " " * span))
    lines = ["".join(groups).rstrip(), "".join(heads), "-" * len("".join(heads))]
    for r in records:
        lines.append(f"{r['series']:<{w0}}" + "".join(f" {cell(r):>{width}}" for _, _, width, cell in cols))
    return "\n".join(lines)


def table_legend(meta) -> str:
    gpu = not meta["functional_only"]
    lines = ["train step (the headline): dispatch + combine forward, then y.backward(dy); x and the router weights",
             "            require grad; identity experts (megatron's multiply each row by its prob; fp8a2a's",
             "            dequantize, and its combine applies the weights)",
             "infer: inference, dispatch + combine forward only (nothing requires grad)",
             f"times: per iteration the slowest rank's; the median of {meta['iters']} iterations (phases, p10/p90, "
             "min/max",
             "       and inference times: in the CSV and JSON)",
             "msg/rank: the BF16 input per rank, tokens x hidden x 2 B",
             "speedup: train: megatron / fp8a2a-fp8 training step time; vs-bf16: fp8a2a-bf16 / fp8a2a-fp8 training",
             "         step time; infer: megatron / fp8a2a-fp8 inference time; > 1: fp8a2a-fp8 is faster",
             "wire: the bytes fp8a2a-fp8's dispatch (forward) sends / megatron's"]
    if gpu:
        lines += ["GPU: host ms, kernels, syncs: megatron/fp8a2a-fp8 per training step (host time without a sync;",
                  "     launches and host syncs from the profiler); busbw: nccl-tests alltoall bus bandwidth of",
                  "     fp8a2a-fp8's dispatch in the training step, GB/s"]
    else:
        lines.append("(host time, bus bandwidth, kernel and host-sync counts: GPU figures, not shown on a CPU)")
    return "\n".join(["variants:"] + [f"  {v}" for v in LEGEND] + lines)


def format_summary(records, analysis) -> str:
    head = (f"{'series':<20}{'train at largest':>17}{'best':>7}{'infer at largest':>17}{'beats fp8a2a-bf16 from':>24}"
            f"{'beats megatron from':>21}")
    lines = ["summary per series: fp8a2a-fp8's training step speedup over megatron at the largest size and at best,",
             "its inference speedup at the largest size; the message size from which fp8a2a-fp8's training step",
             "wins at every larger size", head, "-" * len(head)]

    def cx(c):
        return {"crosses": fmt_bytes(c["crossover_bytes"]), "fp8_always_wins": f"<= {fmt_bytes(c['crossover_bytes'])}",
                "bf16_always_wins": f"> {fmt_bytes(c['last_loss_bytes'])} (never)"}.get(c["status"], "-")
    for name, rs in _by_series(records).items():
        big = max(rs, key=lambda r: r["msg_bytes"])
        sp = [r["speedup_train"] for r in rs if r.get("speedup_train") is not None]
        lines.append(f"{name:<20}{_num(big.get('speedup_train'), '.2f'):>17}{_num(max(sp) if sp else None, '.2f'):>7}"
                     f"{_num(big.get('speedup_infer'), '.2f'):>17}"
                     f"{cx(analysis['crossover_vs_bf16_wire'][name]):>24}"
                     f"{cx(analysis['crossover_vs_megatron'][name]):>21}")
    lines += textwrap.wrap("training step: " + analysis["recommendation"]["text"], 110)
    if "inference" in analysis:
        lines += textwrap.wrap("inference (forward only; dispatch time): "
                               + analysis["inference"]["recommendation"]["text"], 110)
    return "\n".join(lines)


def report(records, meta, args, out=None):
    """Print the table and summary and write JSON, CSV and PNG; None (and nothing written) when no
    variant was measured at any point, else the analysis."""
    out = out or sys.stdout
    errors = sorted({f"{NAMES[v]}: {r[f'{v}_error']}" for r in records for v in VARIANTS if r.get(f"{v}_error")})
    for e in errors:
        print(f"not measured: {e}", file=out)
    if not any(r.get(f"{v}_{m}_ms") is not None for r in records for v in VARIANTS for m in MODES):
        print("nothing was measured: no file written", file=out)
        return None
    analysis = analyse(records)
    label = ("FUNCTIONAL NUMBERS ONLY: CPU, gloo ranks in one machine; says nothing about a GPU cluster"
             if meta["functional_only"] else f"{meta['device']}, backend {meta['backend']}")
    print(f"\nfp8a2a all-to-all benchmark: world size {meta['world']}; {label}", file=out)
    print(format_table(records, gpu=not meta["functional_only"]), file=out)
    print(table_legend(meta), file=out)
    if meta.get("skipped_series"):
        print(f"skipped (experts not a multiple of world size {meta['world']}): {', '.join(meta['skipped_series'])}",
              file=out)
    print("", file=out)
    print(format_summary(records, analysis), file=out)
    if meta["functional_only"]:
        print("(functional run: the crossover and threshold above say nothing about a GPU cluster)", file=out)
    paths = output_paths(args)
    os.makedirs(os.path.dirname(os.path.abspath(paths["json"])), exist_ok=True)
    write_json(paths["json"], records, meta, analysis)
    write_csv(paths["csv"], records)
    why = None if args.no_plot else write_plot(paths["png"], records, meta, analysis)
    written = [paths["json"], paths["csv"]] + ([paths["png"]] if not args.no_plot and why is None else [])
    print(f"wrote {', '.join(written)}", file=out)
    if why:
        print(f"plot: {why}", file=out)
    return analysis


def output_paths(args):
    if args.json:
        stem = args.json[:-5] if args.json.endswith(".json") else args.json
        return {"json": args.json, "csv": stem + ".csv", "png": stem + ".png"}
    return {k: os.path.join(args.out, f"alltoall.{k}") for k in ("json", "csv", "png")}
