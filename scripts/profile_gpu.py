#!/usr/bin/env python
"""Where the time goes (one GPU): torch-profiler tables for the slow spots the benchmarks show.

    python scripts/profile_gpu.py [moe_layer] [experts] [pack_device] [capacity_step] [pack_host] [dispatch_host]
    ncu --clock-control none -k regex:dispatch_ python scripts/profile_gpu.py pack_calls

moe_layer: one fp8a2a MoE-layer step (dispatch -> FP8GroupedMLP -> combine, forward + backward; default,
fp8_dgrad, fp8_dgrad + fp8_wgrad) at the DeepSeek-V3 shape of scripts/bench_moe_layer.py, kernels by
GPU time.
experts: FP8GroupedMLP forward + backward at 8 experts x 2048 rows, 7168 -> 2048 (default and
fp8_dgrad), kernels by GPU time.
pack_device: dispatch_pack's two kernels (layout, pack) at bench_kernels' size, next to torch's fill_
of the send buffer (slow: 0.8 of copy; scripts/pack_roofline.cu times fills that reach copy speed and
the op's memory pattern without layout work) and the raw (unquantized, read once write per rank) pack.
capacity_step: kernels of one capacity-mode dispatch + combine at 128 tokens (bench_dispatch's graph step).
pack_calls: a few bare dispatch_pack calls at that size, for ncu.
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

    for name in ("fp8", "fp8_dgrad", "fp8_bwd"):
        def step():
            p._zero()
            _, y = getattr(p, name)()
            y.backward(p.gy)
        print(f"== MoE layer, DeepSeek-V3 shape, fp8a2a ({name}) fwd+bwd, 3 steps\n" + table(step))


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


def _pack_case():
    T, H, K, E, R = 16384, 7168, 8, 256, 8
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    return x, idx, w, E, R


def pack_device():
    from fp8a2a.timing import cuda_median_ms
    x, idx, w, E, R = _pack_case()
    row = ops.GRANULARITY["row"]
    send, _, _ = ops.dispatch_pack(x, idx, w, E, R, row, None)
    raw, _, _ = ops.dispatch_pack(x.view(torch.uint8), idx, w, E, R, ops.RAW, None)
    src = torch.empty(send.numel() // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    print(f"== send rows {send.shape}, raw rows {raw.shape}")
    for name, fn, nbytes in (
            ("dispatch_pack row", lambda: ops.dispatch_pack(x, idx, w, E, R, row, None), x.nbytes + send.nbytes),
            ("dispatch_pack raw", lambda: ops.dispatch_pack(x.view(torch.uint8), idx, w, E, R, ops.RAW, None),
             x.nbytes + raw.nbytes),
            ("fill send buffer (write only)", lambda: send.fill_(1), send.nbytes),
            ("copy of the same total bytes", lambda: dst.copy_(src), 2 * src.nbytes)):
        ms = cuda_median_ms(fn, iters=50)
        print(f"{name:32s} {ms:8.3f} ms  {nbytes / ms / 1e9:8.2f} TB/s")
    print("== dispatch_pack kernels\n" + table(lambda: ops.dispatch_pack(x, idx, w, E, R, row, None), steps=10))


def capacity_step():
    from bench_dispatch import dispatch_combine_step, routing
    torch.manual_seed(0)
    x = torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16)
    idx, w = routing(128, 256, 8)
    step = dispatch_combine_step(fp8a2a.Dispatcher(256, capacity_factor=2.0), x, idx, w)
    print("== capacity-mode dispatch + combine, 128 tokens, 10 steps\n" + table(step, steps=10, rows=40))


def pack_calls():
    x, idx, w, E, R = _pack_case()
    for _ in range(4):
        ops.dispatch_pack(x, idx, w, E, R, ops.GRANULARITY["row"], None)
    torch.cuda.synchronize()


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
    what = sys.argv[1:] or ["moe_layer", "experts", "pack_device", "capacity_step", "pack_host", "dispatch_host"]
    for name in what:
        globals()[name]()
