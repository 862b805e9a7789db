"""benchmarks/bench_megatron_training.py on the CPU, with a stand-in for the training script that logs
as Megatron's training loop does: the runs alternate, each a process through the launcher, the
warm-up figures stay out, the speedups are per round, a failed run is reported, not averaged, and a
run the time budget cut is continued by the same command (--resume)."""
import importlib.util
import json
import os
import signal
import types

import pytest

from .programs import ROOT, run

pytest.importorskip("megatron.core")

BENCH = os.path.join(ROOT, "benchmarks", "bench_megatron_training.py")
# Megatron's log line (megatron/training/training.py, training_log), with a time per dispatcher type
FAKE_SCRIPT = """
import sys

import fp8a2a.megatron as fm

argv = sys.argv[1:]
flag = lambda name: argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last one given wins
assert fm.is_registered()
iters, interval = int(flag("--train-iters")), int(flag("--log-interval"))
experts = flag("--fp8a2a-experts") if "--fp8a2a-experts" in argv else None
ms = 50.0 if experts == "fp8" else {"alltoall": 100.0, "fp8_alltoall": 80.0}[flag("--moe-token-dispatcher-type")]
if "--fail" in argv and experts == "fp8":
    sys.exit("failing as asked")
for it in [1] + list(range(interval, iters + 1, interval)):
    t = 5000.0 if it <= interval else ms  # the first interval holds the warm-up
    print(f" [2026-12-02 10:00:00.000000] iteration {it:8d}/{iters:8d} | consumed samples: {it * 2:12d} | "
          f"elapsed time per iteration (ms): {t:.1f} | learning rate: 1.000000E-04 | global batch size:     2 | "
          f"lm loss: {7.0 - it / 100:.6E} | loss scale: 1.0 | number of skipped iterations:   0 | "
          "number of nan iterations:   0 |")
"""


def bench_argv(tmp_path, runs, configs, *flags):
    script = tmp_path / "pretrain_fake.py"
    script.write_text(FAKE_SCRIPT)
    return [str(a) for a in ("--script", script, "--runs", runs, "--iters", "20", "--warmup", "10", "--log-interval",
                             "10", "--configs", configs, "--json", tmp_path / "bench.json", "--md",
                             tmp_path / "bench.md", *flags)]


def bench(tmp_path, runs, configs, *flags):
    r = run(BENCH, *bench_argv(tmp_path, runs, configs, *flags), timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r, json.loads((tmp_path / "bench.json").read_text())


def test_bench_megatron_training_alternates_and_parses(tmp_path):
    r, res = bench(tmp_path, 2, "alltoall/bf16,fp8a2a-fp8/bf16,fp8a2a-te/blockwise")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    order = [(x["round"], x["config"]) for x in res["runs"]]
    assert order == [(1, "alltoall/bf16"), (1, "fp8a2a-fp8/bf16"), (1, "fp8a2a-te/blockwise"),
                     (2, "fp8a2a-fp8/bf16"), (2, "fp8a2a-te/blockwise"), (2, "alltoall/bf16")]
    s = res["summary"]
    assert s["alltoall/bf16"]["runs_ms"] == [100.0, 100.0] and "speedup" not in s["alltoall/bf16"]
    assert s["fp8a2a-fp8/bf16"]["ms"] == 50.0 and s["fp8a2a-fp8/bf16"]["speedup"] == 2.0
    assert s["fp8a2a-te/blockwise"]["ms"] == 80.0 and "speedup" not in s["fp8a2a-te/blockwise"]  # no baseline run
    assert all(x["logged_ms"] == [s[x["config"]]["ms"]] * 2 for x in res["runs"])  # iterations 11-30 only
    assert "--no-gradient-accumulation-fusion" in res["run_commands"]["alltoall/bf16"]
    assert "| `fp8_alltoall` + fp8a2a experts (`--fp8a2a-experts fp8`), BF16 | 2 | 50.0 [50.0-50.0] | 2.00x [2.00-2.00] (2) |" \
        in (tmp_path / "bench.md").read_text()


def test_bench_megatron_training_reports_a_failed_run(tmp_path):
    r, res = bench(tmp_path, 1, "fp8a2a-fp8/bf16,alltoall/bf16", "--args=--fail")
    assert r.returncode == 1
    failed = [x for x in res["runs"] if "error" in x]
    assert [x["config"] for x in failed] == ["fp8a2a-fp8/bf16"] and "failing as asked" in failed[0]["error"]
    assert "fp8a2a-fp8/bf16" not in res["summary"] and res["summary"]["alltoall/bf16"]["ms"] == 100.0
    assert "1 run(s) failed: fp8a2a-fp8/bf16 (round 1)" in r.stdout


def test_bench_megatron_training_dry_run():
    r = run(BENCH, "--dry-run", "--configs", "fp8a2a-te/blockwise", "--args=--micro-batch-size 4", timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    line, = r.stdout.splitlines()
    assert line.startswith("fp8a2a-te/blockwise: ") and " -m fp8a2a.megatron.run " in line
    assert line.endswith("--moe-token-dispatcher-type fp8_alltoall --fp8a2a-experts megatron --fp8-format e4m3 "
                         "--fp8-recipe blockwise --micro-batch-size 4")
    assert "--train-iters 60 --log-interval 10" in line


def test_bench_megatron_training_starts_no_run_the_budget_would_cut(tmp_path):
    """A run given less than a cold start would only time out: it is not started, and the JSON says why."""
    r, res = bench(tmp_path, 1, "alltoall/bf16", "--time-budget", "30", "--min-run-s", "60")
    assert r.returncode == 1 and res["runs"] == [] and res["summary"] == {}
    assert res["stopped"].startswith("out of time in round 1: alltoall/bf16 not started"), res["stopped"]


def test_bench_megatron_training_resumes_a_cut_run_and_refuses_another_setup(tmp_path, monkeypatch):
    """A call the time budget stops in round 2 of 2, then the same command: the runs not done run, in the
    round's rotated order, and the table covers all of them; a call with other iterations or other
    configurations is refused and leaves the file as it is. The first call runs in this process on a
    clock of its own, every run taking 50 s of it, so where the budget stops it does not hang on this
    machine's speed: budget 230 s, a run needs 1.2 x 50 s once one has finished, so four runs start."""
    configs = "alltoall/bf16,fp8a2a-te/bf16,fp8a2a-fp8/bf16"  # the order of CONFIGS, which the runs keep
    flags = ("--resume", "--time-budget", "230", "--min-run-s", "50")
    spec = importlib.util.spec_from_file_location("bench_megatron_training_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    clock = [0.0]
    real_run_one = mod.run_one

    def run_one(*a):
        out = real_run_one(*a)
        clock[0] += 50.0
        return {**out, "wall_s": 50.0}

    monkeypatch.setattr(mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(mod, "run_one", run_one)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        rc = mod.main(bench_argv(tmp_path, 2, configs, *flags))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert rc == 0
    cut = json.loads((tmp_path / "bench.json").read_text())
    assert [(x["round"], x["config"]) for x in cut["runs"]] == [
        (1, "alltoall/bf16"), (1, "fp8a2a-te/bf16"), (1, "fp8a2a-fp8/bf16"), (2, "fp8a2a-te/bf16")]
    assert cut["stopped"].startswith("out of time in round 2: fp8a2a-fp8/bf16 not started"), cut["stopped"]

    r, res = bench(tmp_path, 2, configs, *flags)  # the same command, as a program
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "resuming " in r.stdout and "4 run(s) done, 2 of 2 round(s) x 3 left" in r.stdout
    assert res["runs"][:4] == cut["runs"] and "stopped" not in res
    assert [(x["round"], x["config"], x["call"]) for x in res["runs"][4:]] == [
        (2, "fp8a2a-fp8/bf16", 2), (2, "alltoall/bf16", 2)]
    assert [c["runs_before"] for c in res["calls"]] == [0, 4]
    s = res["summary"]
    assert s["alltoall/bf16"]["runs_ms"] == [100.0, 100.0]
    assert s["fp8a2a-fp8/bf16"]["speedup"] == 2.0 and s["fp8a2a-fp8/bf16"]["speedup_runs"] == 2
    assert s["fp8a2a-te/bf16"]["speedup"] == 1.25 and s["fp8a2a-te/bf16"]["speedup_runs"] == 2
    md = (tmp_path / "bench.md").read_text()
    assert "| 2 | " in md and "runs from 2 calls (resumed)" in md
    assert "| `fp8_alltoall` + TE experts (`--fp8a2a-experts megatron`), BF16 | 2 | 80.0 [80.0-80.0] | 1.25x" in md

    done = (tmp_path / "bench.json").read_text()
    for other, why in ((("--iters", "30"), "iters 20 there, 30 here"),
                       (("--configs", "alltoall/bf16,fp8a2a-fp8/bf16"), "configs ")):
        r = run(BENCH, *bench_argv(tmp_path, 2, configs, *flags, *other), timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
        assert r.stderr.startswith("bench_megatron_training.py: error: refusing to resume ") and why in r.stderr
        assert (tmp_path / "bench.json").read_text() == done
