"""The host-side shortcuts of dispatcher.py, at world size 1 without a process group: dispatch and
combine skip their autograd Functions when nothing needs a gradient (but not under forward AD),
exchange.agree_on_wire accepts equal valid headers without its full checks, and
Layout.with_weights copies the handle without its __init__. Each must give what the path it
shortcuts gives."""
import contextlib
import dataclasses

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fp8a2a
from fp8a2a import dispatcher, exchange
from fp8a2a.wire import REJECTED, CountsCol, Granularity

from .test_dispatch import make_inputs

MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
def _dispatcher(wire, layout, **kw):
    return fp8a2a.Dispatcher(8, bf16_below_bytes=(1 << 40) if wire == "raw" else 0,
                             capacity_factor=1.0 if layout == "capacity" else None, **kw)


def _inputs():
    xs, idxs, ws = make_inputs(1, 16, 64, 8, 2, torch.bfloat16)
    dy = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    return xs[0], idxs[0], ws[0], dy


def _dispatch_combine(d, x, idx, w, mode="grad"):
    with MODES[mode]():
        out = d.dispatch(x, idx, w)
        return out, d.combine(out.dequantized(), out.handle)


def _assert_same_dispatch(out, ref):
    """Equal rows (bytes and scales), weights, counts and layout."""
    assert type(out.tokens) is type(ref.tokens)
    if isinstance(ref.tokens, torch.Tensor):
        assert torch.equal(out.tokens.detach(), ref.tokens.detach())
    else:
        assert torch.equal(out.tokens.data.view(torch.uint8), ref.tokens.data.view(torch.uint8))
        assert torch.equal(out.tokens.scale, ref.tokens.scale.detach())
    assert torch.equal(out.weights.detach(), ref.weights.detach())
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
    h, r = out.handle, ref.handle
    assert (h.wire, h.num_rows, h.send_splits, h.recv_splits) == (r.wire, r.num_rows, r.send_splits, r.recv_splits)
    assert torch.equal(h.slot_pos, r.slot_pos) and torch.equal(h.send_pos, r.send_pos)


@pytest.mark.parametrize("layout", ["compact", "capacity"])
@pytest.mark.parametrize("wire", ["raw", "row"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("w_grad", [False, True], ids=["w", "w_grad"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["x", "x_grad"])
def test_bypass_matches_autograd_path(x_grad, w_grad, mode, wire, layout):
    d = _dispatcher(wire, layout)
    x0, idx, w0, dy = _inputs()
    # The reference: both inputs require grad in grad mode, the autograd Functions' path (the one
    # every call took before the bypass).
    x_ref, w_ref = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref, y_ref = _dispatch_combine(d, x_ref, idx, w_ref)
    (y_ref.float() * dy).sum().backward()

    x, w = x0.clone().requires_grad_(x_grad), w0.clone().requires_grad_(w_grad)
    out, y = _dispatch_combine(d, x, idx, w, mode)
    _assert_same_dispatch(out, ref)
    assert torch.equal(y, y_ref.detach())
    if layout == "compact":
        assert isinstance(out.tokens, torch.Tensor) == (wire == "raw")
    # An autograd Function's differentiable outputs require grad when any of its inputs does.
    tracked = mode == "grad" and (x_grad or w_grad)
    if isinstance(out.tokens, torch.Tensor):
        assert out.tokens.requires_grad == tracked
    else:
        assert (out.tokens.grad_anchor is not None) == tracked
        assert not out.tokens.data.requires_grad and not out.tokens.scale.requires_grad
    assert out.weights.requires_grad == tracked and out.handle.weights is out.weights
    assert not out.tokens_per_expert.requires_grad
    assert y.requires_grad == tracked
    if tracked:
        (y.float() * dy).sum().backward()
    assert (x.grad is not None) == (tracked and x_grad) and (w.grad is not None) == (tracked and w_grad)
    if x.grad is not None:
        assert torch.equal(x.grad, x_ref.grad)
    if w.grad is not None:
        assert torch.equal(w.grad, w_ref.grad)


@pytest.mark.parametrize("mode", list(MODES))
def test_tensor_scale_requiring_grad(mode):
    # A given tensor scale is a constant of the quantization: one that requires grad gives the same
    # rows, a detached copy of it as their scale, and outputs with no history of it in every mode.
    scale = torch.tensor(0.02, requires_grad=True)
    d = fp8a2a.Dispatcher(8, granularity="tensor", tensor_scale=scale, bf16_below_bytes=0)
    x, idx, w, dy = _inputs()
    ref, y_ref = _dispatch_combine(d, x.clone().requires_grad_(), idx, w.clone().requires_grad_())
    out, y = _dispatch_combine(d, x, idx, w, mode)
    _assert_same_dispatch(out, ref)
    assert torch.equal(y, y_ref.detach())
    assert float(out.tokens.scale) == pytest.approx(0.02)
    assert not out.tokens.scale.requires_grad and out.handle.tensor_scale is out.tokens.scale
    assert out.tokens.scale.data_ptr() != scale.data_ptr()
    assert out.tokens.grad_anchor is None and not out.weights.requires_grad and not out.tokens_per_expert.requires_grad
    assert not y.requires_grad


@pytest.mark.parametrize("wire", ["raw", "row"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dual", ["x", "topk_weights", "expert_out"])
def test_forward_ad_is_not_bypassed(dual, mode, wire):
    # Dual tensors do not require grad: the bypass must not take them and drop their tangents. The
    # input checks reject them (dispatch and combine have no jvp); inference mode disables forward
    # AD, and there the tangents go as they always did.
    d = _dispatcher(wire, "compact")
    x, idx, w, _ = _inputs()
    raises = pytest.raises(NotImplementedError, match="jvp") if mode != "inference_mode" else \
        contextlib.nullcontext()
    with fwAD.dual_level(), raises:
        if dual == "x":
            x = fwAD.make_dual(x, torch.ones_like(x))
        elif dual == "topk_weights":
            w = fwAD.make_dual(w, torch.ones_like(w))
        with MODES[mode]():
            out = d.dispatch(x, idx, w)
            rows = out.dequantized()
            if dual == "expert_out":
                rows = fwAD.make_dual(rows, torch.ones_like(rows))
            y = d.combine(rows, out.handle)
        assert fwAD.unpack_dual(y).tangent is None
    assert fwAD._current_level == -1  # what dispatcher._forward_ad_active reads
    assert not dispatcher._forward_ad_active()


def _header(hidden=64, topk=2, bad=0, wire=Granularity.ROW, dtype=3, grad=0, rows=5, experts=(3, 2)):
    row = [0] * CountsCol.EXPERTS
    row[CountsCol.HIDDEN], row[CountsCol.TOPK], row[CountsCol.BAD_IDS] = hidden, topk, bad
    row[CountsCol.WIRE], row[CountsCol.DTYPE], row[CountsCol.ROWS] = int(wire), dtype, rows
    row[CountsCol.GRAD] = grad
    return row + list(experts)


# (headers of ranks 0 and 1, the error's type and exact message; None: no error)
_REJECTED_MSG = "fp8a2a: ranks {} rejected their dispatch input (their error says why); this rank raises too " \
                "instead of waiting for them"
_HEADER_ERRORS = {
    "rejected_equal": ([_header(bad=REJECTED)] * 2, RuntimeError, _REJECTED_MSG.format([0, 1])),
    "rejected_one": ([_header(), _header(bad=REJECTED)], RuntimeError, _REJECTED_MSG.format([1])),
    "bad_ids_equal": ([_header(bad=3)] * 2, ValueError, "fp8a2a: expert ids outside [-1, 8) on ranks [0, 1] "
                                                        "([3, 3] ids)"),
    "topk": ([_header(), _header(topk=4)], ValueError, "fp8a2a: ranks use different top-k: [2, 4]"),
    "dtype": ([_header(), _header(dtype=1)], ValueError,
              "fp8a2a: ranks dispatch x of different dtypes: ['bfloat16', 'float32']"),
    "grad": ([_header(grad=1), _header()], ValueError,
             "fp8a2a: x (or topk_weights) requires grad on some ranks only: [True, False] (every rank must run "
             "the dispatch's backward, or none)"),
    "hidden": ([_header(), _header(hidden=128)], ValueError,
               "fp8a2a: ranks use different hidden sizes: [64, 128] (this rank: 64)"),
    "hidden_equal_not_mine": ([_header(hidden=128)] * 2, ValueError,
                              "fp8a2a: ranks use different hidden sizes: [128, 128] (this rank: 64)"),
    "raw_hidden_bytes_not_mine": ([_header(hidden=64, wire=Granularity.RAW)] * 2, ValueError,
                                  "fp8a2a: ranks use different hidden sizes: [32, 32] (this rank: 64)"),
}


@pytest.mark.parametrize("raise_on_bad_ids", [True, False])
@pytest.mark.parametrize("case", list(_HEADER_ERRORS))
def test_agree_on_wire_still_raises(case, raise_on_bad_ids):
    headers, error, message = _HEADER_ERRORS[case]
    d = fp8a2a.Dispatcher(8)
    if case == "bad_ids_equal" and not raise_on_bad_ids:  # capacity mode counts them instead
        assert exchange.agree_on_wire(d.spec, headers, 64, 2, raise_on_bad_ids=False) == Granularity.ROW
        return
    with pytest.raises(error) as info:
        exchange.agree_on_wire(d.spec, headers, 64, 2, raise_on_bad_ids=raise_on_bad_ids)
    assert str(info.value) == message


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_agree_on_wire_formats(granularity):
    d = fp8a2a.Dispatcher(8, granularity=granularity)
    code = d.code
    raw = _header(hidden=128, wire=Granularity.RAW)  # a raw header's hidden counts bytes (bf16: 2 each)
    fp8 = _header(hidden=64, wire=code)
    assert exchange.agree_on_wire(d.spec, [raw, raw], 64, 2) == Granularity.RAW
    assert exchange.agree_on_wire(d.spec, [fp8, fp8], 64, 2) == code
    assert exchange.agree_on_wire(d.spec, [raw, fp8], 64, 2) == code  # one rank over the size threshold: FP8 for all
    assert exchange.agree_on_wire(d.spec, [fp8, raw], 64, 2) == code
    # only the counts differ (rows, per-expert): the shortcut's case
    assert exchange.agree_on_wire(d.spec, [fp8, _header(wire=code, rows=9, experts=(0, 9))], 64, 2) == code
    assert exchange.agree_on_wire(d.spec, [raw], 64, 2) == Granularity.RAW  # world size 1


@pytest.mark.parametrize("case", ["compact_raw", "compact_row", "capacity", "tensor"])
def test_handle_with_weights_equals_replace(case):
    """The handle users get (Layout.with_weights, a shallow copy) equals dataclasses.replace of the
    layout the backward keeps, field by field, and leaves that layout without weights."""
    d = {"compact_raw": lambda: _dispatcher("raw", "compact"), "compact_row": lambda: _dispatcher("row", "compact"),
         "capacity": lambda: _dispatcher("row", "capacity"),
         "tensor": lambda: fp8a2a.Dispatcher(8, granularity="tensor", bf16_below_bytes=0)}[case]()
    x, idx, w, _ = _inputs()
    for x_grad in (False, True):  # the bypass and the Function
        out = d.dispatch(x.clone().requires_grad_(x_grad), idx, w)
        handle = out.handle
        assert isinstance(handle, dispatcher.DispatchHandle) and handle.weights is out.weights
        bare = handle.with_weights(None)
        slow = dataclasses.replace(bare, weights=out.weights)
        assert bare.weights is None and handle.weights is out.weights
        for f in dataclasses.fields(exchange.Layout):
            fast_value, slow_value = getattr(handle, f.name), getattr(slow, f.name)
            assert fast_value is slow_value, f.name
        assert handle.tokens_per_expert_list == slow.tokens_per_expert_list
