#!/usr/bin/env python
"""Branched A/B on the GPT-MoE of examples/convergence_megatron.py (its model, arms, optimizer and data):
one BF16 trunk (arm A, under the TE FP8 recipe every arm uses for the non-MoE layers) and, from each
of its checkpoints, every arm continued for the same steps on the same data with the trunk's
learning-rate schedule, then evaluated on the same held-out windows. A branch's gap: its validation
loss over that of arm A's branch from the same checkpoint, minus 1. Paired per checkpoint, the gaps
drop what separates two runs from the start (initialization, data order, when a run learns): what
is left is what an arm's numerics add over --branch-steps steps.

Noise floors, branched the same way: `noise` (A with the second data order) and `rerun` (A again with
another RNG seed: on the GPU it differs from A only where kernels are nondeterministic, such as
atomics in attention's backward; on the CPU its gap is exactly 0).

At each checkpoint the same job measures examples/grad_noise.py's gradient error against minibatch
noise for every arm (the checkpoint's weights, the same batches for every arm).

  python examples/branched_ab.py --state-dir .branch_ckpt --out out/branch --time-budget 480 --workers 10
  python examples/branched_ab.py --merge .branch_ckpt --out results/branch        # the tables only
  python examples/branched_ab.py --device cpu --tiny --trunk-steps 24 --first-checkpoint 12 --checkpoints 3 \\
      --branch-steps 3 --eval-seqs 8 --eval-batch 4 --state-dir /tmp/b --out /tmp/b/out

Processes: one trains the trunk and saves STATE/trunk/s<step>.pt at each checkpoint (weights, FP32
masters, AdamW, RNG); --workers others take tasks (one arm's branch from one checkpoint, or the
gradient measurement at one) as soon as the checkpoint exists, claiming each first: the earliest
checkpoint's first, and there an arm whose model the worker has already built (a task then only
loads the checkpoint). Under --workers 0 this process trains the trunk, then runs the tasks.

Deadline (--time-budget): the trunk trains until it and saves where it stopped (STATE/trunk/
resume.pt); a worker starts a task only while that worker's last time for such a task fits, and
drops a task the deadline reaches. A finished task writes STATE/branches/s<step>_<arm>.json or
STATE/grad/s<step>.json, so the same command again continues the trunk and runs only the tasks
without a file. STATE/plan.json fixes the model, seed, trunk, checkpoints, branch length and
evaluation; another plan needs another --state-dir. The summary lists the tasks not done and why.

--merge STATE: per arm, the gaps at the checkpoints where it and arm A finished, their mean and 95%
t-interval (target: inside +-0.25%), beside the noise floors' over the same checkpoints; then the
gradient table (grad_noise.py's --merge). Writes branch_summary.md, branch_summary.json, branches.csv
and grad_noise.json to --out; a run ends with the same merge.
"""
import argparse
import csv
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
import warnings

import torch

import convergence_megatron as cm  # sibling examples (this script's directory is on sys.path)
import grad_noise as gn
from convergence_stats import ARMS, NOISE_ARMS, pct, t_interval
from train_convergence import load_corpus, sync

DEFAULT_ARMS = "A,B,C,D,E,F,noise,rerun,G,H"  # the order tasks of one checkpoint are taken in
GAP_BOUND = 0.0025  # the 95% t-interval of an arm's mean gap inside +-0.25%
RERUN_SEED = 977  # the rerun arm's RNG: another draw for anything random (dropout, if on)
MERGE_S = 15  # seconds the run keeps for the merge after its workers


def checkpoint_steps(first, last, k):
    """k trunk steps evenly spaced from first to last."""
    if k < 1 or not 1 <= first <= last:
        raise SystemExit(f"checkpoints: need k >= 1 and 1 <= first <= last (k {k}, first {first}, last {last})")
    steps = sorted({round(first + i * (last - first) / max(1, k - 1)) for i in range(k)})
    if len(steps) < k:
        raise SystemExit(f"{k} checkpoints do not fit between steps {first} and {last}")
    return steps


class State:
    """The files a run keeps (STATE): plan, trunk checkpoints, finished tasks, claims of this call."""

    def __init__(self, root, call=None):
        self.root, self.call = os.path.abspath(root), call
        for d in ("trunk", "branches", "grad", "claims"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)

    def path(self, *p):
        return os.path.join(self.root, *p)

    def ckpt(self, step):
        return self.path("trunk", f"s{step:06d}.pt")

    def result(self, step, task):
        return self.path("grad", f"s{step:06d}.json") if task == "grad" else self.path("branches", f"s{step:06d}_{task}.json")

    def done(self, step, task):
        return os.path.exists(self.result(step, task))

    def claim(self, step, task):
        """True for the one process that claims the task in this call."""
        d = self.path("claims", self.call)
        os.makedirs(d, exist_ok=True)
        try:
            os.close(os.open(os.path.join(d, f"{step}_{task}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def claimed(self, step, task):
        return os.path.exists(self.path("claims", self.call, f"{step}_{task}"))

    def write(self, path, doc):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    def read(self, path, default=None):
        if not os.path.exists(path):
            return default
        with open(path) as f:
            return json.load(f)

    def trunk_status(self):
        return self.read(self.path("trunk", "status.json"), {})

    def latest_trunk(self):
        """The trunk's furthest saved state: (step, path), or None."""
        found = [(int(os.path.basename(p)[1:7]), p) for p in glob.glob(self.path("trunk", "s*.pt"))]
        resume = self.path("trunk", "resume.pt")
        if os.path.exists(resume):
            found.append((torch.load(resume, map_location="cpu", mmap=True, weights_only=False)["done"], resume))
        return max(found) if found else None


def plan_of(a, cfg):
    return dict(seed=a.seed, config=vars(cfg), corpus_bytes=a.corpus_bytes, trunk_steps=a.trunk_steps,
                checkpoints=checkpoint_steps(a.first_checkpoint, a.trunk_steps, a.checkpoints),
                branch_steps=a.branch_steps, schedule_steps=a.trunk_steps + a.branch_steps, eval_seqs=a.eval_seqs,
                eval_batch=a.eval_batch, grad_batches=a.grad_batches)


def setup(a, plan):
    """This process's Megatron world, model configuration and data orders."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|moe_ffn_hidden_size).*")
    import fp8a2a.megatron as fm
    from fp8a2a.megatron.standalone import world_of_one
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = types.SimpleNamespace(**plan["config"])
    fm.register()
    teardown = world_of_one(plan["seed"])
    train_t, val_t, corpus = load_corpus(plan["corpus_bytes"] or None)
    whole = not plan["eval_seqs"]  # the held-out windows every branch is evaluated on
    held_out = dict(val_seqs=1 if whole else plan["eval_seqs"], val_full_max=10 ** 9 if whole else 1)
    data = {o: cm.data_order(train_t, val_t, cfg, plan["seed"], o, plan["schedule_steps"], device, **held_out)
            for o in (1, 2)}
    return types.SimpleNamespace(device=device, cfg=cfg, teardown=teardown, data=data, train_t=train_t, val_t=val_t,
                                 corpus=corpus, whole=whole)


def deadline_of(a):
    return time.perf_counter() + (a.deadline_at - time.time()) if a.deadline_at else None


# ---------------------------------------------------------------------------------------------
# trunk


def run_trunk(a, plan, st, log):
    env = setup(a, plan)
    deadline, cfg, steps, last = deadline_of(a), env.cfg, set(plan["checkpoints"]), plan["trunk_steps"]
    stop = min(last, a.stop_after) if a.stop_after else last
    r = cm.Arm("A", cfg, cm.reference_weights(cfg, plan["seed"], env.device), env.data[1], env.device,
               plan["schedule_steps"])
    done, t_train, rows, saved = 0, 0.0, [], st.latest_trunk()
    if saved:
        ck = torch.load(saved[1], map_location="cpu", weights_only=False)
        r.load_state(ck["arm"])
        done, t_train, rows = ck["done"], ck["t_train"], ck["rows"]
        log(f"trunk: continuing from step {done} ({saved[1]})")

    def save(path):
        t = time.perf_counter()
        cm._checkpoint(path, cfg, plan["schedule_steps"], arm=r.state(), done=done, t_train=t_train, rows=rows)
        return time.perf_counter() - t

    def status(state):
        st.write(st.path("trunk", "status.json"), dict(state=state, done=done, call=st.call,
                                                       ms_per_step=round(1e3 * t_train / max(1, done), 2)))

    status("running")
    acc, n, save_s, step_s, start = torch.zeros((), device=env.device), 0, 5.0, 0.0, done
    sync(env.device)
    t = t0 = time.perf_counter()
    while done < stop:
        if deadline and time.perf_counter() + 2 * step_s + save_s > deadline:
            break
        acc += r.step(done)
        done += 1
        n += 1
        if done % cfg.log_every == 0 or done in steps or done == stop:
            tl = float(acc) / n
            t_train += time.perf_counter() - t
            if not math.isfinite(tl):
                status("failed")
                raise SystemExit(f"trunk: step {done}: loss {tl}")
            rows.append(dict(step=done, train_loss=tl))
            step_s = (time.perf_counter() - t0) / (done - start)
            log(f"trunk step {done:6d}  train {tl:.4f}  {1e3 * t_train / done:6.1f} ms/step")
            acc.zero_()
            n = 0
            if done in steps:
                save_s = save(st.ckpt(done))
                status("running")
            t = time.perf_counter()
    if done < last:
        t_train += (time.perf_counter() - t) if n else 0.0
        save(st.path("trunk", "resume.pt"))
        log(f"trunk: stopped at step {done} of {last}; the same command continues it")
    status("finished" if done >= last else "cut")
    env.teardown()
    return done


# ---------------------------------------------------------------------------------------------
# tasks


class Worker:
    """Takes tasks in order (checkpoint, then arm), keeps the models it built."""

    def __init__(self, a, plan, st, arms, log):
        self.a, self.plan, self.st, self.log = a, plan, st, log
        self.env = setup(a, plan)
        self.grad_arms = [x for x in arms if x in gn.GRAD_ARMS]
        kinds = arms + (["grad"] if plan["grad_batches"] and self.grad_arms else [])
        self.tasks = [(s, x) for s in plan["checkpoints"] for x in kinds]
        self.gdata = gn.noise_batches(self.env.train_t, self.env.val_t, self.env.cfg, plan["seed"],
                                      plan["grad_batches"], self.env.device) if "grad" in kinds else None
        self.models, self.took, self.eval_s = {}, {}, None

    def model(self, x, ck):
        """This worker's model of arm x ("ref": a second arm A, grad_noise's reference)."""
        if x not in self.models:
            arm = "A" if x == "ref" else x
            init = {n: ck["model"][n] for n in ck["names"]}
            self.models[x] = cm.Arm(arm, self.env.cfg, init, self.env.data[ARMS[arm][4]], self.env.device,
                                    self.plan["schedule_steps"])
        return self.models[x]

    def estimate(self, x):
        if x in self.took:
            return 1.1 * self.took[x]
        return 1.5 * max(self.took.values()) if self.took else None  # a new model to build too

    def run(self, deadline):
        st, ran = self.st, 0
        while True:
            todo = [t for t in self.tasks if not st.done(*t) and not st.claimed(*t)]
            if not todo:
                break
            ready = [t for t in todo if os.path.exists(st.ckpt(t[0]))]
            if not ready:
                trunk = st.trunk_status()
                if trunk.get("call") == st.call and trunk.get("state") in ("cut", "finished", "failed") \
                        or (deadline and time.perf_counter() > deadline):
                    if not any(os.path.exists(st.ckpt(s)) for s, _ in todo):
                        break
                time.sleep(0.2)
                continue
            # the earliest checkpoint first; there, a task whose models this worker has
            have = lambda x: all(k in self.models for k in (["ref"] + self.grad_arms if x == "grad" else [x]))  # noqa: E731
            step, x = min(ready, key=lambda t: (t[0], not have(t[1]), self.tasks.index(t)))
            est = self.estimate(x)
            if deadline and (time.perf_counter() > deadline or est and time.perf_counter() + est > deadline):
                self.log(f"deadline: not starting {x} at step {step} (estimated {est or 0:.0f} s)")
                break
            if not st.claim(step, x):
                continue
            t = time.perf_counter()
            ck = torch.load(st.ckpt(step), map_location="cpu", mmap=True, weights_only=False)["arm"]
            doc = self.grad(step, ck) if x == "grad" else self.branch(step, x, ck, deadline)
            if doc is None:
                self.log(f"deadline: dropped {x} at step {step}")
                break
            st.write(st.result(step, x), doc)
            self.took[x] = time.perf_counter() - t
            ran += 1
            self.log(f"step {step:6d} {x:6s} " + (f"val {doc['val_loss']:.5f}  {doc['ms_per_step']:.1f} ms/step"
                                                  if x != "grad" else "gradients") + f"  ({self.took[x]:.1f} s)")
        self.env.teardown()
        return ran

    def branch(self, step, x, ck, deadline):
        r, n = self.model(x, ck), self.plan["branch_steps"]
        r.load_weights(ck)
        torch.set_rng_state(ck["rng"])  # every arm's branch draws what the trunk would have drawn next
        if ck.get("cuda_rng") is not None and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"], self.env.device)
        if x == "rerun":
            torch.manual_seed(RERUN_SEED)
        r.probe.loads = {}
        acc = torch.zeros((), device=self.env.device)
        sync(self.env.device)
        t = time.perf_counter()
        for i in range(step, step + n):
            if deadline and time.perf_counter() > deadline:
                return None
            acc += r.step(i)
        train_loss = float(acc) / n
        t_train = time.perf_counter() - t
        if deadline and self.eval_s and time.perf_counter() + 1.1 * self.eval_s > deadline:
            return None
        t = time.perf_counter()
        vl = r.val_loss(full=self.env.whole, batch=self.plan["eval_batch"])
        self.eval_s = time.perf_counter() - t
        r.probe.log_load(step + n)
        p = r.probe.report()
        return dict(checkpoint_step=step, arm=x, name=ARMS[x][0], dispatcher=r.dispatcher, options=ARMS[x][2],
                    fp8_experts=ARMS[x][3], data_order=ARMS[x][4], steps=n, val_loss=vl, train_loss=train_loss,
                    ms_per_step=round(1e3 * t_train / n, 2), eval_s=round(self.eval_s, 2),
                    held_out_windows=self.windows(),
                    fp8_wire=p["fp8_wire"], wire_granularity=p["wire_granularity"], experts_input=p["experts_input"],
                    te_fp8=p["te_fp8"], router_max_load=p["router_max_load"][-1][1] if p["router_max_load"] else None)

    def windows(self):
        """How many held-out windows an evaluation reads (whole batches of eval_batch)."""
        d, b = self.env.data[1], self.plan["eval_batch"]
        return (d.val_full if self.env.whole else d.val).shape[0] // b * b

    def grad(self, step, ck):
        models = {"ref": self.model("ref", ck), **{x: self.model(x, ck) for x in self.grad_arms}}
        for m in models.values():
            m.load_weights(ck, optimizer=False)
        n = self.plan["grad_batches"]
        res, noise, by_group = gn.measure_models(models, self.grad_arms, self.gdata, n, lambda *s: None)
        return gn.document(models, self.grad_arms, res, noise, by_group, self.env.cfg, n, self.plan["seed"],
                           f"step{step}", self.st.ckpt(step), step)


# ---------------------------------------------------------------------------------------------
# merge


def floor(gaps, steps):
    """The t-interval of a noise floor's gaps at these checkpoints, or None."""
    v = [gaps[s] for s in steps if s in gaps]
    return t_interval(v)[4] if len(v) > 1 else None


def ci_text(ci):
    return "n/a" if ci is None else f"[{pct(ci[0])}, {pct(ci[1])}]"


def merge(state_dir, out, log):
    st = State(state_dir)
    plan = st.read(st.path("plan.json"))
    if plan is None:
        raise SystemExit(f"{state_dir}: no plan.json (not a branched_ab.py state directory)")
    rows = [st.read(p) for p in sorted(glob.glob(st.path("branches", "*.json")))]
    by = {}
    for r in rows:
        by.setdefault(r["checkpoint_step"], {})[r["arm"]] = r
    arms = [x for x in ARMS if any(x in b for b in by.values())]
    gaps = {x: {s: b[x]["val_loss"] / b["A"]["val_loss"] - 1 for s, b in by.items() if x in b and "A" in b}
            for x in arms if x != "A"}
    table = {}
    for x, g in gaps.items():
        steps = sorted(g)
        m, sd, _, h, ci = t_interval([g[s] for s in steps]) if steps else (None,) * 5
        mine = [by[s][x] for s in steps]
        table[x] = dict(name=ARMS[x][0], n=len(steps), gaps={str(s): v for s, v in g.items()}, mean=m, sd=sd,
                        half_width=h, ci95=ci, inside=None if ci is None else -GAP_BOUND <= ci[0] and ci[1] <= GAP_BOUND,
                        floors={f: floor(gaps[f], steps) for f in NOISE_ARMS if f in gaps and f != x},
                        fp8_wire=all(r["fp8_wire"] for r in mine),
                        ms_per_step=sum(r["ms_per_step"] for r in mine) / len(mine) if mine else None)
    requested = st.read(st.path("arms.json"), arms)
    trunk = st.trunk_status()
    missing = [(s, x) for s in plan["checkpoints"] for x in requested if x not in by.get(s, {})]
    grad_paths = sorted(glob.glob(st.path("grad", "*.json")))
    grad = gn.merge(grad_paths, log) if grad_paths else None
    grad_missing = [s for s in plan["checkpoints"] if not os.path.exists(st.result(s, "grad"))]

    cfg = plan["config"]
    windows = {r["held_out_windows"] for r in rows}
    lines = [f"Branched A/B: a trunk of arm A for {plan['trunk_steps']} steps (schedule over {plan['schedule_steps']}), "
             f"{len(plan['checkpoints'])} checkpoints at steps {plan['checkpoints'][0]}-{plan['checkpoints'][-1]}, "
             f"branches of {plan['branch_steps']} steps; validation loss on "
             + ("the whole held-out split" if not plan["eval_seqs"] else f"{plan['eval_seqs']} windows spread over the held-out split")
             + f" ({', '.join(map(str, sorted(windows)))} x {cfg['seq']} bytes); model {cfg['layers']} layers, d {cfg['hidden']}, "
             f"{cfg['experts']} experts top-{cfg['topk']}, batch {cfg['batch']}, FP8 recipe {cfg['fp8_recipe']}",
             "",
             "| arm | run | checkpoints | mean gap vs A | 95% t-interval | sd | inside +-0.25% | noise floor: "
             "other data order | noise floor: rerun | ms/step |",
             "| --- |" + " --- |" * 9]
    yn = lambda v: "n/a" if v is None else ("yes" if v else "NO")  # noqa: E731
    for x, t in sorted(table.items(), key=lambda kv: (kv[0] not in NOISE_ARMS, list(ARMS).index(kv[0]))):
        fl = [ci_text(t["floors"].get(f)) if f != x else "-" for f in NOISE_ARMS]
        lines.append(f"| {x} | {t['name']} | {t['n']} | {pct(t['mean'])} | {ci_text(t['ci95'])} | "
                     f"{pct(t['sd'], False)} | {yn(t['inside']) if x not in NOISE_ARMS else '-'} | {fl[0]} | {fl[1]} | "
                     + (f"{t['ms_per_step']:.1f}" if t["ms_per_step"] else "n/a") + " |")
    lines.append("")
    lines.append(f"trunk: {trunk.get('state', 'not started')} at step {trunk.get('done', 0)} of {plan['trunk_steps']}, "
                 f"{trunk.get('ms_per_step', 0):.1f} ms/step")
    if missing or grad_missing:
        reached = trunk.get("done", 0)
        why = lambda s: "trunk not there yet" if s > reached else "not run (time)"  # noqa: E731
        lines.append(f"not done: {len(missing)} of {len(plan['checkpoints']) * len(requested)} branches"
                     + "".join(f"; step {s}: {','.join(x for t, x in missing if t == s)} ({why(s)})"
                               for s in sorted({t for t, _ in missing}))
                     + (f"; gradients at steps {','.join(map(str, grad_missing))}" if grad_missing else ""))
    if grad:
        lines.append("")
        gn.report(grad["summary"], lines.append)
    text = "\n".join(lines)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "branch_summary.md"), "w") as f:
        f.write(text + "\n")
    doc = dict(plan=plan, trunk=trunk, gap="val loss of the branch / that of arm A's branch from the same checkpoint - 1",
               target=f"95% t-interval of the mean gap inside +-{100 * GAP_BOUND}%", arms=table,
               missing=[dict(step=s, arm=x) for s, x in missing], grad_missing=grad_missing,
               grad_summary=grad["summary"] if grad else None)
    with open(os.path.join(out, "branch_summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    keys = ("checkpoint_step", "arm", "name", "steps", "val_loss", "train_loss", "ms_per_step", "eval_s", "fp8_wire",
            "router_max_load")
    with open(os.path.join(out, "branches.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (r["checkpoint_step"], list(ARMS).index(r["arm"]))))
    if grad:
        with open(os.path.join(out, "grad_noise.json"), "w") as f:
            json.dump(grad, f)
    log(text)
    return doc


# ---------------------------------------------------------------------------------------------
# main


def spawn(a, argv):
    """The trunk's process and a.workers workers, each logging to --out/log_<name>.txt."""
    base = cm.strip_args(argv, {"--workers", "--role", "--deadline-at", "--call"})
    procs = []
    for name in ["trunk"] + [f"worker{k}" for k in range(a.workers)]:
        cmd = [sys.executable, os.path.abspath(__file__), *base, "--role", "trunk" if name == "trunk" else "worker",
               "--call", a.call, "--deadline-at", repr(a.deadline_at)]
        with open(os.path.join(a.out, f"log_{name}.txt"), "w") as f:
            procs.append((name, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)))
    return procs


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)} (A is always run)")
    p.add_argument("--seed", type=int, default=1, help="the trunk's initialization and data orders")
    p.add_argument("--trunk-steps", type=int, default=2400)
    p.add_argument("--checkpoints", type=int, default=20, help="how many trunk checkpoints to branch from")
    p.add_argument("--first-checkpoint", type=int, default=1000, help="the first checkpoint's step (the rest up to the "
                   "trunk's last step, evenly spaced)")
    p.add_argument("--branch-steps", type=int, default=100)
    p.add_argument("--eval-seqs", type=int, default=1536, help="held-out windows spread over the split (0: the whole split)")
    p.add_argument("--eval-batch", type=int, default=64, help="windows per evaluation forward")
    p.add_argument("--grad-batches", type=int, default=4, help="grad_noise.py's N per checkpoint (0: no gradients)")
    p.add_argument("--workers", type=int, default=10, help="task processes beside the trunk's (0: all in this one)")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds for this command (0: none)")
    p.add_argument("--stop-after", type=int, default=0, help="train the trunk to this step at most in this command")
    p.add_argument("--state-dir", default=".branch_ckpt", help="checkpoints and finished tasks (kept across commands)")
    p.add_argument("--out", default="out/branch")
    p.add_argument("--merge", metavar="STATE", help="run nothing: the tables of this state directory into --out")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--role", choices=("trunk", "worker"), help=argparse.SUPPRESS)
    p.add_argument("--call", help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)  # epoch s, the parent's
    cm.add_model_args(p)
    a = p.parse_args(argv)
    log = (lambda *s: None) if a.quiet else (lambda *s: print(*s, flush=True))
    if a.merge:
        return merge(a.merge, a.out, log)

    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    arms = list(dict.fromkeys(["A"] + arms))  # every gap needs A's branch
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny)")
    plan = plan_of(a, cm.model_config(a))
    if a.time_budget > 0 and not a.deadline_at:
        a.deadline_at = time.time() + a.time_budget - MERGE_S
    a.call = a.call or f"{os.getpid()}-{int(time.time())}"
    st = State(a.state_dir, a.call)
    if a.role == "trunk":
        return run_trunk(a, plan, st, log)
    if a.role == "worker":
        return Worker(a, plan, st, arms, log).run(deadline_of(a))

    saved = st.read(st.path("plan.json"))
    if saved is not None and saved != json.loads(json.dumps(plan)):
        raise SystemExit(f"{a.state_dir} holds another plan: use another --state-dir (saved "
                         f"{ {k: v for k, v in saved.items() if plan.get(k) != v} })")
    st.write(st.path("plan.json"), plan)
    st.write(st.path("arms.json"), [x for x in ARMS if x in arms or x in st.read(st.path("arms.json"), [])])
    st.write(st.path("trunk", "status.json"), dict(st.trunk_status(), state="starting", call=a.call))
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    log(f"plan: {json.dumps({k: v for k, v in plan.items() if k != 'config'})}; arms {','.join(arms)}; "
        f"{a.workers} workers; state {st.root}")
    bad = []
    if a.workers == 0:
        run_trunk(a, plan, st, log)
        Worker(a, plan, st, arms, log).run(deadline_of(a))
    else:
        procs, report = spawn(a, argv), 30
        while any(proc.poll() is None for _, proc in procs):
            time.sleep(0.5)
            if time.perf_counter() - t0 > report:
                report += 30
                n = len(glob.glob(st.path("branches", "*.json"))) + len(glob.glob(st.path("grad", "*.json")))
                log(f"{time.perf_counter() - t0:5.0f} s: trunk {st.trunk_status()}; {n} tasks done")
        bad = [name for name, proc in procs if proc.returncode != 0]
    shutil.rmtree(st.path("claims", a.call), ignore_errors=True)
    log(f"ran for {time.perf_counter() - t0:.0f} s")
    doc = merge(a.state_dir, a.out, log)
    if bad:
        raise SystemExit(f"failed: {bad} (their logs: {a.out}/log_<name>.txt)")
    return doc


if __name__ == "__main__":
    main()
