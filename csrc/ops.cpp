// Op schemas (TORCH_LIBRARY) and the registrations of both backends: the CPU kernels (csrc/cpu/)
// always, the CUDA ones (csrc/cuda/) when the build compiles them (setup.py defines
// FP8A2A_WITH_CUDA). Fake (meta) implementations for torch.compile / CUDA graphs are in fp8a2a/ops.py.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

// An importable module with no Python functions: the ops are reached through torch.ops.fp8a2a.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}

namespace fp8a2a {

int64_t dispatch_row_bytes(int64_t hidden, int64_t granularity, int64_t topk) {
  check_granularity(granularity, hidden);
  return DispatchRow(hidden, granularity, topk).bytes;
}

int64_t combine_row_bytes(int64_t hidden, int64_t elem_size, bool quantized, int64_t extra_k) {
  return CombineRow(hidden, elem_size, quantized, extra_k).bytes;
}

TORCH_LIBRARY(fp8a2a, m) {
  // granularity: 0 row, 1 block128, 2 tensor. Scales are dequant multipliers (x ~= e4m3 * scale).
  m.def("quantize(Tensor x, int granularity, Tensor? scale) -> (Tensor data, Tensor scale)");
  m.def("dequantize(Tensor data, Tensor scale, ScalarType dtype) -> Tensor");
  // -> send rows [T*min(K,R), DispatchRow.bytes] uint8 ordered by destination rank (only the first
  //    counts[:, rows].sum() are written), counts [R, kColExperts + local experts] int64, send_pos [T, R] int32.
  //    rank_capacity > 0 (capacity mode): rows for rank r start at r * rank_capacity, [R * rank_capacity] rows.
  //    granularity 3 (raw): x's own bytes (x float, or already viewed as uint8). tensor_scale (tensor
  //    granularity): [s] (multiplier 1 / s) or [s, q] (q = 448 / amax by the scale rule).
  //    needs_grad: written to every destination's counts[r, kColGrad] (1 or 0).
  m.def(
      "dispatch_pack(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int num_ranks, "
      "int granularity, Tensor? tensor_scale, int rank_capacity=0, bool needs_grad=False) "
      "-> (Tensor send, Tensor counts, Tensor send_pos)");
  // -> expert-major data [N, H] e4m3, scale, weights [N], tokens_per_expert, slot_pos [Nr, K], row_src [N].
  //    Capacity mode: source r's rows are the first counts[r, rows] of segment r; expert e owns rows
  //    [e*R*C, (e+1)*R*C) (N = local experts * R * C), padding rows zero.
  m.def(
      "dispatch_unpack(Tensor recv, Tensor recv_counts, int hidden, int granularity, int topk, int num_rows, "
      "int rank_capacity=0, int expert_capacity=0) "
      "-> (Tensor data, Tensor scale, Tensor weights, Tensor tokens_per_expert, Tensor slot_pos, Tensor row_src)");
  // Expert side: per received row, the sum (weighted) of its local experts' outputs in float32 ->
  // CombineRow bytes, converted last: to e4m3 (quantize) or to dtype (the activation's, whatever
  // expert_out's own float32/float16/bfloat16; default expert_out's).
  m.def(
      "combine_pack(Tensor expert_out, Tensor slot_pos, Tensor? weights, Tensor? extra, bool quantize, "
      "ScalarType? dtype=None) -> Tensor");
  // Token side: y[t] = sum over ranks of the rows sent back for t; extra[t, k] likewise.
  m.def(
      "combine_unpack(Tensor buf, Tensor send_pos, int hidden, ScalarType dtype, bool quantized, int extra_k) "
      "-> (Tensor y, Tensor extra)");
  // Combine's backward on the expert side: dy's rows as they arrive (e4m3 with a row scale, or raw
  // rows) -> grad [N, H] in dtype = dy * (weights or 1), converted once; grad_weights float32 [N] =
  // dy . expert_out in float32 in fp8_common.h's blocked order (for e4m3 rows: the scale times the
  // dot of the unscaled values), or an empty tensor where expert_out is not given.
  m.def(
      "combine_backward_rows(Tensor data, Tensor? scale, Tensor? weights, Tensor? expert_out, ScalarType dtype) "
      "-> (Tensor grad, Tensor grad_weights)");
  // Capacity mode's drop: per expert, keep the `capacity` slots with the largest router weight
  // (ties: the earlier slot); dropped slots become -1, other ids are kept. -> (ids, dropped count).
  m.def("capacity_drop(Tensor topk_idx, Tensor topk_weights, int num_experts, int capacity) -> (Tensor, Tensor)");
  // Megatron's dense routing (a bool [T, E] map, probs [T, E]) as top-k slots: (idx int64 [T, k], -1
  // where unused, each token's experts in ascending order, the first k where more are routed;
  // weights [T, k] in probs' dtype, 0 where unused), k = min(topk, E). drop_zero: experts whose prob
  // is 0 are not routed. One kernel on CUDA.
  m.def("routing_map_to_topk(Tensor routing_map, Tensor probs, int topk, bool drop_zero) -> (Tensor, Tensor)");
  // The row-scaled FP8 GEMMs of the experts, one per expert: out [M, N] bfloat16, out's rows of expert
  // e (counts[e] of them, expert-major from row 0) = (a's rows * scale_a) (b[e] * scale_b[e])^T, one
  // scale per row of a and per output channel of b, fp32 accumulation (fast_accum: cuBLAS's faster
  // mode on CUDA). CUDA: cuBLASLt, one call for all experts (its algorithm found once per N, K and
  // bucket of 128 rows of an expert).
  m.def(
      "mm_fp8_per_expert(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, int[] counts, bool fast_accum) "
      "-> Tensor");
  // The FP8 weight gradient's GEMMs, one per expert: out [E, Na, Nb] in out_dtype, out[e] = the sum
  // over expert e's token columns (widths[e] of them, in order from column 0) of (a * scale_a) (b *
  // scale_b)^T, fp32 accumulation, each scale covering 128 columns of one operand row (1 x 128
  // along the reduction, TE blockwise's rule); zeros for an expert of width 0. CUDA: cuBLASLt, one
  // call for all experts (its algorithm found once per shape).
  m.def(
      "wgrad_fp8_per_expert(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, int[] widths, ScalarType out_dtype) "
      "-> Tensor");
  m.def("dispatch_row_bytes(int hidden, int granularity, int topk) -> int", &dispatch_row_bytes);
  m.def("combine_row_bytes(int hidden, int elem_size, bool quantized, int extra_k) -> int", &combine_row_bytes);
}

TORCH_LIBRARY_IMPL(fp8a2a, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("dispatch_pack", &dispatch_pack_cpu);
  m.impl("dispatch_unpack", &dispatch_unpack_cpu);
  m.impl("combine_pack", &combine_pack_cpu);
  m.impl("combine_unpack", &combine_unpack_cpu);
  m.impl("combine_backward_rows", &combine_backward_rows_cpu);
  m.impl("capacity_drop", &capacity_drop_cpu);
  m.impl("routing_map_to_topk", &routing_map_to_topk_cpu);
  m.impl("mm_fp8_per_expert", &mm_fp8_per_expert_cpu);
  m.impl("wgrad_fp8_per_expert", &wgrad_fp8_per_expert_cpu);
}

#ifdef FP8A2A_WITH_CUDA
TORCH_LIBRARY_IMPL(fp8a2a, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dispatch_pack", &dispatch_pack_cuda);
  m.impl("dispatch_unpack", &dispatch_unpack_cuda);
  m.impl("combine_pack", &combine_pack_cuda);
  m.impl("combine_unpack", &combine_unpack_cuda);
  m.impl("combine_backward_rows", &combine_backward_rows_cuda);
  m.impl("capacity_drop", &capacity_drop_cuda);
  m.impl("routing_map_to_topk", &routing_map_to_topk_cuda);
  m.impl("mm_fp8_per_expert", &mm_fp8_per_expert_cuda);
  m.impl("wgrad_fp8_per_expert", &wgrad_fp8_per_expert_cuda);
}
#endif

}  // namespace fp8a2a
