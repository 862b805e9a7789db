"""benchmarks/bench_megatron_training.py on the CPU, with a stand-in for the training script that logs
as Megatron's training loop does: the runs alternate, each a process through the launcher, the
warm-up figures stay out, the speedups are per round, and a failed run is reported, not averaged."""
import json
import os

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


def bench(tmp_path, runs, configs, *flags):
    script = tmp_path / "pretrain_fake.py"
    script.write_text(FAKE_SCRIPT)
    out = tmp_path / "bench.json"
    r = run(BENCH, "--script", script, "--runs", str(runs), "--iters", "20", "--warmup", "10", "--log-interval",
            "10", "--configs", configs, "--json", out, "--md", tmp_path / "bench.md", *flags, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r, json.loads(out.read_text())


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
    assert "| `fp8_alltoall` + fp8a2a experts (`--fp8a2a-experts fp8`), BF16 | 50.0 [50.0-50.0] | 2.00x [2.00-2.00] |" \
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
