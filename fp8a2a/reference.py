"""Plain-torch references: what the fused ops compute, written with ordinary torch ops.

Used by the tests (as ground truth) and by the benchmarks (as the eager-torch way a user would
write it: amax, div, cast, index_select / scatter). Never on the fast path."""
import itertools

import torch

from .kernels import constant
from .quant import scale_rule
from .wire import BLOCK, FP8


def _div(a, b):
    # torch.div on tensors is IEEE-correct; `448.0 / t` is reciprocal-then-multiply.
    return torch.div(torch.as_tensor(a, dtype=torch.float32, device=b.device).expand_as(b), b)


def quantize_reference(x: torch.Tensor, granularity: str = "row", scale: torch.Tensor | None = None,
                       amax: torch.Tensor | None = None):
    """(data e4m3, dequant scale) by the rule of csrc/fp8_common.h. Tensor granularity: from a
    given dequant `scale` the multiplier is 1 / scale; else from `amax` (default: x's own) by the
    scale rule, 448 / amax, as row granularity's; a row holding NaN or Inf is NaN throughout."""
    xf = x.float()
    t, h = xf.shape
    if granularity == "tensor":
        if scale is not None:
            scale = scale.reshape(()).float()
            q = _div(1.0, scale)
        else:
            if amax is None:
                amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
            q, scale = scale_rule(amax.reshape(()).float())
        data = (xf * q).to(FP8).view(torch.uint8)
        nan_rows = ~torch.isfinite(xf).all(dim=1, keepdim=True)  # one scale cannot mark them: NaN bytes
        return torch.where(nan_rows, torch.full_like(data, 0x7F), data).view(FP8), scale
    blocks = xf.view(t, h // BLOCK, BLOCK) if granularity == "block128" else xf.view(t, 1, h)
    amax = blocks.abs().amax(dim=-1)  # propagates NaN
    q, s = scale_rule(amax)
    data = (blocks * q.unsqueeze(-1)).to(FP8).view(t, h)
    return data, (s.view(t) if granularity == "row" else s)


def dequantize_reference(data, scale, dtype=torch.float32):
    t, h = data.shape
    df = data.float()
    if scale.dim() == 2:
        df = (df.view(t, -1, BLOCK) * scale.unsqueeze(-1)).view(t, h)
    else:
        df = df * (scale.unsqueeze(-1) if scale.dim() == 1 else scale)
    return df.to(dtype)


def route_reference(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Per-destination-rank token lists of the send side, in token order: {rank: [token ids]}."""
    per_rank = num_experts // num_ranks
    out = {r: [] for r in range(num_ranks)}
    for t, row in enumerate(topk_idx.tolist()):
        for r in sorted({e // per_rank for e in row if 0 <= e < num_experts}):
            out[r].append(t)
    return out


def expert_major_reference(xs, topk_idxs, topk_weights, rank: int, num_experts: int, num_ranks: int):
    """What rank `rank` must receive, from every source rank's (x, topk_idx, topk_weights):
    rows grouped by local expert, source ranks in order, tokens in order within a source.
    Returns (rows [N, H] float64, weights [N], tokens_per_expert, (src, token, k) per row)."""
    per_rank = num_experts // num_ranks
    rows, weights, origin, tpe = [], [], [], []
    for le in range(per_rank):
        e = rank * per_rank + le
        n = 0
        for src, (x, idx, w) in enumerate(zip(xs, topk_idxs, topk_weights)):
            for t in range(idx.shape[0]):
                for k in range(idx.shape[1]):
                    if int(idx[t, k]) == e:
                        rows.append(x[t].double())
                        weights.append(float(w[t, k]))
                        origin.append((src, t, k))
                        n += 1
        tpe.append(n)
    h = xs[0].shape[1]
    stacked = torch.stack(rows) if rows else torch.zeros(0, h, dtype=torch.float64)
    return stacked, torch.tensor(weights, dtype=torch.float64), torch.tensor(tpe), origin


def drop_to_capacity_reference(topk_idx, topk_weights, capacity: int, num_experts: int):
    """Per expert, keep the `capacity` routed slots with the highest weight (ties: earlier slot in
    token-major order); dropped slots become -1."""
    idx = topk_idx.clone()
    slots = [(float(topk_weights[t, k]), t, k) for t in range(idx.shape[0]) for k in range(idx.shape[1])]
    for e in range(num_experts):
        mine = sorted([s for s in slots if int(topk_idx[s[1], s[2]]) == e], key=lambda s: (-s[0], s[1], s[2]))
        for _, t, k in mine[capacity:]:
            idx[t, k] = -1
    return idx


def combine_backward_rows_reference(data, scale, weights, expert_out, dtype):
    """ops.combine_backward_rows in plain float32 torch ops, in the blocked order of
    csrc/fp8_common.h (kDotUnit): the same bits. (grad in dtype, grad_weights float32 or empty)."""
    fp8 = data.dtype == FP8
    v = data.float()  # e4m3 rows unscaled: the scale multiplies the gradient and the finished dot
    s = scale.float() if fp8 else torch.ones(data.shape[0])
    m = (s * weights if weights is not None else s) if fp8 else weights
    grad = (v * m.unsqueeze(1) if m is not None else v).to(dtype)
    if expert_out is None:
        return grad, torch.zeros(0)
    n, h = v.shape
    units = -(-h // 16)
    lanes = -(-units // 32) * 32  # whole rounds of 32 units: padding products and units are +0
    p = torch.zeros(n, lanes * 16)
    p[:, :h] = v * expert_out.float()
    p = p.view(n, lanes, 16)
    while p.shape[-1] > 1:  # each unit's 16 products as a pairwise tree
        p = p[..., 0::2] + p[..., 1::2]
    p = p.view(n, lanes // 32, 32)
    acc = torch.zeros(n, 32)
    for j in range(p.shape[1]):  # unit u to lane u % 32, in increasing u
        acc = acc + p[:, j]
    for o in (16, 8, 4, 2, 1):  # the lanes as a tree: lane l < o adds lane l + o
        acc = acc[:, :o] + acc[:, o:2 * o]
    return grad, (acc[:, 0] * s if fp8 else acc[:, 0])


def routing_map_to_topk_reference(routing_map, probs, topk: int, drop_zero: bool = False):
    """ops.routing_map_to_topk in six torch ops (the dispatcher's form before that op): each row's k
    lowest routed experts, found by topk over keys that rank lower experts higher (differentiable
    in probs)."""
    if drop_zero:
        routing_map = routing_map & (probs != 0)
    e = routing_map.shape[1]
    k = max(1, min(int(topk), e))
    descending = constant(("descending", e, routing_map.device),
                          lambda: torch.arange(e, 0, -1, device=routing_map.device, dtype=torch.int32))
    val, idx = torch.topk(torch.where(routing_map, descending, 0), k, dim=1, sorted=True)
    valid = val > 0
    return torch.where(valid, idx, -1), torch.where(valid, probs.gather(1, idx), 0)


def mm_fp8_per_expert_reference(a, sa, wq, sw, counts, fast_accum):
    """ops.mm_fp8_per_expert as a Python loop of torch._scaled_mm (the experts' form before that op):
    bf16 [M, N], expert e's rows = (sa * a's rows) @ (sw[e] * wq[e])^T; each expert's row scales on
    16 bytes, as cuBLASLt needs them (views where they already are, else one padded copy)."""
    rows = list(itertools.accumulate(counts, initial=0))
    if sa.data_ptr() % 16 == 0 and all(r % 4 == 0 for r, n in zip(rows, counts) if n):
        scales = [sa[r:r + n, None] for r, n in zip(rows, counts)]
    else:
        pieces, starts, at = [], [], 0
        for n, r in zip(counts, rows):
            starts.append(at)
            pieces.append(sa[r:r + n])
            gap = -(at + n) % 4
            if gap:
                pieces.append(sa.new_zeros(gap))
            at += n + gap
        buf = torch.cat(pieces)
        scales = [buf[s:s + n, None] for s, n in zip(starts, counts)]
    out = torch.empty((a.shape[0], wq.shape[1]), device=a.device, dtype=torch.bfloat16)
    for e, (r, n, sa_e) in enumerate(zip(rows, counts, scales)):
        if n:
            torch._scaled_mm(a[r:r + n], wq[e].t(), sa_e, sw[e:e + 1], out_dtype=torch.bfloat16,
                             use_fast_accum=fast_accum, out=out[r:r + n])
    return out
