"""Dispatch and combine as autograd Functions over the exchange engine (fp8a2a.exchange).

`dispatch_rows` and `combine_rows` pick the path: the Function when something needs a gradient,
else the engine alone (the Function's bookkeeping is a host cost on every call).
"""
import torch
from torch.autograd.function import once_differentiable

from . import exchange, ops
from .exchange import ExchangeSpec, Layout, Route
from .wire import Granularity


def differentiable(*tensors) -> bool:
    """Whether a call must go through its autograd Function: grad mode and an input (None: absent)
    that requires grad. Dual inputs, which do not require grad, never get here: the Dispatcher's
    input checks reject them first, so no tangent is dropped by the bypass."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


def dispatch_rows(spec: ExchangeSpec, x, topk_weights, route: Route, fail_peers=None):
    """(data, scale, weights, tokens per expert, the handle: a Layout with the weights, anchors).
    Raw rows are data itself; FP8 rows' gradient reaches x through `anchors`: zero-memory carriers
    (x's dtype, float32 or None), (None, None) when nothing needs a gradient."""
    # (a given tensor scale is read detached: no gradient flows to it)
    if not differentiable(x, topk_weights):
        data, scale_rows, weights, tpe, layout = exchange.dispatch(spec, x, route, False, fail_peers)
        return data, scale_rows, weights, tpe, layout.with_weights(weights), (None, None)
    rows, weights, data, scale_rows, tpe, layout, rows32 = _DispatchFn.apply(x, topk_weights, spec, route, fail_peers)
    if layout.wire == Granularity.RAW:
        return rows, scale_rows, weights, tpe, layout.with_weights(weights), (None, None)
    anchors = (rows, rows32) if rows.requires_grad else (None, None)
    return data, scale_rows, weights, tpe, layout.with_weights(weights), anchors


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, spec, route, fail_peers):
        # the header says whether this rank's backward will exchange: only x's and the weights'
        # gradients travel
        needs_grad = x.requires_grad or topk_weights.requires_grad
        data, scale, weights, tpe, layout = exchange.dispatch(spec, x, route, needs_grad, fail_peers)
        ctx.layout = layout  # without the weights: they would close a reference cycle through ctx
        # an output without a gradient comes to backward as None, not as zeros autograd allocates
        # (for the rows, [N, H]): backward allocates only what the exchange needs
        ctx.set_materialize_grads(False)
        if layout.wire == Granularity.RAW:  # data: the rows themselves, [N, H] in x's dtype
            placeholder = data.new_empty(0)
            ctx.mark_non_differentiable(placeholder, scale, tpe)
            return data, weights, placeholder, scale, tpe, layout, None
        # gradient carriers of the FP8 rows: no memory, never read. One in x's dtype and, for x of
        # another dtype, one in float32: rows dequantized to float32 hand their gradient to it, so
        # that it reaches this backward as it is (combine_pack sums it in float32) instead of
        # through the cast to x's dtype that autograd makes for a carrier of that dtype
        shape = (layout.num_rows, layout.hidden)
        anchor = x.new_empty(()).expand(shape)
        anchor32 = None if x.dtype == torch.float32 else x.new_empty((), dtype=torch.float32).expand(shape)
        ctx.mark_non_differentiable(data, scale, tpe)
        return anchor, weights, data, scale, tpe, layout, anchor32

    @staticmethod
    @once_differentiable  # its exchange has no derivative of its own: a double backward raises
    def backward(ctx, grad_rows, grad_weights, _data, _scale, _tpe, _layout, grad_rows32):
        h: Layout = ctx.layout
        spec = h.spec
        if grad_rows32 is not None:  # both carriers used (rows dequantized to two dtypes): one sum
            grad_rows = grad_rows32 if grad_rows is None else grad_rows32 + grad_rows
        # the rows' width must be the same on every rank, whichever ranks' router weights need a
        # gradient: with peers, always with the weights' column
        want_w = not spec.local or (ctx.needs_input_grad[1] and grad_weights is not None)
        if grad_rows is None and not want_w:  # no peer waits and nothing to send: x's gradient is 0
            return None, None, None, None, None
        # zeros only where the exchange needs rows to carry the weights' column
        device = h.send_pos.device
        if grad_rows is None:
            grad_rows = torch.zeros((h.num_rows, h.hidden), dtype=h.dtype, device=device)
        if want_w and grad_weights is None:
            grad_weights = torch.zeros(h.num_rows, dtype=torch.float32, device=device)
        extra = grad_weights.float().contiguous() if want_w else None
        # grad_rows in whichever dtype it came (x's or float32): combine_pack reads it as it is
        gx, gw = exchange.combine(grad_rows, None, h, spec.fp8_dispatch_backward, extra)
        return gx, (gw if want_w and ctx.needs_input_grad[1] else None), None, None, None


def combine_rows(expert_out, weights, layout: Layout):
    """y [T, H] in the dispatch's dtype: the Function when expert_out or weights need a gradient."""
    if differentiable(expert_out, weights):
        return _CombineFn.apply(expert_out, weights, layout)
    return exchange.combine(expert_out, weights, layout, layout.spec.fp8_combine)[0]


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, layout):
        y = exchange.combine(expert_out, weights, layout, layout.spec.fp8_combine)[0]
        ctx.layout = layout
        ctx.out_dtype = expert_out.dtype
        ctx.save_for_backward(expert_out if weights is not None else None, weights)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        h: Layout = ctx.layout
        expert_out, weights = ctx.saved_tensors
        data, scale, wire = exchange.redispatch(grad_y, h)
        # one pass over dy's rows: the (weighted) gradient of expert_out and, where the router
        # weights need one, their gradient dy . expert_out per row, reduced in float32 in the kernel
        want_w = weights is not None and ctx.needs_input_grad[1]
        grad_out, grad_w = ops.combine_backward_rows(
            data, None if wire == Granularity.RAW else scale, None if weights is None else weights.detach(),
            expert_out.contiguous() if want_w else None, ctx.out_dtype)
        return grad_out, (grad_w if want_w else None), None
