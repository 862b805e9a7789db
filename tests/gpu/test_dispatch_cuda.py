"""Dispatch on one GPU: the CPU scenarios on CUDA (no process group, and NCCL at world size 1),
capacity mode without host syncs, and a captured dispatch -> experts -> combine step replayed
from a CUDA graph. Marked gpu (skipped without CUDA). On one GPU:

    python -m pytest tests/gpu/test_dispatch_cuda.py -m gpu -q
"""
import gc
import importlib.util
import os
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fp8a2a
from fp8a2a.bench import capture_cuda_graph

from ..test_dispatch import BASE, CASES, TRAIN_BASE, TRAIN_CASES, cases_for_world, make_inputs, scenario, training_step

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# The world-size-1 cases, less those about other ranks (an empty rank, a rank receiving nothing) and
# those covered below (capacity drops, hidden 7168); test_dispatch_nccl.py runs every case over NCCL.
WORLD_ONE = {n: c for n, c in cases_for_world(1).items()
             if n not in ("empty_rank", "receives_nothing", "capacity_with_drops", "hidden7168")}


@pytest.mark.parametrize("name", list(WORLD_ONE))
def test_scenarios_on_cuda(name):
    scenario(0, 1, {**WORLD_ONE[name], "device": "cuda"})


def test_large_hidden_on_cuda():
    scenario(0, 1, {**BASE, "hidden": 7168, "tokens": 512, "experts": 64, "topk": 8, "device": "cuda"})


@pytest.mark.parametrize("name", ["uniform", "k8_e16", "block128", "bf16_fallback", "capacity_with_drops"])
def test_nccl_world_size_one(nccl_world_of_one, name):
    assert not fp8a2a.Dispatcher(8, always_communicate=True).local  # the NCCL all_to_all path really runs
    scenario(0, 1, {**BASE, **CASES[name], "device": "cuda", "always_communicate": True})


def _capacity_step(d, x, idx, w):
    out = d.dispatch(x, idx, w)
    h = out.dequantized(torch.bfloat16) * 2  # a stand-in expert
    return d.combine(h, out.handle), out.handle.dropped


# (tokens, hidden, experts, top-k): 1024 slots take the one-launch drop and the self-routed pack;
# 8192 and 32768 (the benchmark's ws1-4096 point) the sorted drop and the layout + scan + pack chain.
GRAPH_SHAPES = [(256, 1024, 32, 4), (1024, 512, 64, 8), (4096, 7168, 256, 8)]


@pytest.mark.parametrize("shape", GRAPH_SHAPES, ids=lambda s: f"{s[0] * s[3]}slots")
@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "local"])
def test_capacity_mode_has_no_host_sync_and_replays_from_a_cuda_graph(nccl_world_of_one, shape, nccl):
    tokens, hidden, experts, topk = shape
    xs, idxs, ws = make_inputs(1, tokens, hidden, experts, topk, torch.bfloat16, routing="skewed")
    x, idx, w = xs[0].cuda(), idxs[0].cuda(), ws[0].cuda()
    d = fp8a2a.Dispatcher(experts, capacity_factor=1.0, always_communicate=nccl)
    assert d.local != nccl
    eager, dropped = _capacity_step(d, x, idx, w)  # the first call per shape validates (one sync)
    assert int(dropped) > 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync now raises
    try:
        again, _ = _capacity_step(d, x, idx, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(eager, again)

    # Capture one step on static buffers, replay it on new values, twice (the second replay reuses
    # the graph's memory as it was left).
    sx, sidx, sw = x.clone(), idx.clone(), w.clone()
    graph, (static_y, static_dropped) = capture_cuda_graph(lambda: _capacity_step(d, sx, sidx, sw))
    for seed in (7, 8):
        xs2, idxs2, ws2 = make_inputs(1, tokens, hidden, experts, topk, torch.bfloat16, routing="skewed", seed=seed)
        sx.copy_(xs2[0].cuda()), sidx.copy_(idxs2[0].cuda()), sw.copy_(ws2[0].cuda())
        graph.replay()
        expected, expected_dropped = _capacity_step(d, xs2[0].cuda(), idxs2[0].cuda(), ws2[0].cuda())
        torch.cuda.synchronize()
        assert torch.equal(static_y, expected)
        assert int(static_dropped) == int(expected_dropped) > 0


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_training_step_gradients_on_cuda(name):
    """The training step's x.grad, topk_weights.grad and expert rows' gradient against float64 on
    the GPU (combine_backward_rows' CUDA kernel), and its backward without a host sync."""
    training_step(0, 1, {**TRAIN_BASE, **TRAIN_CASES[name], "device": "cuda"})
    training_step(0, 1, {**TRAIN_BASE, **TRAIN_CASES[name], "device": "cuda", "hidden": 7168, "tokens": 40})


def test_benchmark_graph_rows_hold_their_inputs():
    """bench_dispatch builds every point's graph before it times any: a replay must hold the step's
    static inputs, or their memory, freed, goes to the next point's tensors under the graph."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dispatch.py"
    spec = importlib.util.spec_from_file_location("bench_dispatch", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def make_step():  # the step's closure holds the only reference to its input
        x = torch.arange(8.0, device="cuda")
        return (lambda: x * 2), weakref.ref(x)
    step, alive = make_step()
    replay = bench.graph_of(step, cuda=True)
    del step
    gc.collect()
    assert alive() is not None
    _, y = replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(8.0, device="cuda") * 2)


def test_default_mode_syncs_once_per_dispatch():
    xs, idxs, ws = make_inputs(1, 128, 512, 16, 2, torch.bfloat16)
    d = fp8a2a.Dispatcher(16, bf16_below_bytes=0)
    x, idx, w = xs[0].cuda(), idxs[0].cuda(), ws[0].cuda()
    d.combine(d.dispatch(x, idx, w).dequantized(), d.dispatch(x, idx, w).handle)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = d.dispatch(x, idx, w)
        d.combine(out.dequantized(), out.handle)
        syncs = [c for c in caught if "synchroniz" in str(c.message)]
    torch.cuda.set_sync_debug_mode("default")
    assert len(syncs) == 1, [str(c.message) for c in syncs]


def test_inputs_on_the_wrong_device_raise_before_any_collective(nccl_world_of_one):
    """Issue 19: a CPU tensor handed to a Dispatcher on an NCCL group raises (NCCL moves CUDA tensors
    only), as does a mix of devices, in dispatch and in combine; the Dispatcher then still works."""
    d = fp8a2a.Dispatcher(8, always_communicate=True)
    assert not d.local
    xs, idxs, ws = make_inputs(1, 16, 64, 8, 2, torch.bfloat16)
    x, idx, w = xs[0].cuda(), idxs[0].cuda(), ws[0].cuda()
    with pytest.raises(ValueError, match=r"\(NCCL\) needs CUDA tensors"):
        d.dispatch(xs[0], idxs[0], ws[0])
    with pytest.raises(ValueError, match="one device"):
        d.dispatch(x, idxs[0], w)
    out = d.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="expert_out is on cpu"):
        d.combine(out.dequantized().cpu(), out.handle)
    y = d.combine(out.dequantized(), out.handle)
    assert y.is_cuda and torch.isfinite(y.float()).all()
