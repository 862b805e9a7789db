"""fp8a2a.megatron against real megatron-core (0.16.1 in CI) on 1, 2 and 4 gloo ranks.

Reference: the same MoELayer (router, experts, weights, inputs) with Megatron's own `allgather`
dispatcher, which runs on CPU (Megatron's `alltoall` needs CUDA streams;
tests/gpu/test_megatron_gpu.py compares with it on a GPU). Unquantized (BF16 fallback wire) runs must
match it to float32 rounding; FP8 runs stay within the e4m3 bound of their path (tests/fp8_bounds.py).
Megatron assumes CUDA in two places on CPU, worked around in fp8a2a.megatron.standalone (plain-torch
router gating; CPU current_device in the child processes)."""
import argparse
import functools
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.utils import make_viewless_tensor

from fp8a2a import ops
from fp8a2a.reference import routing_map_to_topk_reference
import fp8a2a.megatron as fm
from fp8a2a.megatron.dispatcher import FP8AlltoAllTokenDispatcher, routing_map_to_topk
from fp8a2a.megatron.standalone import cpu_current_device, with_portable_router

from .distributed import run_ranks
from .fp8_bounds import BLOCKS, E4M3, FP8_EXPERTS, WIRE, bound, small_block_error

HAVE_FP8_EXPERTS = os.path.exists(os.path.join(os.path.dirname(fm.__file__), "..", "experts.py"))
RAW = 1 << 40  # bf16_below_bytes that keeps every dispatch unquantized


@pytest.fixture(autouse=True, scope="module")
def registered():
    fm.register()
    yield
    fm.unregister()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_config(dispatcher, **over):
    fp8 = {k: over.pop(k) for k in list(over) if k.startswith("fp8a2a_")}
    kw = dict(num_layers=1, hidden_size=128, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=8,
              moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
              activation_func=F.silu, moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher)
    kw.update(over)
    cfg = TransformerConfig(**kw)
    for k, v in fp8.items():
        setattr(cfg, k, v)
    return cfg


def moe_spec(num_experts, fp8_experts=False):
    spec = with_portable_router(get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False))
    return fm.fp8_experts_spec(spec) if fp8_experts else spec


def build(spec, cfg):
    if isinstance(spec, functools.partial):  # megatron-core >= 0.19 builders
        return spec(config=cfg)
    return build_module(spec, config=cfg)


def init_parallel(ep, etp=1):
    cpu_current_device()
    ps.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 create_gloo_process_groups=False)


# ---- the layer against Megatron's allgather dispatcher ------------------------------------------

EXACT = {"y": 1e-5, "x.grad": 1e-5, "router": 1.5e-5, "experts": 1e-5}  # float32 rounding
BASE = dict(hidden=128, experts=8, topk=2, seq=6, batch=2, dtype=torch.float32, tol=EXACT, fp8=False)
CASES = {
    # unquantized wire: must equal allgather to float32 rounding
    "raw": dict(),
    "capacity_drop": dict(config=dict(moe_expert_capacity_factor=0.5)),  # router-side dropping
    "drop_and_pad_variable": dict(config=dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True,
                                              fp8a2a_capacity_mode="variable")),
    "pad_beyond_tokens_variable": dict(config=dict(moe_expert_capacity_factor=4.0,
                                                   moe_pad_expert_input_to_capacity=True,
                                                   fp8a2a_capacity_mode="variable")),
    "shared_experts": dict(config=dict(moe_shared_expert_intermediate_size=96)),
    "router_options": dict(config=dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                       moe_router_topk_scaling_factor=2.0, moe_router_load_balancing_type="seq_aux_loss",
                                       moe_aux_loss_coeff=0.01)),
    "topk1_gelu": dict(topk=1, config=dict(gated_linear_unit=False, activation_func=F.gelu, moe_aux_loss_coeff=0.01,
                                          moe_router_pre_softmax=True)),
    "e16_k4": dict(experts=16, topk=4),
    # FP8 wire (row / block128 / tensor scales), Megatron's experts on dequantized rows
    "fp8_row": dict(fp8=True, tol=WIRE),
    "fp8_block128": dict(fp8=True, tol=WIRE, config=dict(fp8a2a_granularity="block128"), **BLOCKS),
    "fp8_tensor": dict(fp8=True, tol=WIRE, config=dict(fp8a2a_granularity="tensor")),
    # WIRE + the expert outputs on the combine's wire (y) + the row gradients on the dispatch backward's (x.grad)
    "fp8_all_directions": dict(fp8=True, tol=bound(2, 3, 2, 2), config=dict(fp8a2a_fp8_combine=True,
                                                                             fp8a2a_fp8_dispatch_backward=True)),
    "fp8_bf16": dict(fp8=True, tol=WIRE, dtype=torch.bfloat16, config=dict(params_dtype=torch.bfloat16, bf16=True)),
    # drop-and-pad -> fp8a2a's capacity mode (always FP8 on the wire; static rows per expert)
    "drop_and_pad": dict(fp8=True, tol=WIRE, static_rows=0.5,
                         config=dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)),
    "pad_beyond_tokens": dict(fp8=True, tol=WIRE, static_rows=4.0,
                              config=dict(moe_expert_capacity_factor=4.0, moe_pad_expert_input_to_capacity=True)),
    "capacity_static": dict(fp8=True, tol=WIRE, static_rows=0.5,
                            config=dict(moe_expert_capacity_factor=0.5, fp8a2a_capacity_mode="static")),
}
# moe_router_padding_for_quantization (set after construction: megatron-core refuses fp8 configs
# without TransformerEngine): every local expert's rows a multiple of 16; results unchanged
PAD = dict(fp8="e4m3", moe_router_padding_for_quantization=True)
CASES["pad_for_quantization"] = dict(after=PAD, align=16)
CASES["pad_for_quantization_fp8"] = dict(fp8=True, tol=WIRE, after=PAD, align=16)
CASES["pad_for_quantization_drop_and_pad"] = dict(
    fp8=True, tol=WIRE, after=PAD, align=16,
    config=dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True))
if HAVE_FP8_EXPERTS:
    CASES["fp8_experts"] = dict(fp8=True, tol=FP8_EXPERTS, fp8_experts=True)
    # FP8_EXPERTS less gy (a BF16 combine backward); the experts quantize x themselves
    CASES["fp8_experts_raw_wire"] = dict(fp8=False, tol=bound(4, 2, 2, 3), fp8_experts=True)
    # FP8_EXPERTS + 2 per FP8 dgrad (dY times W's scales, per row): fc2's (x.grad, router, dW1), fc1's (x.grad)
    CASES["fp8_experts_fp8_dgrad"] = dict(fp8=True, tol=bound(4, 7, 5, 5), fp8_experts=True,
                                          config=dict(fp8a2a_fp8_dgrad=True))
    # + 2 per FP8 wgrad (both operands per column): dW1 5 + 2
    CASES["fp8_experts_fp8_dgrad_wgrad"] = dict(fp8=True, tol=bound(4, 7, 5, 7), fp8_experts=True,
                                                config=dict(fp8a2a_fp8_dgrad=True, fp8a2a_fp8_wgrad=True))
    # not padded; config.fp8 set: the FP8 dgrad and wgrad by default (options.recipe_gradients)
    CASES["fp8_experts_pad_for_quantization"] = dict(fp8=True, tol=bound(4, 7, 5, 7), fp8_experts=True,
                                                     after=PAD)
    # the same from the plain spec: under a TE FP8 recipe the experts default to fp8a2a's (options.recipe_experts)
    CASES["recipe_picks_fp8_experts"] = dict(fp8=True, tol=bound(4, 7, 5, 7), recipe_experts=True, after=PAD)


def inputs(c, rank):
    """A rank's layer input (with BLOCKS: its second 128-block scaled by small_block) and output gradient."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(c["seq"], c["batch"], c["hidden"], generator=g)
    if "small_block" in c:
        x[..., 128:256] *= c["small_block"]
    return x.to(c["dtype"]), torch.randn(x.shape, generator=g).to(c["dtype"])


def above(errors, tol):
    """The errors (y, x.grad, each parameter's gradient) above their tolerance (bound())."""
    kind = {"y": "y", "x.grad": "x.grad"}
    return {k: v for k, v in errors.items() if not v < tol[kind.get(k, "router" if "router" in k else "experts")]}


def layer_scenario(rank, world, case):
    c = {**BASE, **case}
    init_parallel(c.get("ep", world), c.get("etp", 1))
    try:
        over = dict(num_moe_experts=c["experts"], moe_router_topk=c["topk"], hidden_size=c["hidden"],
                    **c.get("config", {}))
        over.setdefault("fp8a2a_bf16_below_bytes", 0 if c["fp8"] else RAW)
        fp8_experts = c.get("fp8_experts", False) or c.get("recipe_experts", False)
        if not fp8_experts:  # Megatron's experts, whatever the recipe would pick
            over.setdefault("fp8a2a_experts", "megatron")
        ref_over = {k: v for k, v in over.items() if not k.startswith("fp8a2a_")}
        torch.manual_seed(1)
        ref = build(moe_spec(c["experts"]), make_config("allgather", **ref_over))
        cfg = make_config(fm.FP8_ALLTOALL, **over)
        for k, v in c.get("after", {}).items():
            setattr(cfg, k, v)
        torch.manual_seed(1)
        mine = build(moe_spec(c["experts"], c.get("fp8_experts", False)), cfg)
        assert isinstance(mine.token_dispatcher, FP8AlltoAllTokenDispatcher)
        if fp8_experts:
            impl = mine.experts._fp8a2a_impl
            recipe = bool(c.get("after", {}).get("fp8"))  # a TE FP8 recipe: FP8 dgrad and wgrad by default
            assert (impl.fp8_dgrad, impl.fp8_wgrad) == (over.get("fp8a2a_fp8_dgrad", recipe),
                                                        over.get("fp8a2a_fp8_wgrad", recipe))
        assert cfg.moe_token_dispatcher_type == fm.FP8_ALLTOALL
        assert mine.token_dispatcher.deliver_fp8 == fp8_experts
        assert list(mine.state_dict()) == list(ref.state_dict())  # same parameters, same checkpoint layout
        mine.load_state_dict(ref.state_dict())

        seen, rows = [], []  # what the experts were given: rows per expert, and the rows

        def hook(module, args):
            seen.append(torch.as_tensor(args[1]).tolist())
            rows.append(args[0])
        mine.experts.register_forward_pre_hook(hook)
        x, G = inputs(c, rank)
        results = []
        for m in (ref, mine):
            xi = x.clone().requires_grad_()
            y, bias = m(xi)
            assert bias is None and y.shape == x.shape and y.dtype == x.dtype
            (y.float() * G.float()).sum().backward()
            results.append((y, xi.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        (y_ref, gx_ref, gp_ref), (y, gx, gp) = results
        errors = {"y": rel(y, y_ref), "x.grad": rel(gx, gx_ref)}
        assert set(gp) == set(gp_ref), (set(gp) ^ set(gp_ref))
        for n in gp_ref:
            errors[n] = rel(gp[n], gp_ref[n])
        bad = above(errors, c["tol"])
        assert not bad, f"rank {rank}: errors above {c['tol']}: {bad}"
        if c["fp8"]:
            assert errors["y"] > 1e-4, "an FP8 case must actually quantize"
        if "align" in c:  # padded for quantization: multiples of the alignment
            assert all(n % c["align"] == 0 for n in seen[0]) and sum(seen[0]) > 0, seen
            assert mine.token_dispatcher._pad_rows is None  # cleared by the combine
        elif "static_rows" in c:  # capacity mode: every local expert gets world x capacity rows
            capacity = -(-c["seq"] * c["batch"] * c["topk"] * c["static_rows"] // c["experts"])
            assert seen == [[int(world * capacity)] * (c["experts"] // c.get("ep", world))], seen
        else:
            assert sum(seen[0]) <= c["seq"] * c["batch"] * c["topk"] * world
        if "small_block" in c:  # what the wire did to the small block of every row the experts got
            every = torch.cat([inputs(c, r)[0].reshape(-1, c["hidden"]) for r in range(world)])
            errors["small block"] = small_block_error(rows[0], every)
        return errors
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_allgather_2_ranks(name):
    run_ranks(2, layer_scenario, CASES[name])


@pytest.mark.parametrize("name", ["raw", "fp8_row", "e16_k4", "drop_and_pad", "drop_and_pad_variable"])
def test_layer_matches_allgather_4_ranks(name):
    run_ranks(4, layer_scenario, CASES[name])


@pytest.mark.parametrize("name", ["raw", "fp8_row", "drop_and_pad"])
def test_expert_tensor_parallel(name):
    """EP=2 x expert-TP=2 on 4 ranks: the exchange runs over the TP x EP group."""
    run_ranks(4, layer_scenario, {**CASES[name], "ep": 2, "etp": 2})


def test_single_rank_layer():
    run_ranks(1, layer_scenario, CASES["fp8_row"])


def test_block128_keeps_the_small_block_that_row_scales_lose():
    """Through the layer, at BLOCKS (hidden 256, one 128-block of every row 1e-6 of the other): a
    row's scale, set by its large block, flushes the small block to zero; block128 gives the small
    block its own scale, within one e4m3 rounding."""
    block = run_ranks(2, layer_scenario, CASES["fp8_block128"])
    row = run_ranks(2, layer_scenario, {**CASES["fp8_row"], **BLOCKS})
    for b, r in zip(block, row):
        assert b["small block"] <= E4M3 and r["small block"] > 0.5, (b["small block"], r["small block"])


def _capacity_scenario(rank, world):
    """Drop-and-pad with the capacity applied by the Dispatcher (the router applies none) and by the
    router (the expert bias keeps it there: the path of every drop-and-pad before the Dispatcher
    took it over): the same outputs and gradients, to the bit."""
    init_parallel(world)
    try:
        over = dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True,
                    moe_router_score_function="sigmoid", fp8a2a_bf16_below_bytes=0)
        torch.manual_seed(1)
        once = build(moe_spec(8), make_config(fm.FP8_ALLTOALL, **over))
        torch.manual_seed(1)
        router = build(moe_spec(8), make_config(fm.FP8_ALLTOALL, moe_router_enable_expert_bias=True, **over))
        torch.manual_seed(1)
        position = build(moe_spec(8), make_config(fm.FP8_ALLTOALL, moe_token_drop_policy="position", **over))
        router.load_state_dict(once.state_dict(), strict=False)  # expert_bias: zeros, the same routing
        d = once.token_dispatcher
        assert not d.router_applies_capacity and not d.strip_capacity_padding and d.capacity_factor == 0.5
        assert once.router.config.moe_expert_capacity_factor is None and once.config.moe_expert_capacity_factor == 0.5
        for layer in (router, position):
            assert layer.token_dispatcher.router_applies_capacity and layer.token_dispatcher.strip_capacity_padding
            assert layer.router.config is layer.config

        maps = []
        preprocess = d.dispatch_preprocess
        d.dispatch_preprocess = lambda h, m, p: (maps.append(m), preprocess(h, m, p))[1]
        x, G = inputs({**BASE}, rank)
        results = []
        for layer in (once, router):
            xi = x.clone().requires_grad_()
            y, _ = layer(xi)
            (y * G).sum().backward()
            results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*results))
        # the router applied no capacity: Megatron's top-k map, more slots than the capacity for some expert
        assert int(maps[0].sum(1).max()) <= 2
        return int(maps[0].sum(0).max()) > -(-12 * 2 * 0.5 // 8)
    finally:
        ps.destroy_model_parallel()


def test_capacity_applied_once_with_the_results_of_the_router_applying_it():
    assert any(run_ranks(2, _capacity_scenario))  # a slot was dropped on some rank


# ---- the six stages as Megatron's combined-1F1B schedule drives them -----------------------------

class _Node:
    """What megatron.core.pipeline_parallel.utils.ScheduleNode does on CPU: detach (viewless) inputs,
    run, optionally free the storage of the inputs it was given, and later backward stage by stage."""

    def __init__(self, fn, free_input):
        self.fn, self.free_input, self.detached, self.before = fn, free_input, (), ()

    def detach(self, t):
        d = make_viewless_tensor(t, requires_grad=t.requires_grad, keep_graph=True).detach()
        d.requires_grad = t.requires_grad
        self.before, self.detached = self.before + (t,), self.detached + (d,)
        return d

    def forward(self, *inputs):
        self.inputs = []
        for e in inputs:
            d = make_viewless_tensor(e, requires_grad=e.requires_grad, keep_graph=True).detach()
            d.requires_grad = e.requires_grad
            self.inputs.append(d)
        out = self.fn(self, *self.inputs)
        self.out = out if isinstance(out, tuple) else (out,)
        if self.free_input:
            for e in inputs:
                e.untyped_storage().resize_(0)
        return out

    def backward(self, *grads):
        outs = [o for o in self.out + self.before]
        grads = list(grads) + [d.grad for d in self.detached]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return tuple(e.grad for e in self.inputs)


def schedule_scenario(rank, world, fp8):
    init_parallel(world)
    try:
        cfg = make_config(fm.FP8_ALLTOALL, fp8a2a_bf16_below_bytes=0 if fp8 else RAW, moe_aux_loss_coeff=0.01)
        torch.manual_seed(1)
        layer = build(moe_spec(8), cfg)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(6, 2, 128, generator=g)
        G = torch.randn(x.shape, generator=g)

        xa = x.clone().requires_grad_()
        y_ref, _ = layer(xa)
        (y_ref * G).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)

        state = {}

        def pre(node, h):  # router + dispatch_preprocess (attention omitted)
            probs, routing_map = layer.route(h)
            return layer.preprocess(h, probs, routing_map)

        def dispatch(node, tokens, probs):
            tokens, probs = layer.dispatch(tokens, probs)
            state["probs"] = node.detach(probs)
            return tokens

        def mlp(node, tokens):
            out, _ = layer.routed_experts_compute(tokens, state["probs"])
            return out

        def combine(node, out):
            return layer.postprocess(layer.combine(out), None)

        nodes = [_Node(pre, False), _Node(dispatch, True), _Node(mlp, True), _Node(combine, True)]
        xb = x.clone().requires_grad_()
        h = nodes[0].forward(xb)
        h = nodes[1].forward(*h)
        h = nodes[2].forward(h)
        y = nodes[3].forward(h)
        assert torch.equal(y, y_ref)
        grads = (G,)
        for node in reversed(nodes):
            grads = node.backward(*grads)
            grads = grads if isinstance(grads, tuple) else (grads,)
        gx = nodes[0].inputs[0].grad
        assert torch.allclose(gx, xa.grad, rtol=1e-5, atol=1e-6), rel(gx, xa.grad)
        for n, p in layer.named_parameters():
            assert torch.allclose(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6), (n, rel(p.grad, ref_grads[n]))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("fp8", [False, True], ids=["raw", "fp8"])
def test_stages_under_a_detaching_freeing_schedule(fp8):
    run_ranks(2, schedule_scenario, fp8)


# ---- registration, validation, options, command line ---------------------------------------------

def test_config_validates_as_alltoall():
    cfg = make_config(fm.FP8_ALLTOALL)
    assert cfg.moe_token_dispatcher_type == fm.FP8_ALLTOALL
    # accepted for alltoall, rejected for allgather: fp8_alltoall follows alltoall
    kw = dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    assert make_config(fm.FP8_ALLTOALL, **kw).moe_shared_expert_overlap
    with pytest.raises(ValueError, match="alltoall"):
        make_config("allgather", **kw)
    assert make_config(fm.FP8_ALLTOALL, variable_seq_lengths=True).variable_seq_lengths
    with pytest.raises(ValueError, match="variable sequence length"):
        make_config("allgather", variable_seq_lengths=True)
    # rejected for alltoall: rejected for fp8_alltoall, with Megatron's message
    with pytest.raises(ValueError, match="moe_expert_capacity_factor must be set"):
        make_config(fm.FP8_ALLTOALL, moe_pad_expert_input_to_capacity=True)
    # a Megatron check keyed on the type ('alltoall' or 'flex') passes for fp8_alltoall
    kw = dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2)
    try:
        make_config(fm.FP8_ALLTOALL, **kw)
    except (AssertionError, ValueError) as e:
        assert "token dispatcher" not in str(e), e


def _build_layer_in_child(rank, world, registered_, over):
    init_parallel(world)
    try:
        if not registered_:
            fm.unregister()
        cfg = make_config(fm.FP8_ALLTOALL, **over)
        try:
            layer = build(moe_spec(8), cfg)
        except (ValueError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return type(layer.token_dispatcher).__name__
    finally:
        ps.destroy_model_parallel()


def test_register_is_what_makes_moe_layer_build_it():
    assert run_ranks(1, _build_layer_in_child, True, {}) == ["FP8AlltoAllTokenDispatcher"]
    assert "Unsupported token dispatcher type" in run_ranks(1, _build_layer_in_child, False, {})[0]
    # other types are untouched by the hooks
    assert fm.is_registered()
    fm.register()  # idempotent
    original = MoELayer.__init__.__fp8a2a_original__
    assert getattr(original, "__fp8a2a_original__", None) is None


def test_static_capacity_mode_needs_a_capacity_factor():
    msg = run_ranks(1, _build_layer_in_child, True, {"fp8a2a_capacity_mode": "static"})[0]
    assert msg.startswith("ValueError") and "capacity-factor" in msg


def test_default_granularity_follows_the_recipe():
    """No granularity given: the recipe's own under Megatron's experts, row for the FP8 experts or
    without a recipe; any given granularity wins."""
    def granularity(recipe, fp8_experts=False, fp8="e4m3", hidden=512, **kw):
        cfg = argparse.Namespace(fp8=fp8, fp8_recipe=recipe, hidden_size=hidden, **kw)
        return fm.resolve(cfg, fp8_experts=fp8_experts).dispatcher.granularity
    want = {"blockwise": "block128", "tensorwise": "row", "delayed": "row", "mxfp8": "row"}
    for recipe, g in want.items():
        assert granularity(recipe) == g
        assert granularity(recipe, fp8_experts=True) == "row"
    assert granularity("blockwise", fp8=None) == "row"  # FP8 off
    assert granularity("blockwise", hidden=200) == "row"  # no 128-value blocks
    assert granularity("blockwise", moe_latent_size=200) == "row"  # the dispatched width
    assert granularity("blockwise", fp8a2a_granularity="tensor") == "tensor"
    try:
        fm.register(granularity="tensor")
        assert granularity("blockwise") == "tensor"
    finally:
        fm.options.reset_defaults()


def _granularity_in_child(rank, world, fp8_experts, recipe, over):
    init_parallel(world)
    try:
        cfg = make_config(fm.FP8_ALLTOALL, **over)
        cfg.fp8, cfg.fp8_recipe = "e4m3", recipe  # after construction: megatron-core refuses fp8 without TE
        layer = build(moe_spec(8, fp8_experts), cfg)
        return layer.token_dispatcher.dispatcher.granularity
    finally:
        ps.destroy_model_parallel()


MEGATRON_EXPERTS = {"fp8a2a_experts": "megatron"}  # else the recipe picks the FP8 experts (options.recipe_experts)


@pytest.mark.parametrize("fp8_experts,recipe,over,want", [
    (False, "blockwise", MEGATRON_EXPERTS, "block128"), (False, "tensorwise", MEGATRON_EXPERTS, "row"),
    (False, "blockwise", {**MEGATRON_EXPERTS, "fp8a2a_granularity": "tensor"}, "tensor"),
    pytest.param(True, "blockwise", {}, "row", marks=pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="no FP8 experts")),
    pytest.param(False, "blockwise", {}, "row", marks=pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="no FP8 experts"))])
def test_layer_dispatcher_takes_the_recipe_granularity(fp8_experts, recipe, over, want):
    """Through MoELayer on 2 ranks: the Dispatcher is built once, after the experts, on every rank (its
    agreement collective would hang or raise otherwise)."""
    assert run_ranks(2, _granularity_in_child, fp8_experts, recipe, over, timeout=120) == [want, want]


def test_options_precedence():
    try:
        fm.register(granularity="block128", bf16_below_bytes=0)
        assert fm.resolve(None).dispatcher.granularity == "block128"
        cfg = argparse.Namespace(fp8a2a_granularity="tensor", fp8a2a_fp8_combine=None)
        wire = fm.resolve(cfg).dispatcher
        assert (wire.granularity, wire.bf16_below_bytes, wire.fp8_combine) == ("tensor", 0, False)
        with pytest.raises(ValueError, match="granularity"):
            fm.resolve(argparse.Namespace(fp8a2a_granularity="col"))
        with pytest.raises(ValueError, match="capacity mode"):
            fm.register(capacity_mode="sometimes")
        with pytest.raises(TypeError, match="unknown"):
            fm.register(granularty="row")
        fm.register(fp8_dgrad=True)  # the FP8 experts' options follow the same precedence
        assert fm.resolve(None).experts == fm.options.ExpertOptions(fp8_dgrad=True, fp8_wgrad=False)
        assert not fm.resolve(argparse.Namespace(fp8a2a_fp8_dgrad=False)).experts.fp8_dgrad
        assert fm.resolve(argparse.Namespace(fp8a2a_fp8_wgrad=True)).experts.fp8_wgrad
    finally:
        fm.options.reset_defaults()
    assert fm.resolve(None) == fm.Options()


@pytest.mark.parametrize("mode,pad,factor", [("auto", True, 0.5), ("auto", False, None), ("static", False, 0.5),
                                             ("variable", True, None)])
def test_capacity_mode_gives_the_dispatcher_its_capacity_factor(mode, pad, factor):
    cfg = argparse.Namespace(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad,
                             fp8a2a_capacity_mode=mode)
    opts = fm.resolve(cfg)
    assert (opts.capacity_mode, opts.dispatcher.capacity_factor) == (mode, factor)


def test_command_line_flags():
    # a parser that already has the option (as megatron.training's has): choices are extended
    p = argparse.ArgumentParser()
    p.add_argument("--moe-token-dispatcher-type", default="allgather", choices=("allgather", "alltoall", "flex"))
    assert fm.extra_args_provider(p) is p
    fm.add_arguments(p)  # idempotent
    a = p.parse_args(["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-granularity", "block128",
                      "--fp8a2a-fp8-combine", "--fp8a2a-bf16-below-bytes", "0", "--fp8a2a-fp8-dgrad"])
    assert a.moe_token_dispatcher_type == "fp8_alltoall"
    opts = fm.resolve(a)
    assert (opts.dispatcher.granularity, opts.dispatcher.fp8_combine, opts.dispatcher.bf16_below_bytes,
            opts.capacity_mode) == ("block128", True, 0, "auto")
    assert (opts.experts.fp8_dgrad, opts.experts.fp8_wgrad) == (True, False)
    assert fm.resolve(p.parse_args(["--fp8a2a-fp8-wgrad"])).experts.fp8_wgrad
    # under a TE FP8 recipe both gradients follow it (FP8); flags override both ways
    te = p.parse_args([])
    te.fp8 = "e4m3"
    assert (fm.resolve(te).experts.fp8_dgrad, fm.resolve(te).experts.fp8_wgrad) == (True, True)
    off = p.parse_args(["--no-fp8a2a-fp8-dgrad", "--no-fp8a2a-fp8-wgrad"])
    off.fp8 = "e4m3"
    assert (fm.resolve(off).experts.fp8_dgrad, fm.resolve(off).experts.fp8_wgrad) == (False, False)
    mixed = p.parse_args(["--no-fp8a2a-fp8-wgrad"])
    mixed.fp8 = "e4m3"
    assert (fm.resolve(mixed).experts.fp8_dgrad, fm.resolve(mixed).experts.fp8_wgrad) == (True, False)
    defaults = p.parse_args([])
    assert fm.resolve(defaults) == fm.Options()
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-token-dispatcher-type", "fp9"])
    # a parser without it gets it
    q = fm.add_arguments(argparse.ArgumentParser())
    assert q.parse_args(["--moe-token-dispatcher-type", "fp8_alltoall"]).moe_token_dispatcher_type == "fp8_alltoall"


def test_megatron_training_parser_when_present():
    try:
        from megatron.training import arguments
    except Exception:  # noqa: BLE001
        pytest.skip("megatron.training is not installed (megatron-core < 0.19 wheels do not ship it)")
    old = sys.argv
    sys.argv = ["prog", "--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-granularity", "tensor"]
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = old
    assert args.moe_token_dispatcher_type == "fp8_alltoall" and args.fp8a2a_granularity == "tensor"


FAKE_TRAINING_ARGUMENTS = """
import argparse

def add_megatron_arguments(parser):
    parser.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                        choices=("allgather", "alltoall", "flex"))
    return parser

def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    parser = argparse.ArgumentParser()
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(argv)
"""


def test_training_parser_is_patched_on_import(tmp_path):
    """megatron.training.arguments as 0.19 shapes it (a fake one here, megatron being a namespace
    package): patched when imported after register(), and at once when imported before."""
    try:
        import megatron.training  # noqa: F401
        pytest.skip("a real megatron.training is installed (see the next test)")
    except ImportError:
        pass
    pkg = tmp_path / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text(FAKE_TRAINING_ARGUMENTS)
    argv = ["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-granularity", "block128"]
    sys.path.insert(0, str(tmp_path))
    try:
        from megatron.training import arguments  # imported after register(): the hook patches it
        a = arguments.parse_args(argv=argv)
        assert (a.moe_token_dispatcher_type, a.fp8a2a_granularity) == ("fp8_alltoall", "block128")
        fm.unregister()
        with pytest.raises(SystemExit):
            arguments.parse_args(argv=argv)
        fm.register()  # imported before register(): patched at once
        assert arguments.parse_args(argv=argv).moe_token_dispatcher_type == "fp8_alltoall"
    finally:
        fm.unregister()
        sys.path.remove(str(tmp_path))
        for name in ("megatron.training.arguments", "megatron.training"):
            sys.modules.pop(name, None)
        fm.register()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("T,E,K", [(32, 16, 4), (7, 3, 8), (64, 256, 8), (0, 8, 2), (5, 1, 1)])
def test_routing_map_to_topk(T, E, K, dtype):
    """The one-kernel conversion against torch ops, byte for byte, gradient included: rows fully and
    partly dropped, a row with more than k experts (its lowest kept), k above the experts, probs of 0
    (dropped under drop_zero only)."""
    g = torch.Generator().manual_seed(T * 1000 + E)
    scores = torch.rand(T, E, generator=g)
    top = scores.topk(min(K, E), dim=1).indices
    routing = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    if T > 5:
        routing[3] = False  # a dropped token
        routing[4, top[4, :2]] = False  # partly dropped
        routing[5] = True  # more than k: the lowest k stay
        scores[2, top[2, 0]] = 0  # a routed prob of 0
        scores[1, top[1, 0]] = 1e-45 if dtype != torch.float64 else 1e-300  # tiny, not 0: kept
    for drop_zero in (False, True):
        probs = (scores * routing).to(dtype).requires_grad_()
        ref_probs = probs.detach().clone().requires_grad_()
        idx, w = routing_map_to_topk(routing, probs, K, drop_zero)
        ref_idx, ref_w = routing_map_to_topk_reference(routing, ref_probs, K, drop_zero)
        assert idx.dtype == torch.int64 and w.dtype == dtype
        assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
        dy = torch.randn(w.shape, generator=g).to(dtype)
        w.backward(dy)
        ref_w.backward(dy)
        assert torch.equal(probs.grad, ref_probs.grad)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(routing_map_to_topk(routing, probs, K, drop_zero),
                                                            (idx, w)))


def test_routing_map_to_topk_checks_its_inputs():
    m, p = torch.zeros(4, 8, dtype=torch.bool), torch.zeros(4, 8)
    for msg, args in {"bool": (m.float(), p, 2), "probs": (m, p[:, :4], 2), "at least 1": (m, p, 0)}.items():
        with pytest.raises(ValueError, match=msg):
            ops.routing_map_to_topk(*args, False)


def test_fp8_experts_spec_swaps_only_the_experts():
    spec = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)
    if not HAVE_FP8_EXPERTS:
        pytest.skip("fp8a2a.experts (FP8GroupedMLP) is not in this tree")
    from fp8a2a.megatron.experts import fp8_expert_classes
    fp8_seq = fp8_expert_classes()[SequentialMLP]
    out = fm.fp8_experts_spec(spec)
    assert issubclass(fp8_seq, SequentialMLP)
    if isinstance(spec, ModuleSpec):  # megatron-core 0.16: ModuleSpec trees
        assert isinstance(out, ModuleSpec) and out.module is spec.module
        assert out.submodules.experts.module is fp8_seq
        assert out.submodules.experts.submodules is spec.submodules.experts.submodules
        assert out.submodules.shared_experts is spec.submodules.shared_experts
        assert spec.submodules.experts.module is SequentialMLP  # the input is not modified
        assert fm.fp8_experts_spec(out).submodules.experts.module is fp8_seq  # idempotent
    else:  # megatron-core 0.19: the layer spec is a functools.partial builder
        assert out.func is spec.func
        assert out.keywords["submodules"].experts.func is fp8_seq
        assert spec.keywords["submodules"].experts.func is SequentialMLP  # the input is not modified
        assert fm.fp8_experts_spec(out).keywords["submodules"].experts.func is fp8_seq  # idempotent
    # builder-style specs (megatron-core 0.19: functools.partial all the way down)
    sub = spec.submodules.experts.submodules if isinstance(spec, ModuleSpec) else \
        spec.keywords["submodules"].experts.keywords["submodules"]
    builder = functools.partial(MoELayer, submodules=MoESubmodules(
        experts=functools.partial(SequentialMLP, submodules=sub)))
    swapped = fm.fp8_experts_spec(builder)
    assert swapped.keywords["submodules"].experts.func is fp8_seq
    with pytest.raises(ValueError, match="no MoE experts"):
        fm.fp8_experts_spec(ModuleSpec(module=torch.nn.Linear))


def _fp8_experts_errors(rank, world):
    init_parallel(world)
    try:
        with pytest.raises(ValueError, match="SwiGLU"):
            build(moe_spec(8, True), make_config(fm.FP8_ALLTOALL, gated_linear_unit=False, activation_func=F.silu))
        with pytest.raises(ValueError, match="bias"):
            build(moe_spec(8, True), make_config(fm.FP8_ALLTOALL, add_bias_linear=True))
    finally:
        ps.destroy_model_parallel()


def _fp8_experts_cache(rank, world):
    """FP8 experts over several micro-batches: the FP8 weights (and the BF16 stack of the BF16
    dgrad) are made once, again after an optimizer step and after a weight write."""
    import fp8a2a.weight_cache as wc
    init_parallel(world)
    counts = {}
    cached = wc._cached

    def counting(weight, kind, build):
        def counted(sources):
            counts[kind] = counts.get(kind, 0) + 1
            return build(sources)
        return cached(weight, kind, counted)
    wc._cached = counting
    try:
        torch.manual_seed(1)
        layer = build(moe_spec(8, True), make_config(fm.FP8_ALLTOALL, fp8a2a_bf16_below_bytes=0))
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)  # fused: no version bumps
        x = torch.randn(6, 2, 128, generator=torch.Generator().manual_seed(0))
        once = {False: 2, "stack": 2}  # fc1 and fc2: FP8 forward weights, BF16 stack for the dgrad
        seen = []
        for step in range(2):
            for _ in range(3):
                layer(x.clone().requires_grad_())[0].sum().backward()
            seen.append(dict(counts))
            counts.clear()
            if step == 0:
                opt.step()
        with torch.no_grad():
            layer.experts.local_experts[3].linear_fc2.weight.add_(0.1)
        layer(x.clone().requires_grad_())[0].sum().backward()
        seen.append(dict(counts))
        return seen == [once, once, {False: 1, "stack": 1}] or seen
    finally:
        wc._cached = cached
        ps.destroy_model_parallel()


@pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="fp8a2a.experts (FP8GroupedMLP) is not in this tree")
def test_fp8_experts_weights_made_once_per_optimizer_step():
    assert run_ranks(1, _fp8_experts_cache) == [True]


def _fp8_experts_param_gather_hooks(rank, world):
    """Megatron's overlapped param all-gather (overlap_param_gather): the parameters hold stale
    values until a forward pre-hook of the module owning them (DDP's, on every module) waits for
    the gather. Simulated: every expert parameter starts zeroed, its module's pre-hook writes the
    gathered values through .data (no version bump, as NCCL) after an optimizer step. The FP8
    experts must fire those hooks before reading (and caching) the weights: the output equals the
    same layer built with the gathered weights, each hook fired once per forward, and a second
    micro-batch after another such step follows again."""
    init_parallel(world)
    try:
        torch.manual_seed(1)
        cfg = make_config(fm.FP8_ALLTOALL, fp8a2a_bf16_below_bytes=0)
        layer = build(moe_spec(8, True), cfg)
        torch.manual_seed(1)
        ref = build(moe_spec(8, True), cfg)
        x = torch.randn(6, 2, 128, generator=torch.Generator().manual_seed(0))
        owners = [m for m in layer.experts.modules() if m is not layer.experts
                  and next(m.parameters(recurse=False), None) is not None]
        assert owners and all(p.dim() == 2 for m in owners for p in m.parameters(recurse=False))
        gathered = {}
        fired = []

        def hook(module, *unused):  # DDP's signature: finish_param_sync of the module's own params
            fired.append(module)
            for p in module.parameters(recurse=False):
                p.data.copy_(gathered[p])

        for m in owners:
            m.register_forward_pre_hook(hook)
        ok = []
        for step in range(2):
            with torch.no_grad():
                for p, q in zip(layer.experts.parameters(), ref.experts.parameters()):
                    if step:
                        q.mul_(-0.5)  # the new weights: the reference holds them at once
                    gathered[p] = q.detach().clone()
                    p.data.zero_()  # not gathered yet
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0).step()  # the optimizer step
            fired.clear()
            y = layer(x.clone())[0]
            want = ref(x.clone())[0]
            ok.append((sorted(map(id, fired)) == sorted(map(id, owners)), torch.equal(y, want)))
        return ok == [(True, True)] * 2 or ok
    finally:
        ps.destroy_model_parallel()


@pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="fp8a2a.experts (FP8GroupedMLP) is not in this tree")
def test_fp8_experts_fire_param_gather_pre_hooks():
    assert run_ranks(1, _fp8_experts_param_gather_hooks) == [True]


@pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="fp8a2a.experts (FP8GroupedMLP) is not in this tree")
def test_fp8_experts_unsupported_configs():
    run_ranks(1, _fp8_experts_errors)


def test_train_script_smoke():
    root = os.path.join(os.path.dirname(__file__), "..")
    from .programs import run  # forked from a warm process: the imports are done
    r = run(os.path.join(root, "examples", "train_moe_megatron.py"), "--device", "cpu", "--steps", "4",
            "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "64", "--seq-length", "32",
            "--micro-batch-size", "4", "--vocab-size", "128", "--fp8a2a-bf16-below-bytes", "0", timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "FP8AlltoAllTokenDispatcher" in r.stdout and "done: loss" in r.stdout, r.stdout


# ---- --fp8a2a-experts: the experts of every fp8_alltoall layer -------------------------------------

def _layer_experts_in_child(rank, world, dispatcher, how):
    """A GPT layer built from Megatron's own local spec function with the experts chosen `how`:
    (experts class, the dispatcher's deliver_fp8, the layer's parameter names)."""
    import types
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    init_parallel(world)
    gv = "megatron.training.global_vars"
    saved = sys.modules.get(gv)
    try:
        over = {}
        if how == "config":
            over["fp8a2a_experts"] = "fp8"
        elif how == "flag":  # megatron.training's global args, as its parse_args leaves them
            p = fm.add_arguments(argparse.ArgumentParser())
            sys.modules[gv] = types.SimpleNamespace(_GLOBAL_ARGS=p.parse_args(["--fp8a2a-experts", "fp8"]))
        elif how == "register":
            fm.register(experts="fp8")
        elif how == "flag_megatron":  # the flag says megatron: it wins over register()'s default
            fm.register(experts="fp8")
            p = fm.add_arguments(argparse.ArgumentParser())
            sys.modules[gv] = types.SimpleNamespace(_GLOBAL_ARGS=p.parse_args(["--fp8a2a-experts", "megatron"]))
        spec = with_portable_router(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False))
        layer = build(spec, make_config(dispatcher, **over))
        moe = layer.mlp
        dispatcher_ = moe.token_dispatcher
        return (type(moe.experts).__name__, getattr(dispatcher_, "deliver_fp8", None),
                sorted(n for n, _ in layer.named_parameters()))
    finally:
        fm.options.reset_defaults()
        if saved is None:
            sys.modules.pop(gv, None)
        else:
            sys.modules[gv] = saved
        ps.destroy_model_parallel()


@pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="fp8a2a.experts (FP8GroupedMLP) is not in this tree")
def test_experts_option_swaps_the_experts_of_megatrons_layer_spec():
    """--fp8a2a-experts fp8 (the flag, a config attribute or register's default): the MoE layer a GPT
    layer spec of Megatron's makes gets fp8a2a's FP8 experts, with the same parameter names; without
    it, or under another dispatcher type, Megatron's."""
    base = run_ranks(1, _layer_experts_in_child, fm.FP8_ALLTOALL, None)[0]
    assert base[:2] == ("SequentialMLP", False)
    for how in ("config", "flag", "register"):
        got = run_ranks(1, _layer_experts_in_child, fm.FP8_ALLTOALL, how)[0]
        assert got[:2] == ("FP8SequentialMLP", True), how
        assert got[2] == base[2], how  # Megatron's parameters (and so its checkpoint keys)
    assert run_ranks(1, _layer_experts_in_child, fm.FP8_ALLTOALL, "flag_megatron")[0][:2] == ("SequentialMLP", False)
    assert run_ranks(1, _layer_experts_in_child, "allgather", "config")[0][0] == "SequentialMLP"


def _recipe_experts_in_child(rank, world, over):
    """A GPT layer (Megatron's local spec) built under a TE FP8 recipe (config.fp8 set after
    construction: megatron-core refuses it without TE): (experts class, warnings) or the error."""
    import warnings
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    init_parallel(world)
    try:
        cfg = make_config(fm.FP8_ALLTOALL, **over)
        cfg.fp8 = "e4m3"
        spec = with_portable_router(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                layer = build(spec, cfg)
            except ValueError as e:
                return f"ValueError: {e}"
        return type(layer.mlp.experts).__name__, [str(w.message) for w in seen if "keeps Megatron" in str(w.message)]
    finally:
        ps.destroy_model_parallel()


@pytest.mark.skipif(not HAVE_FP8_EXPERTS, reason="fp8a2a.experts (FP8GroupedMLP) is not in this tree")
def test_te_fp8_recipe_picks_the_fp8_experts_where_they_fit():
    """Under a TE FP8 recipe a run that chose no experts gets fp8a2a's FP8 experts; a layer they do
    not cover (bias) keeps Megatron's, with a warning; a run that asked for them gets the error;
    --fp8a2a-experts megatron keeps Megatron's without a word."""
    assert run_ranks(1, _recipe_experts_in_child, {})[0] == ("FP8SequentialMLP", [])
    name, warned = run_ranks(1, _recipe_experts_in_child, {"add_bias_linear": True})[0]
    assert name == "SequentialMLP" and len(warned) == 1 and "add_bias_linear" in warned[0]
    err = run_ranks(1, _recipe_experts_in_child, {"add_bias_linear": True, "fp8a2a_experts": "fp8"})[0]
    assert err.startswith("ValueError") and "add_bias_linear" in err
    assert run_ranks(1, _recipe_experts_in_child, {"fp8a2a_experts": "megatron"})[0] == ("SequentialMLP", [])
    N = argparse.Namespace
    assert [fm.resolve(N(fp8="e4m3", fp8_recipe=r)).experts.impl for r in ("blockwise", "tensorwise", "delayed")] \
        == ["fp8"] * 3
    assert fm.resolve(N(fp8=None)).experts.impl == "megatron"
    # Megatron's experts: Blackwell's recipes, TE's FP8 parameters, layers kept in BF16
    for other in (dict(fp8_recipe="mxfp8"), dict(fp8_param=True), dict(first_last_layers_bf16=True)):
        assert fm.resolve(N(fp8="e4m3", **other)).experts.impl == "megatron", other
        assert fm.resolve(N(fp8="e4m3", fp8a2a_experts="fp8", **other)).experts.impl == "fp8", other


def test_experts_option_values():
    assert fm.resolve(None).experts.impl == "megatron"
    p = fm.add_arguments(argparse.ArgumentParser())
    assert fm.resolve(p.parse_args(["--fp8a2a-experts", "fp8"])).experts.impl == "fp8"
    assert fm.resolve(p.parse_args([])).experts.impl == "megatron"
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8a2a-experts", "te"])
    with pytest.raises(ValueError, match="experts must be one of"):
        fm.resolve(argparse.Namespace(fp8a2a_experts="te"))
    with pytest.raises(ValueError, match="experts must be one of"):
        fm.register(experts="te")
    assert fm.resolve(None).experts.impl == "megatron"  # a refused default is not kept


# ---- the launcher: python -m fp8a2a.megatron.run SCRIPT.py ARGS ----------------------------------

LAUNCHED_SCRIPT = """
import json
import sys

import beside_the_script  # the script's directory is on sys.path, as under `python SCRIPT.py`
import fp8a2a.megatron as fm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import arguments  # a Megatron-LM checkout's, beside the script

assert fm.is_registered()
assert hasattr(TransformerConfig.__post_init__, "__fp8a2a_original__")
a = arguments.parse_args()  # sys.argv[1:]
print(json.dumps({"name": __name__, "argv": sys.argv, "type": a.moe_token_dispatcher_type,
                  "experts": a.fp8a2a_experts}))
"""


def test_launcher_registers_then_runs_the_script(tmp_path):
    """The launcher as a user runs it, from another folder, on a script beside a Megatron-LM style
    megatron/training/arguments.py that fp8a2a's register() must patch when the script imports it."""
    try:
        import megatron.training  # noqa: F401
        pytest.skip("a real megatron.training is installed: the fake one beside the script would not be used")
    except ImportError:
        pass
    import json
    from .programs import run
    lm = tmp_path / "Megatron-LM"
    (lm / "megatron" / "training").mkdir(parents=True)
    (lm / "megatron" / "training" / "__init__.py").write_text("")
    (lm / "megatron" / "training" / "arguments.py").write_text(FAKE_TRAINING_ARGUMENTS)
    (lm / "beside_the_script.py").write_text("")
    script = lm / "pretrain_gpt.py"
    script.write_text(LAUNCHED_SCRIPT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-experts", "fp8"]
    r = run("-m", "fp8a2a.megatron.run", script, *args, cwd=elsewhere, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"name": "__main__", "argv": [str(script), *args], "type": "fp8_alltoall", "experts": "fp8"}


def test_launcher_refuses_a_missing_script(tmp_path, capsys):
    from fp8a2a.megatron.run import main
    assert main([]) == 2
    assert "no script given" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.py"), "--x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such script" in err
    assert not fm.options._registered  # nothing registered or run


def test_launcher_skips_the_compile_step_of_a_prebuilt_wheel(tmp_path):
    """megatron.training's initialize calls compile_helpers (`make` in megatron/core/datasets): the
    wheels ship the helper built and no Makefile, so under the launcher the step is skipped."""
    import importlib.util
    helper = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
    if helper is None or os.path.exists(os.path.join(os.path.dirname(helper.origin), "Makefile")):
        pytest.skip("this megatron-core has no prebuilt dataset helper, or has its Makefile")
    from .programs import run
    script = tmp_path / "init.py"
    script.write_text("from megatron.core.datasets.utils import compile_helpers\n"
                      "compile_helpers()  # as megatron.training's initialize does\n"
                      "print('past compile_helpers')\n")
    r = run("-m", "fp8a2a.megatron.run", script, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "past compile_helpers" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert "skipping Megatron's compile step" in r.stderr
