"""CPU smoke of scripts/train_convergence.py: a tiny byte-level MoE LM trained for 30 steps with the
FP8 dispatch forced on (bf16_below_bytes=0) must learn (loss goes down) and stay finite, and start
from the same weights as the BF16-dispatch run. The real experiment runs on a GPU (BENCHMARKS.md)."""
import csv
import importlib.util
import json
import math
import os

import pytest
import torch

import fp8a2a

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tc():
    spec = importlib.util.spec_from_file_location("train_convergence", os.path.join(ROOT, "scripts",
                                                                                     "train_convergence.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fp8_dispatch_is_really_used(tc):
    cfg = tc.Config(**tc.TINY)
    train, val, _ = tc.load_corpus(max_bytes=1_000_000)
    batches = tc.Batches(train, val, cfg, 2, torch.device("cpu"))
    for name, quantized in (("bf16", False), ("fp8_row", True), ("fp8_block128", True)):
        run = tc.Run(name, cfg, torch.device("cpu"), batches, 2)
        moe = run.model.blocks[0].moe
        x = torch.randn(cfg.batch * cfg.seq, cfg.d_model).to(torch.bfloat16)
        idx = torch.randint(0, cfg.experts, (x.shape[0], cfg.topk))
        out = moe.dispatcher.dispatch(x, idx, torch.full(idx.shape, 0.5))
        assert isinstance(out.tokens, fp8a2a.QuantizedTensor) == quantized, name


def test_training_with_fp8_dispatch_converges(tc, tmp_path):
    steps = 30
    meta = tc.main(["--device", "cpu", "--tiny", "--steps", str(steps), "--runs", "bf16,fp8_row,fp8_row_fp8mlp",
                    "--out", str(tmp_path), "--corpus-bytes", "1000000", "--log-every", "5", "--no-plot", "--quiet"])
    with open(tmp_path / "convergence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["run", "step", "train_loss", "val_loss"]
    summary = json.loads((tmp_path / "convergence_summary.json").read_text())
    assert summary["same_init"] and summary["compared_at_step"] == steps
    for run in ("bf16", "fp8_row", "fp8_row_fp8mlp"):
        rr = [r for r in rows if r["run"] == run]
        assert [int(r["step"]) for r in rr] == list(range(5, steps + 1, 5))
        train = [float(r["train_loss"]) for r in rr]
        val = [float(r["val_loss"]) for r in rr]
        assert all(math.isfinite(v) for v in train + val), run
        # uniform bytes cost ln(256) = 5.55 nats; 30 steps get well below
        assert train[-1] < train[0] - 0.5 and val[-1] < val[0] - 0.5 and val[-1] < 4.5, (run, train, val)
        s = meta["runs"][run]
        assert s["steps"] == steps and not s["truncated"]
        assert abs(s["rel_to_bf16"]) < 0.05, (run, s["rel_to_bf16"])  # a loose bound at 30 steps


def test_merge_seeds(tc, tmp_path):
    """--merge: the first dir's runs keep their names, the others get _seed<N>; each run is compared with
    the bf16 run of its own seed, then averaged over the seeds."""
    final = {1: dict(bf16=1.0, fp8_row=1.004), 5: dict(bf16=1.02, fp8_row=1.02 * 0.998)}
    dirs = []
    for seed, losses in final.items():
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        rows = [dict(run=n, step=s, train_loss=v + 1 / s, val_loss=v + 2 / s) for n, v in losses.items()
                for s in (10, 20, 30)]
        tc.write_csv(rows, d / "convergence.csv")
        runs = {n: dict(steps=30, final_val_loss_full=v) for n, v in losses.items()}
        (d / "convergence_summary.json").write_text(json.dumps(dict(config=dict(seed=seed), steps=30, runs=runs)))
        dirs.append(str(d))
    out = tmp_path / "merged"
    merged = tc.main(["--merge", *dirs, "--out", str(out)])
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
    assert merged["variants"]["fp8_row"]["mean_rel_to_bf16"] == pytest.approx(0.001)
    if importlib.util.find_spec("matplotlib"):
        assert (out / "convergence.png").stat().st_size > 0
