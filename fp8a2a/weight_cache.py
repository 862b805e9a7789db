"""The expert weights the FP8 GEMMs read, cached across micro-batches: fp8_weight (FP8 [E, N, K]
with per-output-channel scales, or the same bytes transposed for the FP8 dgrad), the BF16
stack for the BF16 dgrad (dense_weight), and expert_weights' stand-ins for Megatron's per-expert
parameters (no stack per forward). One validity rule for every cached copy (_cached).

CUDA graphs: a copy handed out while a graph is captured is read by the graph's kernels at every
replay, which skips the check. Such copies stay where they are: a rebuild copies into them, and
refresh_graphed(weight), called before a replay (fp8a2a.megatron does it for Megatron's graphs),
applies the same rule at the point where the eager forward would."""
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .kernels import capturing, quantize_rows, triton_kernels, triton_ok
from .wire import FP8


# Fused optimizers (e.g. AdamW(fused=True)) update weights without bumping their version counter,
# so the FP8 weight cache is also keyed on an epoch that every optimizer step, any optimizer's, and
# invalidate_fp8_weight_cache() advance.
_weight_epoch = [0]


def invalidate_fp8_weight_cache(*_):
    """Requantize every expert weight at its next use. Call it after changing weights in a way
    neither their version counter nor an optimizer step shows: writes through `.data` (manual SGD,
    EMA swaps, `p.data.normal_()`), or into a buffer the parameters are views of."""
    _weight_epoch[0] += 1


register_optimizer_step_post_hook(invalidate_fp8_weight_cache)


class _ExpertWeights(torch.autograd.Function):
    """Stand-ins [E, N, K] for groups of E per-expert [N, K] parameters: no memory (zero strides),
    the gradient of each stand-in handed to its parameters as slices (views, no copy)."""

    @staticmethod
    def forward(ctx, counts, fuse, *params):
        ctx.counts, ctx.fuse, out, i = counts, fuse, [], 0
        ctx.params = params if fuse else None  # fused: main_grad is written in the backward
        for n in counts:
            out.append(params[i].new_empty(()).expand(n, *params[i].shape))
            i += n
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        parts = [(None,) * n if g is None else g.unbind(0) for g, n in zip(grads, ctx.counts)]
        flat = [t for part in parts for t in part]
        if ctx.fuse:
            flat = [g if g is None else _into_main_grad(p, g) for p, g in zip(ctx.params, flat)]
        return (None, None) + tuple(flat)


def _dummy_wgrad(shape, dtype, device, zero):
    """One shared placeholder gradient per (shape, dtype, device, zero) (as TE's get_dummy_wgrad)."""
    key = (tuple(shape), dtype, device, zero)
    t = _DUMMY_WGRADS.get(key)
    if t is None:
        t = _DUMMY_WGRADS[key] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return t


_DUMMY_WGRADS = {}


def _into_main_grad(param, grad):
    """Megatron's gradient_accumulation_fusion (LinearWithGradAccumulationAndAsyncCommunication):
    grad is added into param.main_grad in place (the buffer Megatron's DDP sets, float32) and no
    .grad is made. Under DDP (param.grad_added_to_main_grad exists) a placeholder gradient is
    returned instead of None and grad_added_to_main_grad set, as Megatron does, so that DDP's
    gradient hooks still run (its overlapped reduce counts on them) and skip adding it again; with
    zero_out_wgrad the placeholder is zeros. A parameter without main_grad gets grad as usual."""
    main = getattr(param, "main_grad", None)
    if main is None:
        return grad
    main.add_(grad)  # in main_grad's dtype: grad is rounded as the unfused DDP path rounds .grad
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return _dummy_wgrad(main.shape, grad.dtype, grad.device, bool(getattr(param, "zero_out_wgrad", False)))


def expert_weights(*groups, gradient_accumulation_fusion: bool = False):
    """For each group of E per-expert parameters [N, K] (Megatron's experts), an [E, N, K] weight for
    grouped_linear / FP8GroupedMLP without stacking them: differentiable (each parameter gets its
    slice of the gradient), but holding no values. The expert GEMMs read only the copies cached
    on the parameters under fp8_weight's rule: the FP8 weights, and the BF16 stack the BF16 dgrad
    reads (dense_weight). Returns a tuple, one weight per group.

    gradient_accumulation_fusion (Megatron's config option of that name): each parameter that has a
    main_grad gets its gradient added into main_grad in place instead of .grad (_into_main_grad)."""
    groups = [tuple(g) for g in groups]
    if any(not g or any(t.shape != g[0].shape for t in g) for g in groups):
        raise ValueError("fp8a2a: expert_weights needs non-empty groups of same-shaped parameters")
    out = _ExpertWeights.apply(tuple(len(g) for g in groups), bool(gradient_accumulation_fusion),
                               *(t for g in groups for t in g))
    for w, g in zip(out, groups):
        w.__dict__["_fp8a2a_sources"] = g
    return out


def _slot(weight):
    """(sources, the cache dict, the key of the weight's state now: every kind cached under this key
    is valid; None where nothing may be cached)."""
    sources = weight.__dict__.get("_fp8a2a_sources") or (weight,)
    # each source's version and where its values live: a new storage (.data = ...) misses, though it
    # leaves the version counter as it was (_store keeps the old storage alive, so that its address
    # cannot come back); dtype and strides of the first (per source they cost
    # 3x the rest of the key at 256 experts; a group's parameters change dtype together)
    first = sources[0]
    try:
        key = (tuple((t._version, t.data_ptr()) for t in sources), _weight_epoch[0], first.dtype, first.stride(),
               weight.device, tuple(weight.shape))
    except RuntimeError:  # inference tensors carry no version counter: never cache
        key = None
    return sources, first.__dict__.setdefault("_fp8a2a_cache", {}), key


def _capturing(weight):
    return capturing(weight.device)


def _graphed(sources):
    """The kinds cached on sources that a captured CUDA graph reads (refilled in place, never replaced)."""
    return sources[0].__dict__.setdefault("_fp8a2a_graphed", set())


def _hit(weight, sources, cache, kind, key):
    """The cached copy of kind if it is valid under key, else None. Under capture a hit is marked
    as read by the graph."""
    hit = cache.get(kind)
    if key is None or hit is None or hit[0] != key:
        return None
    if _capturing(weight):
        _graphed(sources).add(kind)
    return hit[1]


def _store(sources, cache, kind, key, out):
    """Caches out under key and returns what the caller must use: out, or for a copy a graph
    reads, that copy with out's values copied in (a new shape cannot be: the graph must be captured
    again, and this raises)."""
    graphed = _graphed(sources)
    old = cache.get(kind, (None, None))[1]
    if kind in graphed:
        olds, news = _tensors(old), _tensors(out)
        if old is not None and len(olds) == len(news) and all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in zip(olds, news)):
            for a, b in zip(olds, news):
                a.copy_(b)
            out = old
        else:  # the graph would keep reading the old copy's memory, freed or reused
            raise RuntimeError("fp8a2a: an expert weight a captured CUDA graph reads changed its shape or dtype "
                               "(or its cached copy was dropped); capture the graph again")
    if key is not None or kind in graphed:  # a graphed copy with no key is refilled at every call
        # the sources' storages stay alive with their copy: no new storage can take their address,
        # so a key that matches names the same memory (a freed one could be reused by `.data = ...`)
        cache[kind] = (key, out, tuple(t.untyped_storage() for t in sources))
    return out


def _tensors(out):
    return () if out is None else (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _cached(weight, kind, build):
    """build(sources) cached on the weight (on the first of its parameters for an expert_weights
    stand-in) under kind. The one validity rule: recomputed when a version counter, the address,
    dtype or strides of a source change, after every optimizer step (fused optimizers do not bump versions) and after
    invalidate_fp8_weight_cache(); never cached for inference tensors (no version counter). A copy
    a CUDA graph reads is rebuilt in place. A miss under capture is built by the graph itself (it
    then rebuilds it at every replay; Megatron captures after eager warm-up runs, which hit)."""
    sources, cache, key = _slot(weight)
    out = _hit(weight, sources, cache, kind, key)
    if out is not None:
        return out
    if not _capturing(weight) and kind not in _graphed(sources):
        cache.pop(kind, None)  # free the stale copy before building its successor
    with torch.no_grad():
        out = build(sources)
        return out if _capturing(weight) else _store(sources, cache, kind, key, out)


def refresh_graphed(weight: torch.Tensor) -> None:
    """Brings every cached copy of weight that a captured CUDA graph reads up to date, in place,
    by _cached's rule (nothing to do while they are valid). Call it before each replay, once the
    weights the replay should see are written: a replay itself checks nothing."""
    sources = weight.__dict__.get("_fp8a2a_sources") or (weight,)
    graphed = sources[0].__dict__.get("_fp8a2a_graphed")
    if not graphed:
        return
    _, cache, key = _slot(weight)
    if key is not None and all(cache.get(k, (None,))[0] == key for k in graphed):
        return
    for kind in tuple(graphed):
        if kind == "stack":
            dense_weight(weight)
        else:
            fp8_weight(weight, transposed=kind)


def is_stand_in(weight: torch.Tensor) -> bool:
    """Whether weight is an expert_weights stand-in (it holds no values: read dense_weight or
    fp8_weight of it)."""
    return "_fp8a2a_sources" in weight.__dict__


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """The values of an [E, N, K] weight: itself, or for an expert_weights stand-in the stack of its
    parameters, cached (one copy of the local expert weights, refreshed when they change: it spares
    every micro-batch a copy of all of them). What the BF16 dgrad reads."""
    if not is_stand_in(weight):
        return weight
    return _cached(weight, "stack", lambda sources: torch.stack([t.detach() for t in sources]))


def _fast_weight_quant(weight, sources):
    """fp8_weight's row-wise build in one Triton launch (triton_kernels.expert_weight_quant: the same
    bytes), or None where it does not apply: not CUDA / no Triton, no elements, another dtype, or for
    a stand-in, parameters not all contiguous of one dtype on the weight's device."""
    if not triton_ok(weight):
        return None
    tk = triton_kernels()
    E, N, K = weight.shape
    if E == 0 or N == 0 or K == 0:
        return None
    if not is_stand_in(weight):
        w = weight.detach()
        if w.dtype not in tk.WEIGHT_DTYPES or w.stride(2) != 1:
            return None
        return tk.expert_weight_quant(w)
    ts = [t.detach() for t in sources]
    t0 = ts[0]
    if (len(ts) != E or t0.dtype not in tk.WEIGHT_DTYPES
            or any(t.device != weight.device or t.dtype != t0.dtype or t.shape != (N, K) or not t.is_contiguous()
                   for t in ts)):
        return None
    return tk.expert_weight_quant(ts)


def fp8_weight(weight: torch.Tensor, transposed: bool = False):
    """(w_fp8 [E, N, K], scale [E, N]): `weight` [E, N, K] quantized per output channel, the bytes of
    the extension's row quantization of the [E*N, K] rows. transposed=True: the same bytes as
    [E, K, N] (each expert's matrix transposed: the FP8 dgrad's operand, which folds the same
    per-output-channel scales into dY), with the same scales. Both are cached on the weight tensor
    (on its parameters for an expert_weights stand-in, read through a table of their addresses on
    CUDA, expert by expert elsewhere: no BF16 stack) and recomputed as _cached says; on CUDA with
    Triton one launch each (triton_kernels.expert_weight_quant; transpose_bytes from the row-wise
    copy, so the BF16 weights are read once for both)."""
    if transposed:
        return _cached(weight, True, lambda sources: _transpose(*fp8_weight(weight)))
    return _cached(weight, False, lambda sources: _fast_weight_quant(weight, sources) or _build(weight, sources))


def _transpose(data, scale):
    if triton_ok(data):
        return triton_kernels().transpose_bytes(data), scale
    return data.view(torch.uint8).transpose(-2, -1).contiguous().view(FP8), scale


def _build(weight, sources):
    """fp8_weight's row-wise build off the Triton path: the extension's row quantization, expert by
    expert for a stand-in (no BF16 stack)."""
    E, N, K = weight.shape
    if not is_stand_in(weight):
        data, scale = quantize_rows(weight.detach().reshape(E * N, K))
        return data.view(E, N, K), scale.view(E, N)
    data = torch.empty((E, N, K), dtype=FP8, device=weight.device)
    scale = torch.empty((E, N), dtype=torch.float32, device=weight.device)
    for e, t in enumerate(sources):
        d, s = quantize_rows(t.detach())
        data[e].copy_(d)
        scale[e].copy_(s)
    return data, scale
