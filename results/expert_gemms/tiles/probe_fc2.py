"""grouped_mm_fp8 at the layer's four expert GEMM shapes: its two tile orders (group_m 1: one row
tile's column tiles in turn; 8: 8 row tiles share each column tile in turn), bytes checked against
its default, and one dense torch._scaled_mm per expert (host counts), against one dense GEMM of the
same total size. (Its first run also timed other tiles, BK, stages, loop flattening and warp
specialization through a copy of the kernel with those knobs, not kept: fc2_probe_h100.txt.)
"""
import torch

from fp8a2a import experts
from fp8a2a.triton_gemm import grouped_mm_fp8


def timeit(f, n=20):
    for _ in range(3):
        f()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        f()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2] * 1e3


torch.manual_seed(0)
M = 32768
SHAPES = [(E, N, K) for E in (8, 16, 32) for N, K in ((7168, 2048), (4096, 7168), (2048, 7168), (7168, 4096))]
for E, N, K in SHAPES:  # fc2, fc1, dgrad of fc2, dgrad of fc1
    counts = torch.full((E,), M // E)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(E, N, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(M, device="cuda")
    sw = torch.rand(E, N, device="cuda")
    fl = 2 * M * N * K
    big = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    one_a, one_b = torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda")
    dense = timeit(lambda: torch._scaled_mm(a, big.t(), one_a, one_b, out_dtype=torch.bfloat16, use_fast_accum=True))
    ref = grouped_mm_fp8(a, sa, w, sw, offs)
    base = timeit(lambda: grouped_mm_fp8(a, sa, w, sw, offs))
    print(f"E={E} N={N} K={K}: dense {dense:.0f} us ({fl / dense / 1e6:.0f} TF/s); committed default "
          f"{base:.0f} us ({dense / base:.3f} of dense)", flush=True)
    for g in (1, 8):
        eq = torch.equal(grouped_mm_fp8(a, sa, w, sw, offs, group_m=g), ref)
        us = timeit(lambda: grouped_mm_fp8(a, sa, w, sw, offs, group_m=g))
        print(f"  group_m={g}: {us:.0f} us {fl / us / 1e6:.0f} TF/s {dense / us:.3f} of dense, eq={eq}", flush=True)
    counts_host = counts.tolist()

    def per_expert():  # what the experts run with host counts from dense_min_rows_per_expert rows per expert
        return experts._mm_fp8_per_expert(a, sa, w, sw, counts_host, True)
    try:
        d = (per_expert().float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        us = timeit(per_expert)
        print(f"  per-expert torch._scaled_mm: {us:.0f} us {fl / us / 1e6:.0f} TF/s {dense / us:.3f} of dense, "
              f"max diff / max {d:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  per-expert torch._scaled_mm: failed {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
