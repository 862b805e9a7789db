"""Probe (GPU): wall time against summed kernel time of one DeepSeek-V3 MoE-layer step (forward +
backward, world size 1) for each path of scripts/bench_moe_layer.py, and the caching allocator's
device allocations per step: is the GPU idle inside a step, and is the allocator why.

    python scripts/probe_moe_idle.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench_moe_layer import GPU_SHAPES, Paths, make_megatron_dispatcher  # noqa: E402


def main():
    dev = torch.device("cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    p = Paths(GPU_SHAPES["deepseek-v3"], dev, None, 0, 1)
    try:
        p.megatron, p.megatron_note = make_megatron_dispatcher(GPU_SHAPES["deepseek-v3"], 1)
    except Exception as exc:  # noqa: BLE001
        print("megatron:", exc)
    names = ["fp8", "fp8_dgrad", "replica_bf16"] + (["megatron_bf16"] if p.megatron is not None else [])
    for n in names:
        def step():
            p._zero()
            _, y = getattr(p, n)()
            y.backward(p.gy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        s0 = torch.cuda.memory_stats()
        walls = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            step()
            b.record()
            b.synchronize()
            walls.append(a.elapsed_time(b))
        s1 = torch.cuda.memory_stats()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        kern = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
        d = {k: (s1.get(k, 0) - s0.get(k, 0)) / 5 for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
        walls.sort()
        print(f"{n:14s} wall median {walls[2]:7.3f} ms (min {walls[0]:.3f})  GPU kernel sum {kern:7.3f} ms  "
              f"idle {walls[2] - kern:6.3f} ms  per step: {d}  peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB",
              flush=True)


if __name__ == "__main__":
    main()
