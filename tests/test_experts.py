"""fp8a2a.grouped_linear / FP8GroupedMLP: the reference path against float64 on the CPU (forward and
backward, every activation and granularity, empty experts, bad counts), and on a GPU the
torch._scaled_grouped_mm and Triton paths against the reference path at real expert shapes.

Ground truth is float64 with the straight-through rules of fp8a2a/experts.py spelt out: forward
values use the FP8 input, FP8 weights (per output channel), a bf16 fc1 output and a per-row FP8
activation; gradients flow to the input and the master weights as if no quantization happened."""
import contextlib
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp8a2a
from fp8a2a import experts, ops
from fp8a2a.experts import (ExpertsConfig, FP8GroupedMLP, _block_to_row, expert_weights, fp8_weight, grouped_linear,
                            resolve_backend)
from fp8a2a.quant import QuantizedTensor
from fp8a2a.reference import dequantize_reference, mm_fp8_per_expert_reference, quantize_reference

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(names, got, ref, tol):
    errs = {n: rel(a, b) for n, a, b in zip(names, got, ref)}
    print(errs)
    assert all(e < (tol[n] if isinstance(tol, dict) else tol) for n, e in errs.items()), errs


def make_q(x, granularity="row"):
    """QuantizedTensor of x (a leaf that receives the input gradient), on any device."""
    data, scale = quantize_reference(x.detach(), granularity)
    return QuantizedTensor(data, scale, granularity, grad_anchor=x)


def xhat64(q):
    return dequantize_reference(q.data, q.scale, torch.float64)


def what64(w):
    e, n, k = w.shape
    data, scale = quantize_reference(w.detach().reshape(e * n, k), "row")
    return dequantize_reference(data, scale, torch.float64).view(e, n, k)


def ste_linear(x, w, w_hat):
    """Value x @ w_hat^T; gradients as for x @ w^T (straight-through weight quantization)."""
    exact = x @ w.t()
    return x.detach() @ w_hat.t() + exact - exact.detach()


def act64(z, act):
    if act == "swiglu":
        g, u = z.chunk(2, -1)
        return F.silu(g) * u
    return F.gelu(z) if act == "gelu" else F.relu(z)


def per_expert(fn, tpe, *rows):
    outs, start = [], 0
    for e, n in enumerate(tpe):
        outs.append(fn(e, *(r[start:start + n] for r in rows)))
        start += n
    return torch.cat(outs)


def mlp64(q, w1, w2, tpe, rw, act):
    """float64 straight-through model of FP8GroupedMLP; returns (y, leaves x, W1, W2, rw)."""
    x = xhat64(q).requires_grad_()
    W1, W2 = w1.detach().double().requires_grad_(), w2.detach().double().requires_grad_()
    W1h, W2h = what64(w1), what64(w2)
    r = rw.detach().double().requires_grad_() if rw is not None else None
    z = per_expert(lambda e, xe: ste_linear(xe, W1[e], W1h[e]), tpe, x)
    z = z + (z.detach().to(torch.bfloat16).double() - z.detach())  # fc1 output is bf16
    h = act64(z, act) * (r[:, None] if r is not None else 1)
    hq, hs = quantize_reference(h.detach().float(), "row")
    h = h + (dequantize_reference(hq, hs, torch.float64) - h.detach())  # fc2 input is FP8 per row
    y = per_expert(lambda e, he: ste_linear(he, W2[e], W2h[e]), tpe, h)
    return y, x, W1, W2, r


def inputs(tpe, hidden, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(tpe), hidden, generator=g).to(device).requires_grad_()
    rw = torch.rand(sum(tpe), generator=g).to(device).requires_grad_()
    return x, rw


# ------------------------------------------------------------------------------------------------
# CPU: reference path against float64


@pytest.mark.parametrize("granularity", ["row", "block128", "tensor"])
@pytest.mark.parametrize("with_rw", [False, True])
def test_grouped_linear_reference_vs_float64(granularity, with_rw):
    tpe, H, N = [5, 0, 17, 10], 256, 96
    x, rw = inputs(tpe, H)
    rw = rw if with_rw else None
    w = (torch.randn(len(tpe), N, H) * 0.05).bfloat16().requires_grad_()
    q = make_q(x, granularity)
    y = grouped_linear(q, w, torch.tensor(tpe), rw)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(tpe), N)

    xr, W = xhat64(q).requires_grad_(), w.detach().double().requires_grad_()
    rr = rw.detach().double().requires_grad_() if rw is not None else None
    Wh = what64(w)
    y64 = per_expert(lambda e, xe: ste_linear(xe, W[e], Wh[e]), tpe, xr)
    y64 = y64 * rr[:, None] if rr is not None else y64
    assert rel(y, y64) < 5e-3

    dy = torch.randn_like(y64)
    y.backward(dy.bfloat16())
    y64.backward(dy.bfloat16().double())
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    assert rel(x.grad, xr.grad) < 1e-2
    assert rel(w.grad, W.grad) < 1e-2
    assert w.grad[1].abs().max() == 0  # expert 1 got no rows
    if rw is not None:
        assert rel(rw.grad, rr.grad) < 1e-2


@pytest.mark.parametrize("act", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("tpe", [[7, 0, 30, 3], [0, 0, 24, 0]], ids=["uneven", "one_expert"])
def test_mlp_reference_vs_float64(act, tpe):
    E, H, FF = len(tpe), 128, 64
    torch.manual_seed(1)
    mlp = FP8GroupedMLP(E, H, FF, act)
    assert mlp.fc1_weight.shape == (E, (2 if act == "swiglu" else 1) * FF, H)
    assert mlp.fc2_weight.shape == (E, H, FF) and mlp.fc1_weight.dtype == torch.bfloat16
    x, rw = inputs(tpe, H, seed=2)
    q = make_q(x)
    y = mlp(q, torch.tensor(tpe), rw)
    y64, xr, W1, W2, rr = mlp64(q, mlp.fc1_weight, mlp.fc2_weight, tpe, rw, act)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(tpe), H)
    assert rel(y, y64) < 1e-2

    dy = torch.randn(y.shape).bfloat16()
    y.backward(dy)
    y64.backward(dy.double())
    assert rel(x.grad, xr.grad) < 2e-2
    assert rel(mlp.fc1_weight.grad, W1.grad) < 2e-2
    assert rel(mlp.fc2_weight.grad, W2.grad) < 2e-2
    assert rel(rw.grad, rr.grad) < 2e-2
    for e, n in enumerate(tpe):
        if n == 0:
            assert mlp.fc1_weight.grad[e].abs().max() == 0 and mlp.fc2_weight.grad[e].abs().max() == 0


def test_mlp_without_router_weights_and_block_input():
    tpe, H = [9, 4, 0], 256
    torch.manual_seed(3)
    mlp = FP8GroupedMLP(3, H, 64)
    x, _ = inputs(tpe, H, seed=4)
    q = make_q(x, "block128")
    y = mlp(q, torch.tensor(tpe))
    y64, xr, W1, W2, _ = mlp64(q, mlp.fc1_weight, mlp.fc2_weight, tpe, None, "swiglu")
    assert rel(y, y64) < 1e-2
    y.backward(torch.ones_like(y))
    y64.backward(torch.ones_like(y64))
    assert rel(x.grad, xr.grad) < 2e-2 and rel(mlp.fc1_weight.grad, W1.grad) < 2e-2


def test_plain_tensor_input_and_fp8_quantize_api():
    tpe, H = [3, 5], 128
    mlp = FP8GroupedMLP(2, H, 32, "relu")
    x, _ = inputs(tpe, H)
    y_plain = mlp(x, torch.tensor(tpe))  # quantized per row inside, gradient reaches x
    y_q = mlp(fp8a2a.quantize(x, "row"), torch.tensor(tpe))
    torch.testing.assert_close(y_plain, y_q)
    y_plain.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_fp8_dgrad_option_close_to_bf16_dgrad():
    tpe, H = [11, 6, 0, 15], 256
    torch.manual_seed(5)
    ref, fp8 = FP8GroupedMLP(4, H, 128), FP8GroupedMLP(4, H, 128, fp8_dgrad=True)
    fp8.load_state_dict(ref.state_dict())
    grads = []
    for m in (ref, fp8):
        x, rw = inputs(tpe, H, seed=6)
        y = m(make_q(x), torch.tensor(tpe), rw)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).bfloat16())
        grads.append((y.detach(), x.grad, rw.grad, m.fc1_weight.grad, m.fc2_weight.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])  # same forward
    assert rel(grads[1][4], grads[0][4]) < 1e-6  # fc2 wgrad does not involve the dgrad
    for a, b in zip(grads[1][1:4], grads[0][1:4]):
        assert rel(a, b) < 0.08  # FP8 quantization error of dY and W^T


@pytest.mark.parametrize("with_rw", [False, True])
def test_fp8_dgrad_vs_float64(with_rw):
    """The FP8 dgrad's rule in float64: dX_e = q(dY_e * s_w[e]) @ w_fp8[e], the forward's FP8 weight
    (per output channel) read transposed, its scales folded into dY's columns before dY's per-row
    quantization; router weights scale dX's rows afterwards. Also close to the exact dY @ W."""
    tpe, H, N = [5, 0, 17, 10], 256, 96
    x, rw = inputs(tpe, H, seed=3)
    rw = rw if with_rw else None
    w = (torch.randn(len(tpe), N, H, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    w.requires_grad_()
    y = grouped_linear(make_q(x), w, torch.tensor(tpe), rw, fp8_dgrad=True)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    y.backward(dy)

    wq, sw = fp8_weight(w)
    e_of = torch.repeat_interleave(torch.arange(len(tpe)), torch.tensor(tpe))
    gq, gs = quantize_reference(dy.float() * sw[e_of], "row")
    g64 = dequantize_reference(gq, gs, torch.float64)
    dx64 = per_expert(lambda e, ge: ge @ wq[e].double(), tpe, g64)
    if rw is not None:
        dx64 = dx64 * rw.detach().double()[:, None]
    torch.testing.assert_close(x.grad.double(), dx64, rtol=2 ** -8, atol=1e-6)  # its bf16 rounding, element by element
    exact = per_expert(lambda e, ge: ge @ w[e].detach().double(), tpe, dy.double())
    if rw is not None:
        exact = exact * rw.detach().double()[:, None]
    assert rel(x.grad, exact) < 0.08  # FP8 rounding of dY and W


def test_fp8_dgrad_with_counts_short_of_the_rows_unchecked():
    """check=False with counts that leave rows outside every group: those rows take no part in the
    GEMMs (zero output, zero input gradient), as with the BF16 dgrad, and the FP8 dgrad's scale
    folding reads no expert past the last."""
    w = (torch.randn(3, 64, 128, generator=torch.Generator().manual_seed(9)) * 0.05).bfloat16()
    grads = []
    for fp8_dgrad in (False, True):
        x = torch.randn(10, 128, generator=torch.Generator().manual_seed(8)).requires_grad_()
        y = grouped_linear(x, w.clone().requires_grad_(), torch.tensor([4, 0, 5]), fp8_dgrad=fp8_dgrad, check=False)
        y.float().sum().backward()
        assert y[9].abs().max() == 0 and x.grad[9].abs().max() == 0 and bool(torch.isfinite(x.grad).all())
        grads.append(x.grad)
    assert rel(grads[1], grads[0]) < 0.08


def test_fp8_dgrad_error_as_small_as_scaling_the_weight_per_input_channel():
    """The FP8 dgrad reads the forward's FP8 weight (per output channel, along the dgrad's reduction)
    with the scales folded into dY; the alternative, a second copy of W^T quantized per input
    channel (and dY per row), needs the weights read twice per optimizer step. On weights and
    gradients whose channels' ranges spread over e^+-1, both have the same error against dY @ W."""
    g = torch.Generator().manual_seed(11)

    def spread(*shape):
        return torch.exp(torch.randn(*shape, generator=g) * 0.5)

    for N, K in ((1024, 512), (512, 1024)):
        w = (torch.randn(N, K, generator=g) * 0.02 * spread(N, 1) * spread(1, K)).bfloat16().float()
        dy = (torch.randn(2048, N, generator=g) * spread(2048, 1) * spread(1, N) * 1e-4).bfloat16().float()
        exact = dy.double() @ w.double()
        wq, ws = quantize_reference(w, "row")
        gq, gs = quantize_reference(dy * ws, "row")
        ours = dequantize_reference(gq, gs, torch.float64) @ wq.double()
        wtq, wts = quantize_reference(w.t().contiguous(), "row")
        gq, gs = quantize_reference(dy, "row")
        per_input = dequantize_reference(gq, gs, torch.float64) @ dequantize_reference(wtq, wts, torch.float64).t()
        assert rel(ours, exact) < 0.05 and rel(ours, exact) < 1.02 * rel(per_input, exact)


def test_block_col_quant_t_is_the_row_rule_per_128_tokens_of_an_expert():
    """The FP8 wgrad's operand rounding: every 128 rows of an expert, column by column, as
    quantize(..., 'row') quantizes the transposed block; padding rows are zero (scale 1 where a
    whole block is padding or zero), and no block straddles two experts."""
    tpe = [7, 0, 300, 128, 1]
    offs = torch.cumsum(torch.tensor(tpe), 0, dtype=torch.int32)
    v = torch.randn(sum(tpe), 96) * torch.logspace(-3, 2, 96)
    v[:, 5] = 0  # an all-zero column
    pad_offs, mpad = experts._wgrad_padding(offs, sum(tpe))
    assert pad_offs.tolist() == [128, 128, 512, 640, 768] and mpad >= 768 and mpad % 128 == 0
    data, scale = experts._block_col_quant_t(v, offs, pad_offs, mpad)
    assert data.shape == (96, mpad) and scale.shape == (mpad // 128, 96)
    u8, start, pstart = data.view(torch.uint8), 0, 0
    for n, pend in zip(tpe, pad_offs.tolist()):
        for b0 in range(0, pend - pstart, 128):
            rows = v[start + b0:start + min(b0 + 128, n)]
            rd, rs = quantize_reference(rows.t(), "row")
            blk = (pstart + b0) // 128
            assert torch.equal(scale[blk], rs)
            assert torch.equal(u8[:, pstart + b0:pstart + b0 + len(rows)], rd.view(torch.uint8))
        assert (u8[:, pstart + n:pend] == 0).all()
        start, pstart = start + n, pend


@pytest.mark.parametrize("tpe", [[7, 0, 300, 128, 1], [0, 0], [256]])
def test_wgrad_padding_from_host_counts_is_the_device_layout(tpe):
    """_wgrad_padding from host counts (one copy in) gives the padded group ends the device path
    computes, and as its bound their exact width (no scale block past the last group), one block
    at least (no expert with rows: an operand of width 0 would have no TMA descriptor)."""
    offs = torch.cumsum(torch.tensor(tpe, dtype=torch.int64), 0, dtype=torch.int32)
    device_ends, static_bound = experts._wgrad_padding(offs, sum(tpe))
    host_ends, width = experts._wgrad_padding(offs, sum(tpe), counts=tpe)
    assert host_ends.dtype == torch.int32 and torch.equal(host_ends, device_ends)
    assert width == max(128, sum(-(-n // 128) * 128 for n in tpe)) <= static_bound


@pytest.mark.parametrize("exact", [True, False], ids=["exact_width", "static_bound"])
@pytest.mark.parametrize("tpe", [[300, 0, 77, 1, 130], [0, 1000, 0, 129], [300]])
def test_fp8_wgrad_per_expert_gemms_slice_the_padded_operands(tpe, exact):
    """The per-expert GEMMs (_wgrad_fp8_per_expert: ops.wgrad_fp8_per_expert's CPU twin) on
    block_col_quant_t's operands: each expert's columns and scale blocks, zeros for an expert without
    rows; equal to the emulated FP8 weight gradient, whether the operands are as wide as the experts'
    padded columns (what _wgrad_fp8 quantizes to) or as the static bound (columns past them unread)."""
    torch.manual_seed(20)
    offs = torch.cumsum(torch.tensor(tpe), 0, dtype=torch.int32)
    g, x = torch.randn(sum(tpe), 96), torch.randn(sum(tpe), 64)
    pad_offs, mpad = experts._wgrad_padding(offs, sum(tpe))
    if exact:
        mpad = sum(-(-n // 128) * 128 for n in tpe)
    (a, sa), (b, sb) = (experts._block_col_quant_t(v, offs, pad_offs, mpad) for v in (g, x))
    if not exact:  # what the Triton quantize-transpose leaves past the last expert: not read
        for q, s in ((a, sa), (b, sb)):
            q[:, pad_offs[-1]:] = float("nan")
            s[pad_offs[-1] // 128:] = float("nan")
    got = experts._wgrad_fp8_per_expert(a, sa, b, sb, tpe, torch.float32)
    ref = experts._wgrad_fp8_reference(g, x, offs, len(tpe))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(got[e].abs().max() == 0 for e, n in enumerate(tpe) if n == 0)


def test_wgrad_fp8_per_expert_checks_its_operands():
    """Bad operands get a clear ValueError (not a read past the buffers, and not the RuntimeError
    that _wgrad_fp8_per_expert takes for cuBLAS refusing the shape)."""
    a, b = torch.zeros(96, 256).to(torch.float8_e4m3fn), torch.zeros(64, 256).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(2, 96), torch.ones(2, 64)
    for args, match in [((a, sa, b, sb, [128, 256]), "summing to at most 256"),
                        ((a, sa, b, sb, [2 ** 62, 2 ** 62]), "summing to at most 256"),  # no wrap-around
                        ((a, sa, b, sb, [100]), "multiples of 128"),
                        ((a, sa, b, torch.ones(1, 64), [128]), "scale_b must be"),
                        ((a, sa, b[:, :128].contiguous(), sb, [128]), "same token columns"),
                        ((a.float(), sa, b, sb, [128]), "float8_e4m3fn")]:
        with pytest.raises(ValueError, match=match):
            ops.wgrad_fp8_per_expert(*args, torch.bfloat16)
    empty = ops.wgrad_fp8_per_expert(a, sa, b, sb, [0, 0], torch.bfloat16)  # no expert has columns: zeros
    assert empty.shape == (2, 96, 64) and empty.dtype == torch.bfloat16 and empty.abs().max() == 0


def test_fp8_wgrad_per_expert_refusal_falls_back(monkeypatch):
    """A cuBLAS that refuses the block scales: None (the caller's Triton GEMM), a warning, and that
    (device, dtype, shape) remembered; other shapes still try."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no blockwise scaling here")
    monkeypatch.setattr(ops, "wgrad_fp8_per_expert", refuse)
    monkeypatch.setattr(experts, "_CUBLAS_BLOCKWISE_REFUSED", set())
    a, b = torch.zeros(96, 128).to(torch.float8_e4m3fn), torch.zeros(64, 128).to(torch.float8_e4m3fn)
    s_a, s_b = torch.ones(1, 96), torch.ones(1, 64)
    with pytest.warns(RuntimeWarning, match="refused 1 x 128 block scales"):
        assert experts._wgrad_fp8_per_expert(a, s_a, b, s_b, [100], torch.bfloat16) is None
    assert experts._CUBLAS_BLOCKWISE_REFUSED == {(a.device, torch.bfloat16, 96, 64)}


def test_mm_fp8_per_expert_refusal_falls_back(monkeypatch):
    """A cuBLAS that refuses the per-expert GEMMs: None (the caller's grouped GEMM), a warning, and
    that (device, N, K) remembered, which _dense_per_expert then skips."""
    def refuse(*args, **kwargs):
        raise RuntimeError("not supported")
    monkeypatch.setattr(ops, "mm_fp8_per_expert", refuse)
    monkeypatch.setattr(experts, "_DENSE_REFUSED", set())
    a, sa = torch.zeros(6, 32).to(torch.float8_e4m3fn), torch.ones(6)
    w, sw = torch.zeros(2, 16, 32).to(torch.float8_e4m3fn), torch.ones(2, 16)
    with pytest.warns(RuntimeWarning, match="cuBLAS refused the per-expert GEMMs"):
        assert experts._mm_fp8_per_expert(a, sa, w, sw, [3, 3], True) is None
    assert experts._DENSE_REFUSED == {(a.device, 16, 32)}
    assert not experts._dense_per_expert(ExpertsConfig(dense_min_rows_per_expert=0), (3, 3), a.device, 6, 16, 32)


def test_fp8_wgrad_reference_is_the_blockwise_product():
    """The emulated FP8 weight gradient: per expert, the sum over its 128-token blocks of the
    dequantized operands' product (float64 here), zero for an expert without rows."""
    tpe = [130, 0, 5]
    offs = torch.cumsum(torch.tensor(tpe), 0, dtype=torch.int32)
    g, x = torch.randn(sum(tpe), 48), torch.randn(sum(tpe), 80)
    got = experts._wgrad_fp8_reference(g, x, offs, len(tpe))
    pad_offs, mpad = experts._wgrad_padding(offs, sum(tpe))
    (gq, gs), (xq, xs) = (experts._block_col_quant_t(v, offs, pad_offs, mpad) for v in (g, x))
    gd = gq.double().view(48, -1, 128) * gs.t().double()[:, :, None]
    xd = xq.double().view(80, -1, 128) * xs.t().double()[:, :, None]
    want = torch.stack([torch.einsum("mbt,nbt->mn", gd[:, a:b], xd[:, a:b]) for a, b in [(0, 2), (2, 2), (2, 3)]])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # float32 sums
    assert got[1].abs().max() == 0
    assert 1e-3 < rel(got, experts._ref_wgrad(g, x, offs, len(tpe))) < 0.05


def _grads_with_and_without_fp8_wgrad(make, tpe, H, granularity="row"):
    out = []
    for fp8_wgrad in (False, True):
        m = make(fp8_wgrad)
        x, rw = inputs(tpe, H, seed=12)
        y = m(make_q(x, granularity), torch.tensor(tpe), rw)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(13)).bfloat16())
        out.append((y.detach(), x.grad, rw.grad) + tuple(p.grad for p in m.parameters()))
    return out


def test_fp8_wgrad_option_close_to_bf16_wgrad():
    tpe, H = [11, 0, 37, 16, 5], 256  # an expert without rows, counts not multiples of 16
    torch.manual_seed(14)
    state = FP8GroupedMLP(len(tpe), H, 128).state_dict()

    def make(fp8_wgrad):
        m = FP8GroupedMLP(len(tpe), H, 128, fp8_wgrad=fp8_wgrad)
        m.load_state_dict(state)
        return m
    bf16, fp8 = _grads_with_and_without_fp8_wgrad(make, tpe, H)
    for a, b in zip(fp8[:3], bf16[:3]):  # y, dx, d rw: the weight gradients feed none of them
        assert torch.equal(a, b)
    for a, b in zip(fp8[3:], bf16[3:]):  # dW1, dW2: the FP8 rounding of dY / dZ and x_hat / h
        assert 1e-3 < rel(a, b) < 0.05
        assert a[1].abs().max() == 0


def test_fp8_wgrad_option_grouped_linear_block_input():
    tpe, H = [20, 3, 0, 17], 256
    w = (torch.randn(len(tpe), 64, H, generator=torch.Generator().manual_seed(15)) * 0.05).bfloat16()

    class Linear(torch.nn.Module):
        def __init__(self, fp8_wgrad):
            super().__init__()
            self.w, self.fp8_wgrad = torch.nn.Parameter(w.clone()), fp8_wgrad

        def forward(self, q, tpe, rw):
            return grouped_linear(q, self.w, tpe, rw, fp8_wgrad=self.fp8_wgrad)
    bf16, fp8 = _grads_with_and_without_fp8_wgrad(Linear, tpe, H, "block128")
    for a, b in zip(fp8[:3], bf16[:3]):
        assert torch.equal(a, b)
    assert 1e-3 < rel(fp8[3], bf16[3]) < 0.05 and fp8[3][2].abs().max() == 0


def test_fp8_weight_cache_follows_the_version_counter():
    w = torch.randn(2, 32, 64).bfloat16().requires_grad_()
    a = fp8_weight(w)
    assert fp8_weight(w) is a
    torch.testing.assert_close(a[0].float() * a[1][..., None], w.detach().float(), rtol=0.07, atol=1e-3)
    with torch.no_grad():
        w.mul_(2)  # optimizer-style in-place update
    b = fp8_weight(w)
    assert b is not a
    torch.testing.assert_close(b[1], a[1] * 2)
    t = fp8_weight(w, transposed=True)  # the FP8 dgrad's operand: the same bytes, transposed
    assert torch.equal(t[0].view(torch.uint8), b[0].view(torch.uint8).transpose(1, 2)) and t[1] is b[1]
    assert fp8_weight(w) is b and fp8_weight(w, transposed=True) is t  # both kinds cached side by side


def test_fp8_weight_of_expert_parameters_is_cached_on_them():
    """Megatron's experts hold one parameter per expert: the stand-in is new on every forward, the
    FP8 copy is not (it follows the parameters' versions)."""
    ps = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(3)]
    a = fp8_weight(expert_weights(ps)[0])
    assert fp8_weight(expert_weights(ps)[0]) is a
    torch.testing.assert_close(a[0].float() * a[1][..., None], torch.stack(ps).detach(), rtol=0.07, atol=1e-3)
    t = fp8_weight(expert_weights(ps)[0], transposed=True)  # expert by expert, as of the stack's transpose
    want = fp8_weight(torch.stack(ps).detach(), transposed=True)
    assert torch.equal(t[0].float(), want[0].float()) and torch.equal(t[1], want[1])
    with torch.no_grad():
        ps[2].mul_(2)  # any one parameter changing refreshes the copy
    b = fp8_weight(expert_weights(ps)[0])
    assert b is not a
    torch.testing.assert_close(b[1][2], a[1][2] * 2)
    w, v = expert_weights(ps, ps[:2])
    assert w.shape == (3, 32, 64) and v.shape == (2, 32, 64) and w.stride() == (0, 0, 0)  # no memory
    ((w.sum(0) * 3).sum() + v.sum()).backward()  # differentiable into the parameters, slice by slice
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0 + (i < 2))) for i, p in enumerate(ps))


def test_fp8_weight_transposed_is_built_from_the_row_wise_copy(monkeypatch):
    """The transposed copy (an FP8 dgrad's backward) is the row-wise copy's bytes transposed, made
    from the cached row-wise copy without quantizing again, for a dense weight and for per-expert
    parameters; an update rebuilds both."""
    counts = _count_builds(monkeypatch)
    w = torch.randn(3, 32, 48).bfloat16()
    ps = [torch.nn.Parameter(w[e].clone()) for e in range(3)]
    for weight in (lambda d=w.clone().requires_grad_(): d, lambda: expert_weights(ps)[0]):
        counts.update(fp8=0, transposed=0)
        row = fp8_weight(weight())
        t = fp8_weight(weight(), transposed=True)
        assert fp8_weight(weight()) is row and fp8_weight(weight(), transposed=True) is t
        assert counts["fp8"] == 1 and counts["transposed"] == 1, counts
        assert torch.equal(t[0].view(torch.uint8), row[0].view(torch.uint8).transpose(1, 2).contiguous())
        assert t[1] is row[1]
        fp8a2a.invalidate_fp8_weight_cache()  # an optimizer step
        t2 = fp8_weight(weight(), transposed=True)
        assert t2 is not t and fp8_weight(weight()) is not row and counts["fp8"] == 2, counts
        assert torch.equal(t2[0].view(torch.uint8), t[0].view(torch.uint8))  # same values, same bytes


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_fp8_dgrad_forward_without_grad_builds_no_transposed_copy(mode):
    """Evaluation or serving: the parameters still require grad, but no backward comes."""
    mlp = FP8GroupedMLP(2, 32, 16, fp8_dgrad=True)
    x, tpe = torch.randn(6, 32), torch.tensor([4, 2])
    with mode():
        mlp(x, tpe)
    for w in (mlp.fc1_weight, mlp.fc2_weight):  # the row-wise copies only
        assert set(w.__dict__["_fp8a2a_cache"]) == {False}
    mlp(x.clone().requires_grad_(), tpe).sum().backward()
    for w in (mlp.fc1_weight, mlp.fc2_weight):
        assert set(w.__dict__["_fp8a2a_cache"]) == {False, True}


def _count_builds(monkeypatch):
    """{'stack': BF16 stacks built, 'fp8': weight quantizations, 'transposed': transposed FP8 copies}
    of the expert weight caches."""
    import fp8a2a.weight_cache as wc
    counts = {"stack": 0, "fp8": 0, "transposed": 0}
    cached = wc._cached

    def counting(weight, kind, build):
        def counted(sources):
            counts["stack" if kind == "stack" else "transposed" if kind is True else "fp8"] += 1
            return build(sources)
        return cached(weight, kind, counted)
    monkeypatch.setattr(wc, "_cached", counting)
    return counts


@pytest.mark.parametrize("fp8_dgrad", [False, True], ids=["bf16_dgrad", "fp8_dgrad"])
def test_expert_weights_built_once_per_optimizer_step(monkeypatch, fp8_dgrad):
    """Per-expert parameters: the FP8 weights (and, for the BF16 dgrad, the BF16 stack) are made
    once for several micro-batches, again after an optimizer step or a weight write; the gradients
    are those of torch.stack'ed weights."""
    counts = _count_builds(monkeypatch)
    E, H, F_ = 4, 64, 32
    w1 = [torch.nn.Parameter(torch.randn(2 * F_, H) * 0.1) for _ in range(E)]
    w2 = [torch.nn.Parameter(torch.randn(H, F_) * 0.1) for _ in range(E)]
    mlp = FP8GroupedMLP(E, H, F_, fp8_dgrad=fp8_dgrad, device="meta")
    tpe = torch.tensor([5, 0, 7, 4])
    opt = torch.optim.SGD(w1 + w2, lr=0.1)

    def micro_batch(seed, stacked=False):
        g = torch.Generator().manual_seed(seed)
        x, rw = torch.randn(16, H, generator=g).requires_grad_(), torch.rand(16, generator=g)
        weights = (torch.stack(w1), torch.stack(w2)) if stacked else expert_weights(w1, w2)
        y = torch.func.functional_call(mlp, {"fc1_weight": weights[0], "fc2_weight": weights[1]}, (x, tpe, rw))
        y.float().pow(2).sum().backward()
        return y, x.grad

    # per weight and step one quantization; the FP8 dgrad's first backward transposes its bytes once
    per_step = {"stack": 0 if fp8_dgrad else 2, "fp8": 2, "transposed": 2 if fp8_dgrad else 0}
    for _ in range(3):
        micro_batch(0)
    assert counts == per_step, counts
    opt.zero_grad()
    y_ref, gx_ref = micro_batch(0, stacked=True)  # the reference: stacked weights (and its own caches)
    grads = [p.grad.clone() for p in w1 + w2]
    for hooks in (False, True):  # saved-tensor hooks that copy (activation offloading) see no stand-in
        opt.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t) if hooks \
                else contextlib.nullcontext():
            y, gx = micro_batch(0)
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
        assert all(torch.equal(p.grad, g) for p, g in zip(w1 + w2, grads))
    counts.update(stack=0, fp8=0, transposed=0)
    opt.step()  # an optimizer step: everything again, once
    for _ in range(2):
        micro_batch(1)
    assert counts == per_step, counts
    counts.update(stack=0, fp8=0, transposed=0)
    with torch.no_grad():
        w2[1].add_(1.0)  # an in-place write to one expert's weight: that weight's copies again
    micro_batch(2)
    assert counts == {k: v // 2 for k, v in per_step.items()}, counts


def test_fp8_weight_cache_refreshes_after_a_fused_optimizer_step():
    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    a = fp8_weight(w)
    w.grad = torch.randn_like(w)
    version = w._version
    torch.optim.AdamW([w], lr=0.1, fused=True).step()
    assert w._version == version  # the fused step does not bump the counter...
    b = fp8_weight(w)
    assert b is not a  # ...but the cache still sees the step
    torch.testing.assert_close(b[0].float() * b[1][..., None], w.detach().float(), rtol=0.07, atol=1e-3)


def test_fp8_weight_cache_invalidated_by_hand_after_data_writes():
    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    a = fp8_weight(w)
    w.data.mul_(2)  # a write through .data: no version bump, no optimizer step
    fp8a2a.invalidate_fp8_weight_cache()
    b = fp8_weight(w)
    assert b is not a
    torch.testing.assert_close(b[1], a[1] * 2)


def test_fp8_weight_cache_misses_a_new_view_or_dtype_of_the_same_storage():
    """`.data = ...` moves no version counter: a view with other strides (same address, same shape)
    or another dtype over the same bytes must not be served the old copy."""
    w = torch.nn.Parameter(torch.randn(2, 64, 64, dtype=torch.bfloat16))
    a = fp8_weight(w)
    w.data = w.data.transpose(1, 2)
    b = fp8_weight(w)
    assert b is not a
    assert torch.equal(b[0].view(torch.uint8), fp8_weight(w.detach().contiguous())[0].view(torch.uint8))
    w.data = w.data.view(torch.float16)
    assert fp8_weight(w) is not b
    # a stand-in over per-expert parameters: new storage under any one of them misses
    ps = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)) for _ in range(3)]
    stand_in, = expert_weights(ps)
    a = fp8_weight(stand_in)
    ps[2].data = ps[2].data * 2
    b = fp8_weight(stand_in)
    assert b is not a and torch.equal(b[1][2], a[1][2] * 2) and torch.equal(b[1][:2], a[1][:2])


def test_fp8_weight_cache_misses_new_storage_where_the_old_one_lived():
    """`.data = ...` in two steps (the module moved off its storage, then given new values, as
    checkpoint loaders do) could hand the new values the old storage's address: the cache keeps the
    storage its copy was made from alive, so the key cannot match new values."""
    q = fp8a2a.quantize(torch.randn(8, 128, generator=torch.Generator().manual_seed(0)), "row")
    tpe = torch.tensor([5, 3])
    for trial in range(10):
        torch.manual_seed(trial)
        mlp = FP8GroupedMLP(2, 128, 64, "swiglu")
        mlp(q, tpe)
        new_w = torch.randn(2, 128, 64) * 0.05
        mlp.float()
        mlp.fc2_weight.data = new_w.to(torch.bfloat16)
        mlp.fc1_weight.data = mlp.fc1_weight.data.to(torch.bfloat16)
        fresh = FP8GroupedMLP(2, 128, 64, "swiglu")
        fresh.load_state_dict(mlp.state_dict())
        assert torch.equal(mlp(q, tpe), fresh(q, tpe)), trial


def test_expert_parameters_written_before_the_backward_raise():
    """expert_weights' stand-ins are not saved tensors, so autograd cannot see their parameters
    change; the experts' backward checks their versions itself, as autograd does for a saved weight."""
    w1 = [torch.nn.Parameter(torch.randn(32, 128) * 0.1) for _ in range(2)]
    w2 = [torch.nn.Parameter(torch.randn(128, 32) * 0.1) for _ in range(2)]
    mlp = FP8GroupedMLP(2, 128, 32, "relu", device="meta")
    for modify in (False, True):
        x = torch.randn(8, 128, requires_grad=True)
        y = mlp.forward_with(*expert_weights(w1, w2), fp8a2a.quantize(x), torch.tensor([3, 5]))
        if modify:
            with torch.no_grad():
                w2[1].mul_(-3.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.float().sum().backward()
        else:
            y.float().sum().backward()
            assert torch.isfinite(x.grad).all()


def _graph_reads(weight, fp8_dgrad):
    """What the captured forward + backward of an FP8GroupedMLP read of weight: the row-wise FP8
    copy, and the transposed one (FP8 dgrad) or the BF16 stack (BF16 dgrad)."""
    from fp8a2a.weight_cache import dense_weight
    row = fp8_weight(weight)
    return row, (fp8_weight(weight, transposed=True) if fp8_dgrad else dense_weight(weight))


def _flat(reads):
    return [t for r in reads for t in ((r,) if isinstance(r, torch.Tensor) else r)]


@pytest.mark.parametrize("fp8_dgrad", [False, True], ids=["bf16_dgrad", "fp8_dgrad"])
@pytest.mark.parametrize("stand_in", [False, True], ids=["dense", "expert_params"])
def test_graphed_copies_are_refreshed_in_place(monkeypatch, stand_in, fp8_dgrad):
    """Copies handed out during a CUDA-graph capture stay where the graph reads them: after an
    optimizer step (or .data writes and invalidate_fp8_weight_cache()) refresh_graphed rebuilds them
    in place, equal to a fresh build of the new weights; while valid it builds nothing."""
    import fp8a2a.weight_cache as wc
    counts = _count_builds(monkeypatch)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(48, 32).bfloat16()) for _ in range(3)]
    dense = torch.nn.Parameter(torch.stack([p.detach() for p in ps]))
    weight = (lambda: expert_weights(ps)[0]) if stand_in else (lambda: dense)
    params = ps if stand_in else [dense]

    def fresh():  # the same values, nothing cached
        return _graph_reads(torch.stack([p.detach() for p in params]).reshape(3, 48, 32).clone(), fp8_dgrad)

    eager = _flat(_graph_reads(weight(), fp8_dgrad))
    with monkeypatch.context() as m:  # the capture: hits, now read by the graph
        m.setattr(wc, "_capturing", lambda w: True)
        captured = _flat(_graph_reads(weight(), fp8_dgrad))
    assert all(a is b for a, b in zip(captured, eager))
    ptrs = [t.data_ptr() for t in captured]
    counts.update(stack=0, fp8=0, transposed=0)
    wc.refresh_graphed(weight())
    assert counts == {"stack": 0, "fp8": 0, "transposed": 0}  # valid: nothing built

    opt = torch.optim.SGD(params, lr=10.0)  # large steps: a stale copy differs visibly
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for update in ("optimizer step", "data write"):
        want = _flat(fresh())
        counts.update(stack=0, fp8=0, transposed=0)
        assert not all(torch.equal(a.float(), b.float()) for a, b in zip(captured, want))  # stale until refreshed
        wc.refresh_graphed(weight())
        assert [t.data_ptr() for t in captured] == ptrs
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == wc.FP8 else a,
                               b.view(torch.uint8) if b.dtype == wc.FP8 else b) for a, b in zip(captured, want))
        assert all(a is b for a, b in zip(_flat(_graph_reads(weight(), fp8_dgrad)), captured))  # eager: hits
        # once; the transposed copy from the row-wise one; a dense weight is its own BF16 stack
        assert counts == {"stack": int(stand_in and not fp8_dgrad), "fp8": 1, "transposed": int(fp8_dgrad)}, counts
        for p in params:
            p.data.mul_(-0.5)
        fp8a2a.invalidate_fp8_weight_cache()


def test_graphed_copy_refreshed_in_place_by_an_eager_use_too(monkeypatch):
    """An eager call after a change rebuilds a graph-read copy in place as well (the graph sees it)."""
    import fp8a2a.weight_cache as wc
    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    a = fp8_weight(w)
    monkeypatch.setattr(wc, "_capturing", lambda w: True)
    assert fp8_weight(w) is a
    with torch.no_grad():
        fresh = fp8_weight(w.detach().clone() * 2)  # a miss under capture: built, not cached
    assert w.__dict__["_fp8a2a_cache"][False][1] is a
    monkeypatch.setattr(wc, "_capturing", lambda w: False)
    with torch.no_grad():
        w.mul_(2)
    ptr = a[0].data_ptr()
    assert fp8_weight(w) is a and a[0].data_ptr() == ptr
    assert torch.equal(a[0].view(torch.uint8), fresh[0].view(torch.uint8)) and torch.equal(a[1], fresh[1])


def test_graphed_copy_that_cannot_be_refilled_raises(monkeypatch):
    """A graph-read copy whose rebuild has another shape cannot be refilled where the graph reads it:
    it raises instead of letting the graph read freed memory."""
    import fp8a2a.weight_cache as wc
    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    a = fp8_weight(w)
    monkeypatch.setattr(wc, "_capturing", lambda w: True)
    assert fp8_weight(w) is a  # now read by the graph
    monkeypatch.setattr(wc, "_capturing", lambda w: False)
    with pytest.raises(RuntimeError, match="capture the graph again"):
        wc._store((w,), w.__dict__["_fp8a2a_cache"], False, None, (a[0][:, :16], a[1][:, :16]))


def test_zero_rows():
    mlp = FP8GroupedMLP(3, 128, 32)
    x = torch.zeros(0, 128, requires_grad=True)
    y = mlp(make_q(x), torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 128)
    y.sum().backward()
    assert mlp.fc1_weight.grad.abs().sum() == 0 and x.grad.shape == (0, 128)


def test_forward_with_matches_functional_call():
    """forward_with(w1, w2, ...) (what fp8a2a.megatron's experts call) is the module's forward with
    those weights: the same output and gradients as torch.func.functional_call, bit for bit."""
    E, H, F_ = 3, 64, 32
    g = torch.Generator().manual_seed(3)
    w1 = [torch.nn.Parameter(torch.randn(2 * F_, H, generator=g) * 0.1) for _ in range(E)]
    w2 = [torch.nn.Parameter(torch.randn(H, F_, generator=g) * 0.1) for _ in range(E)]
    mlp = FP8GroupedMLP(E, H, F_, fp8_dgrad=True, device="meta")
    x0, rw, dy = torch.randn(12, H, generator=g), torch.rand(12, generator=g), torch.randn(12, H, generator=g)
    tpe = torch.tensor([5, 0, 7])
    results = []
    for run in ("forward_with", "functional_call"):
        x = x0.clone().requires_grad_()
        a, b = expert_weights(w1, w2)
        if run == "forward_with":
            y = mlp.forward_with(a, b, make_q(x), tpe, rw)
        else:
            y = torch.func.functional_call(mlp, {"fc1_weight": a, "fc2_weight": b}, (make_q(x), tpe, rw))
        (y.float() * dy).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in w1 + w2])
        for p in w1 + w2:
            p.grad = None
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_dense_per_expert_routing(monkeypatch):
    """One dense GEMM per expert only with host counts, from dense_min_rows_per_expert rows per expert
    on average, for a shape torch has not refused."""
    cpu, cfg = torch.device("cpu"), ExpertsConfig()
    assert experts._dense_per_expert(cfg, (4096,) * 8, cpu, 4096 * 8, 7168, 2048)
    assert not experts._dense_per_expert(cfg, None, cpu, 4096 * 8, 7168, 2048)  # device counts
    assert not experts._dense_per_expert(cfg, (4095,) * 8, cpu, 4095 * 8, 7168, 2048)
    assert experts._dense_per_expert(ExpertsConfig(dense_min_rows_per_expert=0), (1, 0), cpu, 1, 64, 48)
    monkeypatch.setattr(experts, "_DENSE_REFUSED", {(cpu, 7168, 2048)})
    assert not experts._dense_per_expert(cfg, (4096,) * 8, cpu, 4096 * 8, 7168, 2048)


@pytest.mark.parametrize("counts", [[300, 0, 77, 1, 130], [5, 40, 3], [33, 0, 31, 35], [7], [32, 0, 64, 16],
                                    [0, 1], [1, 1, 1, 1, 1], [0, 0, 1, 0]])
def test_mm_fp8_per_expert_cpu(counts):
    """The per-expert dense GEMMs' CPU twin (ops.mm_fp8_per_expert, what _mm_fp8_per_expert calls):
    every expert, one-row and empty ones too, comes out as a float64 product of its dequantized
    operands does, rounded to bfloat16 once."""
    torch.manual_seed(31)
    M, E, N, K = sum(counts), len(counts), 64, 48
    a = torch.randn(M, K).to(torch.float8_e4m3fn)
    sa = torch.rand(M) + 0.5
    w, sw = torch.randn(E, N, K).to(torch.float8_e4m3fn), torch.rand(E, N) + 0.5
    starts = [0] + list(itertools.accumulate(counts))
    y = experts._mm_fp8_per_expert(a, sa, w, sw, counts, fast_accum=True)
    ref = torch.cat([(a[s:t].double() * sa[s:t, None].double()) @ (w[e].double() * sw[e][:, None].double()).t()
                     for e, (s, t) in enumerate(zip(starts, starts[1:]))])
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert torch.equal(y, ref.to(torch.bfloat16)) or rel(y, ref) < 2 ** -8  # one rounding of a float32 sum
    # the torch._scaled_mm loop it replaced (the layer benchmark's A/B row runs it): the same product
    assert rel(mm_fp8_per_expert_reference(a, sa, w, sw, counts, True), ref) < 1e-2


def test_mm_fp8_per_expert_checks_its_operands():
    """Bad operands or counts: a ValueError naming what is wrong (a RuntimeError is what
    _mm_fp8_per_expert takes for cuBLAS refusing the shape and falls back from)."""
    a, sa = torch.zeros(6, 32).to(torch.float8_e4m3fn), torch.ones(6)
    w, sw = torch.zeros(2, 16, 32).to(torch.float8_e4m3fn), torch.ones(2, 16)
    bad = {"counts must be non-negative": (a, sa, w, sw, [7, -1]),
           "sum to 5": (a, sa, w, sw, [2, 3]),
           "3 counts for 2 experts": (a, sa, w, sw, [2, 2, 2]),
           "scale_a must be": (a, sa[:5], w, sw, [3, 3]),
           "scale_b must be": (a, sa, w, sw.t(), [3, 3]),
           "weights": (a, sa, w[..., :16], sw, [3, 3]),
           "rows": (a.float(), sa, w, sw, [3, 3])}
    for msg, args in bad.items():
        with pytest.raises(ValueError, match=msg):
            ops.mm_fp8_per_expert(*args, True)
    assert ops.mm_fp8_per_expert(a[:0], sa[:0], w, sw, [0, 0], True).shape == (0, 16)


def test_offsets_host_and_device_paths_agree():
    """Counts on the host are checked and summed there (one copy to the GPU); the device path
    (check='async') sums them with cumsum: the same int32 offsets."""
    for counts in ([5, 0, 7], [0, 0, 0], [12]):
        tpe, rows = torch.tensor(counts), sum(counts)
        host, _ = experts._offsets(tpe, rows, len(counts), torch.device("cpu"), None)
        dev, _ = experts._offsets(tpe, rows, len(counts), torch.device("cpu"), "async")
        assert host.dtype == dev.dtype == torch.int32 and torch.equal(host, dev)
    # unchecked (check=False) counts are summed as they are
    off, _ = experts._offsets(torch.tensor([4, -1]), 9, 2, torch.device("cpu"), False)
    assert off.tolist() == [4, 3]


def test_bad_tokens_per_expert():
    mlp = FP8GroupedMLP(3, 128, 32)
    q = make_q(torch.randn(10, 128))
    with pytest.raises(ValueError, match="sums to 9"):
        mlp(q, torch.tensor([4, 0, 5]))
    with pytest.raises(ValueError, match="sums to 11"):
        grouped_linear(q, mlp.fc2_weight.transpose(1, 2), torch.tensor([4, 2, 5]))
    with pytest.raises(ValueError, match="3 counts"):
        mlp(q, torch.tensor([10, 0]))
    with pytest.raises(ValueError, match="negative"):
        mlp(q, torch.tensor([12, -2, 0]))
    with pytest.raises(ValueError, match="columns"):
        mlp(make_q(torch.randn(10, 256)), torch.tensor([10, 0, 0]))
    for bad in (torch.tensor([True, True, False]), torch.zeros(3, dtype=torch.long, device="meta")):
        with pytest.raises(ValueError, match="integer tensor"):
            mlp(q, bad)
    with pytest.raises(ValueError, match="check must be"):
        mlp(q, torch.tensor([10, 0, 0]), check="bogus")
    # the GPU default (no host read): asserted on the device; on CPU _assert_async raises at once
    # ([2**32 + 4, 6, 0]: int32 offsets would wrap to the right total; the check sums in int64;
    # [2**63 - 1, 2**63 - 1, 12]: so would an int64 sum, had the counts no upper bound)
    for counts in ([12, -2, 0], [4, 0, 5], [2**32 + 4, 6, 0], [2**63 - 1, 2**63 - 1, 12]):
        with pytest.raises(RuntimeError, match="count is negative"):
            mlp(q, torch.tensor(counts), check="async")


def test_backend_selection_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend"):
        FP8GroupedMLP(2, 128, 32, backend="cutlass")
    with pytest.raises(ValueError, match="activation"):
        FP8GroupedMLP(2, 128, 32, activation="silu")


def _block_input(device="cpu"):
    torch.manual_seed(8)
    x = torch.randn(40, 512) * torch.logspace(-2, 1, 512)
    x[3] = 0
    x[5, :128] = 0  # a zero block has scale 1: must not set the row's scale
    return quantize_reference(x.to(device), "block128")


def test_block_to_row_conversion():
    data, scale = _block_input()
    d, s = _block_to_row(data, scale)
    ref_d, ref_s = quantize_reference(dequantize_reference(data, scale), "row")
    assert torch.equal(s, ref_s) and torch.equal(d.view(torch.uint8), ref_d.view(torch.uint8))
    assert s[3] == 1 and s[5] < 0.1  # zero row; zero block ignored
    # the conversion costs one e4m3 rounding on the blocks below the row's amax
    err = rel(dequantize_reference(d, s), dequantize_reference(data, scale))
    assert 1e-3 < err < 0.05


# ------------------------------------------------------------------------------------------------
# GPU: the fast paths against the reference path

SHAPES = {"deepseek": (7168, 2048), "mixtral": (4096, 14336), "qwen3": (2048, 768)}
GPU_TPE = [300, 0, 77, 1, 130]


MLP_NAMES = ["y", "dx", "dw1", "dw2", "drw"]
# Fast and reference paths differ by accumulation order (and the scaled path's fast accumulation);
# the per-row e4m3 rounding of the activation turns a few of those last-bit differences into
# one-e4m3-step differences, which fc2 carries to y and to every gradient before it.
TOL = {"triton": 1e-2, "scaled_grouped_mm": 2.5e-2}


def _run_mlp(backend, hidden, ffn, act="swiglu", granularity="row", fp8_dgrad=False, rw=True, seed=0,
             fast_accum=True, fp8_wgrad=False, config=None, counts_on="cuda"):
    torch.manual_seed(seed)
    mlp = FP8GroupedMLP(len(GPU_TPE), hidden, ffn, act, backend=backend, fp8_dgrad=fp8_dgrad, device="cuda",
                        fast_accum=fast_accum, fp8_wgrad=fp8_wgrad, config=config)
    x, r = inputs(GPU_TPE, hidden, "cuda", seed)
    r = r if rw else None
    y = mlp(make_q(x, granularity), torch.tensor(GPU_TPE, device=counts_on), r)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
    return [y.detach(), x.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad] + ([r.grad] if rw else [])


@gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["scaled_grouped_mm", "triton"])
def test_gpu_mlp_vs_reference(backend, shape):
    hidden, ffn = SHAPES[shape]
    ref = _run_mlp("reference", hidden, ffn)
    check(MLP_NAMES, _run_mlp(backend, hidden, ffn), ref, TOL[backend])
    if backend == "scaled_grouped_mm" and shape == "deepseek":
        check(MLP_NAMES, _run_mlp(backend, hidden, ffn, fast_accum=False), ref, 1e-2)
        # torch._scaled_grouped_mm for the fast-accumulation GEMMs too (the TMA kernel otherwise)
        check(MLP_NAMES, _run_mlp(backend, hidden, ffn, config=ExpertsConfig(tma_max_rows_per_expert=0)), ref,
              TOL[backend])
    if backend == "triton":  # the Triton dgrad / wgrad kernels too (torch._grouped_mm otherwise)
        check(MLP_NAMES, _run_mlp(backend, hidden, ffn, config=ExpertsConfig(triton_backward=True)), ref,
              TOL[backend])


@gpu
@pytest.mark.parametrize("fp8_dgrad", [False, True])
def test_gpu_dense_per_expert(fp8_dgrad, monkeypatch):
    """Host counts from dense_min_rows_per_expert rows per expert on: the forward and FP8 dgrad GEMMs
    run one dense cuBLAS GEMM per expert with rows (experts starting off 16 bytes of the row scales
    and one of one row among them), one extension call per projection, and give the reference's
    output and gradients, and the grouped GEMMs' (device counts) up to accumulation order; no
    fallback taken."""
    calls, per_expert = [], ops.mm_fp8_per_expert
    monkeypatch.setattr(ops, "mm_fp8_per_expert", lambda *args: calls.append(list(args[4])) or per_expert(*args))
    cfg = ExpertsConfig(dense_min_rows_per_expert=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a refused call would warn and fall back
        got = _run_mlp("scaled_grouped_mm", 2048, 768, fp8_dgrad=fp8_dgrad, config=cfg, counts_on="cpu")
    assert calls == [list(GPU_TPE)] * (4 if fp8_dgrad else 2) and not experts._DENSE_REFUSED
    check(MLP_NAMES, got, _run_mlp("reference", 2048, 768, fp8_dgrad=fp8_dgrad), TOL["scaled_grouped_mm"])
    check(MLP_NAMES, got, _run_mlp("scaled_grouped_mm", 2048, 768, fp8_dgrad=fp8_dgrad, config=cfg), 1e-2)


@gpu
@pytest.mark.parametrize("fast_accum", [True, False])
def test_gpu_mm_fp8_per_expert_matches_scaled_mm(fast_accum):
    """ops.mm_fp8_per_expert (cuBLASLt, one call for every expert) against torch._scaled_mm per expert
    with the same row and channel scales, and against its CPU twin: experts whose row scales start
    off 16 bytes (copied), an empty one, a one-row one, counts of one algorithm bucket and the next;
    a second call (the cached algorithms) gives the same bytes."""
    torch.manual_seed(29)
    N, K = 768, 2048
    for counts in ([300, 0, 1, 129, 128, 1000], [256, 512, 64, 1024]):
        M, E = sum(counts), len(counts)
        a = (torch.randn(M, K, device="cuda") * 8).to(torch.float8_e4m3fn)
        w = (torch.randn(E, N, K, device="cuda") * 8).to(torch.float8_e4m3fn)
        sa, sw = torch.rand(M, device="cuda") + 0.5, torch.rand(E, N, device="cuda") + 0.5
        got = ops.mm_fp8_per_expert(a, sa, w, sw, counts, fast_accum)
        assert torch.equal(got, ops.mm_fp8_per_expert(a, sa, w, sw, counts, fast_accum))
        cpu = ops.mm_fp8_per_expert(a.cpu(), sa.cpu(), w.cpu(), sw.cpu(), counts, fast_accum)
        ref = mm_fp8_per_expert_reference(a, sa, w, sw, counts, fast_accum)  # torch._scaled_mm per expert
        for e, (start, n) in enumerate(zip(itertools.accumulate(counts, initial=0), counts)):
            if n:
                rows = slice(start, start + n)
                assert rel(got[rows], ref[rows]) < 4e-3 and rel(got[rows].cpu(), cpu[rows]) < 5e-3, (counts, e)


@gpu
@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("backend", ["scaled_grouped_mm", "triton"])
def test_gpu_activations(backend, act):
    check(MLP_NAMES, _run_mlp(backend, 2048, 768, act), _run_mlp("reference", 2048, 768, act), TOL[backend])


@gpu
@pytest.mark.parametrize("backend", ["scaled_grouped_mm", "triton"])
def test_gpu_fp8_dgrad(backend):
    check(MLP_NAMES, _run_mlp(backend, 2048, 768, fp8_dgrad=True), _run_mlp("reference", 2048, 768, fp8_dgrad=True),
          TOL[backend])


@gpu
@pytest.mark.parametrize("tpe", [GPU_TPE, [0, 40, 0], [300, 0, 128, 129], [300], [0] * 1100 + [129]],
                         ids=["uneven", "empty_ends", "blocks", "one_expert", "1101_experts"])
@pytest.mark.parametrize("source", ["bf16", "row", "block128", "tensor"])
def test_gpu_block_col_quant_t_equals_the_emulation(source, tpe):
    """triton_kernels.block_col_quant_t against experts._block_col_quant_t, byte for byte: data,
    scales and the zero padding of every group (the columns past the last group are never read)."""
    from fp8a2a import triton_kernels as tk
    torch.manual_seed(16)
    offs = torch.cumsum(torch.tensor(tpe, device="cuda"), 0, dtype=torch.int32)
    M, C = sum(tpe), 1664 if source == "block128" else 1600  # 1600: a partial column tile
    v = torch.randn(M, C, device="cuda") * torch.logspace(-3, 2, C, device="cuda")
    if source == "bf16":
        x, sx, vf = v.bfloat16(), None, v.bfloat16().float()
    else:
        x, sx = quantize_reference(v, source)
        sx = sx.reshape(1).expand(M) if source == "tensor" else sx
        vf = experts._dequant(x, sx)
    pad_offs, mpad = experts._wgrad_padding(offs, M)
    ref_q, ref_s = experts._block_col_quant_t(vf, offs, pad_offs, mpad)
    data, scale = tk.block_col_quant_t(x, offs, pad_offs, mpad, sx=sx)
    used = int(pad_offs[-1])
    assert data.shape == (C, mpad) and torch.equal(scale[:used // 128], ref_s[:used // 128])
    assert torch.equal(data[:, :used].view(torch.uint8), ref_q[:, :used].view(torch.uint8))


@gpu
@pytest.mark.parametrize("tpe", [GPU_TPE, [0, 1000, 0, 129], [300]], ids=["uneven", "empty", "one_expert"])
@pytest.mark.parametrize("shape", [(768, 2048), (200, 72)], ids=["aligned", "partial_tiles"])
def test_gpu_grouped_wgrad_fp8_equals_the_emulation(shape, tpe):
    """triton_kernels.grouped_wgrad_fp8 on block_col_quant_t's operands: the emulated FP8 weight
    gradient up to accumulation order and the bf16 output; zeros for an expert without rows."""
    from fp8a2a import triton_kernels as tk
    torch.manual_seed(19)
    (N, K), M = shape, sum(tpe)
    offs = torch.cumsum(torch.tensor(tpe, device="cuda"), 0, dtype=torch.int32)
    g, x = torch.randn(M, N, device="cuda").bfloat16(), torch.randn(M, K, device="cuda").bfloat16()
    pad_offs, mpad = experts._wgrad_padding(offs, M)
    a, sa = tk.block_col_quant_t(g, offs, pad_offs, mpad)
    b, sb = tk.block_col_quant_t(x, offs, pad_offs, mpad)
    got = tk.grouped_wgrad_fp8(a, sa, b, sb, pad_offs)
    ref = experts._wgrad_fp8_reference(g.float(), x.float(), offs, len(tpe))
    assert got.shape == (len(tpe), N, K) and rel(got, ref) < 1e-2
    for e, n in enumerate(tpe):
        if n == 0:
            assert got[e].abs().max() == 0


@gpu
@pytest.mark.parametrize("granularity", ["row", "block128"])
def test_gpu_fp8_wgrad_grouped_linear_vs_emulation(granularity):
    """Same dY and input on both backends: the GPU FP8 wgrad is the emulated one up to accumulation
    order and the bf16 output."""
    tpe = torch.tensor(GPU_TPE, device="cuda")
    torch.manual_seed(17)
    w = (torch.randn(len(GPU_TPE), 768, 2048, device="cuda") * 0.02).bfloat16().requires_grad_()
    x = torch.randn(sum(GPU_TPE), 2048, device="cuda")
    rw = torch.rand(sum(GPU_TPE), device="cuda")
    q = make_q(x, granularity)
    dws = []
    for be in ("reference", "scaled_grouped_mm"):
        y = grouped_linear(q, w, tpe, rw, backend=be, fp8_wgrad=True)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(18)).to("cuda", torch.bfloat16))
        dws.append(w.grad)
        w.grad = None
    assert rel(dws[1], dws[0]) < 1e-2 and dws[1][1].abs().max() == 0


@gpu
@pytest.mark.parametrize("tpe", [GPU_TPE, [0, 1000, 0, 129], [300]], ids=["uneven", "empty", "one_expert"])
def test_gpu_fp8_wgrad_per_expert_cublas(tpe):
    """Host counts: the FP8 wgrad's per-expert cuBLAS GEMMs (1 x 128 scales on both operands) give
    the emulated gradient up to accumulation order, and the Triton grouped GEMM's (device counts) to
    within the bf16 output's rounding; zeros for an expert without rows; no fallback taken."""
    torch.manual_seed(21)
    w = (torch.randn(len(tpe), 768, 2048, device="cuda") * 0.02).bfloat16().requires_grad_()
    x, rw = torch.randn(sum(tpe), 2048, device="cuda"), torch.rand(sum(tpe), device="cuda")
    q = make_q(x)
    dy = torch.randn(sum(tpe), 768, generator=torch.Generator().manual_seed(22)).to("cuda", torch.bfloat16)
    dws = []
    for be, counts in (("reference", torch.tensor(tpe)), ("scaled_grouped_mm", torch.tensor(tpe)),
                       ("scaled_grouped_mm", torch.tensor(tpe, device="cuda"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a refused cuBLAS call would warn and fall back
            grouped_linear(q, w, counts, rw, backend=be, fp8_wgrad=True,
                           config=ExpertsConfig(cublas_wgrad_min_rows_per_expert=0)).backward(dy)
        dws.append(w.grad)
        w.grad = None
    assert not experts._CUBLAS_BLOCKWISE_REFUSED
    for e, n in enumerate(tpe):  # expert by expert: a wrong small one would hide in a global norm
        if n == 0:
            assert dws[1][e].abs().max() == 0
        else:
            assert rel(dws[1][e], dws[0][e]) < 1e-2 and rel(dws[1][e], dws[2][e]) < 5e-3, e


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_wgrad_fp8_per_expert_matches_scaled_mm(out_dtype):
    """ops.wgrad_fp8_per_expert (cuBLASLt, one call for every expert) against torch._scaled_mm per
    expert with the same 1 x 128 scales, and against its CPU twin; experts starting off 256-byte
    alignment, one without columns, and a second width of the operands (the cached algorithm under
    another leading dimension)."""
    torch.manual_seed(23)
    widths, tol = [384, 0, 128, 1024], 1e-5 if out_dtype == torch.float32 else 4e-3  # bf16: another algorithm's rounding
    for mpad in (1536, 2048):
        a, b = ((torch.randn(n, mpad, device="cuda") * 8).to(torch.float8_e4m3fn) for n in (768, 2048))
        sa, sb = (torch.rand(mpad // 128, n, device="cuda") + 0.5 for n in (768, 2048))
        got = ops.wgrad_fp8_per_expert(a, sa, b, sb, widths, out_dtype)
        cpu = ops.wgrad_fp8_per_expert(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), widths, out_dtype)
        assert got.shape == (4, 768, 2048) and got.dtype == out_dtype
        start = 0
        for e, w in enumerate(widths):
            blocks = slice(start // 128, (start + w) // 128)
            if w == 0:
                assert got[e].abs().max() == 0
                continue
            ref = torch._scaled_mm(a[:, start:start + w], b[:, start:start + w].t(), scale_a=sa[blocks].t(),
                                   scale_b=sb[blocks], out_dtype=out_dtype)
            assert rel(got[e], ref) < tol and rel(got[e].cpu(), cpu[e]) < 5e-3, (mpad, e)
            start += w


@gpu
def test_gpu_fp8_wgrad_mlp():
    ref = _run_mlp("reference", 2048, 768, fp8_wgrad=True)
    got = _run_mlp("scaled_grouped_mm", 2048, 768, fp8_wgrad=True)
    # dW1 / dW2 also carry the forward's one-e4m3-step differences (TOL), which the
    # requantization of dZ / h per 128-token block can enlarge; the wgrad itself is held to 1e-2 by the test above
    check(MLP_NAMES, got, ref, TOL["scaled_grouped_mm"])
    assert got[2][1].abs().max() == 0 and got[3][1].abs().max() == 0  # expert 1 has no rows
    bf16 = _run_mlp("scaled_grouped_mm", 2048, 768)
    check(MLP_NAMES[2:4], got[2:4], bf16[2:4], 0.05)


@gpu
@pytest.mark.parametrize("granularity", ["block128", "block128-convert", "tensor"])
@pytest.mark.parametrize("backend", ["scaled_grouped_mm", "triton"])
def test_gpu_grouped_linear_granularities(backend, granularity):
    convert = granularity == "block128-convert"
    granularity = granularity.split("-")[0]
    config = ExpertsConfig(block128_native=not convert)
    tpe = torch.tensor(GPU_TPE, device="cuda")
    torch.manual_seed(9)
    w = (torch.randn(len(GPU_TPE), 768, 2048, device="cuda") * 0.02).bfloat16().requires_grad_()
    outs = {}
    for be in ("reference", backend):
        x, rw = inputs(GPU_TPE, 2048, "cuda", 10)
        q = make_q(x, granularity)
        y = grouped_linear(q, w, tpe, rw, backend=be, config=config)
        y.backward(torch.ones_like(y))
        outs[be] = [y.detach(), x.grad, w.grad.clone(), rw.grad]
        w.grad = None
    tol = dict(y=1e-2, dx=1e-2, dw=1e-2, drw=1e-2)
    if backend == "scaled_grouped_mm" and convert:
        # the forward GEMM ran on the row-converted input (one more e4m3 rounding): close to the
        # reference on that input; d rw recomputes that forward; dx and dw use the block input as it is
        d, s = _block_to_row(q.data, q.scale)
        ref_conv = grouped_linear(QuantizedTensor(d, s, "row"), w.detach(), tpe, rw.detach(), backend="reference")
        assert rel(outs[backend][0], ref_conv) < 1e-2
        tol.update(y=5e-2, drw=5e-2)
    check(["y", "dx", "dw", "drw"], outs[backend], outs["reference"], tol)


@gpu
def test_gpu_triton_backward_kernels():
    from fp8a2a import triton_kernels as tk
    torch.manual_seed(11)
    offs = torch.cumsum(torch.tensor(GPU_TPE, device="cuda"), 0, dtype=torch.int32)
    M = sum(GPU_TPE)
    g = torch.randn(M, 768, device="cuda").bfloat16()
    w = torch.randn(len(GPU_TPE), 768, 2048, device="cuda").bfloat16()
    dx = tk.grouped_mm(g, w, offs, b_strides=(w.stride(0), w.stride(2), w.stride(1)), n=2048)
    assert rel(dx, experts._ref_mm(g, w.transpose(-2, -1), offs)) < 5e-3
    for gran in ("row", "block128"):
        xq, xs = quantize_reference(torch.randn(M, 2048, device="cuda"), gran)
        dw = tk.grouped_wgrad(g, xq, offs, sx=xs)
        ref = experts._ref_wgrad(g, dequantize_reference(xq, xs, torch.bfloat16), offs, len(GPU_TPE))
        assert rel(dw, ref) < 5e-3 and dw[1].abs().max() == 0


@gpu
@pytest.mark.parametrize("tpe,n,k", [(GPU_TPE, 768, 2048), ([0, 40, 0, 300], 200, 2064), ([5], 256, 128),
                                     ([0, 0, 0], 256, 256), ([129, 127, 128, 255], 512, 384),
                                     ([1000, 0, 3000, 1, 2500], 768, 256)])
def test_gpu_grouped_mm_fp8_tma(tpe, n, k):
    # the TMA kernel the scaled_grouped_mm backend uses at few rows per expert: ragged groups, empty
    # experts and inputs, N and K not multiples of its 128 x 256 x 128 tile, a strided row scale, and
    # more tiles than SMs (its persistent programs take several tiles each)
    from fp8a2a import triton_kernels as tk
    torch.manual_seed(12)
    E, M = len(tpe), sum(tpe)
    offs = torch.cumsum(torch.tensor(tpe, device="cuda"), 0, dtype=torch.int32)
    wq, sw = fp8_weight((torch.randn(E, n, k, device="cuda") * 0.02).bfloat16())
    xq, xs = quantize_reference(torch.randn(M, k, device="cuda"), "row")
    xs = torch.stack([xs, -xs], 1)[:, 0]  # stride 2
    assert tk.fp8_tma_ok(xq, wq)
    y = tk.grouped_mm_fp8(xq, xs, wq, sw, offs)
    ref = experts._ref_mm(experts._dequant(xq, xs), experts._dequant(wq.flatten(0, 1), sw.flatten()).view(wq.shape), offs)
    assert y.shape == (M, n) and y.dtype == torch.bfloat16
    if M:
        assert rel(y, ref) < 5e-3
        for group_m in (1, 3, 8):  # tile orders (fp8_group_m picks 1 or 8 by K): each tile computed alike
            assert torch.equal(tk.grouped_mm_fp8(xq, xs, wq, sw, offs, group_m=group_m), y)
    if n % 16 == 0 and M:  # the op it stands in for: the same arithmetic (fast accumulation)
        y_op = torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs.contiguous(), sw, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
        assert rel(y, y_op) < 2e-3


@gpu
def test_gpu_scaled_grouped_mm_fallback_and_edges():
    # K = 2056 is not a multiple of 16 bytes... of fp8 elements it is (2056 % 16 == 8): the op refuses,
    # the Triton kernel takes over with a warning.
    tpe = torch.tensor([0, 64, 0], device="cuda")
    w = (torch.randn(3, 64, 2056, device="cuda") * 0.02).bfloat16()
    x = torch.randn(64, 2056, device="cuda")
    with pytest.warns(RuntimeWarning, match="Triton"):
        y = grouped_linear(make_q(x), w, tpe, backend="scaled_grouped_mm")
    y_ref = grouped_linear(make_q(x), w, tpe, backend="reference")
    assert rel(y, y_ref) < 1e-2
    # empty input, all rows on one expert
    mlp = FP8GroupedMLP(4, 2048, 768, device="cuda")
    assert mlp(make_q(torch.zeros(0, 2048, device="cuda")), torch.zeros(4, dtype=torch.int64, device="cuda")).shape == (0, 2048)
    q = make_q(torch.randn(50, 2048, device="cuda"))
    one = torch.tensor([0, 0, 50, 0], device="cuda")
    assert rel(mlp(q, one), FP8GroupedMLP.forward(mlp, q, one.cpu())) < 1e-6
    with pytest.raises(ValueError, match="sums to"):
        mlp(q, torch.tensor([0, 0, 49, 0], device="cuda"), check=True)


@gpu
def test_gpu_triton_elementwise_kernels():
    from fp8a2a import triton_kernels as tk
    data, scale = _block_input("cuda")
    d, s = tk.act_quant(data, None, "identity", z_scale=scale)  # block128 -> row, bit-exact to the rule
    ref_d, ref_s = quantize_reference(dequantize_reference(data, scale), "row")
    assert torch.equal(s, ref_s) and torch.equal(d.view(torch.uint8), ref_d.view(torch.uint8))
    # the FP8 dgrad's dY: each row times its expert's column scales, then per row; the CPU path's bytes
    tpe = torch.tensor([100, 0, 233, 0])
    g = torch.randn(333, 1500, device="cuda").bfloat16()
    cs = torch.rand(4, 1500, device="cuda") * torch.logspace(-6, 0, 1500, device="cuda")
    offs = torch.cumsum(tpe, 0, dtype=torch.int32).cuda()
    d, s = tk.act_quant(g, None, "identity", col_scale=cs, offs=offs)
    ref_d, ref_s = quantize_reference(g.float() * cs[torch.repeat_interleave(torch.arange(4), tpe).cuda()], "row")
    cpu_d, cpu_s = experts._quant_col_scaled(experts._Cfg("reference"), g.cpu(), cs.cpu(), offs.cpu())
    for dd, ss in ((d, s), (cpu_d, cpu_s)):
        assert torch.equal(ss.cpu(), ref_s.cpu()) and torch.equal(dd.view(torch.uint8).cpu(), ref_d.view(torch.uint8).cpu())
    # rows longer than a block (two passes: fc1's dgrad at 2 * ffn > 8192), a NaN row, rows past the
    # last group (check=False): the CPU path's bytes, NaN scales included
    tpe = torch.tensor([3, 0, 2])
    g = torch.randn(7, 9000, device="cuda").bfloat16()
    g[1, 4321] = float("nan")
    cs = torch.rand(3, 9000, device="cuda")
    offs = torch.cumsum(tpe, 0, dtype=torch.int32).cuda()
    d, s = tk.act_quant(g, None, "identity", col_scale=cs, offs=offs)
    cpu_d, cpu_s = experts._quant_col_scaled(experts._Cfg("reference"), g.cpu(), cs.cpu(), offs.cpu())
    assert s[1].isnan() and cpu_s[1].isnan() and torch.equal(s.cpu().view(torch.int32)[[0, 2, 3, 4, 5, 6]],
                                                              cpu_s.view(torch.int32)[[0, 2, 3, 4, 5, 6]])
    assert torch.equal(d.view(torch.uint8).cpu(), cpu_d.view(torch.uint8))
    z = torch.randn(333, 2 * 1500, device="cuda").bfloat16()
    rw = torch.rand(333, device="cuda")
    for act in ("swiglu", "gelu", "relu"):
        zz = z if act == "swiglu" else z[:, :1500].contiguous()
        q, qs = tk.act_quant(zz, rw, act)
        h = F.silu(zz[:, :1500].float()) * zz[:, 1500:].float() if act == "swiglu" else (
            F.gelu(zz.float()) if act == "gelu" else F.relu(zz.float()))
        rq, rqs = quantize_reference(h * rw[:, None], "row")
        torch.testing.assert_close(qs, rqs, rtol=1e-6, atol=0)
        assert (q.float() == rq.float()).float().mean() > 0.999


def test_constant_is_made_once_per_key():
    from fp8a2a.kernels import constant
    made = []

    def make():
        made.append(1)
        return torch.ones(3)
    a = constant(("test_constant", 3), make)
    b = constant(("test_constant", 3), make)
    assert a is b and made == [1] and torch.equal(a, torch.ones(3))
    assert constant(("test_constant", 4), lambda: torch.zeros(4)).shape == (4,)


def test_second_derivatives_raise():
    """The expert GEMMs' backward has no derivative of its own: differentiating their gradients
    raises instead of silently dropping the second-order terms."""
    x = torch.randn(9, 64, requires_grad=True)
    w = torch.randn(3, 32, 64, requires_grad=True)
    y = grouped_linear(make_q(x), w, torch.tensor([4, 0, 5]))
    g, = torch.autograd.grad((y.float() ** 2).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (g * g).sum().backward()
    mlp = FP8GroupedMLP(3, 64, 32)  # the fused MLP's own Function, for its weights and its input
    y = mlp(make_q(x), torch.tensor([4, 0, 5]))
    for wrt in (mlp.fc1_weight, x):
        g, = torch.autograd.grad((y.float() ** 2).sum(), wrt, create_graph=True, retain_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            (g * g).sum().backward()
