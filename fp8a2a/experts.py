"""Expert GEMMs that consume FP8 rows: grouped_linear and FP8GroupedMLP (public API, see README.md).

Layout. Rows are expert-major, as the dispatcher delivers them: expert e owns rows
offs[e-1]:offs[e], offs = cumsum(tokens_per_expert). Weights are [E, out, in], one nn.Linear per
expert: FP8GroupedMLP.fc1_weight is [E, 2*ffn, hidden] for swiglu (rows :ffn the gate, ffn: the up
projection, Megatron's chunk order; h = silu(gate) * up) or [E, ffn, hidden] for gelu / relu, and
fc2_weight is [E, hidden, ffn]. Outputs are bf16, rows in the input's order.

Numerics. Forward: y = (s_x * x_fp8) @ (s_w * w_fp8)^T with fp32 accumulation and both scales
applied inside the GEMM; w_fp8 is the BF16 master weight quantized per output channel, cached on the
weight and refreshed only when the weight changes (its version counter or storage). Between fc1 and
fc2 one kernel computes act(z) * router_weight and quantizes it per row for fc2. Backward is
straight-through for every quantization: dX = dY @ W on the BF16 master weights (fp8_dgrad=True:
an FP8 GEMM on the forward's FP8 weight, its bytes transposed, and dY times that weight's
per-output-channel scales, quantized per row), dW = dY^T @ x_hat in BF16 where x_hat is
rebuilt from the saved FP8 rows and scales: no BF16 copy of any GEMM input is saved.
fp8_wgrad=True (lossy; README's numerics give its effect on training) computes dW from FP8 operands
scaled as TE's blockwise recipe scales them: dY and x_hat quantized per 128 tokens of an expert and
column (1 x 128 along the GEMM's reduction; every expert padded to a multiple of 128 tokens), each
by one fused quantize-transpose (x_hat straight from the saved FP8 rows), then one cuBLAS GEMM per
expert with both 1 x 128 scales (cuBLASLt, all launched by one extension call:
ops.wgrad_fp8_per_expert; given tokens_per_expert on the host and large groups:
ExpertsConfig.cublas_wgrad_min_rows_per_expert) or one Triton grouped GEMM that applies both
scales per 128-token step (triton_kernels.grouped_wgrad_fp8, sm_90+). The 'reference'
backend emulates the same roundings (_block_col_quant_t); a machine without Triton or TMA keeps the
BF16 dW, with a warning.

Backends (backend=..., 'auto' picks the first that fits):
- 'scaled_grouped_mm': torch._scaled_grouped_mm (CUDA sm_90+, row scales) with fast accumulation
  by default (fast_accum=True: faster, and a slightly larger error against a BF16 GEMM of the
  dequantized operands). Block128 input goes to the Triton GEMM, which applies block scales as
  they are (ExpertsConfig.block128_native; False converts it to row scales, see _block_to_row). A
  shape the op refuses (e.g. K not a multiple of 16) goes to the Triton GEMM (warned once). Up to
  ExpertsConfig.tma_max_rows_per_expert rows per expert on average the fast-accumulation GEMM is
  triton_kernels.grouped_mm_fp8 instead: the same arithmetic and the same bytes out, with a
  128 x 256 x 128 tile fed by TMA, where that is faster than the op's smaller tile. Before either:
  given tokens_per_expert on the host (outside graph capture) and at least
  ExpertsConfig.dense_min_rows_per_expert rows per expert on average, one dense row-scaled cuBLAS
  GEMM per expert, all launched by one extension call (ops.mm_fp8_per_expert; faster than both on
  large groups; an extension built with a CUDA toolkit before 12.9 refuses it, with a warning, and
  the grouped GEMMs run).
- 'triton': the FP8 GEMMs in fp8a2a.triton_kernels (grouped GEMM with a row- or block128-scale
  epilogue, fp32 promotion every 128 of K), for CUDA machines without a usable _scaled_grouped_mm.
- 'reference': dequantize and loop over experts in fp32 (any device; the CPU path).
Both GPU backends do the BF16 backward GEMMs with torch._grouped_mm where it runs (the weight
gradient reads a transient BF16 x_hat made by one Triton pass), else with the Triton dgrad / wgrad
kernels (the latter reads the FP8 input directly), and the activation + quantization, its backward
and the row quantizations with Triton kernels (torch ops without Triton).
"""
import functools
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import ops
from .kernels import capability, capturing, constant, quantize_rows, triton_kernels, triton_ok
from .quant import QuantizedTensor, quantize, scale_rule
from .weight_cache import (dense_weight, expert_weights,  # noqa: F401  (expert_weights,
                           fp8_weight, invalidate_fp8_weight_cache, is_stand_in)  # invalidate...: re-exported)
from .wire import BLOCK, FP8

BACKENDS = ("auto", "scaled_grouped_mm", "triton", "reference")
ACTIVATIONS = ("swiglu", "gelu", "relu")
_SGMM_REFUSED = set()  # (N, K, device capability) shapes torch._scaled_grouped_mm refused
_DENSE_REFUSED = set()  # (device, N, K) where cuBLAS refused the per-expert GEMMs
_INT32_MAX = 2 ** 31 - 1  # the GEMMs' row offsets are int32


@dataclass(frozen=True)
class ExpertsConfig:
    """How the GPU backends run the expert GEMMs (which kernel, not what it computes).

    block128_native:          block128 input on the scaled_grouped_mm backend: True = the Triton
                              GEMM applies the block scales (exact, slower than the row-scaled op);
                              False = convert to row scales (_block_to_row: one Triton pass and one
                              more e4m3 rounding) and use torch._scaled_grouped_mm.
    tma_max_rows_per_expert:  average rows per expert up to which the scaled_grouped_mm backend's
                              fast-accumulation GEMMs run triton_kernels.grouped_mm_fp8 (faster than
                              torch's op over the range measured in BENCHMARKS.md); above it,
                              torch's op. 0: always torch's op. (Host counts from
                              dense_min_rows_per_expert: the per-expert GEMMs before either.)
    triton_backward:          the BF16 backward GEMMs use the Triton kernels even where
                              torch._grouped_mm runs (tests; torch builds without a working
                              _grouped_mm fall back by themselves).
    cublas_wgrad_min_rows_per_expert:
                              average rows per expert from which the FP8 weight gradient runs one
                              cuBLAS GEMM per expert (ops.wgrad_fp8_per_expert, 1 x 128 scales on
                              both operands: faster than the Triton grouped GEMM on large groups,
                              BENCHMARKS.md), when tokens_per_expert is on the host (the loop needs
                              the group bounds there, and a host sync is never added for them);
                              below it, or with device counts, the Triton grouped GEMM. 0: always
                              cuBLAS given host counts.
    dense_min_rows_per_expert:
                              likewise for the row-scaled FP8 GEMMs of the scaled_grouped_mm backend
                              (forward, FP8 dgrad): from this average, one dense cuBLAS GEMM per
                              expert (ops.mm_fp8_per_expert; faster than the grouped GEMMs on large
                              groups, BENCHMARKS.md)
                              when tokens_per_expert is on the host.
    """
    block128_native: bool = True
    tma_max_rows_per_expert: int = 4096
    triton_backward: bool = False
    cublas_wgrad_min_rows_per_expert: int = 1024
    dense_min_rows_per_expert: int = 4096

    def __post_init__(self):
        for name in ("tma_max_rows_per_expert", "cublas_wgrad_min_rows_per_expert", "dense_min_rows_per_expert"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"fp8a2a: {name} must be >= 0, got {getattr(self, name)}")


def _check_backend(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"fp8a2a: backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs on `device` (see the module docstring)."""
    _check_backend(backend)
    cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        if not cuda:
            return "reference"
        if hasattr(torch, "_scaled_grouped_mm") and capability(device) >= (9, 0):
            return "scaled_grouped_mm"
        return "triton" if triton_kernels() is not None else "reference"
    if backend != "reference" and not cuda:
        raise ValueError(f"fp8a2a: backend {backend!r} needs CUDA tensors; use 'reference' (or 'auto') on {device}")
    if backend == "triton" and triton_kernels() is None:
        raise ImportError("fp8a2a: backend 'triton' needs the triton package")
    if backend == "scaled_grouped_mm" and not hasattr(torch, "_scaled_grouped_mm"):
        raise RuntimeError(f"fp8a2a: torch {torch.__version__} has no torch._scaled_grouped_mm; use 'triton'")
    return backend


@dataclass(frozen=True)
class _Cfg:
    backend: str
    fp8_dgrad: bool = False
    fast_accum: bool = True
    activation: str = "swiglu"
    fp8_wgrad: bool = False
    tuning: ExpertsConfig = ExpertsConfig()


# ----------------------------------------------------------------------------------------------
# small helpers


def _dequant(xq, xs, dtype=torch.float32):
    """x_hat = xq * xs (row or block128 scales): the extension's dequantize kernel."""
    return ops.dequantize(xq.contiguous(), xs.contiguous(), dtype)


def _block_to_row(data, scale):
    """Convert block128 e4m3 rows to row scaling, for kernels without block scales
    (torch._scaled_grouped_mm): x_hat = data * block scale is requantized per row by the package rule
    (amax / 448), exactly quantize(dequantize(q), 'row'). One Triton kernel on CUDA (one read, one
    write of the rows); adds one rounding to every block whose amax is below its row's amax, which
    is why backend='auto' sends block128 input to the Triton GEMM (block scales applied per K step)."""
    if triton_ok(data):
        return triton_kernels().act_quant(data, None, "identity", z_scale=scale)
    return quantize_rows(_dequant(data, scale))


def _fold(xs, rw):
    """Scales with the router weights folded in (row: [M]; block: [M, H/128])."""
    if rw is None:
        return xs
    rw = rw.to(torch.float32)
    return xs * (rw if xs.dim() == 1 else rw[:, None])


# ----------------------------------------------------------------------------------------------
# the GEMMs of each backend


def _expert_rows(offs):
    """(e, rows of expert e) for every expert with rows; offs = cumulative row counts (host read)."""
    bounds = [0] + offs.tolist()
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]


def _ref_mm(a, b, offs):
    """fp32 [M, N]: a[rows of e] @ b[e]^T, a [M, K], b [E, N, K]; a loop over experts."""
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
    for e, rows in _expert_rows(offs):
        out[rows] = a[rows].float() @ b[e].float().t()
    return out


def _ref_wgrad(g, x, offs, num_experts):
    """fp32 [E, N, K]: g[rows of e]^T @ x[rows of e]."""
    out = g.new_zeros((num_experts, g.shape[1], x.shape[1]), dtype=torch.float32)
    for e, rows in _expert_rows(offs):
        out[e] = g[rows].float().t() @ x[rows].float()
    return out


@functools.lru_cache(None)
def _warn_fp8_wgrad_unavailable(backend):
    warnings.warn(f"fp8a2a: fp8_wgrad needs Triton with TMA (sm_90+); backend {backend!r} computes the BF16 "
                  "weight gradient here", RuntimeWarning, stacklevel=4)


def _warn_refused(err, op="torch._scaled_grouped_mm refused this shape", instead="the Triton grouped GEMM"):
    warnings.warn(f"fp8a2a: {op} ({err}); using {instead}", RuntimeWarning, stacklevel=3)


def _mm_fp8_per_expert(a, sa, wq, sw, counts, fast_accum):
    """bf16 [M, N] = sa * (a @ wq[e]^T) * sw[e], one dense row-scaled cuBLAS GEMM per expert with rows
    (host counts: the bounds of each), all launched by one extension call (ops.mm_fp8_per_expert);
    None where cuBLAS refuses."""
    try:  # (wq: fp8_weight's copies, contiguous as the op needs them, transposed ones too)
        return ops.mm_fp8_per_expert(a.contiguous(), sa, wq, sw, counts, fast_accum)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:  # cuBLAS refused this shape: remember, use the grouped GEMM
        _DENSE_REFUSED.add((a.device, wq.shape[1], a.shape[1]))
        _warn_refused(err, "cuBLAS refused the per-expert GEMMs", "the grouped GEMM")
        return None


def _dense_per_expert(tuning, counts, device, M, N, K) -> bool:
    """Whether _mm_fp8 runs one dense GEMM per expert: counts on the host, outside graph capture, at
    least tuning.dense_min_rows_per_expert rows per expert on average, a shape cuBLAS has not refused."""
    return (counts is not None and M >= tuning.dense_min_rows_per_expert * len(counts)
            and (device, N, K) not in _DENSE_REFUSED
            and not capturing(device))


def _mm_fp8(cfg, xq, xs, wq, sw, offs, counts=None):
    """bf16 [M, N] = xs * (xq @ wq[e]^T) * sw[e] per expert; xs [M] (any strides) or [M, K/128].
    counts: the rows per expert on the host, or None."""
    backend, fast_accum, tuning = cfg.backend, cfg.fast_accum, cfg.tuning
    M, N = xq.shape[0], wq.shape[1]
    if M == 0:
        return xq.new_zeros((0, N), dtype=torch.bfloat16)
    if backend == "scaled_grouped_mm" and xs.dim() == 2 and tuning.block128_native and triton_kernels() is not None:
        backend = "triton"
    if backend == "scaled_grouped_mm":
        key = (N, xq.shape[1], capability(xq.device))
        if key not in _SGMM_REFUSED:
            a, sa = _block_to_row(xq, xs) if xs.dim() == 2 else (xq, xs.contiguous())
            if _dense_per_expert(tuning, counts, xq.device, M, N, xq.shape[1]):
                out = _mm_fp8_per_expert(a, sa, wq, sw.contiguous(), counts, fast_accum)
                if out is not None:
                    return out
            if fast_accum and M <= tuning.tma_max_rows_per_expert * wq.shape[0] and triton_kernels() is not None \
                    and triton_kernels().fp8_tma_ok(a, wq):
                return triton_kernels().grouped_mm_fp8(a, sa, wq, sw, offs)
            try:
                return torch._scaled_grouped_mm(a, wq.transpose(-2, -1), sa, sw, offs=offs,
                                                out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:  # the op refused this shape: remember, use the Triton GEMM
                _SGMM_REFUSED.add(key)
                _warn_refused(err)
        backend = "triton" if triton_kernels() is not None else "reference"
    if backend == "triton":
        return triton_kernels().grouped_mm(xq, wq, offs, sa=xs, sb=sw)
    return _ref_mm(_dequant(xq, xs), _dequant(wq.flatten(0, 1), sw.flatten()).view(wq.shape), offs).to(torch.bfloat16)


def _dgrad(cfg, g, w, offs, counts=None):
    """bf16 [M, K] = g[rows of e] @ w[e], g [M, N] bf16, w [E, N, K] master weights."""
    M, K = g.shape[0], w.shape[2]
    if M == 0:
        return g.new_zeros((0, K), dtype=torch.bfloat16)
    if cfg.fp8_dgrad:  # the forward's FP8 weight, transposed; its scales (along N) folded into g
        wtq, sw = fp8_weight(w, transposed=True)
        gq, gs = _quant_col_scaled(cfg, g, sw, offs)
        return _mm_fp8(cfg, gq, gs, wtq, _unit_scales(w.shape[0], K, g.device), offs, counts)
    w = dense_weight(w)
    if cfg.backend == "reference":
        return _ref_mm(g, w.transpose(-2, -1), offs).to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    if hasattr(torch, "_grouped_mm") and not cfg.tuning.triton_backward:
        try:
            return torch._grouped_mm(g, wb, offs=offs, out_dtype=torch.bfloat16)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            pass
    if triton_kernels() is None:  # torch refused and no Triton: the reference loop
        return _ref_mm(g, w.transpose(-2, -1), offs).to(torch.bfloat16)
    return triton_kernels().grouped_mm(g, wb, offs, b_strides=(wb.stride(0), wb.stride(2), wb.stride(1)), n=K)


def _quant_col_scaled(cfg, g, col_scale, offs):
    """(e4m3 [M, N], scale [M]) of g * col_scale[e] per row of expert e, quantized per row: the FP8
    dgrad's dY with the weight's per-output-channel scales folded in, one Triton kernel on CUDA.
    Rows past the last group (counts that do not sum up, under check=False) take the last expert's."""
    if cfg.backend != "reference" and triton_ok(g):
        return triton_kernels().act_quant(g, None, "identity", col_scale=col_scale, offs=offs)
    return quantize_rows(g.float() * col_scale[_row_groups(offs, g.shape[0]).clamp_max(offs.shape[0] - 1)])


def _unit_scales(E, K, device):
    """float32 ones [E, K]: the B scales of a GEMM whose scales were folded into A, one per shape."""
    return constant(("unit_scales", E, K, torch.device(device)),
                    lambda: torch.ones((E, K), dtype=torch.float32, device=device))


def _row_groups(offs, rows):
    """int [rows]: the group (expert) of every row, on offs' device (no host sync)."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def _starts(ends):
    """Each group's first row from the cumulative group ends."""
    return F.pad(ends[:-1], (1, 0))


def _block_widths(counts):
    """Each group's rows padded to a multiple of 128 (whole scale blocks), from host counts."""
    return [-(-n // BLOCK) * BLOCK for n in counts]


def _wgrad_padding(offs, rows, counts=None):
    """(padded group ends int32 [G] on offs' device, column bound) of the FP8 weight gradient's
    operands: every group padded to a multiple of 128 tokens (no scale block straddles two experts).
    From the host counts where given (summed on the host, one copy in; the bound is then the padded
    groups' exact width, at least one block: an operand of width 0 has no TMA descriptor), else
    computed on the device (no host sync) into a buffer of static size."""
    if counts is not None:
        ends = list(itertools.accumulate(_block_widths(counts)))
        return torch.tensor(ends, dtype=torch.int32).to(offs.device, non_blocking=True), max([BLOCK] + ends[-1:])
    counts = offs - _starts(offs)
    pad_offs = torch.cumsum((counts + BLOCK - 1) // BLOCK * BLOCK, 0, dtype=torch.int32)
    return pad_offs, (rows + BLOCK - 1) // BLOCK * BLOCK + BLOCK * offs.shape[0]


def _block_col_quant_t(v, offs, pad_offs, mpad):
    """(e4m3 [C, mpad], scale f32 [mpad/128, C]): v [M, C] fp32 quantized per 128 tokens of a group
    and column by the package rule (amax / 448, IEEE divisions; scale 1 for an all-zero block),
    transposed, group g's rows in columns pad_offs[g-1]:pad_offs[g], zero-padded (TE blockwise's
    1 x 128 along the weight gradient's reduction). The numerics of the FP8 weight gradient: its
    CPU path, and the reference of triton_kernels.block_col_quant_t."""
    M, C = v.shape
    gid = _row_groups(offs, M)
    starts, pstarts = _starts(offs)[gid], _starts(pad_offs)[gid]
    padded = v.new_zeros((mpad, C))
    padded[pstarts + torch.arange(M, device=v.device) - starts] = v
    blocks = padded.view(mpad // BLOCK, BLOCK, C)
    qmul, scale = scale_rule(blocks.abs().amax(1))
    return (blocks * qmul[:, None]).to(FP8).view(mpad, C).t().contiguous(), scale


def _wgrad_fp8_reference(g, x_hat, offs, num_experts):
    """fp32 [E, N, K]: the FP8 weight gradient emulated, both operands rounded by _block_col_quant_t."""
    pad_offs, mpad = _wgrad_padding(offs, g.shape[0])
    (gq, gs), (xq, xs) = (_block_col_quant_t(v.float(), offs, pad_offs, mpad) for v in (g, x_hat))
    deq = [q.float() * s.t().repeat_interleave(BLOCK, 1) for q, s in ((gq, gs), (xq, xs))]
    return _ref_wgrad(deq[0].t(), deq[1].t(), pad_offs, num_experts)


_CUBLAS_BLOCKWISE_REFUSED = set()  # (device, out dtype, N, K) whose cuBLAS refused 1 x 128 scales


def _wgrad_fp8_per_expert(a, sa, b, sb, counts, out_dtype):
    """[E, out_f, in_f] from block_col_quant_t's operands, one cuBLAS blockwise GEMM per expert over
    its padded token columns (host counts: the bounds of each call), all launched by one call of the
    extension (ops.wgrad_fp8_per_expert); None where cuBLAS refuses."""
    try:
        return ops.wgrad_fp8_per_expert(a, sa, b, sb, _block_widths(counts), out_dtype)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:  # a cuBLAS without 1 x 128 scales: the Triton GEMM
        _CUBLAS_BLOCKWISE_REFUSED.add((a.device, out_dtype, a.shape[0], b.shape[0]))
        _warn_refused(err, "cuBLAS refused 1 x 128 block scales")
        return None


def _wgrad_fp8(g, xq, xs, offs, out_dtype, counts=None, tuning=ExpertsConfig()):
    """[E, out_f, in_f] = g_e^T @ x_hat_e from e4m3 operands quantized per 128 tokens and column by
    one fused quantize-transpose each (x_hat read from the saved FP8 rows); then one cuBLAS GEMM per
    expert (host counts, large groups: ExpertsConfig.cublas_wgrad_min_rows_per_expert) or one
    Triton grouped GEMM."""
    tk = triton_kernels()
    if capturing(g.device):  # a replay keeps its captured bounds: the device's
        counts = None
    pad_offs, mpad = _wgrad_padding(offs, g.shape[0], counts)  # host counts: one copy, the exact width
    per_expert = (counts is not None
                  and (g.device, out_dtype, g.shape[1], xq.shape[1]) not in _CUBLAS_BLOCKWISE_REFUSED
                  and g.shape[0] >= tuning.cublas_wgrad_min_rows_per_expert * len(counts))
    a, sa = tk.block_col_quant_t(g, offs, pad_offs, mpad)  # g^T [out_f, mpad]
    b, sb = tk.block_col_quant_t(xq, offs, pad_offs, mpad, sx=xs)  # x_hat^T [in_f, mpad]
    out = _wgrad_fp8_per_expert(a, sa, b, sb, counts, out_dtype) if per_expert else None
    return out if out is not None else tk.grouped_wgrad_fp8(a, sa, b, sb, pad_offs, out_dtype=out_dtype)


def _wgrad(cfg, g, xq, xs, offs, weight, counts=None):
    """[E, N, K] in weight.dtype = g[rows of e]^T @ x_hat[rows of e], x_hat = xs * xq (cfg.fp8_wgrad:
    both operands quantized per 128 tokens of an expert and column first). counts: the rows per
    expert on the host, or None."""
    E = weight.shape[0]
    if g.shape[0] == 0:
        return torch.zeros_like(weight)
    if cfg.fp8_wgrad and cfg.backend == "reference":
        return _wgrad_fp8_reference(g, _dequant(xq, xs), offs, E).to(weight.dtype)
    if cfg.fp8_wgrad and triton_kernels() is not None and triton_kernels().tma_ok(g.device):
        return _wgrad_fp8(g, xq, xs, offs, weight.dtype, counts, cfg.tuning)
    if cfg.fp8_wgrad:
        _warn_fp8_wgrad_unavailable(cfg.backend)
    if cfg.backend == "reference":
        return _ref_wgrad(g, _dequant(xq, xs), offs, E).to(weight.dtype)
    if hasattr(torch, "_grouped_mm") and not cfg.tuning.triton_backward:
        # a transient BF16 x_hat (one pass) + torch's grouped GEMM: faster than the fused Triton
        # wgrad (BENCHMARKS.md)
        x_hat = _dequant(xq, xs, torch.bfloat16)
        try:
            return torch._grouped_mm(g.t(), x_hat, offs=offs, out_dtype=torch.bfloat16).to(weight.dtype)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            pass
    if triton_kernels() is None:  # torch refused and no Triton: the reference loop
        return _ref_wgrad(g, _dequant(xq, xs), offs, E).to(weight.dtype)
    return triton_kernels().grouped_wgrad(g, xq, offs, sx=xs, out_dtype=weight.dtype)


def _act_torch(z, act):
    if act == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(z) if act == "gelu" else F.relu(z)


def _act_fwd(cfg, z, rw):
    """(e4m3 [M, F], scale [M]) of act(z) * rw, one fused kernel on CUDA."""
    if cfg.backend != "reference" and triton_ok(z):
        return triton_kernels().act_quant(z, rw, cfg.activation)
    h = _act_torch(z.float(), cfg.activation)
    if rw is not None:
        h = h * rw.float()[:, None]
    return quantize_rows(h)


def _act_bwd(cfg, z, dh, rw):
    """(dz like z, d rw f32 [M] or None) for h = act(z) * rw."""
    if cfg.backend != "reference" and triton_ok(z):
        return triton_kernels().act_bwd(z, dh, rw, cfg.activation)
    with torch.enable_grad():
        zf = z.detach().float().requires_grad_()
        rwf = rw.detach().float().requires_grad_() if rw is not None else None
        h = _act_torch(zf, cfg.activation)
        if rwf is not None:
            h = h * rwf[:, None]
        grads = torch.autograd.grad(h, [zf] + ([rwf] if rwf is not None else []), dh.float())
    return grads[0].to(z.dtype), (grads[1] if rwf is not None else None)


# ----------------------------------------------------------------------------------------------
# autograd


def _save(ctx, *tensors):
    """ctx.save_for_backward, but expert_weights stand-ins (no values: their identity names the
    parameters) are kept as they are, out of reach of saved-tensor hooks that would copy them, with
    their parameters' versions: autograd's check of a saved tensor, which their backward reads."""
    ctx.stand_ins = {i: (t, _versions(t)) for i, t in enumerate(tensors) if t is not None and is_stand_in(t)}
    ctx.save_for_backward(*(None if i in ctx.stand_ins else t for i, t in enumerate(tensors)))


def _versions(stand_in):
    """The sum of the version counters of a stand-in's parameters (each only grows: any in-place
    write changes the sum); None for inference tensors, which have none."""
    try:
        return sum(t._version for t in stand_in.__dict__["_fp8a2a_sources"])
    except RuntimeError:
        return None


def _saved(ctx):
    for t, version in ctx.stand_ins.values():
        if version is not None and _versions(t) != version:
            raise RuntimeError("fp8a2a: one of the variables needed for gradient computation has been modified by "
                               "an inplace operation: an expert weight (a parameter behind expert_weights) was "
                               "written between the forward and its backward")
    return tuple(ctx.stand_ins[i][0] if i in ctx.stand_ins else t for i, t in enumerate(ctx.saved_tensors))


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xq, xs, anchor, weight, rw, offs, counts, cfg):
        wq, sw = fp8_weight(weight)
        y = _mm_fp8(cfg, xq, _fold(xs, rw), wq, sw, offs, counts)
        _save(ctx, xq, xs, weight, rw, offs)  # FP8 rows + scales, not a BF16 copy
        ctx.cfg, ctx.counts, ctx.anchor_dtype = cfg, counts, (anchor.dtype if anchor is not None else None)
        return y

    @staticmethod
    @once_differentiable  # the GEMMs' backward is not differentiable: a double backward raises
    def backward(ctx, dy):
        xq, xs, weight, rw, offs = _saved(ctx)
        need_x, need_w, need_rw = ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dy = dy.to(torch.bfloat16).contiguous()
        dx = dw = drw = None
        if need_rw:  # d rw_i = dY_i . y_i before weighting: recompute that forward GEMM (no saved copy)
            wq, sw = fp8_weight(weight)
            drw = (dy.float() * _mm_fp8(ctx.cfg, xq, xs, wq, sw, offs, ctx.counts)).sum(1).to(rw.dtype)
        if need_x:
            gx = _dgrad(ctx.cfg, dy, weight, offs, ctx.counts)  # dY @ W, before the router weights
            dx = (gx if rw is None else gx * rw.to(torch.float32)[:, None]).to(ctx.anchor_dtype)
        if need_w:
            dw = _wgrad(ctx.cfg, dy, xq, _fold(xs, rw), offs, weight, ctx.counts)
        return None, None, dx, dw, drw, None, None, None


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xq, xs, anchor, w1, w2, rw, offs, counts, cfg):
        w1q, s1 = fp8_weight(w1)
        z = _mm_fp8(cfg, xq, xs, w1q, s1, offs, counts)  # [M, 2F or F] bf16
        hq, hs = _act_fwd(cfg, z, rw)  # act(z) * rw, quantized per row for fc2
        w2q, s2 = fp8_weight(w2)  # (after fc1's launch: the GPU starts it while the host looks this up)
        y = _mm_fp8(cfg, hq, hs, w2q, s2, offs, counts)
        _save(ctx, xq, xs, z, hq, hs, w1, w2, rw, offs)
        ctx.cfg, ctx.counts, ctx.anchor_dtype = cfg, counts, (anchor.dtype if anchor is not None else None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        xq, xs, z, hq, hs, w1, w2, rw, offs = _saved(ctx)
        cfg = ctx.cfg
        _, _, need_x, need_w1, need_w2, need_rw, _, _, _ = ctx.needs_input_grad
        dy = dy.to(torch.bfloat16).contiguous()
        dx = dw1 = dw2 = None
        if need_w2:
            dw2 = _wgrad(cfg, dy, hq, hs, offs, w2, ctx.counts)
        if not (need_x or need_w1 or need_rw):
            return None, None, None, None, dw2, None, None, None, None
        dh = _dgrad(cfg, dy, w2, offs, ctx.counts)
        dz, drw = _act_bwd(cfg, z, dh, rw)
        del dh
        if need_w1:
            dw1 = _wgrad(cfg, dz, xq, xs, offs, w1, ctx.counts)
        if need_x:
            dx = _dgrad(cfg, dz, w1, offs, ctx.counts).to(ctx.anchor_dtype)
        if drw is not None:
            drw = drw.to(rw.dtype)
        return None, None, dx, dw1, dw2, drw if need_rw else None, None, None, None


# ----------------------------------------------------------------------------------------------
# public API


def _checked_config(config) -> ExpertsConfig:
    if config is None:
        return ExpertsConfig()
    if not isinstance(config, ExpertsConfig):
        raise TypeError(f"fp8a2a: config must be an ExpertsConfig, got {type(config).__name__}")
    return config


def _as_quantized(q) -> QuantizedTensor:
    if isinstance(q, QuantizedTensor):
        return q
    if isinstance(q, torch.Tensor) and q.dim() == 2 and q.is_floating_point():
        return quantize(q.contiguous(), "row")  # the op takes contiguous rows; grads reach q
    raise TypeError(f"fp8a2a: expected a QuantizedTensor (or a 2-D float tensor), got {type(q).__name__}")


def _offsets(tokens_per_expert, rows, num_experts, device, check):
    """(offs int32 [E] on device, the counts on the host or None): counts given on the host are kept
    for a CUDA device when they are valid (the per-expert GEMMs take their bounds; not in a graph
    capture, whose replays would keep this call's bounds). Counts on the host are checked (unless check is False
    or 'async') and summed there, and reach the device in one copy; counts on the device, and
    counts on the host under check='async' or a graph capture, are summed on the device."""
    tpe = torch.as_tensor(tokens_per_expert)
    if (tpe.dim() != 1 or tpe.numel() != num_experts or tpe.is_floating_point() or tpe.is_complex()
            or tpe.dtype == torch.bool or tpe.device.type == "meta"):
        raise ValueError(f"fp8a2a: tokens_per_expert must be a 1-D integer tensor of {num_experts} counts "
                         f"(one per local expert), got {tpe.dtype} of shape {tuple(tpe.shape)} on {tpe.device}")
    if check not in (None, True, False, "sync", "async"):
        raise ValueError(f"fp8a2a: check must be None, True, False, 'sync' or 'async', got {check!r}")
    in_capture = capturing(device)
    on_host = tpe.device.type == "cpu"
    if check is None:
        check = "sync" if on_host else "async"
    counts = tpe.tolist() if on_host or check in (True, "sync") else None  # (counts on the GPU: a host sync)
    valid = counts is not None and min(counts, default=0) >= 0 and sum(counts) == rows
    if check in (True, "sync") and not valid:
        raise ValueError(f"fp8a2a: tokens_per_expert {counts} sums to {sum(counts)}, "
                         f"but the input has {rows} rows (they must match, no count negative)")
    # only valid counts: under check=False or 'async' nothing else stops wrong ones before the GEMMs
    host = tuple(counts) if on_host and valid and device.type == "cuda" and not in_capture else None
    if on_host and check != "async" and not in_capture:  # summed here, one copy in
        ends = list(itertools.accumulate(counts))
        if ends and max(ends) > _INT32_MAX:
            raise ValueError(f"fp8a2a: tokens_per_expert {counts}: the row offsets pass 2**31 - 1")
        return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True), host
    tpe = tpe.to(device, non_blocking=True)
    offs = torch.cumsum(tpe, 0, dtype=torch.int32)
    if check == "async" and num_experts and not in_capture:
        # summed in int64 (the int32 offsets wrap past 2^31), with every count in [0, rows] so
        # that the sum cannot wrap either; a negative count would make the offsets go back: the
        # GEMMs would read outside the groups
        lo, hi = torch.aminmax(tpe)
        torch._assert_async((tpe.sum() == rows) & (lo >= 0) & (hi <= rows),
                            "fp8a2a: tokens_per_expert does not sum to the rows given, or a count is negative "
                            "or above the rows")
    return offs, host


def _prepare(q, tokens_per_expert, num_experts, hidden, backend, check, router_weights):
    q = _as_quantized(q)
    xq, xs = q.data, q.scale
    M, H = xq.shape
    if H != hidden:
        raise ValueError(f"fp8a2a: input has {H} columns, the weight expects {hidden}")
    if router_weights is not None and router_weights.shape != (M,):
        raise ValueError(f"fp8a2a: router_weights must be [{M}], got {tuple(router_weights.shape)}")
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if xs.dim() == 0:  # tensor scale: a row scale that every row shares
        xs = xs.reshape(1).expand(M)
    be = resolve_backend(backend, xq.device)
    offs, counts = _offsets(tokens_per_expert, M, num_experts, xq.device, check)
    anchor = q.grad_anchor if torch.is_grad_enabled() else None
    return xq, xs, anchor, offs, counts, be


def grouped_linear(q, weight: torch.Tensor, tokens_per_expert, router_weights: Optional[torch.Tensor] = None,
                   *, backend: str = "auto", fp8_dgrad: bool = False, fp8_wgrad: bool = False,
                   fast_accum: bool = True, check=None, config: Optional[ExpertsConfig] = None):
    """y [N, out] bf16 = x_e @ weight[e]^T for the rows x_e of each local expert e.

    q: QuantizedTensor [N, in] (row, block128 or tensor scales), rows expert-major (a plain 2-D
    float tensor is quantized per row first). weight: [E, out, in] master weights (bf16), quantized
    per output channel and cached. tokens_per_expert: int [E], summing to N. router_weights: [N],
    multiplies each output row. Differentiable w.r.t. the input (through q.grad_anchor), weight and
    router_weights. backend, fp8_dgrad, fp8_wgrad, fast_accum, config: as for FP8GroupedMLP.
    check: None = verify the counts on the host when tokens_per_expert is on the CPU (ValueError;
    also the cheaper path to a GPU: the offsets go in one copy), an asynchronous device assert when
    it is on the GPU (no host sync); 'async' = that device assert wherever the counts are;
    True / 'sync' = a ValueError (a host sync for counts on the GPU); False = no check."""
    if weight.dim() != 3:
        raise ValueError(f"fp8a2a: weight must be [E, out, in], got shape {tuple(weight.shape)}")
    xq, xs, anchor, offs, counts, be = _prepare(q, tokens_per_expert, weight.shape[0], weight.shape[2], backend,
                                                check, router_weights)
    cfg = _Cfg(be, fp8_dgrad=fp8_dgrad, fast_accum=fast_accum, fp8_wgrad=fp8_wgrad,
               tuning=_checked_config(config))
    return _GroupedLinear.apply(xq, xs, anchor, weight, router_weights, offs, counts, cfg)


class FP8GroupedMLP(torch.nn.Module):
    """E local experts, each fc1 -> activation -> fc2, on expert-major FP8 rows (module docstring).

    fc1_weight [E, 2*ffn (swiglu: gate rows then up rows) or ffn, hidden], fc2_weight [E, hidden, ffn],
    master weights in `dtype` (bf16). forward(q, tokens_per_expert, router_weights=None) -> [N, hidden]
    bf16; router_weights [N] multiply the activation (where Megatron applies its probs).
    backend: 'auto' | 'scaled_grouped_mm' | 'triton' | 'reference'; fp8_dgrad: FP8 input-gradient
    GEMMs (default BF16); fp8_wgrad: FP8 weight-gradient GEMMs, operands quantized per 128 tokens
    of an expert and column (default BF16; lossy; sm_90+ with Triton, or the 'reference' backend,
    see the module docstring); fast_accum: torch._scaled_grouped_mm's (and the per-expert torch._scaled_mm's) fast accumulation (default on);
    config: an ExpertsConfig, how the GPU backends pick their kernels (default ExpertsConfig())."""

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, activation: str = "swiglu", *,
                 backend: str = "auto", fp8_dgrad: bool = False, fp8_wgrad: bool = False, fast_accum: bool = True,
                 device=None, dtype: torch.dtype = torch.bfloat16, config: Optional[ExpertsConfig] = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"fp8a2a: activation must be one of {ACTIVATIONS}, got {activation!r}")
        _check_backend(backend)
        self.num_local_experts, self.hidden, self.ffn_hidden = num_local_experts, hidden, ffn_hidden
        self.activation, self.backend, self.fp8_dgrad, self.fast_accum = activation, backend, fp8_dgrad, fast_accum
        self.fp8_wgrad, self.config = fp8_wgrad, _checked_config(config)
        fc1_out = (2 if activation == "swiglu" else 1) * ffn_hidden
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, fc1_out, hidden, device=device, dtype=dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():  # nn.Linear's default bound, per expert
            self.fc1_weight.uniform_(-1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))
            self.fc2_weight.uniform_(-1 / math.sqrt(self.ffn_hidden), 1 / math.sqrt(self.ffn_hidden))

    def forward(self, q, tokens_per_expert, router_weights: Optional[torch.Tensor] = None, *, check=None):
        return self.forward_with(self.fc1_weight, self.fc2_weight, q, tokens_per_expert, router_weights, check=check)

    def forward_with(self, fc1_weight, fc2_weight, q, tokens_per_expert, router_weights=None, *, check=None):
        """forward with these weights in place of the module's parameters (as
        torch.func.functional_call would, without its per-call swapping of the parameters, and
        without the module's hooks): e.g. expert_weights stand-ins of another module's per-expert
        parameters."""
        xq, xs, anchor, offs, counts, be = _prepare(q, tokens_per_expert, self.num_local_experts, self.hidden,
                                                    self.backend, check, router_weights)
        cfg = _Cfg(be, self.fp8_dgrad, self.fast_accum, self.activation, self.fp8_wgrad, self.config)
        return _GroupedMLP.apply(xq, xs, anchor, fc1_weight, fc2_weight, router_weights, offs, counts, cfg)

    def extra_repr(self):
        return (f"experts={self.num_local_experts}, hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"activation={self.activation}, backend={self.backend}, fp8_dgrad={self.fp8_dgrad}, "
                f"fp8_wgrad={self.fp8_wgrad}")
