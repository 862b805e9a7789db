"""Megatron's own training loop (megatron.training.pretrain: megatron-core 0.19's wheel) with the
flag, as a user runs it: `python -m fp8a2a.megatron.run tests/gpu/pretrain_gpt_mock.py` (a small
GPT-MoE from Megatron's flags, TE spec, grouped GEMM, permute fusion, mock data) with
`--moe-token-dispatcher-type fp8_alltoall`, each expert implementation (--fp8a2a-experts megatron:
TE's grouped experts on dequantized rows; fp8: fp8a2a's FP8 experts), in BF16 and under TE's FP8
blockwise recipe, beside the same runs with Megatron's `alltoall`. One process per run, all at
once (the GPU has room; the checks are not about time).

Each run must finish its iterations with finite losses and no skipped or NaN iteration, build the
layers the flags ask for (dispatcher, experts, wire granularity), learn (its last losses below its
first), and end near the `alltoall` run of its precision (same seed and data): the mean loss of the
last iterations within 10% of the first loss apart, a bound for "the same training", not for FP8
error.

    python -m pytest tests/gpu/test_megatron_training.py -m gpu -q
"""
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.gpu]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DRIVER = os.path.join(ROOT, "tests", "gpu", "pretrain_gpt_mock.py")
ITERS = 30
MODEL = ("--num-layers 2 --hidden-size 512 --ffn-hidden-size 512 --num-attention-heads 8 --seq-length 512 "
         "--max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 4 --num-experts 8 "
         "--moe-router-topk 2 --moe-grouped-gemm --moe-permute-fusion --swiglu --disable-bias-linear "
         "--moe-aux-loss-coeff 1e-2 --bf16 --lr 1e-3 --lr-decay-style constant --seed 1234 "
         f"--train-iters {ITERS} --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
         # no evaluation; megatron.training 0.19 has no default --eval-interval and divides by it
         "--eval-iters 0 --eval-interval 1000000").split()
BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
# name: (flags, dispatcher class, experts class, wire granularity)
RUNS = {
    "alltoall-bf16": (["--moe-token-dispatcher-type", "alltoall"], "MoEAlltoAllTokenDispatcher", "TEGroupedMLP", None),
    "alltoall-blockwise": (["--moe-token-dispatcher-type", "alltoall", *BLOCKWISE],
                           "MoEAlltoAllTokenDispatcher", "TEGroupedMLP", None),
}
for _experts, _cls in (("megatron", "TEGroupedMLP"), ("fp8", "FP8TEGroupedMLP")):
    for _prec, _extra in (("bf16", []), ("blockwise", BLOCKWISE)):
        _granularity = "block128" if (_experts, _prec) == ("megatron", "blockwise") else "row"
        RUNS[f"{_experts}-{_prec}"] = (["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-experts", _experts,
                                        *_extra], "FP8AlltoAllTokenDispatcher", _cls, _granularity)
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*? lm loss: ([-+.\dEeNnAaIiFf]+) \|")


def _have(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gradient_accumulation_flags():
    """Megatron's own output layer needs APEX's fused kernel for gradient_accumulation_fusion."""
    return [] if _have("fused_weight_gradient_mlp_cuda") else ["--no-gradient-accumulation-fusion"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit status, log text)}: every run of RUNS, launched together."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for module in ("megatron.training", "transformer_engine"):
        if not _have(module):
            pytest.skip(f"{module} is not importable")
    logs = tmp_path_factory.mktemp("training")
    procs = {}
    for name, (flags, *_) in RUNS.items():
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": os.pathsep.join(
                   p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        log = open(logs / f"{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, "-m", "fp8a2a.megatron.run", DRIVER, *MODEL, *flags,
                                         *gradient_accumulation_flags()], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT), log)
    out, deadline = {}, time.monotonic() + 180  # one deadline for all: the runs go at once
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        out[name] = (rc, (logs / f"{name}.log").read_text())
    return out


def losses(text):
    return {int(m.group(1)): float(m.group(3)) for m in ITERATION.finditer(text)}


@pytest.mark.parametrize("name", list(RUNS))
def test_training_run(runs, name):
    rc, text = runs[name]
    assert rc == 0, f"{name}: exit {rc}\n{text[-6000:]}"
    _, dispatcher, experts, granularity = RUNS[name]
    layers = json.loads(re.search(r"^fp8a2a-layers: (.*)$", text, re.M).group(1))
    assert len(layers) == 2 and all(layer == {"dispatcher": dispatcher, "experts": experts,
                                              "granularity": granularity} for layer in layers), layers
    loss = losses(text)
    assert sorted(loss) == list(range(1, ITERS + 1)), sorted(loss)
    assert all(math.isfinite(v) for v in loss.values()), loss
    assert not re.search(r"number of (skipped|nan) iterations:\s*[1-9]", text)
    assert sum(loss[i] for i in range(ITERS - 4, ITERS + 1)) / 5 < loss[1], loss  # it learns


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("alltoall")])
def test_training_follows_alltoall(runs, name):
    reference = "alltoall-" + name.split("-", 1)[1]
    (rc, text), (ref_rc, ref_text) = runs[name], runs[reference]
    if rc != 0 or ref_rc != 0:
        pytest.skip("a run failed (test_training_run says why)")
    mine, ref = losses(text), losses(ref_text)
    last = range(ITERS - 4, ITERS + 1)
    gap = abs(sum(mine[i] for i in last) - sum(ref[i] for i in last)) / 5
    assert gap <= 0.1 * ref[1], (f"{name}: last losses {[mine[i] for i in last]} against {reference}'s "
                                 f"{[ref[i] for i in last]}")
