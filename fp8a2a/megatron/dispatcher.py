"""FP8AlltoAllTokenDispatcher: Megatron-core's six-stage token-dispatcher interface on fp8a2a.Dispatcher.

Stages and the state they leave on the dispatcher (Megatron's overlap schedules call them one by
one, possibly on different streams, and may detach and free the tensors passed between them):

  dispatch_preprocess(x, routing_map, probs)  local only: routing_map/probs [T, E] -> topk_idx/weights
                                              [T, K]; keeps x and topk_idx; returns (x carrier, weights)
  token_dispatch(carrier, weights)            the exchange: fp8a2a.Dispatcher.dispatch (quantize+pack,
                                              counts, one host sync (none in the capacity mode), rows,
                                              unpack); keeps the result;
                                              returns (rows carrier, received router weights [N])
  dispatch_postprocess(carrier, weights)      local only: the rows for the experts, FP8
                                              (QuantizedTensor, when the experts take it) or dequantized
                                              to x's dtype; tokens_per_expert; weights in probs' dtype
  combine_preprocess(expert_out)              identity (rows are already expert-major)
  token_combine(expert_out)                   the exchange back: fp8a2a.Dispatcher.combine, unweighted
                                              (Megatron's experts already applied the probs)
  combine_postprocess(y)                      reshape to x's shape (+ the overlapped shared experts)

Between stages only "carriers" travel: zero-stride tensors of the right shape, with no memory, whose
gradient is passed straight through. The payload (x, the FP8 rows and scales) stays on the
dispatcher. So a schedule that detaches a stage's inputs (and frees their storage, as Megatron's
combined 1F1B schedule does) neither frees x (a view of the layernorm output that the router and
shared experts still need) nor the received rows, and the gradients still flow stage by stage
through the tensors the schedule handed over. The router weights are copied once (T x K floats) in
token_dispatch for the same reason.

Groups: with expert-TP size 1 the exchange runs over the EP group. With expert-TP > 1 it runs over
the TP x EP group with Dispatcher(expert_tp_size=...): each token goes straight to every expert-TP
rank of its expert's EP rank (what Megatron's all-to-all + TP all-gather achieve, in FP8 bytes);
the combine sums the expert-TP partial outputs (Megatron's reduce-scatter).

Capacity (options.py, --fp8a2a-capacity-mode): drop-and-pad (moe_pad_expert_input_to_capacity)
maps to the Dispatcher's capacity mode (static shapes, no host sync, every local expert gets R x
capacity rows, padding rows zero with weight 0: the shapes and results of Megatron's alltoall
drop-and-pad). The capacity is then applied once, by the Dispatcher (its kernels drop and pad):
Megatron's get_capacity, and per expert the slots with the lowest router probabilities dropped
first, Megatron's "probs" drop policy; set_router gives the router a config without the capacity
factor, so it neither drops nor adds padding slots. The router keeps applying it where its result
would differ: outside the capacity mode, under the "position" drop policy, and with the expert
bias (which counts the router's capacity-padded routing map). Its padding slots (probability 0)
are then removed in dispatch_preprocess and never sent.

Padding for quantization (moe_router_padding_for_quantization, which Megatron sets with FP8/FP4
recipes; its experts then skip their own padding): every local expert's row count is rounded up
to Megatron's get_align_size_for_quantization(config) (16 for FP8 on Hopper, as TE's FP8 grouped
GEMMs need). Megatron's alltoall pads the routing map on the sending side (real tokens with
probability 0 added to each (source rank, expert)); fp8_alltoall pads on the receiving side
instead: zero rows with weight 0 appended to each local expert in dispatch_postprocess and cut off
again in combine_preprocess. The same alignment with fewer rows and none on the wire; outputs and
gradients are those without padding (the padding rows add 0 to both, and being zero they do not
move TE's current-scaling amax as Megatron's padding tokens can). The FP8 experts
(fp8_experts_spec) need no alignment and get none.
"""
import copy
from dataclasses import replace
from typing import Optional

import torch

from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .. import Dispatcher, ops
from ..kernels import capturing
from ..quant import QuantizedTensor, dequantize
from .options import Options, resolve


class _Carrier(torch.autograd.Function):
    """A stand-in for `x` between two stages: no memory, gradient straight through to `x`."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Attach(torch.autograd.Function):
    """`value` (no grad) again, with its gradient handed to `carrier`."""

    @staticmethod
    def forward(ctx, carrier, value):
        ctx.dtype = carrier.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def _attach(carrier: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    if carrier is not None and carrier.requires_grad and torch.is_grad_enabled():
        return _Attach.apply(carrier, value)
    return value


class _RoutingMapToTopk(torch.autograd.Function):
    """ops.routing_map_to_topk with the weights differentiable: each slot's gradient goes back to
    the prob it was read from."""

    @staticmethod
    def forward(ctx, routing_map, probs, k, drop_zero):
        idx, weights = ops.routing_map_to_topk(routing_map, probs, k, drop_zero)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        ctx.shape = probs.shape
        return idx, weights

    @staticmethod
    def backward(ctx, _, grad):
        (idx,) = ctx.saved_tensors
        unused = idx < 0
        return None, grad.new_zeros(ctx.shape).scatter_add_(1, idx.masked_fill(unused, 0),
                                                            grad.masked_fill(unused, 0)), None, None


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int, drop_zero: bool = False):
    """Megatron's dense routing ([T, E] bool map, [T, E] probs) -> (topk_idx [T, k] int64, -1 where
    unused, experts in ascending order; topk_weights [T, k] in probs' dtype, differentiable), one
    kernel, no host sync. Rows must hold at most `topk` experts (the router guarantees it; a row
    with more keeps its lowest). drop_zero: experts whose prob is 0 are not routed (the capacity
    factor's padding)."""
    routing_map, probs = routing_map.contiguous(), probs.contiguous()
    if probs.requires_grad and torch.is_grad_enabled():
        return _RoutingMapToTopk.apply(routing_map, probs, int(topk), drop_zero)
    return ops.routing_map_to_topk(routing_map, probs, int(topk), drop_zero)


def padded_rows(counts, tokens_per_expert, multiple, rows):
    """Where each of `rows` expert-major rows goes once every local expert's rows are rounded up to
    `multiple` (zero rows after each expert's own). counts: the rows per expert on the host;
    tokens_per_expert: the same on the device. Device arithmetic only: no host-to-device copy (each
    would be a stream sync) and nothing a CUDA graph cannot capture."""
    pos = torch.arange(rows, device=tokens_per_expert.device)
    if len(set(counts)) == 1 and counts[0] > 0:  # equal counts (the capacity mode): one shape
        return pos + torch.div(pos, counts[0], rounding_mode="floor") * (-(-counts[0] // multiple) * multiple - counts[0])
    gap = (tokens_per_expert + multiple - 1) // multiple * multiple - tokens_per_expert
    return pos + torch.repeat_interleave(torch.cumsum(gap, 0) - gap, tokens_per_expert, output_size=rows)


def _graph_modules(config):
    """The per-layer CUDA-graph scope of a config as names (megatron-core 0.19: cuda_graph_modules,
    0.16: cuda_graph_scope); [] means the whole layer."""
    scope = getattr(config, "cuda_graph_modules", None)
    if scope is None or isinstance(scope, str):
        scope = getattr(config, "cuda_graph_scope", None) or []
    if isinstance(scope, str):
        scope = [s for s in scope.split(",") if s and s != "full"]
    return [getattr(s, "name", s) for s in scope]


def check_cuda_graphs(config, capacity_mode: bool):
    """Refuses (ValueError naming the option) the Megatron CUDA-graph settings fp8_alltoall does not
    support; README.md (Megatron-core, CUDA graphs) has the table and the reasons."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return
    modules = _graph_modules(config)
    if impl != "local":
        raise ValueError(
            f"fp8a2a: cuda_graph_impl={impl!r} is not supported with --moe-token-dispatcher-type fp8_alltoall: "
            f"only cuda_graph_impl='local' has been checked against alltoall (outputs and gradients); "
            f"use --cuda-graph-impl local")
    if "full_iteration" in modules:
        raise ValueError("fp8a2a: cuda_graph_scope full_iteration is not supported with fp8_alltoall "
                         "(not checked against alltoall); use cuda_graph_impl='local' with a per-layer scope")
    captures_dispatch = not modules or "moe" in modules
    if captures_dispatch and not capacity_mode:
        what = "cuda_graph_modules=[] (the whole layer)" if not modules else "cuda_graph_modules 'moe'"
        raise ValueError(
            f"fp8a2a: {what} captures the token dispatch, and fp8_alltoall outside its capacity mode reads "
            f"the received row counts on the host once per dispatch (variable shapes), which a CUDA graph "
            f"cannot capture; use drop-and-pad (--moe-expert-capacity-factor with "
            f"--moe-pad-expert-input-to-capacity, --fp8a2a-capacity-mode auto or static) or "
            f"--cuda-graph-modules moe_router moe_preprocess (the dispatch stays eager)")


class FP8AlltoAllTokenDispatcher(MoETokenDispatcher):
    """--moe-token-dispatcher-type fp8_alltoall (see the module docstring).

    The MoELayer hook of fp8a2a.megatron.register() calls set_experts, then set_router. set_experts
    resolves the options once (fp8a2a.megatron.options.resolve: a run that gives no granularity
    gets its experts' default) and builds the Dispatcher: experts that consume QuantizedTensor rows
    (the FP8 experts of fp8a2a.megatron.fp8_experts_spec) get them (`deliver_fp8`), Megatron's own
    experts get dequantized rows. set_router leaves the capacity to the Dispatcher (module
    docstring, Capacity)."""

    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection=None):
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.router_topk = config.moe_router_topk
        self.ep_rank = mcore_utils.get_pg_rank(self.ep_group)
        if num_local_experts < 1 or self.local_expert_indices != list(
                range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts)):
            raise ValueError(f"fp8a2a: expected the contiguous local experts of EP rank {self.ep_rank}, got "
                             f"{self.local_expert_indices}")

        # resolved once, when the experts are known (set_experts)
        self.options: Optional[Options] = None
        self.capacity_factor = None  # the Dispatcher's capacity mode: options.dispatcher.capacity_factor
        self.router_applies_capacity = False  # Megatron's router drops (module docstring, Capacity)
        self.strip_capacity_padding = False  # ... and adds padding slots (probability 0), never sent
        self.pad_multiple = 0  # moe_router_padding_for_quantization: rows per local expert rounded up to this
        if getattr(config, "moe_router_padding_for_quantization", False):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
            self.pad_multiple = int(get_align_size_for_quantization(config))

        tp = self.tp_size
        group = self.ep_group
        if tp > 1:  # expert TP: every TP rank of an expert's EP rank gets its tokens (Dispatcher.expert_tp_size)
            group = self.tp_ep_group
            want = self.ep_rank * tp + self.tp_rank
            got = mcore_utils.get_pg_rank(self.tp_ep_group)
            if got != want or mcore_utils.get_pg_size(self.tp_ep_group) != tp * self.ep_size:
                raise ValueError(f"fp8a2a: unexpected TP x EP group layout (rank {got}, expected ep_rank * tp_size "
                                 f"+ tp_rank = {want})")
        self._group = group
        self._dispatcher = None  # built by set_experts: Dispatcher() runs one collective (its options' agreement)
        self.deliver_fp8 = False
        self.shared_experts = None

        # state between stages
        self.hidden_shape = None
        self._x: Optional[torch.Tensor] = None
        self._topk_idx: Optional[torch.Tensor] = None
        self._probs_dtype = None
        self._out = None
        self._handle = None
        self._pad_rows = None  # destination rows of the received rows in the padded layout
        self.cudagraph_attrs = ["_x", "_topk_idx"]

    @property
    def dispatcher(self) -> Dispatcher:
        """The fp8a2a.Dispatcher (built by set_experts)."""
        if self._dispatcher is None:
            self.set_experts(None)
        return self._dispatcher

    def set_experts(self, experts):
        """Called once the MoELayer has built its experts (once, on every rank): resolves the options,
        checks the CUDA-graph settings against them and builds the Dispatcher (one collective).
        FP8 rows go to experts that take them (fp8a2a_accepts_quantized)."""
        if self.options is not None:
            raise RuntimeError("fp8a2a: set_experts called twice")
        config = self.config
        fp8_experts = bool(getattr(experts, "fp8a2a_accepts_quantized", False))
        options = resolve(config, fp8_experts=fp8_experts)
        factor = options.dispatcher.capacity_factor
        check_cuda_graphs(config, factor is not None)
        # who applies Megatron's capacity factor, if any (module docstring, Capacity)
        router_applies = getattr(config, "moe_expert_capacity_factor", None) is not None and (
            factor is None or getattr(config, "moe_token_drop_policy", "probs") != "probs"
            or bool(getattr(config, "moe_router_enable_expert_bias", False)))
        pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        self.options = replace(options, dispatcher=replace(options.dispatcher, expert_tp_size=self.tp_size))
        self.deliver_fp8, self.capacity_factor = fp8_experts, factor
        self.router_applies_capacity, self.strip_capacity_padding = router_applies, router_applies and pad
        self._dispatcher = Dispatcher(self.num_experts, group=self._group, config=self.options.dispatcher)
        return self._dispatcher

    def set_router(self, router):
        """Called after set_experts: unless the router keeps applying the capacity
        (router_applies_capacity), it gets a copy of its config without moe_expert_capacity_factor, so
        that the capacity is applied once, by the Dispatcher (module docstring, Capacity)."""
        if self.options is None:
            raise RuntimeError("fp8a2a: set_router before set_experts")
        config = router.config
        if self.router_applies_capacity or getattr(config, "moe_expert_capacity_factor", None) is None:
            return
        router.config = copy.copy(config)
        router.config.moe_expert_capacity_factor = None

    # ---- helpers -------------------------------------------------------------------------------

    def _shared(self, name, *args):
        fn = getattr(self.shared_experts, name, None) if self.shared_experts is not None else None
        if fn is not None:
            return fn(*args)
        return None

    # ---- the six stages ------------------------------------------------------------------------

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        assert probs.dim() == 2 and routing_map.dim() == 2, "Expected 2D probs and routing_map"
        assert routing_map.dtype == torch.bool, "Expected a bool routing_map"
        if self.options is None:
            self.set_experts(None)  # built outside MoELayer's hook: Megatron's experts
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        idx, weights = routing_map_to_topk(routing_map, probs, self.router_topk, self.strip_capacity_padding)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(x.view(self.hidden_shape))
        self._x, self._topk_idx, self._probs_dtype = x, idx, probs.dtype
        return _Carrier.apply(x), weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        x = _attach(hidden_states, self._x)
        weights = probs.to(torch.float32, copy=True)  # ours: the schedule may free its inputs
        self._shared("wait_current_stream")
        out = self.dispatcher.dispatch(x, self._topk_idx, weights)
        self._out, self._handle = out, out.handle
        if isinstance(out.tokens, QuantizedTensor):
            carrier = out.tokens.grad_anchor
        else:
            carrier = _Carrier.apply(out.tokens)
        if carrier is None:
            carrier = x.new_empty(()).expand(out.handle.num_rows, out.handle.hidden)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(carrier)
        return carrier, out.weights

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        out, self._out = self._out, None
        probs = probs.to(self._probs_dtype)
        carrier = hidden_states if hidden_states.requires_grad else None
        tokens = out.tokens
        if isinstance(tokens, QuantizedTensor):
            tokens = QuantizedTensor(tokens.data, tokens.scale, tokens.granularity,
                                     grad_anchor=carrier if torch.is_grad_enabled() else None)
            if not self.deliver_fp8:
                tokens = dequantize(tokens, out.handle.dtype)
        else:
            tokens = _attach(carrier, tokens)
        if self.deliver_fp8:
            # the counts on the host, where the dispatch's sync put them: the FP8 experts check and
            # sum them there, and the FP8 wgrad's per-expert GEMMs take their bounds; in a graph
            # capture (which cannot copy them in) the device counts
            if capturing(out.tokens_per_expert.device):
                return tokens, out.tokens_per_expert, probs
            return tokens, torch.tensor(out.handle.tokens_per_expert_list, dtype=torch.int64), probs
        counts = out.handle.tokens_per_expert_list
        if self.pad_multiple > 1:
            tokens, probs, counts = self._pad_for_quantization(tokens, probs, counts, out.tokens_per_expert)
        # Megatron's experts call tokens_per_expert.tolist(): a host tensor costs no sync
        return tokens, torch.tensor(counts, dtype=torch.int64), probs

    def _pad_for_quantization(self, tokens, probs, counts, tokens_per_expert):
        """Rows and weights with every local expert's rows rounded up to pad_multiple (zero rows,
        weight 0, after the expert's own); remembers where the real rows went (combine_preprocess)."""
        m = self.pad_multiple
        padded = [-(-c // m) * m for c in counts]
        self._pad_rows = None
        if padded == counts:
            return tokens, probs, counts
        dest = padded_rows(counts, tokens_per_expert, m, tokens.shape[0])
        total = sum(padded)
        tokens = tokens.new_zeros((total, tokens.shape[1])).index_copy(0, dest, tokens)
        probs = probs.new_zeros((total,) + tuple(probs.shape[1:])).index_copy(0, dest, probs)
        self._pad_rows = dest
        return tokens, probs, padded

    def combine_preprocess(self, hidden_states: torch.Tensor):
        dest, self._pad_rows = self._pad_rows, None
        if dest is not None:  # drop the padding rows of moe_router_padding_for_quantization
            hidden_states = hidden_states.index_select(0, dest)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
        self._shared("wait_current_stream")
        y = self.dispatcher.combine(hidden_states, self._handle, apply_weights=False)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(y)
            self.shared_experts.post_forward_comm()
        return y

    def combine_postprocess(self, hidden_states: torch.Tensor):
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        self._x = self._topk_idx = self._handle = self._pad_rows = None
        return output
