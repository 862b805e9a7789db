"""Triton kernels of the expert path (fp8a2a.experts). Imported lazily: CPU machines need no Triton.
The GEMMs (grouped_mm, grouped_mm_fp8, grouped_wgrad, grouped_wgrad_fp8) live in fp8a2a.triton_gemm and are
re-exported here, so this is the one module to load.

- act_quant: activation (swiglu / gelu / relu / identity) * router weight, then e4m3 per row with the
  package's scale rule (amax / 448, IEEE divisions): one kernel, two passes over the row.
- act_bwd: the activation's backward and the router-weight gradient in one kernel.
- block_col_quant_t: e4m3 per 128 rows of an expert group and column (TE blockwise's 1 x 128 along
  the reduction), written transposed with every group padded to a multiple of 128 rows: the
  operands of the FP8 weight-gradient GEMM (grouped_wgrad_fp8, or cuBLAS per expert: experts.py).
"""
import torch
import triton
import triton.language as tl

from . import wire
# the GEMMs, and the tile loader the activation kernels share with the weight-gradient GEMM
from .triton_gemm import (FP8_TILE, SCALE_BLOCK, _load_rows, fp8_tma_ok,  # noqa: F401
                          grouped_mm, grouped_mm_fp8, grouped_wgrad, grouped_wgrad_fp8, tma_ok)

# The wire's constants the kernels read (fp8a2a.wire, csrc/fp8_common.h). A global a kernel reads
# must be a constexpr; these compile to the same immediates as the literals would.
E4M3_MAX = tl.constexpr(wire.E4M3_MAX)
AMAX_FLOOR = tl.constexpr(wire.AMAX_FLOOR)

ACT_CODE = {"identity": 0, "swiglu": 1, "gelu": 2, "relu": 3}


@triton.jit
def _act(g, u, ACT: tl.constexpr):
    if ACT == 1:
        return g / (1.0 + tl.exp(-g)) * u
    elif ACT == 2:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 3:
        return tl.maximum(g, 0.0)
    else:
        return g


@triton.jit
def _scale_rule(amax):
    """(quantize multiplier 448 / amax, dequant scale amax / 448): quant.scale_rule on the device, the
    same IEEE divisions, both 1 where amax is 0, a nonzero amax below AMAX_FLOOR counted as it."""
    zero = amax == 0.0
    a1 = tl.where(zero, 1.0, tl.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax))
    return tl.where(zero, 1.0, tl.math.div_rn(E4M3_MAX, a1)), tl.where(zero, 1.0, tl.math.div_rn(a1, E4M3_MAX))


@triton.jit
def _nan_of(v, axis: tl.constexpr):
    """NaN where a NaN is in v along axis, else 0: added to an amax, it makes the amax NaN-propagating
    (csrc/fp8_common.h's amax_step) whatever tl.max does with NaN."""
    return tl.sum(tl.where(v != v, v, 0.0), axis=axis)


@triton.jit
def _act_chunk(zr, zs_row, cs_row, off, F, w, ACT: tl.constexpr, Z_BLOCK: tl.constexpr, COL: tl.constexpr,
               BLOCK: tl.constexpr):
    """(act(z) * w for columns off .. off + BLOCK of a row (0 past F), their mask)."""
    c = off + tl.arange(0, BLOCK)
    ok = c < F
    g = tl.load(zr + c, mask=ok, other=0.0).to(tl.float32)
    if Z_BLOCK:  # z is e4m3 with 128-block scales (block128 -> row conversion)
        g = g * tl.load(zs_row + c // SCALE_BLOCK, mask=ok, other=0.0)
    if COL:  # times the row's expert's column scales (an FP8 dgrad's dY: the weight's scales folded in)
        g = g * tl.load(cs_row + c, mask=ok, other=0.0)
    u = g
    if ACT == 1:
        u = tl.load(zr + F + c, mask=ok, other=0.0).to(tl.float32)
    return _act(g, u, ACT) * w, ok


@triton.jit
def _act_quant_kernel(z_ptr, w_ptr, zs_ptr, cs_ptr, offs_ptr, q_ptr, s_ptr, F, E, s_z, s_zs, s_q,
                      ACT: tl.constexpr, HAS_W: tl.constexpr, Z_BLOCK: tl.constexpr, COL: tl.constexpr,
                      EB: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zr = z_ptr + row * s_z
    zs_row = zs_ptr + row * s_zs
    qr = q_ptr + row * s_q
    cs_row = cs_ptr
    if COL:  # the row's expert: how many groups end at or before it
        ee = tl.arange(0, EB)
        ends = tl.load(offs_ptr + ee, mask=ee < E, other=2147483647)
        e = tl.minimum(tl.sum((ends <= row).to(tl.int32), 0), E - 1)  # (rows past the last group: counts
        cs_row = cs_ptr + e.to(tl.int64) * F                            # that do not sum up, check=False)
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + row).to(tl.float32)
    if ONE_PASS:  # the row fits the block: read once
        h, ok = _act_chunk(zr, zs_row, cs_row, 0, F, w, ACT, Z_BLOCK, COL, BLOCK)
        qmul, scale = _scale_rule(tl.max(tl.where(ok, tl.abs(h), 0.0), axis=0) + _nan_of(h, 0))
        tl.store(qr + tl.arange(0, BLOCK), (h * qmul).to(tl.float8e4nv), mask=ok)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, F, BLOCK):  # pass 1: the row's amax
            h, ok = _act_chunk(zr, zs_row, cs_row, off, F, w, ACT, Z_BLOCK, COL, BLOCK)
            amax = tl.maximum(amax, tl.where(ok, tl.abs(h), 0.0))
            nan += tl.where(h != h, h, 0.0)
        qmul, scale = _scale_rule(tl.max(amax, axis=0) + _nan_of(nan, 0))
        for off in range(0, F, BLOCK):  # pass 2: recompute (cheaper than keeping the row) and quantize
            h, ok = _act_chunk(zr, zs_row, cs_row, off, F, w, ACT, Z_BLOCK, COL, BLOCK)
            tl.store(qr + off + tl.arange(0, BLOCK), (h * qmul).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + row, scale)


def _block(f):
    return max(128, min(4096, triton.next_power_of_2(max(f, 1))))


def act_quant(z, w, act, z_scale=None, col_scale=None, offs=None):
    """(data e4m3 [M, F], scale f32 [M]) of act(z) * w per row; F = z.shape[1] // 2 for swiglu.
    z_scale [M, F/128] (act 'identity'): z is e4m3 with block scales, converted to row scales.
    col_scale [E, F] f32 with offs (the expert groups' cumulative ends, int32 [E]): each row times its
    expert's column scales first."""
    M = z.shape[0]
    F = z.shape[1] // 2 if act == "swiglu" else z.shape[1]
    assert z.stride(1) == 1
    data = torch.empty((M, F), device=z.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((M,), device=z.device, dtype=torch.float32)
    if col_scale is not None:
        assert col_scale.is_contiguous() and col_scale.shape == (offs.shape[0], F)
    if M:
        one_pass = F <= 8192  # a row in registers: a warp per 512 columns
        blk = triton.next_power_of_2(max(F, 128)) if one_pass else _block(F)
        E = offs.shape[0] if col_scale is not None else 1
        _act_quant_kernel[(M,)](z, w if w is not None else scale, z_scale if z_scale is not None else scale,
                                col_scale if col_scale is not None else scale, offs if offs is not None else scale,
                                data, scale, F, E, z.stride(0), z_scale.stride(0) if z_scale is not None else 0,
                                data.stride(0), ACT=ACT_CODE[act], HAS_W=w is not None, Z_BLOCK=z_scale is not None,
                                COL=col_scale is not None, EB=triton.next_power_of_2(E), BLOCK=blk,
                                ONE_PASS=one_pass, num_warps=max(4, blk // 512))
    return data, scale


@triton.jit
def _act_bwd_kernel(z_ptr, dh_ptr, w_ptr, dz_ptr, dw_ptr, F, s_z, s_dh, s_dz,
                    ACT: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zr = z_ptr + row * s_z
    dzr = dz_ptr + row * s_dz
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, F, BLOCK):
        c = off + tl.arange(0, BLOCK)
        ok = c < F
        g = tl.load(zr + c, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row * s_dh + c, mask=ok, other=0.0).to(tl.float32)
        if ACT == 1:
            u = tl.load(zr + F + c, mask=ok, other=0.0).to(tl.float32)
            sg = 1.0 / (1.0 + tl.exp(-g))
            silu = g * sg
            tl.store(dzr + c, (dh * w * u * sg * (1.0 + g * (1.0 - sg))).to(dz_ptr.dtype.element_ty), mask=ok)
            tl.store(dzr + F + c, (dh * w * silu).to(dz_ptr.dtype.element_ty), mask=ok)
            acc += dh * silu * u
        elif ACT == 2:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
            tl.store(dzr + c, (dh * w * (cdf + g * pdf)).to(dz_ptr.dtype.element_ty), mask=ok)
            acc += dh * g * cdf
        else:
            tl.store(dzr + c, tl.where(g > 0.0, dh * w, 0.0).to(dz_ptr.dtype.element_ty), mask=ok)
            acc += dh * tl.maximum(g, 0.0)
    if HAS_W:
        tl.store(dw_ptr + row, tl.sum(acc, axis=0))


def act_bwd(z, dh, w, act):
    """(dz like z, dw f32 [M] or None) for h = act(z) * w."""
    M = z.shape[0]
    F = dh.shape[1]
    dh = dh if dh.stride(1) == 1 else dh.contiguous()
    dz = torch.empty_like(z)
    dw = torch.empty((M,), device=z.device, dtype=torch.float32) if w is not None else None
    if M:
        blk = _block(F)
        _act_bwd_kernel[(M,)](z, dh, w if w is not None else dz, dz, dw if dw is not None else dz, F,
                              z.stride(0), dh.stride(0), dz.stride(0), ACT=ACT_CODE[act], HAS_W=w is not None,
                              BLOCK=blk, num_warps=8 if blk >= 2048 else 4)
    return dz, dw


@triton.jit
def _block_col_quant_t_kernel(x_ptr, sx_ptr, offs_ptr, poffs_ptr, q_ptr, s_ptr, C, G, MPAD, S_STRIDE,
                              s_xm, s_xc, s_sxm, s_sxc,
                              X_SCALE: tl.constexpr, GB: tl.constexpr, BC: tl.constexpr):
    # one 128-row block of the padded layout x one column tile: read once, amax per column,
    # quantize, store transposed
    blk = tl.program_id(0)
    p0 = blk * SCALE_BLOCK
    gg = tl.arange(0, GB)
    pends = tl.load(poffs_ptr + gg, mask=gg < G, other=2147483647)
    g = tl.sum((pends <= p0).to(tl.int32), 0)  # the group whose padded rows hold this block
    if g >= G:  # past the last group: never read by the GEMM
        return
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    pstart = tl.load(poffs_ptr + g - 1, mask=g > 0, other=0)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = rc < C
    rm = start + (p0 - pstart) + tl.arange(0, SCALE_BLOCK)
    v = _load_rows(x_ptr, sx_ptr, rm, rc, rm < end, c_ok, s_xm, s_xc, s_sxm, s_sxc, X_SCALE)  # 0 past end
    qmul, scale = _scale_rule(tl.max(tl.abs(v), axis=0))
    q = tl.trans(v * qmul[None, :]).to(tl.float8e4nv)  # [BC, 128]: rows of data are columns of x
    rp = p0 + tl.arange(0, SCALE_BLOCK)
    tl.store(q_ptr + rc.to(tl.int64)[:, None] * MPAD + rp[None, :], q, mask=c_ok[:, None])
    tl.store(s_ptr + blk.to(tl.int64) * S_STRIDE + rc, scale, mask=c_ok)


def block_col_quant_t(x, offs, pad_offs, mpad, sx=None):
    """(data e4m3 [C, mpad], scale f32 [mpad / 128, C]) of x [M, C] (bf16 / fp32, or e4m3 times sx:
    [M] row scales, any strides, or [M, C/128] block scales) quantized per 128 rows of a group and
    column by the package rule, transposed: experts._block_col_quant_t's layout and bytes. Columns
    past pad_offs[-1] are left unwritten."""
    M, C = x.shape
    G = offs.shape[0]
    data = torch.empty((C, mpad), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((mpad // wire.BLOCK, C), device=x.device, dtype=torch.float32)
    if G == 0 or C == 0 or mpad == 0:
        return data, scale
    x_scale = 0 if sx is None else (2 if sx.dim() == 2 else 1)
    s_sxm, s_sxc = (sx.stride(0), sx.stride(1) if sx.dim() == 2 else 0) if sx is not None else (0, 0)
    BC = 64
    _block_col_quant_t_kernel[(mpad // wire.BLOCK, triton.cdiv(C, BC))](
        x, sx if sx is not None else scale, offs, pad_offs, data, scale, C, G, mpad, scale.stride(0),
        x.stride(0), x.stride(1), s_sxm, s_sxc, X_SCALE=x_scale, GB=triton.next_power_of_2(G), BC=BC, num_warps=4)
    return data, scale


# ---------------------------------------------------------------------------------------------
# FP8 expert weights: E experts' [N, K] weights quantized in one launch, read from one [E, N, K]
# tensor or through a table of the experts' addresses (expert_weights stand-ins: no stack).
# ---------------------------------------------------------------------------------------------
@triton.jit
def _expert_src(x_ptr, tab_ptr, e, s_e, PTRS: tl.constexpr, VEC: tl.constexpr):
    """Pointer to expert e's [N, K] weight: x + e * s_e, or (PTRS) x + tab[e] * VEC, tab holding each
    expert's address less x's in units of VEC elements (VEC elements = 16 bytes where every address
    allows it: the offset's known divisibility lets the loads be vectorized)."""
    if PTRS:
        src = x_ptr + tl.load(tab_ptr + e) * VEC
    else:
        src = x_ptr + e.to(tl.int64) * s_e
    return src


@triton.jit
def _weight_quant_rows_kernel(x_ptr, tab_ptr, q_ptr, s_ptr, N, K, s_e, s_n,
                              PTRS: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One row (output channel) of one expert per program."""
    e = tl.program_id(0) // N
    n = tl.program_id(0) % N
    src = _expert_src(x_ptr, tab_ptr, e, s_e, PTRS, VEC) + n.to(tl.int64) * s_n
    c = tl.arange(0, BLOCK)
    row = e.to(tl.int64) * N + n
    qr = q_ptr + row * K
    if ONE_PASS:  # the row fits the block: one read
        ok = c < K
        v = tl.load(src + c, mask=ok, other=0.0).to(tl.float32)
        qmul, scale = _scale_rule(tl.max(tl.abs(v), axis=0) + _nan_of(v, 0))
        tl.store(qr + c, (v * qmul).to(tl.float8e4nv), mask=ok)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, K, BLOCK):  # pass 1: the row's amax
            cc = off + c
            v = tl.load(src + cc, mask=cc < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
            nan += tl.where(v != v, v, 0.0)
        qmul, scale = _scale_rule(tl.max(amax, axis=0) + _nan_of(nan, 0))
        for off in range(0, K, BLOCK):  # pass 2: quantize (the row is read again from L2)
            cc = off + c
            ok = cc < K
            v = tl.load(src + cc, mask=ok, other=0.0).to(tl.float32)
            tl.store(qr + cc, (v * qmul).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """y[e] = x[e]^T for [E, N, K] bytes, one BN x BK tile per program."""
    base = tl.program_id(2).to(tl.int64) * N * K
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    v = tl.load(x_ptr + base + rn.to(tl.int64)[:, None] * K + rk[None, :], mask=ok)
    tl.store(y_ptr + base + rk.to(tl.int64)[:, None] * N + rn[None, :], tl.trans(v), mask=tl.trans(ok))


WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRANSPOSE_TILE = (64, 128)  # BN, BK of transpose_bytes: the fastest of 9 measured on an H200


def _weight_source(w):
    """(x, tab, s_e, s_n, PTRS, VEC, E, N, K) of an [E, N, K] weight or a sequence of E [N, K] ones."""
    if isinstance(w, torch.Tensor):
        E, N, K = w.shape
        assert w.stride(2) == 1
        x, tab, s_e, s_n, ptrs, vec = w, None, w.stride(0), w.stride(1), False, 1
    else:
        E = len(w)
        x = w[0]
        N, K = x.shape
        assert all(t.shape == x.shape and t.dtype == x.dtype and t.device == x.device and t.stride() == x.stride()
                   for t in w) and x.stride(1) == 1
        s_e, s_n, ptrs = 0, x.stride(0), True
        size = x.element_size()
        deltas = [(t.data_ptr() - x.data_ptr()) // size for t in w]  # in elements: same dtype, so exact
        vec = 16 // size if all(t.data_ptr() % 16 == 0 for t in w) else 1
        # a pageable host tensor copied without a host sync (the copy is staged before this returns)
        tab = torch.tensor([d // vec for d in deltas], dtype=torch.int64).to(x.device, non_blocking=True)
    assert x.dtype in WEIGHT_DTYPES and x.is_cuda
    return x, tab, s_e, s_n, ptrs, vec, E, N, K


def expert_weight_quant(w):
    """(data e4m3 [E, N, K], scale f32 [E, N]) of E experts' [N, K] weights per output channel by the
    package rule, in one launch: the bytes of quantize(w.reshape(E*N, K), 'row'). w: an [E, N, K]
    tensor with stride(2) == 1, or a sequence of E [N, K] tensors of one shape, dtype, device and
    strides, stride(1) == 1 (read through a table of their addresses: no stack). Reads the weights
    once (past K 8192 twice, the second from L2)."""
    x, tab, s_e, s_n, ptrs, vec, E, N, K = _weight_source(w)
    data = torch.empty((E, N, K), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((E, N), device=x.device, dtype=torch.float32)
    if data.numel() == 0:
        return data, scale.fill_(1.0)  # no elements: amax 0 -> scale 1
    blk = max(128, min(8192, triton.next_power_of_2(K)))
    _weight_quant_rows_kernel[(E * N,)](x, tab if tab is not None else scale, data, scale, N, K, s_e, s_n,
                                        PTRS=ptrs, VEC=vec, BLOCK=blk, ONE_PASS=K <= blk, num_warps=4)
    return data, scale


def transpose_bytes(q):
    """[E, K, N] contiguous: the transpose of each [N, K] matrix of a contiguous 1-byte [E, N, K]
    tensor (an FP8 weight's bytes, as the FP8 dgrad reads them)."""
    E, N, K = q.shape
    assert q.is_contiguous() and q.element_size() == 1
    out = torch.empty((E, K, N), device=q.device, dtype=q.dtype)
    if out.numel():
        BN, BK = TRANSPOSE_TILE
        _transpose_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK), E)](q.view(torch.uint8), out.view(torch.uint8),
                                                                        N, K, BN=BN, BK=BK, num_warps=4)
    return out
