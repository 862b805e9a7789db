"""fp8a2a's FP8 experts (fp8_experts_spec / --fp8a2a-experts fp8) against Megatron's SequentialMLP on
CPU (megatron-core 0.16.1, local spec, world size 1): the same state_dict and sharded_state_dict, a
distributed checkpoint (torch_dist) saved with either loading into the other, and
gradient_accumulation_fusion (weight gradients added into main_grad, no .grad).

Run as a program (`python -m tests.test_megatron_checkpoint DIR`), the round trip of
test_dist_checkpoint_loads_across_expert_implementations: Megatron's checkpoint writer starts
processes of its own, which the daemonic ranks of tests/distributed.py may not."""
import os
import sys
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

import fp8a2a.megatron as fm  # noqa: E402

from . import test_megatron as tm  # noqa: E402
from .distributed import run_ranks  # noqa: E402



@pytest.fixture(autouse=True, scope="module")
def registered():
    fm.register()
    yield
    fm.unregister()


needs_fp8_experts = pytest.mark.skipif(not tm.HAVE_FP8_EXPERTS, reason="fp8a2a.experts is not in this tree")


def _layers(**over):
    """(Megatron's MoE layer, the same with fp8a2a's FP8 experts), differently initialized."""
    torch.manual_seed(0)
    meg = tm.build(tm.moe_spec(8, False), tm.make_config(fm.FP8_ALLTOALL, **over))
    torch.manual_seed(1)
    fp8 = tm.build(tm.moe_spec(8, True), tm.make_config(fm.FP8_ALLTOALL, **over))
    assert type(meg.experts).__name__ == "SequentialMLP" and type(fp8.experts).__name__ == "FP8SequentialMLP"
    return meg, fp8


def _describe(sharded):
    """What a checkpoint records of each entry of a sharded_state_dict."""
    out = {}
    for k, v in sharded.items():
        out[k] = (type(v).__name__, v.key, getattr(v, "replica_id", None),
                  *(tuple(getattr(v, a, None) or ()) for a in ("global_shape", "global_offset", "local_shape",
                                                               "axis_fragmentations")),
                  tuple(v.data.shape) if isinstance(getattr(v, "data", None), torch.Tensor) else None)
    return out


def _tensors(module):
    return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _same_tensors(a, b):
    ta, tb = _tensors(a), _tensors(b)
    return list(ta) == list(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def _state_dicts_in_child(rank, world):
    tm.init_parallel(world)
    try:
        meg, fp8 = _layers()
        assert [(n, p.shape, p.dtype) for n, p in meg.named_parameters()] == \
            [(n, p.shape, p.dtype) for n, p in fp8.named_parameters()]
        assert list(meg.state_dict()) == list(fp8.state_dict())
        assert _describe(meg.sharded_state_dict(prefix="mlp.")) == _describe(fp8.sharded_state_dict(prefix="mlp."))
        assert not _same_tensors(meg, fp8)
        for src, dst in ((meg, fp8), (fp8, meg)):  # strict, both ways
            torch.manual_seed(2)
            with torch.no_grad():
                for p in src.parameters():
                    p.normal_()
            dst.load_state_dict(src.state_dict(), strict=True)
            assert _same_tensors(src, dst)
        return True
    finally:
        tm.ps.destroy_model_parallel()


@needs_fp8_experts
def test_state_dict_and_sharded_state_dict_match_megatrons_experts():
    assert run_ranks(1, _state_dicts_in_child) == [True]


def round_trip(tmp):
    """Saves each layer's sharded_state_dict (torch_dist) and loads it into the other; True when the
    parameters then agree (run in a non-daemonic process: the writer forks)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from fp8a2a.megatron.standalone import world_of_one

    if not torch.cuda.is_available():  # megatron-core 0.16's writer on a CPU-only torch, without psutil
        torch.cuda.synchronize = lambda *a: None
        filesystem_async._process_memory = lambda: 0
    fm.register()
    teardown = world_of_one()
    try:
        meg, fp8 = _layers()
        results = []
        for i, (src, dst) in enumerate(((fp8, meg), (meg, fp8))):
            torch.manual_seed(10 + i)
            with torch.no_grad():
                for p in src.parameters():
                    p.normal_()
            assert not _same_tensors(src, dst)
            path = os.path.join(tmp, f"ckpt{i}")
            os.makedirs(path)
            dist_checkpointing.save(src.sharded_state_dict(prefix="mlp."), path)
            loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix="mlp."), path)
            dst.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
            results.append(_same_tensors(src, dst))
        return results
    finally:
        teardown()


@needs_fp8_experts
def test_dist_checkpoint_loads_across_expert_implementations():
    """A torch_dist checkpoint saved with fp8a2a's experts loads into Megatron's, and the other way."""
    from .programs import run
    with tempfile.TemporaryDirectory() as tmp:
        r = run("-m", "tests.test_megatron_checkpoint", tmp, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "round trip: [True, True]" in r.stdout, r.stdout + r.stderr[-4000:]


# ---- gradient_accumulation_fusion --------------------------------------------------------------

def _backward(layer, x, gy):
    y, _ = layer(x.clone().requires_grad_())
    y.backward(gy)


def _fusion_in_child(rank, world, ddp):
    tm.init_parallel(world)
    try:
        _, layer = _layers(fp8a2a_bf16_below_bytes=tm.RAW)
        experts = [p for n, p in layer.named_parameters() if ".local_experts." in n]
        g = torch.Generator().manual_seed(5)
        batches = [(torch.randn(6, 2, 128, generator=g), torch.randn(6, 2, 128, generator=g)) for _ in range(2)]
        unfused = []
        for x, gy in batches:  # the unfused path, one micro-batch at a time
            layer.zero_grad(set_to_none=True)
            _backward(layer, x, gy)
            unfused.append({p: p.grad.clone() for p in experts})
        # fused (set after construction: Megatron's ColumnParallelLinear refuses it without APEX, and
        # these experts never call it)
        layer.zero_grad(set_to_none=True)
        layer.config.gradient_accumulation_fusion = True
        for p in experts:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            if ddp:
                p.grad_added_to_main_grad = False
        for x, gy in batches:
            _backward(layer, x, gy)
        for p in experts:
            want = unfused[0][p].float() + unfused[1][p].float()
            assert torch.equal(p.main_grad, want), (p.main_grad - want).abs().max()
            if ddp:  # a placeholder .grad (DDP's hook drops it), and the flag its hook reads
                assert p.grad_added_to_main_grad is True and p.grad is not None
            else:
                assert p.grad is None
        # the other parameters (the router) are Megatron's: untouched by the fusion
        assert all(p.grad is not None for n, p in layer.named_parameters() if ".local_experts." not in n)
        return True
    finally:
        tm.ps.destroy_model_parallel()


@needs_fp8_experts
@pytest.mark.parametrize("ddp", [False, True], ids=["main_grad", "ddp_flag"])
def test_gradient_accumulation_fusion_adds_into_main_grad(ddp):
    """Two micro-batches under gradient_accumulation_fusion: each expert weight's main_grad (float32)
    holds exactly the sum of the unfused gradients, and no .grad is made (under DDP's
    grad_added_to_main_grad: a placeholder, the flag set, as Megatron's linears do)."""
    assert run_ranks(1, _fusion_in_child, ddp) == [True]


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print("round trip:", round_trip(sys.argv[1]), flush=True)
