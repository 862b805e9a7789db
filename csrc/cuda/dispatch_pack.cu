// dispatch_pack: the pack kernels (one block per token: read once, quantized once, written to
// each destination rank's send row), plan_dispatch_pack (one call's shape, self-routing policy and
// send buffer: dispatch.cuh) and dispatch_pack_cuda, which launches the layout stage
// (dispatch_layout.cu) unless the pack blocks route their own tokens, then the pack kernel.
#include "dispatch.cuh"

namespace fp8a2a {
namespace {

// =============================================================================================
// dispatch_pack: pack kernel (one block per token: read once, quantize once, write per rank)
// =============================================================================================
// The pack kernels' parameters: the call's shape (the wire row, the routing, the layout's tables)
// and what the pack alone reads.
struct PackParams : DispatchShape {
  const void* x;
  const float* w;
  const float* tscale;  // tensor: [s] or [s, q] (tscale_q)
  uint8_t* send;
  int* send_pos;
  int64_t T;
  bool vec;       // raw: 16-byte copies
  bool tscale_q;  // tensor: tscale[1] is the quant multiplier (else 1 / s); in vec's padding
  int self_off;  // self routing: byte offset of its shared memory area (counts: written here)
};

// Tensor granularity's quant multiplier: the given one (from the amax, by the scale rule), else
// 1 / s (IEEE division), as ops_cpu.cpp's tensor_scales().
__device__ __forceinline__ float tensor_multiplier(const PackParams& p, float s) {
  return p.tscale_q ? __ldg(p.tscale + 1) : 1.0f / s;
}

// How a row of amax m is quantized, row or tensor granularity: its quant multiplier, the scale its
// wire row carries, and (tensor) whether it holds NaN or Inf, so is NaN throughout (amax_finite).
struct RowQuant {
  float q, scale;
  bool nan_row;
};

__device__ __forceinline__ RowQuant row_quant(const PackParams& p, float m) {
  if (p.wire.gran == kRow) return {quant_multiplier(m), scale_of(m), false};
  const float s = __ldg(p.tscale);
  return {tensor_multiplier(p, s), s, !amax_finite(m)};
}

struct RouteSmem {
  int* rank;   // [K] destination rank of slot k, -1 if not routed
  int* row;    // [K] send row if slot k is the first slot of its rank, else -1
  int* le;     // [K] local expert id
  int* pos;    // [K] position within (rank, local expert)
  float* w;    // [K]
  float* red;  // [32]
  float* amax; // [H/128] block128 amaxes
};

__device__ __forceinline__ RouteSmem carve_route_smem(unsigned char* smem, int K) {
  RouteSmem s;
  s.rank = reinterpret_cast<int*>(smem);
  s.row = s.rank + K;
  s.le = s.row + K;
  s.pos = s.le + K;
  s.w = reinterpret_cast<float*>(s.pos + K);
  s.red = s.w + K;
  s.amax = s.red + 32;
  return s;
}

size_t route_smem_bytes(int64_t K, int64_t num_block_scales) { return (5 * K + 32 + num_block_scales) * 4; }

// ---- small batches: each pack block routes its own token (no layout kernel, one launch) ----
constexpr int64_t kSelfMaxSlots = 4096;
constexpr int64_t kSelfMaxTokens = 512;  // every block scans every token: work grows as tokens^2
constexpr int kSelfMaxK = 8;

int64_t self_smem_bytes(int64_t TK, int64_t E, int64_t R, int64_t K) { return (TK + E + R + 1 + 3 * K) * 4; }

// What load_routing reads from the layout, counted by this block over all of topk_idx (staged in
// shared memory): a slot's position = the earlier slots of its expert; a rank leader's row = the
// earlier tokens on its rank, after the rows of lower ranks (compact mode) or at rank * capacity.
// Every block also builds the expert and rank histograms and writes its share of the counts rows.
template <typename IdxT>
__device__ void self_routing(const PackParams& p, int64_t t, const RouteSmem& s, unsigned char* smem) {
  const int K = p.K, E = p.E, R = p.R, El = p.El, TK = static_cast<int>(p.T) * K;
  int* ids = reinterpret_cast<int*>(smem + p.self_off);  // [TK] expert id, -1 not routed, -2 bad
  int* hist = ids + TK;                                   // [E] slots per expert
  int* rows = hist + E;                                   // [R] tokens on each rank
  int* bad = rows + R;                                    // [1] bad ids
  int* cnt = bad + 1;  // [3, K] per slot: position, row among its rank's rows, rows of lower ranks
  for (int i = threadIdx.x; i < E + R + 1 + 3 * K; i += blockDim.x) hist[i] = 0;
  const IdxT* idx = reinterpret_cast<const IdxT*>(p.idx);
  for (int i = threadIdx.x; i < TK; i += blockDim.x) {
    const int64_t e = load_idx<IdxT>(idx + i);
    ids[i] = (e >= 0 && e < E) ? static_cast<int>(e) : (e == -1 ? -1 : -2);
  }
  __syncthreads();
  int me[kSelfMaxK], mr[kSelfMaxK], c_pos[kSelfMaxK], c_row[kSelfMaxK], c_off[kSelfMaxK];
  bool lead[kSelfMaxK];
#pragma unroll
  for (int k = 0; k < kSelfMaxK; ++k) {
    me[k] = k < K ? ids[t * K + k] : -1;
    mr[k] = me[k] >= 0 ? me[k] / El : -1;
    lead[k] = mr[k] >= 0;
#pragma unroll
    for (int j = 0; j < k; ++j)
      if (mr[j] == mr[k]) lead[k] = false;
    c_pos[k] = c_row[k] = c_off[k] = 0;
  }
  int n_bad = 0;
  for (int64_t u = threadIdx.x; u < p.T; u += blockDim.x) {
    int ue[kSelfMaxK], ur[kSelfMaxK];
#pragma unroll
    for (int j = 0; j < kSelfMaxK; ++j) {
      ue[j] = j < K ? ids[u * K + j] : -1;
      ur[j] = ue[j] >= 0 ? ue[j] / El : -1;
      n_bad += ue[j] == -2;
      if (ue[j] >= 0) atomicAdd(hist + ue[j], 1);
    }
#pragma unroll
    for (int j = 0; j < kSelfMaxK; ++j) {
      bool first = ur[j] >= 0;  // token u's first slot on rank ur[j]: u has one row there
#pragma unroll
      for (int i = 0; i < j; ++i)
        if (ur[i] == ur[j]) first = false;
      if (first) atomicAdd(rows + ur[j], 1);
#pragma unroll
      for (int k = 0; k < kSelfMaxK; ++k) {
        if (me[k] >= 0 && ue[j] == me[k] && (u < t || (u == t && j < k))) ++c_pos[k];
        if (first && lead[k]) {
          c_off[k] += ur[j] < mr[k];
          c_row[k] += ur[j] == mr[k] && u < t;
        }
      }
    }
  }
  const bool lane0 = (threadIdx.x & 31) == 0;
  n_bad = __reduce_add_sync(kFull, n_bad);
  if (lane0 && n_bad) atomicAdd(bad, n_bad);
#pragma unroll
  for (int k = 0; k < kSelfMaxK; ++k) {
    if (k >= K) break;
    const int a = __reduce_add_sync(kFull, c_pos[k]), b = __reduce_add_sync(kFull, c_row[k]),
              c = __reduce_add_sync(kFull, c_off[k]);
    if (lane0) {
      atomicAdd(cnt + k, a);
      atomicAdd(cnt + K + k, b);
      atomicAdd(cnt + 2 * K + k, c);
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const int e = ids[t * K + k];
    int rank = -1, row = -1, le = -1, pos = -1;
    float wt = 0.0f;
    if (e >= 0) {
      rank = e / El;
      le = e - rank * El;
      pos = cnt[k];
      wt = __ldg(p.w + t * K + k);
      bool leader = true;
      for (int j = 0; j < k; ++j)
        if (ids[t * K + j] >= 0 && ids[t * K + j] / El == rank) leader = false;
      if (leader) {
        const int local = cnt[K + k];  // as load_routing: a rank over its capacity gets no row
        if (p.cap == 0) row = cnt[2 * K + k] + local;
        else if (local < p.cap) row = static_cast<int>(rank * p.cap + local);
      }
    }
    s.rank[k] = rank;
    s.row[k] = row;
    s.le[k] = le;
    s.pos[k] = pos;
    s.w[k] = wt;
  }
  const int C = kColExperts + El;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < static_cast<int64_t>(R) * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / C), c = static_cast<int>(i - static_cast<int64_t>(r) * C);
    p.counts[i] = c == kColRows ? rows[r] : c >= kColExperts ? hist[r * El + (c - kColExperts)]
                                                             : count_header(c, p.wire.hidden, K, *bad, p.wire.gran,
                                                                            p.dtype, p.grad);
  }
}

template <typename IdxT>
__device__ __forceinline__ void load_routing(const PackParams& p, int64_t t, const RouteSmem& s) {
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) {
    const int64_t slot = t * p.K + k;
    const int64_t e = load_idx<IdxT>(reinterpret_cast<const IdxT*>(p.idx) + slot);
    int rank = -1, row = -1, le = -1, pos = -1;
    float wt = 0.0f;
    if (e >= 0 && e < p.E) {
      const int ei = static_cast<int>(e);
      rank = ei / p.El;
      le = ei - rank * p.El;
      const int2 sr = __ldcg(p.slot_rank + slot);  // L2 loads: the layout kernel wrote these after this block began
      const int* co = p.chunk_off + (slot / p.chunk_slots) * p.cols;
      pos = __ldcg(co + ei) + sr.x;
      if (sr.y >= 0) {
        const int local = __ldcg(co + p.E + rank) + sr.y;  // row among this rank's rows
        // Capacity mode: a rank over its capacity is a caller bug (ops_cpu.cpp raises); its
        // extra rows are not written and their send_pos stays -1.
        if (p.cap == 0 || local < p.cap) row = __ldcg(p.rank_off + rank) + local;
      }
      wt = __ldg(p.w + slot);
    }
    s.rank[k] = rank;
    s.row[k] = row;
    s.le[k] = le;
    s.pos[k] = pos;
    s.w[k] = wt;
  }
}

// The routing of token t: from the layout kernel's tables, or counted by this block (SELF).
template <typename IdxT, bool SELF>
__device__ __forceinline__ void route_token(const PackParams& p, int64_t t, const RouteSmem& s, unsigned char* smem) {
  if constexpr (SELF) {
    self_routing<IdxT>(p, t, s, smem);
  } else {
    wait_prior_grid();  // the layout kernel's tables are complete
    load_routing<IdxT>(p, t, s);
  }
}

// send_pos[t, r]: the send row of token t for rank r, or -1.
__device__ __forceinline__ void write_send_pos(const PackParams& p, int64_t t, const RouteSmem& s) {
  for (int r = threadIdx.x; r < p.R; r += blockDim.x) {
    int v = -1;
    for (int k = 0; k < p.K; ++k)
      if (s.rank[k] == r && s.row[k] >= 0) v = s.row[k];
    p.send_pos[t * p.R + r] = v;
  }
}

// One 32-bit word of a row's tail, at byte offset off >= scale_off (4-aligned), for rank r.
__device__ __forceinline__ uint32_t dispatch_tail_word(const PackParams& p, int64_t off, int r, float row_scale,
                                                       const RouteSmem& s) {
  if (off < p.wire.weight_off) {
    if (p.wire.gran == kBlock128) return __float_as_uint(scale_of(s.amax[(off - p.wire.scale_off) >> 2]));
    return __float_as_uint(row_scale);
  }
  if (off < p.wire.expert_off) {
    const int k = static_cast<int>((off - p.wire.weight_off) >> 2);
    return s.rank[k] == r ? __float_as_uint(s.w[k]) : 0u;
  }
  if (off < p.wire.pos_off) {
    const int k = static_cast<int>((off - p.wire.expert_off) >> 2);
    return s.rank[k] == r ? static_cast<uint32_t>(s.le[k]) : 0xffffffffu;
  }
  if (off < p.wire.pos_off + 4 * static_cast<int64_t>(p.K)) {
    const int k = static_cast<int>((off - p.wire.pos_off) >> 2);
    return s.rank[k] == r ? static_cast<uint32_t>(s.pos[k]) : 0xffffffffu;
  }
  return 0u;
}

// The tail of one send row for rank r (bytes [H, row_bytes)): zeros up to scale_off, then the
// words of dispatch_tail_word; thread i of n writes every n-th byte / word (coalesced).
__device__ __forceinline__ void write_dispatch_tail(const PackParams& p, uint8_t* dst, int r, float row_scale,
                                                    const RouteSmem& s, int i, int n) {
  for (int64_t h = p.wire.hidden + i; h < p.wire.scale_off; h += n) dst[h] = 0;
  for (int64_t off = p.wire.scale_off + 4 * static_cast<int64_t>(i); off < p.wire.bytes;
       off += 4 * static_cast<int64_t>(n))
    *reinterpret_cast<uint32_t*>(dst + off) = dispatch_tail_word(p, off, r, row_scale, s);
}

// H % 16 == 0, 16-byte aligned x: UPT units of 16 elements per thread.
template <typename T, typename IdxT, int UPT, bool SELF>
__global__ void __launch_bounds__(UPT == 1 ? 512 : 1024) dispatch_pack_vec_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x;
  const int64_t U = p.wire.hidden / 16;
  const T* xrow = reinterpret_cast<const T*>(p.x) + t * p.wire.hidden;
  // self routing first: its counters and the row would not fit in registers together
  if constexpr (SELF) route_token<IdxT, SELF>(p, t, s, smem);
  uint32_t w[UPT][Elem<T>::kWords];
  load_units<T, UPT>(xrow, U, w);
  if constexpr (!SELF) route_token<IdxT, SELF>(p, t, s, smem);  // overlaps the row's loads

  // each branch has one __syncthreads(): the routing in shared memory is complete after it
  float q[UPT];
  RowQuant rq{0.0f, 0.0f, false};  // row, tensor
  if (p.wire.gran == kBlock128) {
    block128_multipliers<T, UPT>(w, U, q, [&](int64_t b, float m) { s.amax[b] = m; });
    __syncthreads();
  } else {
    rq = row_quant(p, amax_value(block_max_u32(units_amax_bits<T, UPT>(w, U), reinterpret_cast<uint32_t*>(s.red))));
#pragma unroll
    for (int j = 0; j < UPT; ++j) q[j] = rq.q;
  }
  uint4 out[UPT];
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) out[j] = rq.nan_row ? e4m3_nan_unit() : quantize_unit<T>(w[j], q[j]);
  }
  write_send_pos(p, t, s);

  // row n's tail is written by warp n % warps, so no warp computes every tail
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int n = 0;
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.wire.bytes;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (u < U) reinterpret_cast<uint4*>(dst)[u] = out[j];
    }
    if (warp == n++ % nwarps) write_dispatch_tail(p, dst, s.rank[k], rq.scale, s, threadIdx.x & 31, 32);
  }
}

// Any H, any alignment of x: element by element.
template <typename T, typename IdxT, bool SELF>
__global__ void __launch_bounds__(256) dispatch_pack_scalar_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x, H = p.wire.hidden;
  const T* xrow = reinterpret_cast<const T*>(p.x) + t * H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  route_token<IdxT, SELF>(p, t, s, smem);
  float rm = 0.0f;
  if (p.wire.gran == kBlock128) {
    const int64_t nb = H / kBlock;
    for (int64_t b = warp; b < nb; b += nwarps) {
      float m = 0.0f;
      for (int i = lane; i < kBlock; i += 32) m = amax_step(m, Elem<T>::load1(xrow + b * kBlock + i));
      m = warp_amax(m);
      if (lane == 0) s.amax[b] = m;
    }
  } else {  // the row's amax: its scale (row), whether it is finite (tensor)
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) rm = amax_step(rm, Elem<T>::load1(xrow + h));
    rm = warp_amax(rm);
    if (lane == 0) s.red[warp] = rm;
  }
  __syncthreads();
  RowQuant rq{0.0f, 0.0f, false};  // row, tensor
  if (p.wire.gran != kBlock128) {
    rm = 0.0f;
    for (int i = 0; i < nwarps; ++i) rm = amax_step(rm, s.red[i]);
    rq = row_quant(p, rm);
  }
  write_send_pos(p, t, s);
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    const int r = s.rank[k];
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.wire.bytes;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const float qh = p.wire.gran == kBlock128 ? quant_multiplier(s.amax[h / kBlock]) : rq.q;
      dst[h] = rq.nan_row ? kE4M3NaN : e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), qh));
    }
    write_dispatch_tail(p, dst, r, rq.scale, s, threadIdx.x, blockDim.x);
  }
}

// Raw wire: the activation's own bytes (x is a uint8 [T, H] view), read once, written per rank.
template <typename IdxT, bool SELF>
__global__ void __launch_bounds__(512) dispatch_pack_raw_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x, H = p.wire.hidden;
  const uint8_t* xrow = reinterpret_cast<const uint8_t*>(p.x) + t * H;
  route_token<IdxT, SELF>(p, t, s, smem);
  __syncthreads();
  write_send_pos(p, t, s);
  if (p.vec) {
    for (int64_t u = threadIdx.x; u < H / 16; u += blockDim.x) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(xrow) + u);
      for (int k = 0; k < p.K; ++k) {
        const int row = s.row[k];
        if (row >= 0) reinterpret_cast<uint4*>(p.send + static_cast<int64_t>(row) * p.wire.bytes)[u] = v;
      }
    }
  } else {
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const uint8_t v = xrow[h];
      for (int k = 0; k < p.K; ++k) {
        const int row = s.row[k];
        if (row >= 0) p.send[static_cast<int64_t>(row) * p.wire.bytes + h] = v;
      }
    }
  }
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    const int r = s.rank[k];
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.wire.bytes;
    write_dispatch_tail(p, dst, r, 0.0f, s, threadIdx.x, blockDim.x);
  }
}

// The pack kernels' parameters: the plan's shape, the buffers of this call.
PackParams pack_params(const DispatchPackPlan& plan, const Tensor& x, const Tensor& topk_weights,
                       const std::optional<Tensor>& tensor_scale, const Tensor& send, const Tensor& send_pos) {
  PackParams p{plan.shape};
  p.x = x.data_ptr();
  p.w = topk_weights.data_ptr<float>();
  p.tscale = plan.shape.wire.gran == kTensor ? tensor_scale->data_ptr<float>() : nullptr;
  p.tscale_q = plan.shape.wire.gran == kTensor && tensor_scale->numel() == 2;
  p.send = send.data_ptr<uint8_t>();
  p.send_pos = send_pos.data_ptr<int>();
  p.T = plan.T;
  p.vec = plan.vec;
  p.self_off = static_cast<int>(plan.route_smem);
  return p;
}

// One pack block per token: the kernel for the wire, x's dtype, the row's width and alignment, the
// index type and the self-routing flag; early (after the layout kernels) where pdl.
void launch_pack(const DispatchPackPlan& plan, const PackParams& p, at::ScalarType x_dtype, bool pdl,
                 cudaStream_t stream, int device) {
  const int64_t H = plan.shape.wire.hidden, U = H / 16;
  auto launch = [&](auto kernel, int threads) {
    ensure_smem(kernel, plan.smem, device, "dispatch_pack");
    launch_kernel(kernel, plan.T, threads, plan.smem, stream, pdl && !plan.self_route, p);
  };
  FP8A2A_DISPATCH_ROUTING(plan.idx64, plan.self_route, [&] {
    if (plan.shape.wire.gran == kRaw) {
      launch(dispatch_pack_raw_kernel<IdxT, SELF>, static_cast<int>(std::min<int64_t>(512, round_up32(p.vec ? U : H))));
      return;
    }
    const int upt = p.vec ? units_per_thread(U, /*prefer2=*/true) : 0;
    FP8A2A_DISPATCH_FLOAT(x_dtype, "dispatch_pack", [&] {
      if (upt == 1) launch(dispatch_pack_vec_kernel<scalar_t, IdxT, 1, SELF>, threads_for(U, 1));
      else if (upt == 2) launch(dispatch_pack_vec_kernel<scalar_t, IdxT, 2, SELF>, threads_for(U, 2));
      else launch(dispatch_pack_scalar_kernel<scalar_t, IdxT, SELF>, 256);
    });
  });
}

}  // namespace

DispatchPackPlan plan_dispatch_pack(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                                    int64_t granularity, int64_t rank_capacity, int64_t act_dtype, bool needs_grad) {
  const int64_t T = x.size(0), H = x.size(1), K = topk_idx.size(1), R = num_ranks, E = num_experts;
  const int64_t cols = E + R + 1;  // layout columns: per-expert slots, per-rank rows, bad ids
  DispatchPackPlan plan{};
  plan.T = T;
  plan.TK = T * K;
  plan.send_rows = send_buffer_rows(T, K, R, rank_capacity);
  TORCH_CHECK(plan.TK < INT_MAX && E < INT_MAX / 2 && plan.send_rows < INT_MAX,
              "fp8a2a: dispatch_pack on CUDA supports fewer than 2^31 slots and rows");
  plan.layout = plan_dispatch_layout(plan.TK, R, cols, x.get_device());

  DispatchShape& shape = plan.shape;  // the counts and the layout's tables: pointed at by the caller
  shape.idx = topk_idx.data_ptr();
  shape.wire = DispatchWire(DispatchRow(H, granularity, K), granularity);
  shape.cap = rank_capacity;
  shape.K = static_cast<int>(K);
  shape.E = static_cast<int>(E);
  shape.El = static_cast<int>(E / R);
  shape.R = static_cast<int>(R);
  shape.cols = static_cast<int>(cols);
  shape.chunk_slots = static_cast<int>(plan.layout.chunk_slots);
  shape.dtype = static_cast<int>(act_dtype);
  shape.grad = needs_grad ? 1 : 0;

  // Small batches (the host-bound regime): no layout kernel, each pack block routes its own token.
  plan.route_smem = route_smem_bytes(K, granularity == kBlock128 ? H / kBlock : 0);
  const size_t self_tables = self_smem_bytes(plan.TK, E, R, K);
  plan.self_route = T > 0 && T <= kSelfMaxTokens && plan.TK <= kSelfMaxSlots && K <= kSelfMaxK &&
                    plan.route_smem + self_tables <= static_cast<size_t>(kSmemDefault);
  plan.smem = plan.route_smem + (plan.self_route ? self_tables : 0);
  plan.idx64 = topk_idx.scalar_type() == at::kLong;
  plan.vec = H % 16 == 0 && aligned16(x.data_ptr());
  plan.send_bytes = plan.send_rows * shape.wire.bytes;
  plan.alloc_bytes = plan.send_bytes + (plan.self_route ? 0 : plan.layout.scratch_bytes(plan.TK));
  return plan;
}

std::tuple<Tensor, Tensor, Tensor> dispatch_pack_cuda(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                                                      int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                                      const std::optional<Tensor>& tensor_scale, int64_t rank_capacity,
                                                      bool needs_grad) {
  const Tensor x = check_dispatch_pack(x_in, topk_idx, topk_weights, num_experts, num_ranks, granularity, tensor_scale,
                                       rank_capacity);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int device = x.get_device();
  DispatchPackPlan plan = plan_dispatch_pack(x, topk_idx, num_experts, num_ranks, granularity, rank_capacity,
                                             act_dtype_code(x_in), needs_grad);
  const auto o = x.options();
  auto counts = at::empty({num_ranks, kColExperts + num_experts / num_ranks}, o.dtype(at::kLong));
  auto send_pos = at::empty({plan.T, num_ranks}, o.dtype(at::kInt));
  const Tensor alloc = at::empty({plan.alloc_bytes}, o.dtype(at::kByte));
  const Tensor send = plan.send(alloc);
  plan.shape.counts = counts.data_ptr<int64_t>();
  // the kernels after the layout kernel start early and wait for it (programmatic dependent launch)
  const bool pdl = dispatch_early_launch_ok(device);
  if (!plan.self_route)
    launch_dispatch_layout(plan.shape, plan.layout, plan.scratch(alloc), plan.TK, plan.idx64, pdl, stream, device);
  if (plan.T > 0)
    launch_pack(plan, pack_params(plan, x, topk_weights, tensor_scale, send, send_pos), x.scalar_type(), pdl, stream,
                device);
  return {send, counts, send_pos};
}

}  // namespace fp8a2a
