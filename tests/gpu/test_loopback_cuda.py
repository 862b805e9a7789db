"""The loopback group on one GPU: its links move the right bytes, and dispatchers on it give what
they give at world size 1. Marked gpu (skipped without CUDA). On one GPU:

    python -m pytest tests/gpu/test_loopback_cuda.py -m gpu -q

Each test makes the loopback world torch.distributed's default group in this process (a forked
child cannot use CUDA), and tears it down."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from fp8a2a import loopback

from ..test_loopback import (WIRES, _maps, fp8a2a_step, make_routing, megatron_inputs, megatron_step)

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def world(n, rank, **kw):
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized by another test in this process")
    torch.cuda.set_device(0)
    loopback.init(n, rank=rank, **kw)
    try:
        yield loopback.world()
    finally:
        loopback.destroy()


def _uneven(n, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.randint(0, 40, (n,), generator=g)]


@pytest.mark.parametrize("link", ["none", "device", "pcie"])
@pytest.mark.parametrize("chunk", [None, 4096 + 16])
def test_links_move_the_right_bytes(link, chunk):
    """Uneven splits, several dtypes and shapes, 12 calls back to back without a sync (the pcie
    staging buffer is reused across calls), inputs freed before the bytes land: every output equals
    its input (what the symmetric model receives), as link 'none' gives it."""
    n, rank = 8, 3
    with world(n, rank, link=link, pcie_chunk_bytes=chunk):
        outs, want = [], []
        for i in range(12):
            splits = _uneven(n, rank, i)
            dtype = (torch.uint8, torch.bfloat16, torch.float32)[i % 3]
            x = torch.randn(sum(splits), 7168 // (1 + i % 3) + 1, device="cuda").mul(100).to(dtype)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x, splits, splits)
            want.append(x.clone())
            outs.append(y)
            del x  # the link must keep the send buffer alive until its copies ran
        torch.cuda.synchronize()
        for i, (y, x) in enumerate(zip(outs, want)):
            assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)), (link, i)


def test_two_level_topology_mixes_links():
    n, rank = 16, 9
    with world(n, rank, topology=loopback.two_level(8)):
        splits = [1000 + 37 * j for j in range(n)]
        x = torch.randint(0, 255, (sum(splits), 1024), dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, splits, splits)
        assert torch.equal(x, y)
        by = loopback.bytes_over_links(splits, 1024)
        assert set(by) == {"self", "device", "pcie"}


def test_measure_link_reports_bandwidth():
    for link in ("device", "pcie"):
        m = loopback.measure_link(link, 64 << 20, iters=3)
        assert m["gbps_each_way"] > 1 and not m["functional_only"], m


@pytest.mark.parametrize("wire", ["fp8", "bf16", "fp8_all"])
def test_fp8a2a_on_loopback_equals_world_size_1(wire):
    n, E = 8, 64
    x, idx, w, grad = make_routing(512, 1024, E, 8, torch.float32)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    ref = fp8a2a_step(x, idx, w, grad, E, E // n, **WIRES[wire])
    got = {}
    for link in ("none", "pcie", "device"):
        with world(n, 5, link=link):
            got[link] = fp8a2a_step(x, idx, w, grad, E, E // n, **WIRES[wire])
    for link in ("pcie", "device"):  # the links change no byte
        for a, b in zip(got[link], got["none"]):
            assert torch.equal(a, b), link
    assert torch.equal(got["none"][0], ref[0].view(n, E // n).sum(0))
    for name, a, b in zip(("y", "dx", "dw"), got["none"][3:], ref[3:]):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize("fused", [False, True])
def test_megatron_alltoall_dispatcher_on_loopback_equals_world_size_1(fused):
    pytest.importorskip("megatron.core")
    if fused:
        pytest.importorskip("transformer_engine")
    n, E, K = 8, 64, 8
    x, idx, w, grad = megatron_inputs(512, 1024, E, K)
    rmap, probs = _maps(idx, w, E)
    x, rmap, probs = x.cuda(), rmap.cuda(), probs.cuda()
    with world(1, 0):
        ref = megatron_step(1, 0, x, rmap, probs, grad, E, E // n, K, fused=fused)
    for link in ("pcie", "none"):
        with world(n, 6, link=link, num_experts=E):
            got = megatron_step(n, 6, x, rmap, probs, grad, E, E // n, K, fused=fused)
        assert torch.equal(got[0], ref[0].view(n, E // n).sum(0))
        for name, a, b in zip(("y", "dx", "dprobs"), got[1:], ref[1:]):
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-5, (link, name, err)
