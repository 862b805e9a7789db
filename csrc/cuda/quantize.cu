// quantize (row, block128, tensor granularity) and dequantize: kernels and host entry points.
#include "common.cuh"

namespace fp8a2a {
namespace {

// =============================================================================================
// quantize
// =============================================================================================
struct QuantParams {
  const void* x;
  uint8_t* data;
  float* scales;             // [T] row, [T, H/128] block128; unused for tensor
  const float* tscale;       // tensor: the given dequant scale (device), or nullptr
  const float* partials;     // tensor without a given scale: per-block amax partials
  int num_partials;
  float* scale_out;          // tensor: where block 0 writes the scale
  int64_t T, H;
  int gran;
};

// Tensor granularity: (q, s) from the given scale or from the amax partials; s is the stored scale.
// Needs a __syncthreads() between this and the use of s_red when partials are reduced.
__device__ __forceinline__ float reduce_partials(const float* partials, int n, float* s_red) {
  float m = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = amax_step(m, __ldg(partials + i));
  m = warp_amax(m);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = m;
  __syncthreads();
  float r = 0.0f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = amax_step(r, s_red[i]);
  __syncthreads();
  return r;
}

template <typename T>
__global__ void tensor_amax_kernel(const T* x, int64_t numel, float* partials) {
  __shared__ float s_red[32];
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (aligned16(x)) {
    const int64_t units = numel / 16;
    uint32_t mb = 0;
    for (int64_t u = tid; u < units; u += stride) {
      uint32_t w[Elem<T>::kWords];
      load_unit<T>(x, u, w);
      mb = max(mb, unit_amax_bits<T>(w));
    }
    m = amax_value(mb);
    for (int64_t i = units * 16 + tid; i < numel; i += stride) m = amax_step(m, Elem<T>::load1(x + i));
  } else {
    for (int64_t i = tid; i < numel; i += stride) m = amax_step(m, Elem<T>::load1(x + i));
  }
  m = warp_amax(m);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = amax_step(r, s_red[i]);
    partials[blockIdx.x] = r;
  }
}

__device__ __forceinline__ void tensor_qs(const QuantParams& p, float* s_red, float& q, float& s) {
  if (p.partials != nullptr) {  // from the amax: the scale rule, as row granularity (and ops_cpu.cpp)
    const float m = reduce_partials(p.partials, p.num_partials, s_red);
    s = scale_of(m);
    q = quant_multiplier(m);
  } else {  // a given dequant scale: q = 1 / s (IEEE division), as ops_cpu.cpp's tensor_scales()
    s = __ldg(p.tscale);
    q = 1.0f / s;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.scale_out = s;
}

// One block per row, UPT units per thread, 16-byte accesses.
template <typename T, int UPT>
__global__ void __launch_bounds__(UPT == 1 ? 512 : 1024) quantize_vec_kernel(QuantParams p) {
  __shared__ float s_red[32];
  __shared__ uint32_t s_redu[32];
  const int64_t t = blockIdx.x;
  const int64_t U = p.H / 16;
  uint32_t w[UPT][Elem<T>::kWords];
  load_units<T, UPT>(reinterpret_cast<const T*>(p.x) + t * p.H, U, w);
  float q[UPT];
  bool nan_row = false;  // tensor: the row holds NaN or Inf (amax_finite)
  if (p.gran == kTensor) {
    float s;
    tensor_qs(p, s_red, q[0], s);
#pragma unroll
    for (int j = 1; j < UPT; ++j) q[j] = q[0];
    nan_row = !amax_finite(amax_value(block_max_u32(units_amax_bits<T, UPT>(w, U), s_redu)));
  } else if (p.gran == kBlock128) {
    float* scales = p.scales + t * (p.H / kBlock);
    block128_multipliers<T, UPT>(w, U, q, [&](int64_t b, float m) { scales[b] = scale_of(m); });
  } else {
    const float m = amax_value(block_max_u32(units_amax_bits<T, UPT>(w, U), s_redu));
#pragma unroll
    for (int j = 0; j < UPT; ++j) q[j] = quant_multiplier(m);
    if (threadIdx.x == 0) p.scales[t] = scale_of(m);
  }
  uint8_t* out = p.data + t * p.H;
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) reinterpret_cast<uint4*>(out)[u] = nan_row ? e4m3_nan_unit() : quantize_unit<T>(w[j], q[j]);
  }
}

// Any H, any alignment: one block per row, element by element.
template <typename T>
__global__ void quantize_scalar_kernel(QuantParams p) {
  extern __shared__ float s_amax[];  // block128: one amax per block
  __shared__ float s_red[32];
  const int64_t t = blockIdx.x, H = p.H;
  const T* xrow = reinterpret_cast<const T*>(p.x) + t * H;
  uint8_t* out = p.data + t * H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  if (p.gran == kBlock128) {
    const int64_t nb = H / kBlock;
    for (int64_t b = warp; b < nb; b += nwarps) {
      float m = 0.0f;
      for (int i = lane; i < kBlock; i += 32) m = amax_step(m, Elem<T>::load1(xrow + b * kBlock + i));
      m = warp_amax(m);
      if (lane == 0) {
        s_amax[b] = m;
        p.scales[t * nb + b] = scale_of(m);
      }
    }
    __syncthreads();
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
      out[h] = e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), quant_multiplier(s_amax[h / kBlock])));
    return;
  }
  float q = 0.0f, s;
  if (p.gran == kTensor) tensor_qs(p, s_red, q, s);  // first: its reduction and the row's share s_red
  // the row's amax: its scale (row), whether it is finite (tensor)
  float m = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) m = amax_step(m, Elem<T>::load1(xrow + h));
  m = warp_amax(m);
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < nwarps; ++i) m = amax_step(m, s_red[i]);
  const bool nan_row = p.gran == kTensor && !amax_finite(m);
  if (p.gran == kRow) {
    q = quant_multiplier(m);
    if (threadIdx.x == 0) p.scales[t] = scale_of(m);
  }
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    out[h] = nan_row ? kE4M3NaN : e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), q));
}

// =============================================================================================
// dequantize
// =============================================================================================
// Grid-stride over 16-byte units, 4 independent units in flight per thread.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_vec_kernel(const uint8_t* in, const float* scale, T* out, int64_t units,
                                                             int64_t span) {
  constexpr int B = 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < units; u0 += B * stride) {
    uint4 q[B];
    float s[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t u = u0 + b * stride;
      if (u < units) {
        q[b] = load_fp8_unit(in + u * 16);
        s[b] = __ldg(scale + (span ? (u * 16) / span : 0));
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t u = u0 + b * stride;
      if (u < units) {
        float f[16];
        fp8_unit_to_f32(q[b], f);
        uint32_t w[Elem<T>::kWords];
#pragma unroll
        for (int j = 0; j < 16; ++j) Elem<T>::put(w, j, __fmul_rn(f[j], s[b]));
        store_unit<T>(out, u, w);
      }
    }
  }
}

template <typename T>
__global__ void dequantize_scalar_kernel(const uint8_t* in, const float* scale, T* out, int64_t n, int64_t span) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    Elem<T>::store1(out + i, __fmul_rn(e4m3_to_f32_1(in[i]), __ldg(scale + (span ? i / span : 0))));
}

}  // namespace

std::tuple<Tensor, Tensor> quantize_cuda(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale) {
  check_quantize(x, granularity, scale);
  const int64_t T = x.size(0), H = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto fopts = x.options().dtype(at::kFloat);
  auto data = at::empty({T, H}, x.options().dtype(at::kFloat8_e4m3fn));
  if (granularity == kTensor && T * H == 0) {
    // Nothing to quantize: the scale is the given one, or 1 (amax of nothing is 0).
    return {data, scale.has_value() ? scale->reshape({}).clone() : at::full({}, 1.0f, fopts)};
  }
  auto scales = at::empty(scale_shape(T, H, granularity), fopts);
  if (T == 0) return {data, scales};

  QuantParams p{};
  p.x = x.data_ptr();
  p.data = reinterpret_cast<uint8_t*>(data.data_ptr());
  p.T = T;
  p.H = H;
  p.gran = static_cast<int>(granularity);
  Tensor partials;
  if (granularity == kTensor) {
    p.scale_out = scales.data_ptr<float>();
    if (scale.has_value()) {
      p.tscale = scale->data_ptr<float>();
    } else {
      const int64_t numel = T * H;
      const int blocks = static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, numel / (256 * 16)), 2 * num_sms(x.get_device())));
      partials = at::empty({blocks}, fopts);
      p.partials = partials.data_ptr<float>();
      p.num_partials = blocks;
      FP8A2A_DISPATCH_FLOAT(x.scalar_type(), "quantize", [&] {
        tensor_amax_kernel<scalar_t><<<blocks, 256, 0, stream>>>(reinterpret_cast<const scalar_t*>(p.x), numel,
                                                                 partials.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  } else {
    p.scales = scales.data_ptr<float>();
  }
  const int64_t U = H / 16;
  const int upt = (H % 16 == 0 && H > 0 && aligned16(x.data_ptr())) ? units_per_thread(U) : 0;
  FP8A2A_DISPATCH_FLOAT(x.scalar_type(), "quantize", [&] {
    if (upt == 1) {
      quantize_vec_kernel<scalar_t, 1><<<T, threads_for(U, 1), 0, stream>>>(p);
    } else if (upt == 2) {
      quantize_vec_kernel<scalar_t, 2><<<T, threads_for(U, 2), 0, stream>>>(p);
    } else {
      const size_t smem = granularity == kBlock128 ? (H / kBlock) * 4 : 0;
      ensure_smem(quantize_scalar_kernel<scalar_t>, smem, x.get_device(), "quantize");
      quantize_scalar_kernel<scalar_t><<<T, 256, smem, stream>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, scales};
}

Tensor dequantize_cuda(const Tensor& data, const Tensor& scale, at::ScalarType dtype) {
  const int64_t span = check_dequantize(data, scale, dtype);  // elements per scale; 0: one scale
  const int64_t T = data.size(0), H = data.size(1);
  const c10::cuda::CUDAGuard guard(data.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto out = at::empty({T, H}, data.options().dtype(dtype));
  const int64_t n = T * H;
  if (n == 0) return out;
  const auto* in = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const int64_t cap = static_cast<int64_t>(num_sms(data.get_device())) * 16;
  const bool vec = H % 16 == 0 && aligned16(in);
  FP8A2A_DISPATCH_FLOAT_AND_DOUBLE(dtype, "dequantize", [&] {
    auto* op = reinterpret_cast<scalar_t*>(out.data_ptr());
    if (vec) {
      const int64_t units = n / 16;
      const int blocks = static_cast<int>(std::min<int64_t>((units + 1023) / 1024, cap));
      dequantize_vec_kernel<scalar_t><<<blocks, 256, 0, stream>>>(in, sp, op, units, span);
    } else {
      const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, cap));
      dequantize_scalar_kernel<scalar_t><<<blocks, 256, 0, stream>>>(in, sp, op, n, span);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace fp8a2a
