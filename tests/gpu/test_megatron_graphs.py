"""fp8_alltoall under Megatron's CUDA graphs (cuda_graph_impl="local") on one GPU, against Megatron's
`alltoall` under the same options: a MoETransformerLayer (attention + MoE, local spec) at world size
one, step 1 eager (Megatron records the graphs), create_cudagraphs() (capture), step 2 replayed
from the graphs on a new input; output, input gradient and every parameter's gradient compared
(main_grad, where the graphs accumulate weight gradients, plus .grad of what ran eagerly). Also
the settings fp8_alltoall refuses (fp8a2a.megatron.dispatcher.check_cuda_graphs): the error names
the option. Marked gpu; needs megatron-core (0.19.2 on the device):

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
