// dispatch_pack's layout stage: the layout kernel (per-chunk counts and positions) and the scan
// kernel (the chunk totals scanned over chunks, the counts, the rank offsets), and their host side:
// geometry, the tables' place in the scratch, the launches. dispatch_pack.cu's pack kernel reads
// the tables.
#include "dispatch.cuh"

namespace fp8a2a {
namespace {

constexpr int kMaxLayoutSteps = 8;

// The flattened slots (t, k) of topk_idx are cut into chunks of chunk_slots; each chunk is one block
// of W warps, each warp owning `steps` consecutive groups of 32 slots. Positions follow the slot
// order, which is token order: (rank, local expert) positions count slots, rank rows count the
// first slot of each token that reaches the rank ("rank leader").
// Per chunk: pass 0 counts per warp (match_any groups equal keys), the counts are scanned across
// warps (chunk totals go to chunk_tot[chunk]), pass 1 assigns in-chunk positions.
// One chunk: its block writes counts and rank_off itself; several: dispatch_scan_kernel scans the
// chunk totals across chunks (exclusive, into chunk_off) and writes them.
// Flat, with the fields of DispatchShape the layout reads (H: the wire row's hidden, for the counts
// header): a DispatchWire member here makes nvcc address the parameters through a pointer.
struct LayoutParams {
  const void* idx;
  int64_t TK;
  int K, E, El, R, cols, chunk_slots, steps, nchunks;
  int64_t H, gran, cap;  // cap: rank_capacity (capacity mode), 0 compact
  int2* slot_rank;  // [TK]: (position within (rank, expert) in the chunk, or -1; row within rank in the chunk, or -1)
  int* chunk_tot;   // [nchunks, cols]: chunk totals (layout kernel)
  int* chunk_off;   // [nchunks, cols]: exclusive prefix of the totals over chunks (scan kernel)
  int* rank_off;    // [R]: first send row of each rank
  int64_t* counts;  // [R, kColExperts + El]
  int dtype, grad;  // the header's kColDtype and kColGrad; last: the fields above keep their offsets
};

// counts[r, :] entries of column col of the layout (expert, rank rows, bad ids) from its total;
// the bad-ids column also writes the header columns.
__device__ __forceinline__ void write_count_column(const LayoutParams& p, int col, int total) {
  const int C = kColExperts + p.El;
  if (col < p.E) {
    const int r = col / p.El;
    p.counts[r * C + kColExperts + (col - r * p.El)] = total;
  } else if (col < p.E + p.R) {
    p.counts[(col - p.E) * C + kColRows] = total;
  } else {
    for (int r = 0; r < p.R; ++r)
      for (int c = 0; c < kColRows; ++c)
        p.counts[static_cast<int64_t>(r) * C + c] = count_header(c, p.H, p.K, total, p.gran, p.dtype, p.grad);
  }
}

// rank_off of ranks base + lane (lane < 32 of one warp; v: that rank's rows, 0 past the last rank):
// the rows of lower ranks (carry: those below base), or r * capacity. Returns the carry for base + 32.
__device__ __forceinline__ int write_rank_offsets(const LayoutParams& p, int base, int v, int carry) {
  const int lane = threadIdx.x & 31, r = base + lane;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(kFull, inc, o);
    if (lane >= o) inc += n;
  }
  if (r < p.R) p.rank_off[r] = p.cap > 0 ? static_cast<int>(r * p.cap) : carry + inc - v;
  return carry + __shfl_sync(kFull, inc, 31);
}

template <typename IdxT>
__global__ void __launch_bounds__(512) dispatch_layout_kernel(LayoutParams p) {
  extern __shared__ int hist[];  // [W, cols]
  allow_dependent_grid();  // the next kernel may start now (it waits for this one's results)
  const int W = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cols = p.cols;
  const IdxT* idx = reinterpret_cast<const IdxT*>(p.idx);
  for (int i = threadIdx.x; i < W * cols; i += blockDim.x) hist[i] = 0;
  __syncthreads();

  const int64_t wbase = static_cast<int64_t>(blockIdx.x) * p.chunk_slots + static_cast<int64_t>(warp) * p.steps * 32;
  int* h = hist + warp * cols;
  const unsigned lt = (1u << lane) - 1u;
  const bool aligned_tokens = (32 % p.K) == 0;  // a token's slots never straddle a group of 32
  int64_t ev[kMaxLayoutSteps];
#pragma unroll
  for (int s = 0; s < kMaxLayoutSteps; ++s) {
    const int64_t slot = wbase + s * 32 + lane;
    ev[s] = (s < p.steps && slot < p.TK) ? load_idx<IdxT>(idx + slot) : INT64_MIN;
  }

  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int s = 0; s < kMaxLayoutSteps; ++s) {
      if (s >= p.steps) break;
      const int64_t slot = wbase + s * 32 + lane;
      const int64_t e64 = ev[s];
      const bool in = slot < p.TK;
      const bool valid = in && e64 >= 0 && e64 < p.E;
      const bool bad = in && !valid && e64 != -1;
      const int e = valid ? static_cast<int>(e64) : -1;
      const int r = valid ? e / p.El : -1;
      bool lead = valid;
      if (aligned_tokens) {
        const int k = lane % p.K;
        for (int j = 1; j < p.K; ++j) {
          const int o = __shfl_up_sync(kFull, r, j);
          if (j <= k && o == r) lead = false;
        }
      } else if (valid) {
        const int64_t t = slot / p.K;
        const int k = static_cast<int>(slot - t * p.K);
        for (int j = 0; j < k; ++j) {
          const int64_t o = load_idx<IdxT>(idx + t * p.K + j);
          if (o >= 0 && o < p.E && static_cast<int>(o) / p.El == r) {
            lead = false;
            break;
          }
        }
      }
      const int rk = lead ? r : -1;
      const unsigned me = __match_any_sync(kFull, e);
      const unsigned mr = __match_any_sync(kFull, rk);
      const bool e_first = e >= 0 && (__ffs(me) - 1) == lane;
      const bool r_first = rk >= 0 && (__ffs(mr) - 1) == lane;
      if (pass == 0) {
        if (e_first) h[e] += __popc(me);
        if (r_first) h[p.E + rk] += __popc(mr);
        const unsigned mb = __ballot_sync(kFull, bad);
        if (lane == 0) h[p.E + p.R] += __popc(mb);
      } else {
        const int pos = e >= 0 ? h[e] + __popc(me & lt) : -1;
        const int row = rk >= 0 ? h[p.E + rk] + __popc(mr & lt) : -1;
        __syncwarp();
        if (e_first) h[e] += __popc(me);
        if (r_first) h[p.E + rk] += __popc(mr);
        if (in) p.slot_rank[slot] = make_int2(pos, row);
      }
      __syncwarp();
    }
    if (pass == 0) {
      __syncthreads();
      for (int col = threadIdx.x; col < cols; col += blockDim.x) {
        int run = 0;
        for (int w = 0; w < W; ++w) {
          const int v = hist[w * cols + col];
          hist[w * cols + col] = run;
          run += v;
        }
        p.chunk_tot[static_cast<int64_t>(blockIdx.x) * cols + col] = run;
      }
      __syncthreads();
    }
  }

  // ---- one chunk: its totals are the counts (several: dispatch_scan_kernel scans the chunks) ----
  if (p.nchunks > 1) return;
  __syncthreads();
  int* tot = hist;  // [cols]
  for (int col = threadIdx.x; col < cols; col += blockDim.x) {
    tot[col] = p.chunk_tot[col];
    p.chunk_off[col] = 0;
  }
  __syncthreads();
  for (int col = threadIdx.x; col < cols; col += blockDim.x) write_count_column(p, col, tot[col]);
  if (warp == 0) {
    int carry = 0;
    for (int b = 0; b < p.R; b += 32) carry = write_rank_offsets(p, b, b + lane < p.R ? tot[p.E + b + lane] : 0, carry);
  }
}

// Several chunks: chunk_off's chunk totals become exclusive prefixes over the chunks, column by
// column: a block per kScanCols columns, its threads summing kScanRows ranges of chunks; the
// columns' totals are the counts; the last block sums the rank columns for rank_off.
constexpr int kScanCols = 32, kScanRows = 16, kScanBatch = 8;

// sum of chunk_tot[c, col] over chunks [c0, c1), kScanBatch loads in flight
__device__ __forceinline__ int sum_chunks(const LayoutParams& p, int col, int c0, int c1) {
  int sum = 0;
  for (int b = c0; b < c1; b += kScanBatch) {
    int v[kScanBatch];
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) v[j] = b + j < c1 ? p.chunk_tot[static_cast<int64_t>(b + j) * p.cols + col] : 0;
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) sum += v[j];
  }
  return sum;
}

__global__ void __launch_bounds__(kScanCols * kScanRows) dispatch_scan_kernel(LayoutParams p) {
  __shared__ int part[kScanRows][kScanCols + 1];  // [chunk range, column]: partial sums
  allow_dependent_grid();
  wait_prior_grid();  // the layout kernel's chunk totals
  const int cx = threadIdx.x % kScanCols, cy = threadIdx.x / kScanCols;
  const int per = (p.nchunks + kScanRows - 1) / kScanRows;
  const int c0 = min(p.nchunks, cy * per), c1 = min(p.nchunks, c0 + per);
  if (blockIdx.x == gridDim.x - 1) {  // rank_off: the rank columns' totals, 32 ranks at a time
    int carry = 0;
    for (int base = 0; base < p.R; base += kScanCols) {
      part[cy][cx] = base + cx < p.R ? sum_chunks(p, p.E + base + cx, c0, c1) : 0;
      __syncthreads();
      if (threadIdx.x < kScanCols) {
        int v = 0;
        for (int y = 0; y < kScanRows; ++y) v += part[y][cx];
        carry = write_rank_offsets(p, base, v, carry);
      }
      __syncthreads();
    }
    return;
  }
  const int col = blockIdx.x * kScanCols + cx;
  part[cy][cx] = col < p.cols ? sum_chunks(p, col, c0, c1) : 0;
  __syncthreads();
  if (col >= p.cols) return;
  int before = 0, total = 0;
  for (int y = 0; y < kScanRows; ++y) {
    const int v = part[y][cx];
    before += y < cy ? v : 0;
    total += v;
  }
  for (int b = c0; b < c1; b += kScanBatch) {  // chunk totals -> exclusive prefixes
    int v[kScanBatch];
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) v[j] = b + j < c1 ? p.chunk_tot[static_cast<int64_t>(b + j) * p.cols + col] : 0;
#pragma unroll
    for (int j = 0; j < kScanBatch; ++j) {
      if (b + j < c1) p.chunk_off[static_cast<int64_t>(b + j) * p.cols + col] = before;
      before += v[j];
    }
  }
  if (cy == 0) write_count_column(p, col, total);
}

}  // namespace

LayoutPlan plan_dispatch_layout(int64_t TK, int64_t R, int64_t cols, int device) {
  LayoutPlan plan{};
  // chunks of W warps x steps groups of 32 slots, about one per SM
  int W = 16;
  while (W > 1 && static_cast<int64_t>(W) * cols * 4 > kSmemDefault) W /= 2;
  plan.warps = W;
  plan.smem = static_cast<size_t>(W) * cols * 4;
  const int64_t per_step = static_cast<int64_t>(W) * 32;
  const int64_t sms = num_sms(device);
  // Up to W * 32 * kMaxLayoutSteps slots one chunk (one block: no cross-block scan, no counter to
  // clear, one launch less); above, about one chunk per SM.
  const int64_t one_chunk_steps = (TK + per_step - 1) / per_step;
  plan.steps = static_cast<int>(one_chunk_steps <= kMaxLayoutSteps
      ? std::max<int64_t>(1, one_chunk_steps)
      : std::min<int64_t>(kMaxLayoutSteps, (TK + per_step * sms - 1) / (per_step * sms)));
  plan.chunk_slots = per_step * plan.steps;
  plan.nchunks = std::max<int64_t>(1, (TK + plan.chunk_slots - 1) / plan.chunk_slots);
  TORCH_CHECK(2 * plan.nchunks * cols < INT_MAX,
              "fp8a2a: dispatch_pack: too many tokens x experts for the CUDA layout");
  // The scan kernel reads chunk_tot and writes chunk_off: no block reads what another one writes.
  plan.slot_off = (R + 2 * plan.nchunks * cols + 1) / 2 * 2;
  return plan;
}

bool dispatch_early_launch_ok(int device) { return early_launch_ok(dispatch_scan_kernel, device); }

void launch_dispatch_layout(DispatchShape& shape, const LayoutPlan& plan, int* scratch, int64_t TK, bool idx64,
                            bool pdl, cudaStream_t stream, int device) {
  const int64_t cols = shape.cols;
  shape.rank_off = scratch;
  shape.chunk_off = scratch + shape.R;
  shape.slot_rank = reinterpret_cast<int2*>(scratch + plan.slot_off);
  LayoutParams lp{};
  lp.idx = shape.idx;
  lp.TK = TK;
  lp.K = shape.K;
  lp.E = shape.E;
  lp.El = shape.El;
  lp.R = shape.R;
  lp.cols = shape.cols;
  lp.chunk_slots = shape.chunk_slots;
  lp.steps = plan.steps;
  lp.nchunks = static_cast<int>(plan.nchunks);
  lp.H = shape.wire.hidden;
  lp.gran = shape.wire.gran;
  lp.dtype = shape.dtype;
  lp.grad = shape.grad;
  lp.cap = shape.cap;
  lp.slot_rank = shape.slot_rank;
  lp.chunk_tot = scratch + shape.R + plan.nchunks * cols;
  lp.chunk_off = shape.chunk_off;
  lp.rank_off = shape.rank_off;
  lp.counts = shape.counts;
  FP8A2A_DISPATCH_INDEX(idx64, [&] {
    ensure_smem(dispatch_layout_kernel<IdxT>, plan.smem, device, "dispatch_pack layout");
    dispatch_layout_kernel<IdxT><<<plan.nchunks, plan.warps * 32, plan.smem, stream>>>(lp);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (plan.nchunks > 1)  // a block per kScanCols columns, and one for the rank offsets
    launch_kernel(dispatch_scan_kernel, (cols + kScanCols - 1) / kScanCols + 1, kScanCols * kScanRows, 0, stream, pdl,
                  lp);
}

}  // namespace fp8a2a
