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

from .distributed import run_ranks  # noqa: E402
from .programs import run  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _step(layer, shape):
    T, H = shape[0], shape[3]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, 1, H, generator=g).bfloat16().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, _ = layer(x)
    y.float().pow(2).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _differences(rank, world):
    """{alternative: what differs from the current path} on one gloo rank (Megatron's parallel
    state lives and dies in that process)."""
    import fp8a2a.megatron as fm
    from megatron.core import parallel_state as ps
    from fp8a2a.megatron.standalone import cpu_current_device
    fm.register()
    cpu_current_device()
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        shape = next(iter(bm.CPU_SHAPES.values()))
        layer = bm.make_layer(shape, *bm.VARIANTS[ab.ROW], False)[0]
        want, out = _step(layer, shape), {}
        for alternative, items in ab.ALTERNATIVES.items():
            with ab.patched(items):
                got = _step(layer, shape)
            same = len(got) == len(want) and all((a is None and b is None) or torch.equal(a, b)
                                                 for a, b in zip(got, want))
            restored = all(getattr(*key) is not fn for key, fn in items.items())
            if not (same and restored):
                out[alternative] = f"same output and gradients: {same}; patch undone: {restored}"
        return out
    finally:
        ps.destroy_model_parallel()
        fm.unregister()


def test_every_alternative_computes_the_same():
    assert run_ranks(1, _differences, timeout=300) == [{}]


def test_script_runs_on_cpu():
    r = run(os.path.join(ROOT, "benchmarks", "ablate_layer_host_path.py"), "--cpu", "--shapes", "0", "--repeat", "1",
            "--iters", "1", timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [line.split()[0] for line in r.stdout.splitlines() if " x1." in line or " x0." in line]
    assert "current" in rows and len(rows) == 1 + len(ab.ALTERNATIVES), r.stdout
