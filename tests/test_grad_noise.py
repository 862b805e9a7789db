"""CPU smoke of examples/grad_noise.py (gradient error against minibatch noise, issue 35) on the tiny
model of convergence_megatron.py's smoke: arms A and B (FP8 row wire) on 2 batches at the
initialization; the JSON's layout, arm A's second model gives the reference's gradients exactly
(ratio 0), B's FP8 wire gives a finite positive error, the noise is positive; --merge of two
checkpoints' files, and a finished run's checkpoint (no weights) is refused."""
import functools
import json
import math
import os

import pytest
import torch

from .programs import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "grad_noise.py")
COMMON = ("--device", "cpu", "--tiny", "--threads", "1", "--corpus-bytes", "1000000", "--quiet")


run_tool = functools.partial(run, SCRIPT, timeout=300, check=True)


def test_grad_noise_smoke(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "init.json"
    run_tool(*COMMON, "--arms", "A,B", "--batches", "2", "--out", str(out))
    d = json.loads(out.read_text())
    assert d["tool"] == "grad_noise" and d["batches"] == 2 and d["checkpoint"] is None and d["label"] == "init_seed1"
    assert d["batch"] == d["config"]["batch"] == 4 and set(d["arms"]) == {"A", "B"}
    params = d["params"]
    assert {m["group"] for m in params.values()} == {"expert", "router", "rest"}
    assert all(".experts." in n for n, m in params.items() if m["group"] == "expert")
    assert d["groups"]["all"] == len(params)
    keys = set(params) | {"expert", "router", "rest", "all"}
    assert set(d["noise"]) == keys
    assert d["fp8_wire"] == dict(A=False, B=True)  # B really sent FP8 rows
    noise = [v for vs in d["noise"].values() for v in vs]
    assert len(noise) == 2 * len(keys)
    assert sum(v is not None for v in noise) >= 0.9 * len(noise)  # None: an expert no token reached
    assert all(v > 0 and math.isfinite(v) for v in noise if v is not None)
    for x in ("A", "B"):
        arm = d["arms"][x]
        assert set(arm["error"]) == set(arm["ratio"]) == keys
        assert all(len(v) == 2 for v in arm["ratio"].values())
        for k in keys:  # a ratio exactly where the error and the noise are both defined
            for e, n, r in zip(arm["error"][k], d["noise"][k], arm["ratio"][k]):
                assert (r is None) == (e is None or n is None)
                if r is not None:
                    assert r == pytest.approx(e / n)
    a = [r for v in d["arms"]["A"]["ratio"].values() for r in v if r is not None]
    b = [r for v in d["arms"]["B"]["ratio"].values() for r in v if r is not None]
    assert a and all(r == 0 for r in a)  # the same weights and batch: identical gradients on the CPU
    assert b and all(math.isfinite(r) and r > 0 for r in b)
    s = d["summary"]["arms"]
    assert s["A"]["median_ratio"] == 0 and s["A"]["meets_target"]
    assert 0 < s["B"]["median_ratio"] < math.inf and s["B"]["ratios"] == len(b) - 2 * 4  # per parameter, not groups
    assert s["B"]["worst_group"]["group"] in ("expert", "router", "rest")
    assert s["B"]["worst_group"]["ratio"] == max(g["median_param_ratio"] for g in s["B"]["groups"].values())
    assert s["B"]["meets_target"] == (s["B"]["median_ratio"] <= 0.1)
    assert list(s["B"]["median_ratio_per_checkpoint"]) == ["init_seed1"]

    # --merge: a second checkpoint's file (here the same numbers under another label, arm A only)
    other = dict(d, label="ckpt2", arms={"A": d["arms"]["A"]})
    (tmp_path / "ckpt2.json").write_text(json.dumps(other))
    run_tool("--merge", str(out), str(tmp_path / "ckpt2.json"), "--out", str(tmp_path / "m.json"), "--quiet")
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["checkpoints"] == ["init_seed1", "ckpt2"] and set(m["per_checkpoint"]) == {"init_seed1", "ckpt2"}
    ms = m["summary"]["arms"]
    assert ms["A"]["median_ratio_per_checkpoint"] == {"init_seed1": 0, "ckpt2": 0} and ms["A"]["meets_target"]
    assert ms["B"]["median_ratio"] == pytest.approx(s["B"]["median_ratio"])
    assert ms["B"]["checkpoints_missing"] == ["ckpt2"] and not ms["B"]["meets_target"]  # not measured everywhere
    assert run_tool("--merge", str(out), str(out), "--out", str(tmp_path / "x.json"), check=False).returncode != 0

    # a finished run's checkpoint holds its result, not its weights: refused with the reason
    torch.save(dict(config=d["config"], steps=10, result={}, rows=[]), tmp_path / "done.pt")
    bad = run_tool(*COMMON, "--checkpoint", str(tmp_path / "done.pt"), "--arms", "B", "--batches", "1",
                   "--out", str(tmp_path / "bad.json"), check=False)
    assert bad.returncode != 0 and "not its weights" in bad.stdout + bad.stderr


def test_grad_noise_on_a_checkpoint(tmp_path):
    """The weights of a run convergence_megatron.py cut (--checkpoint-dir), with its configuration and
    the step it reached; arm A's model then holds exactly those weights (ratio 0 again)."""
    pytest.importorskip("megatron.core")
    ck = tmp_path / "ckpt"
    cut = run(os.path.join(ROOT, "examples", "convergence_megatron.py"), "--device", "cpu", "--tiny", "--steps", "100",
              "--arms", "A", "--seed", "2", "--threads", "1", "--corpus-bytes", "1000000", "--quiet",
              "--time-budget", "0.001", "--checkpoint-dir", str(ck), "--out", str(tmp_path / "run"), timeout=300)
    assert cut.returncode == 0, cut.stderr[-4000:]
    out = tmp_path / "ck.json"
    run_tool("--checkpoint", str(ck / "bf16_seed2.pt"), "--device", "cpu", "--threads", "1", "--corpus-bytes",
             "1000000", "--quiet", "--arms", "A", "--batches", "1", "--batch", "2", "--label", "step5",
             "--out", str(out))
    d = json.loads(out.read_text())
    assert d["label"] == "step5" and d["checkpoint_step"] == 5 and d["batch"] == 2
    assert d["config"] == dict(json.loads((tmp_path / "run" / "summary.json").read_text())["config"], batch=2)
    assert d["summary"]["arms"]["A"]["median_ratio"] == 0
