"""Expert-parallel dispatch and combine: one uint8 all_to_all_single per direction, with autograd.

Dispatch (forward):  dispatch_pack -> all_to_all(counts) -> one host sync -> all_to_all(rows)
                     -> dispatch_unpack.  Rows carry FP8 payload, scales and routing together.
Combine (forward):   combine_pack (sum of a token's local experts, weighted) -> all_to_all
                     -> combine_unpack (sum over ranks).
Backward reuses the same machinery in the other direction: dispatch backward is a combine of
the row gradients (BF16 by default) that also carries the router-weight gradients; combine
backward is a dispatch of dy (FP8 by default) over the cached layout, with no counts exchange.
"""
import math
import struct
from dataclasses import MISSING, dataclass, field, fields
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch.autograd import forward_ad

from . import ops
from .quant import QuantizedTensor, checked_tensor_scale, dequantize, scale_rule, tensor_amax
from .wire import ACT_DTYPES, REJECTED, CountsCol, Granularity

# Below this many bytes of input per rank, the dispatch sends the activation unquantized: the
# exchange is latency-bound there and BF16 costs no extra kernel in this design, so it is free
# accuracy. Override per Dispatcher (bf16_below_bytes=0 forces FP8).
DEFAULT_BF16_BELOW_BYTES = 64 * 1024


@dataclass(frozen=True)
class DispatcherConfig:
    """A Dispatcher's options (their meaning: see Dispatcher), checked on construction. The group
    size checks (expert_tp_size divides it) need the group and happen in the Dispatcher."""
    granularity: str = "row"
    fp8_combine: bool = False
    fp8_dispatch_backward: bool = False
    bf16_below_bytes: int = DEFAULT_BF16_BELOW_BYTES
    expert_tp_size: int = 1
    capacity_factor: Optional[float] = None
    always_communicate: bool = False

    def __post_init__(self):
        ops.granularity_code(self.granularity)
        if int(self.bf16_below_bytes) < 0:
            raise ValueError(f"fp8a2a: bf16_below_bytes must be >= 0, got {self.bf16_below_bytes}")
        if self.expert_tp_size < 1:
            raise ValueError(f"fp8a2a: expert_tp_size must be >= 1, got {self.expert_tp_size}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"fp8a2a: capacity_factor must be positive, got {self.capacity_factor}")

    @property
    def code(self) -> Granularity:
        return Granularity(ops.granularity_code(self.granularity))


def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("fp8a2a: a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _float64_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def _show_float32_scale(bits: int):
    if bits < 0:
        return None if bits == -1 else "invalid"
    return struct.unpack("<f", struct.pack("<i", bits))[0]


# The counts header's columns as plain ints for the per-call reads (an enum member lookup is a
# Python attribute access each time).
_HIDDEN, _BAD_IDS, _WIRE, _ROWS, _EXPERTS = (int(c) for c in (CountsCol.HIDDEN, CountsCol.BAD_IDS, CountsCol.WIRE,
                                                              CountsCol.ROWS, CountsCol.EXPERTS))

# The options _check_agreement compares (name, how to print a rank's value), in the order of
# Dispatcher._agreed_options.
_AGREED_OPTIONS = (("num_experts", int), ("granularity", lambda c: Granularity(c).label), ("expert_tp_size", int),
                   ("tensor_scale", _show_float32_scale), ("fp8_combine", bool), ("fp8_dispatch_backward", bool),
                   ("capacity_factor", lambda b: None if b == -1 else struct.unpack("<d", struct.pack("<q", b))[0]))


_INVALID_OPTIONS = -3  # every value of a rank's agreement row: its options were rejected before it


def _tracing() -> bool:
    """Under torch.compile (or export) tracing: there meta and fake tensors are the normal case."""
    return torch.compiler.is_compiling()


def _forward_ad_active() -> bool:
    """A forward-AD level is entered (forward_ad.dual_level, torch.func.jvp): only then can an input
    be dual, and _tangent_error looks. The module global that dynamo's own dual-level guard reads;
    -1 outside any level."""
    return forward_ad._current_level >= 0


# a private torch API (torch.func's own check): looked up once, and absent means no transform
_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _differentiable(*tensors) -> bool:
    """Whether a call must go through its autograd Function: grad mode and an input (None: absent)
    that requires grad. Dual inputs, which do not require grad, never get here: _tangent_error
    rejects them first, so no tangent is dropped by the bypass."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


# Every tensor op called from Python is a host-side dispatch (and a launch on the GPU), even when it
# returns its input unchanged: the helpers below call one only when it changes something.

def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _float32_weights(t: torch.Tensor) -> torch.Tensor:
    """Router weights as the ops take them: float32, contiguous, without autograd history."""
    t = _detached(t)
    return (t if t.dtype == torch.float32 else t.float()).contiguous()


@dataclass(frozen=True)
class _Route:
    """One dispatch's routing as the kernels take it: after the capacity drop and the expert-TP
    replication (K' = K * expert_tp_size slots)."""
    topk_idx: torch.Tensor  # [T, K'] contiguous
    topk_weights: torch.Tensor  # [T, K'] float32, detached (only its layout is reused)
    # (route.topk_weights, handle.topk_weights: may be the caller's tensor itself, not a copy)
    rank_capacity: int = 0  # capacity mode: rows per destination rank segment (0: compact)
    expert_capacity: int = 0  # capacity mode: rows per (source rank, local expert)
    dropped: Optional[torch.Tensor] = None  # capacity mode: slots dropped on this rank (device)


@dataclass(frozen=True)
class DispatchHandle(_Route):
    """What combine and the backward passes need, built in one go per dispatch after its unpack;
    opaque to callers but for dropped, invalid_ids, num_rows and tokens_per_expert_list."""
    dispatcher: "Dispatcher" = None
    hidden: int = 0
    dtype: torch.dtype = torch.bfloat16
    wire: Granularity = Granularity.ROW  # what the rows were sent as (RAW: unquantized)
    send_pos: torch.Tensor = None  # [T, R] int32: send row of token t for rank r, or -1
    slot_pos: torch.Tensor = None  # [Nr, K'] int32: expert-major row of each received slot, or -1
    recv_counts: torch.Tensor = None  # [R, CountsCol.EXPERTS + local experts] int64 (device)
    # the counts exchange as read by the one host sync (compact mode; empty in capacity mode):
    # what this rank sent to each rank, and what it received from each
    send_counts_host: List[List[int]] = field(default_factory=list)
    recv_counts_host: List[List[int]] = field(default_factory=list)
    send_splits: List[int] = field(default_factory=list)  # rows sent to each rank
    recv_splits: List[int] = field(default_factory=list)  # rows received from each rank
    num_rows: int = 0  # expert-major rows N
    tensor_scale: Optional[torch.Tensor] = None  # the agreed scale in 'tensor' granularity
    invalid_ids: Optional[torch.Tensor] = None  # capacity mode: out-of-range ids seen (device)
    tokens_received: Optional[torch.Tensor] = None  # capacity mode: real rows per local expert
    weights: Optional[torch.Tensor] = None  # received router weights [N] (autograd-connected)

    @property
    def tokens_per_expert_list(self) -> List[int]:
        """Rows per local expert on the host (no extra sync); built on demand: a Python sum over
        ranks x experts is not free at hundreds of experts."""
        if self.expert_capacity:  # capacity mode: every expert holds its padded rows
            d = self.dispatcher
            return [d.world * self.expert_capacity] * d.num_local_experts
        return [sum(col) for col in zip(*(row[CountsCol.EXPERTS:] for row in self.recv_counts_host))]


_HANDLE_DEFAULTS = {f.name: f.default for f in fields(DispatchHandle) if f.default is not MISSING}
_HANDLE_FACTORIES = [(f.name, f.default_factory) for f in fields(DispatchHandle) if f.default_factory is not MISSING]


def _new_handle(values: dict) -> DispatchHandle:
    """DispatchHandle(**values) in one dict update: a frozen dataclass's __init__ sets each of its many
    fields through object.__setattr__, on every dispatch."""
    state = dict(_HANDLE_DEFAULTS)
    state.update(values)
    for name, factory in _HANDLE_FACTORIES:
        if name not in values:
            state[name] = factory()
    handle = object.__new__(DispatchHandle)
    handle.__dict__.update(state)
    return handle


@dataclass
class DispatchOutput:
    tokens: Union[QuantizedTensor, torch.Tensor]  # expert-major rows; a plain tensor when sent in BF16
    tokens_per_expert: torch.Tensor  # int64 [num_local_experts]
    weights: torch.Tensor  # float32 [N]
    handle: DispatchHandle

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if isinstance(self.tokens, QuantizedTensor):
            return dequantize(self.tokens, dtype)
        return self.tokens.to(dtype)


class Dispatcher:
    """FP8 token dispatch/combine for expert parallelism over `group` (default: the world).

    num_experts:            global number of experts, a multiple of the group size
    granularity:            'row' (default), 'block128' or 'tensor' (one scale agreed by all
                            ranks: the caller's `tensor_scale`, else an all-reduce of amax)
    fp8_combine:            send combine forward in FP8 too (lossy; default BF16)
    fp8_dispatch_backward:  send dispatch backward in FP8 too (lossy; default BF16)
    bf16_below_bytes:       size policy: smaller inputs are dispatched unquantized
    capacity_factor:        capacity mode (drop-and-pad, zero host syncs, static shapes, CUDA-graph
                            capturable): each expert takes at most ceil(factor * T * K / E)
                            tokens from each source rank (Megatron's rounding), dropping the lowest router weights;
                            every local expert gets R * C rows, padding rows are zero
    always_communicate:     call the collectives even at group size 1 (exercises NCCL on one GPU);
                            by default a group of one skips them, like Megatron does
    expert_tp_size:         expert tensor parallelism: `group` is then the TP-EP group (rank =
                            ep_rank * expert_tp_size + tp_rank, Megatron's order) and every TP
                            rank of an expert's EP rank receives its tokens (the FP8 all-gather)
                            and returns a partial output that combine sums (the reduce-scatter)
    config:                 the options above as one DispatcherConfig, instead of as arguments
    """

    def __init__(self, num_experts: int, group=None, granularity: str = "row", *, fp8_combine: bool = False,
                 fp8_dispatch_backward: bool = False, bf16_below_bytes: int = DEFAULT_BF16_BELOW_BYTES,
                 tensor_scale: Optional[torch.Tensor] = None, expert_tp_size: int = 1,
                 capacity_factor: Optional[float] = None, always_communicate: bool = False,
                 config: Optional[DispatcherConfig] = None):
        self.group = group
        self.rank, self.world = _group_info(group)
        try:
            given = DispatcherConfig(granularity=granularity, fp8_combine=fp8_combine,
                                     fp8_dispatch_backward=fp8_dispatch_backward, bf16_below_bytes=bf16_below_bytes,
                                     expert_tp_size=expert_tp_size, capacity_factor=capacity_factor,
                                     always_communicate=always_communicate)
            if config is None:
                config = given
            elif given != DispatcherConfig():
                raise TypeError("fp8a2a: pass the Dispatcher's options either as config= or as arguments, not both")
            elif not isinstance(config, DispatcherConfig):
                raise TypeError(f"fp8a2a: config must be a DispatcherConfig, got {type(config).__name__}")
            if self.world % config.expert_tp_size:
                raise ValueError(f"fp8a2a: expert_tp_size={config.expert_tp_size} must divide the group size "
                                 f"{self.world}")
            ep = self.world // config.expert_tp_size
            if num_experts < 1 or num_experts % ep:
                raise ValueError(f"fp8a2a: num_experts={num_experts} must be a positive multiple of the "
                                 f"expert-parallel size {ep}")
        except Exception:
            if self.world > 1:  # the peers are on their way into the agreement: make them raise too
                try:
                    self._gather_ints([_INVALID_OPTIONS] * len(_AGREED_OPTIONS))
                except Exception:  # e.g. the peers are gone: the option error is the one to see
                    pass
            raise
        self.config = config
        self.granularity = config.granularity
        self.code = config.code
        self.tp = config.expert_tp_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.fp8_combine = config.fp8_combine
        self.fp8_dispatch_backward = config.fp8_dispatch_backward
        self.bf16_below_bytes = config.bf16_below_bytes
        # the caller's tensor itself is kept (in-place updates reach the next call); its value is
        # read once here, on the host (one sync per Dispatcher for a device scale): checked, and as
        # float32 bits for the agreement check (-1: no scale, -2: an invalid one)
        scale_error, scale_bits = None, -1
        if tensor_scale is not None:
            try:
                tensor_scale = torch.as_tensor(tensor_scale)
                scale_bits = int(checked_tensor_scale(tensor_scale.detach().float().cpu()).view(torch.int32))
            except Exception as e:  # joins the agreement below, so that every rank raises
                scale_error, scale_bits = e, -2
        self.tensor_scale = tensor_scale
        self.capacity_factor = config.capacity_factor
        self._validated_shapes = set()
        self.local = self.world == 1 and not (config.always_communicate and dist.is_initialized())
        # NCCL moves CUDA tensors only (gloo takes CPU and CUDA ones): checked per call, before any
        # collective, as an attribute read
        self._needs_cuda = not self.local and dist.get_backend(group) == "nccl"
        if self.world > 1:
            self._check_agreement(scale_bits, scale_error)
        elif scale_error is not None:
            raise scale_error

    def _check_agreement(self, scale_bits, scale_error):
        # Once per Dispatcher, not per call, in one all-gather: every option that changes what
        # crosses the wire or which collectives a rank enters must be the same on every rank, or
        # the per-call exchanges would have mismatched sizes or meanings (a hang, a gloo abort or
        # silently wrong numbers, not an error). A rank with an invalid tensor scale joins the
        # gather too (-2), so that every rank raises. Not compared: bf16_below_bytes (the ranks
        # agree on the wire format per call, in the counts exchange: it may differ by rank) and
        # always_communicate (it only matters at group size 1, where there is no peer).
        every = self._gather_ints(self._agreed_options(scale_bits))
        if scale_error is not None:
            raise scale_error
        invalid = [r for r, v in enumerate(every) if v[0] == _INVALID_OPTIONS]
        if invalid:
            raise ValueError(f"fp8a2a: ranks {invalid} were given invalid Dispatcher options (their error says why)")
        invalid = [r for r, v in enumerate(every) if v[3] == -2]
        if invalid:
            raise ValueError(f"fp8a2a: ranks {invalid} were given an invalid tensor_scale (their error says why)")
        differ = [f"{name} (per rank: {[show(v[i]) for v in every]})"
                  for i, (name, show) in enumerate(_AGREED_OPTIONS) if len({v[i] for v in every}) > 1]
        if differ:
            raise ValueError(f"fp8a2a: ranks disagree on the Dispatcher option(s) {'; '.join(differ)}: every rank "
                             f"of the group must build its Dispatcher with the same options")

    def _agreed_options(self, scale_bits) -> List[int]:
        """The options of _AGREED_OPTIONS as ints, in its order."""
        cap = self.capacity_factor
        # capacity_factor exactly, as float64 bits (a positive float's bits are >= 0; -1: off)
        return [self.num_experts, int(self.code), self.tp, scale_bits, int(self.fp8_combine),
                int(self.fp8_dispatch_backward), -1 if cap is None else _float64_bits(cap)]

    def _gather_ints(self, values: List[int]) -> List[List[int]]:
        """Every rank's `values` (one all-gather, one host read): for once-per-setup agreement checks."""
        mine = torch.tensor(values, dtype=torch.int64, device=self._device())
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return torch.stack(every).cpu().tolist()

    def _device(self):
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # ---- the two collectives -------------------------------------------------------------

    def _exchange(self, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
        sent = send_splits[0] if self.local else sum(send_splits)
        if sent != send.shape[0]:  # the pack allocates for the worst case
            send = send[:sent]
        if self.local:
            return send
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        return recv

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.local:
            return counts
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        return recv

    # ---- public API ------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        """Send each token (once per destination rank) to the ranks of its top-k experts.

        x [T, H] float; topk_idx int [T, K] (-1 = not routed); topk_weights [T, K]."""
        try:  # a rank whose input is rejected here makes the others raise too, not wait for it
            self._check_inputs(x, topk_idx, topk_weights)
            capacity = {}
            if self.capacity_factor is not None:
                t, k = topk_idx.shape
                c = max(1, math.ceil((t * k / self.num_experts) * self.capacity_factor))  # Megatron's get_capacity
                # per expert, the c slots of this rank with the largest router weight stay (one kernel)
                topk_idx, dropped = ops.capacity_drop(topk_idx.contiguous(), _float32_weights(topk_weights),
                                                      self.num_experts, c)
                # at least one row per rank segment: T = 0 still gets a (padding-only) static layout
                capacity = dict(expert_capacity=c, rank_capacity=max(1, min(t, self.num_local_experts * c)),
                                dropped=dropped)
            if self.tp > 1:
                topk_idx, topk_weights = self._replicate_over_tp(topk_idx, topk_weights)
            route = _Route(topk_idx.contiguous(), _float32_weights(topk_weights), **capacity)
        except Exception:
            self._fail_peers(reduced=False)
            raise
        # The autograd Function runs its forward without grad mode: without it, so must every input
        # (the tensor scale included), or an output could carry a history the Function's would not.
        if _differentiable(x, topk_weights, self.tensor_scale):
            rows, weights, data, scale, tpe, layout = _DispatchFn.apply(x, topk_weights, self, route)
            anchor = rows if rows.requires_grad else None
        else:  # nothing to differentiate: skip the Function's bookkeeping, a host cost on every call
            data, scale, weights, tpe, layout = self._forward(x, route)
            rows, anchor = data, None
        # the handle callers get carries the weights; what the backward keeps does not (a cycle)
        handle = _new_handle(dict(layout, weights=weights))
        if handle.wire == Granularity.RAW:
            tokens = rows
        else:
            if self.code == Granularity.TENSOR:
                scale = handle.tensor_scale
            tokens = QuantizedTensor(data, scale, self.granularity, grad_anchor=anchor)
        return DispatchOutput(tokens, tpe, weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, apply_weights: bool = True) -> torch.Tensor:
        """y [T, H] in x.dtype: sum over k of weight * expert row (apply_weights=False: unweighted).

        A rank whose expert_out is rejected still takes part in the exchange (rows of 0xFF bytes, so
        the peers' y is NaN in every token this rank served; they cannot raise without a host sync)
        and then raises."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"fp8a2a: combine expects the DispatchHandle of a dispatch, got {type(handle).__name__}")
        error = _combine_input_error(expert_out, handle)
        if error is not None:
            handle.dispatcher._poison_combine(handle)
            raise error
        weights = handle.weights if apply_weights else None
        if expert_out.dtype != handle.dtype:
            expert_out = expert_out.to(handle.dtype)
        if _differentiable(expert_out, weights):
            return _CombineFn.apply(expert_out, weights, handle)
        return _combine_rows(expert_out, weights, handle)  # nothing to differentiate: no Function

    # ---- pieces used by the autograd functions ---------------------------------------------

    def _check_inputs(self, x, topk_idx, topk_weights):
        # attribute reads only (no tensor op, no sync): this runs on every call
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"fp8a2a: dispatch expects {name} as a torch.Tensor, got {type(t).__name__}")
        device = x.device
        if topk_idx.device != device or topk_weights.device != device:
            raise ValueError(f"fp8a2a: dispatch needs x, topk_idx and topk_weights on one device, got {device}, "
                             f"{topk_idx.device} and {topk_weights.device}")
        _check_device(x, self._needs_cuda, "dispatch")
        if topk_idx.dtype not in _IDX_DTYPES or not topk_weights.is_floating_point():
            raise ValueError(f"fp8a2a: topk_idx must be int64 or int32 and topk_weights floating-point, got "
                             f"{topk_idx.dtype} and {topk_weights.dtype}")
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"fp8a2a: expected x [T, H] and topk_idx [T, K], got {tuple(x.shape)} and "
                             f"{tuple(topk_idx.shape)}")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"fp8a2a: topk_weights {tuple(topk_weights.shape)} must match topk_idx "
                             f"{tuple(topk_idx.shape)}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"fp8a2a: x must be float32, float16 or bfloat16, got {x.dtype}")
        if x.shape[1] == 0:
            raise ValueError("fp8a2a: x has hidden size 0")
        error = _tangent_error("dispatch", x=x, topk_weights=topk_weights)
        if error is not None:
            raise error
        # checked whatever wire this call takes: a rank under the size threshold must fail like the others
        if self.code == Granularity.BLOCK128 and x.shape[1] % 128:
            raise ValueError(f"fp8a2a: block128 granularity needs hidden % 128 == 0, got hidden={x.shape[1]}")

    def _fail_peers(self, reduced: bool = True):
        """This rank rejected its input before the counts exchange. Take part in the collectives the
        other ranks are waiting in (the tensor-mode amax all-reduce unless `reduced`, then the counts
        exchange) with a header that marks the failure, so they raise (_agree_on_wire) instead of
        hanging. Capacity mode reads no header after a shape's first call: see README's limits."""
        if self.local:
            return
        try:
            device = self._device()
            if self.code == Granularity.TENSOR and self.tensor_scale is None and not reduced:
                dist.all_reduce(torch.zeros((), device=device), op=dist.ReduceOp.MAX, group=self.group)
            header = torch.zeros((self.world, CountsCol.EXPERTS + self.num_local_experts), dtype=torch.int64,
                                 device=device)
            header[:, CountsCol.BAD_IDS] = REJECTED
            self._exchange_counts(header)
        except Exception:  # e.g. the peers are gone: the input error is the one the caller must see
            pass

    def _poison_combine(self, handle):
        """This rank rejected its combine input. Its peers are already on their way into the combine
        exchange and read nothing on the host there, so they cannot be told to raise: send them rows
        of the exchange's exact sizes whose bytes are all 0xFF (NaN in a BF16/FP16/FP32 payload, and
        in an e4m3 payload with its f32 scale), which their combine_unpack sums into the tokens this
        rank served: NaN, never finite wrong values."""
        if self.local:
            return
        try:
            row = ops.combine_row_bytes(handle.hidden, handle.dtype, self.fp8_combine, 0)
            buf = torch.full((sum(handle.recv_splits), row), 0xFF, dtype=torch.uint8, device=handle.send_pos.device)
            self._exchange(buf, handle.recv_splits, handle.send_splits)
        except Exception:  # e.g. the peers are gone: the input error is the one the caller must see
            pass

    def _replicate_over_tp(self, topk_idx, topk_weights):
        """Expert TP as routing: expert e becomes one virtual expert on each TP rank of its EP rank,
        so the ops see tp * E experts over the whole TP-EP group and need nothing special.
        The weight copies are autograd views: their gradients sum back into topk_weights."""
        el, tp = self.num_local_experts, self.tp
        e = topk_idx.long().unsqueeze(-1)
        j = torch.arange(tp, device=e.device)
        virtual = ((e // el) * tp + j) * el + e % el
        valid = (e >= 0) & (e < self.num_experts)
        bad = torch.where(e == -1, -1, self.num_experts * tp)  # keep bad ids bad, -1 unrouted
        idx = torch.where(valid, virtual, bad).flatten(1)
        return idx, topk_weights.unsqueeze(-1).expand(*topk_weights.shape, tp).flatten(1)

    def _tensor_scale(self, x):
        """(the dequant scale s, what dispatch_pack takes: s for a given scale, whose multiplier is
        1 / s; [s, 448 / amax] for one from the amax: the scale rule, so the bytes equal row
        granularity's for the same amax)."""
        if self.tensor_scale is not None:
            scale = self.tensor_scale.reshape(()).to(device=x.device, dtype=torch.float32)
            return scale, scale
        amax = tensor_amax(x)
        if self.world > 1:  # documented: tensor mode without a given scale costs one all-reduce
            # NaN as inf: a MAX all-reduce may drop NaN (gloo, by rank order); inf poisons every rank alike
            amax = torch.nan_to_num(amax, nan=math.inf, posinf=math.inf)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        q, s = scale_rule(amax)
        sq = torch.stack((s, q))
        return sq[0], sq

    def _pack(self, x, route: _Route, wire, tensor_scale=None):
        # raw: the op sends x's own bytes and writes its dtype in the header, as for every wire
        return ops.dispatch_pack(_detached(x).contiguous(), route.topk_idx, route.topk_weights,
                                 self.num_experts * self.tp, self.world, wire, tensor_scale, route.rank_capacity)

    def _unpack(self, recv, route: _Route, wire, recv_counts, hidden, dtype, num_rows):
        """dispatch_unpack of `num_rows` expert-major rows; a raw (unquantized) wire's rows come back
        viewed as [N, hidden] `dtype`."""
        raw = wire == Granularity.RAW
        out = ops.dispatch_unpack(recv, recv_counts, hidden * dtype.itemsize if raw else hidden, wire,
                                  route.topk_idx.shape[1], num_rows, route.rank_capacity, route.expert_capacity)
        return (out[0].view(dtype),) + tuple(out[1:]) if raw else out

    def _forward(self, x, route: _Route):
        """(data, scales, weights, tokens per expert, the DispatchHandle fields of this call but its
        weights, as a dict)."""
        elem = x.element_size()
        capacity = route.expert_capacity > 0
        # Capacity mode must not sync, so it cannot agree on a format per call: it keeps its own.
        local = Granularity.RAW if x.numel() * elem < self.bf16_below_bytes and not capacity else self.code
        scale, packed_scale = self._tensor_scale(x) if self.code == Granularity.TENSOR else (None, None)
        try:
            send, counts, send_pos = self._pack(x, route, local, packed_scale)
        except Exception:
            self._fail_peers()
            raise
        recv_counts = self._exchange_counts(counts)
        if capacity:
            return self._forward_static(x, route, scale, send, counts, send_pos, recv_counts)
        # The one host sync of a dispatch: what we send and what we receive, in one copy (tolist
        # copies a device tensor to the host itself).
        host = (counts if self.local else torch.cat([counts, recv_counts])).tolist()
        mine, theirs = host[: self.world], host[-self.world:]
        wire = self._agree_on_wire(theirs, x.shape[1], elem)
        if wire != local:  # this rank was under the size threshold but others were not
            send, counts, send_pos = self._pack(x, route, wire, packed_scale)
        send_splits = [row[_ROWS] for row in mine]
        recv_splits = [row[_ROWS] for row in theirs]
        num_rows = sum(sum(row[_EXPERTS:]) for row in theirs)
        recv = self._exchange(send, send_splits, recv_splits)
        data, scale_rows, weights, tpe, slot_pos, _ = self._unpack(recv, route, wire, recv_counts, x.shape[1], x.dtype,
                                                                   num_rows)
        layout = dict(vars(route), dispatcher=self, hidden=x.shape[1], dtype=x.dtype, wire=wire, send_pos=send_pos,
                      slot_pos=slot_pos, recv_counts=recv_counts, send_counts_host=mine, recv_counts_host=theirs,
                      send_splits=send_splits, recv_splits=recv_splits, num_rows=num_rows, tensor_scale=scale)
        return data, scale_rows, weights, tpe, layout

    def _forward_static(self, x, route, scale, send, counts, send_pos, recv_counts):
        """Capacity mode: fixed splits and a fixed expert-major layout, so nothing is read on the host."""
        key = (tuple(x.shape), route.topk_idx.shape[1], x.dtype)
        if key not in self._validated_shapes:  # once per new shape: the checks the sync would do
            # out-of-range ids are counted (handle.invalid_ids), on this call as on every later one
            self._agree_on_wire(recv_counts.cpu().tolist(), x.shape[1], x.element_size(), raise_on_bad_ids=False)
            if self.world > 1:  # static splits need the same tokens per rank everywhere
                tokens = [v[0] for v in self._gather_ints([x.shape[0]])]
                if len(set(tokens)) != 1:
                    raise ValueError(f"fp8a2a: capacity mode needs the same number of tokens on every rank, got "
                                     f"{tokens}")
            self._validated_shapes.add(key)
        splits = [route.rank_capacity] * self.world
        num_rows = self.world * route.expert_capacity * self.num_local_experts
        recv = self._exchange(send, splits, splits)
        data, scale_rows, weights, tpe, slot_pos, _ = self._unpack(recv, route, self.code, recv_counts, x.shape[1],
                                                                   x.dtype, num_rows)
        padded = torch.full_like(tpe, self.world * route.expert_capacity)
        layout = dict(vars(route), dispatcher=self, hidden=x.shape[1], dtype=x.dtype, wire=self.code,
                      send_pos=send_pos, slot_pos=slot_pos, recv_counts=recv_counts, send_splits=splits,
                      recv_splits=splits, num_rows=num_rows, tensor_scale=scale,
                      invalid_ids=counts[0, CountsCol.BAD_IDS], tokens_received=tpe)
        return data, scale_rows, weights, padded, layout

    def _agree_on_wire(self, headers, hidden, elem, raise_on_bad_ids=True):
        """Check every rank's header (rows of the counts exchange, as lists: all ranks see all
        headers, so all raise together) and agree on one wire format: FP8 if any rank packed FP8
        (the size policy is local). Out-of-range expert ids raise unless not `raise_on_bad_ids`
        (capacity mode, which counts them)."""
        # The common case first: every rank sent the same header, valid and without bad ids, and
        # its hidden size is this rank's. Anything else takes the full checks below, which name
        # what differs.
        head = headers[0][:_ROWS]
        if head[_BAD_IDS] == 0 and all(row[:_ROWS] == head for row in headers[1:]):
            raw = head[_WIRE] == Granularity.RAW
            if (head[_HIDDEN] // elem if raw else head[_HIDDEN]) == hidden:
                return Granularity.RAW if raw else self.code
        failed = [r for r, row in enumerate(headers) if row[CountsCol.BAD_IDS] < 0]  # REJECTED
        if failed:
            raise RuntimeError(f"fp8a2a: ranks {failed} rejected their dispatch input (their error says why); "
                               f"this rank raises too instead of waiting for them")
        bad = [row[CountsCol.BAD_IDS] for row in headers]
        if raise_on_bad_ids and any(bad):
            raise ValueError(f"fp8a2a: expert ids outside [-1, {self.num_experts}) on ranks "
                             f"{[r for r, b in enumerate(bad) if b]} ({bad} ids)")
        topks = [row[CountsCol.TOPK] for row in headers]
        if len(set(topks)) != 1:
            raise ValueError(f"fp8a2a: ranks use different top-k: {topks}")
        dtypes = [row[CountsCol.DTYPE] for row in headers]
        if len(set(dtypes)) != 1:  # combine's rows carry x's dtype: they would differ in size or meaning
            raise ValueError(f"fp8a2a: ranks dispatch x of different dtypes: {[ACT_DTYPES.get(d, d) for d in dtypes]}")
        wires = [row[CountsCol.WIRE] for row in headers]
        sizes = [row[CountsCol.HIDDEN] // elem if w == Granularity.RAW else row[CountsCol.HIDDEN] for row, w in zip(headers, wires)]
        if any(s != hidden for s in sizes):
            raise ValueError(f"fp8a2a: ranks use different hidden sizes: {sizes} (this rank: {hidden})")
        raw = [w == Granularity.RAW for w in wires]
        return Granularity.RAW if all(raw) else self.code


_IDX_DTYPES = (torch.int64, torch.int32)


def _check_device(t: torch.Tensor, needs_cuda: bool, op: str):
    """A dispatch or combine input's device: never meta outside tracing (the fake kernels would hand
    back uninitialised buffers), CUDA where the group's backend is NCCL. Attribute reads only (a
    tensor's is_meta and is_cuda are cheaper than its device's type)."""
    if t.is_meta and not _tracing():
        raise ValueError(f"fp8a2a: {op} got meta tensors outside torch.compile tracing: there is no data to send")
    if needs_cuda and not t.is_cuda:
        raise ValueError(f"fp8a2a: {op} got tensors on {t.device}, but the process group's backend (NCCL) needs "
                         f"CUDA tensors")


def _tangent_error(op: str, **tensors) -> Optional[Exception]:
    """Why dispatch or combine must reject these inputs for forward-mode AD (None: fine). They have
    no jvp and no torch.func support: a dual input, or a call inside a transform, is rejected
    before any collective, as any bad input is, so that every rank raises (not after the exchanges,
    where the autograd Function would fail and the peers wait in the next exchange). Inference mode
    disables forward AD: there the tangents are ignored, as everywhere."""
    if _forward_ad_active() and not torch.is_inference_mode_enabled():
        for name, t in tensors.items():
            if forward_ad.unpack_dual(t).tangent is not None:
                return NotImplementedError(f"fp8a2a: {op} has no forward-mode AD (jvp), and {name} is a dual tensor")
    # torch.func's transforms need Functions with setup_context, which these are not: their error
    # would come from the Function's apply, after this rank's peers entered the exchange
    if _functorch_transforms_active() and not _tracing():
        return NotImplementedError(f"fp8a2a: {op} does not support torch.func transforms (jvp, grad, vmap)")
    return None


_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _combine_input_error(expert_out, handle: DispatchHandle) -> Optional[Exception]:
    """Why combine must reject expert_out (None: it is fine). Attribute reads only: every call runs it."""
    if not isinstance(expert_out, torch.Tensor):
        return TypeError(f"fp8a2a: combine expects expert_out as a torch.Tensor (dequantize a QuantizedTensor "
                         f"first), got {type(expert_out).__name__}")
    if expert_out.dim() != 2 or expert_out.shape != (handle.num_rows, handle.hidden):
        return ValueError(f"fp8a2a: expert_out must be [{handle.num_rows}, {handle.hidden}] (the dispatched rows), "
                          f"got {tuple(expert_out.shape)}")
    if expert_out.dtype not in _COMBINE_DTYPES:
        return ValueError(f"fp8a2a: expert_out must be bfloat16, float16, float32 or float64, got {expert_out.dtype}")
    device = handle.send_pos.device
    if expert_out.device != device:
        return ValueError(f"fp8a2a: expert_out is on {expert_out.device}, but the dispatch ran on {device}")
    return _tangent_error("combine", expert_out=expert_out)


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, dispatcher, route):
        data, scale, weights, tpe, layout = dispatcher._forward(x, route)
        ctx.layout = layout  # without the weights: they would close a reference cycle through ctx
        if layout["wire"] == Granularity.RAW:  # data: the rows themselves, [N, H] in x's dtype
            placeholder = data.new_empty(0)
            ctx.mark_non_differentiable(placeholder, scale, tpe)
            return data, weights, placeholder, scale, tpe, layout
        # gradient carrier of the FP8 rows: no memory, never read
        anchor = x.new_empty(()).expand(layout["num_rows"], layout["hidden"])
        ctx.mark_non_differentiable(data, scale, tpe)
        return anchor, weights, data, scale, tpe, layout

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, *_):
        h = DispatchHandle(**ctx.layout)
        d = h.dispatcher
        # the rows' width must be the same on every rank, whichever ranks' router weights need a
        # gradient: with peers, always with the weights' column
        want_w = not d.local or (ctx.needs_input_grad[1] and grad_weights is not None)
        if grad_rows is None:
            grad_rows = torch.zeros((h.num_rows, h.hidden), dtype=h.dtype, device=h.send_pos.device)
        if want_w and grad_weights is None:
            grad_weights = torch.zeros(h.num_rows, dtype=torch.float32, device=h.send_pos.device)
        extra = grad_weights.float().contiguous() if want_w else None
        quant = d.fp8_dispatch_backward
        buf = ops.combine_pack(grad_rows.to(h.dtype).contiguous(), h.slot_pos, None, extra, quant)
        back = d._exchange(buf, h.recv_splits, h.send_splits)
        gx, gw = ops.combine_unpack(back, h.send_pos, h.hidden, h.dtype, quant, h.topk_idx.shape[1] if want_w else 0)
        return gx, (gw if want_w and ctx.needs_input_grad[1] else None), None, None


def _combine_rows(expert_out, weights, handle):
    """Combine's forward: pack (weighted unless weights is None), exchange, sum per token."""
    d = handle.dispatcher
    buf = ops.combine_pack(expert_out.contiguous(), handle.slot_pos, None if weights is None else _detached(weights),
                           None, d.fp8_combine)
    back = d._exchange(buf, handle.recv_splits, handle.send_splits)
    return ops.combine_unpack(back, handle.send_pos, handle.hidden, handle.dtype, d.fp8_combine, 0)[0]


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, handle):
        y = _combine_rows(expert_out, weights, handle)
        ctx.handle = handle
        ctx.save_for_backward(expert_out if weights is not None else None, weights)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        h = ctx.handle
        d = h.dispatcher
        expert_out, weights = ctx.saved_tensors
        # Combine backward moves dy to the experts: a dispatch over the cached layout (FP8 unless
        # the forward dispatch went unquantized), no counts exchange, no host sync.
        wire = Granularity.RAW if h.wire == Granularity.RAW else Granularity.ROW
        send, _, _ = d._pack(grad_y, h, wire)
        recv = d._exchange(send, h.send_splits, h.recv_splits)
        # raw: data is dy's rows in h.dtype
        data, scale, _, _, _, _ = d._unpack(recv, h, wire, h.recv_counts, h.hidden, h.dtype, h.num_rows)
        raw = wire == Granularity.RAW
        if weights is None:  # straight into the output dtype: no fp32 copy of [rows, hidden]
            return (data if raw else ops.dequantize(data, scale, h.dtype)), None, None
        w = weights.detach()
        gf = data.float() if raw else None
        # FP8: the router weight folds into the row scale, one dequantize gives the weighted gradient
        grad_out = (gf * w.unsqueeze(1)).to(h.dtype) if raw else ops.dequantize(data, scale * w, h.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            gf = gf if raw else ops.dequantize(data, scale, torch.float32)
            grad_w = (gf * expert_out.float()).sum(1)
        return grad_out, grad_w, None
