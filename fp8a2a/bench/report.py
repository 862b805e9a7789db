"""The all-to-all benchmark's statistics and outputs: percentiles, nccl-tests bandwidths, the
FP8/BF16 crossover and the bf16_below_bytes it recommends; the table, JSON, CSV and PNG writers.
Pure functions of the records the sweep produces (no process group, no device)."""
import csv
import json
import math
import os
import sys
from typing import Dict, Optional, Sequence

from ..dispatcher import DEFAULT_BF16_BELOW_BYTES

VARIANTS = ("megatron_bf16", "fp8a2a_bf16", "fp8a2a_fp8")

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
        notes.append(f"FP8 did not win for good at any measured size in: {', '.join(never)}")
    if crossing:
        worst = max(crossing, key=lambda k: crossing[k]["crossover_bytes"])
        value = _pow2_ceil(crossing[worst]["crossover_bytes"])
        text = (f"recommended bf16_below_bytes = {value} ({fmt_bytes(value)}): the largest crossover "
                f"({worst}, {fmt_bytes(crossing[worst]['crossover_bytes'])}) rounded up to a power of two")
    elif always:
        smallest = min(c["crossover_bytes"] for c in always.values())
        value = min(default, int(smallest))
        text = (f"FP8 won at every size measured (down to {fmt_bytes(smallest)}): keep bf16_below_bytes "
                f"<= {fmt_bytes(smallest)}; recommended {value} ({fmt_bytes(value)})")
    else:
        value = None
        text = (f"no crossover found: FP8 never won for good in this sweep; no bf16_below_bytes to recommend "
                f"(keep the default {fmt_bytes(default)} or measure larger sizes)")
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
    bf16_below_bytes falls back to, and FP8 vs the Megatron baseline) and the threshold."""
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    vs_wire, vs_mega = {}, {}
    for name, rs in by.items():
        sizes = [r["msg_bytes"] for r in rs]
        vs_wire[name] = find_crossover(sizes, [r.get("speedup_fp8_vs_bf16_wire_dispatch") for r in rs])
        vs_mega[name] = find_crossover(sizes, [r.get("speedup_total") for r in rs])
    return {"crossover_vs_bf16_wire": vs_wire, "crossover_vs_megatron": vs_mega,
            "recommendation": recommend_threshold(vs_wire, default)}


CSV_COLUMNS = ["series", "hidden", "experts", "topk", "granularity", "tokens", "world", "msg_bytes"] + [
    f"{v}_{k}" for v in VARIANTS for k in (
        "dispatch_ms", "dispatch_ms_p10", "dispatch_ms_p90", "combine_ms", "combine_ms_p10", "combine_ms_p90",
        "total_ms", "wire_bytes", "combine_wire_bytes", "algbw_GBps", "busbw_GBps", "host_us", "launches",
        "copies", "syncs", "d2h")] + [
    "speedup_dispatch", "speedup_total", "speedup_fp8_vs_bf16_wire_dispatch", "wire_ratio_dispatch"]


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
    """PNG of speedup against message size, one line per series; returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), sharey=True)
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    rec = (analysis or {}).get("recommendation", {}).get("recommended_bytes")
    panels = ((axes[0], "speedup_dispatch", "dispatch: Megatron BF16 / fp8a2a FP8"),
              (axes[1], "speedup_total", "dispatch + combine: Megatron BF16 / fp8a2a FP8"),
              (axes[2], "speedup_fp8_vs_bf16_wire_dispatch", "dispatch: fp8a2a BF16 wire / FP8 wire"))
    for ax, key, title in panels:
        for name, rs in by.items():
            pts = sorted((r["msg_bytes"], r[key]) for r in rs if r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        if rec and key == "speedup_fp8_vs_bf16_wire_dispatch":
            ax.axvline(rec, color="red", linestyle=":", linewidth=1, label=f"bf16_below_bytes {fmt_bytes(rec)}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v).replace(".0 ", " ")))
        ax.set_xlabel("message per rank (tokens x hidden x 2 B)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup (> 1: FP8 faster)")
    axes[2].legend(fontsize=8)
    label = "FUNCTIONAL ONLY (CPU/gloo)" if meta["functional_only"] else meta["device"]
    fig.suptitle(f"fp8a2a all-to-all: {label}, world size {meta['world']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _f(v, spec=".2f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(records) -> str:
    head = (f"{'series':<20}{'T':>6}{'msg':>10} | {'BF16 disp ms [p10,p90]':>24} | {'FP8 disp ms [p10,p90]':>24}"
            f" | {'xdisp':>6}{'xtotal':>7}{'xwire':>6} | {'wire MB bf16/fp8':>17} | {'busbw':>6}"
            f" | {'host us bf16/fp8':>16} | {'launch':>7} | {'sync':>5}")
    lines = [head, "-" * len(head)]
    m, f = "megatron_bf16", "fp8a2a_fp8"
    for r in records:
        def span(v):
            if r.get(f"{v}_dispatch_ms") is None:
                return "-"
            return (f"{r[f'{v}_dispatch_ms']:.3f} [{r[f'{v}_dispatch_ms_p10']:.3f},"
                    f"{r[f'{v}_dispatch_ms_p90']:.3f}]")
        wire = f"{_f(_mb(r.get(f'{m}_wire_bytes')))}/{_f(_mb(r.get(f'{f}_wire_bytes')))}"
        host = f"{_f(r.get(f'{m}_host_us'), '.0f')}/{_f(r.get(f'{f}_host_us'), '.0f')}"
        launch = f"{_f(r.get(f'{m}_launches'), 'd')}/{_f(r.get(f'{f}_launches'), 'd')}"
        syncs = f"{_f(r.get(f'{m}_syncs'), 'd')}/{_f(r.get(f'{f}_syncs'), 'd')}"
        lines.append(f"{r['series']:<20}{r['tokens']:>6}{fmt_bytes(r['msg_bytes']):>10} | {span(m):>24} | "
                     f"{span(f):>24} | {_f(r.get('speedup_dispatch')):>6}{_f(r.get('speedup_total')):>7}"
                     f"{_f(r.get('speedup_fp8_vs_bf16_wire_dispatch')):>6} | {wire:>17} | "
                     f"{_f(r.get(f'{f}_busbw_GBps'), '.1f'):>6} | {host:>16} | {launch:>7} | {syncs:>5}")
    return "\n".join(lines)


def _mb(b):
    return None if b is None else b / 1e6


def format_summary(records, analysis) -> str:
    lines = ["summary (per series): speedup of fp8a2a FP8 over Megatron BF16 (dispatch+combine) at the largest "
             "size, best speedup, FP8 crossovers", f"{'series':<20}{'largest':>9}{'best':>7}"
             f"{'  crossover vs BF16 wire':>26}{'  crossover vs Megatron':>26}"]
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    for name, rs in by.items():
        big = max(rs, key=lambda r: r["msg_bytes"])
        sp = [r["speedup_total"] for r in rs if r.get("speedup_total") is not None]

        def cx(c):
            return {"crosses": fmt_bytes(c["crossover_bytes"]), "fp8_always_wins": f"<= {fmt_bytes(c['crossover_bytes'])}",
                    "bf16_always_wins": f"> {fmt_bytes(c['last_loss_bytes'])}"}.get(c["status"], "-")
        lines.append(f"{name:<20}{_f(big.get('speedup_total')):>9}{_f(max(sp) if sp else None):>7}"
                     f"{cx(analysis['crossover_vs_bf16_wire'][name]):>26}{cx(analysis['crossover_vs_megatron'][name]):>26}")
    lines.append(analysis["recommendation"]["text"])
    return "\n".join(lines)


def report(records, meta, args, out=None):
    out = out or sys.stdout
    analysis = analyse(records)
    errors = sorted({f"{v}: {r[f'{v}_error']}" for r in records for v in VARIANTS if r.get(f"{v}_error")})
    label = ("FUNCTIONAL NUMBERS ONLY: CPU, gloo ranks in one machine; says nothing about a GPU cluster"
             if meta["functional_only"] else f"{meta['device']}, backend {meta['backend']}")
    print(f"\nfp8a2a all-to-all benchmark: world size {meta['world']}; {label}", file=out)
    print("times: per iteration the slowest rank's, median [p10, p90] over "
          f"{meta['iters']} iterations; xdisp/xtotal: Megatron BF16 / fp8a2a FP8; xwire: fp8a2a BF16 wire / FP8 "
          "(dispatch); busbw: nccl-tests alltoall bus bandwidth of the FP8 dispatch, GB/s", file=out)
    print(format_table(records), file=out)
    for e in errors:
        print(f"not measured: {e}", file=out)
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
