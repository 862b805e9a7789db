"""fp8_alltoall and Megatron's CUDA-graph options, on CPU (megatron-core 0.16.1 here; the device runs
0.19.2 and tests/gpu/test_megatron_graphs.py): the config-time refusals, the decisions at the
places where Megatron tests `moe_token_dispatcher_type == "alltoall"` outside the dispatcher, and
the capture-safe padding rows of the capacity mode."""
import inspect
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer import TransformerConfig

import fp8a2a.megatron as fm
from fp8a2a.megatron.dispatcher import _graph_modules, check_cuda_graphs, padded_rows

from .distributed import run_ranks


@pytest.mark.parametrize("impl,modules,refused", [
    ("none", [], None), ("local", ["moe_router", "moe_preprocess"], None), ("local", ["attn"], None),
    ("local", [], None), ("local", ["moe"], None), ("local", ["full_iteration"], "cuda_graph_impl"),
    ("transformer_engine", [], "cuda_graph_impl"), ("transformer_engine", ["moe_router"], None),
    ("full_iteration", [], "cuda_graph_impl")])
def test_fp8_experts_under_graphs(impl, modules, refused):
    """FP8 experts captured by Megatron's local graphs are allowed (their weights are refreshed before
    every replay); a capture whose replays fp8a2a cannot precede is refused, naming the option."""
    from megatron.core.transformer.cuda_graphs import _CudaGraphRunner

    from fp8a2a.megatron.experts import check_cuda_graphs as check_experts
    if refused:
        with pytest.raises(ValueError, match=refused):
            check_experts(Cfg(impl, modules))
    else:
        check_experts(Cfg(impl, modules))
    if impl == "local" and modules in ([], ["moe"]):  # the replay now refreshes them first
        assert getattr(_CudaGraphRunner.replay_graph_capture, "__fp8a2a_refresh__", False)


def _cache_state(layer):
    """[(kind, tensors)] of every cached copy on the FP8 experts' parameters, and the graph-read kinds."""
    out = []
    for p in layer.experts.parameters():
        for kind, (_, v, _) in sorted(p.__dict__.get("_fp8a2a_cache", {}).items(), key=str):
            out.append((kind, (v,) if isinstance(v, torch.Tensor) else tuple(v)))
    return out


def _replay_refreshes(rank, world, fp8_dgrad):
    """A Megatron MoE layer with FP8 experts: eager micro-batches, a 'capture' (weight_cache sees a
    capturing stream), then a mixed-precision optimizer step as Megatron's: the inner torch step on
    fp32 main params (where torch's step hooks fire), then the BF16 params written from them through
    .data (no version bump). The wrapped replay (a stand-in for Megatron's replay, same wrapper)
    finds the copies the graph reads rebuilt in place, equal to an eager build of the new weights."""
    import fp8a2a.weight_cache as wc
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.cuda_graphs import _CudaGraphRunner

    from fp8a2a.megatron.experts import _refresh_before_replay
    from tests.test_megatron import build, init_parallel, make_config, moe_spec
    init_parallel(world)
    seen = {}

    def replay(runner, *args, **kwargs):  # what Megatron's replay would read, at replay time
        seen["copies"] = [(k, [t.clone() for t in ts], [t.data_ptr() for t in ts]) for k, ts in _cache_state(layer)]
    original = _CudaGraphRunner.replay_graph_capture
    _CudaGraphRunner.replay_graph_capture = replay
    try:
        assert _refresh_before_replay()
        torch.manual_seed(1)
        layer = build(moe_spec(8, True), make_config(fm.FP8_ALLTOALL, fp8a2a_bf16_below_bytes=0,
                                                     fp8a2a_fp8_dgrad=fp8_dgrad)).bfloat16()
        x = torch.randn(6, 2, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
        layer(x.clone().requires_grad_())[0].float().sum().backward()  # eager warm-up: the copies exist
        capturing = wc._capturing
        wc._capturing = lambda w: True
        try:
            layer(x.clone().requires_grad_())[0].float().sum().backward()  # the capture: hits, marked
        finally:
            wc._capturing = capturing
        captured = [(k, [t.data_ptr() for t in ts]) for k, ts in _cache_state(layer)]
        params = list(layer.experts.parameters())
        main = [p.detach().float().clone().requires_grad_() for p in params]
        for m in main:
            m.grad = torch.randn_like(m)
        torch.optim.SGD(main, lr=1.0).step()  # torch's post-step hooks fire here, before the copy
        for p, m in zip(params, main):
            p.data.copy_(m.detach())
        runner = types.SimpleNamespace(base_module=layer)
        _CudaGraphRunner.replay_graph_capture(runner, False, (), {})
        got = seen["copies"]
        assert [(k, ptrs) for k, _, ptrs in got] == captured, "rebuilt elsewhere than where the graph reads"
        for p in params:  # the eager rule from scratch: what the graph must now read
            p.__dict__.pop("_fp8a2a_cache", None)
            p.__dict__.pop("_fp8a2a_graphed", None)
        layer(x.clone().requires_grad_())[0].float().sum().backward()
        want = _cache_state(layer)
        assert [k for k, _ in want] == [k for k, _, _ in got]
        return all(torch.equal(a.view(torch.uint8) if a.dtype == wc.FP8 else a,
                               b.view(torch.uint8) if b.dtype == wc.FP8 else b)
                   for (_, ga, _), (_, wa) in zip(got, want) for a, b in zip(ga, wa)) and len(got) > 0
    finally:
        _CudaGraphRunner.replay_graph_capture = original
        ps.destroy_model_parallel()


@pytest.mark.parametrize("fp8_dgrad", [False, True], ids=["bf16_dgrad", "fp8_dgrad"])
def test_replay_refreshes_graph_read_weights_after_a_mixed_precision_step(fp8_dgrad):
    assert run_ranks(1, _replay_refreshes, fp8_dgrad) == [True]


@pytest.fixture(autouse=True, scope="module")
def registered():
    fm.register()
    yield
    fm.unregister()


def config(dispatcher=fm.FP8_ALLTOALL, **over):
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
              moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False,
              moe_token_dispatcher_type=dispatcher)
    kw.update(over)
    return TransformerConfig(**kw)


class Cfg:  # what check_cuda_graphs reads, without TransformerConfig's own validation
    def __init__(self, impl, modules):
        self.cuda_graph_impl, self.cuda_graph_modules = impl, modules


@pytest.mark.parametrize("impl,modules,capacity,refused", [
    ("none", [], False, None),
    ("local", ["moe_router", "moe_preprocess"], False, None),
    ("local", ["attn"], False, None),
    ("local", ["moe"], True, None),
    ("local", [], True, None),
    ("local", [], False, "cuda_graph_modules"),
    ("local", ["moe"], False, "cuda_graph_modules"),
    ("local", ["full_iteration"], True, "full_iteration"),
    ("transformer_engine", ["moe_router"], False, "cuda_graph_impl"),
    ("transformer_engine", [], True, "cuda_graph_impl"),
    ("full_iteration", [], True, "cuda_graph_impl"),
])
def test_check_cuda_graphs(impl, modules, capacity, refused):
    cfg = Cfg(impl, modules)
    if refused is None:
        check_cuda_graphs(cfg, capacity)
    else:
        with pytest.raises(ValueError, match=refused):
            check_cuda_graphs(cfg, capacity)


def test_graph_modules_of_either_megatron():
    from megatron.core.transformer import enums
    scope = getattr(enums, "CudaGraphModule", None) or enums.CudaGraphScope
    assert _graph_modules(Cfg("local", [scope.moe_router, scope.moe_preprocess])) == ["moe_router", "moe_preprocess"]
    cfg = Cfg("local", None)
    cfg.cuda_graph_scope = "full"
    assert _graph_modules(cfg) == []


def _refused_when_built(rank, world):
    from megatron.core import parallel_state as ps

    from fp8a2a.megatron.standalone import cpu_current_device
    from tests.test_megatron import build, moe_spec
    cpu_current_device()
    cfg = config()
    cfg.cuda_graph_impl = "local"  # set after validation: 0.16.1's own checks want TE / CUDA here
    if hasattr(cfg, "cuda_graph_modules"):
        cfg.cuda_graph_modules = []
    else:
        cfg.cuda_graph_scope = []
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        with pytest.raises(ValueError, match="cuda_graph_modules.*capacity"):
            build(moe_spec(4), cfg)
        cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity = 1.0, True
        return build(moe_spec(4), cfg).token_dispatcher.capacity_factor
    finally:
        ps.destroy_model_parallel()


def test_refused_when_the_dispatcher_is_built():
    """Through a real MoELayer: whole-layer capture of a dropless fp8_alltoall is refused, naming the
    option; the same config with drop-and-pad builds. In a forked rank: a process group (and its
    threads) in the pytest process itself would be inherited by every later fork."""
    assert run_ranks(1, _refused_when_built) == [1.0]


def _should_free_input():
    try:
        from megatron.core.models.common.utils import should_free_input  # 0.19
    except ImportError:
        from megatron.core.models.gpt.fine_grained_callables import should_free_input  # 0.16
    return should_free_input


def test_mlp_input_may_be_freed_in_the_overlapped_schedule():
    """Branch 1 (should_free_input, 'mlp'): fp8_alltoall stays on the non-alltoall branch: the mlp
    node's input is a memoryless carrier, the rows live on the dispatcher, so freeing it is safe at
    any local expert count (tests/test_megatron.py::test_stages_under_a_detaching_freeing_schedule
    frees it and checks outputs and gradients)."""
    fn = _should_free_input()
    cfg = config()
    assert cfg.moe_token_dispatcher_type == fm.FP8_ALLTOALL  # what the check reads after register()
    args = ("mlp", True, cfg) + ((1,) if len(inspect.signature(fn).parameters) == 4 else ())
    assert fn(*args) is True


def test_pre_mlp_layernorm_recompute_decision():
    """Branch 2 (can_recompute_pre_mlp_layernorm_for_cudagraph): alltoall may recompute the pre-MLP
    layernorm under a moe_router+moe_preprocess graph because its graph outputs are permuted copies;
    fp8_alltoall's graph outputs include `_x`, a view of the layernorm output (cudagraph_attrs), so
    it must stay on the other branch (no recompute). The check reads the type after register()."""
    from fp8a2a.megatron.dispatcher import FP8AlltoAllTokenDispatcher
    src = inspect.getsource(FP8AlltoAllTokenDispatcher.__init__)
    assert 'self.cudagraph_attrs = ["_x", "_topk_idx"]' in src
    cfg = config(recompute_granularity="selective", recompute_modules=["layernorm"])
    assert cfg.moe_token_dispatcher_type != "alltoall"


@pytest.mark.parametrize("counts,m", [([8, 8, 8], 16), ([5, 5], 4), ([3, 7, 0, 2], 4), ([0, 0], 16)])
def test_padded_rows_capture_safe_form_matches(counts, m):
    padded = [-(-c // m) * m for c in counts]
    shift, acc = [], 0
    for c, p in zip(counts, padded):
        shift.append(acc)
        acc += p - c
    rows = sum(counts)
    want = torch.arange(rows) + torch.repeat_interleave(torch.tensor(shift), torch.tensor(counts), output_size=rows)
    assert torch.equal(padded_rows(counts, torch.tensor(counts), m, rows), want)
