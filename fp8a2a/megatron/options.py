"""Options of the fp8_alltoall dispatcher and where they come from (no megatron import here).

Each option (the names in NAMES) is looked up, first match wins:
  1. an attribute `fp8a2a_<name>` on the TransformerConfig (set it in programs that build their own
     config, e.g. `config.fp8a2a_granularity = "block128"`),
  2. the same attribute on megatron.training's global args, when that module is in use and the
     flag was given (--fp8a2a-granularity ...; the parser defaults are None = not given),
  3. the defaults given to fp8a2a.megatron.register(...),
  4. the built-in defaults (DispatcherConfig's, ExpertOptions', capacity_mode "auto"); a granularity
     given nowhere follows the TE recipe (RECIPE_GRANULARITY), and so do the experts (recipe_experts:
     fp8a2a's FP8 experts under a TE FP8 recipe, where they cover the layer) and the FP8 experts'
     dgrad and wgrad (recipe_gradients: FP8 under a TE FP8 recipe).
resolve(config, fp8_experts) applies this once per layer and returns Options: the Dispatcher's
DispatcherConfig (the wire options, and the capacity factor that Megatron's capacity settings and
capacity_mode give it), the experts' ExpertOptions and the capacity mode. ExpertOptions.impl
(option `experts`: config.fp8a2a_experts, --fp8a2a-experts) picks the experts of every fp8_alltoall
layer (Megatron's or fp8a2a's FP8 experts; see megatron/__init__.py). expert_tp_size is not an
option: it is the size of the layer's expert-TP group (the token dispatcher sets it).
"""
import sys
from dataclasses import dataclass, field, fields
from typing import Optional

from .. import DispatcherConfig
from ..wire import QUANTIZED

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

# The wire granularity under a TE FP8 recipe when the run gives none and Megatron's experts run
# the GEMMs. TE's GroupedLinear takes no FP8 input (README), so the rows are dequantized and TE
# quantizes them again whatever the wire carries: the blockwise recipe gets its own quantizer's
# 128-value blocks (as fast as row); current scaling keeps row, since tensor granularity adds an
# amax all-reduce per dispatch and measured no faster (BENCHMARKS.md); delayed scaling (one scale
# per tensor too, not measured) follows it. fp8a2a's FP8 experts take row scales; other recipes
# (mxfp8, nvfp4) keep row.
RECIPE_GRANULARITY = {"blockwise": "block128"}


# Which experts an fp8_alltoall layer runs (--fp8a2a-experts): Megatron's own, from the layer spec,
# on dequantized rows; or fp8a2a's FP8 experts (experts.py) in their place, on the FP8 rows.
EXPERT_IMPLS = ("megatron", "fp8")


@dataclass(frozen=True)
class ExpertOptions:
    """The experts' options: which experts (impl, option name `experts`) and the FP8 experts' own
    (fp8a2a.FP8GroupedMLP's; resolve() sets the defaults: recipe_experts, recipe_gradients)."""
    fp8_dgrad: bool = False
    fp8_wgrad: bool = False
    impl: str = "megatron"

    def __post_init__(self):
        if self.impl not in EXPERT_IMPLS:
            raise ValueError(f"fp8a2a: experts must be one of {EXPERT_IMPLS}, got {self.impl!r}")


@dataclass(frozen=True)
class Options:
    """One layer's options, resolved once (resolve); validated on construction."""
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    experts: ExpertOptions = field(default_factory=ExpertOptions)
    capacity_mode: str = "auto"

    def __post_init__(self):
        if self.capacity_mode not in CAPACITY_MODES:
            raise ValueError(f"fp8a2a: capacity mode must be one of {CAPACITY_MODES}, got {self.capacity_mode!r}")


# What a run sets (config.fp8a2a_<name>, --fp8a2a-<name>, register(<name>=...)), by where it goes.
WIRE_NAMES = ("granularity", "fp8_combine", "fp8_dispatch_backward", "bf16_below_bytes")
EXPERT_FIELDS = {"experts": "impl", "fp8_dgrad": "fp8_dgrad", "fp8_wgrad": "fp8_wgrad"}  # option: field
assert set(EXPERT_FIELDS.values()) == {f.name for f in fields(ExpertOptions)}
EXPERT_NAMES = tuple(EXPERT_FIELDS)
NAMES = WIRE_NAMES + ("capacity_mode",) + EXPERT_NAMES
_registered = {}  # the defaults register() set


def _options(values: dict, capacity_factor: Optional[float] = None) -> Options:
    """Options of {name: value} (names from NAMES; the rest built-in)."""
    wire = {n: values[n] for n in WIRE_NAMES if n in values}
    if "bf16_below_bytes" in wire:
        wire["bf16_below_bytes"] = int(wire["bf16_below_bytes"])
    return Options(DispatcherConfig(**wire, capacity_factor=capacity_factor),
                   ExpertOptions(**{f: values[n] for n, f in EXPERT_FIELDS.items() if n in values}),
                   values.get("capacity_mode", "auto"))


def set_defaults(**kwargs):
    """Process-wide defaults (what register(**kwargs) sets), checked before they are kept."""
    unknown = set(kwargs) - set(NAMES)
    if unknown:
        raise TypeError(f"fp8a2a: unknown option(s) {sorted(unknown)}; known: {list(NAMES)}")
    _options({**_registered, **kwargs})
    _registered.update(kwargs)


def reset_defaults():
    _registered.clear()


def _training_args():
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None


def _given(config) -> dict:
    """{name: value} of the options the config, the training flags or register() set."""
    args, values = _training_args(), dict(_registered)
    for name in NAMES:
        for source in (config, args):
            value = getattr(source, "fp8a2a_" + name, None) if source is not None else None
            if value is not None:
                values[name] = value
                break
    return values


def _recipe_granularity(config, fp8_experts: bool) -> str:
    """The granularity of a run that gave none (RECIPE_GRANULARITY)."""
    if fp8_experts or not getattr(config, "fp8", None):
        return "row"
    recipe = getattr(config, "fp8_recipe", None)
    granularity = RECIPE_GRANULARITY.get(str(getattr(recipe, "value", recipe)), "row")
    # the dispatched width: Megatron projects to moe_latent_size before the dispatch when it is set
    width = getattr(config, "moe_latent_size", None) or getattr(config, "hidden_size", 0)
    if granularity == "block128" and width % 128:
        return "row"  # block128 needs a width % 128 == 0
    return granularity


# The TE recipes under which a run that chose no experts gets fp8a2a's (recipe_experts): Hopper's,
# whose scales (one per tensor, or 1 x 128 / 128 x 128 blocks) the FP8 experts' per-row scales are
# at least as fine as; MXFP8 / NVFP4 (Blackwell) keep Megatron's experts unless asked.
RECIPES_FOR_FP8_EXPERTS = ("blockwise", "tensorwise", "delayed")


def recipe_experts(config) -> str:
    """The experts of a run that chose none: under a TE FP8 recipe (config.fp8) fp8a2a's FP8 experts,
    which take the FP8 rows straight into their GEMMs and were faster than Megatron's TE experts in
    every layer and training-loop measurement (README: which precision where); without a recipe
    Megatron's, since FP8 GEMMs would change what a BF16 run computes. Megatron's too under a recipe
    not in RECIPES_FOR_FP8_EXPERTS, with FP8 parameters (fp8_param: TE's quantized weights), and where
    some layers stay BF16 (first_last_layers_bf16: the layer number is unknown when the experts are
    built). Where the FP8 experts do not cover a layer (bias, another activation, a CUDA-graph setting
    they refuse), that layer keeps Megatron's experts (fp8a2a.megatron._with_chosen_experts); a run
    that asks for them gets the error."""
    recipe = getattr(config, "fp8_recipe", None)
    recipe = str(getattr(recipe, "value", recipe) or "delayed")  # Megatron's default recipe: delayed
    if (not getattr(config, "fp8", None) or recipe not in RECIPES_FOR_FP8_EXPERTS
            or getattr(config, "fp8_param", False) or getattr(config, "first_last_layers_bf16", False)):
        return "megatron"
    return "fp8"


def experts_chosen(config) -> bool:
    """Whether the run chose the experts (config, flag or register()) rather than the recipe."""
    return "experts" in _given(config)


def recipe_gradients(config) -> dict:
    """The FP8 experts' gradient GEMMs of a run that set none: under a TE FP8 recipe (config.fp8) both
    in FP8, as TE computes its own layers' (the weight gradient scaled 1 x 128 along the tokens, TE
    blockwise's rule; within the numerics bounds, README: which precision where). Without a recipe,
    both BF16."""
    recipe = bool(getattr(config, "fp8", None))
    return {"fp8_dgrad": recipe, "fp8_wgrad": recipe}


def _capacity_factor(config, mode: str) -> Optional[float]:
    """The Dispatcher's capacity factor (its capacity mode) under Megatron's capacity settings, or None."""
    factor = getattr(config, "moe_expert_capacity_factor", None)
    pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
    if mode == "static" and factor is None and config is not None:
        raise ValueError("fp8a2a: --fp8a2a-capacity-mode static needs --moe-expert-capacity-factor")
    return factor if (mode == "static" or (mode == "auto" and pad)) else None


def resolve(config=None, fp8_experts: bool = False) -> Options:
    """The options of a layer built from `config` (a TransformerConfig or Megatron's args; None: the
    defaults alone) whose experts take FP8 rows or not (fp8_experts: the granularity default)."""
    values = {"experts": recipe_experts(config), **recipe_gradients(config), **_given(config)}
    values.setdefault("granularity", _recipe_granularity(config, fp8_experts))
    return _options(values, _capacity_factor(config, values.get("capacity_mode", "auto")))
