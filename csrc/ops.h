// Declarations of the fp8a2a ops and the input checks both backends share.
// Schemas and their meaning live in ops.cpp (TORCH_LIBRARY); shapes and bytes in fp8_common.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "fp8_common.h"

namespace fp8a2a {

using at::Tensor;

std::tuple<Tensor, Tensor> quantize_cpu(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale);
std::tuple<Tensor, Tensor> quantize_cuda(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale);

Tensor dequantize_cpu(const Tensor& data, const Tensor& scale, at::ScalarType dtype);
Tensor dequantize_cuda(const Tensor& data, const Tensor& scale, at::ScalarType dtype);

std::tuple<Tensor, Tensor, Tensor> dispatch_pack_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                                     int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                                     const std::optional<Tensor>& tensor_scale, int64_t rank_capacity,
                                                     bool needs_grad);
std::tuple<Tensor, Tensor, Tensor> dispatch_pack_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                                      int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                                      const std::optional<Tensor>& tensor_scale, int64_t rank_capacity,
                                                      bool needs_grad);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dispatch_unpack_cpu(const Tensor& recv, const Tensor& recv_counts,
                                                                               int64_t hidden, int64_t granularity,
                                                                               int64_t topk, int64_t num_rows,
                                                                               int64_t rank_capacity, int64_t expert_capacity);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dispatch_unpack_cuda(const Tensor& recv, const Tensor& recv_counts,
                                                                                int64_t hidden, int64_t granularity,
                                                                                int64_t topk, int64_t num_rows,
                                                                                int64_t rank_capacity, int64_t expert_capacity);

Tensor combine_pack_cpu(const Tensor& expert_out, const Tensor& slot_pos, const std::optional<Tensor>& weights,
                        const std::optional<Tensor>& extra, bool quantize, std::optional<at::ScalarType> dtype);
Tensor combine_pack_cuda(const Tensor& expert_out, const Tensor& slot_pos, const std::optional<Tensor>& weights,
                         const std::optional<Tensor>& extra, bool quantize, std::optional<at::ScalarType> dtype);

std::tuple<Tensor, Tensor> combine_unpack_cpu(const Tensor& buf, const Tensor& send_pos, int64_t hidden,
                                              at::ScalarType dtype, bool quantized, int64_t extra_k);
std::tuple<Tensor, Tensor> combine_unpack_cuda(const Tensor& buf, const Tensor& send_pos, int64_t hidden,
                                               at::ScalarType dtype, bool quantized, int64_t extra_k);

std::tuple<Tensor, Tensor> combine_backward_rows_cpu(const Tensor& data, const std::optional<Tensor>& scale,
                                                     const std::optional<Tensor>& weights,
                                                     const std::optional<Tensor>& expert_out, at::ScalarType dtype);
std::tuple<Tensor, Tensor> combine_backward_rows_cuda(const Tensor& data, const std::optional<Tensor>& scale,
                                                      const std::optional<Tensor>& weights,
                                                      const std::optional<Tensor>& expert_out, at::ScalarType dtype);

std::tuple<Tensor, Tensor> capacity_drop_cpu(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                             int64_t capacity);
std::tuple<Tensor, Tensor> capacity_drop_cuda(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                              int64_t capacity);

// Megatron's dense routing as top-k slots: see ops.cpp.
std::tuple<Tensor, Tensor> routing_map_to_topk_cpu(const Tensor& routing_map, const Tensor& probs, int64_t topk,
                                                   bool drop_zero);
std::tuple<Tensor, Tensor> routing_map_to_topk_cuda(const Tensor& routing_map, const Tensor& probs, int64_t topk,
                                                    bool drop_zero);

// One row-scaled FP8 GEMM per expert (the forward, the FP8 dgrad): see ops.cpp.
Tensor mm_fp8_per_expert_cpu(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                             at::IntArrayRef counts, bool fast_accum);
Tensor mm_fp8_per_expert_cuda(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                              at::IntArrayRef counts, bool fast_accum);

// One FP8 GEMM per expert over 1 x 128-scaled operands (the FP8 weight gradient): see ops.cpp.
Tensor wgrad_fp8_per_expert_cpu(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                at::IntArrayRef widths, at::ScalarType out_dtype);
Tensor wgrad_fp8_per_expert_cuda(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                 at::IntArrayRef widths, at::ScalarType out_dtype);

// ---- checks shared by both backends (clear errors instead of silent corruption) ----

inline void check_activation(const Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2, "fp8a2a: ", name, " must be 2-D [tokens, hidden], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "fp8a2a: ", name, " must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "fp8a2a: ", name, " must be contiguous (call .contiguous())");
}

inline void check_granularity(int64_t granularity, int64_t hidden) {
  TORCH_CHECK(granularity == kRow || granularity == kBlock128 || granularity == kTensor || granularity == kRaw,
              "fp8a2a: unknown granularity code ", granularity);
  TORCH_CHECK(granularity != kBlock128 || hidden % kBlock == 0,
              "fp8a2a: block128 granularity needs hidden % 128 == 0, got hidden=", hidden,
              " (use granularity='row')");
}

inline void check_same_device(const Tensor& a, const Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), "fp8a2a: ", name, " is on ", b.device(), " but the input is on ", a.device());
}

inline void check_index(const Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, "fp8a2a: ", name, " must be ", dim, "-D, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt, "fp8a2a: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "fp8a2a: ", name, " must be contiguous");
}

inline void check_f32_vector(const std::optional<Tensor>& t, int64_t n, const Tensor& like, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kFloat && t->is_contiguous(),
              "fp8a2a: ", name, " must be a contiguous float32 vector of length ", n, ", got ", t->sizes(), " ",
              t->scalar_type());
  check_same_device(like, *t, name);
}

// The counts header's dtype code of an activation (kColDtype).
inline int64_t act_dtype_code(const Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return kDtypeFloat32;
    case at::kHalf: return kDtypeFloat16;
    case at::kBFloat16: return kDtypeBFloat16;
    default: return kDtypeBytes;
  }
}

// dispatch_pack's activation as its kernels take it: raw (unquantized) rows are the activation's
// bytes, so a float activation is viewed as uint8 [tokens, hidden * elem] (a uint8 view is taken as is).
inline Tensor pack_input(const Tensor& x, int64_t granularity) {
  if (granularity != kRaw || x.scalar_type() == at::kByte) return x;
  check_activation(x, "x");
  // an empty expanded tensor (the gradient of a sum on a rank without tokens) counts as contiguous,
  // but its zero strides cannot be viewed as bytes: a fresh empty one can
  return (x.numel() == 0 ? at::empty(x.sizes(), x.options()) : x).view(at::kByte);
}

inline void check_routing(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                          int64_t num_ranks, int64_t granularity) {
  if (granularity == kRaw) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kByte && x.is_contiguous(),
                "fp8a2a: raw dispatch takes the activation as a contiguous uint8 [tokens, bytes] view");
  } else {
    check_activation(x, "x");
  }
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == x.size(0),
              "fp8a2a: topk_idx must be [tokens, k] with tokens=", x.size(0), ", got ", topk_idx.sizes());
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
              "fp8a2a: topk_idx must be int64 or int32, got ", topk_idx.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_idx.sizes(), "fp8a2a: topk_weights ", topk_weights.sizes(),
              " must have the shape of topk_idx ", topk_idx.sizes());
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat, "fp8a2a: topk_weights must be float32, got ",
              topk_weights.scalar_type());
  TORCH_CHECK(topk_idx.is_contiguous() && topk_weights.is_contiguous(), "fp8a2a: topk tensors must be contiguous");
  TORCH_CHECK(topk_idx.size(1) >= 1, "fp8a2a: top-k must be at least 1");
  check_same_device(x, topk_idx, "topk_idx");
  check_same_device(x, topk_weights, "topk_weights");
  TORCH_CHECK(num_ranks >= 1 && num_experts >= num_ranks && num_experts % num_ranks == 0,
              "fp8a2a: num_experts (", num_experts, ") must be a positive multiple of the number of ranks (", num_ranks,
              ")");
}

// A tensor scale: the dequant scale s (one element; the quant multiplier is then 1 / s), or where
// `with_multiplier` (dispatch_pack) also [s, q]: s and the multiplier q the caller derived from the
// amax by the scale rule (q = 448 / amax), as row granularity has.
inline void check_tensor_scale(const std::optional<Tensor>& scale, const Tensor& x, bool with_multiplier = false) {
  TORCH_CHECK(scale.has_value(), "fp8a2a: granularity 'tensor' needs a scale");
  TORCH_CHECK((scale->numel() == 1 || (with_multiplier && scale->dim() == 1 && scale->numel() == 2)) &&
                  scale->scalar_type() == at::kFloat && scale->is_contiguous(),
              "fp8a2a: the tensor scale must be a one-element float32 tensor",
              with_multiplier ? " (or [scale, multiplier])" : "", ", got ", scale->sizes(), " ", scale->scalar_type());
  check_same_device(x, *scale, "scale");
}

// quantize: x, its granularity and, for 'tensor', the scale if given (none: from x's amax).
inline void check_quantize(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale) {
  check_activation(x, "x");
  check_granularity(granularity, x.size(1));
  TORCH_CHECK(granularity != kRaw, "fp8a2a: quantize takes granularity row, block128 or tensor");
  if (granularity == kTensor && scale.has_value()) check_tensor_scale(scale, x);
}

// dispatch_pack: checks the inputs, returns the activation as the kernels take it (pack_input).
inline Tensor check_dispatch_pack(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                                  int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                  const std::optional<Tensor>& tensor_scale, int64_t rank_capacity) {
  const Tensor x = pack_input(x_in, granularity);
  check_routing(x, topk_idx, topk_weights, num_experts, num_ranks, granularity);
  check_granularity(granularity, x.size(1));
  if (granularity == kTensor) check_tensor_scale(tensor_scale, x, /*with_multiplier=*/true);
  TORCH_CHECK(rank_capacity >= 0, "fp8a2a: rank_capacity must be >= 0, got ", rank_capacity);
  return x;
}

// dequantize: checks data and scale, returns the elements per scale (0: one scale for the tensor).
inline int64_t check_dequantize(const Tensor& data, const Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kFloat8_e4m3fn && data.is_contiguous(),
              "fp8a2a: dequantize needs contiguous float8_e4m3fn [tokens, hidden] data, got ", data.sizes(), " ",
              data.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "fp8a2a: scale must be contiguous float32");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "fp8a2a: dequantize dtype must be float32, float16, bfloat16 or float64, got ", dtype);
  check_same_device(data, scale, "scale");
  const int64_t T = data.size(0), H = data.size(1);
  if (scale.dim() == 0) return 0;
  if (scale.dim() == 1) {
    TORCH_CHECK(scale.size(0) == T, "fp8a2a: row scale has ", scale.size(0), " entries for ", T, " rows");
    return H;
  }
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == T && scale.size(1) * kBlock == H,
              "fp8a2a: block128 scale must be [", T, ", ", H / kBlock, "], got ", scale.sizes());
  return kBlock;
}

// routing_map_to_topk: a contiguous bool [T, E] map and contiguous float [T, E] probs on one
// device, topk >= 1. Returns the slots per token: min(topk, E), at least 1.
inline int64_t check_routing_map_to_topk(const Tensor& routing_map, const Tensor& probs, int64_t topk) {
  TORCH_CHECK_VALUE(routing_map.dim() == 2 && routing_map.scalar_type() == at::kBool && routing_map.is_contiguous(),
                    "fp8a2a: routing_map_to_topk needs a contiguous bool [tokens, experts] routing map, got ",
                    routing_map.sizes(), " ", routing_map.scalar_type());
  TORCH_CHECK_VALUE(probs.sizes() == routing_map.sizes() && probs.is_floating_point() && probs.is_contiguous(),
                    "fp8a2a: routing_map_to_topk needs contiguous float probs of the routing map's shape ",
                    routing_map.sizes(), ", got ", probs.sizes(), " ", probs.scalar_type());
  TORCH_CHECK_VALUE(probs.device() == routing_map.device(), "fp8a2a: routing_map_to_topk: probs are on ",
                    probs.device(), ", the routing map on ", routing_map.device());
  TORCH_CHECK_VALUE(topk >= 1, "fp8a2a: routing_map_to_topk: topk must be at least 1, got ", topk);
  return std::max<int64_t>(1, std::min<int64_t>(topk, routing_map.size(1)));
}

// mm_fp8_per_expert: a [M, K] and b [E, N, K] e4m3, contiguous; scale_a float32 [M] and scale_b
// float32 [E, N], contiguous; counts: E rows per expert, none negative, summing to M; all on one
// device. A ValueError: the caller's bug, not a GEMM to fall back from (as below).
inline void check_mm_fp8_per_expert(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                    at::IntArrayRef counts) {
  TORCH_CHECK_VALUE(a.dim() == 2 && a.scalar_type() == at::kFloat8_e4m3fn && a.is_contiguous(),
                    "fp8a2a: mm_fp8_per_expert needs contiguous float8_e4m3fn [rows, K] rows, got ", a.sizes(), " ",
                    a.scalar_type());
  TORCH_CHECK_VALUE(b.dim() == 3 && b.scalar_type() == at::kFloat8_e4m3fn && b.is_contiguous() && b.size(2) == a.size(1),
                    "fp8a2a: mm_fp8_per_expert needs contiguous float8_e4m3fn [experts, N, ", a.size(1),
                    "] weights, got ", b.sizes(), " ", b.scalar_type());
  TORCH_CHECK_VALUE(scale_a.dim() == 1 && scale_a.size(0) == a.size(0) && scale_a.scalar_type() == at::kFloat &&
                        scale_a.is_contiguous(),
                    "fp8a2a: mm_fp8_per_expert: scale_a must be contiguous float32 [", a.size(0), "], got ",
                    scale_a.sizes(), " ", scale_a.scalar_type());
  TORCH_CHECK_VALUE(scale_b.dim() == 2 && scale_b.size(0) == b.size(0) && scale_b.size(1) == b.size(1) &&
                        scale_b.scalar_type() == at::kFloat && scale_b.is_contiguous(),
                    "fp8a2a: mm_fp8_per_expert: scale_b must be contiguous float32 [", b.size(0), ", ", b.size(1),
                    "], got ", scale_b.sizes(), " ", scale_b.scalar_type());
  for (const Tensor* t : {&scale_a, &b, &scale_b})
    TORCH_CHECK_VALUE(t->device() == a.device(), "fp8a2a: mm_fp8_per_expert: an operand is on ", t->device(),
                      ", a is on ", a.device());
  TORCH_CHECK_VALUE(static_cast<int64_t>(counts.size()) == b.size(0), "fp8a2a: mm_fp8_per_expert: ", counts.size(),
                    " counts for ", b.size(0), " experts");
  int64_t total = 0;
  for (int64_t n : counts) {
    TORCH_CHECK_VALUE(n >= 0 && n <= a.size(0) - total, "fp8a2a: mm_fp8_per_expert: counts must be non-negative and ",
                      "sum to the ", a.size(0), " rows, got ", counts);
    total += n;
  }
  TORCH_CHECK_VALUE(total == a.size(0), "fp8a2a: mm_fp8_per_expert: counts ", counts, " sum to ", total, ", not the ",
                    a.size(0), " rows");
}

// wgrad_fp8_per_expert: a [Na, M] and b [Nb, M] e4m3, their scales [M / 128, Na] and [M / 128, Nb]
// float32, all contiguous on one device; widths: each expert's columns, multiples of 128 summing to
// at most M (columns past them are not read). A ValueError: the caller's bug, not a GEMM to fall
// back from (experts.py treats a RuntimeError as cuBLAS refusing the shape). Returns the widths' sum.
inline int64_t check_wgrad_fp8_per_expert(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                       at::IntArrayRef widths, at::ScalarType out_dtype) {
  for (const Tensor* t : {&a, &b}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->scalar_type() == at::kFloat8_e4m3fn && t->is_contiguous(),
                      "fp8a2a: wgrad_fp8_per_expert needs contiguous float8_e4m3fn [features, tokens] operands, "
                      "got ", t->sizes(), " ", t->scalar_type());
  }
  const int64_t M = a.size(1);
  TORCH_CHECK_VALUE(b.size(1) == M && M % kBlock == 0, "fp8a2a: wgrad_fp8_per_expert: both operands need the ",
                    "same token columns, a multiple of 128, got ", a.sizes(), " and ", b.sizes());
  for (auto [s, n, name] : {std::make_tuple(&scale_a, a.size(0), "scale_a"),
                            std::make_tuple(&scale_b, b.size(0), "scale_b")}) {
    TORCH_CHECK_VALUE(s->dim() == 2 && s->size(0) == M / kBlock && s->size(1) == n &&
                          s->scalar_type() == at::kFloat && s->is_contiguous(),
                      "fp8a2a: wgrad_fp8_per_expert: ", name, " must be contiguous float32 [", M / kBlock, ", ", n,
                      "], got ", s->sizes(), " ", s->scalar_type());
  }
  for (const Tensor* t : {&scale_a, &b, &scale_b})
    TORCH_CHECK_VALUE(t->device() == a.device(), "fp8a2a: wgrad_fp8_per_expert: an operand is on ", t->device(),
                      ", a is on ", a.device());
  int64_t total = 0;
  for (int64_t w : widths) {
    TORCH_CHECK_VALUE(w >= 0 && w % kBlock == 0 && w <= M - total, "fp8a2a: wgrad_fp8_per_expert: widths must be ",
                      "multiples of 128 summing to at most ", M, " columns, got ", widths);
    total += w;
  }
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
                    "fp8a2a: wgrad_fp8_per_expert: out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  return total;
}

// dispatch_unpack: the checks that need only shapes (those on the counts' values are the CPU's
// alone: on the GPU they would need a host sync, and inconsistent rows are skipped instead).
inline DispatchRow check_unpack(const Tensor& recv, const Tensor& recv_counts, int64_t hidden, int64_t granularity,
                                int64_t topk, int64_t num_rows, int64_t rank_capacity, int64_t expert_capacity) {
  check_granularity(granularity, hidden);
  TORCH_CHECK((rank_capacity > 0) == (expert_capacity > 0), "fp8a2a: capacity mode needs both capacities");
  const DispatchRow L(hidden, granularity, topk);
  TORCH_CHECK(recv.dim() == 2 && recv.scalar_type() == at::kByte && recv.size(1) == L.bytes && recv.is_contiguous(),
              "fp8a2a: received buffer must be contiguous uint8 [rows, ", L.bytes, "], got ", recv.sizes(), " ",
              recv.scalar_type());
  TORCH_CHECK(recv_counts.dim() == 2 && recv_counts.scalar_type() == at::kLong && recv_counts.size(1) > kColExperts,
              "fp8a2a: recv_counts must be int64 [ranks, ", int64_t(kColExperts), " + local experts]");
  check_same_device(recv, recv_counts, "recv_counts");
  const int64_t R = recv_counts.size(0), El = recv_counts.size(1) - kColExperts;
  if (expert_capacity > 0) {
    TORCH_CHECK(recv.size(0) == R * rank_capacity, "fp8a2a: capacity mode expects ", R * rank_capacity,
                " rows, got ", recv.size(0));
    TORCH_CHECK(num_rows == El * R * expert_capacity, "fp8a2a: capacity mode has ", El * R * expert_capacity,
                " expert rows, num_rows is ", num_rows);
  }
  return L;
}

// combine_pack: checks the inputs; returns the wire row and its payload's dtype when not quantized
// (the activation's: `dtype`, by default expert_out's).
inline std::pair<CombineRow, at::ScalarType> check_combine_pack(const Tensor& expert_out, const Tensor& slot_pos,
                                                                const std::optional<Tensor>& weights,
                                                                const std::optional<Tensor>& extra, bool quantize,
                                                                std::optional<at::ScalarType> dtype) {
  check_activation(expert_out, "expert_out");
  check_index(slot_pos, 2, "slot_pos");
  check_same_device(expert_out, slot_pos, "slot_pos");
  check_f32_vector(weights, expert_out.size(0), expert_out, "weights");
  check_f32_vector(extra, expert_out.size(0), expert_out, "extra");
  const at::ScalarType wire = dtype.value_or(expert_out.scalar_type());
  TORCH_CHECK(wire == at::kFloat || wire == at::kHalf || wire == at::kBFloat16,
              "fp8a2a: combine_pack's row dtype (the activation's) must be float32, float16 or bfloat16, got ", wire);
  const CombineRow L(expert_out.size(1), c10::elementSize(wire), quantize, extra.has_value() ? slot_pos.size(1) : 0);
  return {L, wire};
}

// combine_unpack: the buffer must hold CombineRow rows for this hidden size and dtype.
inline CombineRow check_combine_buffer(const Tensor& buf, const Tensor& send_pos, int64_t hidden, at::ScalarType dtype,
                                       bool quantized, int64_t extra_k) {
  check_index(send_pos, 2, "send_pos");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "fp8a2a: combine dtype must be float32, float16, bfloat16 or float64, got ", dtype);
  const CombineRow L(hidden, c10::elementSize(dtype), quantized, extra_k);
  TORCH_CHECK(buf.dim() == 2 && buf.scalar_type() == at::kByte && buf.size(1) == L.bytes && buf.is_contiguous(),
              "fp8a2a: combine buffer must be contiguous uint8 [rows, ", L.bytes, "], got ", buf.sizes());
  check_same_device(buf, send_pos, "send_pos");
  return L;
}

// combine_backward_rows: e4m3 rows with a float32 row scale [N], or raw rows (float32, float16 or
// bfloat16; no scale, or an empty one); weights float32 [N] or none; expert_out [N, H] in `dtype`
// (the gradient's) or none. Returns whether the rows are e4m3.
inline bool check_combine_backward_rows(const Tensor& data, const std::optional<Tensor>& scale,
                                        const std::optional<Tensor>& weights, const std::optional<Tensor>& expert_out,
                                        at::ScalarType dtype) {
  const bool fp8 = data.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() &&
                  (fp8 || data.scalar_type() == at::kFloat || data.scalar_type() == at::kHalf ||
                   data.scalar_type() == at::kBFloat16),
              "fp8a2a: combine_backward_rows needs contiguous [rows, hidden] e4m3 or float32/float16/bfloat16 rows, "
              "got ", data.sizes(), " ", data.scalar_type());
  const int64_t N = data.size(0);
  if (fp8) {
    TORCH_CHECK(scale.has_value(), "fp8a2a: combine_backward_rows: e4m3 rows need their row scale");
    check_f32_vector(scale, N, data, "scale");
  } else {
    TORCH_CHECK(!scale.has_value() || scale->numel() == 0, "fp8a2a: combine_backward_rows: raw rows take no scale");
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "fp8a2a: combine_backward_rows: dtype must be float32, float16, bfloat16 or float64, got ", dtype);
  check_f32_vector(weights, N, data, "weights");
  if (expert_out.has_value()) {
    TORCH_CHECK(expert_out->sizes() == data.sizes() && expert_out->scalar_type() == dtype && expert_out->is_contiguous(),
                "fp8a2a: combine_backward_rows: expert_out must be contiguous ", data.sizes(), " ", dtype,
                " (the gradient's dtype), got ", expert_out->sizes(), " ", expert_out->scalar_type());
    check_same_device(data, *expert_out, "expert_out");
  }
  return fp8;
}

inline void check_capacity_drop(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                int64_t capacity) {
  TORCH_CHECK(topk_idx.dim() == 2 && (topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt) &&
                  topk_idx.is_contiguous(),
              "fp8a2a: capacity_drop: topk_idx must be a contiguous int64 or int32 [tokens, k], got ",
              topk_idx.sizes(), " ", topk_idx.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_idx.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "fp8a2a: capacity_drop: topk_weights must be contiguous float32 of topk_idx's shape ", topk_idx.sizes(),
              ", got ", topk_weights.sizes(), " ", topk_weights.scalar_type());
  check_same_device(topk_idx, topk_weights, "topk_weights");
  TORCH_CHECK(num_experts >= 1 && num_experts < (int64_t{1} << 30), "fp8a2a: capacity_drop: num_experts out of range: ",
              num_experts);
  TORCH_CHECK(capacity >= 1, "fp8a2a: capacity_drop: capacity must be >= 1, got ", capacity);
}

// Capacity drop order: by expert, then router weight descending, then slot. The weight's float32
// bits map to an unsigned key that orders like the float (-0 < +0; NaN by its bits), inverted so
// that a larger weight gives a smaller key.
FP8A2A_HD uint32_t weight_desc_key(uint32_t bits) {
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ordered;
}

// Compact mode: an upper bound (each token to at most min(K, R) ranks). Capacity mode: R fixed segments.
inline int64_t send_buffer_rows(int64_t tokens, int64_t topk, int64_t num_ranks, int64_t rank_capacity) {
  return rank_capacity > 0 ? num_ranks * rank_capacity : tokens * std::min(topk, num_ranks);
}

inline std::vector<int64_t> scale_shape(int64_t rows, int64_t hidden, int64_t granularity) {
  if (granularity == kRow) return {rows};
  if (granularity == kBlock128) return {rows, hidden / kBlock};
  if (granularity == kRaw) return {0};
  return {};
}

}  // namespace fp8a2a
