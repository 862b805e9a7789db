"""Thin Python over the extension: loads fp8a2a._C and gives each op a fake (meta) implementation
so the ops trace under torch.compile and record into CUDA graphs. Shapes never depend on data:
the caller passes every data-dependent size (e.g. the number of received expert rows)."""
import torch

from .wire import BLOCK, FP8, QUANTIZED, CountsCol, Granularity, blocks_error, fits_blocks

try:
    from . import _C  # noqa: F401  registers torch.ops.fp8a2a.*
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "fp8a2a: the C++ extension fp8a2a._C is not built. Run `pip install --no-build-isolation -e .` "
        f"in the repository (after installing torch). Original error: {e}") from e

_ops = torch.ops.fp8a2a


def granularity_code(granularity: str) -> int:
    return int(Granularity.parse(granularity, names_only=True))


def dispatch_row_bytes(hidden: int, granularity: int, topk: int) -> int:
    return _ops.dispatch_row_bytes(hidden, granularity, topk)


def combine_row_bytes(hidden: int, dtype: torch.dtype, quantized: bool, extra_k: int) -> int:
    return _ops.combine_row_bytes(hidden, dtype.itemsize, quantized, extra_k)


def _same_device(name, first, *others):
    """csrc/ops.h's check_same_device in the fakes: a meta tensor among real ones (e.g. meta topk_idx
    with a CPU x) picks the fake kernel too, which would hand back uninitialised real buffers."""
    for what, t in others:
        if t is not None:
            torch._check(t.device == first.device,
                         lambda: f"fp8a2a: {name}: {what} is on {t.device} but the input is on {first.device}")


def _scale_shape(rows, hidden, granularity):
    return {Granularity.ROW: (rows,), Granularity.BLOCK128: (rows, hidden // BLOCK), Granularity.TENSOR: (),
            Granularity.RAW: (0,)}[granularity]


@torch.library.register_fake("fp8a2a::quantize")
def _(x, granularity, scale):
    # the real op's argument checks (csrc/ops.h), so that a traced call fails as an eager one does
    torch._check(granularity in QUANTIZED, lambda: "fp8a2a: quantize takes granularity row, block128 or tensor")
    torch._check(granularity != Granularity.BLOCK128 or fits_blocks(x.shape[1]), lambda: blocks_error(x.shape[1]))
    _same_device("quantize", x, ("scale", scale))
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(_scale_shape(x.shape[0], x.shape[1], granularity),
                                                        dtype=torch.float32)


@torch.library.register_fake("fp8a2a::dequantize")
def _(data, scale, dtype):
    _same_device("dequantize", data, ("scale", scale))
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.register_fake("fp8a2a::dispatch_pack")
def _(x, topk_idx, topk_weights, num_experts, num_ranks, granularity, tensor_scale, rank_capacity=0,
      needs_grad=False):
    _same_device("dispatch_pack", x, ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                 ("tensor_scale", tensor_scale))
    t, k = topk_idx.shape
    rows = num_ranks * rank_capacity if rank_capacity else t * min(k, num_ranks)
    hidden = x.shape[1] * x.element_size() if granularity == Granularity.RAW else x.shape[1]  # raw: bytes
    return (x.new_empty((rows, dispatch_row_bytes(hidden, granularity, k)), dtype=torch.uint8),
            x.new_empty((num_ranks, CountsCol.EXPERTS + num_experts // num_ranks), dtype=torch.int64),
            x.new_empty((t, num_ranks), dtype=torch.int32))


@torch.library.register_fake("fp8a2a::dispatch_unpack")
def _(recv, recv_counts, hidden, granularity, topk, num_rows, rank_capacity=0, expert_capacity=0):
    _same_device("dispatch_unpack", recv, ("recv_counts", recv_counts))
    n, local = num_rows, recv_counts.shape[1] - CountsCol.EXPERTS
    scale_shape = (n,) if granularity == Granularity.TENSOR else _scale_shape(n, hidden, granularity)
    return (recv.new_empty((n, hidden), dtype=torch.uint8 if granularity == Granularity.RAW else FP8), recv.new_empty(scale_shape, dtype=torch.float32),
            recv.new_empty((n,), dtype=torch.float32), recv.new_empty((local,), dtype=torch.int64),
            recv.new_empty((recv.shape[0], topk), dtype=torch.int32), recv.new_empty((n,), dtype=torch.int32))


@torch.library.register_fake("fp8a2a::combine_pack")
def _(expert_out, slot_pos, weights, extra, quantize, dtype=None):
    _same_device("combine_pack", expert_out, ("slot_pos", slot_pos), ("weights", weights), ("extra", extra))
    extra_k = slot_pos.shape[1] if extra is not None else 0
    row_dtype = expert_out.dtype if dtype is None else dtype
    return expert_out.new_empty((slot_pos.shape[0], combine_row_bytes(expert_out.shape[1], row_dtype, quantize,
                                                                       extra_k)), dtype=torch.uint8)


@torch.library.register_fake("fp8a2a::combine_unpack")
def _(buf, send_pos, hidden, dtype, quantized, extra_k):
    _same_device("combine_unpack", buf, ("send_pos", send_pos))
    t = send_pos.shape[0]
    return buf.new_empty((t, hidden), dtype=dtype), buf.new_empty((t, extra_k), dtype=torch.float32)


@torch.library.register_fake("fp8a2a::combine_backward_rows")
def _(data, scale, weights, expert_out, dtype):
    _same_device("combine_backward_rows", data, ("scale", scale), ("weights", weights), ("expert_out", expert_out))
    return data.new_empty(data.shape, dtype=dtype), \
        data.new_empty((data.shape[0] if expert_out is not None else 0,), dtype=torch.float32)


@torch.library.register_fake("fp8a2a::capacity_drop")
def _(topk_idx, topk_weights, num_experts, capacity):
    _same_device("capacity_drop", topk_idx, ("topk_weights", topk_weights))
    return torch.empty_like(topk_idx), topk_idx.new_empty((), dtype=torch.int64)


@torch.library.register_fake("fp8a2a::routing_map_to_topk")
def _(routing_map, probs, topk, drop_zero):
    _same_device("routing_map_to_topk", routing_map, ("probs", probs))
    k = max(1, min(topk, routing_map.shape[1]))
    return (routing_map.new_empty((routing_map.shape[0], k), dtype=torch.int64),
            probs.new_empty((routing_map.shape[0], k)))


@torch.library.register_fake("fp8a2a::mm_fp8_per_expert")
def _(a, scale_a, b, scale_b, counts, fast_accum):
    _same_device("mm_fp8_per_expert", a, ("scale_a", scale_a), ("b", b), ("scale_b", scale_b))
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@torch.library.register_fake("fp8a2a::wgrad_fp8_per_expert")
def _(a, scale_a, b, scale_b, widths, out_dtype):
    _same_device("wgrad_fp8_per_expert", a, ("scale_a", scale_a), ("b", b), ("scale_b", scale_b))
    return a.new_empty((len(widths), a.shape[0], b.shape[0]), dtype=out_dtype)


def combine_pack(expert_out, slot_pos, weights, extra, quantize, dtype=None):
    """The expert side of combine (and of dispatch's backward): per received row, the sum of its
    local experts' rows of expert_out (each times its weight, where weights are given) in float32,
    converted last into one combine wire row: e4m3 with a row scale (quantize), else `dtype` (the
    activation's; default expert_out's). expert_out: bfloat16, float16 or float32 rows, in whichever
    dtype the experts produced (float64 rows are converted to float32 here first)."""
    if expert_out.dtype == torch.float64:
        expert_out = expert_out.float()
    return _ops.combine_pack(expert_out, slot_pos, weights, extra, quantize, dtype)


def combine_backward_rows(data, scale, weights, expert_out, dtype):
    """Combine's backward on the expert side, one pass over the rows of dy that came back: (grad
    [N, H] in `dtype`, grad_weights float32 [N]). data: e4m3 rows with their row scale [N], or raw
    rows (float32, float16 or bfloat16; scale None). grad = dy * weights (dy alone where weights is
    None), converted once; grad_weights = dy . expert_out per row in float32, in the blocked order
    of csrc/fp8_common.h (kDotUnit), an empty tensor where expert_out is None. expert_out is in
    `dtype`. No float32 [N, H] temporary."""
    return _ops.combine_backward_rows(data, scale, weights, expert_out, dtype)


quantize = _ops.quantize
dequantize = _ops.dequantize
dispatch_pack = _ops.dispatch_pack
dispatch_unpack = _ops.dispatch_unpack
combine_unpack = _ops.combine_unpack
capacity_drop = _ops.capacity_drop
routing_map_to_topk = _ops.routing_map_to_topk
mm_fp8_per_expert = _ops.mm_fp8_per_expert
wgrad_fp8_per_expert = _ops.wgrad_fp8_per_expert
