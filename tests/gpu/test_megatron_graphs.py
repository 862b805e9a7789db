"""fp8_alltoall under Megatron's CUDA graphs (cuda_graph_impl="local") on one GPU, against Megatron's
`alltoall` under the same options: a MoETransformerLayer (attention + MoE, local spec) at world size
one, step 1 eager (Megatron records the graphs), create_cudagraphs() (capture), step 2 replayed
from the graphs on a new input; output, input gradient and every parameter's gradient compared
(main_grad, where the graphs accumulate weight gradients, plus .grad of what ran eagerly). Also
the settings fp8_alltoall refuses (fp8a2a.megatron.dispatcher.check_cuda_graphs): the error names
the option. And fp8_experts_spec's FP8 experts captured in the layer's graph (cuda_graph_modules
[] or ["moe"]: megatron-core 0.19 graphs the whole MoETransformerLayer for both), against the same
layer eager over several optimizer steps (their cached FP8 weights refreshed before each replay),
with a control arm running Megatron's own experts through the same harness. Marked gpu; needs
megatron-core (0.19.2 on the device):

    python -m pytest tests/gpu/test_megatron_graphs.py -m gpu -q
"""
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore")]

import fp8a2a.megatron as fm  # noqa: E402
from fp8a2a.megatron.standalone import build_layer, world_of_one  # noqa: E402

SEQ, MBS, HIDDEN, FFN, EXPERTS, TOPK = 512, 2, 512, 512, 8, 2
RAW = 1 << 40  # bf16_below_bytes: an unquantized wire (must match alltoall to bf16 rounding)
TOL = {"fp8": 0.08, "raw": 0.02}


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    from megatron.core import tensor_parallel
    fm.register()
    teardown = world_of_one()
    # Megatron's local graphs need the graph-safe RNG tracker (what megatron.training sets for them)
    tensor_parallel.model_parallel_cuda_manual_seed(123, use_cudagraphable_rng=True, force_reset_rng=True)
    yield
    teardown()
    fm.unregister()


def make_config(dispatcher, modules, **over):
    from megatron.core.transformer import TransformerConfig
    fp8 = {k: over.pop(k) for k in list(over) if k.startswith("fp8a2a_")}
    if over.get("cuda_graph_impl") == "none":  # the eager reference of a graphed config
        modules = []
    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=FFN,
              num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type=dispatcher,
              moe_aux_loss_coeff=0.0, add_bias_linear=False, gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, bf16=True, params_dtype=torch.bfloat16,
              pipeline_dtype=torch.bfloat16, moe_router_dtype="fp32", hidden_dropout=0.0, attention_dropout=0.0,
              cuda_graph_impl="local", cuda_graph_modules=modules, cuda_graph_warmup_steps=1)
    kw.update(over)
    cfg = TransformerConfig(**kw)
    for k, v in fp8.items():
        setattr(cfg, k, v)
    return cfg


def layer_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer
    return ModuleSpec(module=MoETransformerLayer,
                      submodules=get_gpt_layer_local_submodules(num_experts=EXPERTS, moe_grouped_gemm=False))


def graphed_run(cfg, state=None):
    """Builds the layer (weights from `state` if given), step 1 eager + capture, step 2 replayed
    -> (state_dict, y, x.grad, {name: grad})."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs, delete_cuda_graphs
    delete_cuda_graphs()
    torch.manual_seed(1)
    layer = build_layer(layer_spec(), cfg).cuda().bfloat16()  # as Megatron's Float16Module (torch norms are fp32)
    if state is not None:
        layer.load_state_dict(state)
    for p in layer.parameters():  # the graphs add weight gradients to main_grad (Megatron DDP's)
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    g = torch.Generator(device="cuda").manual_seed(7)
    out = None
    for step in range(2):
        x = torch.randn(SEQ, MBS, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        if step == 0:  # whether the backward capture reuses the released input buffer depends on the
            keep_graph_input(x)  # graph pool's state: the two runs could differ in input_layernorm.weight
        G = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
        for p in layer.parameters():
            p.main_grad.zero_()
            p.grad = None
        y = layer(hidden_states=x, attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        # the output as the forward left it: a replayed backward reuses the graphs' static buffers
        # and overwrote y on the H200 (with alltoall too)
        y_fwd = y.detach().clone()
        (y.float() * G.float()).sum().backward()
        if step == 0:
            create_cudagraphs()
        out = y_fwd, x.grad.detach().clone()
    grads = {}
    for n, p in layer.named_parameters():
        t = p.main_grad.clone()
        if p.grad is not None:
            t += p.grad.float()
        grads[n] = t
    torch.cuda.synchronize()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}  # TE's _extra_state
    result = (state,) + out + (grads,)
    delete_cuda_graphs()
    del layer
    return result


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# (id, cuda_graph_modules, extra config): every local-impl combination fp8_alltoall supports
SUPPORTED = [
    ("router+preprocess-dropless", ["moe_router", "moe_preprocess"], {}),
    ("router-dropless", ["moe_router"], {}),  # local adds moe_preprocess itself
    ("router+preprocess-drop-and-pad", ["moe_router", "moe_preprocess"],
     dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
    ("moe-drop-and-pad", ["moe"], dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
    ("whole-layer-drop-and-pad", [], dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
]


# every scope on the FP8 wire; the unquantized wire where one exists: the capacity mode (drop-and-pad)
# always sends FP8 rows, whatever bf16_below_bytes says
CASES = [(*s, "fp8") for s in SUPPORTED] + [(*s, "raw") for s in SUPPORTED if s[0] == "router+preprocess-dropless"]


@pytest.mark.parametrize("name,modules,over,wire", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_graphed_layer_matches_alltoall(name, modules, over, wire):
    ref = graphed_run(make_config("alltoall", list(modules), **over))
    mine_over = dict(over, **({"fp8a2a_bf16_below_bytes": RAW} if wire == "raw" else {}))
    mine = graphed_run(make_config(fm.FP8_ALLTOALL, list(modules), **mine_over), state=ref[0])
    tol = TOL[wire]
    err = {"y": rel(mine[1], ref[1]), "x.grad": rel(mine[2], ref[2])}
    err.update({n: rel(mine[3][n], ref[3][n]) for n in ref[3] if ref[3][n].norm() > 0})
    assert all(torch.isfinite(v).all() for v in (mine[1], mine[2])), "non-finite output or gradient"
    bad = {k: v for k, v in err.items() if not v <= tol}
    assert not bad, f"{name}/{wire}: relative L2 errors above {tol}: {bad}"


REFUSED = [
    ("whole-layer-dropless", dict(cuda_graph_impl="local", cuda_graph_modules=[]), "cuda_graph_modules"),
    ("moe-drop-and-pad-variable-mode",
     dict(cuda_graph_impl="local", cuda_graph_modules=["moe"], moe_expert_capacity_factor=1.5,
          moe_pad_expert_input_to_capacity=True, fp8a2a_capacity_mode="variable"), "cuda_graph_modules"),
    ("transformer-engine-impl", dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router"]),
     "cuda_graph_impl"),
    ("full-iteration-impl", dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]), "cuda_graph_impl"),
]


@pytest.mark.parametrize("name,over,option", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_settings_name_the_option(name, over, option):
    over = dict(over)
    modules = over.pop("cuda_graph_modules")
    with pytest.raises(ValueError, match=option):
        build_layer(layer_spec(), make_config(fm.FP8_ALLTOALL, modules, **over)).cuda().bfloat16()


# ---- FP8 experts (fp8_experts_spec) under the graphs, over several optimizer steps ----------------

STEPS = 4  # step 0 eager (recorded, then captured), steps 1.. replayed, each after an optimizer step
# graphed against eager at the same weights (the optimizer steps are teacher-forced, below): the same
# kernels on the same values, so ~0 where every kernel is deterministic (the local spec); TE's fused
# attention backward may accumulate with atomics (NVTE_ALLOW_NONDETERMINISTIC_ALGO), ~1e-3 at most
STEP_TOL = 0.03
MOVE = 0.2  # each parameter moves this fraction of its norm per step: a stale FP8 weight is far off


def seed_rng(te):
    """The RNG tracker Megatron's training sets for local CUDA graphs: TE's (TECudaRNGStatesTracker,
    megatron.training forces te_rng_tracker with TE modules under graphs; TE's attention asserts it
    while capturing) for the TE spec, else Megatron's graph-safe one (the module fixture's)."""
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(123, te_rng_tracker=te, use_cudagraphable_rng=True,
                                                    force_reset_rng=True)


def layer_spec_of(te, fp8_experts):
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_submodules,
                                                          get_gpt_layer_with_transformer_engine_submodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer
    subs = (get_gpt_layer_with_transformer_engine_submodules(num_experts=EXPERTS, moe_grouped_gemm=True) if te
            else get_gpt_layer_local_submodules(num_experts=EXPERTS, moe_grouped_gemm=False))
    spec = ModuleSpec(module=MoETransformerLayer, submodules=subs)
    return fm.fp8_experts_spec(spec) if fp8_experts else spec


def keep_graph_input(x):
    """Works around megatron-core 0.19's local graphs (with TE installed) releasing a graph's input
    buffer to the graph pool right after the forward capture (_weakref_forward_buffers), unless a
    Python autograd Function saved it for backward (its save_for_backward observer). The local
    spec's input_layernorm is torch.nn.LayerNorm, whose native autograd saves the layer input
    unobserved: the backward capture then reuses that buffer (the output-gradient buffer, same
    shape), and every replayed backward computes the LayerNorm's weight gradient (and its part of
    x.grad) from G instead of x (bias gradient unaffected). Eager it does not show; graphed against
    graphed (the alltoall test above) it showed once in a full run, the reference and the fp8_alltoall
    run apart in input_layernorm.weight alone (whether the buffer is reused depends on the graph
    pool's state), so that test applies it too. Marking the input as Megatron's observer would (TE's
    LayerNormLinear does it in the TE spec) keeps the buffer until the backward capture is done."""
    from megatron.core.transformer import cuda_graphs
    tag = getattr(cuda_graphs, "_tag_cudagraph_buffer_saved_for_backward", None)
    if tag is not None:
        tag(x)
    return x


def train(cfg, spec, graphed, state=None, lrs=None, forced=None):
    """STEPS optimizer steps of one micro-batch (the same input every step, so only the weights
    change the output), as Megatron's mixed precision does them: gradients (main_grad + .grad) onto
    fp32 main params, torch SGD steps them (torch's step hooks fire there), then the BF16 params are
    written from them through .data (no version bump). lrs (one per parameter) default to moving each
    parameter MOVE of its norm on step 0. forced: the per-step gradients the optimizer takes instead
    of this run's own (the eager reference's: both runs then hold the same weights at every step, so
    a difference cannot compound through the steps or flip a routing decision; this run's own
    gradients are still what is returned and compared). Graphed: step 0 records,
    create_cudagraphs() after its backward (as Megatron's schedule), later steps replay. -> (state
    at build, lrs, [per step: y - x, x.grad, {name: grad}], the experts' class name)."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs, delete_cuda_graphs
    delete_cuda_graphs()
    torch.manual_seed(1)
    layer = build_layer(spec, cfg).cuda().bfloat16()
    if state is not None:
        layer.load_state_dict(state)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    names, params = zip(*layer.named_parameters())
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    main = [p.detach().float().clone() for p in params]
    g = torch.Generator(device="cuda").manual_seed(7)
    x0 = torch.randn(SEQ, MBS, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    G = torch.randn(x0.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    opt, out = None, []
    for step in range(STEPS):
        for p in params:
            p.main_grad.zero_()
            p.grad = None
        x = x0.clone().requires_grad_()
        if graphed and step == 0:
            keep_graph_input(x)
        y = layer(hidden_states=x, attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        d = (y.detach().float() - x0.float()).clone()  # before the backward (graph buffers are reused)
        (y.float() * G.float()).sum().backward()
        grads = {n: p.main_grad + (p.grad.float() if p.grad is not None else 0) for n, p in zip(names, params)}
        out.append((d, x.grad.detach().float().clone(), grads))
        if graphed and step == 0:
            create_cudagraphs()  # after the step's backward, before its optimizer step (Megatron's order)
        step_grads = grads if forced is None else forced[step][2]
        if opt is None:
            if lrs is None:
                lrs = [(MOVE * m.norm() / step_grads[n].norm()).item() if step_grads[n].norm() > 0 else 0.0
                       for n, m in zip(names, main)]
            opt = torch.optim.SGD([{"params": [m], "lr": lr} for m, lr in zip(main, lrs)], lr=0.0)
        for n, m in zip(names, main):
            m.grad = step_grads[n]
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, main):
                p.data.copy_(m)
    torch.cuda.synchronize()
    experts = type(layer.mlp.experts).__name__
    delete_cuda_graphs()
    del layer
    return state, lrs, out, experts


GRAPHED_FP8_EXPERTS = [("moe-drop-and-pad", ["moe"]), ("whole-layer-drop-and-pad", [])]
# (experts, fp8_dgrad): the CONTROL first (Megatron's own experts, the same harness, graphs and
# steps: if it fails, the harness or Megatron's graphs are at fault, not the FP8 experts), then the
# FP8 experts with either dgrad
EXPERT_ARMS = [("megatron-control", False), ("fp8-bf16-dgrad", False), ("fp8-fp8-dgrad", True)]
# The local spec only: under the TE spec the control arm (Megatron's own experts) also ends with a
# non-finite input gradient at step 3 of these large steps, so there the harness cannot tell
# fp8a2a's experts apart (te=True stays wired for a harness that can).
FP8_CASES = [(n, m, te, e, dg) for n, m in GRAPHED_FP8_EXPERTS for te in (False,) for e, dg in EXPERT_ARMS]


@pytest.mark.parametrize("name,modules,te,arm,fp8_dgrad", FP8_CASES,
                         ids=[f"{c[0]}-{'te' if c[2] else 'local'}-spec-{c[3]}" for c in FP8_CASES])
def test_graphed_fp8_experts_follow_optimizer_steps(name, modules, te, arm, fp8_dgrad):
    """FP8 experts captured in Megatron's graphs against the same layer eager, step by step over
    STEPS optimizer steps: the layer's output (less its input), the input gradient and every
    parameter's gradient, at the same weights every step (teacher-forced optimizer steps). Each step
    moves every parameter MOVE of its norm, so the output moves far more than STEP_TOL per step
    (checked): FP8 weights (or the BF16 / transposed copies the backward reads) stale by one step
    fail. The megatron-control arm runs Megatron's experts through the same harness."""
    if te:
        pytest.importorskip("transformer_engine")  # after torch (imported above), as TE needs
    fp8_experts = arm != "megatron-control"
    over = dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True, fp8a2a_fp8_dgrad=fp8_dgrad,
                **({"moe_grouped_gemm": True} if te else {}))
    spec = layer_spec_of(te, fp8_experts)
    seed_rng(te)
    try:
        state, lrs, ref, ref_experts = train(make_config(fm.FP8_ALLTOALL, list(modules), cuda_graph_impl="none",
                                                         **over), spec, graphed=False)
        seed_rng(te)
        _, _, mine, experts = train(make_config(fm.FP8_ALLTOALL, list(modules), **over), spec, graphed=True,
                                    state=state, lrs=lrs, forced=ref)
    finally:
        seed_rng(False)  # the module fixture's tracker, for whatever runs next
    want = {(True, True): "FP8TEGroupedMLP", (True, False): "FP8SequentialMLP",
            (False, True): "TEGroupedMLP", (False, False): "SequentialMLP"}[fp8_experts, te]
    assert experts == ref_experts == want, f"experts built: graphed {experts}, eager {ref_experts}, expected {want}"
    for step in range(1, STEPS):
        moved = rel(ref[step][0], ref[step - 1][0])
        assert moved > 3 * STEP_TOL, f"step {step}: the output moved only {moved:.3f}: staleness would not show"
    bad, worst = {}, (0.0, None)
    for step, ((d, gx, grads), (rd, rgx, rgrads)) in enumerate(zip(mine, ref)):
        assert torch.isfinite(d).all() and torch.isfinite(gx).all(), f"step {step}: non-finite output or gradient"
        err = {"y-x": rel(d, rd), "x.grad": rel(gx, rgx)}
        err.update({n: rel(grads[n], rgrads[n]) for n in rgrads if rgrads[n].norm() > 0})
        for k, v in err.items():
            if not v <= STEP_TOL:
                bad[f"step {step} {k}"] = round(v, 4)
            if v > worst[0] or v != v:
                worst = (v, f"step {step} {k}")
    who = ("CONTROL (Megatron's experts) fails: the harness or Megatron's graphs are at fault, not the FP8 "
           "experts" if not fp8_experts else f"FP8 experts ({arm}); compare this case's megatron-control")
    assert not bad, (f"{name}/{'te' if te else 'local'}-spec: {who}: graphed against eager at the same weights, "
                     f"relative L2 errors above {STEP_TOL} ({len(bad)}; worst {worst[1]}: {worst[0]:.4g}): {bad}")
