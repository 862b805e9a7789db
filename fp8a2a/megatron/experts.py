"""FP8 experts for Megatron MoE layers: Megatron's expert modules (same parameters, init, TP
sharding, state_dict and sharded_state_dict: checkpoints keep their layout) whose forward runs
fp8a2a.FP8GroupedMLP on the FP8 rows that fp8_alltoall delivers (no dequantize in between).

The local experts' fc1 / fc2 parameters reach FP8GroupedMLP as fp8a2a.weight_cache.expert_weights
stand-ins in its [E, out, in] layout: no per-forward stack. The GEMMs read the FP8 weights
(quantized per output channel) and, for the BF16 dgrad, a BF16 stack, both cached on the
parameters across micro-batches and rebuilt once they change (an optimizer step, an in-place
write, invalidate_fp8_weight_cache()); each parameter gets its slice of the weight gradient, added
into its main_grad in place under config.gradient_accumulation_fusion (as Megatron's and TE's
linears do: no .grad; no APEX needed, since these experts never call Megatron's linears). Not
calling those linears, the forward fires their forward pre-hooks itself (Megatron DDP's wait for an
overlapped param all-gather, overlap_param_gather) before reading the weights.
Under Megatron's local CUDA graphs the copies a graph reads are refreshed in place before each
replay (check_cuda_graphs). fp8_dgrad / fp8_wgrad come from the fp8a2a options (--fp8a2a-fp8-dgrad, --fp8a2a-fp8-wgrad,
config.fp8a2a_fp8_dgrad, ...; fp8a2a/megatron/options.py); with fp8_dgrad no BF16 stack is made. Supported: SwiGLU (gated
SiLU), GELU and ReLU experts without bias; expert-TP shards work as they are (fc2 partial sums are
added by the dispatcher's combine).

fp8_experts_spec(spec) swaps these classes into a layer spec (ModuleSpec trees of megatron-core
0.16, partial builders of 0.19)."""
import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..quant import QuantizedTensor

_ACTIVATIONS = {F.silu: "swiglu", F.gelu: "gelu", F.relu: "relu"}


def _activation_name(config) -> str:
    act = getattr(config, "activation_func", None)
    gated = bool(getattr(config, "gated_linear_unit", False))
    if getattr(config, "use_te_activation_func", False):
        raise ValueError("fp8a2a: FP8 experts do not support use_te_activation_func")
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0.0):
        raise ValueError("fp8a2a: FP8 experts do not support activation_func_clamp_value / glu_linear_offset")
    name = _ACTIVATIONS.get(act)
    if name == "swiglu" and gated:
        return "swiglu"
    if name in ("gelu", "relu") and not gated:
        return name
    raise ValueError(f"fp8a2a: FP8 experts support gated SiLU (SwiGLU), GELU and ReLU; got "
                     f"activation_func={act}, gated_linear_unit={gated}")


def check_config(config) -> str:
    """The FP8 experts' activation for a layer built from config; ValueError naming what they do not
    support (bias, probs on the input, the activation, a CUDA-graph setting)."""
    if getattr(config, "add_bias_linear", False):
        raise ValueError("fp8a2a: FP8 experts do not support add_bias_linear")
    if getattr(config, "moe_apply_probs_on_input", False):
        raise ValueError("fp8a2a: FP8 experts do not support moe_apply_probs_on_input")
    check_cuda_graphs(config)
    return _activation_name(config)


def check_cuda_graphs(config):
    """Refuses a CUDA-graph setting that captures the FP8 experts where their cached FP8 weights
    (checked for staleness in Python, which a replay skips) cannot be kept current. Under Megatron's
    local graphs (cuda_graph_impl="local") they are: every replay is preceded by a refresh in place
    of the copies the graph reads (_refresh_before_replay). Refused: the other implementations and
    full_iteration, whose replays fp8a2a cannot precede."""
    from .dispatcher import _graph_modules
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    modules = _graph_modules(config)
    if impl == "none" or (modules and "moe" not in modules and "full_iteration" not in modules):
        return
    what = "cuda_graph_modules=[] (the whole layer) or 'moe'"
    if impl != "local" or "full_iteration" in modules:
        raise ValueError(f"fp8a2a: FP8 experts (fp8_experts_spec) cannot be captured with cuda_graph_impl={impl!r}, "
                         f"cuda_graph_modules {modules}: a replay would keep the captured step's FP8 weights "
                         f"after optimizer steps; use cuda_graph_impl='local' with {what}, capture "
                         f"moe_router / moe_preprocess only, or use Megatron's experts")
    if not _refresh_before_replay():
        raise ValueError(f"fp8a2a: FP8 experts (fp8_experts_spec) under {what}: this megatron-core has no "
                         f"_CudaGraphRunner.replay_graph_capture to refresh their FP8 weights before; capture "
                         f"moe_router / moe_preprocess only, or use Megatron's experts")


def _refresh_before_replay() -> bool:
    """Wraps Megatron's _CudaGraphRunner.replay_graph_capture once per process (left in place by
    unregister(): built models depend on it): before a replay, every FP8 experts module in the
    runner's module brings the weight copies its graphs read up to date. That call comes after
    CudaGraphManager has run the DDP pre-forward hooks (an overlapped param all-gather has landed)
    and after the whole optimizer step (the BF16 params are written from the main params after the
    inner optimizer's step hooks): where the eager forward would check them. Costs one key check
    per weight per replay; the rebuild, once per optimizer step. False where there is nothing to wrap."""
    try:
        from megatron.core.transformer.cuda_graphs import _CudaGraphRunner
    except ImportError:
        return False
    original = getattr(_CudaGraphRunner, "replay_graph_capture", None)
    if original is None:
        return False
    if getattr(original, "__fp8a2a_refresh__", False):
        return True

    @functools.wraps(original)
    def replay_graph_capture(self, *args, **kwargs):
        experts = self.__dict__.get("_fp8a2a_experts")
        if experts is None:  # the runner's module does not change: look once
            experts = [m for m in self.base_module.modules() if isinstance(m, _FP8ExpertsMixin)]
            self.__dict__["_fp8a2a_experts"] = experts
        for m in experts:
            m.refresh_graphed_weights()
        return original(self, *args, **kwargs)

    replay_graph_capture.__fp8a2a_refresh__ = True
    _CudaGraphRunner.replay_graph_capture = replay_graph_capture
    return True


class _FP8ExpertsMixin:
    """forward(tokens, tokens_per_expert, probs) -> (y [N, H], None) through FP8GroupedMLP."""

    fp8a2a_accepts_quantized = True

    def _fp8_setup(self, config, fc1_out, hidden, ffn):
        from ..experts import FP8GroupedMLP  # lazily: written alongside, and it pulls Triton where present
        from .options import resolve

        act = check_config(config)
        want = (2 if act == "swiglu" else 1) * ffn
        if fc1_out != want:
            raise ValueError(f"fp8a2a: fc1 has {fc1_out} outputs, expected {want} for {act}")
        # Compute only: its own parameters live on the meta device; each call runs it on
        # expert_weights stand-ins of Megatron's weights (forward_with). Kept out of the module
        # tree, so parameters, state_dict and checkpoints are exactly Megatron's.
        opts = resolve(config).experts
        self.__dict__["_fp8a2a_impl"] = FP8GroupedMLP(self.num_local_experts, hidden, ffn, act, device="meta",
                                                      fp8_dgrad=opts.fp8_dgrad, fp8_wgrad=opts.fp8_wgrad)

    def _expert_params(self):  # -> ([E x [fc1_out, H]], [E x [H, ffn]])
        """Read from the module and parameter dicts on every call (a submodule or parameter may be
        replaced), without nn.Module's attribute lookup: this runs between the dispatch's sync and
        the experts' first GEMM, where the GPU waits on the host."""
        raise NotImplementedError

    def _fp8_weights(self):  # -> ([E, fc1_out, H], [E, H, ffn]) stand-ins (fp8a2a.weight_cache.expert_weights)
        from ..experts import expert_weights
        return expert_weights(*self._expert_params(), gradient_accumulation_fusion=bool(
            getattr(self.config, "gradient_accumulation_fusion", False)))

    def refresh_graphed_weights(self):
        """Rebuilds in place the cached weights that captured CUDA graphs read, where the parameters
        changed (weight_cache.refresh_graphed); nothing when no graph reads them."""
        from ..weight_cache import refresh_graphed
        w1, w2 = self._expert_params()
        if not (w1[0].__dict__.get("_fp8a2a_graphed") or w2[0].__dict__.get("_fp8a2a_graphed")):
            return
        with torch.no_grad():
            for w in self._fp8_weights():
                refresh_graphed(w)

    def _run_weight_pre_hooks(self):
        """Fires the forward pre-hooks of the submodules that own the expert parameters
        (linear_fc1 / linear_fc2, per expert for SequentialMLP), as calling them would: these
        experts read their weights without calling those submodules. Megatron's DDP registers
        such a hook on every module when it overlaps the param all-gather (distributed optimizer,
        overlap_param_gather); it waits for the all-gather of the module's own parameters
        (recurse=False), so without this the FP8 copies could be built from parameters not yet
        gathered, and then cached for the whole step. Called with no inputs (DDP's hook takes
        `module, *unused`); return values are ignored, as there is no call whose inputs they could
        replace. Nothing to do, and no cost beyond a dict check, when no hook is registered."""
        for m in self.__dict__.get("_fp8a2a_weight_modules") or self._weight_modules():
            if not m._forward_pre_hooks:
                continue
            with_kwargs = getattr(m, "_forward_pre_hooks_with_kwargs", {})
            for hook_id, hook in list(m._forward_pre_hooks.items()):
                if hook_id in with_kwargs:
                    hook(m, (), {})
                else:
                    hook(m, ())

    def _weight_modules(self):
        """The submodules (not self) that own expert parameters directly, in module order; cached."""
        out = [m for m in self.modules() if m is not self and next(m.parameters(recurse=False), None) is not None]
        self.__dict__["_fp8a2a_weight_modules"] = out
        return out

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        x = permuted_local_hidden_states
        if not isinstance(x, QuantizedTensor) and x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        self._run_weight_pre_hooks()  # e.g. Megatron DDP's wait for the overlapped param all-gather
        w1, w2 = self._fp8_weights()
        return self._fp8a2a_impl.forward_with(w1, w2, x, tokens_per_expert, permuted_probs.reshape(-1)), None


def _sequential_cls():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class FP8SequentialMLP(_FP8ExpertsMixin, SequentialMLP):
        """Megatron's SequentialMLP (local_experts.{i}.linear_fc1/linear_fc2), FP8 grouped forward."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
            SequentialMLP.__init__(self, num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
            fc1 = self.local_experts[0].linear_fc1.weight
            fc2 = self.local_experts[0].linear_fc2.weight
            self._fp8_setup(self.config, fc1.shape[0], fc1.shape[1], fc2.shape[1])

        def _expert_params(self):
            experts = self._modules["local_experts"]._modules.values()
            return ([e._modules["linear_fc1"]._parameters["weight"] for e in experts],
                    [e._modules["linear_fc2"]._parameters["weight"] for e in experts])

    return FP8SequentialMLP


def _te_grouped_cls():
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    class FP8TEGroupedMLP(_FP8ExpertsMixin, TEGroupedMLP):
        """Megatron's TEGroupedMLP (linear_fc1.weight{i} / linear_fc2.weight{i}), FP8 grouped forward.
        Needs TransformerEngine to build (as TEGroupedMLP does); not tested without TE."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
            TEGroupedMLP.__init__(self, num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
            w1, w2 = self._expert_params()
            self._fp8_setup(self.config, w1[0].shape[0], w1[0].shape[1], w2[0].shape[1])

        def _expert_params(self):
            names = self.__dict__.get("_fp8a2a_weight_names")
            if names is None:
                names = self.__dict__["_fp8a2a_weight_names"] = [f"weight{i}" for i in range(self.num_local_experts)]
            out = tuple([self._modules[linear]._parameters.get(n) for n in names]
                        for linear in ("linear_fc1", "linear_fc2"))
            if any(w is None for ws in out for w in ws):
                raise ValueError("fp8a2a: FP8TEGroupedMLP needs TE GroupedLinear weights weight0..weight{E-1}")
            return out

    return FP8TEGroupedMLP


@functools.lru_cache(None)
def fp8_expert_classes():
    """{Megatron expert class: its FP8 counterpart}, for the classes this megatron-core has."""
    from megatron.core.transformer.moe import experts as mx

    out = {mx.SequentialMLP: _sequential_cls()}
    if hasattr(mx, "TEGroupedMLP"):
        out[mx.TEGroupedMLP] = _te_grouped_cls()
    return out


def _swap_class(obj):
    if not isinstance(obj, type):
        return None
    classes = fp8_expert_classes()
    if obj in classes.values():
        return obj
    for base, fp8 in classes.items():
        if obj is base:
            return fp8
    from megatron.core.transformer.moe import experts as mx
    if obj.__name__ == "GroupedMLP" and getattr(mx, "GroupedMLP", None) is obj:
        raise ValueError("fp8a2a: the legacy GroupedMLP has no FP8 counterpart; build the spec with "
                         "SequentialMLP (local spec) or TEGroupedMLP (TE spec, moe_grouped_gemm=True)")
    return None


def _swap_experts_class(cls, inside_moe: bool, found: list):
    """cls, or its FP8 counterpart when it is the experts class of an MoE submodules (recorded in found)."""
    new = _swap_class(cls) if inside_moe else None
    if new is None:
        return cls
    found.append(new)
    return new


def _swap(obj, inside_moe: bool, found: list):
    """A copy of a spec object with the experts of every MoE submodules replaced."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        module = _swap_experts_class(obj.module, inside_moe, found)
        sub = _swap(obj.submodules, False, found) if obj.submodules is not None else None
        if module is obj.module and sub is obj.submodules:
            return obj
        return dataclasses.replace(obj, module=module, submodules=sub)
    if isinstance(obj, functools.partial):
        func = _swap_experts_class(obj.func, inside_moe, found)
        args = tuple(_swap(a, False, found) for a in obj.args)
        kw = {k: _swap(v, False, found) for k, v in obj.keywords.items()}
        if func is obj.func and all(a is b for a, b in zip(args, obj.args)) and \
                all(kw[k] is obj.keywords[k] for k in kw):
            return obj
        return functools.partial(func, *args, **kw)
    if isinstance(obj, MoESubmodules):
        experts = _swap(obj.experts, True, found)
        if experts is obj.experts:
            return obj
        return dataclasses.replace(obj, experts=experts)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            v = getattr(obj, f.name, None)
            nv = _swap(v, False, found)
            if nv is not v:
                changes[f.name] = nv
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, (list, tuple)):
        items = [_swap(v, False, found) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(items) if isinstance(obj, list) else tuple(items)
    return obj


def fp8_experts_spec(spec):
    """A copy of a Megatron layer / block / MoE spec whose MoE experts (SequentialMLP, TEGroupedMLP)
    are replaced by their FP8 counterparts. Raises ValueError if the spec has no MoE experts."""
    found = []
    out = _swap(spec, False, found)
    if not found:
        raise ValueError("fp8a2a: no MoE experts (SequentialMLP / TEGroupedMLP) found in this spec")
    return out
