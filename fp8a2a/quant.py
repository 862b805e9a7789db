"""QuantizedTensor and the quantize / dequantize entry points (public API, see DESIGN.md).

Scale rule (csrc/fp8_common.h): per row or 128-block, amax = max |x|; data = e4m3(x * (448 / amax)),
scale = amax / 448, so x ~= data.float() * scale. An all-zero row gets scale 1. A row holding NaN or
Inf dequantizes to NaN. Casts are round-to-nearest-even and saturate at +-448.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # float8_e4m3fn [T, H]
    scale: torch.Tensor  # float32: [T] row, [T, H // 128] block128, [] tensor
    granularity: str = "row"
    # Gradient carrier (internal): dequantize/grouped_linear hand their input gradient to this
    # tensor (straight-through), which reaches x or the dispatcher's backward.
    grad_anchor: Optional[torch.Tensor] = None

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


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """The package's tensor-scale rule: amax / 448 (correctly rounded), 1 where amax is 0."""
    return torch.where(amax == 0, torch.ones_like(amax), torch.div(amax, torch.full_like(amax, 448.0)))


def scale_for_tensor(x: torch.Tensor) -> torch.Tensor:
    """The dequant scale of a whole tensor (amax / 448; 1 for an all-zero or empty tensor)."""
    return scale_of_amax(tensor_amax(x))


def quantize(x: torch.Tensor, granularity: str = "row", scale: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Quantize a [T, H] float tensor to e4m3 with row, block128 or tensor scales.

    For granularity='tensor', `scale` (the dequant multiplier, a one-element float32 tensor) may be
    given, e.g. agreed across ranks; otherwise it comes from this tensor's amax. Gradients pass
    straight through to `x` when the result is dequantized or fed to grouped_linear."""
    code = ops.granularity_code(granularity)
    if scale is not None:
        if code != ops.GRANULARITY["tensor"]:
            raise ValueError("fp8a2a: a given scale is only meaningful for granularity='tensor'")
        scale = scale.reshape(()).to(device=x.device, dtype=torch.float32)
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
    if q.grad_anchor is not None and torch.is_grad_enabled():
        return _Dequantize.apply(q.data, q.scale, q.grad_anchor, dtype)
    return ops.dequantize(q.data, q.scale, dtype)
