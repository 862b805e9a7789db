"""CPU smoke of examples/branched_ab.py on the tiny model: a trunk of 24 steps, branches of 3 steps from
3 checkpoints, arms A, B, D, F and both noise floors, gradients at each checkpoint, in a trunk process
and a worker process; then the same plan cut (the trunk stopped at step 15) and continued in a second
command, in one process, reaching the same numbers; a finished plan runs nothing again, and another
plan is refused."""
import csv
import functools
import json
import math
import os

import pytest

from .programs import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "branched_ab.py")
PLAN = ("--device", "cpu", "--tiny", "--threads", "1", "--corpus-bytes", "1000000", "--trunk-steps", "24",
        "--first-checkpoint", "12", "--checkpoints", "3", "--branch-steps", "3", "--eval-seqs", "8", "--eval-batch", "4",
        "--grad-batches", "1", "--arms", "A,B,D,F,noise,rerun", "--quiet")
ARMS = ("A", "B", "D", "F", "noise", "rerun")


run_tool = functools.partial(run, SCRIPT, timeout=300, check=True)


def summary(out):
    return json.loads((out / "branch_summary.json").read_text())


def test_branched_ab_pipeline(tmp_path):
    pytest.importorskip("megatron.core")
    state, out = tmp_path / "state", tmp_path / "out"
    run_tool(*PLAN, "--workers", "1", "--time-budget", "600", "--state-dir", str(state), "--out", str(out))
    assert sorted(os.listdir(state / "trunk")) == ["s000012.pt", "s000018.pt", "s000024.pt", "status.json"]
    assert len(os.listdir(state / "branches")) == 3 * len(ARMS) and len(os.listdir(state / "grad")) == 3
    assert os.listdir(state / "claims") == []  # this command's claims are gone
    assert (out / "log_trunk.txt").exists() and (out / "log_worker0.txt").exists()
    d = summary(out)
    assert d["plan"]["checkpoints"] == [12, 18, 24] and d["plan"]["schedule_steps"] == 27
    assert d["trunk"]["state"] == "finished" and d["trunk"]["done"] == 24 and not d["missing"] and not d["grad_missing"]
    t = d["arms"]
    assert set(t) == set(ARMS) - {"A"} and all(v["n"] == 3 for v in t.values())
    assert all(g == 0 for g in t["rerun"]["gaps"].values())  # the CPU's kernels are deterministic
    assert all(g != 0 and math.isfinite(g) for g in t["noise"]["gaps"].values())  # another data order
    for x in ("B", "D", "F"):  # FP8 on the wire moves the loss, a little
        assert all(0 < abs(g) < 0.05 for g in t[x]["gaps"].values()), (x, t[x]["gaps"])
        assert t[x]["fp8_wire"] and t[x]["inside"] == (-0.0025 <= t[x]["ci95"][0] and t[x]["ci95"][1] <= 0.0025)
        assert t[x]["floors"]["rerun"] == [0, 0] and t[x]["floors"]["noise"] == pytest.approx(
            [t["noise"]["mean"] - t["noise"]["half_width"], t["noise"]["mean"] + t["noise"]["half_width"]])
    with open(out / "branches.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * len(ARMS) and {r["fp8_wire"] for r in rows if r["arm"] in ("A", "noise", "rerun")} == {"False"}
    a12 = next(json.loads(p.read_text()) for p in (state / "branches").glob("s000012_A.json"))
    assert a12["steps"] == 3 and a12["held_out_windows"] == 8 and math.isfinite(a12["val_loss"])
    g = d["grad_summary"]["arms"]
    assert list(g) == ["A", "B", "D", "F"] and g["A"]["median_ratio"] == 0
    assert list(g["B"]["median_ratio_per_checkpoint"]) == ["step12", "step18", "step24"]
    assert g["B"]["worst_group"]["group"] in ("expert", "router", "rest") and g["B"]["median_ratio"] > 0
    md = (out / "branch_summary.md").read_text()
    assert "| B | fp8_row | 3 |" in md and "| noise | bf16_order2 | 3 |" in md and "worst group" in md

    # cut: the trunk stops at step 15 (only the checkpoint at 12 exists), then the next command continues
    cut = tmp_path / "cut"
    run_tool(*PLAN, "--workers", "0", "--stop-after", "15", "--state-dir", str(cut), "--out", str(tmp_path / "o1"))
    c = summary(tmp_path / "o1")
    assert c["trunk"]["state"] == "cut" and c["trunk"]["done"] == 15 and (cut / "trunk" / "resume.pt").exists()
    assert {(m["step"], m["arm"]) for m in c["missing"]} == {(s, x) for s in (18, 24) for x in ARMS}
    assert c["grad_missing"] == [18, 24] and "trunk not there yet" in (tmp_path / "o1" / "branch_summary.md").read_text()
    run_tool(*PLAN, "--workers", "0", "--state-dir", str(cut), "--out", str(tmp_path / "o2"))
    c = summary(tmp_path / "o2")
    assert c["trunk"]["state"] == "finished" and not c["missing"]
    for x in t:  # the same numbers as the run never cut, in other processes
        assert c["arms"][x]["gaps"] == t[x]["gaps"], x

    # done: the same command again trains nothing
    before = {p: p.stat().st_mtime_ns for p in (cut / "branches").iterdir()}
    run_tool(*PLAN, "--workers", "0", "--state-dir", str(cut), "--out", str(tmp_path / "o3"))
    assert {p: p.stat().st_mtime_ns for p in (cut / "branches").iterdir()} == before
    # another plan (branch length) in the same state directory is refused
    bad = run_tool(*PLAN[:-1], "--branch-steps", "4", "--workers", "0", "--state-dir", str(cut),
                   "--out", str(tmp_path / "o4"), check=False)
    assert bad.returncode != 0 and "another plan" in bad.stdout + bad.stderr
