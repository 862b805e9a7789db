"""FP8 expert weights on CUDA (fp8_weight -> triton_kernels.expert_weight_quant, and the FP8 dgrad's
transposed copy -> triton_kernels.transpose_bytes): for dense [E, N, K] weights and expert_weights
stand-ins (a table of the parameters' addresses), bf16 / fp16 / fp32, odd shapes and rows with
zeros, tiny (below the scale floor), inf and NaN values: the bytes of data and scales equal the
extension's row quantization of the [E*N, K] rows (transposed: those bytes transposed, the same
scales); one kernel launch per call and no host sync.

    python -m pytest tests/gpu/test_weight_quant.py -m gpu -q
"""
import pytest
import torch

from fp8a2a import experts as fx
from fp8a2a import ops
from fp8a2a.wire import Granularity

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


def _weights(E, N, K, dtype, special, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-3, 2, N).view(1, N, 1)
    if special:
        w[0, 1] = 0  # a zero row
        w[0, :, 2] = 0  # a zero column
        w[E - 1, 3] = w[E - 1, 3] / w[E - 1, 3].abs().amax() * 2e-37  # amax below 2^-117
        w[E - 1, :, 4] = w[E - 1, :, 4] / w[E - 1, :, 4].abs().amax() * 2e-37
        w[0, 5, K // 2] = float("nan")
        w[E - 1, 6, 0] = float("-inf")
        w[0, 7, K - 1] = 1e6  # saturating values elsewhere in its column
    return w.to(dtype).cuda()


def _reference(w, transposed):
    E, N, K = w.shape
    d, s = ops.quantize(w.reshape(E * N, K).contiguous(), Granularity.ROW, None)
    d = d.view(E, N, K)
    return (d.view(torch.uint8).transpose(1, 2).contiguous().view(d.dtype), s.view(E, N)) if transposed \
        else (d, s.view(E, N))


def _fp8_weight(weight, transposed):
    """fp8_weight(weight, transposed) and its kernels; transposed: the row-wise copy is made first
    (the forward's), so the call under test is the transpose alone."""
    if transposed:
        fx.fp8_weight(weight)
    return _kernels(lambda: fx.fp8_weight(weight, transposed))


def _one_kernel(names, transposed):
    assert len(names) == 1 and ("transpose" if transposed else "weight_quant") in names[0], names


def _same(got, ref):
    gd, gs = got
    rd, rs = ref
    assert gd.dtype == rd.dtype == torch.float8_e4m3fn and gd.shape == rd.shape
    assert torch.equal(gd.view(torch.uint8), rd.view(torch.uint8))
    assert gs.dtype == rs.dtype == torch.float32 and gs.shape == rs.shape
    same = (gs.view(torch.int32) == rs.view(torch.int32)) | (gs.isnan() & rs.isnan())
    assert bool(same.all())


def _kernels(fn):
    """fn()'s result and the CUDA kernels it launched (names), under sync-debug 'error'."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return out, names


SHAPES = [(3, 200, 136), (2, 7168, 2048), (2, 136, 200), (4, 64, 9000), (1, 9, 17)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_dense(shape, transposed, dtype, special):
    w = _weights(*shape, dtype, special and shape[1] >= 8 and shape[2] >= 8)
    got, names = _fp8_weight(w, transposed)
    _one_kernel(names, transposed)
    _same(got, _reference(w, transposed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_stand_in(shape, transposed, dtype, special):
    w = _weights(*shape, dtype, special and shape[1] >= 8 and shape[2] >= 8, seed=1)
    params = [torch.nn.Parameter(w[e].clone()) for e in range(shape[0])]
    (stand_in,) = fx.expert_weights(params)
    got, names = _fp8_weight(stand_in, transposed)
    _one_kernel(names, transposed)
    _same(got, _reference(w, transposed))
    # cached: a second call launches nothing; an in-place update rebuilds it
    again, names = _kernels(lambda: fx.fp8_weight(stand_in, transposed))
    assert again[0] is got[0] and names == []
    with torch.no_grad():
        params[0].mul_(2)
    _same(fx.fp8_weight(stand_in, transposed), _reference(torch.stack([p.detach() for p in params]), transposed))


def test_misaligned_stand_in():
    """Parameters at addresses that are not 16-byte aligned (views into one flat buffer): still
    read through the table (unvectorized), same bytes."""
    E, N, K = 3, 40, 72
    w = _weights(E, N, K, torch.bfloat16, True)
    flat = torch.empty(E * N * K + E, dtype=w.dtype, device=w.device)
    params = []
    for e in range(E):
        p = flat[e * N * K + e + 1: (e + 1) * N * K + e + 1].view(N, K)
        p.copy_(w[e])
        params.append(p)
    (stand_in,) = fx.expert_weights(params)
    for transposed in (False, True):
        got, names = _fp8_weight(stand_in, transposed)
        _one_kernel(names, transposed)
        _same(got, _reference(w, transposed))


@pytest.mark.parametrize("shape", [(2, 96, 7168), (3, 4097, 65), (1, 1, 1), (5, 63, 129)])
def test_transpose_bytes(shape):
    """triton_kernels.transpose_bytes against torch's transposed copy: partial tiles of both sides,
    every byte value."""
    from fp8a2a import triton_kernels as tk
    q = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out = tk.transpose_bytes(q)
    assert out.dtype == q.dtype and out.shape == (shape[0], shape[2], shape[1]) and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
