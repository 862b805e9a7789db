"""The dispatch scenarios of tests/test_dispatch.py on every rank of a torchrun job: NCCL with one
GPU per rank, or gloo on CPU (the backend follows the device); plus a capacity-mode dispatch ->
experts -> combine step captured in a CUDA graph on every rank and replayed (marked gpu). Each rank
runs pytest; each test's outcome is agreed on by all ranks (an all-reduce), so a failure on one
rank fails the test on every rank and the ranks stay in step.

    torchrun --standalone --nproc-per-node 8 -m pytest tests/gpu/test_dispatch_nccl.py -q -p no:cacheprovider
    torchrun --standalone --nproc-per-node 4 -m pytest tests/gpu/test_dispatch_nccl.py -q -p no:cacheprovider \\
        -k expert_tp                                # EP = 2 x expert-TP = 2 only
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node 2 -m pytest tests/gpu/test_dispatch_nccl.py -q \\
        -p no:cacheprovider                         # on CPU: gloo (tests/test_dispatch.py runs this)

Every scenario of tests/test_dispatch.py.CASES is an item; those the world size does not allow
(expert TP 2 on an odd world) are skipped; the world size must divide 8 (the
scenarios' expert counts). Under plain pytest (no torchrun environment) the module
is skipped: tests/test_dispatch.py runs the scenarios on forked gloo ranks, test_dispatch_cuda.py at
world size 1 on CUDA. With CUDA, each rank needs a GPU of its own.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import fp8a2a
from fp8a2a.bench import capture_cuda_graph

from ..test_dispatch import CASES, cases_for_world, make_inputs, scenario

UNDER_TORCHRUN = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.skipif(
    not UNDER_TORCHRUN, reason="launch under torchrun: torchrun --standalone --nproc-per-node N -m pytest "
                               "tests/gpu/test_dispatch_nccl.py (see the module docstring)")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
    if CUDA:
        if torch.cuda.device_count() < local_world:
            pytest.skip(f"{local_world} ranks on this host but {torch.cuda.device_count()} CUDA devices: one per "
                        "rank (CUDA_VISIBLE_DEVICES= runs the scenarios on CPU, over gloo)")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if CUDA else "gloo", timeout=datetime.timedelta(seconds=180))
    yield dist.get_rank()
    dist.destroy_process_group()


def on_every_rank(check):
    """Runs check() on this rank; the test fails on every rank if it failed on any."""
    error = None
    try:
        check()
    except Exception as e:  # noqa: BLE001 - agreed on by all ranks below, then raised
        error = e
    ok = torch.tensor([0 if error else 1], device=DEVICE)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        pytest.fail("failed on another rank (its output has the error)", pytrace=False)


@pytest.mark.parametrize("name", list(CASES))
def test_scenario(process_group, name):
    cfg = cases_for_world(WORLD).get(name)
    if cfg is None:
        pytest.skip(f"expert TP {CASES[name]['tp']} does not divide the world size {WORLD}")
    on_every_rank(lambda: scenario(process_group, WORLD, {**cfg, "device": DEVICE}))


@pytest.mark.gpu
def test_capacity_mode_graph_replay(process_group):
    """Capacity mode on every rank: capture one step, replay it on new inputs, compare with eager."""
    rank = process_group

    def check():
        d = fp8a2a.Dispatcher(8 * WORLD, capacity_factor=1.0)
        step_inputs = [make_inputs(WORLD, 256, 1024, 8 * WORLD, 4, torch.bfloat16, "skewed", seed=s) for s in (0, 1)]
        sx, sidx, sw = (t[rank].cuda() for t in step_inputs[0])

        def step():
            out = d.dispatch(sx, sidx, sw)
            return d.combine(out.dequantized() * 2, out.handle)

        step()  # validates the shape once (the only sync of capacity mode)
        graph, y = capture_cuda_graph(step)
        for src, dst in zip((t[rank].cuda() for t in step_inputs[1]), (sx, sidx, sw)):
            dst.copy_(src)
        graph.replay()
        expected = step()
        torch.cuda.synchronize()
        assert torch.equal(y, expected), "graph replay differs from eager"
    on_every_rank(check)
