"""CPU smoke of examples/train_convergence.py, run as a program: a tiny byte-level MoE LM trained for
30 steps with the FP8 dispatch forced on (bf16_below_bytes=0) must learn (loss goes down), stay finite,
really send FP8 rows, and start from the same weights as the BF16-dispatch run; --merge combines
seeds. The real experiment runs on a GPU (BENCHMARKS.md)."""
import csv
import functools
import importlib.util
import json
import math
import os
import sys

import pytest

from .programs import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_convergence.py")


run_example = functools.partial(run, SCRIPT, timeout=900, check=True)


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


# ---- examples/convergence_megatron.py (megatron-core GPTModel, arms A-E + noise floor) ------------

MEGATRON_SCRIPT = os.path.join(ROOT, "examples", "convergence_megatron.py")


run_megatron_example = functools.partial(run, MEGATRON_SCRIPT, timeout=600, check=True)


def test_megatron_arms_smoke(tmp_path):
    """CPU, tiny, local spec, no TE: arms A, B and the noise floor in two processes (--jobs 2) for 10
    steps: the CSV's runs and columns, finite falling losses, one initialization, and B really sent
    FP8 rows (row scales) while A and the noise arm did not."""
    pytest.importorskip("megatron.core")
    steps, out = 10, tmp_path / "seed3"
    run_megatron_example("--device", "cpu", "--tiny", "--steps", str(steps), "--arms", "A,B,noise", "--seed", "3",
                         "--jobs", "2", "--threads", "1", "--corpus-bytes", "1000000", "--out", str(out), "--quiet",
                         "--time-budget", "3600")  # the jobs share the parent's deadline; far away here
    with open(out / "convergence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "step", "train_loss", "val_loss"]
    names = {"bf16_seed3": "A", "fp8_row_seed3": "B", "bf16_order2_seed3": "noise"}
    assert set(r["run"] for r in rows) == set(names)
    meta = json.loads((out / "summary.json").read_text())
    assert meta["seed"] == 3 and meta["steps"] == steps and not meta["skipped"]
    assert set(meta["runs"]) == set(names)
    for run, arm in names.items():
        rr = [r for r in rows if r["run"] == run]
        assert [int(r["step"]) for r in rr] == [5, 10]
        train = [float(r["train_loss"]) for r in rr]
        val = [float(r["val_loss"]) for r in rr]
        assert all(math.isfinite(v) for v in train + val), run
        assert train[-1] < math.log(256) and val[-1] < val[0], (run, train, val)  # it learns
        s = meta["runs"][run]
        assert s["arm"] == arm and s["steps"] == steps and not s["truncated"] and math.isfinite(s["final_val_loss"])
        assert s["fp8_wire"] == (arm == "B"), run  # the FP8 arm really dispatched FP8 rows
        assert s["wire_granularity"] == (["row"] if arm == "B" else []), run
        assert s["dispatcher"] == ("fp8_alltoall" if arm == "B" else "allgather")  # alltoall needs CUDA
        assert s["te_fp8"] is None  # no TE here
        loads = s["router_max_load"]  # (step, busiest expert's tokens / mean) at each evaluation
        assert [st for st, _ in loads] == [5, 10] and all(v >= 1.0 for _, v in loads), loads
    assert len({round(s["init_checksum"], 6) for s in meta["runs"].values()}) == 1  # one initialization
    assert set(meta["gaps_vs_bf16"]) == {"fp8_row", "bf16_order2"}


def test_megatron_one_arm_trains_until_the_time_budget(tmp_path):
    """A process with one arm (what each --jobs process gets) does not skip it on a start-up timing:
    it trains until the deadline, and the run is marked truncated (left out of the gaps)."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "seed1"
    run_megatron_example("--device", "cpu", "--tiny", "--steps", "1000", "--arms", "B", "--seed", "1",
                         "--time-budget", "0.001", "--threads", "1", "--corpus-bytes", "1000000", "--out", str(out),
                         "--quiet")
    meta = json.loads((out / "summary.json").read_text())
    assert meta["skipped"] == [] and meta["calibration"] is None
    run = meta["runs"]["fp8_row_seed1"]
    assert run["truncated"] and 0 < run["steps"] < 1000 and math.isfinite(run["final_val_loss"])


def test_megatron_run_continues_from_its_checkpoint(tmp_path):
    """--checkpoint-dir: a run the deadline cuts continues in the next command where it stopped and
    reaches the same losses, step by step, as a run never cut; a finished run is then returned by a
    third command without training (its rows and result as they were)."""
    pytest.importorskip("megatron.core")
    common = ("--device", "cpu", "--tiny", "--steps", "10", "--arms", "B", "--seed", "2", "--threads", "1",
              "--corpus-bytes", "1000000", "--quiet")
    ck, run = tmp_path / "ckpt", "fp8_row_seed2"

    def result(name):
        with open(tmp_path / name / "convergence.csv") as f:
            rows = [(int(r["step"]), float(r["train_loss"]), float(r["val_loss"])) for r in csv.DictReader(f)]
        return rows, json.loads((tmp_path / name / "summary.json").read_text())["runs"][run]

    run_megatron_example(*common, "--out", str(tmp_path / "whole"))
    run_megatron_example(*common, "--out", str(tmp_path / "cut"), "--checkpoint-dir", str(ck), "--time-budget", "0.001")
    cut_rows, cut = result("cut")
    assert cut["truncated"] and cut["steps"] == 5 and [s for s, _, _ in cut_rows] == [5]
    assert (ck / f"{run}.pt").exists()
    run_megatron_example(*common, "--out", str(tmp_path / "resumed"), "--checkpoint-dir", str(ck))
    whole_rows, whole = result("whole")
    rows, resumed = result("resumed")
    assert rows == whole_rows and [s for s, _, _ in rows] == [5, 10]  # the same losses at every log
    assert resumed["final_val_loss"] == whole["final_val_loss"] and not resumed["truncated"]
    assert resumed["steps"] == 10 and resumed["router_max_load"] == whole["router_max_load"]
    assert resumed["fp8_wire"] and resumed["wire_granularity"] == ["row"]
    saved = (ck / f"{run}.pt").read_bytes()  # the finished run's result
    run_megatron_example(*common, "--out", str(tmp_path / "again"), "--checkpoint-dir", str(ck))
    assert result("again") == (rows, resumed) and (ck / f"{run}.pt").read_bytes() == saved  # not trained again
    # another step count cannot continue these runs
    other = run_megatron_example(*common[:4], "12", *common[5:], "--out", str(tmp_path / "other"),
                                 "--checkpoint-dir", str(ck), check=False)
    assert other.returncode != 0 and "another configuration or step count" in other.stdout + other.stderr


def synthetic_seed_dir(path, seed, gaps, steps=3000, checksum=123.0, truncated=()):
    """A per-seed output dir as convergence_megatron.py writes it: arm A's final val loss, and the
    others' at A's times (1 + gap); the arms in `truncated` cut by the deadline at 2/3 of the steps."""
    names = {"A": "bf16", "B": "fp8_row", "C": "fp8_block128", "D": "fp8_experts", "noise": "bf16_order2"}
    ref = 1.0 + 0.01 * seed
    path.mkdir(parents=True)
    runs, rows = {}, []
    for arm, g in gaps.items():
        v = ref * (1 + g)
        run = f"{names[arm]}_seed{seed}"
        fp8 = arm in ("B", "C", "D")
        cut = arm in truncated
        runs[run] = dict(arm=arm, name=names[arm], dispatcher="fp8_alltoall" if fp8 else "alltoall",
                         options={"granularity": "block128" if arm == "C" else "row"} if fp8 else {},
                         steps=steps * 2 // 3 if cut else steps, truncated=cut, ms_per_step=10.0, final_val_loss=v,
                         init_checksum=checksum, fp8_wire=fp8,
                         wire_granularity=(["block128"] if arm == "C" else ["row"]) if fp8 else [],
                         te_fp8=dict(enabled=True, recipe="Float8BlockScaling"))
        rows += [dict(run=run, step=s, train_loss=v + 1000 / s, val_loss=v + 500 / s)
                 for s in (1000, 2000, 3000)[:2 if cut else 3]]
    write_csv(rows, path / "convergence.csv")
    config = dict(layers=4, hidden=512, experts=16, topk=4)
    (path / "summary.json").write_text(json.dumps(dict(seed=seed, steps=steps, config=config, runs=runs)))
    return str(path)


def test_megatron_merge_t_interval(tmp_path):
    """--merge of 5 synthetic seeds (seed 3 split over two dirs, where a complete arm C replaces the
    one the deadline cut, rows and all): the per-seed gaps against arm A of
    the same seed, their mean, sd and 95% t-interval (t(0.975, 4) = 2.776), the noise floor, and the
    target checks (B meets all; C fails |mean| <= 0.25% and the 2x-noise bound)."""
    b = [0.001, -0.001, 0.002, 0.0, 0.0005]
    c = [0.003, 0.0025, 0.0035, 0.002, 0.003]
    noise = [0.0005, -0.0012, 0.0003, 0.0002, -0.0004]
    dirs = []
    for k, seed in enumerate((1, 2, 3, 4, 5)):
        gaps = dict(A=0.0, B=b[k], C=c[k], noise=noise[k])
        cut = ("C",) if seed == 3 else ()  # arm C of seed 3 was cut, then ran again in another session
        dirs.append(synthetic_seed_dir(tmp_path / f"s{seed}", seed, dict(gaps, C=gaps["C"] + 0.05 * bool(cut)),
                                       truncated=cut))
        if cut:
            dirs.append(synthetic_seed_dir(tmp_path / "s3c", seed, dict(C=gaps["C"])))
    out = tmp_path / "merged"
    run_megatron_example("--merge", *dirs, "--out", str(out), "--quiet")
    m = json.loads((out / "convergence_summary.json").read_text())
    with open(out / "convergence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "step", "train_loss", "val_loss"]
    assert {r["run"] for r in rows} >= {"bf16_seed1", "fp8_row_seed5", "fp8_block128_seed3", "bf16_order2_seed2"}
    assert [r["step"] for r in rows if r["run"] == "fp8_block128_seed3"] == ["1000", "2000", "3000"]
    assert m["seeds"] == [1, 2, 3, 4, 5]

    B = m["arms"]["B"]
    assert B["role"] == "target" and B["n"] == 5
    assert [B["gaps"][str(s)] for s in range(1, 6)] == pytest.approx(b, abs=1e-12)
    mean = sum(b) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in b) / 4)
    assert B["mean"] == pytest.approx(0.0005) and B["sd"] == pytest.approx(sd) and sd == pytest.approx(0.001118034)
    assert B["t"] == pytest.approx(2.776, abs=1e-3)
    half = 2.7764 * sd / math.sqrt(5)
    assert B["half_width"] == pytest.approx(half, rel=1e-4) and half == pytest.approx(0.0013882, rel=1e-4)
    assert B["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-4)
    nf = m["noise_floor"]
    assert nf["n"] == 5 and nf["max_abs"] == pytest.approx(0.0012) and nf["mean"] == pytest.approx(sum(noise) / 5)
    assert B["noise_limit"] == pytest.approx(0.0024)
    assert B["checks"] == dict(mean_within=True, ci_within=True, seeds_within_noise=True) and B["meets_targets"]

    C = m["arms"]["C"]
    assert C["mean"] == pytest.approx(0.0028) and C["max_abs"] == pytest.approx(0.0035)
    assert C["checks"] == dict(mean_within=False, ci_within=True, seeds_within_noise=False)
    assert C["meets_targets"] is False
    assert "D" not in m["arms"] and m["verdict"] == "targets NOT met"
    assert all(v for k, v in m["requirements"].items() if isinstance(v, bool)), m["requirements"]
    assert m["requirements"]["seeds_per_arm"] == dict(B=5, C=5, D=0, E=0, F=0, G=0, H=0, noise=5, rerun=0)
    assert m["requirements"]["truncated_runs"] == 0 and m["requirements"]["replaced_runs"] == 1  # seed 3's C
    text = (out / "convergence_summary.txt").read_text()
    assert "+0.050%" in text and "[-0.089%, +0.189%]" in text
    # how flat the curves end: val at step 2000 (the last log at or before 90% of 3000) over the last
    a1 = 1.01 + 500 / 2000, 1.01 + 500 / 3000
    assert m["curves"]["frac"] == 0.1 and m["curves"]["fall"]["bf16_seed1"] == pytest.approx(a1[0] / a1[1] - 1)
    assert len(m["curves"]["fall"]) == m["curves"]["runs"] == len({r["run"] for r in rows})
    assert "over each run's last 10% of steps" in text
    # a resumed run's repeated log keeps its later row; a run that ends on NaN or has one log is left out
    sys.path.insert(0, os.path.dirname(MEGATRON_SCRIPT))
    import convergence_stats
    tail = [dict(run="r", step=s, train_loss=0.0, val_loss=v) for s, v in ((900, 3.0), (1000, 9.0), (1000, 2.0))]
    tail += [dict(run="nan", step=s, train_loss=0.0, val_loss=v) for s, v in ((900, 1.0), (1000, float("nan")))]
    tail += [dict(run="one", step=1000, train_loss=0.0, val_loss=1.0)]
    assert convergence_stats.tail_fall(tail) == {"r": pytest.approx(0.5)}
    if importlib.util.find_spec("matplotlib"):
        assert (out / "convergence.png").stat().st_size > 0

    # Seed 6's arm B was cut (at step 2000 of 3000)
    cut = synthetic_seed_dir(tmp_path / "cut", 6, dict(A=0.0, B=0.001), truncated=("B",))
    # as of step 2000: seed 6's cut arm B counts (its gap then, from the logged val losses), and seed
    # 3's arm C is the complete run that replaced its cut one; rows are v + 500 / s, so gaps shrink
    # by v / (v + 0.25)
    early = run_megatron_example("--merge", *dirs, cut, "--out", str(tmp_path / "early"), "--at-step", "2000",
                                 "--quiet")
    early_doc = json.loads((tmp_path / "early" / "convergence_summary.json").read_text())
    at = early_doc["at_step"]
    ref = {s: 1.0 + 0.01 * s for s in range(1, 7)}
    want = {s: (ref[s] * (1 + b[s - 1]) + 0.25) / (ref[s] + 0.25) - 1 for s in range(1, 6)}
    assert at["step"] == 2000 and at["seeds"] == [1, 2, 3, 4, 5, 6], early.stdout
    assert at["arms"]["B"]["n"] == 6 and at["arms"]["B"]["gaps"]["6"] == pytest.approx(0.001 * 1.06 / 1.31)
    assert [at["arms"]["B"]["gaps"][str(s)] for s in range(1, 6)] == pytest.approx(list(want.values()))
    assert at["arms"]["C"]["gaps"]["3"] == pytest.approx(c[2] * 1.03 / 1.28) and at["noise_floor"]["n"] == 5
    assert "validation loss at step 2000 (the logged subset)" in (tmp_path / "early" / "convergence_summary.txt").read_text()
    assert "6" not in early_doc["arms"]["B"]["gaps"]  # the final table: complete runs only
    # as of step 3000, which seed 6's arm B did not reach: left out
    run_megatron_example("--merge", *dirs, cut, "--out", str(tmp_path / "late"), "--at-step", "3000", "--quiet")
    late = json.loads((tmp_path / "late" / "convergence_summary.json").read_text())["at_step"]
    assert "6" not in late["arms"]["B"]["gaps"] and late["arms"]["B"]["n"] == 5 and late["seeds"] == [1, 2, 3, 4, 5, 6]

    # two seeds: t(0.975, 1) = 12.706; a seed whose arms start from other weights is refused
    two = run_megatron_example("--merge", dirs[0], dirs[1], "--out", str(tmp_path / "two"), "--quiet")
    two_doc = json.loads((tmp_path / "two" / "convergence_summary.json").read_text())
    assert two_doc["arms"]["B"]["t"] == pytest.approx(12.706, abs=1e-3), two.stdout
    assert two_doc["requirements"]["enough_seeds"] is False and "falls short" in two_doc["verdict"]
    # cut runs with nothing to replace them: no gap, no curve, no seed of their own; counted as cut.
    # Seed 6's arm B was cut twice (the longer run stays), seed 7 has only a cut run
    cut_again = synthetic_seed_dir(tmp_path / "cut2", 6, dict(B=0.002), steps=1500, truncated=("B",))
    only_cut = synthetic_seed_dir(tmp_path / "cut3", 7, dict(B=0.0), truncated=("B",))
    three = run_megatron_example("--merge", dirs[0], dirs[1], cut_again, cut, only_cut, "--out", str(tmp_path / "three"),
                                 "--quiet")
    doc = json.loads((tmp_path / "three" / "convergence_summary.json").read_text())
    req = doc["requirements"]
    assert "6" not in doc["arms"]["B"]["gaps"] and req["truncated_runs"] == 3, three.stdout
    assert req["replaced_runs"] == 0 and doc["per_seed"]["6"]["runs"]["B"]["steps"] == 2000
    assert req["seeds_per_arm"]["B"] == 2 and req["min_steps"] == 3000
    text = (tmp_path / "three" / "convergence_summary.txt").read_text()
    assert doc["seeds"] == req["seeds"] == [1, 2, 6] and "seed 6" in text and "seed 7" not in text
    assert "fp8_row_seed6" not in doc["curves"]["fall"] and "bf16_seed6" in doc["curves"]["fall"]
    odd = synthetic_seed_dir(tmp_path / "odd", 9, dict(A=0.0), checksum=1.0)
    odd_b = synthetic_seed_dir(tmp_path / "odd_b", 9, dict(B=0.001), checksum=2.0)
    done = run_megatron_example("--merge", odd, odd_b, "--out", str(tmp_path / "bad"), check=False)
    assert done.returncode != 0 and "different weights" in done.stderr
    # the same arm complete in two dirs: refused, not picked
    twice = run_megatron_example("--merge", dirs[0], dirs[0], "--out", str(tmp_path / "twice"), check=False)
    assert twice.returncode != 0 and "appears twice" in twice.stderr
