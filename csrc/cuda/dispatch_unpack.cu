// dispatch_unpack: one warp per received row, scattering it to its local experts' rows, with the
// rank/expert offset tables built per block from recv_counts; and dispatch_unpack_cuda.
#include "dispatch.cuh"

namespace fp8a2a {
namespace {

// =============================================================================================
// dispatch_unpack: one warp per received row, tables built per block from recv_counts
// =============================================================================================
struct UnpackParams {
  const uint8_t* recv;
  const int64_t* counts;
  uint8_t* data;
  float* scale;
  float* weights;
  int64_t* tpe;
  int* slot_pos;
  int* row_src;
  DispatchWire wire;
  int64_t Nr, N;
  int64_t rcap, ecap;  // capacity mode: rank_capacity, expert_capacity (0: compact)
  int K, R, El, C;
  int split;  // warps per received row (each writes every split-th target): few rows, many targets
  bool vec;
};

size_t unpack_smem_bytes(int64_t R, int64_t C, int64_t El, int64_t K, int warps) {
  return (R * C + R * El + El + (R + 1)) * 8 + static_cast<size_t>(warps) * K * 4;
}

// Exclusive scan of v[0, n) in place by one warp; returns the total.
__device__ __forceinline__ int64_t warp_exclusive_scan(int64_t* v, int n) {
  const int lane = threadIdx.x & 31;
  int64_t carry = 0;
  for (int b = 0; b < n; b += 32) {
    const int i = b + lane;
    const int64_t x = i < n ? v[i] : 0;
    int64_t inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(kFull, inc, o);
      if (lane >= o) inc += y;
    }
    if (i < n) v[i] = carry + inc - x;
    carry += __shfl_sync(kFull, inc, 31);
  }
  return carry;
}

// The offset tables every block builds from recv_counts in its shared memory (a few hundred
// int64), and this warp's list of a row's targets.
struct UnpackTables {
  int64_t* counts;  // [R, C] recv_counts
  int64_t* base;    // [R, El] first expert-major row of (source rank r, local expert e)
  int64_t* est;     // [El] tokens per expert, then (scanned) each expert's first row
  int64_t* rst;     // [R + 1] first received row of each source rank; [R]: the rows in all
  int* tgt;         // [K] this warp's: the expert rows the received row at hand goes to
};

__device__ __forceinline__ UnpackTables build_unpack_tables(const UnpackParams& p, unsigned char* smem) {
  UnpackTables tb;
  tb.counts = reinterpret_cast<int64_t*>(smem);
  tb.base = tb.counts + p.R * p.C;
  tb.est = tb.base + p.R * p.El;
  tb.rst = tb.est + p.El;
  tb.tgt = reinterpret_cast<int*>(tb.rst + p.R + 1) + (threadIdx.x >> 5) * p.K;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  for (int i = threadIdx.x; i < p.R * p.C; i += blockDim.x)
    tb.counts[i] = __ldg(reinterpret_cast<const long long*>(p.counts) + i);
  __syncthreads();
  for (int e = threadIdx.x; e < p.El; e += blockDim.x) {
    int64_t sum = 0;
    for (int r = 0; r < p.R; ++r) sum += tb.counts[r * p.C + kColExperts + e];
    tb.est[e] = sum;
    if (blockIdx.x == 0) p.tpe[e] = sum;
  }
  for (int r = threadIdx.x; r < p.R; r += blockDim.x) tb.rst[r] = tb.counts[r * p.C + kColRows];
  __syncthreads();
  if (warp == 0) warp_exclusive_scan(tb.est, p.El);
  if (warp == W - 1) {
    const int64_t total = warp_exclusive_scan(tb.rst, p.R);
    if (lane == 0) tb.rst[p.R] = total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.El; e += blockDim.x) {
    int64_t run = tb.est[e];
    for (int r = 0; r < p.R; ++r) {
      // Capacity mode: expert e owns rows [e * R * C, (e + 1) * R * C), source r a slice of C.
      tb.base[r * p.El + e] = p.ecap > 0 ? (static_cast<int64_t>(e) * p.R + r) * p.ecap : run;
      run += tb.counts[r * p.C + kColExperts + e];
    }
  }
  __syncthreads();
  return tb;
}

// The source rank of received row i, or -1 when no source announced it.
__device__ __forceinline__ int source_rank(const UnpackParams& p, const UnpackTables& tb, int64_t i) {
  if (p.ecap > 0) {
    const int64_t rr = i / p.rcap;
    return rr < p.R && i - rr * p.rcap < tb.counts[rr * p.C + kColRows] ? static_cast<int>(rr) : -1;
  }
  if (i >= tb.rst[p.R]) return -1;
  int lo = 0, hi = p.R - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tb.rst[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Row i's slots (from source rank r; -1: none): the expert rows they go to, listed in tb.tgt (in
// slot order); part 0 also writes slot_pos, and each target's weight and source row. Slots whose
// expert or position is out of range are skipped. Returns the number of targets.
__device__ __forceinline__ int row_targets(const UnpackParams& p, const UnpackTables& tb, int64_t i, int r,
                                           int part) {
  const int lane = threadIdx.x & 31;
  const uint8_t* row = p.recv + i * p.wire.bytes;
  int ntgt = 0;
  for (int k0 = 0; k0 < p.K; k0 += 32) {
    const int k = k0 + lane;
    int n = -1;
    float wt = 0.0f;
    if (k < p.K && r >= 0) {
      const int ex = __ldg(reinterpret_cast<const int*>(row + p.wire.expert_off) + k);
      const int ps = __ldg(reinterpret_cast<const int*>(row + p.wire.pos_off) + k);
      if (ex >= 0 && ex < p.El && ps >= 0 && ps < tb.counts[r * p.C + kColExperts + ex] && (p.ecap <= 0 || ps < p.ecap)) {
        const int64_t nn = tb.base[r * p.El + ex] + ps;
        if (nn >= 0 && nn < p.N) n = static_cast<int>(nn);
      }
      wt = __ldg(reinterpret_cast<const float*>(row + p.wire.weight_off) + k);
    }
    if (part == 0) {
      if (k < p.K) p.slot_pos[i * p.K + k] = n;
      if (n >= 0) {
        p.weights[n] = wt;
        p.row_src[n] = static_cast<int>(i);
      }
    }
    const unsigned m = __ballot_sync(kFull, n >= 0);
    if (n >= 0) tb.tgt[ntgt + __popc(m & ((1u << lane) - 1u))] = n;
    ntgt += __popc(m);
  }
  __syncwarp();
  return ntgt;
}

// Capacity mode: the padding rows (past each (source, expert) count) are zero (data, scales,
// weight) with no source (-1); warp gwarp of nwarps takes every nwarps-th row.
__device__ __forceinline__ void zero_padding_rows(const UnpackParams& p, const UnpackTables& tb, int64_t gwarp,
                                                  int64_t nwarps) {
  const int lane = threadIdx.x & 31;
  const int64_t U = p.wire.hidden / 16, seg = static_cast<int64_t>(p.R) * p.ecap;
  for (int64_t n = gwarp; n < p.N; n += nwarps) {
    const int64_t e = n / seg, rem = n - e * seg, r = rem / p.ecap, pos = rem - r * p.ecap;
    if (pos < tb.counts[r * p.C + kColExperts + e]) continue;  // a real row, written by row_targets' warp
    if (p.vec) {
      for (int64_t v = lane; v < U; v += 32)
        reinterpret_cast<uint4*>(p.data + n * p.wire.hidden)[v] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t hh = lane; hh < p.wire.hidden; hh += 32) p.data[n * p.wire.hidden + hh] = 0;
    }
    for (int c = lane; c < p.wire.num_scales; c += 32) p.scale[n * p.wire.num_scales + c] = 0.0f;
    if (lane == 0) {
      p.weights[n] = 0.0f;
      p.row_src[n] = -1;
    }
  }
}

__global__ void __launch_bounds__(256) dispatch_unpack_kernel(UnpackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const UnpackTables tb = build_unpack_tables(p, smem);
  const int lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const int64_t U = p.wire.hidden / 16;
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * W + (threadIdx.x >> 5);
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t item = gwarp; item < p.Nr * p.split; item += nwarps) {
    const int64_t i = item / p.split;
    const int part = static_cast<int>(item - i * p.split);  // this warp's share of row i's targets
    const int r = source_rank(p, tb, i);
    const uint8_t* row = p.recv + i * p.wire.bytes;
    const uint4* src = reinterpret_cast<const uint4*>(row);
    constexpr int PB = 8;  // 16-byte loads in flight per lane
    uint4 buf[PB];
    const bool early = p.vec && p.split == 1;  // split rows: only warps with targets read the payload
    if (early) {  // the payload's first batch does not depend on the routing fields: load it now
#pragma unroll
      for (int a = 0; a < PB; ++a)
        if (lane + a * 32 < U) buf[a] = __ldg(src + lane + a * 32);
    }
    const int ntgt = row_targets(p, tb, i, r, part);
    if (part >= ntgt) continue;  // nothing of this row for this warp (uniform across the warp)
    for (int j = part; j < ntgt; j += p.split) {
      const int64_t n = tb.tgt[j];
      for (int c = lane; c < p.wire.num_scales; c += 32)
        p.scale[n * p.wire.num_scales + c] = __ldg(reinterpret_cast<const float*>(row + p.wire.scale_off) + c);
    }
    // payload: read once, written to each target
    if (p.vec) {
      for (int64_t v0 = lane; v0 < U; v0 += PB * 32) {
        if (v0 != lane || !early) {
#pragma unroll
          for (int a = 0; a < PB; ++a)
            if (v0 + a * 32 < U) buf[a] = __ldg(src + v0 + a * 32);
        }
        for (int j = part; j < ntgt; j += p.split) {
          uint4* dst = reinterpret_cast<uint4*>(p.data + static_cast<int64_t>(tb.tgt[j]) * p.wire.hidden);
#pragma unroll
          for (int a = 0; a < PB; ++a)
            if (v0 + a * 32 < U) dst[v0 + a * 32] = buf[a];
        }
      }
    } else {
      for (int64_t hh = lane; hh < p.wire.hidden; hh += 32) {
        const uint8_t b = row[hh];
        for (int j = part; j < ntgt; j += p.split) p.data[static_cast<int64_t>(tb.tgt[j]) * p.wire.hidden + hh] = b;
      }
    }
    __syncwarp();
  }
  if (p.ecap > 0) zero_padding_rows(p, tb, gwarp, nwarps);
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dispatch_unpack_cuda(const Tensor& recv, const Tensor& recv_counts,
                                                                                int64_t hidden, int64_t granularity,
                                                                                int64_t topk, int64_t num_rows,
                                                                                int64_t rank_capacity,
                                                                                int64_t expert_capacity) {
  const DispatchRow L =
      check_unpack(recv, recv_counts, hidden, granularity, topk, num_rows, rank_capacity, expert_capacity);
  const auto counts = recv_counts.contiguous();
  const int64_t R = counts.size(0), C = counts.size(1), El = C - kColExperts, Nr = recv.size(0), H = hidden;
  const bool capacity = expert_capacity > 0;
  TORCH_CHECK(num_rows >= 0 && num_rows < INT_MAX && Nr < INT_MAX,
              "fp8a2a: dispatch_unpack on CUDA supports fewer than 2^31 rows, got num_rows=", num_rows);
  const c10::cuda::CUDAGuard guard(recv.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int device = recv.get_device();
  const auto o = recv.options();
  auto data = at::empty({num_rows, H}, o.dtype(granularity == kRaw ? at::kByte : at::kFloat8_e4m3fn));
  auto scale = at::empty(granularity == kTensor ? std::vector<int64_t>{num_rows} : scale_shape(num_rows, H, granularity),
                         o.dtype(at::kFloat));
  auto weights = at::empty({num_rows}, o.dtype(at::kFloat));
  auto tpe = at::empty({El}, o.dtype(at::kLong));
  auto slot_pos = at::empty({Nr, topk}, o.dtype(at::kInt));
  auto row_src = at::empty({num_rows}, o.dtype(at::kInt));
  if (R == 0) {
    tpe.zero_();
    if (Nr * topk > 0) slot_pos.fill_(-1);
    return {data, scale, weights, tpe, slot_pos, row_src};
  }
  UnpackParams p{};
  p.recv = recv.data_ptr<uint8_t>();
  p.counts = counts.data_ptr<int64_t>();
  p.data = reinterpret_cast<uint8_t*>(data.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.weights = weights.data_ptr<float>();
  p.tpe = tpe.data_ptr<int64_t>();
  p.slot_pos = slot_pos.data_ptr<int>();
  p.row_src = row_src.data_ptr<int>();
  p.wire = DispatchWire(L, granularity);
  p.Nr = Nr;
  p.N = num_rows;
  p.rcap = rank_capacity;
  p.ecap = expert_capacity;
  p.K = static_cast<int>(topk);
  p.R = static_cast<int>(R);
  p.El = static_cast<int>(El);
  p.C = static_cast<int>(C);
  p.vec = H % 16 == 0 && aligned16(p.recv) && aligned16(p.data);
  constexpr int kWarps = 8;
  const size_t smem = unpack_smem_bytes(R, C, El, topk, kWarps);
  ensure_smem(dispatch_unpack_kernel, smem, device, "dispatch_unpack");
  // Few rows (small batches): split each row's targets over up to topk warps, so that one warp
  // does not write all of a row's copies alone while most of the GPU idles.
  const int64_t max_warps = 4 * num_sms(device) * kWarps;
  p.split = static_cast<int>(std::clamp<int64_t>(Nr > 0 ? max_warps / Nr : 1, 1, std::max<int64_t>(1, topk)));
  const int64_t work = std::max(Nr * p.split, capacity ? num_rows : int64_t{0});
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + kWarps - 1) / kWarps, max_warps / kWarps));
  dispatch_unpack_kernel<<<blocks, kWarps * 32, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Tensor granularity keeps one scale per row, as on the CPU.
  return {data, scale, weights, tpe, slot_pos, row_src};
}

}  // namespace fp8a2a
