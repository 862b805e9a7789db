"""Try tile orders, BK = 256 and warp specialization for grouped_mm_fp8 at fc2's shape (K = 2048)
(--tries), and at every expert GEMM shape the two tile orders and one dense torch._scaled_mm per expert.

A copy of fp8a2a.triton_gemm's persistent kernel with three knobs: GROUP_M (1: d883e79's order,
the column tiles of one row tile in turn; g > 1: g row tiles share each column tile in turn, so a
wave of programs reads fewer distinct B tiles), FLAT (the committed flattened tile loop) and WS
(tl.range's warp_specialize, where this Triton has it). Bytes checked against the committed kernel.
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fp8a2a.kernels import sm_count
from fp8a2a.triton_gemm import _grouped_order, _row_tile, _tile_table, grouped_mm_fp8, FP8_TILE

FP8_TILE_SHORT_K = (256, 128, 128, 8, 4)  # d883e79's tile at K <= 2048


@triton.jit
def _kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, offs_ptr, N, K, E, s_sam, PROGRAMS: tl.constexpr,
            EB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            FLAT: tl.constexpr, WS: tl.constexpr):
    ee, starts, ends, tiles, cum = _tile_table(offs_ptr, E, BM, EB)
    num_n = tl.cdiv(N, BN)
    num_m = tl.sum(tiles, 0)
    tile_out = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLAT, warp_specialize=WS):
        m, n = _grouped_order(tile, num_m, num_n, GROUP_M)
        e, row0, _ = _row_tile(m, ee, starts, ends, tiles, cum, E, BM)
        n0 = n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([row0, k0])
            b = b_desc.load([e * N + n0, k0])
            acc = tl.dot(a, b.T, acc)
        tile_out += PROGRAMS
        m, n = _grouped_order(tile_out, num_m, num_n, GROUP_M)
        e, row0, row_end = _row_tile(m, ee, starts, ends, tiles, cum, E, BM)
        rm = row0 + tl.arange(0, BM)
        rn = n * BN + tl.arange(0, BN)
        m_ok = rm < row_end
        n_ok = rn < N
        sa = tl.load(sa_ptr + rm.to(tl.int64) * s_sam, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=n_ok, other=0.0)
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], (acc * sa[:, None] * sb[None, :]).to(tl.bfloat16),
                 mask=m_ok[:, None] & n_ok[None, :])


def variant(a, sa, w, sw, offs, tile, group_m=1, flat=True, ws=False, programs=None):
    M, K = a.shape
    E, N, _ = w.shape
    BM, BN, BK, warps, stages = tile
    out = torch.empty((M, N), device=a.device, dtype=torch.bfloat16)
    programs = programs or sm_count(a.device)
    _kernel[(programs,)](TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(w.view(E * N, K), [BN, BK]),
                         out, sa, sw, offs, N, K, E, sa.stride(0), PROGRAMS=programs, EB=triton.next_power_of_2(E),
                         BM=BM, BN=BN, BK=BK, GROUP_M=group_m, FLAT=flat, WS=ws, num_warps=warps, num_stages=stages)
    return out


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


TRIES = [dict(tile=FP8_TILE_SHORT_K)] + [dict(tile=FP8_TILE_SHORT_K, group_m=g) for g in (4, 8, 16)] + [
    dict(tile=FP8_TILE, group_m=8), dict(tile=(256, 128, 128, 8, 3)), dict(tile=(256, 128, 128, 8, 3), group_m=8),
    dict(tile=(256, 128, 256, 8, 2)), dict(tile=(128, 256, 256, 8, 2)), dict(tile=(256, 128, 64, 8, 6)),
    dict(tile=FP8_TILE_SHORT_K, flat=False), dict(tile=FP8_TILE_SHORT_K, flat=False, ws=True),
    dict(tile=FP8_TILE, flat=False, ws=True), dict(tile=(128, 256, 128, 8, 3), flat=False, ws=True),
    dict(tile=FP8_TILE_SHORT_K, programs=2 * 132)]

torch.manual_seed(0)
M = 32768
SHAPES = [(E, N, K) for E in (8, 16, 32) for N, K in ((7168, 2048), (4096, 7168), (2048, 7168), (7168, 4096))]
for E, N, K in SHAPES:  # fc2, fc1, dgrad of fc2, dgrad of fc1; the Triton variants at fc2's alone
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
    bounds = [0] + counts.cumsum(0).tolist()

    def per_expert():  # one dense rowwise-scaled torch._scaled_mm per expert (host counts), into one output
        out = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
        for g in range(E):
            s, t = bounds[g], bounds[g + 1]
            torch._scaled_mm(a[s:t], w[g].t(), sa[s:t, None], sw[g][None, :], out_dtype=torch.bfloat16,
                             use_fast_accum=True, out=out[s:t])
        return out
    try:
        d = (per_expert().float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        us = timeit(per_expert)
        print(f"  per-expert torch._scaled_mm: {us:.0f} us {fl / us / 1e6:.0f} TF/s {dense / us:.3f} of dense, "
              f"max diff / max {d:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  per-expert torch._scaled_mm: failed {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    for kw in TRIES if K == 2048 and "--tries" in sys.argv else []:
        try:
            out = variant(a, sa, w, sw, offs, **kw)
            eq = torch.equal(out, ref)
            us = timeit(lambda: variant(a, sa, w, sw, offs, **kw))
            print(f"  {kw}: {us:.0f} us {fl / us / 1e6:.0f} TF/s {dense / us:.3f} of dense, eq={eq}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report what does not compile and go on
            print(f"  {kw}: failed {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
