#!/usr/bin/env python
"""Where the time goes (one GPU): torch-profiler tables for the slow spots the benchmarks show.

    python scripts/profile_gpu.py [moe_layer] [experts] [pack_host] [dispatch_host]

moe_layer: one fp8a2a MoE-layer step (dispatch -> FP8GroupedMLP -> combine, forward + backward) at
the DeepSeek-V3 shape of scripts/bench_moe_layer.py, kernels by GPU time.
experts: FP8GroupedMLP forward + backward at 8 experts x 2048 rows, 7168 -> 2048 (default and
fp8_dgrad), kernels by GPU time.
pack_host: the host side of dispatch_pack at 256 x 4096 (CPU time per runtime call and op).
dispatch_host: Python's own profile (cProfile) of dispatch + combine at 128 tokens, world size 1.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fp8a2a  # noqa: E402
from fp8a2a import ops  # noqa: E402


def table(fn, steps=3, sort="cuda_time_total", rows=30, cpu_only=False):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([] if cpu_only else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)


def moe_layer():
    from bench_moe_layer import GPU_SHAPES, Paths
    p = Paths(GPU_SHAPES["deepseek-v3"], torch.device("cuda"), None, 0, 1)

    def step():
        p._zero()
        _, y = p.fp8()
        y.backward(p.gy)
    print("== MoE layer, DeepSeek-V3 shape, fp8a2a fwd+bwd, 3 steps\n" + table(step))


def experts():
    from fp8a2a.experts import FP8GroupedMLP
    from fp8a2a.reference import quantize_reference
    E, rows, H, Fh = 8, 2048, 7168, 2048
    tpe = torch.full((E,), rows, dtype=torch.int64, device="cuda")
    x = torch.randn(E * rows, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    for fp8_dgrad in (False, True):
        mlp = FP8GroupedMLP(E, H, Fh, "swiglu", fp8_dgrad=fp8_dgrad, device="cuda")
        xa = x.clone().requires_grad_()
        q = fp8a2a.QuantizedTensor(*quantize_reference(x, "row"), "row", grad_anchor=xa)

        def step():
            for t in [xa] + list(mlp.parameters()):
                t.grad = None
            mlp(q, tpe).backward(dy)
        print(f"== FP8GroupedMLP fwd+bwd, fp8_dgrad={fp8_dgrad}, 3 steps\n" + table(step))


def pack_host():
    T, H, K, E, R = 256, 4096, 8, 256, 8
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    row = ops.GRANULARITY["row"]

    def calls():
        for _ in range(50):
            ops.dispatch_pack(x, idx, w, E, R, row, None)
    print("== dispatch_pack host side, 256 x 4096, 150 calls (CPU time)\n"
          + table(calls, sort="self_cpu_time_total", cpu_only=True))


def dispatch_host():
    import cProfile
    import pstats
    import time
    T, H, E, K = 128, 7168, 256, 8
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    d = fp8a2a.Dispatcher(E, bf16_below_bytes=0)
    expert_out = torch.randn(d.dispatch(x, idx, w).handle.num_rows, H, device="cuda", dtype=torch.bfloat16)

    def step():
        d.combine(expert_out, d.dispatch(x, idx, w).handle)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    print(f"== dispatch + combine at {T} tokens: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us per step (host)")
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(200)])
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    what = sys.argv[1:] or ["moe_layer", "experts", "pack_host", "dispatch_host"]
    for name in what:
        globals()[name]()
