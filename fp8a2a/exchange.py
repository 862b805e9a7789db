"""The exchange engine: pack -> uint8 all_to_all_single -> unpack, in both directions.

Plain functions over a frozen `ExchangeSpec` (what crosses the wire: group, experts, formats) and
a frozen `Layout` (one dispatch's routing and sizes, which combine and both backward passes reuse).
Nothing here knows the Dispatcher: it builds the spec, the autograd Functions call these functions.

Dispatch (forward):  dispatch_pack -> all_to_all(counts) -> one host sync -> all_to_all(rows)
                     -> dispatch_unpack.  Rows carry FP8 payload, scales and routing together.
Combine (forward):   combine_pack (sum of a token's local experts, weighted) -> all_to_all
                     -> combine_unpack (sum over ranks).
Dispatch backward is a combine of the row gradients (BF16 by default) that also carries the
router-weight gradients; combine backward is a dispatch of dy (FP8 by default) over the cached
layout, with no counts exchange.
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from . import ops
from .quant import scale_rule, tensor_amax
from .wire import ACT_DTYPES, REJECTED, CountsCol, Granularity

# The counts header's columns as plain ints for the per-call reads (an enum member lookup is a
# Python attribute access each time).
_HIDDEN, _TOPK, _BAD_IDS, _WIRE, _DTYPE, _GRAD, _ROWS, _EXPERTS = (
    int(c) for c in (CountsCol.HIDDEN, CountsCol.TOPK, CountsCol.BAD_IDS, CountsCol.WIRE, CountsCol.DTYPE,
                     CountsCol.GRAD, CountsCol.ROWS, CountsCol.EXPERTS))


@dataclass(frozen=True)
class ExchangeSpec:
    """What every exchange of one Dispatcher shares; the same on every rank (the Dispatcher checks).

    num_experts counts the virtual experts of expert TP (E * expert_tp_size): the ops see those."""
    group: object
    world: int
    local: bool  # a group of one that skips the collectives
    num_experts: int
    num_local_experts: int
    tp: int  # expert TP size: num_experts is the caller's experts times tp
    code: Granularity  # the quantized granularity of the FP8 wire
    fp8_combine: bool
    fp8_dispatch_backward: bool
    # tensor granularity's caller-given scale: the caller's tensor itself (in-place updates reach
    # the next call; the Dispatcher checked its value on every rank), None: agreed from the amax
    tensor_scale: Optional[torch.Tensor] = field(default=None, compare=False)
    # this rank's size policy: smaller inputs go unquantized (may differ by rank: the ranks agree
    # on one wire per call, in the counts exchange)
    bf16_below_bytes: int = 0
    # capacity mode: the (shape, top-k, dtype) keys whose headers were checked once
    # (static splits read no header per call); a cache, not an option
    checked_static: set = field(default_factory=set, compare=False, repr=False)


@dataclass(frozen=True)
class Route:
    """One dispatch's routing as the kernels take it: after the capacity drop and the expert-TP
    replication (K' = K * expert_tp_size slots)."""
    topk_idx: torch.Tensor  # [T, K'] contiguous
    topk_weights: torch.Tensor  # [T, K'] float32, detached (may be the caller's tensor itself)
    rank_capacity: int = 0  # capacity mode: rows per destination rank segment (0: compact)
    expert_capacity: int = 0  # capacity mode: rows per (source rank, local expert)
    dropped: Optional[torch.Tensor] = None  # capacity mode: slots dropped on this rank (device)


@dataclass(frozen=True)
class Layout(Route):
    """One dispatch as combine and the backward passes reuse it; the DispatchHandle users hold.
    Opaque to callers but for dropped, invalid_ids, num_rows, weights and tokens_per_expert_list."""
    spec: ExchangeSpec = None
    hidden: int = 0
    dtype: torch.dtype = torch.bfloat16
    wire: Granularity = Granularity.ROW  # what the rows were sent as (RAW: unquantized)
    send_pos: torch.Tensor = None  # [T, R] int32: send row of token t for rank r, or -1
    slot_pos: torch.Tensor = None  # [Nr, K'] int32: expert-major row of each received slot, or -1
    recv_counts: torch.Tensor = None  # [R, CountsCol.EXPERTS + local experts] int64 (device)
    # the counts exchange as read by the one host sync (compact mode; empty in capacity mode)
    recv_counts_host: List[List[int]] = field(default_factory=list)
    send_splits: List[int] = field(default_factory=list)  # rows sent to each rank
    recv_splits: List[int] = field(default_factory=list)  # rows received from each rank
    num_rows: int = 0  # expert-major rows N
    tensor_scale: Optional[torch.Tensor] = None  # the agreed scale in 'tensor' granularity
    invalid_ids: Optional[torch.Tensor] = None  # capacity mode: out-of-range ids seen (device)
    tokens_received: Optional[torch.Tensor] = None  # capacity mode: real rows per local expert
    # received router weights [N], autograd-connected: set on the handle users get (with_weights),
    # never on the one a backward keeps (it would close a reference cycle through the graph)
    weights: Optional[torch.Tensor] = None

    @property
    def tokens_per_expert_list(self) -> List[int]:
        """Rows per local expert on the host (no extra sync); built on demand: a Python sum over
        ranks x experts is not free at hundreds of experts."""
        if self.expert_capacity:  # capacity mode: every expert holds its padded rows
            return [self.spec.world * self.expert_capacity] * self.spec.num_local_experts
        return [sum(col) for col in zip(*(row[_EXPERTS:] for row in self.recv_counts_host))]

    def with_weights(self, weights: torch.Tensor) -> "Layout":
        """This layout carrying `weights`: a shallow copy (no per-field __init__ on every call)."""
        out = object.__new__(Layout)
        out.__dict__.update(self.__dict__)
        out.__dict__["weights"] = weights
        return out


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


# ---- the collectives --------------------------------------------------------------------------

def all_to_all(spec: ExchangeSpec, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]):
    """The rows' exchange: one uint8 all_to_all_single (a group of one returns its own rows)."""
    sent = send_splits[0] if spec.local else sum(send_splits)
    if sent != send.shape[0]:  # the pack allocates for the worst case
        send = send[:sent]
    if spec.local:
        return send
    recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=spec.group)
    return recv


def exchange_counts(spec: ExchangeSpec, counts: torch.Tensor) -> torch.Tensor:
    if spec.local:
        return counts
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=spec.group)
    return recv


def gather_ints(group, world: int, values: List[int], device) -> List[List[int]]:
    """Every rank's `values` (one all-gather, one host read): for once-per-setup agreement checks."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu().tolist()


# ---- dispatch -----------------------------------------------------------------------------------

def pack(spec: ExchangeSpec, x, route: Route, wire, tensor_scale=None, needs_grad=False):
    """(send rows, counts header per destination, send_pos). A raw wire sends x's own bytes."""
    return ops.dispatch_pack(_detached(x).contiguous(), route.topk_idx, route.topk_weights, spec.num_experts,
                             spec.world, wire, tensor_scale, route.rank_capacity, needs_grad)


def unpack(recv, route: Route, wire, recv_counts, hidden, dtype, num_rows):
    """dispatch_unpack of `num_rows` expert-major rows; a raw (unquantized) wire's rows come back
    viewed as [N, hidden] `dtype`."""
    raw = wire == Granularity.RAW
    out = ops.dispatch_unpack(recv, recv_counts, hidden * dtype.itemsize if raw else hidden, wire,
                              route.topk_idx.shape[1], num_rows, route.rank_capacity, route.expert_capacity)
    return (out[0].view(dtype),) + tuple(out[1:]) if raw else out


def tensor_scale(spec: ExchangeSpec, x):
    """(the dequant scale s, what dispatch_pack takes: s for a given scale, whose multiplier is
    1 / s; [s, 448 / amax] for one from the amax: the scale rule, so the bytes equal row
    granularity's for the same amax)."""
    if spec.tensor_scale is not None:
        # a copy, so the tokens keep the value they were quantized with when the caller updates its
        # scale in place (a given scale is a constant: no gradient flows to it)
        scale = spec.tensor_scale.detach().reshape(()).to(device=x.device, dtype=torch.float32, copy=True)
        return scale, scale
    amax = tensor_amax(x)
    if spec.world > 1:  # documented: tensor mode without a given scale costs one all-reduce
        # NaN as inf: a MAX all-reduce may drop NaN (gloo, by rank order); inf poisons every rank alike
        amax = torch.nan_to_num(amax, nan=math.inf, posinf=math.inf)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=spec.group)
    q, s = scale_rule(amax)
    sq = torch.stack((s, q))
    return sq[0], sq


def dispatch(spec: ExchangeSpec, x, route: Route, needs_grad=False, fail_peers=None):
    """Dispatch x's rows: (data, scales, weights, tokens per expert, Layout without weights).

    needs_grad: this rank will run the backward's exchange; written in the header, so that every
    rank sees whether its peers will. fail_peers: called if this rank's pack rejects its input,
    before the peers' counts exchange."""
    elem = x.element_size()
    # Capacity mode must not sync, so it cannot agree on a format per call: it keeps its own.
    local_wire = (Granularity.RAW if x.numel() * elem < spec.bf16_below_bytes and not route.expert_capacity
                  else spec.code)
    scale, packed_scale = tensor_scale(spec, x) if spec.code == Granularity.TENSOR else (None, None)
    try:
        send, counts, send_pos = pack(spec, x, route, local_wire, packed_scale, needs_grad)
    except Exception:
        if fail_peers is not None:
            fail_peers()
        raise
    recv_counts = exchange_counts(spec, counts)
    hidden = x.shape[1]
    if route.expert_capacity:
        return _dispatch_static(spec, x, route, scale, send, counts, send_pos, recv_counts)
    # The one host sync of a dispatch: what we send and what we receive, in one copy (tolist
    # copies a device tensor to the host itself).
    host = (counts if spec.local else torch.cat([counts, recv_counts])).tolist()
    mine, theirs = host[: spec.world], host[-spec.world:]
    wire = agree_on_wire(spec, theirs, hidden, elem)
    if wire != local_wire:  # this rank was under the size threshold but others were not
        send, counts, send_pos = pack(spec, x, route, wire, packed_scale, needs_grad)
    send_splits = [row[_ROWS] for row in mine]
    recv_splits = [row[_ROWS] for row in theirs]
    num_rows = sum(sum(row[_EXPERTS:]) for row in theirs)
    recv = all_to_all(spec, send, send_splits, recv_splits)
    data, scale_rows, weights, tpe, slot_pos, _ = unpack(recv, route, wire, recv_counts, hidden, x.dtype, num_rows)
    layout = Layout(route.topk_idx, route.topk_weights, spec=spec, hidden=hidden, dtype=x.dtype, wire=wire,
                    send_pos=send_pos, slot_pos=slot_pos, recv_counts=recv_counts, recv_counts_host=theirs,
                    send_splits=send_splits, recv_splits=recv_splits, num_rows=num_rows, tensor_scale=scale)
    return data, scale_rows, weights, tpe, layout


def _dispatch_static(spec, x, route, scale, send, counts, send_pos, recv_counts):
    """Capacity mode: fixed splits and a fixed expert-major layout, so nothing is read on the host
    after a shape's first call."""
    # once per new shape, the checks the sync would do (every rank meets a new shape at the same call:
    # capacity mode needs equal shapes on every rank), the GRAD column's agreement included
    key = (tuple(x.shape), route.topk_idx.shape[1], x.dtype)
    if key not in spec.checked_static:
        # out-of-range ids are counted (handle.invalid_ids), on this call as on every later one
        agree_on_wire(spec, recv_counts.cpu().tolist(), x.shape[1], x.element_size(), raise_on_bad_ids=False)
        if spec.world > 1:  # static splits need the same tokens per rank everywhere
            tokens = [v[0] for v in gather_ints(spec.group, spec.world, [x.shape[0]], counts.device)]
            if len(set(tokens)) != 1:
                raise ValueError(f"fp8a2a: capacity mode needs the same number of tokens on every rank, got {tokens}")
        spec.checked_static.add(key)
    splits = [route.rank_capacity] * spec.world
    num_rows = spec.world * route.expert_capacity * spec.num_local_experts
    bad = counts[0, CountsCol.BAD_IDS]
    recv = all_to_all(spec, send, splits, splits)
    data, scale_rows, weights, tpe, slot_pos, _ = unpack(recv, route, spec.code, recv_counts, x.shape[1], x.dtype,
                                                         num_rows)
    padded = torch.full_like(tpe, spec.world * route.expert_capacity)
    layout = Layout(route.topk_idx, route.topk_weights, route.rank_capacity, route.expert_capacity, route.dropped,
                    spec=spec, hidden=x.shape[1], dtype=x.dtype, wire=spec.code, send_pos=send_pos,
                    slot_pos=slot_pos, recv_counts=recv_counts, send_splits=splits, recv_splits=splits,
                    num_rows=num_rows, tensor_scale=scale,
                    # the ids as the caller gave them: expert TP replicated each one tp times
                    invalid_ids=bad if spec.tp == 1 else bad // spec.tp, tokens_received=tpe)
    return data, scale_rows, weights, padded, layout


def agree_on_wire(spec: ExchangeSpec, headers, hidden, elem, raise_on_bad_ids=True) -> Granularity:
    """Check every rank's header (rows of the counts exchange, as lists: all ranks see all headers,
    so all raise together) and agree on one wire format: FP8 if any rank packed FP8 (the size
    policy is local). Out-of-range expert ids raise unless not `raise_on_bad_ids` (capacity mode,
    which counts them)."""
    # The common case first: every rank sent the same header, valid and without bad ids, and its
    # hidden size is this rank's. Anything else takes the full checks below, which name what differs.
    head = headers[0][:_ROWS]
    if head[_BAD_IDS] == 0 and all(row[:_ROWS] == head for row in headers[1:]):
        raw = head[_WIRE] == Granularity.RAW
        if (head[_HIDDEN] // elem if raw else head[_HIDDEN]) == hidden:
            return Granularity.RAW if raw else spec.code
    failed = [r for r, row in enumerate(headers) if row[_BAD_IDS] == REJECTED]
    if failed:
        raise RuntimeError(f"fp8a2a: ranks {failed} rejected their dispatch input (their error says why); "
                           f"this rank raises too instead of waiting for them")
    bad = [row[_BAD_IDS] // spec.tp for row in headers]  # expert TP replicated each id tp times
    if raise_on_bad_ids and any(bad):
        raise ValueError(f"fp8a2a: expert ids outside [-1, {spec.num_experts // spec.tp}) on ranks "
                         f"{[r for r, b in enumerate(bad) if b]} ({bad} ids)")
    _all_equal([row[_TOPK] for row in headers], "ranks use different top-k: {}")
    # combine's rows carry x's dtype: they would differ in size or meaning
    _all_equal([ACT_DTYPES.get(row[_DTYPE], row[_DTYPE]) for row in headers], "ranks dispatch x of different dtypes: {}")
    # a rank whose input requires no grad would not enter the backward's exchange its peers wait in
    _all_equal([bool(row[_GRAD]) for row in headers], "x (or topk_weights) requires grad on some ranks only: "
               "{} (every rank must run the dispatch's backward, or none)")
    wires = [row[_WIRE] for row in headers]
    sizes = [row[_HIDDEN] // elem if w == Granularity.RAW else row[_HIDDEN] for row, w in zip(headers, wires)]
    if any(s != hidden for s in sizes):
        raise ValueError(f"fp8a2a: ranks use different hidden sizes: {sizes} (this rank: {hidden})")
    return Granularity.RAW if all(w == Granularity.RAW for w in wires) else spec.code


def _all_equal(per_rank, message):
    if len(set(per_rank)) != 1:
        raise ValueError("fp8a2a: " + message.format(per_rank))


def fail_dispatch(spec: ExchangeSpec, device, amax_pending: bool):
    """This rank rejected its input before the counts exchange. Take part in the collectives the
    other ranks are waiting in (the tensor-mode amax all-reduce if `amax_pending`, then the counts
    exchange) with a header that marks the failure, so they raise (agree_on_wire) instead of
    hanging. Capacity mode reads no header after a shape's first call: see README's limits."""
    if spec.local:
        return
    try:
        if amax_pending:
            dist.all_reduce(torch.zeros((), device=device), op=dist.ReduceOp.MAX, group=spec.group)
        header = torch.zeros((spec.world, CountsCol.EXPERTS + spec.num_local_experts), dtype=torch.int64,
                             device=device)
        header[:, CountsCol.BAD_IDS] = REJECTED
        exchange_counts(spec, header)
    except Exception:  # e.g. the peers are gone: the input error is the one the caller must see
        pass


# ---- combine and the backward passes ------------------------------------------------------------

def combine(expert_out, weights, layout: Layout, quantize: bool, extra=None):
    """Rows back to their tokens: pack (weighted unless weights is None; `extra` [N, K'] float32
    per-slot values carried along), exchange, sum per token in float32, convert last.
    (y [T, H] in the dispatch's dtype, the extra values [T, K'] or an empty tensor)."""
    spec = layout.spec
    buf = ops.combine_pack(expert_out.contiguous(), layout.slot_pos, None if weights is None else _detached(weights),
                           extra, quantize, layout.dtype)
    back = all_to_all(spec, buf, layout.recv_splits, layout.send_splits)
    extra_k = layout.topk_idx.shape[1] if extra is not None else 0
    return ops.combine_unpack(back, layout.send_pos, layout.hidden, layout.dtype, quantize, extra_k)


def poison_combine(layout: Layout):
    """This rank rejected its combine input. Its peers are already on their way into the combine
    exchange and read nothing on the host there, so they cannot be told to raise: send them rows
    of the exchange's exact sizes whose bytes are all 0xFF (NaN in a BF16/FP16/FP32 payload, and in
    an e4m3 payload with its f32 scale), which their combine_unpack sums into the tokens this rank
    served: NaN, never finite wrong values."""
    spec = layout.spec
    if spec.local:
        return
    try:
        row = ops.combine_row_bytes(layout.hidden, layout.dtype, spec.fp8_combine, 0)
        buf = torch.full((sum(layout.recv_splits), row), 0xFF, dtype=torch.uint8, device=layout.send_pos.device)
        all_to_all(spec, buf, layout.recv_splits, layout.send_splits)
    except Exception:  # e.g. the peers are gone: the input error is the one the caller must see
        pass


def redispatch(grad_y, layout: Layout):
    """Combine's backward: dy to the experts over the cached layout (FP8 unless the forward dispatch
    went unquantized), no counts exchange, no host sync. (data, scale, wire): raw data is dy's rows
    in the dispatch's dtype."""
    wire = Granularity.RAW if layout.wire == Granularity.RAW else Granularity.ROW
    send, _, _ = pack(layout.spec, grad_y, layout, wire)
    recv = all_to_all(layout.spec, send, layout.send_splits, layout.recv_splits)
    data, scale, _, _, _, _ = unpack(recv, layout, wire, layout.recv_counts, layout.hidden, layout.dtype,
                                     layout.num_rows)
    return data, scale, wire
