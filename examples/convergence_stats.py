"""The statistics and report of `examples/convergence_megatron.py --merge`: per-seed output directories
(summary.json and convergence.csv of each) -> per arm, the gaps of the final validation loss against
arm A of the same seed, their mean and 95% t-interval over seeds, the noise floor (bf16_order2 against
bf16), the targets of issue 20 evaluated (never assumed) and the setup as measured; writes
convergence.csv, convergence_summary.json, convergence_summary.txt and convergence.png.

A module of its own because merging needs no GPU, Megatron or Transformer Engine: it reads only the
per-seed directories. ARMS, the table of arms, lives here so that the training script and the report
share one list of arm names (convergence_megatron.py imports it from here).
"""
import json
import math
import os
import statistics

from fp8a2a.megatron import FP8_ALLTOALL  # a name only: importing it imports no Megatron
from train_convergence import read_csv, write_csv  # a sibling example (this script's directory is on sys.path)

# letter: (run name, dispatcher, fp8a2a options, fp8_experts_spec, data order)
ARMS = {
    "A": ("bf16", "alltoall", {}, False, 1),
    "B": ("fp8_row", FP8_ALLTOALL, {"granularity": "row"}, False, 1),
    "C": ("fp8_block128", FP8_ALLTOALL, {"granularity": "block128"}, False, 1),
    "D": ("fp8_experts", FP8_ALLTOALL, {"granularity": "row", "fp8_dgrad": False}, True, 1),  # BF16 dgrad, recipe or not
    "E": ("fp8_experts_dgrad", FP8_ALLTOALL, {"granularity": "row", "fp8_dgrad": True}, True, 1),
    "F": ("fp8_experts_dgrad_wgrad", FP8_ALLTOALL, {"granularity": "row", "fp8_dgrad": True, "fp8_wgrad": True}, True, 1),
    "G": ("fp8_row_combine", FP8_ALLTOALL, {"granularity": "row", "fp8_combine": True}, False, 1),
    "H": ("fp8_row_dispatch_bwd", FP8_ALLTOALL, {"granularity": "row", "fp8_dispatch_backward": True}, False, 1),
    "noise": ("bf16_order2", "alltoall", {}, False, 2),
    "rerun": ("bf16_rerun", "alltoall", {}, False, 1),  # A again: differs only where the kernels are nondeterministic
}
NOISE_ARMS = ("noise", "rerun")  # noise floors, not arms under test
TARGET_MEAN = 0.0025  # |mean paired gap| <= 0.25%
TARGET_CI = 0.005  # the 95% t-interval inside +-0.5%
NOISE_FACTOR = 2.0  # no seed's |gap| above twice the noise floor's largest |gap|
TARGET_ARMS = ("B", "C")  # held to the targets; D and E reported against the same bounds
MIN_SEEDS, MIN_STEPS = 5, 3000
TAIL_FRAC = 0.1  # how flat a curve ends: its fall over this last part of the run
FINAL = "final validation loss (whole held-out split)"

# two-sided 95% quantiles of Student's t, t(0.975, df), df = 1..30
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
        2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
        2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df):
    """t(0.975, df): the table up to 30, then the Cornish-Fisher expansion around z = 1.95996."""
    if df < 1:
        raise ValueError("df >= 1")
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def t_interval(xs):
    """(mean, sample sd, t, half width, (lo, hi)) of xs; sd/t/interval None for a single value."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None, None, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = t975(n - 1)
    h = t * sd / math.sqrt(n)
    return m, sd, t, h, (m - h, m + h)



def run_name(arm, seed):
    return f"{ARMS[arm][0]}_seed{seed}"


def gap(run, ref):
    """Relative gap of the final validation loss (whole held-out split): run / ref - 1."""
    if run is None or ref is None or run.get("truncated") or ref.get("truncated") or run["steps"] != ref["steps"]:
        return None
    return run["final_val_loss"] / ref["final_val_loss"] - 1.0


def load_dirs(dirs):
    """Rows and {seed: {arm: run stats}} of per-seed output dirs (several dirs may share a seed, each
    with other arms). A run the deadline cut gives way to a complete run of its arm in another dir
    (which lists it in `replaces`), and its rows go with it; of several cut runs of one arm, the
    longest stays. Checks one step count per seed and one initialization per seed."""
    rows, seeds, meta, found = [], {}, {}, {}
    for d in dirs:
        with open(os.path.join(d, "summary.json")) as f:
            m = json.load(f)
        seed = int(m["seed"])
        seeds.setdefault(seed, {})
        for run, s in m["runs"].items():
            found.setdefault((seed, s["arm"]), []).append(dict(s, run=run, dir=d))
        meta.setdefault(seed, []).append(dict(dir=d, steps=m.get("steps"), device=m.get("device"),
                                              versions=m.get("versions"), config=m.get("config"),
                                              corpus=m.get("corpus"), skipped=m.get("skipped")))
    for (seed, arm), runs in found.items():
        done = [r for r in runs if not r.get("truncated")]
        if len(done) > 1:
            raise ValueError(f"arm {arm} of seed {seed} appears twice: {[r['dir'] for r in done]}")
        keep = done[0] if done else max(runs, key=lambda r: r["steps"])
        keep["replaces"] = [r["dir"] for r in runs if r is not keep]
        seeds[seed][arm] = keep
    kept = {(r["dir"], r["run"]) for arms in seeds.values() for r in arms.values()}
    for d in dirs:
        rows += [r for r in read_csv(os.path.join(d, "convergence.csv")) if (d, r["run"]) in kept]
    for seed, arms in seeds.items():
        if len({round(s["init_checksum"], 3) for s in arms.values()}) > 1:
            raise ValueError(f"seed {seed}: the arms start from different weights "
                             f"({ {a: s['init_checksum'] for a, s in arms.items()} })")
        if len({s["steps"] for s in arms.values() if not s.get("truncated")}) > 1:
            raise ValueError(f"seed {seed}: runs of different step counts {[s['steps'] for s in arms.values()]}")
    return rows, seeds, meta


def evaluate(seeds):
    """Per arm: gaps against A of the same seed, their t-interval and the target checks."""
    noise = {s: gap(a.get("noise"), a.get("A")) for s, a in seeds.items()}
    noise = {s: g for s, g in noise.items() if g is not None}
    nf = None
    if noise:
        m, sd, t, h, ci = t_interval(list(noise.values()))
        nf = dict(gaps={str(s): g for s, g in noise.items()}, n=len(noise), mean=m, sd=sd, t=t, half_width=h,
                  ci95=ci, max_abs=max(abs(g) for g in noise.values()))
    out = {}
    for arm in [a for a in ARMS if a != "A" and a not in NOISE_ARMS]:
        gaps = {s: gap(a.get(arm), a.get("A")) for s, a in seeds.items()}
        gaps = {s: g for s, g in gaps.items() if g is not None}
        if not gaps:
            continue
        m, sd, t, h, ci = t_interval(list(gaps.values()))
        worst = max(abs(g) for g in gaps.values())
        limit = NOISE_FACTOR * nf["max_abs"] if nf else None
        checks = dict(mean_within=abs(m) <= TARGET_MEAN,
                      ci_within=None if ci is None else (-TARGET_CI <= ci[0] and ci[1] <= TARGET_CI),
                      seeds_within_noise=None if limit is None else worst <= limit)
        runs = [seeds[s][arm] for s in gaps]
        out[arm] = dict(name=ARMS[arm][0], role="target" if arm in TARGET_ARMS else "reported",
                        gaps={str(s): g for s, g in gaps.items()}, n=len(gaps), mean=m, sd=sd, t=t, half_width=h,
                        ci95=ci, max_abs=worst, noise_limit=limit, checks=checks,
                        meets_targets=None if None in checks.values() else all(checks.values()),
                        fp8_wire=all(r.get("fp8_wire") for r in runs),
                        ms_per_step=sum(r["ms_per_step"] for r in runs) / len(runs))
    return out, nf


def complete(seeds):
    """{seed: {arm: run}} without the runs the deadline cut, and without the seeds left empty."""
    done = {s: {x: r for x, r in a.items() if not r.get("truncated")} for s, a in seeds.items()}
    return {s: a for s, a in done.items() if a}


def at_step(rows, seeds, step):
    """{seed: {arm: run}} as of `step`: each run load_dirs kept (a cut run only where no complete or
    longer run of its arm replaced it) that logged `step`, with its logged validation loss there (the
    fixed held-out subset) as its final one. A resumed run's repeated log keeps its later row."""
    val = {(r["run"], r["step"]): r["val_loss"] for r in rows}
    out = {}
    for seed, arms in seeds.items():
        for arm, r in arms.items():
            if (r["run"], step) in val:
                out.setdefault(seed, {})[arm] = dict(r, final_val_loss=val[r["run"], step], steps=step, truncated=False)
    return out


def requirements(seeds, meta):
    """The issue's setup, as measured (not assumed), from the complete runs: the runs the deadline
    cut count only in truncated_runs (left out) and replaced_runs (a complete run of the arm took
    their place)."""
    runs = [r for a in seeds.values() for r in a.values()]
    cut = sum(1 + len(r["replaces"]) for r in runs if r.get("truncated"))  # a cut run and those it outlasted
    replaced = sum(len(r["replaces"]) for r in runs if not r.get("truncated"))
    seeds = complete(seeds)
    runs = [r for a in seeds.values() for r in a.values()]
    cfgs = [m["config"] for ms in meta.values() for m in ms if m.get("config")]
    te = [r.get("te_fp8") or {} for r in runs]
    fine = all(c["experts"] >= 16 and c["topk"] >= 4 and c["hidden"] >= 512 and c["layers"] >= 4 for c in cfgs)
    paired = [s for s, a in seeds.items() if "A" in a and "noise" in a]
    per_arm = {x: sum(1 for a in seeds.values() if x in a and "A" in a) for x in ARMS if x != "A"}
    one = lambda key: len({json.dumps(m.get(key), sort_keys=True) for ms in meta.values() for m in ms}) <= 1  # noqa: E731
    return dict(seeds=sorted(seeds), truncated_runs=cut, replaced_runs=replaced, seeds_with_a_and_noise=len(paired), seeds_per_arm=per_arm,
                enough_seeds=min(per_arm[x] for x in ("noise", *TARGET_ARMS)) >= MIN_SEEDS,
                min_steps=min((r["steps"] for r in runs), default=0),
                enough_steps=min((r["steps"] for r in runs), default=0) >= MIN_STEPS,
                fine_grained_model=bool(cfgs) and fine, one_config=one("config"), one_corpus=one("corpus"),
                te_fp8_blockwise_every_run=all(t.get("enabled") and t.get("recipe") == "Float8BlockScaling"
                                               for t in te),
                fp8_wire_in_fp8_arms=all(r.get("fp8_wire") and r.get("wire_granularity") == [r["options"]["granularity"]]
                                         for r in runs if r["dispatcher"] == FP8_ALLTOALL))


def tail_fall(rows, frac=TAIL_FRAC):
    """How flat each run's curve ends: {run: v0 / v1 - 1}, v1 its last logged validation loss (the
    logged subset) and v0 the last one logged at or before (1 - frac) of its steps; negative: it
    rose. A step logged twice (a resumed run) keeps its later row; a run whose last log is not
    finite, or with no log before the cut, is left out (the summary counts the runs it covers)."""
    logs = {}
    for r in rows:
        logs.setdefault(r["run"], {})[r["step"]] = r["val_loss"]
    out = {}
    for run, by_step in logs.items():
        pts = sorted(by_step.items())
        before = [v for s, v in pts if s <= (1 - frac) * pts[-1][0] and s < pts[-1][0]]
        if before and math.isfinite(pts[-1][1]):
            out[run] = before[-1] / pts[-1][1] - 1.0
    return out


def pct(v, signed=True):
    return "n/a" if v is None else (f"{100 * v:+.3f}%" if signed else f"{100 * v:.3f}%")


def summary_text(table, nf, req, seeds, curves=None, title=FINAL):
    sl = sorted(seeds)
    lines = [title + " against arm A (bf16 alltoall) of the same seed",
             "| arm | run | " + " | ".join(f"seed {s}" for s in sl) + " | mean | 95% t-interval | max abs | "
             "|mean| <= 0.25% | CI inside +-0.5% | seeds <= 2x noise max | ms/step |",
             "| --- |" + " --- |" * (len(sl) + 8)]
    yn = lambda v: "n/a" if v is None else ("yes" if v else "NO")  # noqa: E731
    if nf:
        ci = "n/a" if nf["ci95"] is None else f"[{pct(nf['ci95'][0])}, {pct(nf['ci95'][1])}]"
        lines.append("| noise | bf16_order2 | " + " | ".join(pct(nf["gaps"].get(str(s))) for s in sl)
                     + f" | {pct(nf['mean'])} | {ci} | {pct(nf['max_abs'], False)} | | | | |")
    for arm, t in table.items():
        ci = "n/a" if t["ci95"] is None else f"[{pct(t['ci95'][0])}, {pct(t['ci95'][1])}]"
        c = t["checks"]
        lines.append(f"| {arm} ({t['role']}) | {t['name']} | " + " | ".join(pct(t["gaps"].get(str(s))) for s in sl)
                     + f" | {pct(t['mean'])} | {ci} | {pct(t['max_abs'], False)} | {yn(c['mean_within'])} | "
                       f"{yn(c['ci_within'])} | {yn(c['seeds_within_noise'])} | {t['ms_per_step']:.1f} |")
    if curves and curves["fall"]:
        f = sorted(curves["fall"].values())
        lines.append(f"curves: over each run's last {curves['frac']:.0%} of steps its validation loss (logged subset) "
                     f"fell by {pct(statistics.median(f))} [{pct(f[0])}, {pct(f[-1])}] (median [min, max] over "
                     f"{len(f)} of {curves['runs']} runs; negative: it rose)")
    if req:
        lines.append("setup as measured: " + ", ".join(f"{k}={v}" for k, v in req.items()))
    return "\n".join(lines)


def plot(rows, seeds, path):
    """Validation loss per arm (mean over seeds, band min-max) and the per-step gap against arm A of
    the same seed (mean, band min-max), with the noise floor's band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = {}
    for r in rows:
        by.setdefault(r["run"], {})[r["step"]] = r["val_loss"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    for k, arm in enumerate(ARMS):
        curves = [by.get(run_name(arm, s), {}) for s in seeds if arm in seeds[s]]
        paired = [s for s in seeds if arm in seeds[s] and "A" in seeds[s]]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        kw = dict(color=f"C{k}", label=f"{arm}: {ARMS[arm][0]} ({len(curves)} seeds)")
        gap_kw = dict(kw, label=f"{arm}: {ARMS[arm][0]} ({len(paired)} seeds)")
        vals = [[c[s] for c in curves] for s in steps]
        a.plot(steps, [sum(v) / len(v) for v in vals], **kw)
        a.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=f"C{k}", alpha=0.2)
        if arm == "A":
            continue
        pairs = [(by.get(run_name(arm, s), {}), by.get(run_name("A", s), {})) for s in paired]
        gs = [s for s in steps if all(s in r for _, r in pairs)]
        if not pairs or not gs:
            continue
        g = [[100 * (c[s] / r[s] - 1) for c, r in pairs] for s in gs]
        b.plot(gs, [sum(v) / len(v) for v in g], **gap_kw)
        b.fill_between(gs, [min(v) for v in g], [max(v) for v in g], color=f"C{k}", alpha=0.15)
    a.set_xlabel("step"), a.set_ylabel("val loss (nats/byte)"), a.set_title("validation loss, mean over seeds (band: min-max)")
    lo = min((r["val_loss"] for r in rows), default=0)
    a.set_ylim(lo - 0.05, lo + 1.0)
    b.axhspan(-100 * TARGET_CI, 100 * TARGET_CI, color="green", alpha=0.08, label="+-0.5%")
    b.axhline(0, color="k", lw=0.8)
    b.set_ylim(-3, 3)
    b.set_xlabel("step"), b.set_ylabel("val loss vs arm A of the same seed (%)")
    b.set_title("gap to bf16 alltoall (band: min-max over seeds)")
    for ax in (a, b):
        ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(dirs, out, no_plot=False, log=print, step=None):
    """`step`: the same table also as of that step, from the logged validation losses, so that runs
    the deadline cut at or after it count (beside the final table, which has only the complete runs)."""
    rows, seeds, meta = load_dirs(dirs)
    table, nf = evaluate(seeds)
    early = None
    if step:
        early_seeds = at_step(rows, seeds, step)
        early_table, early_nf = evaluate(early_seeds)
        early = dict(step=step, seeds=sorted(early_seeds), noise_floor=early_nf, arms=early_table,
                     gap=f"validation loss (logged subset) at step {step} / that of arm A of the same seed - 1",
                     text=summary_text(early_table, early_nf, None, early_seeds,
                                       title=f"validation loss at step {step} (the logged subset)"))
    req = requirements(seeds, meta)
    kept = complete(seeds)
    done = {r["run"] for a in kept.values() for r in a.values()}
    rows = [r for r in rows if r["run"] in done]  # a cut run's curve ends early: the seed's dir keeps it
    curves = dict(frac=TAIL_FRAC, fall=tail_fall(rows), runs=len(done))
    targets = [t["meets_targets"] for a, t in table.items() if a in TARGET_ARMS]
    verdict = ("n/a: arms B and C missing" if not targets else
               "n/a: too few seeds for an interval, or no noise floor" if None in targets else
               ("targets met" if all(targets) else "targets NOT met")
               + ("" if all(v for k, v in req.items() if isinstance(v, bool)) else
                  " (but the setup falls short of issue 20's: see requirements)"))
    merged = dict(merged_from=list(dirs), seeds=sorted(kept), verdict=verdict,
                  gap="final val loss (whole held-out split) / that of arm A of the same seed - 1",
                  targets=dict(target_arms=list(TARGET_ARMS), abs_mean_max=TARGET_MEAN, ci95_within=TARGET_CI,
                               seed_gap_max_over_noise_max=NOISE_FACTOR),
                  noise_floor=nf, arms=table, requirements=req, curves=curves, at_step=early,
                  per_seed={str(s): dict(runs=a, dirs=meta[s]) for s, a in sorted(seeds.items())})
    os.makedirs(out, exist_ok=True)
    write_csv(rows, os.path.join(out, "convergence.csv"))
    with open(os.path.join(out, "convergence_summary.json"), "w") as f:
        json.dump(merged, f, indent=2)
    text = summary_text(table, nf, req, kept, curves) + f"\nverdict: {verdict}\n"
    if early:
        text += "\n" + early["text"] + "\n"
    with open(os.path.join(out, "convergence_summary.txt"), "w") as f:
        f.write(text)
    log(text)
    if not no_plot:
        try:
            plot(rows, kept, os.path.join(out, "convergence.png"))
        except ImportError:
            log("matplotlib missing: no plot")
    return merged
