"""Where the host time of one eager dispatch + combine at 128 tokens goes (world size 1, NCCL): the
mean host time per call over 200 back-to-back calls (its host sync included), the profiler's ops by
self CPU time, and cProfile's Python functions. A diagnostic for the host-path work, not a benchmark
row: bench_dispatch.py's table is the measured figure.

    python benchmarks/profile_dispatch_host.py
"""
import cProfile
import pstats
import time

import torch
import torch.distributed as dist

from fp8a2a.bench import single_process_group

single_process_group("nccl")
import bench_dispatch as bd  # noqa: E402  (this script's own directory is on sys.path)

x = torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16)
idx, w = bd.routing(128, 256, 8, "cuda")
fn = bd.fp8a2a_step(x, idx, w, 256)
for _ in range(100):
    fn()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(200):
    fn()
torch.cuda.synchronize()
print(f"host+sync per call: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    fn()
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
dist.destroy_process_group()
