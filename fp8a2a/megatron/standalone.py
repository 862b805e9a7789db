"""Megatron-core MoE layers outside a Megatron training launch: in one process, on a machine without
CUDA or TransformerEngine, on megatron-core 0.16 and 0.19 alike. What the examples and
benchmarks build their runs on (examples/train_moe_megatron.py's CPU mode,
examples/convergence_megatron.py, benchmarks/bench_megatron_layer.py, bench_small_model.py); the
adapter itself (fp8a2a.megatron) needs none of it.

    teardown = world_of_one()                  # torch.distributed + Megatron parallel state, world size 1
    spec = with_portable_router(get_moe_module_spec(...))
    layer = build_layer(spec, config)
    with fp8_context(config):                  # the config's TE FP8 recipe, if any
        y, _ = layer(x)
    teardown()

* with_portable_router(spec): a copy of a layer/MoE spec whose router is a TopKRouter with its
  gating a plain torch linear on the input's device (PortableTopKRouter). megatron-core 0.16's
  TopKRouter.gating moves its weight to CUDA, and its router_gating_linear raises NameError
  (te_general_gemm) when TransformerEngine is not installed. Routing, scoring, capacity dropping
  and load-balancing losses are Megatron's own.
* cpu_current_device(): makes torch.cuda.current_device() return the CPU device on a machine
  without CUDA (Megatron allocates some buffers there). Process-wide.
* cpu_cuda_streams(): torch.cuda's stream API as no-ops on a machine without CUDA (Megatron's
  MoEAlltoAllTokenDispatcher makes a D2H stream and events even for CPU tensors). Process-wide.
* single_process_group(): torch.distributed at world size 1 (NCCL on a GPU, else gloo).
* world_of_one(seed): that and Megatron's model-parallel state; returns the teardown.
* build_layer(spec, config): the module of a spec, on megatron-core 0.16 (ModuleSpec) and 0.19
  (partial builders) alike.
* fp8_context(config): Megatron's TE FP8 recipe context of a config, else a null context.
"""
import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from ..bench.launch import single_process_group  # noqa: F401  (part of this module's API)


@functools.lru_cache(None)
def _router_cls():
    from megatron.core.transformer.moe.router import TopKRouter

    class PortableTopKRouter(TopKRouter):
        def gating(self, input):
            dtype = input.dtype
            router_dtype = getattr(self.config, "moe_router_dtype", None)
            if router_dtype == "fp32":
                dtype = torch.float32
            elif router_dtype == "fp64":
                dtype = torch.float64
            bias = None if getattr(self, "bias", None) is None else self.bias.to(dtype)
            return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    return PortableTopKRouter


def with_portable_router(spec):
    """A copy of a layer, block or MoE spec (ModuleSpec, partial builder, submodules dataclass) whose
    MoE router is PortableTopKRouter; everything else shared with `spec`."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(obj):
        if isinstance(obj, MoESubmodules):
            return dataclasses.replace(obj, router=_router_cls())
        if isinstance(obj, ModuleSpec):
            sub = swap(obj.submodules)
            return obj if sub is obj.submodules else dataclasses.replace(obj, submodules=sub)
        if isinstance(obj, functools.partial):
            kw = {k: swap(v) for k, v in obj.keywords.items()}
            args = tuple(swap(a) for a in obj.args)
            return functools.partial(obj.func, *args, **kw)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {f.name: swap(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            changes = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
            return dataclasses.replace(obj, **changes) if changes else obj
        if isinstance(obj, list):
            return [swap(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(swap(v) for v in obj)
        return obj

    return swap(spec)


def cpu_current_device():
    """Without CUDA, let torch.cuda.current_device() name the CPU (process-wide)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")


class CpuStream:
    """torch.cuda's stream API as no-ops: Megatron's MoEAlltoAllTokenDispatcher makes a D2H stream
    and events even when its tensors are on the CPU (a CPU torch cannot create them)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, *args):
        return self

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, CpuStream)

    __hash__ = object.__hash__


def cpu_cuda_streams():
    """Without CUDA, torch.cuda.Stream / current_stream / stream become CpuStream no-ops (process-wide),
    and torch.cuda.current_device() names the CPU."""
    if not torch.cuda.is_available():
        torch.cuda.Stream = CpuStream
        torch.cuda.current_stream = lambda *a: CpuStream()
        torch.cuda.stream = lambda s: contextlib.nullcontext()
    cpu_current_device()


def world_of_one(seed: int = 123):
    """torch.distributed at world size 1 (single_process_group) and Megatron's model-parallel state
    (model-parallel RNG seeded with `seed`); returns the function that tears both down."""
    from megatron.core import parallel_state as ps, tensor_parallel

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_current_device()
    single_process_group()
    if cuda:
        ps.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        ps.initialize_model_parallel(create_gloo_process_groups=False)
        torch.manual_seed(seed)

    def teardown():
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return teardown


def build_layer(spec, config):
    """The module of a layer spec: a ModuleSpec (megatron-core 0.16) or a partial builder (0.19)."""
    if isinstance(spec, functools.partial):
        return spec(config=config)
    from megatron.core.transformer.spec_utils import build_module
    return build_module(spec, config=config)


def fp8_context(config):
    """Megatron's TE FP8 recipe context for config (config.fp8 / fp8_recipe), else a null context."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context
    return get_fp8_context(config)
