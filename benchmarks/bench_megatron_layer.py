#!/usr/bin/env python
"""A full megatron-core MoELayer (TE spec: moe_grouped_gemm, moe_permute_fusion, SwiGLU, 7168 -> 2048),
forward + backward at world size 1 (a process group of one), Megatron's alltoall against
--moe-token-dispatcher-type fp8_alltoall, under TE's FP8 recipes (issue 16's table), on one GPU:

    python benchmarks/bench_megatron_layer.py [--repeat 3] [--json out.json]

Shapes: 4096 tokens x 8 experts, top-8 (DeepSeek-V3's per-rank load at EP=32) and x 32 experts
(EP=8), every row below; 256 experts (DeepSeek-V3 on one rank): fp8_experts_spec against
FP8GroupedMLP on fp8a2a's Dispatcher (same weights), per fp8_dgrad / fp8_wgrad option, target
within 1.15x. Rows (TEGroupedMLP experts unless named): alltoall TE BF16; alltoall TE FP8 blockwise
(the baseline of the ratios); alltoall TE FP8 tensorwise (current scaling); fp8_alltoall + TE FP8
blockwise with row and with the default (block128), under tensorwise with the default (row) and
tensor; fp8_alltoall + fp8_experts_spec (default, fp8_dgrad, fp8_dgrad +
fp8_wgrad), and the last again on the host path it had before ops.mm_fp8_per_expert and
ops.routing_map_to_topk (OLD_HOST_PATH: an A/B in one process; at 32 experts, 1024 rows per expert,
the GEMMs take the grouped path either way and only the routing differs). --match REGEX times only
the rows whose name it matches, and the baseline. Timing: CUDA events around forward + backward
only, `--iters` iterations after warm-up, the variants of a shape interleaved (rotating order);
`--repeat` times the shape's table again in the process: medians and min-max of the per-run
medians, ratios per run against the baseline of that run. Both sides are timed as Megatron runs a micro-batch after a step's first:
TE's linears get is_first_microbatch=False (Megatron's TE wrappers pass True to the first call
after set_is_first_microbatch, False after it), so TE reuses its cached FP8 weights, as fp8a2a's
FP8 experts reuse theirs; gradients are set to None before every timed call, outside the timed
region, for every row alike (as Megatron's DDP leaves .grad after each backward). The headline
(fwd_bwd_ms, ratio) is that cached per-micro-batch step, timed from an idle GPU. In the 8- and
32-expert tables each iteration also times --burst cached steps launched back to back, no sync
between them (back_to_back_ms and its per-run ratio): as a training loop runs its micro-batches, the
host's launches up to the dispatch's sync then overlap the previous step's device work; there the
gradients are set to None between the steps, inside the timing (host work only, the same parameters
on both sides). Weight quantization per optimizer step is
measured in the same run, the same way for both sides: in every iteration each row also runs a
step's first micro-batch (TE: set_is_first_microbatch, so it recasts; fp8a2a: that row's cached FP8
weights dropped, so its forward rebuilds them) right after its cached step; quant/step is the
median of those paired differences, reported apart and folded in at 1, 8 and 32 micro-batches per
optimizer step. te_recast_calls counts timed cached steps (bursts included) in which a TE linear that
runs would have recast (0 expected; the FP8 experts' own TE linears never run).

--profile: after the timing, --repeat cached steps of every row under torch.profiler, one after
another (fp8a2a/bench/costs.py): the busy device time of each, and of the first its split by kernel class
(copy, nccl, GEMM, quantize, permute, activation, other: costs.KERNEL_CLASSES), its host syncs and
device-to-host copies, its top kernels and longest idle gaps; the device time a step's first
micro-batch adds (the weight cast); for the FP8 experts with the FP8 wgrad, the rate of cuBLAS's FP8
GEMMs in the step (their per-expert weight-gradient GEMMs): where each millisecond went (CUDA only).

--cpu: tiny shapes, the variants that need neither TE nor CUDA (SequentialMLP experts), numbers
functional only (tests/test_bench_megatron_layer.py runs it)."""
import argparse
import json
import re
import statistics
import time

import torch
import torch.nn.functional as F

import fp8a2a
import fp8a2a.megatron as fm
from fp8a2a.bench import costs
from fp8a2a.megatron.standalone import build_layer, fp8_context, with_portable_router, world_of_one

BASELINE = "alltoall + TE FP8 blockwise"
TARGET = 1.15  # fp8_experts_spec / FP8GroupedMLP at 256 experts
MICRO_BATCHES = (1, 8, 32)
BURST = 3  # cached steps per back-to-back burst (--burst)
OPTIONS = {"": {}, " fp8_dgrad": {"fp8_dgrad": True}, " fp8_dgrad+wgrad": {"fp8_dgrad": True, "fp8_wgrad": True}}
# name: (dispatcher, experts: te | local | fp8 (fp8_experts_spec), TE recipe, fp8a2a options)
VARIANTS = {
    "alltoall + TE BF16": ("alltoall", "te", None, {}),
    BASELINE: ("alltoall", "te", "blockwise", {}),
    "alltoall + TE FP8 tensorwise": ("alltoall", "te", "tensorwise", {}),
    "fp8_alltoall row + TE FP8 blockwise": ("fp8_alltoall", "te", "blockwise", {"granularity": "row"}),
    "fp8_alltoall default (block128) + TE FP8 blockwise": ("fp8_alltoall", "te", "blockwise", {}),
    "fp8_alltoall default (row) + TE FP8 tensorwise": ("fp8_alltoall", "te", "tensorwise", {}),
    "fp8_alltoall tensor + TE FP8 tensorwise": ("fp8_alltoall", "te", "tensorwise", {"granularity": "tensor"}),
    **{f"fp8_alltoall + fp8_experts_spec{k}": ("fp8_alltoall", "fp8", None, v) for k, v in OPTIONS.items()},
}
CPU_VARIANTS = {"fp8_alltoall row + SequentialMLP": ("fp8_alltoall", "local", None, {}),
                **{k: v for k, v in VARIANTS.items() if v[1] == "fp8"}}
# the all-FP8 experts on the host path they had before ops.mm_fp8_per_expert and
# ops.routing_map_to_topk: the per-expert GEMMs (forward, FP8 dgrad) as a Python loop of
# torch._scaled_mm, the routing map turned into top-k slots by six torch ops; an A/B in one process
OLD_HOST_PATH = "fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad, torch._scaled_mm loop + six-op routing"
VARIANTS[OLD_HOST_PATH] = CPU_VARIANTS[OLD_HOST_PATH] = VARIANTS["fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad"]
# name: (tokens, experts, top-k, hidden, ffn, the rows' kind: table | big)
GPU_SHAPES = {"4096 tok x 8 experts top-8 (EP=32)": (4096, 8, 8, 7168, 2048, "table"),
              "4096 tok x 32 experts top-8 (EP=8)": (4096, 32, 8, 7168, 2048, "table"),
              "4096 tok x 256 experts top-8 (EP=1)": (4096, 256, 8, 7168, 2048, "big")}
CPU_SHAPES = {"64 tok x 4 experts top-2": (64, 4, 2, 128, 64, "table"),
              "64 tok x 16 experts top-2": (64, 16, 2, 128, 64, "big")}


class Variant:
    """A row: `step` (forward + backward, the only thing timed); `prepare` (before every step and
    after each row's turn, untimed but between a burst's steps: the gradients set to None, every row
    alike); `first` (untimed: makes the next step a
    step's first micro-batch, which recasts or rebuilds the cached FP8 weights; None: nothing
    cached); `recasts` (whether the next call would recast TE's FP8 weights; None: no TE linears)."""

    def __init__(self, name, step, prepare=None, first=None, cfg=None, recasts=None):
        self.name, self.step, self.prepare, self.first, self.cfg = name, step, prepare, first, cfg
        self.recasts = recasts
        self.recast_calls = 0  # timed cached calls (after warm-up) in which TE would have recast


def make_layer(shape, dispatcher, experts, recipe, opts, cuda, ep=1):
    """The MoELayer of one row; ep: expert_model_parallel_size (parallel_state must be initialized at
    it: benchmarks/bench_loopback.py --layer builds it on a loopback EP group)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    T, E, K, H, Fh, _ = shape
    te = cuda and experts != "local"  # the TE spec (TEGroupedMLP); else the local one (SequentialMLP)
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=Fh, moe_ffn_hidden_size=Fh,
              num_moe_experts=E, moe_router_topk=K, moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=1e-2,
              moe_router_load_balancing_type="aux_loss", add_bias_linear=False, gated_linear_unit=True,
              activation_func=F.silu, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
              moe_router_dtype="fp32", moe_grouped_gemm=te, moe_permute_fusion=cuda,
              use_cpu_initialization=not cuda, expert_model_parallel_size=ep)
    if recipe:
        kw.update(fp8="e4m3", fp8_recipe=recipe, moe_router_padding_for_quantization=True)
    cfg = TransformerConfig(**kw)
    # the experts named: under a TE FP8 recipe a run that names none gets the FP8 experts
    for k, v in {"bf16_below_bytes": 0, "experts": "fp8" if experts == "fp8" else "megatron", **opts}.items():
        setattr(cfg, "fp8a2a_" + k, v)
    spec = get_moe_module_spec(use_te=te, num_experts=E, moe_grouped_gemm=te)
    if experts == "fp8":
        spec = fm.fp8_experts_spec(spec)
    if not cuda:
        spec = with_portable_router(spec)
    return build_layer(spec, cfg).to("cuda" if cuda else "cpu"), cfg


def layer_variant(name, layer, cfg, x, gy):
    def step():
        xi = x.detach().requires_grad_()
        with fp8_context(cfg):
            y, _ = layer(xi)
        y.backward(gy)

    def prepare():
        layer.zero_grad(set_to_none=True)

    firsts = []
    if cfg.fp8 and hasattr(layer, "set_is_first_microbatch"):  # TE casts its FP8 weights in the first micro-batch
        firsts.append(layer.set_is_first_microbatch)
    if hasattr(layer.experts, "_fp8a2a_impl"):  # FP8 experts: their cached weights dropped, rebuilt by the forward
        firsts.append(lambda: drop_caches(layer.experts))
    first = (lambda: [f() for f in firsts]) if firsts else None
    # the TE linears that run (is_first_microbatch True: the next call casts and caches its FP8
    # weights); the FP8 experts keep Megatron's linear_fc1 / fc2 but never call them
    idle = {id(m) for m in layer.experts.modules()} if hasattr(layer.experts, "_fp8a2a_impl") else set()
    te = [m for m in layer.modules() if hasattr(m, "is_first_microbatch") and id(m) not in idle]
    recasts = (lambda: any(m.is_first_microbatch for m in te)) if te else None
    return Variant(name, step, prepare, first, cfg, recasts)


def with_old_host_path(step):
    """step on OLD_HOST_PATH's host path (the functions patched in for its calls only)."""
    from fp8a2a import experts, reference
    from fp8a2a.megatron import dispatcher

    def run():
        saved = experts._mm_fp8_per_expert, dispatcher.routing_map_to_topk
        experts._mm_fp8_per_expert = reference.mm_fp8_per_expert_reference
        dispatcher.routing_map_to_topk = reference.routing_map_to_topk_reference
        try:
            step()
        finally:
            experts._mm_fp8_per_expert, dispatcher.routing_map_to_topk = saved
    return run


def grouped_mlp_variants(shape, layer, x, gy, cuda):
    """FP8GroupedMLP on fp8a2a's Dispatcher with the FP8 experts layer's router and expert weights
    (the layer's expert parameters become views of the [E, out, in] weights both use)."""
    T, E, K, H, Fh, _ = shape
    stacks = []
    for ps in layer.experts._expert_params():
        w = torch.nn.Parameter(torch.stack([p.detach() for p in ps]))
        for i, p in enumerate(ps):
            p.data = w.data[i]
        stacks.append(w)
    disp = fp8a2a.Dispatcher(E, config=fp8a2a.DispatcherConfig(bf16_below_bytes=0))
    router = layer.router.weight
    out = []
    for suffix, opts in OPTIONS.items():
        mlp = fp8a2a.FP8GroupedMLP(E, H, Fh, device="meta", **opts)
        mlp.fc1_weight, mlp.fc2_weight = stacks

        def step(mlp=mlp):
            xi = x.detach().requires_grad_()
            x2 = xi.reshape(-1, H)
            logits = F.linear(x2.float(), router.float())
            val, idx = logits.topk(K, dim=1)
            o = disp.dispatch(x2, idx, torch.softmax(val, dim=1))
            h = mlp(o.tokens, o.tokens_per_expert, router_weights=o.weights)
            disp.combine(h, o.handle, apply_weights=False).view(x.shape).backward(gy)

        def prepare():
            for p in stacks + [router]:
                p.grad = None

        def first():
            for w in stacks:
                w.__dict__.pop("_fp8a2a_cache", None)
        out.append(Variant(f"FP8GroupedMLP on Dispatcher{suffix}", step, prepare, first))
    return out


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def timed_ms(fn, cuda, drain=True):
    """ms of fn(): CUDA events around it (perf_counter off CUDA), from an idle GPU unless not drain
    (then from where the work already queued ends)."""
    if drain:
        sync(cuda)
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def timed_call(v, cuda, first=False, count=False):
    """ms of one v.step (a step's first micro-batch with first=True); prepare / first run untimed."""
    if v.prepare is not None:
        v.prepare()
    if first:
        v.first()
    elif count and v.recasts is not None and v.recasts():
        v.recast_calls += 1
    return timed_ms(v.step, cuda)


def prepared_step(v):
    """One step of v after its prepare (the gradients set to None): a burst's step."""
    if v.prepare is not None:
        v.prepare()
    v.step()


def timed_burst(v, cuda, n=BURST, count=False):
    """ms per step of n cached steps launched back to back behind one untimed step, as a training loop
    runs the micro-batches after a step's first: no sync between them (prepare before each sets the
    gradients to None, host work only), so the host's launches up to the dispatch's sync overlap the
    previous step's device work, as they overlap the layers before it in a model. The events time
    from the end of the untimed step on the device (or from the first timed launch, where the device
    had already finished it) to the end of the last.
    count: the timed steps are counted in v.recast_calls where a step after prepare would recast TE's
    weights, checked after the burst (outside the timed region: every step of it starts that way)."""
    sync(cuda)
    prepared_step(v)  # untimed: the first of the timed steps is launched behind it, as the rest
    ms = timed_ms(lambda: [prepared_step(v) for _ in range(n)], cuda, drain=False) / n
    if count and v.recasts is not None:
        if v.prepare is not None:
            v.prepare()
        if v.recasts():
            v.recast_calls += n
    return ms


def time_group(variants, iters, warmup, cuda, burst=BURST):
    """({name: [ms per cached call]}, {name: [first micro-batch ms - cached ms, per iteration]},
    {name: [ms per step of a back-to-back burst of `burst` steps]: empty for burst=0}, {name: error}):
    fwd+bwd, the variants interleaved in rotating order, each row's first-micro-batch call right after
    its cached one, then its burst; a variant that raises is dropped from the group with its error."""
    times, quant, bursts = ({v.name: [] for v in variants} for _ in range(3))
    failed = {}
    for it in range(warmup + iters):
        live = [v for v in variants if v.name not in failed]
        shift = it % max(1, len(live))
        for v in live[shift:] + live[:shift]:
            try:
                ms = timed_call(v, cuda, count=it >= warmup)
                first_ms = timed_call(v, cuda, first=True) if v.first is not None else ms
                burst_ms = timed_burst(v, cuda, burst, count=it >= warmup) if burst else None
            except Exception as e:  # noqa: BLE001  (one row fails, the table goes on)
                failed[v.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            else:
                if it >= warmup:
                    times[v.name].append(ms)
                    quant[v.name].append(first_ms - ms)
                    if burst:
                        bursts[v.name].append(burst_ms)
            if v.prepare is not None:  # its gradients freed before the next row runs: the rows timed
                v.prepare()            # together do not all hold theirs (32 experts: 2.8 GB a row)
    return times, quant, bursts, failed


def refresh_ms(v, cuda, fwd_bwd_ms, n=3):
    """Median ms a step's first micro-batch (v.first, then a step) takes over fwd_bwd_ms (0: nothing
    cached); benchmarks/bench_loopback.py --layer's quant/step (this file pairs them per iteration)."""
    if v.first is None:
        return 0.0
    return max(0.0, statistics.median(timed_call(v, cuda, first=True) for _ in range(n)) - fwd_bwd_ms)


def drop_caches(*modules):
    for m in modules:
        for p in m.parameters():
            p.__dict__.pop("_fp8a2a_cache", None)


SPEC = "fp8_alltoall + fp8_experts_spec"


def build_groups(shape, args, cuda, x, gy, rows, keep):
    """[(FP8 experts options to set first or None, [Variant])]: the variants timed together."""
    if shape[-1] == "table":
        vs, router = [], None
        for vname, (disp, experts, recipe, opts) in (CPU_VARIANTS if args.cpu else VARIANTS).items():
            if args.match and not re.search(args.match, vname) and vname != BASELINE:
                continue
            try:
                layer, cfg = make_layer(shape, disp, experts, recipe, opts, cuda)
                router = layer.router.weight.detach().clone() if router is None else router
                with torch.no_grad():
                    layer.router.weight.copy_(router)  # one routing for every row
                vs.append(layer_variant(vname, layer, cfg, x, gy))
                if vname == OLD_HOST_PATH:
                    vs[-1].step = with_old_host_path(vs[-1].step)
                keep.append(layer)
            except Exception as e:  # noqa: BLE001
                rows[vname] = {"error": f"failed: {type(e).__name__}: {e}"[:300]}
        return [(None, vs)]
    # 256 experts, per option: fp8_experts_spec and FP8GroupedMLP (same weights), caches dropped between
    layer, cfg = make_layer(shape, "fp8_alltoall", "fp8", None, {}, cuda)
    keep.append(layer)
    spec = layer_variant(SPEC, layer, cfg, x, gy)
    refs = grouped_mlp_variants(shape, layer, x, gy, cuda)
    return [(opts, [Variant(SPEC + suffix, spec.step, spec.prepare, spec.first, cfg, spec.recasts), ref])
            for (suffix, opts), ref in zip(OPTIONS.items(), refs)]


# cuBLAS's FP8 GEMMs on Hopper (its kernel names; elsewhere no rate is reported): in the FP8 experts'
# rows, their per-expert GEMMs (the wgrad's; the forward's and dgrad's on large groups)
FP8_CUBLAS = re.compile(r"nvjet_sm90_qq")


def profile_row(v, steps=1, burst=0):
    """Where one cached step of v goes (costs.profile_call, prepare outside the profile; the first of
    `steps` profiled steps in detail, busy and cuBLAS FP8 GEMM time of each), and the device time a
    step's first micro-batch adds (its busy time less the cached step's: the weight cast on the
    device, without the host gaps a wall-time difference hides it in); burst > 0: also 1 + burst
    cached steps profiled back to back as timed_burst runs them, where their device idles (the
    first step's from an idle GPU included); None off CUDA."""
    cs = [costs.profile_call(lambda _: v.step(), setup=v.prepare) for _ in range(steps)]
    c = cs[0]
    if c is None:
        return None
    classes = costs.by_class(c["busy_us_by_op"])
    out = {"busy_ms": c["busy_us"] / 1e3, "by_class_ms": {k: us / 1e3 for k, us in classes.items()},
           "syncs": c["syncs"], "sync_calls": c["sync_calls"], "d2h": c["d2h"], "kernels": c["kernels"],
           "span_ms": c["span_us"] / 1e3, "gaps": c["gaps"],
           "top_ms": [(op, us / 1e3) for op, us in costs.top_ops(c["busy_us_by_op"], 6)],
           "busy_runs_ms": [x["busy_us"] / 1e3 for x in cs], "span_runs_ms": [x["span_us"] / 1e3 for x in cs],
           "fp8_cublas_runs_ms": [sum(us for op, us in x["busy_us_by_op"].items() if FP8_CUBLAS.search(op)) / 1e3
                                  for x in cs]}
    if burst:
        b = costs.profile_call(lambda: [prepared_step(v) for _ in range(1 + burst)], warmup=0)
        out["burst"] = {"steps": 1 + burst, "span_ms": b["span_us"] / 1e3, "busy_ms": b["busy_us"] / 1e3,
                        "idle_by_pair": b["idle_by_pair"]}
    if v.first is not None:
        def first_microbatch():
            if v.prepare is not None:
                v.prepare()
            v.first()
        f = costs.profile_call(lambda _: v.step(), setup=first_microbatch)
        out["first_busy_ms"] = f["busy_us"] / 1e3
        out["first_extra_busy_ms"] = (f["busy_us"] - c["busy_us"]) / 1e3
        # the added kernels' own time, whether or not they overlap other work
        out["first_extra_kernel_ms"] = (sum(f["busy_us_by_op"].values()) - sum(c["busy_us_by_op"].values())) / 1e3
    return out


def summarize(v, runs):
    """runs: [(times, quant, bursts, failed)] of time_group. fwd_bwd_ms: the cached per-micro-batch
    step; refresh_ms: weight quantization per optimizer step (median over runs of the per-run median of
    the paired first-micro-batch minus cached differences, floored at 0), both from the same calls;
    back_to_back_ms: the cached step in back-to-back bursts (timed_burst)."""
    fails = [f[v.name] for *_, f in runs if v.name in f]
    if fails:
        return {"error": fails[0]}
    meds = [statistics.median(t[v.name]) for t, *_ in runs]
    qmeds = [statistics.median(q[v.name]) for _, q, *_ in runs]
    bmeds = [statistics.median(b[v.name]) for _, _, b, _ in runs if b[v.name]]
    r = {"fwd_bwd_ms": statistics.median(meds), "run_medians_ms": meds, "runs_min_ms": min(meds),
         "runs_max_ms": max(meds), "iter_min_ms": min(min(t[v.name]) for t, *_ in runs),
         "iter_max_ms": max(max(t[v.name]) for t, *_ in runs), "_runs": [t[v.name] for t, *_ in runs],
         **({"back_to_back_ms": statistics.median(bmeds), "back_to_back_run_medians_ms": bmeds,
             "_bursts": [b[v.name] for _, _, b, _ in runs]} if bmeds else {}),
         "refresh_ms": max(0.0, statistics.median(qmeds)) if v.first is not None else 0.0,
         "refresh_run_medians_ms": qmeds if v.first is not None else [], "te_recast_calls": v.recast_calls}
    r["step_ms"] = {str(n): r["fwd_bwd_ms"] + r["refresh_ms"] / n for n in MICRO_BATCHES}
    return r


def run_shape(name, shape, args, cuda):
    T, E, K, H, Fh, kind = shape
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if cuda else "cpu"
    x = torch.randn(T, 1, H, generator=g).to(dev, torch.bfloat16)
    gy = (torch.randn(T, 1, H, generator=g) * 0.01).to(dev, torch.bfloat16)
    rows, keep = {}, []
    groups = build_groups(shape, args, cuda, x, gy, rows, keep)
    iters = args.iters if kind == "table" else args.big_iters
    for opts, vs in groups:
        if opts is not None:  # the FP8 experts layer of the 256-expert shape, with these options
            drop_caches(*keep)
            impl = keep[0].experts._fp8a2a_impl
            impl.fp8_dgrad, impl.fp8_wgrad = opts.get("fp8_dgrad", False), opts.get("fp8_wgrad", False)
        # no bursts at 256 experts: between steps, inside the timing, the spec row would clear 513
        # gradients and FP8GroupedMLP 3
        burst = args.burst if kind == "table" else 0
        runs = [time_group(vs, iters, args.warmup, cuda, burst) for _ in range(args.repeat)]
        rows.update({v.name: summarize(v, runs) for v in vs})
        for v in vs if args.profile and cuda else ():
            if "error" not in rows[v.name]:
                rows[v.name]["profile"] = p = profile_row(v, args.repeat, burst)
                if v.prepare is not None:
                    v.prepare()
                if p and v.cfg is not None and getattr(v.cfg, "fp8a2a_experts", None) == "fp8" and \
                        all(p["fp8_cublas_runs_ms"]):
                    # cuBLAS's FP8 GEMMs in the step, one per expert: the FP8 wgrad's, and from
                    # dense_min_rows_per_expert rows per expert the forward's and the FP8 dgrad's;
                    # each pass 2 * rows * (fc1 + fc2 weights) of useful work, every routed row
                    # once (no capacity drop in these rows)
                    dense = fp8a2a.experts._dense_per_expert(fp8a2a.ExpertsConfig(), (T * K // E,) * E,
                                                             torch.device("cuda"), T * K, H, Fh)
                    gemms = [n for n, on in (("forward", dense), ("dgrad", dense and getattr(v.cfg, "fp8a2a_fp8_dgrad", False)),
                                             ("wgrad", getattr(v.cfg, "fp8a2a_fp8_wgrad", False))) if on]
                    flop = 2 * T * K * H * (2 * Fh + Fh) if v.cfg.gated_linear_unit else 2 * T * K * H * 2 * Fh
                    if gemms:
                        p["cublas_fp8_gemms"] = gemms
                        p["cublas_fp8_tflops_runs"] = [len(gemms) * flop / ms / 1e9 for ms in p["fp8_cublas_runs_ms"]]
    for vname, r in rows.items():  # ratios per run, then their median
        if kind == "table":
            base_name = BASELINE
        else:
            base_name = "FP8GroupedMLP on Dispatcher" + vname[len(SPEC):] if vname.startswith(SPEC) else None
        base = rows.get(base_name) if base_name else None
        if "error" not in r and base and "error" not in base:
            for key, runs_key in (("ratio", "_runs"), ("back_to_back_ratio", "_bursts")):
                if runs_key not in r or runs_key not in base:
                    continue
                per_run = [statistics.median(a) / statistics.median(b) for a, b in zip(r[runs_key], base[runs_key])]
                r[key], r[key + "_min"], r[key + "_max"] = statistics.median(per_run), min(per_run), max(per_run)
            r["ratio_vs"] = base_name
    for r in rows.values():
        r.pop("_runs", None)
        r.pop("_bursts", None)
    del keep, groups
    if cuda:
        torch.cuda.empty_cache()
    return {"shape": name, "tokens": T, "experts": E, "topk": K, "hidden": H, "ffn": Fh, "rows": rows}


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def format_table(res):
    out = []
    for s in res["shapes"]:
        out.append(f"\n## {s['shape']} (hidden {s['hidden']}, ffn {s['ffn']}), fwd+bwd ms")
        out.append(f"{'variant':<48} {'median':>8} {'runs min-max':>15} {'ratio':>7} {'quant/step':>10} "
                   + " ".join(f"{'step/' + str(n):>8}" for n in MICRO_BATCHES)
                   + f" {'b2b':>8} {'b2b ratio [min-max]':>21}")
        for name, r in s["rows"].items():
            if "error" in r:
                out.append(f"{name:<48} {r['error']}")
                continue
            st = r.get("step_ms", {})
            out.append(f"{name:<48} {fmt(r['fwd_bwd_ms']):>8} {fmt(r['runs_min_ms']) + '-' + fmt(r['runs_max_ms']):>15} "
                       f"{fmt(r.get('ratio'), '.3f'):>7} {fmt(r.get('refresh_ms')):>10} "
                       + " ".join(f"{fmt(st.get(str(n))):>8}" for n in MICRO_BATCHES)
                       + f" {fmt(r.get('back_to_back_ms')):>8} "
                       + (f"{r['back_to_back_ratio']:.3f} [{r['back_to_back_ratio_min']:.3f}-"
                          f"{r['back_to_back_ratio_max']:.3f}]" if "back_to_back_ratio" in r else "-").rjust(21))
    for s in res["shapes"]:
        profiled = {n: r["profile"] for n, r in s["rows"].items() if r.get("profile")}
        if profiled:
            out.append(f"\n## {s['shape']}: one cached step profiled, busy device ms by kernel class")
            classes = next(iter(profiled.values()))["by_class_ms"]
            out.append(f"{'variant':<48} {'busy':>7} " + " ".join(f"{k:>10.10}" for k in classes) + "  syncs d2h")
            for name, p in profiled.items():
                out.append(f"{name:<48} {p['busy_ms']:>7.2f} "
                           + " ".join(f"{ms:>10.2f}" for ms in p["by_class_ms"].values())
                           + f"  {p['syncs']:>5} {p['d2h']:>3}")
                out.append("    top: " + ", ".join(f"{op[:40]} {ms:.2f}" for op, ms in p["top_ms"]))
                if "first_extra_busy_ms" in p:
                    out.append(f"    a step's first micro-batch: busy {p['first_busy_ms']:.2f} ms, "
                               f"{p['first_extra_busy_ms']:+.2f} ms of device time (the weight cast; its kernels "
                               f"{p['first_extra_kernel_ms']:+.2f} ms, overlapped or not)")
                if "burst" in p:
                    b = p["burst"]
                    out.append(f"    {b['steps']} steps back to back: span {b['span_ms']:.2f} ms, busy {b['busy_ms']:.2f}, "
                               f"idle {(b['span_ms'] - b['busy_ms']) / b['steps']:.2f} ms per step; idle by the "
                               "kernels around it: " + "; ".join(f"{g['us'] / 1e3:.2f} ms in {g['gaps']} "
                                                                 f"{g['before'][:28]} -> {g['after'][:28]}"
                                                                 for g in b["idle_by_pair"][:5]))
                if len(p.get("busy_runs_ms", ())) > 1:
                    out.append(f"    busy over {len(p['busy_runs_ms'])} profiled steps: "
                               f"{statistics.median(p['busy_runs_ms']):.2f} [{min(p['busy_runs_ms']):.2f}-"
                               f"{max(p['busy_runs_ms']):.2f}] ms, span {statistics.median(p['span_runs_ms']):.2f}")
                if p.get("cublas_fp8_tflops_runs"):
                    w = p["cublas_fp8_tflops_runs"]
                    out.append(f"    cuBLAS FP8 GEMMs, one per expert ({' + '.join(p['cublas_fp8_gemms'])}) in the step: "
                               f"{statistics.median(w):.0f} [{min(w):.0f}-{max(w):.0f}] TFLOP/s of useful work")
                out.append(f"    span {p['span_ms']:.2f} ms; longest gaps: " + "; ".join(
                    f"{g['us']:.0f} us {g['before'][:30]} -> {g['after'][:30]} ({' < '.join(h[:50] for h in g['host'])})"
                    for g in p["gaps"][:3]))
    out.append(f"\nratio: against '{BASELINE}' (the 256-expert shape: against FP8GroupedMLP with the same "
               f"options, target <= {TARGET}); median: a cached micro-batch (TE: is_first_microbatch=False, "
               f"grads set to None outside the timed region, every row alike); quant/step: a step's first "
               f"micro-batch minus the cached one, paired per iteration in the same run (TE: after "
               f"set_is_first_microbatch; fp8a2a: its cached FP8 weights dropped); step/n: fwd+bwd + "
               f"quant/step / n micro-batches; b2b: ms per cached step of --burst launched back to back "
               f"(no sync between them, as a training loop runs its micro-batches; grads set to None "
               f"between them inside the timing), its ratio per run.")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU, no TE (functional only)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per variant (default 20; CPU 2)")
    ap.add_argument("--big-iters", type=int, default=None, help="same, 256-expert shape (default 10; CPU 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 3; CPU 1)")
    ap.add_argument("--repeat", type=int, default=1, help="time every shape's table this many times")
    ap.add_argument("--burst", type=int, default=BURST,
                    help=f"cached steps per back-to-back burst in every iteration (default {BURST}; 0: none)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices of the shapes to run (default all)")
    ap.add_argument("--match", default=None,
                    help="a regular expression (re.search; escape the '+' of row names): the 8- and 32-expert "
                         "tables time only the rows whose name it matches, and the baseline (default all)")
    ap.add_argument("--profile", action="store_true", help="then profile --repeat cached steps of every row (CUDA only)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    args.cpu = not cuda
    args.iters = args.iters or (20 if cuda else 2)
    args.big_iters = args.big_iters or (10 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    shapes = list((GPU_SHAPES if cuda else CPU_SHAPES).items())
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    import megatron.core
    fm.register()
    teardown = world_of_one()
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "megatron_core": getattr(megatron.core, "__version__", None), "args": vars(args), "shapes": []}
    try:
        import transformer_engine
        res["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        res["transformer_engine"] = None
    try:
        for name, shape in shapes:
            t0 = time.time()
            res["shapes"].append(run_shape(name, shape, args, cuda))
            res["shapes"][-1]["seconds"] = round(time.time() - t0, 1)
            print(format_table({"shapes": res["shapes"][-1:]}), flush=True)
    finally:
        teardown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
