"""The extension's ops against plain-torch references: exact bytes, routing and count semantics,
and the inputs that are not happy paths. CUDA bytes against CPU bytes: tests/gpu/test_cuda_ops.py."""
import pytest
import torch

import fp8a2a
from fp8a2a import ops
from fp8a2a.reference import (combine_backward_rows_reference, dequantize_reference, drop_to_capacity_reference,
                              quantize_reference, route_reference)
from fp8a2a.wire import CountsCol, Granularity

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def u8(t):
    """Bytes of an e4m3 tensor, NaN canonicalised to 0x7f (torch keeps the sign of a NaN, fp8a2a
    writes one NaN pattern; every other byte must match exactly)."""
    if t.dtype != torch.float8_e4m3fn:
        return t
    b = t.view(torch.uint8)
    return torch.where(b & 0x7F == 0x7F, torch.full_like(b, 0x7F), b)


def nasty(t, h, dtype, seed=0):
    """Rows spanning 1e-6 .. 1e3 in magnitude, a zero row, a NaN row, an Inf row and a row whose
    amax is below the scale rule's floor (2^-117; zero in float16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-6, 3, t).unsqueeze(1)
    if t >= 4:
        x[1] = 0
        x[2, h // 2] = float("nan")
        x[3, 0] = float("-inf")
    if t >= 6:
        x[5] = x[5] / x[5].abs().amax() * 2e-36
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity", ["row", "block128", "tensor"])
def test_quantize_bit_exact(dtype, granularity):
    x = nasty(33, 256, dtype)
    q = fp8a2a.quantize(x, granularity)
    data, scale = quantize_reference(x, granularity)
    assert torch.equal(u8(q.data), u8(data))
    assert torch.equal(q.scale, scale) or torch.allclose(q.scale, scale, equal_nan=True, rtol=0, atol=0)
    assert q.scale.shape == {"row": (33,), "block128": (33, 2), "tensor": ()}[granularity]


def test_cast_matches_torch_on_every_float_pattern():
    f = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)  # every bf16-exact value
    f = torch.cat([f, torch.randn(1 << 16) * torch.logspace(-12, 4, 1 << 16)])
    finite = f[torch.isfinite(f)]  # (a tensor-scaled row holding NaN or Inf is NaN throughout)
    data, _ = ops.quantize(finite.view(1, -1), 2, torch.ones(()))
    assert torch.equal(u8(data[0]), u8(finite.to(torch.float8_e4m3fn)))


def _rows_with_nonfinite(dtype):
    """Rows of magnitude up to ~40; rows 1, 3, 4 hold an Inf, a NaN, a -Inf (the rest finite)."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)) * 10
    x[1, 7], x[3, 200], x[4, 0] = float("inf"), float("nan"), float("-inf")
    return x.to(dtype), torch.tensor([False, True, False, True, True, False])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_scale_makes_a_nonfinite_row_nan_throughout(dtype):
    """With a given tensor scale an Inf would saturate (a finite 448 * scale) and a NaN leave the
    rest of its row finite: such a row is e4m3 NaN throughout, the other rows torch's cast."""
    x, bad = _rows_with_nonfinite(dtype)
    s = torch.tensor(0.05)
    q = fp8a2a.quantize(x, "tensor", scale=s)
    want = (x.float() * torch.div(torch.tensor(1.0), s)).to(torch.float8_e4m3fn)  # multiplier 1 / s
    assert (q.data[bad].view(torch.uint8) == 0x7F).all()
    assert torch.equal(u8(q.data[~bad]), u8(want[~bad])) and torch.isfinite(want[~bad].float()).all()
    xh = fp8a2a.dequantize(q, torch.float32)
    assert xh[bad].isnan().all() and torch.equal(xh[~bad], want[~bad].float() * s)
    # dispatch_pack's tensor wire: a given [s] (multiplier 1 / s) and [s, q] from an amax of 40
    idx, w = routing(6, 2, 4)  # every token routed: with one rank, send row j is token j
    mult = torch.div(torch.tensor(448.0), torch.tensor(40.0))
    for ts, qm in ((s.reshape(1), torch.div(torch.tensor(1.0), s)), (torch.stack([40.0 / mult, mult]), mult)):
        send, counts, _ = ops.dispatch_pack(x, idx, w, 4, 1, 2, ts)
        assert counts[0, CountsCol.ROWS] == 6
        payload = send[:6, :256]
        assert (payload[bad] == 0x7F).all()
        assert torch.equal(payload[~bad], u8((x[~bad].float() * qm).to(torch.float8_e4m3fn)).view(torch.uint8))
        data, sc, _, _, _, row_src = unpack_all(send, counts, 256, 2, 2)
        xh = ops.dequantize(data, sc, torch.float32)
        assert xh[bad[row_src.long()]].isnan().all() and torch.isfinite(xh[~bad[row_src.long()]]).all()


def test_special_rows():
    x = nasty(8, 64, torch.float32)
    q = fp8a2a.quantize(x)
    xh = fp8a2a.dequantize(q, torch.float32)
    assert q.scale[1] == 1 and torch.all(xh[1] == 0)  # all-zero row: scale 1, no NaN
    assert xh[2].isnan().all() and xh[3].isnan().all()  # NaN / Inf rows: NaN, never finite
    assert torch.isfinite(xh[[0, 4, 5, 6, 7]]).all()
    rel = (xh[4:] - x[4:]).norm() / x[4:].norm()
    assert rel < 0.04


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["row", "block128", "tensor"])
def test_tiny_rows_stay_finite(dtype, granularity):
    # amax below 448 / FLT_MAX (~1.3e-36) would make 448 / amax inf and the row's zeros NaN
    x = torch.zeros(4, 256)
    x[0, 0], x[1, 0], x[1, 5], x[2, 130] = 2e-36, 1e-36, -3e-38, 1e-37
    if granularity != "tensor":  # one scale for all: 1e-30 beside 1e-36 would round those to 0
        x[3, 7] = 1e-30
    x = x.to(dtype)
    q = fp8a2a.quantize(x, granularity)
    data, scale = quantize_reference(x, granularity)
    assert torch.equal(u8(q.data), u8(data)) and torch.equal(q.scale, scale)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    xh = fp8a2a.dequantize(q, torch.float32)
    assert torch.isfinite(xh).all() and torch.equal(xh == 0, x.float() == 0)
    nz = x.float() != 0
    assert torch.allclose(xh[nz], x.float()[nz], rtol=0.07, atol=0)


def test_roundtrip_error_bound():
    x = torch.randn(256, 7168)
    xh = fp8a2a.dequantize(fp8a2a.quantize(x), torch.float32)
    rel = ((xh - x).norm() / x.norm()).item()
    assert 0.015 < rel < 0.035  # about 0.026 for e4m3 (3 mantissa bits) row-scaled N(0, 1)


@pytest.mark.parametrize("granularity", ["row", "block128", "tensor"])
def test_dequantize_matches_reference(granularity):
    q = fp8a2a.quantize(torch.randn(16, 256), granularity)
    for dtype in DTYPES:
        assert torch.equal(fp8a2a.dequantize(q, dtype), dequantize_reference(q.data, q.scale, dtype))


def test_quantize_grad_is_straight_through():
    x = torch.randn(4, 32, requires_grad=True)
    fp8a2a.dequantize(fp8a2a.quantize(x), torch.float32).mul(3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3))


def test_bad_inputs():
    with pytest.raises(RuntimeError, match="block128 granularity needs hidden % 128"):
        fp8a2a.quantize(torch.randn(4, 200), "block128")
    with pytest.raises(ValueError, match="granularity"):
        fp8a2a.quantize(torch.randn(4, 128), "column")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        fp8a2a.quantize(torch.zeros(4, 128, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="2-D"):
        fp8a2a.quantize(torch.randn(4, 2, 64))
    with pytest.raises(RuntimeError, match="contiguous"):
        fp8a2a.quantize(torch.randn(128, 4).t())
    for bad in (0.0, -1.0, 1e-39, float("nan"), float("inf")):  # 1e-39: 1 / scale would overflow
        with pytest.raises(ValueError, match="finite and >="):
            fp8a2a.quantize(torch.randn(4, 128), "tensor", scale=torch.tensor(bad))
    with pytest.raises(ValueError, match="one element"):
        fp8a2a.quantize(torch.randn(4, 128), "tensor", scale=torch.ones(2))
    q = fp8a2a.quantize(torch.randn(4, 128))
    with pytest.raises(TypeError, match="got QuantizedTensor"):
        fp8a2a.quantize(q)
    with pytest.raises(TypeError, match="expects a QuantizedTensor"):
        fp8a2a.dequantize(torch.randn(4, 128))
    assert q != fp8a2a.quantize(torch.randn(4, 128)) and q == q  # identity, never an ambiguous tensor ==
    assert "grad_anchor" not in repr(fp8a2a.quantize(torch.randn(4, 128, requires_grad=True)))
    with pytest.raises(RuntimeError, match="row scale"):
        ops.dequantize(q.data, q.scale[:3], torch.float32)


def test_fake_quantize_checks_like_the_real_op():
    # under torch.compile the fake runs at trace time: it must reject what the op rejects
    from torch._subclasses.fake_tensor import FakeTensorMode
    for gran, msg in ((1, "block128 granularity needs hidden % 128"), (3, "takes granularity row, block128 or tensor")):
        with pytest.raises(RuntimeError, match=msg):
            ops._ops.quantize(torch.randn(4, 100), gran, None)
        with FakeTensorMode(), pytest.raises(RuntimeError, match=msg):
            ops._ops.quantize(torch.randn(4, 100), gran, None)


def test_hidden_not_multiple_of_16_and_empty():
    for h in [1, 7, 200]:
        x = torch.randn(5, h)
        assert torch.equal(u8(fp8a2a.quantize(x).data), u8(quantize_reference(x)[0]))
    q = fp8a2a.quantize(torch.randn(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0,)
    assert fp8a2a.quantize(torch.randn(3, 0)).scale.tolist() == [1.0, 1.0, 1.0]  # empty rows: amax 0
    assert fp8a2a.scale_for_tensor(torch.randn(0, 64)).item() == 1.0  # empty tensor: amax 0, scale 1
    x = torch.randn(4, 64)
    assert torch.equal(fp8a2a.scale_for_tensor(x), torch.div(x.abs().amax(), torch.tensor(448.0)))


# ---- send side, receive side, combine ------------------------------------------------------

def routing(t, k, e, seed=0, bad=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    if t > 1:
        idx[0, -1] = -1
    if bad and t > 2:
        idx[2, 0] = e
    return idx, torch.rand(t, k, generator=g)


def unpack_all(send, counts, hidden, gran, k):
    rows = counts[:, CountsCol.ROWS].sum().item()
    n = counts[:, CountsCol.EXPERTS:].sum().item()
    return ops.dispatch_unpack(send[:rows], counts, hidden, gran, k, n)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_pack_layout_semantics(k, ranks):
    t, h, e = 40, 48, 16
    x = nasty(t, h, torch.bfloat16)
    idx, w = routing(t, k, e)
    send, counts, send_pos = ops.dispatch_pack(x, idx, w, e, ranks, 0, None)
    per_rank = e // ranks
    expected = route_reference(idx, e, ranks)
    assert counts[:, CountsCol.ROWS].tolist() == [len(expected[r]) for r in range(ranks)]
    assert counts[:, CountsCol.HIDDEN].tolist() == [h] * ranks and counts[:, CountsCol.BAD_IDS].sum() == 0
    per_expert = torch.zeros(e, dtype=torch.long)
    for v in idx.flatten().tolist():
        if v >= 0:
            per_expert[v] += 1
    assert torch.equal(counts[:, CountsCol.EXPERTS:].flatten(), per_expert)
    data_ref, scale_ref = quantize_reference(x)
    layout = ops_layout(h, 0, k)
    offset = 0
    for r in range(ranks):
        for j, tok in enumerate(expected[r]):
            row = send[offset + j]
            assert send_pos[tok, r] == offset + j
            assert torch.equal(row[:h], u8(data_ref[tok]))
            assert row[layout["scale"]:layout["scale"] + 4].view(torch.float32).item() == scale_ref[tok].item() or \
                scale_ref[tok].isnan()
            ids = row[layout["expert"]:layout["expert"] + 4 * k].view(torch.int32)
            wts = row[layout["weight"]:layout["weight"] + 4 * k].view(torch.float32)
            for s in range(k):
                mine = idx[tok, s] >= 0 and idx[tok, s] // per_rank == r
                assert ids[s] == (idx[tok, s] % per_rank if mine else -1)
                assert wts[s] == (w[tok, s] if mine else 0)
        offset += len(expected[r])
    assert (send_pos >= 0).sum() == offset


def ops_layout(h, gran, k):
    nscale = {0: 1, 1: h // 128, 2: 1, 3: 0}[gran]
    scale = (h + 3) // 4 * 4
    return {"scale": scale, "weight": scale + 4 * nscale, "expert": scale + 4 * nscale + 4 * k}


@pytest.mark.parametrize("gran", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_unpack_roundtrip_is_expert_major_quantization(gran, k):
    t, h, e = 37, 256, 8
    x = nasty(t, h, torch.float32)
    idx, w = routing(t, k, e, seed=k)
    scale = torch.tensor(0.5) if gran == 2 else None
    send, counts, _ = ops.dispatch_pack(x, idx, w, e, 1, gran, scale)
    data, sc, wts, tpe, slot_pos, row_src = unpack_all(send, counts, h, gran, k)
    data_ref, scale_ref = quantize_reference(x, ["row", "block128", "tensor"][gran], scale)
    # expert-major: expert 0's tokens in token order, then expert 1's, ...
    order = [(tok, s) for ex in range(e) for tok in range(t) for s in range(k) if idx[tok, s] == ex]
    toks = torch.tensor([tok for tok, _ in order], dtype=torch.long)
    assert torch.equal(tpe, torch.bincount(idx[idx >= 0], minlength=e))
    assert torch.equal(u8(data), u8(data_ref[toks]))
    if gran != 2:
        assert torch.allclose(sc, scale_ref[toks], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(wts, torch.tensor([w[tok, s].item() for tok, s in order]))
    for n, (tok, s) in enumerate(order):
        assert slot_pos[row_src[n], s] == n


def test_a_token_on_two_local_experts_appears_under_both():
    x = torch.randn(1, 32)
    send, counts, _ = ops.dispatch_pack(x, torch.tensor([[6, 5]]), torch.tensor([[0.25, 0.75]]), 8, 2, 0, None)
    assert counts[:, CountsCol.ROWS].tolist() == [0, 1]  # both experts on rank 1: one row on the wire
    # rank 1 receives that one row (from a single source here) and expands it to local experts 1 and 2
    data, _, wts, tpe, slot_pos, _ = ops.dispatch_unpack(send[:1], counts[1:2], 32, 0, 2, 2)
    assert tpe.tolist() == [0, 1, 1, 0] and wts.tolist() == [0.75, 0.25] and slot_pos.tolist() == [[1, 0]]
    assert torch.equal(u8(data[0]), u8(data[1]))


@pytest.mark.parametrize("needs_grad", [False, True])
def test_pack_header_says_whether_the_input_needs_grad(needs_grad):
    """Every destination's header carries the sender's needs_grad (1 or 0) in its own column, for
    every wire and in capacity mode; the columns around it keep their values."""
    t, h, e, ranks = 6, 128, 8, 4
    x, (idx, w) = torch.randn(t, h, dtype=torch.bfloat16), routing(t, 2, e)
    _, base, _ = ops.dispatch_pack(x, idx, w, e, ranks, 0, None)
    assert base[:, CountsCol.GRAD].tolist() == [0] * ranks  # the default: no gradient
    for gran, cap in ((0, 0), (1, 0), (2, 0), (int(Granularity.RAW), 0), (0, t)):
        scale = torch.tensor(0.5) if gran == 2 else None
        _, counts, _ = ops.dispatch_pack(x, idx, w, e, ranks, gran, scale, cap, needs_grad)
        assert counts[:, CountsCol.GRAD].tolist() == [int(needs_grad)] * ranks, (gran, cap)
        assert counts[:, CountsCol.DTYPE].tolist() == [3] * ranks  # bfloat16's code, beside it
        assert torch.equal(counts[:, CountsCol.ROWS], base[:, CountsCol.ROWS])
        assert torch.equal(counts[:, CountsCol.EXPERTS:], base[:, CountsCol.EXPERTS:])
    _, counts, _ = ops.dispatch_pack(x, idx, w, e, ranks, 0, None, needs_grad=needs_grad)  # by keyword
    assert counts[:, CountsCol.GRAD].tolist() == [int(needs_grad)] * ranks


def test_bad_ids_are_counted_not_routed():
    idx, w = routing(10, 2, 8, bad=True)
    idx[4, 1] = -7
    _, counts, send_pos = ops.dispatch_pack(torch.randn(10, 16), idx, w, 8, 2, 0, None)
    assert counts[:, CountsCol.BAD_IDS].tolist() == [2, 2]
    assert counts[:, CountsCol.EXPERTS:].sum() == (idx >= 0).logical_and(idx < 8).sum()


def test_pack_bad_inputs():
    x, (idx, w) = torch.randn(4, 16), routing(4, 2, 8)
    with pytest.raises(RuntimeError, match="multiple of the number of ranks"):
        ops.dispatch_pack(x, idx, w, 8, 3, 0, None)
    with pytest.raises(RuntimeError, match="topk_weights"):
        ops.dispatch_pack(x, idx, w[:, :1].contiguous(), 8, 2, 0, None)
    with pytest.raises(RuntimeError, match="int64 or int32"):
        ops.dispatch_pack(x, idx.float(), w, 8, 2, 0, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.dispatch_pack(x, idx, w.double(), 8, 2, 0, None)
    with pytest.raises(RuntimeError, match="rank_capacity must be >= 0"):  # as the CUDA launcher checks
        ops.dispatch_pack(x, idx, w, 8, 2, 0, None, -1)
    with pytest.raises(RuntimeError, match="needs a scale"):
        ops.dispatch_pack(x, idx, w, 8, 2, 2, None)
    send, counts, _ = ops.dispatch_pack(x, idx, w, 8, 1, 0, None)
    with pytest.raises(RuntimeError, match="rows but"):
        ops.dispatch_unpack(send[:1], counts, 16, 0, 2, int(counts[:, CountsCol.EXPERTS:].sum()))


def test_unpack_rejects_counts_out_of_range():
    """The CPU bounds the counts before they index recv (CUDA skips such rows instead)."""
    x, (idx, w) = torch.randn(4, 16), routing(4, 2, 8)
    send, counts, _ = ops.dispatch_pack(x, idx, w, 8, 2, 0, None, 8)
    over = counts.clone()
    over[1, CountsCol.ROWS] = 9  # past rank 1's segment, which ends the buffer
    with pytest.raises(RuntimeError, match="over rank_capacity"):
        ops.dispatch_unpack(send, over, 16, 0, 2, 4 * 2 * 8, 8, 8)
    send, counts, _ = ops.dispatch_pack(x, idx, w, 8, 2, 0, None)
    rows = int(counts[:, CountsCol.ROWS].sum())
    negative = counts.clone()
    negative[:, CountsCol.ROWS] = torch.tensor([rows + 1, -1])  # rank 0 past the buffer; the total still fits
    with pytest.raises(RuntimeError, match=r"rows but \d+ were received \(from rank 0 alone\)"):
        ops.dispatch_unpack(send[:rows], negative, 16, 0, 2, int(counts[:, CountsCol.EXPERTS:].sum()))
    negative[:, CountsCol.ROWS] = torch.tensor([-1, rows + 1])
    with pytest.raises(RuntimeError, match=rf"recv_counts\[0, {int(CountsCol.ROWS)}\] = -1 is out of range"):
        ops.dispatch_unpack(send[:rows], negative, 16, 0, 2, int(counts[:, CountsCol.EXPERTS:].sum()))
    huge = counts.clone()  # expert counts whose sum wraps around to the right total
    num_rows = int(counts[:, CountsCol.EXPERTS:].sum())
    huge[0, CountsCol.EXPERTS], huge[1, CountsCol.EXPERTS] = 2**62, -(2**62) + int(huge[1, CountsCol.EXPERTS])
    with pytest.raises(RuntimeError, match=r"expert rows but num_rows is \d+ \(from rank 0 alone\)"):
        ops.dispatch_unpack(send[:rows], huge, 16, 0, 2, num_rows)


def test_empty_batch():
    send, counts, send_pos = ops.dispatch_pack(torch.randn(0, 64), *routing(0, 4, 8), 8, 2, 0, None)
    assert send.shape[0] == 0 and counts[:, CountsCol.ROWS].sum() == 0 and send_pos.shape == (0, 2)
    data, _, _, tpe, slot_pos, _ = unpack_all(send, counts, 64, 0, 4)
    assert data.shape == (0, 64) and tpe.tolist() == [0] * 4
    y, extra = ops.combine_unpack(torch.zeros(0, 128, dtype=torch.uint8), send_pos, 64, torch.bfloat16, False, 0)
    assert y.shape == (0, 64)


@pytest.mark.parametrize("quant", [False, True])
def test_combine_identity_experts(quant):
    """combine(dispatch(x)) with identity experts = sum_k w_k * dequant(q(x))."""
    t, h, e, k = 30, 128, 8, 4
    x = torch.randn(t, h)
    idx, w = routing(t, k, e)
    for ranks in [1, 2, 4]:
        send, counts, send_pos = ops.dispatch_pack(x, idx, w, e, ranks, 0, None)
        data, sc, wts, _, slot_pos, _ = unpack_all(send, counts, h, 0, k)
        expert_out = ops.dequantize(data, sc, torch.float32)
        buf = ops.combine_pack(expert_out, slot_pos, wts, None, quant)
        y, _ = ops.combine_unpack(buf, send_pos, h, torch.float32, quant, 0)
        xq = dequantize_reference(*quantize_reference(x), torch.float64)
        ref = (w.double() * (idx >= 0)).sum(1, keepdim=True) * xq
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < (0.04 if quant else 1e-6), err


def test_combine_extras_map_back_to_topk_slots():
    t, h, e, k = 12, 32, 8, 3
    idx, w = routing(t, k, e)
    send, counts, send_pos = ops.dispatch_pack(torch.randn(t, h), idx, w, e, 2, 0, None)
    _, _, wts, _, slot_pos, _ = unpack_all(send, counts, h, 0, k)
    buf = ops.combine_pack(torch.zeros(wts.shape[0], h), slot_pos, None, wts, False)
    _, extra = ops.combine_unpack(buf, send_pos, h, torch.float32, False, k)
    assert torch.equal(extra, torch.where(idx >= 0, w, 0.0))  # each slot's value lands at [t, k]


def test_combine_accumulates_in_float32_and_converts_last():
    """float16 activations, float32 expert rows of 1e5, router weights 0.25: each weighted row is
    25000 and token 0's two local experts sum to 50000, both within float16 (1e5 is not: converting
    the rows to the wire's dtype first would give Inf)."""
    h = 64
    idx, w = torch.tensor([[0, 1], [1, -1]]), torch.full((2, 2), 0.25)
    send, counts, send_pos = ops.dispatch_pack(torch.randn(2, h, dtype=torch.float16), idx, w, 2, 1, 0, None)
    _, _, wts, _, slot_pos, _ = unpack_all(send, counts, h, 0, 2)
    expert_out = torch.full((wts.shape[0], h), 1e5)
    want = torch.tensor([[50000.0], [25000.0]]).expand(2, h)
    buf = ops.combine_pack(expert_out, slot_pos, wts, None, False, torch.float16)
    assert buf.shape[1] == ops.combine_row_bytes(h, torch.float16, False, 0)
    y, _ = ops.combine_unpack(buf, send_pos, h, torch.float16, False, 0)
    assert y.dtype == torch.float16 and torch.equal(y, want.half())  # float16's nearest: 49984, 24992
    buf = ops.combine_pack(expert_out, slot_pos, wts, None, True, torch.float16)  # e4m3 wire, same sums
    y, _ = ops.combine_unpack(buf, send_pos, h, torch.float16, True, 0)
    assert torch.isfinite(y).all() and ((y.float() - want).abs() <= want / 2048).all(), y[:, 0]
    # what converting first gave: Inf
    buf = ops.combine_pack(expert_out.half(), slot_pos, wts, None, False)
    assert torch.isinf(ops.combine_unpack(buf, send_pos, h, torch.float16, False, 0)[0]).all()


def _combine_reference(expert_out, slot_pos, weights):
    """combine_pack's sums in float32: slot by slot, each expert row times its weight."""
    ef = expert_out.float()
    ref = torch.zeros(slot_pos.shape[0], expert_out.shape[1])
    for i, slots in enumerate(slot_pos.tolist()):
        for n in slots:
            if n >= 0:
                ref[i] = ref[i] + weights[n] * ef[n]
    return ref


@pytest.mark.parametrize("wire", DTYPES)
@pytest.mark.parametrize("eo_dtype", DTYPES + [torch.float64])
def test_combine_pack_takes_expert_rows_of_any_dtype(eo_dtype, wire):
    """expert_out in its own dtype, the row in the activation's: float32 sums, one conversion
    (float64 rows: converted to float32 first, by the wrapper)."""
    t, h, e, k = 20, 48, 8, 3
    idx, w = routing(t, k, e)
    send, counts, send_pos = ops.dispatch_pack(torch.randn(t, h).to(wire), idx, w, e, 2, 0, None)
    _, _, wts, _, slot_pos, _ = unpack_all(send, counts, h, 0, k)
    g = torch.Generator().manual_seed(1)
    eo = (torch.randn(wts.shape[0], h, generator=g) * torch.logspace(-3, 4, h)).to(eo_dtype)
    ref = _combine_reference(eo, slot_pos, wts)
    buf = ops.combine_pack(eo, slot_pos, wts, None, False, wire)
    assert buf.shape == (slot_pos.shape[0], ops.combine_row_bytes(h, wire, False, 0))
    assert torch.equal(buf[:, :h * wire.itemsize].contiguous().view(wire), ref.to(wire))
    buf = ops.combine_pack(eo, slot_pos, wts, None, True, wire)  # e4m3: the same sums, row-quantized
    data, scale = quantize_reference(ref)
    assert buf.shape == (slot_pos.shape[0], ops.combine_row_bytes(h, wire, True, 0))
    assert torch.equal(buf[:, :h], u8(data).view(torch.uint8))
    assert torch.equal(buf[:, h:h + 4].contiguous().view(torch.float32)[:, 0], scale)  # h % 4 == 0
    if eo_dtype != torch.float64:  # no dtype: the row is expert_out's own
        assert torch.equal(ops.combine_pack(eo, slot_pos, wts, None, False),
                           ops.combine_pack(eo, slot_pos, wts, None, False, eo_dtype))


def test_fake_combine_pack_sizes_rows_by_the_wire_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    slot_pos = torch.zeros(3, 2, dtype=torch.int32)
    for eo_dtype, wire in ((torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float64, None)):
        real = ops.combine_pack(torch.ones(4, 200, dtype=eo_dtype), slot_pos, None, None, False, wire)
        with FakeTensorMode():
            fake = ops.combine_pack(torch.ones(4, 200, dtype=eo_dtype), torch.zeros(3, 2, dtype=torch.int32), None,
                                    None, False, wire)
        assert fake.shape == real.shape, (eo_dtype, wire)
    assert real.shape[1] == ops.combine_row_bytes(200, torch.float32, False, 0)  # float64 rows: a float32 wire


def test_combine_pack_rejects_a_row_dtype_the_wire_cannot_carry():
    slot_pos = torch.zeros(1, 1, dtype=torch.int32)
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(RuntimeError, match="row dtype .* must be float32, float16 or bfloat16"):
            ops.combine_pack(torch.ones(1, 16), slot_pos, None, None, False, dtype)


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("t,k,e,cap,ties", [(0, 8, 16, 2, False), (1, 1, 4, 1, False), (64, 8, 32, 3, False),
                                            (64, 8, 32, 5, True), (40, 2, 2, 30, True), (50, 4, 8, 100, False)])
def test_capacity_drop_keeps_the_largest_weights(idx_dtype, t, k, e, cap, ties):
    g = torch.Generator().manual_seed(t + cap)
    idx = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    if ties:
        w = (w * 3).round() / 3
    if t > 4:
        idx[1, 0], idx[2, -1], idx[3] = -1, e + 3, -1  # unrouted and bad ids stay as they are
    idx = idx.to(idx_dtype)
    out, dropped = ops.capacity_drop(idx, w, e, cap)
    want = drop_to_capacity_reference(idx, w, cap, e)
    assert out.dtype == idx_dtype and torch.equal(out, want)
    assert dropped.dim() == 0 and int(dropped) == int(((idx >= 0) & (idx < e) & (out == -1)).sum())
    counts = torch.bincount(out[(out >= 0) & (out < e)].long().flatten(), minlength=e)
    assert counts.numel() == 0 or int(counts.max()) <= cap


def test_capacity_drop_bad_inputs():
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="capacity must be >= 1"):
        ops.capacity_drop(idx, w, 4, 0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.capacity_drop(idx, w.double(), 4, 1)
    with pytest.raises(RuntimeError, match="int64 or int32"):
        ops.capacity_drop(idx.float(), w, 4, 1)
    with pytest.raises(RuntimeError, match="shape"):
        ops.capacity_drop(idx, w[:3], 4, 1)


def test_ops_trace_under_torch_compile():
    t, h, e, k = 16, 64, 8, 2
    x = torch.randn(t, h)
    idx, w = routing(t, k, e)

    def step(x, idx, w):
        send, counts, send_pos = ops.dispatch_pack(x, idx, w, e, 1, 0, None, 0, True)
        data, sc, wts, _, slot_pos, _ = ops.dispatch_unpack(send, counts, h, 0, k, t * k)
        # bfloat16 expert rows onto a float32 wire (the fake sizes the row by the wire's dtype)
        buf = ops.combine_pack(ops.dequantize(data, sc, torch.bfloat16), slot_pos, wts, None, False, torch.float32)
        return ops.combine_unpack(buf, send_pos, h, torch.float32, False, 0)[0], counts

    idx = torch.randint(0, e, (t, k))  # no -1, so every slot is routed and N = t * k is static
    eager = step(x, idx, w)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x, idx, w)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert compiled[1][:, CountsCol.GRAD].tolist() == [1]



def test_raw_pack_takes_an_empty_expanded_activation():
    # the gradient of y.sum() on a rank without tokens: contiguous by torch's rule, zero strides
    x = torch.ones((), dtype=torch.bfloat16).expand(0, 64)
    idx, w = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    send, counts, _ = ops.dispatch_pack(x, idx, w, 8, 2, int(Granularity.RAW), None, 0)
    assert send.dtype == torch.uint8 and send.shape[0] == 0
    assert counts[:, CountsCol.ROWS].tolist() == [0, 0] and counts[:, CountsCol.HIDDEN].tolist() == [128, 128]


# ---- combine_backward_rows ---------------------------------------------------------------------

def _same_floats(a, b):
    """Bit-identical, NaN == NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("h", [7168, 200, 16, 1])
@pytest.mark.parametrize("rows", ["e4m3", torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_combine_backward_rows_order_and_float64(h, rows, dtype):
    """The gradient is dequantize(data, scale * w) (e4m3) or (rows * w).to(dtype) (raw), bit for bit;
    the router-weight gradient is the blocked float32 dot of csrc/fp8_common.h bit for bit (the plain
    torch reference), within float32 rounding of the float64 dot, with or without weights."""
    g = torch.Generator().manual_seed(h)
    n = 40
    x = nasty(n, h, torch.float32, seed=h) if h >= 16 else torch.randn(n, h, generator=g)
    if rows == "e4m3":
        data, scale = ops.quantize(x, 0, None)
        dy64 = dequantize_reference(data, scale, torch.float64)
    else:
        data, scale = x.to(rows), None
        dy64 = data.double()
    eo = (torch.randn(n, h, generator=g) * 3).to(dtype)
    w = torch.rand(n, generator=g)
    for weights in (w, None):
        for expert_out in (None, eo):  # the last: the router-weight gradient, checked below
            grad, gw = ops.combine_backward_rows(data, scale, weights, expert_out, dtype)
            want, want_w = combine_backward_rows_reference(data, scale, weights, expert_out, dtype)
            assert _same_floats(grad, want) and _same_floats(gw, want_w)
            if weights is None:
                old = ops.dequantize(data, scale, dtype) if rows == "e4m3" else data.to(dtype)
            else:
                old = ops.dequantize(data, scale * weights, dtype) if rows == "e4m3" else \
                    (data.float() * weights.unsqueeze(1)).to(dtype)
            assert _same_floats(grad, old)  # what the backward computed before the fusion
            assert gw.shape == ((n,) if expert_out is not None else (0,)) and gw.dtype == torch.float32
    dot = (dy64 * eo.double()).sum(1)
    finite = dot.isfinite()
    err = (gw[finite].double() - dot[finite]).abs()
    bound = 1e-5 * (dy64.abs() * eo.double().abs()).sum(1)[finite] + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())
    assert not gw[~finite].isfinite().any()
    if rows == "e4m3" and h >= 16:
        assert gw[1] == 0 and gw[2].isnan() and gw[3].isnan()  # a zero row, a NaN row, an Inf row


def test_combine_backward_rows_bad_inputs_and_fake():
    data, scale = ops.quantize(torch.randn(4, 32), 0, None)
    eo = torch.randn(4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="need their row scale"):
        ops.combine_backward_rows(data, None, None, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match="raw rows take no scale"):
        ops.combine_backward_rows(eo, scale, None, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match="the gradient's dtype"):
        ops.combine_backward_rows(data, scale, None, eo, torch.float32)
    with pytest.raises(RuntimeError, match="weights must be a contiguous float32 vector"):
        ops.combine_backward_rows(data, scale, torch.ones(3), eo, torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype must be"):
        ops.combine_backward_rows(data, scale, None, None, torch.int32)
    with pytest.raises(RuntimeError, match="e4m3 or float32"):
        ops.combine_backward_rows(data.view(torch.uint8), None, None, None, torch.float32)
    from torch._subclasses.fake_tensor import FakeTensorMode
    for e in (eo, None):
        real = ops.combine_backward_rows(data, scale, torch.ones(4), e, torch.bfloat16)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = ops.combine_backward_rows(data, scale, torch.ones(4), e, torch.bfloat16)
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]

