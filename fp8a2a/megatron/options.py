"""Options of the fp8_alltoall dispatcher and where they come from (no megatron import here).

Each option is looked up, first match wins:
  1. an attribute `fp8a2a_<name>` on the TransformerConfig (set it in programs that build their own
     config, e.g. `config.fp8a2a_granularity = "block128"`),
  2. the same attribute on megatron.training's global args, when that module is in use and the
     flag was given (--fp8a2a-granularity ...; the parser defaults are None = not given),
  3. the defaults given to fp8a2a.megatron.register(...),
  4. the built-in defaults (DispatcherConfig's, and capacity_mode "auto"); a granularity given
     nowhere follows the TE recipe (default_granularity).
The options are the names in NAMES: DispatcherConfig's wire options, capacity_mode and the FP8
experts' fp8_dgrad / fp8_wgrad (FP8GroupedMLP's, for fp8_experts_spec). The dispatcher's other
fields (expert_tp_size, capacity_factor) come from the TransformerConfig's own settings
(Options.dispatcher_config).
"""
import sys
from dataclasses import dataclass, fields, replace

from ..wire import QUANTIZED
from ..dispatcher import DispatcherConfig

FP8_ALLTOALL = "fp8_alltoall"
GRANULARITIES = tuple(g.label for g in QUANTIZED)
# How Megatron's capacity settings (moe_expert_capacity_factor, moe_pad_expert_input_to_capacity)
# map onto fp8a2a.Dispatcher (see dispatcher.py):
#   auto:     drop-and-pad -> the Dispatcher's capacity mode (static shapes, no host sync);
#             a capacity factor without padding -> the router's dropping, variable shapes
#   static:   the capacity mode whenever a capacity factor is set, padded or not
#   variable: never the capacity mode; drop-and-pad then leaves the padding rows out (the same
#             outputs and gradients, fewer rows, the one host sync of the default mode)
CAPACITY_MODES = ("auto", "static", "variable")


@dataclass(frozen=True)
class Options(DispatcherConfig):
    """A DispatcherConfig with the Megatron-only capacity_mode and the FP8 experts' fp8_dgrad /
    fp8_wgrad (see fp8a2a.FP8GroupedMLP; default BF16 gradients); validated on construction."""
    capacity_mode: str = "auto"
    fp8_dgrad: bool = False
    fp8_wgrad: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.capacity_mode not in CAPACITY_MODES:
            raise ValueError(f"fp8a2a: capacity mode must be one of {CAPACITY_MODES}, got {self.capacity_mode!r}")

    def validate(self) -> "Options":
        return self  # checked on construction; kept for callers

    def dispatcher_config(self, **derived) -> DispatcherConfig:
        """The DispatcherConfig of these options, with `derived` (fields Megatron's config decides)."""
        return DispatcherConfig(**{**{f.name: getattr(self, f.name) for f in fields(DispatcherConfig)}, **derived})


# What a run sets (config.fp8a2a_<name>, --fp8a2a-<name>, register(<name>=...)).
NAMES = ("granularity", "capacity_mode", "fp8_combine", "fp8_dispatch_backward", "bf16_below_bytes", "fp8_dgrad",
         "fp8_wgrad")
_registered = Options()
_registered_names = set()  # the options register() set (a default counts as given once set)

# The wire granularity under a TE FP8 recipe when the run gives none and Megatron's experts run
# the GEMMs. TE's GroupedLinear takes no FP8 input (README), so the rows are dequantized and TE
# quantizes them again whatever the wire carries: the blockwise recipe gets its own quantizer's
# 128-value blocks (as fast as row); current scaling keeps row, since tensor granularity adds an
# amax all-reduce per dispatch and measured no faster (BENCHMARKS.md); delayed scaling (one scale
# per tensor too, not measured) follows it. fp8a2a's FP8 experts take row scales; other recipes
# (mxfp8, nvfp4) keep row.
RECIPE_GRANULARITY = {"blockwise": "block128"}


def set_defaults(**kwargs) -> Options:
    """Process-wide defaults (what register(**kwargs) sets)."""
    global _registered
    unknown = set(kwargs) - set(NAMES)
    if unknown:
        raise TypeError(f"fp8a2a: unknown option(s) {sorted(unknown)}; known: {list(NAMES)}")
    _registered = replace(_registered, **kwargs)
    _registered_names.update(kwargs)
    return _registered


def reset_defaults():
    global _registered
    _registered = Options()
    _registered_names.clear()


def _training_args():
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None


def _given(config):
    """{name: value} of the options the config or the training flags set."""
    args, values = _training_args(), {}
    for name in NAMES:
        for source in (config, args):
            value = getattr(source, "fp8a2a_" + name, None) if source is not None else None
            if value is not None:
                values[name] = value
                break
    return values


def resolve(config=None) -> Options:
    return replace(_registered, **_given(config))


def default_granularity(config, fp8_experts: bool):
    """The granularity a run that gave none gets (RECIPE_GRANULARITY), or None when it gave one."""
    if "granularity" in _given(config) or "granularity" in _registered_names:
        return None
    if fp8_experts or not getattr(config, "fp8", None):
        return "row"
    recipe = getattr(config, "fp8_recipe", None)
    granularity = RECIPE_GRANULARITY.get(str(getattr(recipe, "value", recipe)), "row")
    # the dispatched width: Megatron projects to moe_latent_size before the dispatch when it is set
    width = getattr(config, "moe_latent_size", None) or getattr(config, "hidden_size", 0)
    if granularity == "block128" and width % 128:
        return "row"  # block128 needs a width % 128 == 0
    return granularity
