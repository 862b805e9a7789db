// What the dispatch stage's files share: the wire row as the kernels read it, the routing shape
// of one dispatch_pack call (read by the layout, scan and pack kernels), and the layout's host
// entry points (dispatch_layout.cu), which dispatch_pack_cuda (dispatch_pack.cu) calls.
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

}  // namespace fp8a2a
