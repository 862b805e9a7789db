"""Megatron-core adapter: `--moe-token-dispatcher-type fp8_alltoall`.

    import fp8a2a.megatron
    fp8a2a.megatron.register()            # once, before the model is built (and before parse_args)

After register():
  * TransformerConfig accepts moe_token_dispatcher_type="fp8_alltoall" and validates it exactly as
    "alltoall" (every check Megatron applies to alltoall applies);
  * MoELayer builds fp8a2a.megatron.dispatcher.FP8AlltoAllTokenDispatcher for it (groups from the
    layer's process-group collection: EP, expert-TP, TP x EP);
  * megatron.training's parser (where megatron.training exists: the megatron-core wheels ship it
    from 0.19 on) accepts `--moe-token-dispatcher-type fp8_alltoall` and the --fp8a2a-* flags.
    Programs with their own parser use `add_arguments` (an extra_args_provider) instead.

Megatron has no dispatcher registry; register() wraps methods in memory (nothing installed is
edited), the first two keyed on the dispatcher type so other types are untouched:
  * TransformerConfig.__post_init__: runs the original with the type set to "alltoall", then puts
    "fp8_alltoall" back;
  * MoELayer.__init__: runs the original with the type set to "alltoall" and, for that call only,
    the module-level name MoEAlltoAllTokenDispatcher in megatron.core.transformer.moe.moe_layer bound
    to FP8AlltoAllTokenDispatcher (so the alltoall branch builds ours, with the same arguments);
    then restores both (with `--fp8a2a-experts fp8`, or under a TE FP8 recipe that chose no experts
    (options.recipe_experts), the call also gets the layer's submodules with
    fp8a2a's FP8 experts class in place of the spec's: every MoE layer of that type, whichever spec
    or builder made it). Megatron-core 0.16 and 0.19 both build dispatchers this way; a version that
    does not gets its dispatcher replaced after the original __init__ (with a warning). Then the
    dispatcher learns the experts (set_experts) and, in the capacity mode, takes the capacity
    from the router (set_router: the Dispatcher drops and pads, the router no longer does);
  * megatron.training.arguments.add_megatron_arguments (what its parse_args calls): adds
    add_arguments(parser). Patched at once if that module is loaded, else by a one-shot import hook
    when it is (register() never imports the training stack itself).
register() is idempotent; unregister() undoes it.

CUDA graphs: which of Megatron's settings work with fp8_alltoall is in README.md (Megatron-core, CUDA
graphs); dispatcher.check_cuda_graphs and experts.check_cuda_graphs refuse the rest when the layer
is built, naming the option.

Where Megatron tests `moe_token_dispatcher_type == "alltoall"` outside the dispatcher, fp8_alltoall
(the type reads "fp8_alltoall" there: only __post_init__ and MoELayer.__init__ see "alltoall")
takes the other branch, which is right for it, so nothing is patched:
  * models/common/utils.py should_free_input (free_mlp): alltoall with one local expert hands the
    mlp node's input straight to the GEMM, which saves it; fp8_alltoall's mlp input is a memoryless
    carrier (the rows stay on the dispatcher), so freeing it is safe at any expert count;
  * transformer_layer.py pre-MLP layernorm recompute under a moe_router+moe_preprocess graph:
    alltoall's graph outputs are permuted copies, so the layernorm output can be freed and
    recomputed; fp8_alltoall returns `_x`, a view of the layernorm output, as a graph output
    (cudagraph_attrs), a static buffer: no recompute (the branch Megatron takes for it).

Experts: Megatron's own experts (SequentialMLP, TEGroupedMLP, ...) receive dequantized rows in the
activation dtype; the wire still carries FP8. `fp8_experts_spec(spec)` swaps in FP8 experts that
keep Megatron's parameters and checkpoint layout and take the FP8 rows straight into FP8GroupedMLP;
the option `experts` (`--fp8a2a-experts fp8`, config.fp8a2a_experts, register(experts="fp8")) does
the same for every fp8_alltoall layer, at build time; a run that sets none gets them under a TE FP8
recipe (options.recipe_experts).

Launcher: `python -m fp8a2a.megatron.run SCRIPT.py ARGS...` (or under torchrun) calls register()
and runs the script as `__main__` (fp8a2a/megatron/run.py).
"""
import argparse
import functools
import importlib.abc
import sys
import warnings

from .options import (CAPACITY_MODES, EXPERT_IMPLS, FP8_ALLTOALL, GRANULARITIES, Options, resolve,  # noqa: F401
                      experts_chosen, set_defaults)

__all__ = ["register", "unregister", "is_registered", "add_arguments", "extra_args_provider", "fp8_experts_spec",
           "FP8_ALLTOALL", "Options", "resolve", "FP8AlltoAllTokenDispatcher"]

_BASE_TYPES = ["allgather", "alltoall", "flex"]
_patches = []  # (owner, name, original)


def __getattr__(name):
    if name == "FP8AlltoAllTokenDispatcher":
        from .dispatcher import FP8AlltoAllTokenDispatcher
        return FP8AlltoAllTokenDispatcher
    raise AttributeError(name)


# ---- command line ------------------------------------------------------------------------------

def add_arguments(parser):
    """extra_args_provider: accept `--moe-token-dispatcher-type fp8_alltoall` (extending an existing
    option's choices, or adding the option) and the --fp8a2a-* flags. Idempotent; returns parser."""
    opts = parser._option_string_actions
    action = opts.get("--moe-token-dispatcher-type")
    if action is None:
        parser.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                            choices=_BASE_TYPES + [FP8_ALLTOALL],
                            help="MoE token dispatcher; fp8_alltoall: FP8 all-to-all of fp8a2a")
    elif action.choices is not None and FP8_ALLTOALL not in action.choices:
        action.choices = list(action.choices) + [FP8_ALLTOALL]
    if "--fp8a2a-granularity" in opts:
        return parser
    d = Options().dispatcher
    g = parser.add_argument_group("fp8a2a", "FP8 token dispatch (--moe-token-dispatcher-type fp8_alltoall)")
    g.add_argument("--fp8a2a-granularity", choices=list(GRANULARITIES), default=None,
                   help=f"FP8 scale granularity on the wire (default {d.granularity}; block128 under TE's "
                        "blockwise recipe with Megatron's experts)")
    g.add_argument("--fp8a2a-capacity-mode", choices=list(CAPACITY_MODES), default=None,
                   help="how --moe-expert-capacity-factor / --moe-pad-expert-input-to-capacity map: auto "
                        "(default): drop-and-pad uses fp8a2a's capacity mode (static shapes, no host sync), a "
                        "capacity factor alone the router's dropping; static: the capacity mode whenever a "
                        "capacity factor is set; variable: never (drop-and-pad without sending padding rows)")
    g.add_argument("--fp8a2a-fp8-combine", action="store_true", default=None,
                   help="send the combine (forward) in FP8 too; lossy, default BF16")
    g.add_argument("--fp8a2a-fp8-dispatch-backward", action="store_true", default=None,
                   help="send the dispatch backward (input gradients) in FP8 too; lossy, default BF16")
    g.add_argument("--fp8a2a-bf16-below-bytes", type=int, default=None,
                   help=f"dispatch inputs smaller than this many bytes per rank unquantized "
                        f"(default {d.bf16_below_bytes}; 0 = always FP8)")
    g.add_argument("--fp8a2a-experts", choices=list(EXPERT_IMPLS), default=None,
                   help="experts of every fp8_alltoall MoE layer: megatron: the layer spec's own, on dequantized "
                        "rows; fp8: fp8a2a's FP8 experts (as fp8_experts_spec) on the FP8 rows, with Megatron's "
                        "parameters and checkpoint layout (default: fp8 under TE's blockwise, tensorwise or "
                        "delayed FP8 recipe where they cover the layer, unless --fp8-param-gather or "
                        "--first-last-layers-bf16; else megatron)")
    g.add_argument("--fp8a2a-fp8-dgrad", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 experts (the default under a TE FP8 recipe, or --fp8a2a-experts fp8): FP8 "
                        "input-gradient GEMMs (default: FP8 under a TE FP8 recipe (--fp8-format), else BF16)")
    g.add_argument("--fp8a2a-fp8-wgrad", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 experts (the default under a TE FP8 recipe, or --fp8a2a-experts fp8): FP8 "
                        "weight-gradient GEMMs, operands scaled per 128 tokens (default: FP8 under a TE FP8 "
                        "recipe (--fp8-format), else BF16)")
    return parser


extra_args_provider = add_arguments


# ---- patching ------------------------------------------------------------------------------------

def _patch(owner, name, wrapper):
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    wrapper.__fp8a2a_original__ = original
    setattr(owner, name, wrapper)
    _patches.append((owner, name, original))


def _patch_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__dict__["__post_init__"]

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if getattr(self, "moe_token_dispatcher_type", None) != FP8_ALLTOALL:
            return original(self, *args, **kwargs)
        self.moe_token_dispatcher_type = "alltoall"  # validate exactly as alltoall
        try:
            return original(self, *args, **kwargs)
        finally:
            self.moe_token_dispatcher_type = FP8_ALLTOALL

    _patch(TransformerConfig, "__post_init__", __post_init__)


def _patch_moe_layer():
    from megatron.core.transformer.moe import moe_layer as ml

    original = ml.MoELayer.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if getattr(config, "moe_token_dispatcher_type", None) != FP8_ALLTOALL:
            return original(self, config, *args, **kwargs)
        from .dispatcher import FP8AlltoAllTokenDispatcher

        args, kwargs = _with_chosen_experts(config, args, kwargs)

        stock = ml.MoEAlltoAllTokenDispatcher
        ml.MoEAlltoAllTokenDispatcher = FP8AlltoAllTokenDispatcher
        config.moe_token_dispatcher_type = "alltoall"
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = FP8_ALLTOALL
            ml.MoEAlltoAllTokenDispatcher = stock
        # configs copied while the type read "alltoall" (e.g. SequentialMLP's) get it back
        for module in self.modules():
            sub = getattr(module, "config", None)
            if sub is not None and sub is not config and getattr(sub, "moe_token_dispatcher_type", None) == "alltoall":
                sub.moe_token_dispatcher_type = FP8_ALLTOALL
        if not isinstance(self.token_dispatcher, FP8AlltoAllTokenDispatcher):
            warnings.warn("fp8a2a: this megatron-core built its alltoall dispatcher another way; replacing it",
                          stacklevel=2)
            pg = kwargs.get("pg_collection")
            self.token_dispatcher = FP8AlltoAllTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                               config=self.config, pg_collection=pg)
            if getattr(self, "_training_token_dispatcher", None) is not None:
                self._training_token_dispatcher = self.token_dispatcher
            if self.shared_experts is not None and getattr(self, "shared_expert_overlap", False):
                self.token_dispatcher.set_shared_experts(self.shared_experts)
        self.token_dispatcher.set_experts(self.experts)
        self.token_dispatcher.set_router(self.router)

    _patch(ml.MoELayer, "__init__", __init__)


@functools.lru_cache(None)
def _warn_kept_experts(reason):
    warnings.warn(f"fp8a2a: this layer keeps Megatron's experts under the TE FP8 recipe ({reason}); "
                  "--fp8a2a-experts megatron silences this", RuntimeWarning, stacklevel=4)


def _with_chosen_experts(config, args, kwargs):
    """MoELayer.__init__'s (args, kwargs) with the experts the options choose (--fp8a2a-experts):
    unchanged for Megatron's, else the submodules (positional after config, or keyword) with the
    FP8 counterpart of the spec's experts class (experts.fp8_experts_spec's swap)."""
    if resolve(config).experts.impl != "fp8":
        return args, kwargs
    from .experts import check_config, fp8_experts_spec

    positional = "submodules" not in kwargs and len(args) > 0
    submodules = args[0] if positional else kwargs.get("submodules")
    try:
        check_config(config)
        submodules = fp8_experts_spec(submodules)
    except ValueError as e:
        if not experts_chosen(config):  # the recipe's default (options.recipe_experts): Megatron's experts stay
            _warn_kept_experts(str(e))
            return args, kwargs
        experts = getattr(submodules, "experts", None)
        experts = getattr(experts, "module", getattr(experts, "func", experts))
        raise ValueError(f"fp8a2a: --fp8a2a-experts fp8: no FP8 experts for this layer's experts "
                         f"{getattr(experts, '__name__', experts)!r} ({e})") from None
    if positional:
        return (submodules, *args[1:]), kwargs
    return args, {**kwargs, "submodules": submodules}


_TRAINING_ARGS = "megatron.training.arguments"


def _patch_training_arguments(arguments):
    """megatron.training's parse_args builds its parser through the module-level
    add_megatron_arguments (looked up at call time): wrap it to add ours."""
    original = getattr(arguments, "add_megatron_arguments", None)
    if original is None or hasattr(original, "__fp8a2a_original__"):
        return False

    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        return add_arguments(original(parser, *args, **kwargs))

    _patch(arguments, "add_megatron_arguments", add_megatron_arguments)
    return True


class _LoaderProxy(importlib.abc.Loader):
    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches megatron.training.arguments when (if ever) it is imported, so register() neither
    imports the training stack itself nor depends on being called after it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRAINING_ARGS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderProxy(spec.loader, self._loaded)
                return spec
        return None

    def _loaded(self, module):
        _remove_finder()
        if _patches:  # still registered
            _patch_training_arguments(module)


_finder = None


def _remove_finder():
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def _patch_training_parser():
    """megatron.training (in the megatron-core wheel from 0.19 on): patch its arguments module now
    if it is loaded, else when it gets imported."""
    global _finder
    module = sys.modules.get(_TRAINING_ARGS)
    if module is not None:
        return _patch_training_arguments(module)
    if _finder is None:
        _finder = _PatchOnImport()
        sys.meta_path.insert(0, _finder)
    return False


def is_registered() -> bool:
    return bool(_patches)


def register(**defaults):
    """Make Megatron-core build the fp8_alltoall dispatcher (see the module docstring).

    defaults: process-wide option defaults (granularity, capacity_mode, fp8_combine,
    fp8_dispatch_backward, bf16_below_bytes, experts ("megatron" or "fp8"), and the FP8 experts'
    fp8_dgrad, fp8_wgrad); config
    attributes fp8a2a_<name> and the --fp8a2a-* flags take precedence; a granularity, experts or
    FP8 experts' dgrad / wgrad given nowhere follow the TE recipe (options.RECIPE_GRANULARITY,
    options.recipe_experts, options.recipe_gradients). Returns the defaults as options.Options."""
    import megatron.core  # noqa: F401  (a clear ImportError when megatron-core is missing)

    if defaults:
        set_defaults(**defaults)
    if not _patches:
        try:
            _patch_config()
            _patch_moe_layer()
            _patch_training_parser()
        except BaseException:
            unregister()
            raise
    return resolve(None)


def unregister():
    """Undo register() (restores the wrapped methods and the option defaults)."""
    from .options import reset_defaults

    _remove_finder()
    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)
    reset_defaults()


def fp8_experts_spec(spec):
    """A copy of a Megatron layer/block/MoE spec with FP8 experts (FP8GroupedMLP compute on the FP8
    rows of fp8_alltoall; Megatron's parameters and checkpoint layout). See megatron/experts.py."""
    from .experts import fp8_experts_spec as impl
    return impl(spec)
