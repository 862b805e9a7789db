// combine_pack (expert side: the weighted sum of a received row's expert outputs in float32, one
// wire row in the activation's dtype or e4m3), combine_unpack (token side: the sum of the rows
// sent back for a token) and combine_backward_rows (expert side of combine's backward: the
// gradient of expert_out and of the router weights from dy's rows): kernels and host entry points.
#include "common.cuh"

namespace fp8a2a {
namespace {

// =============================================================================================
// combine kernels' fp32 row accumulators: UPT units of 16 elements per thread (unit u = threadIdx.x
// + j * blockDim.x of the U in a row)
// =============================================================================================
template <int UPT>
__device__ __forceinline__ void zero_units(float (&acc)[UPT][16]) {
#pragma unroll
  for (int j = 0; j < UPT; ++j)
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[j][e] = 0.0f;
}

template <typename T, int UPT>
__device__ __forceinline__ void store_units(const float (&acc)[UPT][16], T* out, int64_t U) {
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      uint32_t w[Elem<T>::kWords];
#pragma unroll
      for (int e = 0; e < 16; ++e) Elem<T>::put(w, e, acc[j][e]);
      store_unit<T>(out, u, w);
    }
  }
}

// =============================================================================================
// combine_pack: one block per received row. T: expert_out's element type; O: the wire payload's
// (the activation's) when not quantized. Weighted and summed in float32, converted when written.
// =============================================================================================
struct CombPackParams {
  const void* eo;
  const int* slot_pos;
  const float* weights;
  const float* extra;
  uint8_t* buf;
  int64_t N, H, Nr, row_bytes, payload_bytes, scale_off, extra_off;
  int K, extra_k;
  bool quant;
};

__device__ __forceinline__ uint32_t combine_tail_word(const CombPackParams& p, int64_t i, int64_t off, float scale) {
  if (off < p.scale_off) return 0u;
  if (p.quant && off < p.scale_off + 4) return __float_as_uint(scale);
  if (off < p.extra_off + 4 * static_cast<int64_t>(p.extra_k)) {
    const int k = static_cast<int>((off - p.extra_off) >> 2);
    const int n = __ldg(p.slot_pos + i * p.K + k);
    return (n >= 0 && n < p.N) ? __float_as_uint(__ldg(p.extra + n)) : 0u;
  }
  return 0u;
}

template <typename T, typename O, int UPT>
__global__ void __launch_bounds__(UPT == 1 ? 512 : 1024) combine_pack_vec_kernel(CombPackParams p) {
  __shared__ uint32_t s_red[32];
  const int64_t i = blockIdx.x;
  const int64_t U = p.H / 16;
  float acc[UPT][16];
  zero_units(acc);
  for (int k = 0; k < p.K; ++k) {
    const int n = __ldg(p.slot_pos + i * p.K + k);
    if (n < 0 || n >= p.N) continue;
    const float wt = p.weights ? __ldg(p.weights + n) : 1.0f;
    const T* src = reinterpret_cast<const T*>(p.eo) + static_cast<int64_t>(n) * p.H;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (u < U) {
        uint32_t w[Elem<T>::kWords];
        load_unit<T>(src, u, w);
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[j][e] = __fadd_rn(acc[j][e], __fmul_rn(wt, Elem<T>::get(w, e)));
      }
    }
  }
  uint8_t* dst = p.buf + i * p.row_bytes;
  float scale = 0.0f;
  if (p.quant) {
    uint32_t mb = 0;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (u < U)
#pragma unroll
        for (int e = 0; e < 16; ++e) mb = max(mb, abs_bits(acc[j][e]));
    }
    const float m = amax_value(block_max_u32(mb, s_red));
    const float q = quant_multiplier(m);
    scale = scale_of(m);
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (u < U) reinterpret_cast<uint4*>(dst)[u] = quantize_f32x16(acc[j], q);
    }
  } else {
    store_units<O, UPT>(acc, reinterpret_cast<O*>(dst), U);
  }
  const int64_t tail_vecs = (p.row_bytes - p.payload_bytes) / 16;
  for (int64_t v = threadIdx.x; v < tail_vecs; v += blockDim.x) {
    const int64_t off = p.payload_bytes + 16 * v;
    uint4 o;
    o.x = combine_tail_word(p, i, off, scale);
    o.y = combine_tail_word(p, i, off + 4, scale);
    o.z = combine_tail_word(p, i, off + 8, scale);
    o.w = combine_tail_word(p, i, off + 12, scale);
    reinterpret_cast<uint4*>(dst + p.payload_bytes)[v] = o;
  }
}

template <typename T>
__device__ __forceinline__ float combine_acc(const CombPackParams& p, int64_t i, int64_t h) {
  float a = 0.0f;
  for (int k = 0; k < p.K; ++k) {
    const int n = __ldg(p.slot_pos + i * p.K + k);
    if (n < 0 || n >= p.N) continue;
    const float wt = p.weights ? __ldg(p.weights + n) : 1.0f;
    a = __fadd_rn(a, __fmul_rn(wt, Elem<T>::load1(reinterpret_cast<const T*>(p.eo) + static_cast<int64_t>(n) * p.H + h)));
  }
  return a;
}

template <typename T, typename O>
__global__ void __launch_bounds__(256) combine_pack_scalar_kernel(CombPackParams p) {
  __shared__ float s_red[32];
  const int64_t i = blockIdx.x;
  uint8_t* dst = p.buf + i * p.row_bytes;
  float scale = 0.0f;
  if (p.quant) {
    float m = 0.0f;
    for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) m = amax_step(m, combine_acc<T>(p, i, h));
    m = warp_amax(m);
    if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = amax_step(m, s_red[w]);
    const float q = quant_multiplier(m);
    scale = scale_of(m);
    for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) dst[h] = e4m3_1(__fmul_rn(combine_acc<T>(p, i, h), q));
  } else {
    O* out = reinterpret_cast<O*>(dst);
    for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) Elem<O>::store1(out + h, combine_acc<T>(p, i, h));
  }
  for (int64_t b = p.payload_bytes + threadIdx.x; b < p.scale_off; b += blockDim.x) dst[b] = 0;
  for (int64_t off = p.scale_off + 4 * static_cast<int64_t>(threadIdx.x); off < p.row_bytes; off += 4 * blockDim.x)
    *reinterpret_cast<uint32_t*>(dst + off) = combine_tail_word(p, i, off, scale);
}

// =============================================================================================
// combine_unpack: one block per token
// =============================================================================================
struct CombUnpackParams {
  const uint8_t* buf;
  const int* send_pos;
  void* y;
  float* extra;
  int64_t T, H, rows, row_bytes, scale_off, extra_off;
  int R, extra_k;
  bool quant;
};

// token t's extra columns (the router weights the combine backward needs): summed over its rows
__device__ __forceinline__ void sum_extra(const CombUnpackParams& p, int64_t t) {
  for (int k = threadIdx.x; k < p.extra_k; k += blockDim.x) {
    float a = 0.0f;
    for (int r = 0; r < p.R; ++r) {
      const int s = __ldg(p.send_pos + t * p.R + r);
      if (s < 0 || s >= p.rows) continue;
      a = __fadd_rn(a, __ldg(reinterpret_cast<const float*>(p.buf + static_cast<int64_t>(s) * p.row_bytes + p.extra_off) + k));
    }
    p.extra[t * p.extra_k + k] = a;
  }
}

template <typename T, int UPT>
__global__ void __launch_bounds__(UPT == 1 ? 512 : 1024) combine_unpack_vec_kernel(CombUnpackParams p) {
  const int64_t t = blockIdx.x;
  const int64_t U = p.H / 16;
  float acc[UPT][16];
  zero_units(acc);
  for (int r = 0; r < p.R; ++r) {
    const int s = __ldg(p.send_pos + t * p.R + r);
    if (s < 0 || s >= p.rows) continue;
    const uint8_t* row = p.buf + static_cast<int64_t>(s) * p.row_bytes;
    if (p.quant) {
      const float sc = __ldg(reinterpret_cast<const float*>(row + p.scale_off));
#pragma unroll
      for (int j = 0; j < UPT; ++j) {
        const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (u < U) {
          float f[16];
          fp8_unit_to_f32(load_fp8_unit(row + u * 16), f);
#pragma unroll
          for (int e = 0; e < 16; ++e) acc[j][e] = __fadd_rn(acc[j][e], __fmul_rn(f[e], sc));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < UPT; ++j) {
        const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (u < U) {
          uint32_t w[Elem<T>::kWords];
          load_unit<T>(reinterpret_cast<const T*>(row), u, w);
#pragma unroll
          for (int e = 0; e < 16; ++e) acc[j][e] = __fadd_rn(acc[j][e], Elem<T>::get(w, e));
        }
      }
    }
  }
  store_units<T, UPT>(acc, reinterpret_cast<T*>(p.y) + t * p.H, U);
  sum_extra(p, t);
}

template <typename T>
__global__ void __launch_bounds__(256) combine_unpack_scalar_kernel(CombUnpackParams p) {
  const int64_t t = blockIdx.x;
  T* yrow = reinterpret_cast<T*>(p.y) + t * p.H;
  for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) {
    float a = 0.0f;
    for (int r = 0; r < p.R; ++r) {
      const int s = __ldg(p.send_pos + t * p.R + r);
      if (s < 0 || s >= p.rows) continue;
      const uint8_t* row = p.buf + static_cast<int64_t>(s) * p.row_bytes;
      if (p.quant)
        a = __fadd_rn(a, __fmul_rn(e4m3_to_f32_1(row[h]), *reinterpret_cast<const float*>(row + p.scale_off)));
      else
        a = __fadd_rn(a, Elem<T>::load1(reinterpret_cast<const T*>(row) + h));
    }
    Elem<T>::store1(yrow + h, a);
  }
  sum_extra(p, t);
}

// =============================================================================================
// combine_backward_rows: one warp per row of dy as it came back to the experts (e4m3 + row scale,
// or raw). Each lane reads its units of the row and of expert_out once, writes the gradient once
// and sums its units' products; the warp reduces them in fp8_common.h's order (kDotUnit) so the
// router-weight gradient equals the CPU's bit for bit.
// =============================================================================================
constexpr int kBwdWarps = 8;  // rows per block

struct E4M3 {};  // the rows' element type tag of e4m3 rows (raw rows: their float type)

struct CombBwdParams {
  const void* data;
  const float* scale;    // e4m3 rows: the row scales
  const float* weights;  // nullptr: unweighted
  const void* eo;        // nullptr: no router-weight gradient
  void* grad;
  float* grad_w;
  int64_t N, H;
};

// A unit of dy as loaded (its 16-byte words: 4 for e4m3, 4-16 for raw rows) and its 16 unscaled values.
template <typename D>
struct DyUnit {
  static constexpr int kWords = Elem<D>::kWords;
  static __device__ __forceinline__ void load(const void* row, int64_t u, uint32_t (&w)[kWords]) {
    load_unit<D>(reinterpret_cast<const D*>(row), u, w);
  }
  static __device__ __forceinline__ void values(const uint32_t (&w)[kWords], float (&f)[16]) {
#pragma unroll
    for (int e = 0; e < 16; ++e) f[e] = Elem<D>::get(w, e);
  }
};

template <>
struct DyUnit<E4M3> {
  static constexpr int kWords = 4;
  static __device__ __forceinline__ void load(const void* row, int64_t u, uint32_t (&w)[kWords]) {
    const uint4 q = load_fp8_unit(reinterpret_cast<const uint8_t*>(row) + u * 16);
    w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
  }
  static __device__ __forceinline__ void values(const uint32_t (&w)[kWords], float (&f)[16]) {
    fp8_unit_to_f32(make_uint4(w[0], w[1], w[2], w[3]), f);
  }
};

template <typename D>
__device__ __forceinline__ float load_dy1(const void* row, int64_t h) {
  if constexpr (std::is_same<D, E4M3>::value) return e4m3_to_f32_1(reinterpret_cast<const uint8_t*>(row)[h]);
  else return Elem<D>::load1(reinterpret_cast<const D*>(row) + h);
}

// Units in flight per lane: 4 where a unit of dy and of expert_out is at most 16 words together.
template <typename D, typename T>
constexpr int bwd_batch() {
  constexpr int words = DyUnit<D>::kWords + Elem<T>::kWords;
  return words <= 16 ? 4 : (words <= 32 ? 2 : 1);
}

// This warp's row and its multipliers: s the row scale (1 for raw rows), m the gradient's
// multiplier (e4m3: s * weight, as dequantize(data, scale * w); raw: the weight), scaled: whether
// to multiply at all (raw unweighted rows are converted as they are).
struct BwdRow {
  int64_t n;
  float s, m;
  bool scaled;
};

template <typename D>
__device__ __forceinline__ BwdRow bwd_row(const CombBwdParams& p) {
  constexpr bool fp8 = std::is_same<D, E4M3>::value;
  BwdRow r;
  r.n = static_cast<int64_t>(blockIdx.x) * kBwdWarps + (threadIdx.x >> 5);
  r.s = fp8 && r.n < p.N ? __ldg(p.scale + r.n) : 1.0f;
  const float w = p.weights && r.n < p.N ? __ldg(p.weights + r.n) : 1.0f;
  r.m = fp8 ? (p.weights ? __fmul_rn(r.s, w) : r.s) : w;
  r.scaled = fp8 || p.weights != nullptr;
  return r;
}

// the lanes' partials summed (fp8_common.h step 4) and written by lane 0: e4m3 rows' times the scale
template <typename D>
__device__ __forceinline__ void store_grad_w(const CombBwdParams& p, const BwdRow& r, float acc) {
#pragma unroll
  for (int o = kDotLanes / 2; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(kFull, acc, o));
  if ((threadIdx.x & 31) == 0) p.grad_w[r.n] = std::is_same<D, E4M3>::value ? __fmul_rn(acc, r.s) : acc;
}

template <typename D, typename T>
__global__ void __launch_bounds__(kBwdWarps * 32) combine_backward_vec_kernel(CombBwdParams p) {
  constexpr int B = bwd_batch<D, T>();
  constexpr int64_t kDataElem = std::is_same<D, E4M3>::value ? 1 : sizeof(D);
  const BwdRow r = bwd_row<D>(p);
  if (r.n >= p.N) return;  // the whole warp: its lanes share the row
  const int lane = threadIdx.x & 31;
  const int64_t U = p.H / 16;
  const void* drow = reinterpret_cast<const uint8_t*>(p.data) + r.n * p.H * kDataElem;
  const T* erow = p.eo ? reinterpret_cast<const T*>(p.eo) + r.n * p.H : nullptr;
  T* grow = reinterpret_cast<T*>(p.grad) + r.n * p.H;
  float acc = 0.0f;
  for (int64_t u0 = lane; u0 < U; u0 += kDotLanes * B) {
    uint32_t dw[B][DyUnit<D>::kWords];
    uint32_t ew[B][Elem<T>::kWords];
#pragma unroll
    for (int b = 0; b < B; ++b) {  // every load of the batch first: B units in flight
      const int64_t u = u0 + static_cast<int64_t>(b) * kDotLanes;
      if (u < U) {
        DyUnit<D>::load(drow, u, dw[b]);
        if (erow) load_unit<T>(erow, u, ew[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t u = u0 + static_cast<int64_t>(b) * kDotLanes;
      if (u < U) {
        float f[16];
        DyUnit<D>::values(dw[b], f);
        uint32_t gw[Elem<T>::kWords];
#pragma unroll
        for (int e = 0; e < 16; ++e) Elem<T>::put(gw, e, r.scaled ? __fmul_rn(f[e], r.m) : f[e]);
        store_unit<T>(grow, u, gw);
        if (erow) {  // unit u belongs to lane u % 32: this lane, in increasing u
          float pr[kDotUnit];
#pragma unroll
          for (int e = 0; e < 16; ++e) pr[e] = __fmul_rn(f[e], Elem<T>::get(ew[b], e));
          acc = __fadd_rn(acc, sum16_pairwise(pr));
        }
      }
    }
  }
  if (erow) store_grad_w<D>(p, r, acc);
}

// Any H and any alignment: element by element, the same units, lanes and order.
template <typename D, typename T>
__global__ void __launch_bounds__(kBwdWarps * 32) combine_backward_scalar_kernel(CombBwdParams p) {
  constexpr int64_t kDataElem = std::is_same<D, E4M3>::value ? 1 : sizeof(D);
  const BwdRow r = bwd_row<D>(p);
  if (r.n >= p.N) return;
  const int lane = threadIdx.x & 31;
  const int64_t U = (p.H + kDotUnit - 1) / kDotUnit;
  const void* drow = reinterpret_cast<const uint8_t*>(p.data) + r.n * p.H * kDataElem;
  const T* erow = p.eo ? reinterpret_cast<const T*>(p.eo) + r.n * p.H : nullptr;
  T* grow = reinterpret_cast<T*>(p.grad) + r.n * p.H;
  float acc = 0.0f;
  for (int64_t u = lane; u < U; u += kDotLanes) {
    float pr[kDotUnit];
#pragma unroll
    for (int e = 0; e < kDotUnit; ++e) {
      const int64_t h = u * kDotUnit + e;
      pr[e] = 0.0f;  // past the row: a product of +0
      if (h < p.H) {
        const float v = load_dy1<D>(drow, h);
        Elem<T>::store1(grow + h, r.scaled ? __fmul_rn(v, r.m) : v);
        if (erow) pr[e] = __fmul_rn(v, Elem<T>::load1(erow + h));
      }
    }
    if (erow) acc = __fadd_rn(acc, sum16_pairwise(pr));
  }
  if (erow) store_grad_w<D>(p, r, acc);
}

}  // namespace

Tensor combine_pack_cuda(const Tensor& expert_out, const Tensor& slot_pos, const std::optional<Tensor>& weights,
                         const std::optional<Tensor>& extra, bool quantize, std::optional<at::ScalarType> dtype) {
  const auto checked = check_combine_pack(expert_out, slot_pos, weights, extra, quantize, dtype);
  const CombineRow L = checked.first;
  const int64_t N = expert_out.size(0), H = expert_out.size(1), Nr = slot_pos.size(0), K = slot_pos.size(1);
  const c10::cuda::CUDAGuard guard(expert_out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto buf = at::empty({Nr, L.bytes}, expert_out.options().dtype(at::kByte));
  if (Nr == 0) return buf;
  CombPackParams p{};
  p.eo = expert_out.data_ptr();
  p.slot_pos = slot_pos.data_ptr<int>();
  p.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  p.extra = extra.has_value() ? extra->data_ptr<float>() : nullptr;
  p.buf = buf.data_ptr<uint8_t>();
  p.N = N;
  p.H = H;
  p.Nr = Nr;
  p.row_bytes = L.bytes;
  p.payload_bytes = H * L.elem;
  p.scale_off = L.scale_off;
  p.extra_off = L.extra_off;
  p.K = static_cast<int>(K);
  p.extra_k = static_cast<int>(L.topk);
  p.quant = quantize;
  const int64_t U = H / 16;
  const int upt = (H % 16 == 0 && H > 0 && aligned16(p.eo)) ? units_per_thread(U) : 0;
  // a quantized row's payload is e4m3 whatever the dtype: the kernels of O = T serve it
  const at::ScalarType out_dtype = quantize ? expert_out.scalar_type() : checked.second;
  FP8A2A_DISPATCH_FLOAT(expert_out.scalar_type(), "combine_pack", [&] {
    using in_t = scalar_t;
    FP8A2A_DISPATCH_FLOAT(out_dtype, "combine_pack", [&] {
      if (upt == 1) combine_pack_vec_kernel<in_t, scalar_t, 1><<<Nr, threads_for(U, 1), 0, stream>>>(p);
      else if (upt == 2) combine_pack_vec_kernel<in_t, scalar_t, 2><<<Nr, threads_for(U, 2), 0, stream>>>(p);
      else combine_pack_scalar_kernel<in_t, scalar_t><<<Nr, 256, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return buf;
}

std::tuple<Tensor, Tensor> combine_unpack_cuda(const Tensor& buf, const Tensor& send_pos, int64_t hidden,
                                               at::ScalarType dtype, bool quantized, int64_t extra_k) {
  const CombineRow L = check_combine_buffer(buf, send_pos, hidden, dtype, quantized, extra_k);
  const int64_t T = send_pos.size(0), R = send_pos.size(1), H = hidden;
  const c10::cuda::CUDAGuard guard(buf.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto y = at::empty({T, H}, buf.options().dtype(dtype));
  auto extra = at::empty({T, extra_k}, buf.options().dtype(at::kFloat));
  if (T == 0 || (H == 0 && extra_k == 0)) return {y, extra};
  CombUnpackParams p{};
  p.buf = buf.data_ptr<uint8_t>();
  p.send_pos = send_pos.data_ptr<int>();
  p.y = y.data_ptr();
  p.extra = extra.data_ptr<float>();
  p.T = T;
  p.H = H;
  p.rows = buf.size(0);
  p.row_bytes = L.bytes;
  p.scale_off = L.scale_off;
  p.extra_off = L.extra_off;
  p.R = static_cast<int>(R);
  p.extra_k = static_cast<int>(extra_k);
  p.quant = quantized;
  const int64_t U = H / 16;
  const int upt = (H % 16 == 0 && H > 0 && aligned16(p.buf)) ? units_per_thread(U) : 0;
  FP8A2A_DISPATCH_FLOAT_AND_DOUBLE(dtype, "combine_unpack", [&] {
    if (upt == 1) combine_unpack_vec_kernel<scalar_t, 1><<<T, threads_for(U, 1), 0, stream>>>(p);
    else if (upt == 2) combine_unpack_vec_kernel<scalar_t, 2><<<T, threads_for(U, 2), 0, stream>>>(p);
    else combine_unpack_scalar_kernel<scalar_t><<<T, 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, extra};
}

std::tuple<Tensor, Tensor> combine_backward_rows_cuda(const Tensor& data, const std::optional<Tensor>& scale,
                                                      const std::optional<Tensor>& weights,
                                                      const std::optional<Tensor>& expert_out, at::ScalarType dtype) {
  const bool fp8 = check_combine_backward_rows(data, scale, weights, expert_out, dtype);
  const int64_t N = data.size(0), H = data.size(1);
  const c10::cuda::CUDAGuard guard(data.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto grad = at::empty({N, H}, data.options().dtype(dtype));
  auto grad_w = at::empty({expert_out.has_value() ? N : 0}, data.options().dtype(at::kFloat));
  if (N == 0) return {grad, grad_w};
  CombBwdParams p{};
  p.data = data.data_ptr();
  p.scale = fp8 ? scale->data_ptr<float>() : nullptr;
  p.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  p.eo = expert_out.has_value() ? expert_out->data_ptr() : nullptr;
  p.grad = grad.data_ptr();
  p.grad_w = grad_w.data_ptr<float>();
  p.N = N;
  p.H = H;
  const bool vec = H % 16 == 0 && aligned16(p.data) && (!p.eo || aligned16(p.eo)) && aligned16(p.grad);
  const int64_t blocks = (N + kBwdWarps - 1) / kBwdWarps;
  auto launch = [&](auto rows_tag) {
    using D = decltype(rows_tag);
    FP8A2A_DISPATCH_FLOAT_AND_DOUBLE(dtype, "combine_backward_rows", [&] {
      if (vec) combine_backward_vec_kernel<D, scalar_t><<<blocks, kBwdWarps * 32, 0, stream>>>(p);
      else combine_backward_scalar_kernel<D, scalar_t><<<blocks, kBwdWarps * 32, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  };
  if (fp8) {
    launch(E4M3{});
  } else {
    FP8A2A_DISPATCH_FLOAT(data.scalar_type(), "combine_backward_rows", [&] { launch(scalar_t{}); });
  }
  return {grad, grad_w};
}

}  // namespace fp8a2a
