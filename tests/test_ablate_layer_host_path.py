"""benchmarks/ablate_layer_host_path.py: each alternative host path computes what the current one
does (same output and gradients, bit for bit, on the CPU layer), and the script runs end to end."""
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import ablate_layer_host_path as ab  # noqa: E402
import bench_megatron_layer as bm  # noqa: E402

from .programs import run  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def layer():
    import fp8a2a.megatron as fm
    fm.register()
    teardown = bm.world_of_one()
    shape = next(iter(bm.CPU_SHAPES.values()))
    yield bm.make_layer(shape, *bm.VARIANTS[ab.ROW], False)[0], shape
    teardown()


def _step(layer, shape):
    T, H = shape[0], shape[3]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, 1, H, generator=g).bfloat16().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, _ = layer(x)
    y.float().pow(2).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("alternative", list(ab.ALTERNATIVES))
def test_alternative_computes_the_same(layer, alternative):
    module, shape = layer
    want = _step(module, shape)
    with ab.patched(ab.ALTERNATIVES[alternative]):
        got = _step(module, shape)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(getattr(*key) is not fn for key, fn in ab.ALTERNATIVES[alternative].items())  # undone after


def test_script_runs_on_cpu():
    r = run(os.path.join(ROOT, "benchmarks", "ablate_layer_host_path.py"), "--cpu", "--shapes", "0", "--repeat", "1",
            "--iters", "1", timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [line.split()[0] for line in r.stdout.splitlines() if " x1." in line or " x0." in line]
    assert "current" in rows and len(rows) == 1 + len(ab.ALTERNATIVES), r.stdout
