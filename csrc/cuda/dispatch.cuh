// What the dispatch stage's files share: the wire row as the kernels read it, the routing shape
// of one dispatch_pack call (read by the layout, scan and pack kernels) and its host plan, the
// index-type dispatch, and the layout's host entry points (dispatch_layout.cu), which
// dispatch_pack_cuda (dispatch_pack.cu) calls.
#pragma once

#include "common.cuh"

namespace fp8a2a {

// A dispatch wire row as the kernels read it, built once per call on the host from
// fp8_common.h's DispatchRow, the one description of the row's bytes (offsets in 32 bits: rows
// are far below 2^31 bytes), and the granularity code the row's scales follow (kColWire). The
// payload is bytes [0, hidden); the K-entry slot arrays (K: the params' top-k, DispatchRow's
// topk) follow at scale_off..pos_off; the row ends at `bytes`.
// The field order is part of the kernels' parameter layout (nvcc pairs adjacent 32-bit fields of
// an 8-byte slot into one load): gran with scale_off and weight_off with expert_off give the pack
// kernels the loads, and the registers, they had with flat parameters.
struct DispatchWire {
  int64_t hidden;  // elements per row = payload bytes (e4m3; raw: the activation's own bytes)
  int64_t bytes;   // the row's size in the buffer, a multiple of kRowAlign
  int gran;        // granularity code (kRaw: no scales)
  int scale_off, weight_off, expert_off, pos_off;
  int num_scales;

  DispatchWire() = default;
  DispatchWire(const DispatchRow& L, int64_t granularity)
      : hidden(L.hidden),
        bytes(L.bytes),
        gran(static_cast<int>(granularity)),
        scale_off(static_cast<int>(L.scale_off)),
        weight_off(static_cast<int>(L.weight_off)),
        expert_off(static_cast<int>(L.expert_off)),
        pos_off(static_cast<int>(L.pos_off)),
        num_scales(static_cast<int>(L.num_scales)) {}
};

// One dispatch_pack call as the layout and the pack kernels see it, filled once on the host (the
// pack kernels' parameters derive from it; the layout's copy what they read of it).
struct DispatchShape {
  const void* idx;  // topk_idx [T, K], int64 or int32
  DispatchWire wire;
  int64_t cap;  // rank_capacity (capacity mode), 0 compact
  int K, E, El, R;
  int cols;         // layout columns: E experts, R ranks, bad ids
  int chunk_slots;  // slots per layout chunk
  // The layout's tables (int32 scratch after the send rows; null when the pack blocks route
  // their own tokens):
  int2* slot_rank;  // [TK]: (position within (rank, expert) in the chunk, or -1; row within rank in the chunk, or -1)
  int* chunk_off;   // [nchunks, cols]: exclusive prefix of the chunk totals over chunks (scan kernel)
  int* rank_off;    // [R]: first send row of each rank
  int64_t* counts;  // [R, kColExperts + El]
  int dtype;        // the activation's ActDtype (kColDtype); last: the fields above keep their offsets
  int grad;         // 1 if the sender's input requires grad (kColGrad), else 0
};

// counts[r, c] of a header column c < kColRows (the same for every destination rank r)
__device__ __forceinline__ int64_t count_header(int c, int64_t H, int64_t K, int64_t bad_ids, int64_t gran,
                                                int64_t dtype, int64_t grad) {
  switch (c) {
    case kColHidden: return H;
    case kColTopk: return K;
    case kColBadIds: return bad_ids;
    case kColWire: return gran;
    case kColDtype: return dtype;
    case kColGrad: return grad;
    default: return 0;
  }
}

// Runs the lambda (the last argument) with IdxT, topk_idx's element type: int64_t where IDX64, else
// int32_t; FP8A2A_DISPATCH_ROUTING also with the constant SELF: whether the pack blocks route their
// own tokens (SELF_ROUTE, DispatchPackPlan::self_route).
#define FP8A2A_DISPATCH_INDEX(IDX64, ...) \
  [&] {                                   \
    if (IDX64) {                          \
      using IdxT = int64_t;               \
      return __VA_ARGS__();               \
    }                                     \
    using IdxT = int32_t;                 \
    return __VA_ARGS__();                 \
  }()

#define FP8A2A_DISPATCH_ROUTING(IDX64, SELF_ROUTE, ...) \
  FP8A2A_DISPATCH_INDEX(IDX64, [&] {                    \
    if (SELF_ROUTE) {                                   \
      constexpr bool SELF = true;                       \
      return __VA_ARGS__();                             \
    }                                                   \
    constexpr bool SELF = false;                        \
    return __VA_ARGS__();                               \
  })

// ---- layout host side (dispatch_layout.cu) ----

// The layout's geometry for TK slots: chunks of `warps` warps x `steps` groups of 32 slots, and
// where its tables lie in the int32 scratch: [rank_off R][chunk_off nchunks x cols]
// [chunk_tot nchunks x cols][slot_rank 2 x TK].
struct LayoutPlan {
  int warps, steps;
  int64_t chunk_slots, nchunks;
  size_t smem;       // the layout kernel's dynamic shared memory
  int64_t slot_off;  // int32 index of slot_rank in the scratch (even: int2-aligned)
  int64_t scratch_bytes(int64_t TK) const { return 4 * (slot_off + 2 * TK); }
};

LayoutPlan plan_dispatch_layout(int64_t TK, int64_t R, int64_t cols, int device);

// Whether the kernels after the layout kernel may be launched early (programmatic dependent launch).
bool dispatch_early_launch_ok(int device);

// Points shape's tables into scratch (plan's layout) and launches the layout kernel, then the scan
// kernel when there are several chunks (early when pdl).
void launch_dispatch_layout(DispatchShape& shape, const LayoutPlan& plan, int* scratch, int64_t TK, bool idx64,
                            bool pdl, cudaStream_t stream, int device);

// ---- one dispatch_pack call, planned on the host (plan_dispatch_pack: dispatch_pack.cu) ----

// What dispatch_pack_cuda decides before it allocates or launches anything: the routing shape the
// kernels read (the counts and the layout's tables not yet pointed at), the layout's geometry,
// the self-routing policy (small batches: no layout kernel, each pack block routes its own token)
// and the send buffer's one allocation: the rows, then the layout's int32 scratch (one allocation
// less per call; none when self-routed).
struct DispatchPackPlan {
  DispatchShape shape;
  LayoutPlan layout;
  int64_t T, TK, send_rows;
  int64_t send_bytes;   // the rows' bytes, a multiple of kRowAlign: the scratch after them is aligned
  int64_t alloc_bytes;  // the rows and the scratch
  size_t route_smem;    // the pack kernels' shared memory for one token's routing
  size_t smem;          // all their dynamic shared memory (self-routed: the routing tables too)
  bool self_route;
  bool idx64;  // topk_idx is int64 (else int32)
  bool vec;    // H % 16 == 0 and x 16-byte aligned: the vector pack kernels (raw: 16-byte copies)

  // the send rows [send_rows, row bytes] and the layout's scratch (null: self-routed) of the allocation
  Tensor send(const Tensor& alloc) const { return alloc.narrow(0, 0, send_bytes).view({send_rows, shape.wire.bytes}); }
  int* scratch(const Tensor& alloc) const {
    return self_route ? nullptr : reinterpret_cast<int*>(alloc.data_ptr<uint8_t>() + send_bytes);
  }
};

// x as the kernels take it (pack_input), checked (check_dispatch_pack); act_dtype: its ActDtype.
DispatchPackPlan plan_dispatch_pack(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                                    int64_t granularity, int64_t rank_capacity, int64_t act_dtype, bool needs_grad);

}  // namespace fp8a2a
