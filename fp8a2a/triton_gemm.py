"""Triton GEMMs of the expert path (fp8a2a.experts), re-exported by fp8a2a.triton_kernels, which the
experts load lazily (CPU machines need no Triton).

- grouped_mm: out[m] = sa[m] * (A[m] @ B[e(m)]^T) * sb[e(m)], rows grouped by expert through int32
  cumulative row ends (offs). A fp8 or bf16; sa none, per row [M] or per 128-block [M, K/128]
  (block scales are applied per K step: block128 input is consumed as it is); sb none or [E, N].
  B is given by strides, so the same kernel does the forward ([E, N, K] weights), the bf16 dgrad
  (W read transposed) and the fp8 dgrad (a [E, K, N] copy).
- grouped_mm_fp8: the same product for contiguous e4m3 operands with row scales, fed by TMA with
  one 128 x 256 x 128 tile and accumulating without promotion, one persistent program per SM: what
  the scaled_grouped_mm backend runs instead of torch._scaled_grouped_mm up to a few thousand rows
  per expert (faster there).
- grouped_wgrad: out[e] = G_e^T @ (sx * X_e): the weight gradient, consuming the saved FP8 input and
  its scales directly (no BF16 copy of the input).
- grouped_wgrad_fp8: the FP8 weight gradient with device counts (given host counts, experts.py
  runs one cuBLAS GEMM per expert on the same operands: ops.wgrad_fp8_per_expert), out[e] = A_e @ B_e^T
  reducing over expert e's token columns, both e4m3 operands scaled per 128 tokens and row
  (triton_kernels.block_col_quant_t's layout); the scales are applied per K step, as DeepGEMM and
  TE's blockwise GEMMs do.
"""
import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton 3.3+): grouped_mm_fp8
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: torch._scaled_grouped_mm only
    TensorDescriptor = None

from . import wire
from .kernels import capability, sm_count

SCALE_BLOCK = tl.constexpr(wire.BLOCK)  # values per block scale (block128): a global a kernel reads is a constexpr

_FP8_DOT = None  # whether tl.dot takes e4m3 on this device (sm_89+)


def _fp8_dot(device) -> bool:
    global _FP8_DOT
    if _FP8_DOT is None:
        _FP8_DOT = torch.cuda.get_device_capability(device) >= (8, 9)
    return _FP8_DOT


def _mm_configs():
    cfg = []
    for bm, bn, bk, w, s in [(128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
                             (64, 128, 128, 4, 4), (128, 256, 64, 8, 3)]:
        cfg.append(triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s))
    return cfg


@triton.jit
def _tile_table(offs_ptr, E, BM: tl.constexpr, EB: tl.constexpr):
    """Each expert's rows cut into tiles of BM (none straddles two experts), taken in order: the
    experts (EB >= E), their first rows, row ends, tile counts and the tiles' running sum."""
    ee = tl.arange(0, EB)
    ends = tl.load(offs_ptr + ee, mask=ee < E, other=0)
    starts = tl.load(offs_ptr + ee - 1, mask=(ee > 0) & (ee < E), other=0)
    tiles = tl.where(ee < E, (ends - starts + BM - 1) // BM, 0)
    return ee, starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _row_tile(tile_m, ee, starts, ends, tiles, cum, E, BM: tl.constexpr):
    """(expert or -1 past the last tile, first row, row end) of row tile tile_m of _tile_table."""
    e = tl.sum((cum <= tile_m).to(tl.int32), 0)  # the first expert whose tiles reach past tile_m
    sel = ee == e
    row0 = tl.sum(tl.where(sel, starts + (tile_m - cum + tiles) * BM, 0), 0)
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    return tl.where(e < E, e, -1), row0, row_end


@triton.jit
def _expert_tile(offs_ptr, E, N, BM: tl.constexpr, BN: tl.constexpr, EB: tl.constexpr):
    """(expert or -1, first row, row end, first column) of this program's output tile. The column
    tiles of one row tile are consecutive programs, so its rows and the expert's weights are read
    from L2 after the first."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    ee, starts, ends, tiles, cum = _tile_table(offs_ptr, E, BM, EB)
    e, row0, row_end = _row_tile(pid // num_n, ee, starts, ends, tiles, cum, E, BM)
    return e, row0, row_end, (pid % num_n) * BN


@triton.autotune(configs=_mm_configs(), key=["N", "K", "E", "A_SCALE", "B_SCALE", "UPCAST", "FP8"])
@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, offs_ptr, M, N, K, E,
                       s_am, s_ak, s_be, s_bn, s_bk, s_cm, s_cn, s_sam, s_sak, s_sbe,
                       A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
                       EB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e_sel, row0, row_end, n0 = _expert_tile(offs_ptr, E, N, BM, BN, EB)
    if e_sel < 0:
        return
    rm = row0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < row_end
    n_ok = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + e_sel.to(tl.int64) * s_be + rn.to(tl.int64)[None, :] * s_bn + rk[:, None] * s_bk
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.bfloat16)
            b = b.to(tl.bfloat16)
        if A_SCALE == 2:
            sa = tl.load(sa_ptr + rm.to(tl.int64) * s_sam + (k0 // SCALE_BLOCK) * s_sak, mask=m_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None]
        elif FP8:  # promote to fp32 every BK (Hopper's fp8 MMA accumulates with reduced precision)
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    if A_SCALE == 1:
        sa = tl.load(sa_ptr + rm.to(tl.int64) * s_sam, mask=m_ok, other=0.0)
        acc = acc * sa[:, None]
    if B_SCALE:
        sb = tl.load(sb_ptr + e_sel.to(tl.int64) * s_sbe + rn, mask=n_ok, other=0.0)
        acc = acc * sb[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_mm(a, b, offs, sa=None, sb=None, b_strides=None, n=None):
    """out [M, N] bf16 = sa * (a @ b[e]^T) * sb per expert group. b: [E, N, K] tensor, or any storage
    with b_strides=(s_e, s_n, s_k) and n=N given. sa: None, [M] (or stride-0 view) or [M, K/128]."""
    M, K = a.shape
    E = offs.shape[0]
    if b_strides is None:
        assert b.dim() == 3 and b.shape[2] == K
        n, b_strides = b.shape[1], b.stride()
    out = torch.empty((M, n), device=a.device, dtype=torch.bfloat16)
    if M == 0 or n == 0:
        return out
    if K == 0:
        return out.zero_()
    a_scale = 0 if sa is None else (2 if sa.dim() == 2 else 1)
    sa_ = sa if sa is not None else out
    s_sam, s_sak = (sa.stride(0), sa.stride(1) if sa.dim() == 2 else 0) if sa is not None else (0, 0)
    upcast = a.dtype == torch.float8_e4m3fn and not _fp8_dot(a.device)
    grid = lambda meta: ((triton.cdiv(M, meta["BM"]) + E) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    _grouped_mm_kernel[grid](a, b, out, sa_, sb if sb is not None else out, offs, M, n, K, E,
                             a.stride(0), a.stride(1), *b_strides, out.stride(0), out.stride(1),
                             s_sam, s_sak, sb.stride(0) if sb is not None else 0,
                             A_SCALE=a_scale, B_SCALE=sb is not None, UPCAST=upcast,
                             FP8=a.dtype == torch.float8_e4m3fn and not upcast, EB=triton.next_power_of_2(E))
    return out


# BM, BN, BK, warps, stages of grouped_mm_fp8 (BENCHMARKS.md, Expert GEMMs)
FP8_TILE = (128, 256, 128, 8, 4)


def fp8_group_m(K):
    """grouped_mm_fp8's default tile order for reduction K: at K <= 2048 (fc2's 16 steps of 128) 8
    row tiles share each column tile in turn (faster there, Expert GEMMs); else 1, the column tiles
    of one row tile in turn."""
    return 8 if K <= 2048 else 1


@triton.jit
def _grouped_order(t, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile t: GROUP_M row tiles take each column tile in turn, so
    that consecutive tiles read the same B tile from L2 (GROUP_M = 1: one row tile's column tiles in
    turn, which read the same A tile)."""
    width = GROUP_M * num_n
    first_m = (t // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % width) % rows, (t % width) // rows


@triton.jit
def _grouped_mm_fp8_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, offs_ptr, N, K, E, s_sam, PROGRAMS: tl.constexpr,
                           EB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           GROUP_M: tl.constexpr):
    """Persistent: PROGRAMS programs walk the output tiles (in _grouped_order); the loop over tiles is
    flattened into the K loop, so the next tile's loads are in flight during this one's epilogue
    (K = 2048 is only 16 steps of 128: a tile's pipeline fill and epilogue are not small beside its
    MMAs)."""
    ee, starts, ends, tiles, cum = _tile_table(offs_ptr, E, BM, EB)
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(N, BN)
    tile_out = tl.program_id(0) - PROGRAMS  # the epilogue's own tile counter: the pipeliner wants one
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
        tm, tn = _grouped_order(tile, num_m, num_n, GROUP_M)
        e, row0, _ = _row_tile(tm, ee, starts, ends, tiles, cum, E, BM)
        n0 = tn * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):  # rows past the expert's end are computed and not stored
            a = a_desc.load([row0, k0])
            b = b_desc.load([e * N + n0, k0])
            acc = tl.dot(a, b.T, acc)
        tile_out += PROGRAMS
        tm, tn = _grouped_order(tile_out, num_m, num_n, GROUP_M)
        e, row0, row_end = _row_tile(tm, ee, starts, ends, tiles, cum, E, BM)
        n0 = tn * BN
        rm = row0 + tl.arange(0, BM)
        rn = n0 + tl.arange(0, BN)
        m_ok = rm < row_end
        n_ok = rn < N
        sa = tl.load(sa_ptr + rm.to(tl.int64) * s_sam, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=n_ok, other=0.0)
        # a pointer store: a TMA store would write the next expert's rows (and Triton 3.6 cannot
        # flatten these loops around a branch between the two)
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], (acc * sa[:, None] * sb[None, :]).to(tl.bfloat16),
                 mask=m_ok[:, None] & n_ok[None, :])


def tma_ok(device) -> bool:
    """Whether the TMA kernels run on device: Triton with host TMA descriptors, sm_90+."""
    device = torch.device(device)
    return TensorDescriptor is not None and device.type == "cuda" and capability(device) >= (9, 0)


def fp8_tma_ok(a, w) -> bool:
    """Whether grouped_mm_fp8 takes these operands: tma_ok, contiguous e4m3 a [M, K] and w [E, N, K]
    with rows of a multiple of 16 bytes."""
    return (tma_ok(a.device) and a.dtype == w.dtype == torch.float8_e4m3fn and a.is_contiguous() and w.is_contiguous()
            and a.shape[1] % 16 == 0 and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def grouped_mm_fp8(a, sa, w, sw, offs, tile=None, group_m=None):
    """bf16 [M, N] = sa * (a @ w[e]^T) * sw[e] per expert group: e4m3 a [M, K] and w [E, N, K]
    (fp8_tma_ok), sa [M] (any stride), sw [E, N] contiguous. Operands through TMA, accumulation
    without promotion (what torch._scaled_grouped_mm does with use_fast_accum=True), one tile size
    (FP8_TILE, or `tile` to try another) in fp8_group_m's order (or `group_m`'s): faster than
    torch's at a few hundred rows per expert."""
    M, K = a.shape
    E, N, _ = w.shape
    out = torch.empty((M, N), device=a.device, dtype=torch.bfloat16)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    BM, BN, BK, warps, stages = tile or FP8_TILE
    programs = sm_count(a.device)  # a constant: the tile count lives on the device
    _grouped_mm_fp8_kernel[(programs,)](TensorDescriptor.from_tensor(a, [BM, BK]),
                                        TensorDescriptor.from_tensor(w.view(E * N, K), [BN, BK]), out, sa,
                                        sw.contiguous(), offs, N, K, E, sa.stride(0), PROGRAMS=programs,
                                        EB=triton.next_power_of_2(E), BM=BM, BN=BN, BK=BK,
                                        GROUP_M=group_m or fp8_group_m(K), num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _load_rows(x_ptr, sx_ptr, rm, rc, m_ok, c_ok, s_xm, s_xc, s_sxm, s_sxc, X_SCALE: tl.constexpr):
    """fp32 [BM, BC] tile of x (times its row or 128-block scale), 0 outside the mask."""
    rm64 = rm.to(tl.int64)
    ok = m_ok[:, None] & c_ok[None, :]
    v = tl.load(x_ptr + rm64[:, None] * s_xm + rc[None, :] * s_xc, mask=ok, other=0.0).to(tl.float32)
    if X_SCALE == 1:
        v = v * tl.load(sx_ptr + rm64 * s_sxm, mask=m_ok, other=0.0)[:, None]
    elif X_SCALE == 2:
        v = v * tl.load(sx_ptr + rm64[:, None] * s_sxm + (rc // SCALE_BLOCK)[None, :] * s_sxc, mask=ok, other=0.0)
    return v


def _wgrad_configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in [(64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4),
                                     (32, 128, 128, 4, 4)]]


@triton.autotune(configs=_wgrad_configs(), key=["N", "K", "E", "X_SCALE"])
@triton.jit
def _grouped_wgrad_kernel(g_ptr, x_ptr, sx_ptr, offs_ptr, out_ptr, N, K, E,
                          s_gm, s_gn, s_xm, s_xk, s_sxm, s_sxk, s_oe, s_on, s_ok,
                          X_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_k = tl.cdiv(K, BK)
    tile_n = pid // num_k
    tile_k = pid % num_k
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    rn = tile_n * BN + tl.arange(0, BN)
    rk = tile_k * BK + tl.arange(0, BK)
    n_ok = rn < N
    k_ok = rk < K
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for m0 in range(start, end, BM):
        rm = m0 + tl.arange(0, BM)
        m_ok = rm < end
        rm64 = rm.to(tl.int64)
        g = tl.load(g_ptr + rm64[:, None] * s_gm + rn[None, :] * s_gn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        x = _load_rows(x_ptr, sx_ptr, rm, rk, m_ok, k_ok, s_xm, s_xk, s_sxm, s_sxk, X_SCALE).to(tl.bfloat16)
        acc = tl.dot(tl.trans(g.to(tl.bfloat16)), x, acc)
    o = out_ptr + e.to(tl.int64) * s_oe + rn.to(tl.int64)[:, None] * s_on + rk[None, :] * s_ok
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def grouped_wgrad(g, x, offs, sx=None, out_dtype=torch.bfloat16):
    """out [E, N, K] = per expert e: g_e^T @ (sx * x_e); g [M, N] bf16, x [M, K] fp8 or bf16,
    sx None, [M] (or stride-0 view) or [M, K/128]. Experts without rows get zeros."""
    M, N = g.shape
    K = x.shape[1]
    E = offs.shape[0]
    out = torch.empty((E, N, K), device=g.device, dtype=out_dtype)
    if M == 0 or E == 0:
        return out.zero_()
    x_scale = 0 if sx is None else (2 if sx.dim() == 2 else 1)
    s_sxm, s_sxk = (sx.stride(0), sx.stride(1) if sx.dim() == 2 else 0) if sx is not None else (0, 0)
    grid = lambda meta: (triton.cdiv(N, meta["BN"]) * triton.cdiv(K, meta["BK"]), E)  # noqa: E731
    _grouped_wgrad_kernel[grid](g, x, sx if sx is not None else g, offs, out, N, K, E,
                                g.stride(0), g.stride(1), x.stride(0), x.stride(1), s_sxm, s_sxk,
                                *out.stride(), X_SCALE=x_scale)
    return out


# BM, BN, GROUP_M, warps, stages of grouped_wgrad_fp8: the fastest measured at DeepSeek-V3's expert
# shapes (BENCHMARKS.md, Expert GEMMs)
WGRAD_FP8_TILE = (128, 128, 8, 8, 3)


@triton.jit
def _grouped_wgrad_fp8_kernel(a_desc, b_desc, sa_ptr, sb_ptr, poffs_ptr, out_ptr, NA, NB, s_sa, s_sb, s_oe, s_om,
                              BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(NA, BM)
    num_n = tl.cdiv(NB, BN)
    e = pid // (num_m * num_n)
    tm, tn = _grouped_order(pid % (num_m * num_n), num_m, num_n, GROUP_M)
    m0 = tm * BM
    n0 = tn * BN
    pstart = tl.load(poffs_ptr + e - 1, mask=e > 0, other=0)
    pend = tl.load(poffs_ptr + e)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    m_ok = rm < NA
    n_ok = rn < NB
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # Each step's product is scaled one step late, while the next step's MMA runs: scaling it at
    # once makes every step wait for its MMA (measured slower). An expert without rows: zeros.
    prev = tl.zeros([BM, BN], dtype=tl.float32)
    sa_prev = tl.zeros([BM], dtype=tl.float32)
    sb_prev = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(pstart, pend, BK):
        a = a_desc.load([m0, k0])
        b = b_desc.load([n0, k0])
        kb = (k0 // BK).to(tl.int64)
        sa = tl.load(sa_ptr + kb * s_sa + rm, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + kb * s_sb + rn, mask=n_ok, other=0.0)
        d = tl.dot(a, b.T)
        acc += prev * (sa_prev[:, None] * sb_prev[None, :])
        prev, sa_prev, sb_prev = d, sa, sb
    acc += prev * (sa_prev[:, None] * sb_prev[None, :])
    o = out_ptr + e.to(tl.int64) * s_oe + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_wgrad_fp8(a, sa, b, sb, pad_offs, out_dtype=torch.bfloat16, tile=None):
    """out [E, NA, NB] = per expert e: sum over its 128-token blocks k of
    (sa[k] * a[:, k]) @ (sb[k] * b[:, k])^T; a [NA, mpad] and b [NB, mpad] e4m3 with scales
    sa [mpad/128, NA], sb [mpad/128, NB] (triton_kernels.block_col_quant_t), expert e's tokens in
    columns pad_offs[e-1]:pad_offs[e] (multiples of 128). One tile (WGRAD_FP8_TILE, or `tile`)."""
    (NA, _), NB, E = a.shape, b.shape[0], pad_offs.shape[0]
    out = torch.empty((E, NA, NB), device=a.device, dtype=out_dtype)
    if E == 0 or NA == 0 or NB == 0:
        return out
    BM, BN, group_m, warps, stages = tile or WGRAD_FP8_TILE
    BK = wire.BLOCK
    grid = (E * triton.cdiv(NA, BM) * triton.cdiv(NB, BN),)
    _grouped_wgrad_fp8_kernel[grid](TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]),
                                    sa, sb, pad_offs, out, NA, NB, sa.stride(0), sb.stride(0),
                                    out.stride(0), out.stride(1), BK=BK, BM=BM, BN=BN, GROUP_M=group_m,
                                    num_warps=warps, num_stages=stages)
    return out
