"""CPU smoke of examples/train_convergence.py, run as a program: a tiny byte-level MoE LM trained for
30 steps with the FP8 dispatch forced on (bf16_below_bytes=0) must learn (loss goes down), stay finite,
really send FP8 rows, and start from the same weights as the BF16-dispatch run; --merge combines
seeds. The real experiment runs on a GPU (BENCHMARKS.md)."""
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_convergence.py")


def run_example(*args):
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_training_with_fp8_dispatch_converges(tmp_path):
    steps = 30
    run_example("--device", "cpu", "--tiny", "--steps", str(steps), "--runs", "bf16,fp8_row,fp8_block128,fp8_row_fp8mlp",
                "--out", str(tmp_path), "--corpus-bytes", "1000000", "--log-every", "5", "--no-plot", "--quiet")
    meta = json.loads((tmp_path / "convergence_summary.json").read_text())
    with open(tmp_path / "convergence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "step", "train_loss", "val_loss"]
    assert meta["same_init"] and meta["compared_at_step"] == steps
    for run in ("bf16", "fp8_row", "fp8_block128", "fp8_row_fp8mlp"):
        rr = [r for r in rows if r["run"] == run]
        assert [int(r["step"]) for r in rr] == list(range(5, steps + 1, 5))
        train = [float(r["train_loss"]) for r in rr]
        val = [float(r["val_loss"]) for r in rr]
        assert all(math.isfinite(v) for v in train + val), run
        # uniform bytes cost ln(256) = 5.55 nats; 30 steps get well below
        assert train[-1] < train[0] - 0.5 and val[-1] < val[0] - 0.5 and val[-1] < 4.5, (run, train, val)
        s = meta["runs"][run]
        assert s["steps"] == steps and not s["truncated"]
        assert s["fp8_wire"] == (run != "bf16"), run  # the FP8 runs really sent FP8 rows
        assert abs(s["rel_to_bf16"]) < 0.05, (run, s["rel_to_bf16"])  # a loose bound at 30 steps


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_merge_seeds(tmp_path):
    """--merge: the first dir's runs keep their names, the others get _seed<N>; each run is compared with
    the bf16 run of its own seed, then averaged over the seeds."""
    final = {1: dict(bf16=1.0, fp8_row=1.004), 5: dict(bf16=1.02, fp8_row=1.02 * 0.998)}
    dirs = []
    for seed, losses in final.items():
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        rows = [dict(run=n, step=s, train_loss=v + 1 / s, val_loss=v + 2 / s) for n, v in losses.items()
                for s in (10, 20, 30)]
        write_csv(rows, d / "convergence.csv")
        runs = {n: dict(steps=30, final_val_loss_full=v) for n, v in losses.items()}
        (d / "convergence_summary.json").write_text(json.dumps(dict(config=dict(seed=seed), steps=30, runs=runs)))
        dirs.append(str(d))
    out = tmp_path / "merged"
    run_example("--merge", *dirs, "--out", str(out))
    with open(out / "convergence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "step", "train_loss", "val_loss"]
    assert list(dict.fromkeys(r["run"] for r in rows)) == ["bf16", "fp8_row", "bf16_seed5", "fp8_row_seed5"]
    assert [int(r["step"]) for r in rows if r["run"] == "fp8_row_seed5"] == [10, 20, 30]
    on_disk = json.loads((out / "convergence_summary.json").read_text())
    assert on_disk["seeds"] == [1, 5] and on_disk["per_seed"]["5"]["run_suffix"] == "_seed5"
    v = on_disk["variants"]["fp8_row"]
    assert v["rel_to_bf16"]["1"] == pytest.approx(0.004) and v["rel_to_bf16"]["5"] == pytest.approx(-0.002)
    assert v["mean_rel_to_bf16"] == pytest.approx(0.001) and v["within_target_mean"] is True
    assert on_disk["bf16_seed_spread"]["max_over_min"] == pytest.approx(0.02)
    if importlib.util.find_spec("matplotlib"):
        assert (out / "convergence.png").stat().st_size > 0
