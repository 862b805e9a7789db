"""QuantizedTensor and the quantize / dequantize entry points (public API, see README.md).

Scale rule (csrc/fp8_common.h): per row or 128-block, amax = max |x|; data = e4m3(x * (448 / amax)),
scale = amax / 448, so x ~= data.float() * scale. An all-zero row gets scale 1; a nonzero amax below
2^-117 counts as 2^-117 (448 / amax would overflow). A row holding NaN or Inf dequantizes to NaN.
Casts are round-to-nearest-even and saturate at +-448.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import ops
from .wire import AMAX_FLOOR, E4M3_MAX, Granularity


@dataclass(eq=False)  # compared by identity, like tensors (field-wise == of tensors is ambiguous)
class QuantizedTensor:
    data: torch.Tensor  # float8_e4m3fn [T, H]
    scale: torch.Tensor  # float32: [T] row, [T, H // 128] block128, [] tensor
    granularity: str = "row"
    # Gradient carrier (internal): dequantize/grouped_linear hand their input gradient to this
    # tensor (straight-through), which reaches x or the dispatcher's backward. Not printed: for
    # dispatched rows it is an expanded placeholder, never read.
    grad_anchor: Optional[torch.Tensor] = field(default=None, repr=False)
    # Dispatched rows of a non-float32 x only: a float32 carrier that dequantize(dtype=float32)
    # hands its gradient to, so that it reaches the dispatch's backward without a cast to x's dtype.
    grad_anchor_float32: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def shape(self):
        return self.data.shape

    def __len__(self):
        return self.data.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar on x's device (0 for an empty tensor)."""
    return x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)


def scale_rule(amax: torch.Tensor):
    """(quant multiplier 448 / amax, dequant scale amax / 448) of float32 amaxes by the package rule
    (csrc/fp8_common.h; wire.E4M3_MAX, wire.AMAX_FLOOR): IEEE divisions (torch.div), both 1 where
    amax is 0, a nonzero amax below AMAX_FLOOR counted as AMAX_FLOOR, NaN kept. The one Python copy
    of the rule; triton_kernels._scale_rule is its device twin."""
    zero, one = amax == 0, torch.ones_like(amax)
    a = torch.where(zero, one, amax.clamp_min(AMAX_FLOOR))  # clamp keeps NaN
    top = torch.full_like(amax, E4M3_MAX)
    return torch.where(zero, one, torch.div(top, a)), torch.where(zero, one, torch.div(a, top))


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """The package's tensor-scale rule: scale_rule's dequant scale (amax / 448; 1 where amax is 0)."""
    return scale_rule(amax)[1]


# The smallest dequant scale the rule gives (AMAX_FLOOR / 448 in float32): a given scale below it
# would make the multiplier 1 / scale overflow.
MIN_SCALE = scale_rule(torch.tensor(AMAX_FLOOR))[1].item()


def checked_tensor_scale(scale) -> torch.Tensor:
    """A given tensor scale (a number or a one-element tensor) as a float32 scalar tensor. Its value
    must be finite and at least MIN_SCALE; that is checked where reading it costs no device sync (a
    number or a CPU tensor)."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.numel() != 1:
        raise ValueError(f"fp8a2a: a tensor scale has one element, got shape {tuple(scale.shape)}")
    if scale.device.type == "cpu" and not (math.isfinite(float(scale)) and float(scale) >= MIN_SCALE):
        raise ValueError(f"fp8a2a: a tensor scale must be finite and >= {MIN_SCALE:.3g}, got {float(scale)}")
    return scale.reshape(())


def scale_for_tensor(x: torch.Tensor) -> torch.Tensor:
    """The dequant scale of a whole tensor (amax / 448; 1 for an all-zero or empty tensor)."""
    return scale_of_amax(tensor_amax(x))


def quantize(x: torch.Tensor, granularity: str = "row", scale: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Quantize a [T, H] float tensor to e4m3 with row, block128 or tensor scales.

    For granularity='tensor', `scale` (the dequant multiplier, a one-element float32 tensor) may be
    given, e.g. agreed across ranks; otherwise it comes from this tensor's amax. Gradients pass
    straight through to `x` when the result is dequantized or fed to grouped_linear."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8a2a: quantize expects a float tensor, got {type(x).__name__}")
    code = ops.granularity_code(granularity)
    if scale is not None:
        if code != Granularity.TENSOR:
            raise ValueError("fp8a2a: a given scale is only meaningful for granularity='tensor'")
        scale = checked_tensor_scale(scale).to(device=x.device)
    data, s = ops.quantize(x.detach(), code, scale)
    return QuantizedTensor(data, s, granularity, grad_anchor=x if x.requires_grad else None)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, scale, anchor, dtype):
        ctx.anchor_dtype = anchor.dtype
        return ops.dequantize(data, scale, dtype)

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad.to(ctx.anchor_dtype), None


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x_hat = q.data * q.scale in `dtype`; differentiable (straight-through) when q carries a gradient."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"fp8a2a: dequantize expects a QuantizedTensor, got {type(q).__name__}")
    if q.grad_anchor is not None and torch.is_grad_enabled():
        anchor = q.grad_anchor_float32 if dtype == torch.float32 and q.grad_anchor_float32 is not None else \
            q.grad_anchor
        return _Dequantize.apply(q.data, q.scale, anchor, dtype)
    return ops.dequantize(q.data, q.scale, dtype)
