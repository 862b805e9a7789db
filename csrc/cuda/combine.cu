// combine_pack (expert side: the weighted sum of a received row's expert outputs in float32, one
// wire row in the activation's dtype or e4m3)
// and combine_unpack (token side: the sum of the rows sent back for a token): kernels and host
// entry points.
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

}  // namespace fp8a2a
