"""What the Megatron layer tests (tests/test_megatron.py on CPU, tests/gpu/test_megatron_gpu.py on
the GPU) allow an FP8 path, and the input that tells block128 scales from row scales. No megatron
import here."""
import torch

E4M3 = 2 ** -4  # relative rounding error bound of one e4m3 quantization (3 mantissa bits, to nearest)


def bound(y, x_grad, router, experts):
    """Tolerances of an FP8 case: n quantizations on a path are off by at most n * E4M3 (to first
    order), n counted for the output, the input's gradient, the router's and the experts' gradients."""
    return {"y": y * E4M3, "x.grad": x_grad * E4M3, "router": router * E4M3, "experts": experts * E4M3}


# The paths' quantizations: x = the layer input (dispatch wire), gy = the output gradient (combine
# backward's wire), W1, W2 = the FP8 experts' weights, h = their activation (fc2's input).
WIRE = bound(1, 2, 2, 2)  # Megatron's experts: y: x; x.grad, router, dW: x, gy
FP8_EXPERTS = bound(4, 3, 3, 4)  # y: x, W1, h, W2; x.grad, router, dW1: x, W1, gy (BF16 dgrad); dW2: x, W1, h, gy

# Rows whose second 128-block is 1e-6 of the first: more than e4m3's range (448 / 2^-9, about 2.3e5),
# so a scale per row flushes that block to zero and a scale per 128 values does not
BLOCKS = dict(hidden=256, small_block=1e-6)


def small_block_error(rows: torch.Tensor, tokens: torch.Tensor) -> float:
    """Relative L2 error of the second 128-block of the rows the experts got, each row against the
    token it came from (the nearest of `tokens` in the first block)."""
    rows, tokens = rows.double(), tokens.double()
    want = tokens[torch.cdist(rows[:, :128], tokens[:, :128]).argmin(1), 128:256]
    return ((rows[:, 128:256] - want).norm() / want.norm()).item()
