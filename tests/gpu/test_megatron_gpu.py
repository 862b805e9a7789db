"""The Megatron adapter on a GPU: a full megatron-core MoELayer (router, dispatcher, experts) with
--moe-token-dispatcher-type fp8_alltoall against the same layer (same weights, same input) with
Megatron's own `alltoall`, forward and backward, at EP=1 on one GPU (NCCL world size 1). Each check
bounds the relative L2 errors of the output, the input's gradient, the router's and the experts'
gradients, each by the e4m3 bound of its path (tests/fp8_bounds.py). Marked gpu; skipped where
megatron.core is not importable. On one GPU (megatron-core 0.19.2 there):

    python -m pytest tests/gpu/test_megatron_gpu.py -m gpu -q

Checks: FP8 wire (row / block128 / tensor scales) with Megatron's SequentialMLP experts, and
what block128 keeps that row scales lose (one 128-block of every row 1e-6 of the others); the
unquantized wire (must match alltoall to bf16 rounding); drop-and-pad (fp8a2a's capacity mode vs
alltoall's drop-and-pad); shared experts, overlapped or not; the FP8 experts spec (FP8GroupedMLP on
the FP8 rows) against alltoall + SequentialMLP; TEGroupedMLP experts where TransformerEngine is
importable; megatron.training's parser where it is importable. On CPU, tests/test_megatron.py runs
the adapter against Megatron's allgather dispatcher on gloo ranks.

TE FP8 recipes (blockwise, tensorwise = current scaling, delayed; test_te_fp8_recipe): fp8_alltoall
with TEGroupedMLP or fp8_experts_spec experts against alltoall + TEGroupedMLP, both under the same
recipe (moe_router_padding_for_quantization set, Megatron's get_fp8_context around the forward).
The bound is measured in the same test: t = TE's own FP8 error (alltoall under the recipe against
alltoall in BF16), q = the error of one row-wise e4m3 quantization of the layer input (what the
wire adds). fp8_alltoall may be off BF16 by t + q (one more row quantization than TE's path), so
against TE's FP8 result (itself off by t, errors independent) by sqrt(t^2 + (t + q)^2); both are
checked, with 25% slack for norms estimated on one sample.
"""
import math
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore")]

import fp8a2a.megatron as fm  # noqa: E402
from fp8a2a.megatron.standalone import build_layer, fp8_context, world_of_one  # noqa: E402

from ..fp8_bounds import BLOCKS, E4M3, FP8_EXPERTS, WIRE, small_block_error  # noqa: E402

RAW = 1 << 40  # bf16_below_bytes that keeps every dispatch unquantized
A = types.SimpleNamespace(tokens=4096, seq=1024, hidden=1024, ffn=1024, experts=16, topk=4)
DEVICE = "cuda"
REFERENCE = "alltoall"

FP8_TOL = WIRE  # the FP8 wire with Megatron's experts (tests/fp8_bounds.py derives both)
FP8_EXPERTS_TOL = FP8_EXPERTS  # the FP8 wire with fp8_experts_spec experts
RAW_TOL = {"*": 0.01}


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    """fp8_alltoall registered, NCCL at world size 1 and Megatron's model-parallel state."""
    fm.register()
    teardown = world_of_one()
    yield
    teardown()
    fm.unregister()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_config(dispatcher, **over):
    from megatron.core.transformer import TransformerConfig
    fp8 = {k: over.pop(k) for k in list(over) if k.startswith("fp8a2a_")}
    kw = dict(num_layers=1, hidden_size=A.hidden, num_attention_heads=8, ffn_hidden_size=A.ffn,
              num_moe_experts=A.experts, moe_router_topk=A.topk, moe_token_dispatcher_type=dispatcher,
              moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss", add_bias_linear=False,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu, bf16=True,
              params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, moe_router_dtype="fp32")
    kw.update(over)
    cfg = TransformerConfig(**kw)
    for k, v in fp8.items():
        setattr(cfg, k, v)
    return cfg


def moe_spec(use_te=False, grouped=False):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    return get_moe_module_spec(use_te=use_te, num_experts=A.experts, moe_grouped_gemm=grouped)


def build(spec, cfg):
    return build_layer(spec, cfg).to(DEVICE)


def run(layer, x, G, cfg=None, warmup=0):
    """Forward (under cfg's TE FP8 recipe, if any) and backward; after `warmup` runs (delayed
    scaling's amax history) -> (y, x.grad, {parameter: grad})."""
    for _ in range(warmup + 1):
        xi = x.detach().clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with fp8_context(cfg):
            y, bias = layer(xi)
        assert bias is None
        (y.float() * G.float()).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad.detach(), grads


def errors(a, b):
    """Relative L2 errors of run() results a against b: output, input grad, router grad, the largest
    expert-parameter grad."""
    (y1, gx1, gp1), (y0, gx0, gp0) = a, b
    assert set(gp0) == set(gp1), "different parameters got gradients"
    return {"y": rel(y1, y0), "x.grad": rel(gx1, gx0),
            "router": max(rel(gp1[n], gp0[n]) for n in gp0 if "router" in n),
            "experts": max(rel(gp1[n], gp0[n]) for n in gp0 if "router" not in n)}


def compare(mine_over, tol, mine_spec=None, ref_spec=None, expect=None, small_block=None):
    """Builds the alltoall reference and the fp8_alltoall layer with the same weights, runs both
    forward and backward on one input (its second 128-block scaled by small_block, if given), and
    asserts the relative errors are within `tol` and `expect(seen, mine)` (what the experts were
    given: seen["tokens"] their type, ["tpe"] rows per expert, ["rows"], and ["x"] the input's
    rows) finds no problem."""
    ref_over = {k: v for k, v in mine_over.items() if not k.startswith("fp8a2a_")}
    torch.manual_seed(1)
    ref = build(ref_spec or moe_spec(), make_config(REFERENCE, **ref_over))
    mine = build(mine_spec or moe_spec(), make_config(fm.FP8_ALLTOALL, **mine_over))
    from fp8a2a.megatron.dispatcher import FP8AlltoAllTokenDispatcher
    assert isinstance(mine.token_dispatcher, FP8AlltoAllTokenDispatcher), type(mine.token_dispatcher)
    assert list(mine.state_dict()) == list(ref.state_dict()), "parameter layouts differ"
    mine.load_state_dict(ref.state_dict())
    seen = {}

    def hook(module, args):
        seen["tokens"] = type(args[0]).__name__
        seen["tpe"] = torch.as_tensor(args[1]).tolist()
        seen["rows"] = args[0]
    mine.experts.register_forward_pre_hook(hook)

    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(A.seq, A.tokens // A.seq, A.hidden, device=DEVICE, generator=g, dtype=torch.bfloat16)
    G = torch.randn(x.shape, device=DEVICE, generator=g, dtype=torch.bfloat16)
    if small_block is not None:
        x[..., 128:256] *= small_block
    seen["x"] = x.reshape(-1, A.hidden)
    err = errors(run(mine, x, G), run(ref, x, G))
    over = {k: v for k, v in err.items() if v > tol.get(k, tol.get("*", 0.0))}
    assert not over, f"relative L2 errors above {tol}: {over} (all: {err}; experts got {seen.get('tokens')})"
    if expect is not None:
        problem = expect(seen, mine)
        assert problem is None, problem
    del ref, mine
    torch.cuda.empty_cache()


def static_rows(factor):
    """Drop-and-pad: every expert is given exactly its capacity in rows, and the capacity is applied
    once, by the Dispatcher (the router's config has no capacity factor)."""
    cap = -(-A.tokens * A.topk * factor // A.experts)

    def expect(seen, mine):
        want = [int(cap)] * A.experts
        if mine.router.config.moe_expert_capacity_factor is not None:
            return "the router still applies the capacity"
        return None if seen.get("tpe") == want else f"tokens_per_expert {seen.get('tpe')[:4]}... != {want[:4]}..."
    return expect


def fp8_input(seen, mine):
    return None if seen.get("tokens") == "QuantizedTensor" and mine.token_dispatcher.deliver_fp8 else \
        "the FP8 experts did not receive FP8 rows"


FP8 = {"fp8a2a_bf16_below_bytes": 0}
# name: (fp8_alltoall's config overrides, tolerances, what the experts must have been given)
CHECKS = {
    "fp8 row, SequentialMLP": (dict(FP8), FP8_TOL, None),
    "fp8 tensor, SequentialMLP": (dict(FP8, fp8a2a_granularity="tensor"), FP8_TOL, None),
    "unquantized wire, SequentialMLP": ({"fp8a2a_bf16_below_bytes": RAW}, RAW_TOL, None),
    "drop-and-pad (capacity mode) vs alltoall": (dict(FP8, moe_expert_capacity_factor=1.0,
                                                      moe_pad_expert_input_to_capacity=True), FP8_TOL,
                                                 static_rows(1.0)),
    "drop-and-pad, variable, unquantized": (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                                                 fp8a2a_capacity_mode="variable", fp8a2a_bf16_below_bytes=RAW),
                                            RAW_TOL, None),
    "shared experts, unquantized": (dict(moe_shared_expert_intermediate_size=A.ffn, fp8a2a_bf16_below_bytes=RAW),
                                    RAW_TOL, None),
    "shared experts overlapped, unquantized": (dict(moe_shared_expert_intermediate_size=A.ffn,
                                                    moe_shared_expert_overlap=True, fp8a2a_bf16_below_bytes=RAW),
                                               RAW_TOL, None),
    "shared experts overlapped, fp8": (dict(FP8, moe_shared_expert_intermediate_size=A.ffn,
                                            moe_shared_expert_overlap=True), FP8_TOL, None),
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_fp8_alltoall_matches_alltoall(name):
    over, tol, expect = CHECKS[name]
    compare(over, tol, expect=expect)


@pytest.mark.parametrize("granularity,kept", [("block128", True), ("row", False)])
def test_block128_keeps_the_small_block_that_row_scales_lose(granularity, kept):
    """Rows whose second 128-block is 1e-6 of the first (BLOCKS): under block128 the rows
    SequentialMLP gets keep that block within one e4m3 rounding, under row scales (set by the large
    block) it is flushed to zero; either way the layer matches alltoall."""
    def expect(seen, mine):
        err = small_block_error(seen["rows"], seen["x"])
        return None if (err <= E4M3 if kept else err > 0.5) else f"{granularity}: the small block's error is {err:.4f}"
    compare(dict(FP8, fp8a2a_granularity=granularity), FP8_TOL, expect=expect, small_block=BLOCKS["small_block"])


@pytest.mark.parametrize("over", [dict(FP8), dict(FP8, fp8a2a_granularity="block128")], ids=["row", "block128"])
def test_fp8_experts_spec(over):
    """fp8a2a.megatron.fp8_experts_spec (FP8GroupedMLP on the FP8 rows) against alltoall + SequentialMLP."""
    compare(over, FP8_EXPERTS_TOL, mine_spec=fm.fp8_experts_spec(moe_spec()), expect=fp8_input)


@pytest.mark.parametrize("fp8_experts", [False, True], ids=["TEGroupedMLP", "fp8_experts_spec-over-TEGroupedMLP"])
def test_te_grouped_mlp(fp8_experts):
    """fp8_alltoall with TEGroupedMLP experts (or the FP8 experts spec over them) against alltoall +
    TEGroupedMLP."""
    pytest.importorskip("transformer_engine")  # after torch (imported above), as TE needs
    mine_spec = fm.fp8_experts_spec(moe_spec(True, True)) if fp8_experts else moe_spec(True, True)
    compare(dict(FP8), FP8_EXPERTS_TOL if fp8_experts else FP8_TOL, mine_spec=mine_spec, ref_spec=moe_spec(True, True))


RECIPES = ("blockwise", "tensorwise", "delayed")


@pytest.mark.parametrize("fp8_experts", [False, True], ids=["TEGroupedMLP", "fp8_experts_spec"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_te_fp8_recipe(recipe, fp8_experts):
    """fp8_alltoall against alltoall under the same TE FP8 recipe (TEGroupedMLP experts), bounded by
    TE's own FP8 error and one row quantization (module docstring)."""
    pytest.importorskip("transformer_engine")  # after torch (imported above), as TE needs
    from fp8a2a import dequantize, quantize
    te_fp8 = dict(fp8="e4m3", fp8_recipe=recipe, moe_router_padding_for_quantization=True)
    torch.manual_seed(1)
    bf16 = build(moe_spec(True, True), make_config(REFERENCE))
    ref_cfg = make_config(REFERENCE, **te_fp8)
    ref = build(moe_spec(True, True), ref_cfg)
    # the experts named: under a TE FP8 recipe a run that names none gets the FP8 experts
    mine_cfg = make_config(fm.FP8_ALLTOALL, **te_fp8, **FP8, fp8a2a_experts="fp8" if fp8_experts else "megatron")
    mine = build(fm.fp8_experts_spec(moe_spec(True, True)) if fp8_experts else moe_spec(True, True), mine_cfg)
    # no granularity given: block128 under blockwise for TE's experts, else row (RECIPE_GRANULARITY)
    want = "block128" if recipe == "blockwise" and not fp8_experts else "row"
    assert mine.token_dispatcher.dispatcher.granularity == want
    weights = dict(bf16.named_parameters())  # the same weights everywhere (TE's FP8 state stays each module's own)
    for m in (ref, mine):
        assert list(dict(m.named_parameters())) == list(weights)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(weights[n])
    seen = []
    mine.experts.register_forward_pre_hook(lambda m, args: seen.append(torch.as_tensor(args[1]).tolist()))
    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(A.seq, A.tokens // A.seq, A.hidden, device=DEVICE, generator=g, dtype=torch.bfloat16)
    G = torch.randn(x.shape, device=DEVICE, generator=g, dtype=torch.bfloat16)
    r_bf16 = run(bf16, x, G)
    r_ref = run(ref, x, G, ref_cfg, warmup=2)
    r_mine = run(mine, x, G, mine_cfg, warmup=2)
    x2 = x.reshape(-1, A.hidden)
    q = rel(dequantize(quantize(x2, "row"), torch.float32), x2)  # one row-wise e4m3 quantization
    t = errors(r_ref, r_bf16)  # TE's own FP8 error under this recipe
    own, vs_te = errors(r_mine, r_bf16), errors(r_mine, r_ref)
    slack = 1.25
    bad = {k: (round(own[k], 4), round(vs_te[k], 4)) for k in t
           if own[k] > slack * (t[k] + q) or vs_te[k] > slack * math.hypot(t[k], t[k] + q)}
    assert not bad, (f"{recipe}: fp8_alltoall (vs BF16, vs TE FP8) above the bounds: {bad}; TE's FP8 error {t}, "
                     f"row quantization {q:.4f}; all: vs BF16 {own}, vs TE FP8 {vs_te}")
    if not fp8_experts:  # TE's FP8 GEMMs got rows padded as the flag asks
        assert seen and all(n % 16 == 0 for n in seen[-1]), seen[-1:]
    del bf16, ref, mine
    torch.cuda.empty_cache()


def test_megatron_training_parser_accepts_fp8_alltoall(monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(sys, "argv", ["x", "--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-granularity",
                                      "block128", "--fp8a2a-bf16-below-bytes", "0", "--num-experts", "8"])
    args = arguments.parse_args()
    assert args.moe_token_dispatcher_type == "fp8_alltoall" and args.fp8a2a_granularity == "block128"
    fm.resolve(args)
