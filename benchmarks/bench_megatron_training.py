#!/usr/bin/env python
"""Megatron's own iteration time (`elapsed time per iteration (ms)` in its training log) for a small
GPT-MoE trained by megatron.training on mock data (4 layers, hidden 2048, 16 experts top-4, TE spec,
grouped GEMM, permute fusion), on one GPU: `alltoall` with TE's grouped experts against
`fp8_alltoall` with TE's experts (--fp8a2a-experts megatron) and with fp8a2a's FP8 experts
(--fp8a2a-experts fp8), each in BF16 and under TE's FP8 blockwise recipe:

    python benchmarks/bench_megatron_training.py --runs 3 --json out.json --md out.md

Every run is a process of its own, `python -m fp8a2a.megatron.run SCRIPT MODEL... FLAGS...`, SCRIPT
being Megatron-LM's pretrain_gpt.py (--script; by default .mlm/pretrain_gpt.py where present, else
tests/gpu/pretrain_gpt_mock.py, the same model and data without a checkout). A round runs every
configuration once, in an order rotated each round; --runs rounds. A run's figure is the mean of the
logged figures after the first --warmup iterations (each logged figure is Megatron's mean over its
--log-interval iterations). Reported per configuration: median [min-max] over the runs, and the
speedup over `alltoall` of the same precision (its time / this time), taken per round. The JSON is
rewritten after every run; --time-budget starts no round that would not fit, and no run with less
time left than 1.2x the longest finished run (before one has finished: --min-run-s; a cold start
alone, model build, TE init, torch.compile and the Triton JIT of fp8a2a's kernels, takes 20-30 s),
so the budget does not cut a run short into a spurious timeout. --dry-run prints the commands.

--resume continues the runs of an existing --json (one device call may not hold them all): the runs
not in it are run, in the same rotated order, so a round the budget cut continues where it stopped,
and --runs may grow; under --resume a round is started even where it may not fit (its rest waits for
the next call). The file must be from the same setup (configurations, --warmup, --iters,
--log-interval, --script, --args and the run commands they give), else it is refused with a one-line
error and left as it is. A failed run counts as done (its error stays in the file; delete its entry to
run it again); a run in flight when a call was killed is not in the file and runs again. The table and
the per-round ratios cover every run in the file; "calls" lists each call's command, commit and GPU,
and each run says which call ran it:

    python benchmarks/bench_megatron_training.py --resume --time-budget 550 --json out.json --md out.md
Without APEX every run gets --no-gradient-accumulation-fusion (Megatron's own output layer needs
APEX's kernel for it). --eval-iters 0 and a --eval-interval past the run: no evaluation, and
megatron.training 0.19 divides by --eval-interval when it sizes the datasets (it has no default)."""
import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPTS = (os.path.join(ROOT, ".mlm", "pretrain_gpt.py"), os.path.join(ROOT, "tests", "gpu", "pretrain_gpt_mock.py"))
MODEL = ("--num-layers 4 --hidden-size 2048 --ffn-hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
         "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 --num-experts 16 "
         "--moe-router-topk 4 --moe-grouped-gemm --moe-permute-fusion --swiglu --disable-bias-linear "
         "--moe-aux-loss-coeff 1e-2 --transformer-impl transformer_engine --bf16 --lr 1e-4 --seed 1234 "
         "--eval-iters 0 --eval-interval 1000000 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000").split()
PRECISIONS = {"bf16": ("BF16", []),
              "blockwise": ("TE FP8 blockwise", "--fp8-format e4m3 --fp8-recipe blockwise".split())}
DISPATCH = {  # name: (label, flags)
    "alltoall": ("`alltoall` + TE experts", ["--moe-token-dispatcher-type", "alltoall"]),
    "fp8a2a-te": ("`fp8_alltoall` + TE experts (`--fp8a2a-experts megatron`)",
                  ["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-experts", "megatron"]),
    "fp8a2a-fp8": ("`fp8_alltoall` + fp8a2a experts (`--fp8a2a-experts fp8`)",
                   ["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-experts", "fp8"]),
}
CONFIGS = {f"{d}/{p}": (f"{dl}, {pl}", df + pf)  # name: (label, flags); BF16 first, alltoall first in each
           for p, (pl, pf) in PRECISIONS.items() for d, (dl, df) in DISPATCH.items()}
LOGGED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? elapsed time per iteration \(ms\): ([\d.]+) \|")
LOSS = re.compile(r" lm loss: ([^ |]+) \|")


def baseline(name):
    return "alltoall/" + name.split("/")[1]


def parse_log(text, warmup, iters, interval):
    """(mean ms per iteration after the warm-up, those logged figures, the last logged loss); raises
    ValueError when the log lacks a logged figure the run should have."""
    logged = {int(m.group(1)): float(m.group(2)) for m in LOGGED.finditer(text)}
    want = list(range(warmup + interval, warmup + iters + 1, interval))
    missing = [i for i in want if i not in logged]
    if missing:
        raise ValueError(f"no logged iteration time for iterations {missing} (logged: {sorted(logged)})")
    losses = LOSS.findall(text)
    figures = [logged[i] for i in want]
    return statistics.fmean(figures), figures, float(losses[-1]) if losses else None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _have(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def command(args, name):
    iters = ["--train-iters", str(args.warmup + args.iters), "--log-interval", str(args.log_interval)]
    fusion = [] if _have("fused_weight_gradient_mlp_cuda") else ["--no-gradient-accumulation-fusion"]
    script = os.path.abspath(args.script)  # the runs start in ROOT
    inside = os.path.relpath(script, ROOT)
    return [sys.executable, "-m", "fp8a2a.megatron.run", script if inside.startswith("..") else inside,
            *MODEL, *iters, *fusion, *CONFIGS[name][1], *shlex.split(args.args)]


def shown(cmd):
    return shlex.join(["python", *cmd[1:]])


_live = set()  # process groups of the runs under way


def _stop(signum, frame):  # a timeout's SIGTERM does not reach the runs' own process groups: end them here
    for pid in _live:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


def run_one(args, name, log_path, timeout):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(args, name), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _live.add(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its data-loader workers too: none may share the GPU's next run
            proc.wait()
            rc = f"timeout after {timeout:.0f} s"
        _live.discard(proc.pid)
    out = {"config": name, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": log_path}
    with open(log_path) as f:
        text = f.read()
    try:
        ms, figures, loss = parse_log(text, args.warmup, args.iters, args.log_interval)
        out.update(ms=round(ms, 2), logged_ms=figures, last_loss=loss)
    except ValueError as e:
        out["error"] = f"exit {rc}: {e}; log tail: {text[-1500:]}"
    if rc != 0 and "error" not in out:
        out["error"] = f"exit {rc} after its iterations; log tail: {text[-1500:]}"
    return out


def summarize(runs, names):
    """{config: median [min-max] ms over its runs and its speedups over alltoall (same precision, same round)}."""
    by_round = {}
    for r in runs:
        if "ms" in r and "error" not in r:
            by_round.setdefault(r["round"], {})[r["config"]] = r["ms"]
    out = {}
    for name in names:
        ms = [rnd[name] for rnd in by_round.values() if name in rnd]
        if not ms:
            continue
        row = {"label": CONFIGS[name][0], "runs_ms": ms, "ms": round(statistics.median(ms), 2), "min_ms": min(ms),
               "max_ms": max(ms)}
        base = baseline(name)
        ratios = [rnd[base] / rnd[name] for rnd in by_round.values() if name in rnd and base in rnd]
        if ratios and name != base:
            row.update(speedup=round(statistics.median(ratios), 3), speedup_min=round(min(ratios), 3),
                       speedup_max=round(max(ratios), 3), speedup_runs=len(ratios))
        out[name] = row
    return out


def table(result):
    lines = ["| configuration | runs | iteration (ms), median [min-max] | speedup over `alltoall` (same precision), "
             "per round: median [min-max] (rounds) |", "| --- | --- | --- | --- |"]
    for name, r in result["summary"].items():
        speed = (f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}] ({r['speedup_runs']})"
                 if "speedup" in r else "baseline" if name == baseline(name) else "-")
        lines.append(f"| {r['label']} | {len(r['runs_ms'])} | {r['ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}] "
                     f"| {speed} |")
    failed = [r for r in result["runs"] if "error" in r]
    if failed:
        lines.append(f"\n{len(failed)} run(s) failed: " + ", ".join(f"{r['config']} (round {r['round']})"
                                                                  for r in failed))
    calls = result.get("calls", [])
    if len(calls) > 1:  # resumed: say so, and where the calls differ in what they ran on
        differ = [f"{key} {', '.join(map(str, seen))}" for key in ("gpu", "commit", "versions")
                  for seen in [list(dict.fromkeys(json.dumps(c.get(key), sort_keys=True) if key == "versions"
                                                  else c.get(key) for c in calls))] if len(seen) > 1]
        lines.append(f"\nruns from {len(calls)} calls (resumed)" + (f"; they differ in {'; '.join(differ)}"
                                                                    if differ else ""))
    return "\n".join(lines)


def setup_of(args, names):
    """What the runs of one results file must share: a resumed file is refused where this differs."""
    return {"configs": names, "warmup": args.warmup, "iters": args.iters, "log_interval": args.log_interval,
            "script": os.path.relpath(os.path.abspath(args.script), ROOT), "args": shlex.split(args.args)}


def load_resumable(path, setup, run_commands):
    """The results in PATH to continue, None where there is no such file; ValueError (one line) where
    the file cannot be continued by this command."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resume from {path}: {e}") from None
    if not isinstance(old, dict) or old.get("benchmark") != "megatron_training" or "setup" not in old:
        raise ValueError(f"cannot resume from {path}: it holds no resumable megatron_training results")
    there = old["setup"]
    diff = [f"{k} {there.get(k)!r} there, {v!r} here" for k, v in setup.items() if there.get(k) != v]
    if not diff:  # the same flags, other commands: the code's model or the APEX fusion flag changed
        diff = [f"the run command of {n} (code or environment changed)" for n in setup["configs"]
                if old.get("run_commands", {}).get(n) != run_commands[n]][:1]
    if diff:
        raise ValueError(f"refusing to resume {path}: another setup ({'; '.join(diff)}); remove the file or give "
                         "another --json")
    return old


def save(result, path):
    """Replace PATH whole (a resumed file must not be left half written by a kill)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def environment():
    versions = {}
    for dist in ("torch", "megatron-core", "transformer_engine", "transformer-engine"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        gpu = []
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"versions": versions, "gpu": gpu[0] if gpu else None, "commit": git.stdout.strip() or None,
            "apex_gradient_accumulation_fusion": _have("fused_weight_gradient_mlp_cuda")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="rounds: every configuration once per round")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--warmup", type=int, default=10, help="iterations left out (a multiple of --log-interval)")
    ap.add_argument("--iters", type=int, default=50, help="measured iterations (a multiple of --log-interval)")
    ap.add_argument("--log-interval", type=int, default=10, help="Megatron's --log-interval")
    ap.add_argument("--script", default=next((s for s in SCRIPTS if os.path.isfile(s)), SCRIPTS[-1]),
                    help="the Megatron training script (default: .mlm/pretrain_gpt.py if present, else the mock one)")
    ap.add_argument("--args", default="", help="more Megatron flags for every run (after the model's: they win)")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds: start no round that would not fit")
    ap.add_argument("--min-run-s", type=float, default=60,
                    help="with --time-budget: start no run with less left than this before a run has finished, then "
                         "than 1.2x the longest finished run")
    ap.add_argument("--log-dir", default=None, help="one log per run here (default: beside --json, or ./bench_out)")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every run)")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--resume", action="store_true",
                    help="continue the runs in --json where it exists (same setup, else refused): only the runs "
                         "not in it run, and the table covers all of them")
    ap.add_argument("--dry-run", action="store_true", help="print each configuration's command and exit")
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        ap.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    if args.warmup < args.log_interval or args.warmup % args.log_interval or args.iters % args.log_interval \
            or args.iters <= 0:
        ap.error("--warmup (at least one log interval: Megatron's first logged figure holds iteration 1) and "
                 "--iters must be multiples of --log-interval")
    if args.resume and not args.json:
        ap.error("--resume continues the runs in --json: give --json")
    names = [n for n in CONFIGS if n in names]
    if args.dry_run:
        for name in names:
            print(f"{name}: {shown(command(args, name))}")
        return 0
    setup, run_commands = setup_of(args, names), {n: shown(command(args, n)) for n in names}
    result = None
    if args.resume:
        try:
            result = load_resumable(args.json, setup, run_commands)
        except ValueError as e:
            print(f"bench_megatron_training.py: error: {e}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _stop)
    log_dir = args.log_dir or os.path.join(os.path.dirname(os.path.abspath(args.json)) if args.json else "bench_out",
                                           "megatron_training_logs")
    os.makedirs(log_dir, exist_ok=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    call = {"command": shlex.join(["python", "benchmarks/bench_megatron_training.py", *(argv or sys.argv[1:])]),
            **environment()}
    if result is None:
        result = {"benchmark": "megatron_training", "script": setup["script"], "command": call["command"],
                  "run_commands": run_commands, "setup": setup, "warmup": args.warmup, "iters": args.iters,
                  "log_interval": args.log_interval, **{k: v for k, v in call.items() if k != "command"},
                  "calls": [], "runs": [], "summary": {}}
    else:
        result.pop("stopped", None)
        result.setdefault("calls", [])
    result["calls"].append({**call, "runs_before": len(result["runs"])})
    ncall = len(result["calls"])
    done = {(r["round"], r["config"]) for r in result["runs"]}
    if args.resume and result["runs"]:
        todo = sum((rnd + 1, n) not in done for rnd in range(args.runs) for n in names)
        print(f"resuming {args.json}: {len(done)} run(s) done, {todo} of {args.runs} round(s) x {len(names)} left",
              flush=True)
    t0, longest_round = time.monotonic(), 0.0
    # a finished run of an earlier call is as long as one of this call: each run is a cold start of its own
    longest_run = max((r["wall_s"] for r in result["runs"] if "error" not in r), default=0.0)
    for rnd in range(args.runs):
        order = [n for n in names[rnd % len(names):] + names[:rnd % len(names)] if (rnd + 1, n) not in done]
        if not order:
            continue
        left = None if args.time_budget is None else args.time_budget - (time.monotonic() - t0)
        # a round cut short is lost without --resume (its ratios want every run); with it, the next call continues it
        if left is not None and not args.resume and longest_round and left < longest_round:
            result["stopped"] = f"round {rnd + 1} of {args.runs} not started: {left:.0f} s left, a round took " \
                                f"{longest_round:.0f} s"
            print(result["stopped"], flush=True)
            break
        t_round = time.monotonic()
        for name in order:
            timeout = args.run_timeout
            if args.time_budget is not None:
                left = args.time_budget - (time.monotonic() - t0)
                need = min(args.run_timeout, 1.2 * longest_run if longest_run else args.min_run_s)
                if left < need:  # a run the budget would kill is no figure, only an error
                    result["stopped"] = f"out of time in round {rnd + 1}: {name} not started, {left:.0f} s left, " \
                                        f"a run needs about {need:.0f} s" + \
                                        ("; the same command continues" if args.resume else "")
                    print(result["stopped"], flush=True)
                    break
                timeout = min(timeout, left)
            log_path = os.path.join(log_dir, f"run{rnd + 1}_{name.replace('/', '_')}.log")
            r = {"round": rnd + 1, **run_one(args, name, log_path, timeout), "call": ncall}
            result["runs"].append(r)
            if "error" not in r:
                longest_run = max(longest_run, r["wall_s"])
            print(f"round {rnd + 1} {name}: " + (f"{r['ms']:.1f} ms/iteration, loss {r['last_loss']}"
                                                 if "error" not in r else r["error"][:300]) + f" ({r['wall_s']} s)",
                  flush=True)
            result["summary"] = summarize(result["runs"], names)
            if args.json:
                save(result, args.json)
        if "stopped" in result:
            break
        longest_round = max(longest_round, time.monotonic() - t_round)
    result["summary"] = summarize(result["runs"], names)  # a resumed file with nothing left to run too
    if args.json:  # again: a stop after the last run (or before any) is recorded too
        save(result, args.json)
    md = table(result)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            commands = list(dict.fromkeys([result["command"], *(c["command"] for c in result.get("calls", []))]))
            f.write(f"{md}\n\n" + "\n".join(f"`{c}`" for c in commands) + "\n")
    return 0 if result["summary"] and not any("error" in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
