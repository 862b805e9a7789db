"""benchmarks/bench_megatron_layer.py's timing loop, without a GPU or TE: with a stand-in for
Megatron's TE linears (is_first_microbatch True after set_is_first_microbatch, passed to TE, then
False), every timed cached call and burst step reuses the cached FP8 weights, only the untimed
`first` makes a call recast, the gradients are cleared before every step (outside the timing of a
cached call, between a burst's steps), and the paired quant/step is kept."""
import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_megatron_layer as bm  # noqa: E402


class FakeTELinear(torch.nn.Module):
    """Megatron's TEGroupedLinear.forward: passes is_first_microbatch to TE, then sets it False."""

    def __init__(self, log):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.is_first_microbatch = True  # as Megatron's TE wrappers start
        self.log = log

    def forward(self, x):
        self.log.append(("call", self.is_first_microbatch, self.weight.grad is None))
        self.is_first_microbatch = False
        return x @ self.weight


class FakeLayer(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.experts = FakeTELinear(log)

    def set_is_first_microbatch(self):  # MegatronModule.set_is_first_microbatch
        for m in self.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True

    def forward(self, x):
        return self.experts(x), None


def test_te_rows_timed_cached_and_grads_cleared(monkeypatch):
    log = []
    layer = FakeLayer(log)
    cfg = types.SimpleNamespace(fp8=None)  # no TE here: fp8_context is a null context
    v = bm.layer_variant("te", layer, cfg, torch.ones(2, 4), torch.ones(2, 4))
    assert v.first is None  # without an FP8 recipe nothing is cached
    cfg.fp8 = "e4m3"
    monkeypatch.setattr(bm, "fp8_context", lambda c: __import__("contextlib").nullcontext())
    v = bm.layer_variant("te", layer, cfg, torch.ones(2, 4), torch.ones(2, 4))
    assert v.first is not None and v.recasts is not None and v.recasts()
    warmup, iters = 2, 3
    times, quant, bursts, failed = bm.time_group([v], iters, warmup, cuda=False)
    assert not failed and len(times["te"]) == iters and len(quant["te"]) == iters and len(bursts["te"]) == iters
    assert layer.experts.weight.grad is None  # freed after the row's turn: rows timed together hold none
    calls = [e for e in log if e[0] == "call"]
    # per iteration: a cached call, a first micro-batch, then a burst (one untimed step, BURST timed)
    per_it = 3 + bm.BURST
    assert len(calls) == per_it * (warmup + iters)
    # iteration 0's cached call is the layer's very first (Megatron starts True: it casts, in warm-up);
    # after it the cached calls pass False, the first-micro-batch calls True, every burst step False
    flags = [c[1] for c in calls]
    assert flags[0] is True and flags[1] is True
    assert flags[per_it::per_it] == [False] * (warmup + iters - 1)
    assert flags[1::per_it] == [True] * (warmup + iters)
    assert all(flags[i * per_it + j] is False for i in range(warmup + iters) for j in range(2, per_it))
    assert v.recast_calls == 0  # no timed (post-warm-up) cached call recast, in a burst either
    assert all(c[2] for c in calls)  # .grad was None at every forward: cleared before each step
    r = bm.summarize(v, [(times, quant, bursts, failed)])
    assert r["te_recast_calls"] == 0 and r["refresh_ms"] >= 0 and set(r["step_ms"]) == {"1", "8", "32"}
    assert r["back_to_back_ms"] > 0 and len(r["back_to_back_run_medians_ms"]) == 1


def test_recast_counted_when_a_timed_call_would_recast():
    log = []
    layer = FakeLayer(log)
    v = bm.Variant("te", lambda: layer(torch.ones(1, 4)), recasts=lambda: layer.experts.is_first_microbatch)
    v.prepare = layer.set_is_first_microbatch  # a harness that reset the flag before every timed call
    bm.time_group([v], 2, 1, cuda=False)
    assert v.recast_calls == 2 * (1 + bm.BURST)  # each timed iteration's cached call and burst steps


def test_profile_runs_and_wgrad_rate_in_the_table():
    """The profile block prints the busy time over the profiled steps and the per-expert cuBLAS FP8 GEMMs' rate
    (median [min-max]) where a row has them."""
    prof = {"busy_ms": 9.8, "by_class_ms": {"GEMM": 7.1, "other": 2.7}, "syncs": 1, "d2h": 1, "span_ms": 12.0,
            "gaps": [], "top_ms": [("nvjet_sm90_qqtst", 2.85)], "busy_runs_ms": [9.8, 9.7, 9.9],
            "span_runs_ms": [12.0, 12.2, 11.9], "fp8_cublas_runs_ms": [2.85, 2.86, 2.84],
            "cublas_fp8_gemms": ["wgrad"], "cublas_fp8_tflops_runs": [1012.6, 1009.1, 1016.2]}
    row = {"fwd_bwd_ms": 12.0, "runs_min_ms": 11.9, "runs_max_ms": 12.1, "refresh_ms": 0.4,
           "step_ms": {"1": 12.4, "8": 12.05, "32": 12.01}, "profile": prof}
    text = bm.format_table({"shapes": [{"shape": "s", "hidden": 7168, "ffn": 2048, "rows": {"r": row}}]})
    assert "busy over 3 profiled steps: 9.80 [9.70-9.90] ms, span 12.00" in text
    assert "cuBLAS FP8 GEMMs, one per expert (wgrad) in the step: 1013 [1009-1016] TFLOP/s" in text
    del prof["cublas_fp8_tflops_runs"], prof["busy_runs_ms"]
    text = bm.format_table({"shapes": [{"shape": "s", "hidden": 7168, "ffn": 2048, "rows": {"r": row}}]})
    assert "cuBLAS FP8 GEMMs" not in text and "profiled steps" not in text


def test_fp8_experts_idle_te_linears_not_counted():
    """The FP8 experts keep Megatron's TE linears but never call them (their is_first_microbatch stays
    True): they are no recast; the TE linears that run still are."""
    log = []
    layer = FakeLayer(log)
    layer.experts._fp8a2a_impl = object()  # an FP8 experts module: its own TE linear is idle
    cfg = types.SimpleNamespace(fp8=None)
    assert bm.layer_variant("fp8", layer, cfg, torch.ones(2, 4), torch.ones(2, 4)).recasts is None
    layer.router_linear = FakeTELinear(log)  # a TE linear outside the experts, which runs
    v = bm.layer_variant("fp8", layer, cfg, torch.ones(2, 4), torch.ones(2, 4))
    assert v.recasts()
    layer.router_linear.is_first_microbatch = False
    assert not v.recasts()


def test_no_bursts_leaves_out_the_back_to_back_keys():
    """burst=0 (the 256-expert table): no burst steps run, and summarize reports no back-to-back keys."""
    log = []
    v = bm.layer_variant("te", FakeLayer(log), types.SimpleNamespace(fp8=None), torch.ones(2, 4), torch.ones(2, 4))
    times, quant, bursts, failed = bm.time_group([v], 2, 1, cuda=False, burst=0)
    assert len([e for e in log if e[0] == "call"]) == 3 and bursts == {"te": []}  # one call per iteration
    r = bm.summarize(v, [(times, quant, bursts, failed)])
    assert "back_to_back_ms" not in r and "_bursts" not in r and r["fwd_bwd_ms"] > 0
