#!/usr/bin/env python
"""Gradient error against minibatch noise (issue 35, measurement 2), on the GPT-MoE of
examples/convergence_megatron.py: its model, its arms and the way it builds them are imported from
there, so an arm here is exactly the arm that script trains.

For one set of weights (a checkpoint of convergence_megatron.py, or the initialization of --seed
when no checkpoint is given) and N batches of --batch sequences, with every model holding the same
weights:

  g_ref(b)   the gradient of arm A (Megatron's BF16 wire) on batch b
  g_ref(b')  the same on an independent batch b' (another uniform draw of windows, same size)
  g_X(b)     each requested arm X's gradient on batch b

and per parameter, and per group (expert: the MoE experts' weights; router: the routers' weights;
rest: everything else; all: every parameter), norms taken over the group's concatenated gradients:

  error  = ||g_X(b) - g_ref(b)|| / ||g_ref(b)||       (the arm's gradient error)
  noise  = ||g_ref(b) - g_ref(b')|| / ||g_ref(b)||    (minibatch noise at this batch size)
  ratio  = error / noise

What this is and is not:
- The gradient is the training loss's (mean token cross entropy plus the routers' aux loss, whose
  gradient Megatron's routers add in backward), at fixed weights, one backward: the error of one
  step's gradient, not the drift of a run (measurement 1 of the issue covers that).
- The reference is arm A as convergence_megatron.py builds it: on the GPU with the TE spec it runs
  under the same TE FP8 recipe as every arm (--fp8-recipe none for a BF16 reference), so the ratio
  isolates what the arm changes (the wire, the experts' GEMMs), not FP8 against full precision. On
  the CPU (--tiny, the local spec) weights are FP32 unless --bf16.
- Each arm is its own model. Under the default blockwise recipe (scales from the current tensor)
  that is all; under a delayed-scaling recipe each model's amax history would differ (the reference
  runs two batches per measurement): measure checkpoints trained with blockwise (the default) or none.
- Arm A measured against the reference is a second, separate model with the same weights: its
  error is the run-to-run nondeterminism (0 where the kernels are deterministic, as on the CPU).
- The noise is one pair of batches per measurement: ||g(b) - g(b')|| is about sqrt(2) times one
  batch's deviation from the full-data gradient, and it is a noisy estimate itself; the median over
  parameters, batches and checkpoints is what the target reads. Its size depends on --batch (the
  noise falls as 1/sqrt(batch)): use the training batch (the default: the checkpoint's).
- A parameter whose reference gradient is zero on batch b (an expert no token reached) has no
  ratio for that batch (null); it is counted in the summary as skipped.

Target (issue 35): median ratio over parameters <= 0.1 at every checkpoint, for every arm; the
summary names the worst group (by the median of its parameters' ratios) with its ratio.

On a GPU, over the checkpoints convergence_megatron.py saves (--checkpoint-dir keeps a run's state,
weights included, when the deadline cuts it: DIR/<run>.pt; a finished run's file holds only its
result and is refused here):

  python examples/convergence_megatron.py --seed 1 --arms A --steps 6000 --time-budget 540 \\
      --checkpoint-dir ckpt/s1                        # cut runs save ckpt/s1/bf16_seed1.pt
  cp ckpt/s1/bf16_seed1.pt ckpt/trunk_2000.pt         # keep a copy per point of the trunk
  python examples/grad_noise.py --checkpoint ckpt/trunk_2000.pt --arms A,B,C,D,E --batches 8 \\
      --out out/grad_noise_2000.json
  python examples/grad_noise.py --merge out/grad_noise_*.json --out out/grad_noise.json

The model's configuration (sizes, spec, FP8 recipe, BF16) is the checkpoint's; --batch overrides
its batch size. Without a checkpoint the sizes come from the same options as convergence_megatron.py
(--tiny, --device cpu for the CPU smoke):

  python examples/grad_noise.py --device cpu --tiny --arms A,B --batches 2 --out /tmp/gn.json

Output JSON: config, batch, arms; params (name: group, numel); noise (per parameter and group: one
value per batch); arms.<X>.error and .ratio (the same layout); summary per arm (median ratio over
parameters and batches, per checkpoint and overall, the worst group with its ratio, meets_target).
--merge combines several such files (checkpoints of one configuration and batch size) into one
summary, keeping each file's per-parameter ratios under its checkpoint's label; an arm not measured
at every checkpoint does not meet the target.
"""
import argparse
import json
import math
import os
import statistics
import time
import types
import warnings

import torch

import convergence_megatron as cm  # the sibling example: model, arms, data (this script's directory is on sys.path)
from convergence_stats import NOISE_ARMS

TARGET = 0.1  # median gradient error / minibatch noise over parameters, at every checkpoint
GROUPS = ("expert", "router", "rest")
GRAD_ARMS = [x for x in cm.ARMS if x not in NOISE_ARMS]  # the noise arms differ in data or nondeterminism only


def group_of(name):
    if ".experts." in name:
        return "expert"
    if ".router." in name:
        return "router"
    return "rest"


def load_checkpoint(path):
    """(config namespace, state dict, steps done) of a convergence_megatron.py checkpoint."""
    st = torch.load(path, map_location="cpu", weights_only=False)  # written by convergence_megatron._checkpoint
    if "arm" not in st:
        raise SystemExit(f"{path} holds a finished run's result, not its weights (convergence_megatron.py "
                         "keeps the state of runs the deadline cut); use a checkpoint of a cut run")
    return types.SimpleNamespace(**st["config"]), st["arm"]["model"], st["done"]


def gradients(arm, x, y):
    """Every parameter's gradient (FP32, zeros where none) of the arm's training loss on (x, y)."""
    arm.model.train()
    arm.new_weights()
    for p in arm.params:
        p.grad = None
    arm.loss(x, y).backward()
    out = {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
           for n, p in arm.model.named_parameters()}
    for p in arm.params:
        p.grad = None
    return out


def rel_diffs(a, b, names_by_group):
    """||a - b|| / ||b|| per parameter and per group (None where ||b|| == 0)."""
    num = {n: float((a[n] - b[n]).double().norm()) ** 2 for n in b}
    den = {n: float(b[n].double().norm()) ** 2 for n in b}
    out = {n: (math.sqrt(num[n] / den[n]) if den[n] > 0 else None) for n in b}
    for g, names in names_by_group.items():
        d = sum(den[n] for n in names)
        out[g] = math.sqrt(sum(num[n] for n in names) / d) if d > 0 else None
    return out


def ratio(err, noise):
    if err is None or noise is None or noise == 0:
        return None
    return err / noise


def median(v):
    return statistics.median(v) if v else None


def summarize(docs):
    """Per arm, from one or more measurement docs (checkpoints): the median ratio over parameters and
    batches per checkpoint and overall, per group the median of its parameters' ratios and of the
    group-norm ratio, the worst group, and whether the target holds at every checkpoint."""
    out = {}
    arms = list(dict.fromkeys(x for d in docs for x in d["arms"]))
    for x in arms:
        per_ckpt, all_r, by_group, group_norm, skipped, n = {}, [], {g: [] for g in GROUPS}, {g: [] for g in GROUPS}, 0, 0
        for d in docs:
            if x not in d["arms"]:
                continue
            rat = d["arms"][x]["ratio"]
            mine = []
            for p, meta in d["params"].items():
                for r in rat[p]:
                    n += 1
                    if r is None:
                        skipped += 1
                        continue
                    mine.append(r)
                    by_group[meta["group"]].append(r)
            for g in GROUPS:
                group_norm[g] += [r for r in rat.get(g, []) if r is not None]
            per_ckpt[d["label"]] = median(mine)
            all_r += mine
        groups = {g: dict(median_param_ratio=median(by_group[g]), median_group_norm_ratio=median(group_norm[g]),
                          n=len(by_group[g])) for g in GROUPS if by_group[g]}
        worst = max(groups, key=lambda g: groups[g]["median_param_ratio"]) if groups else None
        missing = [d["label"] for d in docs if x not in d["arms"]]
        finite = [v for v in per_ckpt.values() if v is not None]
        out[x] = dict(median_ratio=median(all_r), p90_ratio=_quantile(all_r, 0.9), max_ratio=max(all_r) if all_r else None,
                      median_ratio_per_checkpoint=per_ckpt, groups=groups,
                      worst_group=dict(group=worst, ratio=groups[worst]["median_param_ratio"]) if worst else None,
                      ratios=len(all_r), skipped=skipped, values=n, checkpoints_missing=missing,
                      meets_target=bool(finite) and len(finite) == len(per_ckpt) and not missing
                      and max(finite) <= TARGET)
    return dict(target=f"median ratio over parameters <= {TARGET} at every checkpoint", arms=out)


def _quantile(v, q):
    if not v:
        return None
    s = sorted(v)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def report(summary, log):
    log(f"gradient error / minibatch noise ({summary['target']}):")
    log("| arm | median | p90 | max | worst group | checkpoints <= target |")
    log("| --- | --- | --- | --- | --- | --- |")
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for x, s in summary["arms"].items():
        w = s["worst_group"] or {}
        ok = sum(v is not None and v <= TARGET for v in s["median_ratio_per_checkpoint"].values())
        log(f"| {x} | {f(s['median_ratio'])} | {f(s['p90_ratio'])} | {f(s['max_ratio'])} | "
            f"{w.get('group')} {f(w.get('ratio'))} | {ok}/{len(s['median_ratio_per_checkpoint'])} "
            f"{'meets' if s['meets_target'] else 'NOT met'}"
            + (f" (not measured at {', '.join(s['checkpoints_missing'])})" if s["checkpoints_missing"] else "") + " |")


def noise_batches(train_t, val_t, cfg, seed, n, device):
    """2n batches of uniform random windows from a seed no training order uses: b = 2k, b' = 2k + 1."""
    from train_convergence import Batches
    ns = types.SimpleNamespace(data_seed=7919 * (seed + 1) + 17, seq=cfg.seq, batch=cfg.batch, val_seqs=1,
                               val_full_max=1)
    return Batches(train_t, val_t, ns, 2 * n, device)


def measure_models(models, arms, data, n, log):
    """The measurement on models that hold the same weights: models["ref"] (arm A) and models[x] per
    arm x; data from noise_batches. Returns (per-arm error and ratio, noise, names by group)."""
    names = [n for n, _ in models["ref"].model.named_parameters()]
    by_group = {g: [n for n in names if group_of(n) == g] for g in GROUPS}
    by_group = {g: v for g, v in by_group.items() if v}
    by_group["all"] = names
    noise = {k: [] for k in names + list(by_group)}
    res = {x: dict(name=cm.ARMS[x][0], error={k: [] for k in noise}, ratio={k: [] for k in noise}) for x in arms}
    t0 = time.perf_counter()
    for k in range(n):
        xb, yb = data.get(2 * k)
        g_ref = gradients(models["ref"], xb, yb)
        nz = rel_diffs(gradients(models["ref"], *data.get(2 * k + 1)), g_ref, by_group)
        for key in noise:
            noise[key].append(nz[key])
        for x in arms:
            err = rel_diffs(gradients(models[x], xb, yb), g_ref, by_group)
            for key in noise:
                res[x]["error"][key].append(err[key])
                res[x]["ratio"][key].append(ratio(err[key], nz[key]))
        log(f"batch {k + 1}/{n}: noise (all) {nz['all']:.4f}; "
            + ", ".join(f"{x} error {res[x]['error']['all'][-1]:.3g}" for x in arms)
            + f"  ({time.perf_counter() - t0:.1f} s)")
    return res, noise, by_group


def document(models, arms, res, noise, by_group, cfg, n, seed, label, checkpoint=None, step=None):
    """One measurement's output (what --merge reads)."""
    probes = {x: models[x].probe.report() for x in arms}
    doc = dict(tool="grad_noise", label=label, checkpoint=os.path.abspath(checkpoint) if checkpoint else None,
               checkpoint_step=step, seed=seed, batch=cfg.batch, batches=n, config=vars(cfg), arms=res,
               params={k: dict(group=group_of(k), numel=p.numel()) for k, p in models["ref"].model.named_parameters()},
               groups={g: len(v) for g, v in by_group.items()}, noise=noise,
               fp8_wire={x: probes[x]["fp8_wire"] for x in arms},
               wire_granularity={x: probes[x]["wire_granularity"] for x in arms})
    doc["summary"] = summarize([doc])
    return doc


def measure(a, log):
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|moe_ffn_hidden_size).*")
    from fp8a2a.megatron.standalone import world_of_one
    import fp8a2a.megatron as fm
    from train_convergence import load_corpus

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if a.checkpoint:
        cfg, state, done = load_checkpoint(a.checkpoint)
    else:
        cfg, state, done = cm.model_config(a), None, None
    if a.batch:
        cfg.batch = a.batch
    fm.register()
    teardown = world_of_one(a.seed)
    if state is None:
        init = cm.reference_weights(cfg, a.seed, device)
    else:  # the parameters (the state dict also holds buffers and TE's extra state)
        cm.seed_everything(0, device)
        names = [n for n, _ in cm.build_model(cfg, "A", device)[0].named_parameters()]
        missing = [n for n in names if n not in state]
        if missing:
            raise SystemExit(f"{a.checkpoint}: no weights for {missing[:5]}")
        init = {n: state[n].to(device) for n in names}
    train_t, val_t, _ = load_corpus(a.corpus_bytes or None)
    data = noise_batches(train_t, val_t, cfg, a.seed, a.batches, device)
    models = {}
    for x in ["A"] + a.arms:  # the reference, then each arm (arm A again: a second model, the same weights)
        models["ref" if not models else x] = cm.Arm(x, cfg, init, data, device, 1)
    res, noise, by_group = measure_models(models, a.arms, data, a.batches, log)
    label = a.label or (os.path.basename(a.checkpoint) if a.checkpoint else f"init_seed{a.seed}")
    doc = document(models, a.arms, res, noise, by_group, cfg, a.batches, a.seed, label, a.checkpoint, done)
    teardown()
    return doc


def merge(paths, log):
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    first = docs[0]
    for p, d in zip(paths, docs):
        if d.get("tool") != "grad_noise":
            raise SystemExit(f"{p}: not a grad_noise.py output")
        if d["config"] != first["config"] or d["batch"] != first["batch"]:
            raise SystemExit(f"{p}: another model configuration or batch size than {paths[0]}")
    labels = [d["label"] for d in docs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"checkpoint labels repeat: {labels} (give each run its own --label)")
    return dict(tool="grad_noise_merge", files=[os.path.abspath(p) for p in paths], batch=first["batch"],
                config=first["config"], checkpoints=labels,
                per_checkpoint={d["label"]: dict(checkpoint=d["checkpoint"], step=d.get("checkpoint_step"),
                                                 batches=d["batches"], ratio={x: v["ratio"] for x, v in d["arms"].items()})
                                for d in docs},
                summary=summarize(docs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a convergence_megatron.py checkpoint (a cut run's DIR/<run>.pt); "
                   "none: the initialization of --seed")
    p.add_argument("--arms", default="A,B,C,D,E", help="comma-separated, of " + ", ".join(GRAD_ARMS))
    p.add_argument("--batches", type=int, default=8, help="N: measurements, each on batches b and b'")
    p.add_argument("--seed", type=int, default=1, help="the initialization without a checkpoint; the batches")
    p.add_argument("--label", help="this checkpoint's name in --merge (default: the checkpoint's file name)")
    p.add_argument("--out", default="out/grad_noise.json")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="measure nothing: combine these outputs into --out")
    cm.add_model_args(p)  # without a checkpoint; --batch (sequences per batch) overrides a checkpoint's too
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    log = (lambda *s: None) if a.quiet else (lambda *s: print(*s, flush=True))
    if a.merge:
        doc = merge(a.merge, log)
    else:
        a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
        bad = [x for x in a.arms if x not in GRAD_ARMS]
        if bad:
            p.error(f"unknown arms {bad} (the noise arm is a data order; the noise is measured here)")
        if a.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny)")
        doc = measure(a, log)
    report(doc["summary"], log)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f)
    log(f"wrote {a.out}")
    return doc


if __name__ == "__main__":
    main()
