"""The public facade: Dispatcher's options, their agreement across ranks, the input checks, and
dispatch / combine over the exchange engine (fp8a2a.exchange) and its autograd (fp8a2a.autograd)."""
import math
import struct
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch.autograd import forward_ad

from . import exchange, ops
from .autograd import combine_rows, dispatch_rows
from .exchange import ExchangeSpec, Layout, Route
from .quant import QuantizedTensor, checked_tensor_scale, dequantize
from .wire import Granularity, blocks_error, fits_blocks

DispatchHandle = Layout  # what dispatch returns for combine and the backward passes

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
        if self.capacity_factor is not None and not (0 < self.capacity_factor < math.inf):
            raise ValueError(f"fp8a2a: capacity_factor must be positive and finite, got {self.capacity_factor}")

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


# The options _check_agreement compares (name, how to print a rank's value), in the order of
# Dispatcher._agreed_options.
_AGREED_OPTIONS = (("num_experts", int), ("granularity", lambda c: Granularity(c).label), ("expert_tp_size", int),
                   ("tensor_scale", _show_float32_scale), ("fp8_combine", bool), ("fp8_dispatch_backward", bool),
                   ("capacity_factor", lambda b: None if b == -1 else struct.unpack("<d", struct.pack("<q", b))[0]))


_INVALID_OPTIONS = -3  # every value of a rank's agreement row: its options were rejected before it


def _device(group):
    """Where the group's collectives take tensors: CUDA for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


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


def _float32_weights(t: torch.Tensor) -> torch.Tensor:
    """Router weights as the ops take them: float32, contiguous, without autograd history. Every
    tensor op is a host-side dispatch (and a launch on the GPU): called only where it changes something."""
    t = t.detach() if t.requires_grad else t
    return (t if t.dtype == torch.float32 else t.float()).contiguous()


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
                    exchange.gather_ints(group, self.world, [_INVALID_OPTIONS] * len(_AGREED_OPTIONS), _device(group))
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
        if tensor_scale is not None and self.code != Granularity.TENSOR:
            scale_error, scale_bits = ValueError(
                f"fp8a2a: tensor_scale is only meaningful for granularity='tensor', got {config.granularity!r}"), -2
        elif tensor_scale is not None:
            try:
                tensor_scale = torch.as_tensor(tensor_scale)
                scale_bits = int(checked_tensor_scale(tensor_scale.detach().float().cpu()).view(torch.int32))
            except Exception as e:  # joins the agreement below, so that every rank raises
                scale_error, scale_bits = e, -2
        self.tensor_scale = tensor_scale
        self.capacity_factor = config.capacity_factor
        self.local = self.world == 1 and not (config.always_communicate and dist.is_initialized())
        self.spec = ExchangeSpec(group, self.world, self.local, num_experts * self.tp, self.num_local_experts,
                                 self.tp, self.code, self.fp8_combine, self.fp8_dispatch_backward, tensor_scale,
                                 self.bf16_below_bytes)
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
        every = exchange.gather_ints(self.group, self.world, self._agreed_options(scale_bits), _device(self.group))
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

    # ---- public API ------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        """Send each token (once per destination rank) to the ranks of its top-k experts.

        Arguments:
            x: [T, H] bfloat16, float16 or float32, the tokens of this rank (T may differ by rank,
                but not in capacity mode).
            topk_idx: [T, K] int64 or int32, global expert ids; -1 leaves a slot unrouted.
            topk_weights: [T, K] floating point, the router weights (their gradient comes back
                through combine or `out.weights`).

        Returns:
            DispatchOutput: `tokens` [N, H], the rows this rank's experts serve, grouped by local
            expert (a QuantizedTensor: e4m3 data and its scales; a plain tensor in x's dtype when
            the input was under `bf16_below_bytes` on every rank); `tokens_per_expert` int64
            [num_local_experts]; `weights` float32 [N], each row's router weight; `handle`, which
            combine and the backward passes reuse.

        One host sync (the counts exchange; none in capacity mode). A rank whose input is rejected
        makes its peers raise too, rather than leave them waiting."""
        try:  # a rank whose input is rejected here makes the others raise too, not wait for it
            self._check_inputs(x, topk_idx, topk_weights)
            given_idx, capacity = topk_idx, {}
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
            idx = topk_idx.contiguous()
            if idx is given_idx:
                # combine's backward routes dy by these ids (grad mode at combine decides: also after a
                # dispatch under no_grad or inference mode): a private copy, so that the caller
                # changing its tensor in place cannot misroute it
                idx = idx.clone()
            route = Route(idx, _float32_weights(topk_weights), **capacity)
        except Exception:
            self._fail_peers(amax_pending=True)
            raise
        data, scale, weights, tpe, handle, anchors = dispatch_rows(self.spec, x, topk_weights, route, self._fail_peers)
        if handle.wire == Granularity.RAW:
            tokens = data
        else:
            if self.code == Granularity.TENSOR:
                scale = handle.tensor_scale
            tokens = QuantizedTensor(data, scale, self.granularity, grad_anchor=anchors[0],
                                     grad_anchor_float32=anchors[1])
        return DispatchOutput(tokens, tpe, weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, apply_weights: bool = True) -> torch.Tensor:
        """Send the experts' rows back to their tokens and sum them.

        Arguments:
            expert_out: [N, H] bfloat16, float16, float32 or float64, one row per dispatched row, in
                the order of `out.tokens`.
            handle: the dispatch's `out.handle`.
            apply_weights: multiply each row by its router weight (False: the experts applied it,
                as Megatron's do).

        Returns:
            y [T, H] in the dispatch's x dtype: for each token, the sum over its slots of weight *
            expert row, accumulated in float32 and converted last.

        A rank whose expert_out is rejected still takes part in the exchange (rows of 0xFF bytes, so
        the peers' y is NaN in every token this rank served; they cannot raise without a host sync)
        and then raises."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"fp8a2a: combine expects the DispatchHandle of a dispatch, got {type(handle).__name__}")
        error = _combine_input_error(expert_out, handle)
        if error is not None:
            exchange.poison_combine(handle)
            raise error
        return combine_rows(expert_out, handle.weights if apply_weights else None, handle)

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
        if x.layout != torch.strided or topk_idx.layout != torch.strided or topk_weights.layout != torch.strided:
            raise ValueError(f"fp8a2a: dispatch needs strided (dense) tensors, got layouts {x.layout}, "
                             f"{topk_idx.layout} and {topk_weights.layout}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"fp8a2a: x must be float32, float16 or bfloat16, got {x.dtype}")
        if x.shape[1] == 0:
            raise ValueError("fp8a2a: x has hidden size 0")
        error = _tangent_error("dispatch", x=x, topk_weights=topk_weights)
        if error is not None:
            raise error
        # checked whatever wire this call takes: a rank under the size threshold must fail like the others
        if self.code == Granularity.BLOCK128 and not fits_blocks(x.shape[1]):
            raise ValueError(blocks_error(x.shape[1]))

    def _fail_peers(self, amax_pending: bool = False):
        """This rank rejected its dispatch input: make the peers raise too (exchange.fail_dispatch)."""
        if self.local:
            return
        pending = amax_pending and self.code == Granularity.TENSOR and self.tensor_scale is None
        exchange.fail_dispatch(self.spec, _device(self.group), pending)

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
    if expert_out.layout != torch.strided:
        return ValueError(f"fp8a2a: combine needs a strided (dense) expert_out, got layout {expert_out.layout}")
    if expert_out.dim() != 2 or expert_out.shape != (handle.num_rows, handle.hidden):
        return ValueError(f"fp8a2a: expert_out must be [{handle.num_rows}, {handle.hidden}] (the dispatched rows), "
                          f"got {tuple(expert_out.shape)}")
    if expert_out.dtype not in _COMBINE_DTYPES:
        return ValueError(f"fp8a2a: expert_out must be bfloat16, float16, float32 or float64, got {expert_out.dtype}")
    device = handle.send_pos.device
    if expert_out.device != device:
        return ValueError(f"fp8a2a: expert_out is on {expert_out.device}, but the dispatch ran on {device}")
    return _tangent_error("combine", expert_out=expert_out)
