// Shared by the CUDA kernels of every stage (csrc/cuda/*.cu): element and e4m3 conversions, the
// amax helpers, row loads held in registers, and the host launch helpers.
//
// Every op gives the bytes of the CPU ops (csrc/cpu/): the same e4m3 rounding (the sm_89+ hardware
// conversions, checked equal to fp8_common.h's e4m3_from_f32 / f32_from_e4m3 on all 2^32 floats;
// older GPUs use fp8_common.h's code), the same scale rule with IEEE division, the same accumulation
// order with no fused multiply-add (__fmul_rn/__fadd_rn), the same float -> bf16/fp16 rounding as
// c10's host code. The one thing that can differ is the sign or payload of a NaN made by arithmetic
// (x86 makes inf*0 a negative NaN, the GPU a positive one): compare NaNs as NaNs
// (tests/gpu/test_cuda_ops.py does).
//
// No op syncs with the host, allocates by data, or reads a device value on the host: the tensor
// scale is read inside the kernels, and every launch goes to the current stream, so all ops record
// into CUDA graphs. Kernels per call:
//   quantize          1 (tensor granularity with no scale: 2, an amax pass and the quantize pass)
//   dequantize        1
//   dispatch_pack     1 up to 512 tokens, 4096 slots and top-8 (and its tables within 48 KB of
//                     shared memory): pack, each block routing its own token (self_routing).
//                     Otherwise 2 up to 4096 slots, else 3: layout (per-chunk counts and positions),
//                     scan (the chunk totals scanned over chunks, counts, rank offsets) and pack
//                     (each token read once, quantized once, written to each destination rank);
//                     each launched early after the one before (programmatic dependent launch,
//                     sm_90+): the pack blocks load and quantize their rows while the layout runs.
//   capacity_drop     1 up to 4096 slots (one block sorts); above: a memset and 3, count (its last
//                     block lists the over-capacity experts), scatter (their slots into buckets)
//                     and select (a radix select in each bucket drops the slots past capacity)
//   dispatch_unpack   1 (each block builds the small rank/expert offset tables from recv_counts)
//   combine_pack      1
//   combine_unpack    1
//   combine_backward_rows 1 (a warp per row)
//   routing_map_to_topk 1 (a thread per token)
//   mm_fp8_per_expert one cuBLASLt GEMM per expert with rows; a copy of the row scales first
//                     (1 kernel per 128 experts) where an expert's start is off 16 bytes
//                     (csrc/cuda/expert_gemms.cu; it and wgrad_fp8_per_expert match their CPU twins
//                     to a tolerance: cuBLAS's accumulation order is its own)
//   wgrad_fp8_per_expert  one cuBLASLt GEMM per expert with columns (a memset for one without),
//                     no kernel of fp8a2a's own (csrc/cuda/expert_gemms.cu)
// Corrupt input cannot raise on the GPU without a sync: out-of-range positions are skipped instead
// (their slot_pos entries are -1), out-of-range expert ids are counted in the bad-ids column, rows
// over a rank's capacity are not written (send_pos -1).
//
// Everything here is inline (or a template) in namespace fp8a2a, so each .cu includes it freely;
// a stage's own kernels and parameter structs stay in that .cu's anonymous namespace.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../ops.h"

namespace fp8a2a {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kSmemDefault = 48 * 1024;

// ---------------------------------------------------------------------------------------------
// Element conversions. float <- element is exact; element <- float reproduces c10's host code
// (bf16: round-to-nearest-even, NaN -> 0x7FC0; fp16: IEEE round-to-nearest-even, NaN -> sign|0x7E00),
// which is what static_cast<scalar_t>(float) does in ops_cpu.cpp.
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kWords = 16;  // 32-bit words per unit of 16 elements
  static __device__ __forceinline__ float get(const uint32_t* w, int j) { return __uint_as_float(w[j]); }
  static __device__ __forceinline__ void put(uint32_t* w, int j, float f) { w[j] = __float_as_uint(f); }
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void store1(float* p, float f) { *p = f; }
};

__device__ __forceinline__ uint16_t bf16_bits(float f) {
  if (f != f) return 0x7FC0u;
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}
__device__ __forceinline__ uint16_t fp16_bits(float f) {
  if (f != f) return static_cast<uint16_t>(((__float_as_uint(f) >> 16) & 0x8000u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(f));
}

template <>
struct Elem<c10::BFloat16> {
  static constexpr int kWords = 8;
  static __device__ __forceinline__ float get(const uint32_t* w, int j) {
    const uint32_t v = w[j >> 1];
    return __uint_as_float((j & 1) ? (v & 0xffff0000u) : (v << 16));
  }
  static __device__ __forceinline__ void put(uint32_t* w, int j, float f) {
    const uint32_t b = bf16_bits(f);
    w[j >> 1] = (j & 1) ? ((w[j >> 1] & 0xffffu) | (b << 16)) : b;
  }
  static __device__ __forceinline__ float load1(const c10::BFloat16* p) {
    return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
  }
  static __device__ __forceinline__ void store1(c10::BFloat16* p, float f) {
    *reinterpret_cast<uint16_t*>(p) = bf16_bits(f);
  }
};

template <>
struct Elem<c10::Half> {
  static constexpr int kWords = 8;
  static __device__ __forceinline__ float get(const uint32_t* w, int j) {
    const uint32_t v = w[j >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((j & 1) ? (v >> 16) : (v & 0xffffu))));
  }
  static __device__ __forceinline__ void put(uint32_t* w, int j, float f) {
    const uint32_t b = fp16_bits(f);
    w[j >> 1] = (j & 1) ? ((w[j >> 1] & 0xffffu) | (b << 16)) : b;
  }
  static __device__ __forceinline__ float load1(const c10::Half* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
  }
  static __device__ __forceinline__ void store1(c10::Half* p, float f) {
    *reinterpret_cast<uint16_t*>(p) = fp16_bits(f);
  }
};

// float64 only as an output dtype (dequantize, combine_unpack), as the CPU ops allow.
template <>
struct Elem<double> {
  static constexpr int kWords = 32;
  static __device__ __forceinline__ float get(const uint32_t* w, int j) {
    return __double2float_rn(__hiloint2double(static_cast<int>(w[2 * j + 1]), static_cast<int>(w[2 * j])));
  }
  static __device__ __forceinline__ void put(uint32_t* w, int j, float f) {
    const double d = static_cast<double>(f);
    w[2 * j] = static_cast<uint32_t>(__double2loint(d));
    w[2 * j + 1] = static_cast<uint32_t>(__double2hiint(d));
  }
  static __device__ __forceinline__ float load1(const double* p) { return __double2float_rn(*p); }
  static __device__ __forceinline__ void store1(double* p, float f) { *p = static_cast<double>(f); }
};

// A "unit" is 16 consecutive elements of a row: 16 e4m3 bytes = one 16-byte access on the fp8 side,
// 1, 2 or 4 16-byte accesses on the activation side.
template <typename T>
__device__ __forceinline__ void load_unit(const T* row, int64_t u, uint32_t (&w)[Elem<T>::kWords]) {
  const uint4* src = reinterpret_cast<const uint4*>(row) + u * (Elem<T>::kWords / 4);
#pragma unroll
  for (int i = 0; i < Elem<T>::kWords / 4; ++i) {
    const uint4 q = __ldg(src + i);
    w[4 * i] = q.x;
    w[4 * i + 1] = q.y;
    w[4 * i + 2] = q.z;
    w[4 * i + 3] = q.w;
  }
}

template <typename T>
__device__ __forceinline__ void store_unit(T* row, int64_t u, const uint32_t (&w)[Elem<T>::kWords]) {
  uint4* dst = reinterpret_cast<uint4*>(row) + u * (Elem<T>::kWords / 4);
#pragma unroll
  for (int i = 0; i < Elem<T>::kWords / 4; ++i) dst[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

__device__ __forceinline__ uint4 load_fp8_unit(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- e4m3 conversions ----
// On sm_89+ the hardware converts pairs: cvt.rn.satfinite.e4m3x2.f32 (round to nearest even,
// saturating to +-448, inf -> +-448) gives e4m3_from_f32's byte for every non-NaN float, and
// cvt.rn.f16x2.e4m3x2 gives f32_from_e4m3's value exactly (e4m3 is a subset of f16); only the
// sign/payload of NaN can differ. tests/gpu/test_cuda_ops.py checks both against fp8_common.h on
// all 2^32 floats. Define FP8A2A_SOFT_E4M3 to use fp8_common.h's code instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(FP8A2A_SOFT_E4M3)
#define FP8A2A_HW_E4M3 1
#else
#define FP8A2A_HW_E4M3 0
#endif

// e4m3 bytes of (a, b, c, d), a in the lowest byte
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
#if FP8A2A_HW_E4M3
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
#else
  return static_cast<uint32_t>(e4m3_from_f32(a)) | (static_cast<uint32_t>(e4m3_from_f32(b)) << 8) |
         (static_cast<uint32_t>(e4m3_from_f32(c)) << 16) | (static_cast<uint32_t>(e4m3_from_f32(d)) << 24);
#endif
}

__device__ __forceinline__ uint8_t e4m3_1(float f) {
#if FP8A2A_HW_E4M3
  return static_cast<uint8_t>(e4m3x4(f, 0.0f, 0.0f, 0.0f) & 0xffu);
#else
  return e4m3_from_f32(f);
#endif
}

// the 4 values of 4 e4m3 bytes
__device__ __forceinline__ void e4m3x4_to_f32(uint32_t w, float& a, float& b, float& c, float& d) {
#if FP8A2A_HW_E4M3
  uint32_t h01, h23;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h01) : "h"(static_cast<unsigned short>(w & 0xffffu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h23) : "h"(static_cast<unsigned short>(w >> 16)));
  a = __half2float(__ushort_as_half(static_cast<unsigned short>(h01 & 0xffffu)));
  b = __half2float(__ushort_as_half(static_cast<unsigned short>(h01 >> 16)));
  c = __half2float(__ushort_as_half(static_cast<unsigned short>(h23 & 0xffffu)));
  d = __half2float(__ushort_as_half(static_cast<unsigned short>(h23 >> 16)));
#else
  a = f32_from_e4m3(static_cast<uint8_t>(w));
  b = f32_from_e4m3(static_cast<uint8_t>(w >> 8));
  c = f32_from_e4m3(static_cast<uint8_t>(w >> 16));
  d = f32_from_e4m3(static_cast<uint8_t>(w >> 24));
#endif
}

__device__ __forceinline__ float e4m3_to_f32_1(uint8_t v) {
  float a, b, c, d;
  e4m3x4_to_f32(v, a, b, c, d);
  return a;
}

// 16 values of a 16-byte e4m3 unit
__device__ __forceinline__ void fp8_unit_to_f32(const uint4& q, float (&f)[16]) {
  e4m3x4_to_f32(q.x, f[0], f[1], f[2], f[3]);
  e4m3x4_to_f32(q.y, f[4], f[5], f[6], f[7]);
  e4m3x4_to_f32(q.z, f[8], f[9], f[10], f[11]);
  e4m3x4_to_f32(q.w, f[12], f[13], f[14], f[15]);
}

// ---- amax as the bits of a non-negative float ----
// For |x| the IEEE order is the unsigned order of the bits, and every NaN is above inf, so a max
// of (bits & 0x7fffffff) propagates NaN exactly as amax_step does; amax_value() maps any NaN to
// amax_step's NAN. Reduces with one integer max per element (two elements per op for 16-bit).
__device__ __forceinline__ float amax_value(uint32_t bits) { return bits > 0x7f800000u ? NAN : __uint_as_float(bits); }
__device__ __forceinline__ uint32_t abs_bits(float f) { return __float_as_uint(f) & 0x7fffffffu; }

// The dequant scale of an amax. Same value as dequant_scale(); for a NaN amax it returns that NaN
// itself (amax_step's NAN), which is the bit pattern the host division produces, where the GPU
// division would return its canonical NaN.
__device__ __forceinline__ float scale_of(float amax) { return amax != amax ? amax : dequant_scale(amax); }

template <typename T>
__device__ __forceinline__ uint32_t unit_amax_bits(const uint32_t (&w)[Elem<T>::kWords]) {
  if constexpr (sizeof(T) == 4) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = max(m, w[j] & 0x7fffffffu);
    return m;
  } else {
    uint32_t m2 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m2 = __vmaxu2(m2, w[j] & 0x7fff7fffu);
    const uint32_t h = max(m2 >> 16, m2 & 0xffffu);  // the larger |x| of the two halves
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      return h << 16;
    } else {
      return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
    }
  }
}

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t m) { return __reduce_max_sync(kFull, m); }

__device__ __forceinline__ float warp_amax(float m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = amax_step(m, __shfl_xor_sync(kFull, m, o));
  return m;
}

// max over 8 consecutive lanes (the 8 units of one 128-block)
__device__ __forceinline__ uint32_t group8_max_u32(uint32_t m) {
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFull, m, o));
  return m;
}

template <typename T>
__device__ __forceinline__ uint4 quantize_unit(const uint32_t (&w)[Elem<T>::kWords], float q) {
  float f[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) f[j] = __fmul_rn(Elem<T>::get(w, j), q);
  return make_uint4(e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]), e4m3x4(f[8], f[9], f[10], f[11]),
                    e4m3x4(f[12], f[13], f[14], f[15]));
}

// 16 e4m3 NaN bytes (kE4M3NaN): a unit of a tensor-scaled row that holds NaN or Inf
__device__ __forceinline__ uint4 e4m3_nan_unit() {
  constexpr uint32_t w = kE4M3NaN * 0x01010101u;
  return make_uint4(w, w, w, w);
}

__device__ __forceinline__ uint4 quantize_f32x16(const float (&a)[16], float q) {
  float f[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) f[j] = __fmul_rn(a[j], q);
  return make_uint4(e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]), e4m3x4(f[8], f[9], f[10], f[11]),
                    e4m3x4(f[12], f[13], f[14], f[15]));
}

// The max of every thread's mb over the block (s_red: 32 words of shared memory). One
// __syncthreads(), which also publishes whatever the block wrote to shared memory before it.
__device__ __forceinline__ uint32_t block_max_u32(uint32_t mb, uint32_t* s_red) {
  mb = warp_max_u32(mb);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = mb;
  __syncthreads();
  mb = 0;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) mb = max(mb, s_red[i]);
  return mb;
}

// ---- one row held in registers by the vec kernels: UPT units per thread, unit u = threadIdx.x +
// j * blockDim.x of the U in the row ----
template <typename T, int UPT>
__device__ __forceinline__ void load_units(const T* row, int64_t U, uint32_t (&w)[UPT][Elem<T>::kWords]) {
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) load_unit<T>(row, u, w[j]);
  }
}

// this thread's share of the row amax (as bits; 0 for units past the row)
template <typename T, int UPT>
__device__ __forceinline__ uint32_t units_amax_bits(const uint32_t (&w)[UPT][Elem<T>::kWords], int64_t U) {
  uint32_t mb = 0;
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) mb = max(mb, unit_amax_bits<T>(w[j]));
  }
  return mb;
}

// block128: q[j] = the quant multiplier of unit j's 128-block (8 consecutive lanes); the block's
// first lane hands its amax to put_amax(block index, amax).
template <typename T, int UPT, typename PutAmax>
__device__ __forceinline__ void block128_multipliers(const uint32_t (&w)[UPT][Elem<T>::kWords], int64_t U,
                                                     float (&q)[UPT], PutAmax put_amax) {
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    const float m = amax_value(group8_max_u32(u < U ? unit_amax_bits<T>(w[j]) : 0u));
    q[j] = quant_multiplier(m);
    if (u < U && (u & 7) == 0) put_amax(u >> 3, m);
  }
}

template <typename IdxT>
__device__ __forceinline__ int64_t load_idx(const IdxT* p);
template <>
__device__ __forceinline__ int64_t load_idx<int64_t>(const int64_t* p) {
  return static_cast<int64_t>(__ldg(reinterpret_cast<const long long*>(p)));
}
template <>
__device__ __forceinline__ int64_t load_idx<int32_t>(const int32_t* p) {
  return static_cast<int64_t>(__ldg(reinterpret_cast<const int*>(p)));
}

// Programmatic dependent launch (sm_90+): a kernel launched with launch_kernel(..., after_prior)
// may start while the previous one runs (once that one calls allow_dependent_grid); it waits in
// wait_prior_grid() before reading that kernel's results. The pack blocks load and quantize their
// rows before waiting for the layout; elsewhere (and before sm_90) both are no-ops.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------------------------
inline int num_sms(int device) {
  static int cache[256] = {0};
  if (device < 0 || device >= 256) return 132;
  if (cache[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = n > 0 ? n : 132;
  }
  return cache[device];
}

inline int max_smem_optin(int device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return n;
}

template <typename Kernel>
void ensure_smem(Kernel kernel, size_t bytes, int device, const char* what) {
  if (bytes <= static_cast<size_t>(kSmemDefault)) return;
  TORCH_CHECK(bytes <= static_cast<size_t>(max_smem_optin(device)), "fp8a2a: ", what, " needs ", bytes,
              " bytes of shared memory, more than this GPU offers (too many ranks/experts/top-k for the CUDA kernel)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// launch_kernel: kernel<<<grid, threads, smem, stream>>>(args...); with `after_prior` (sm_90+) as a
// programmatic dependent launch: it may start before the previous kernel in the stream ends and
// must call wait_prior_grid() before reading that kernel's results.
template <typename... Args>
void launch_kernel(void (*kernel)(Args...), int64_t grid, int threads, size_t smem, cudaStream_t stream,
                   bool after_prior, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = after_prior ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Whether kernel may be launched early (programmatic dependent launch): an sm_90+ device running
// code compiled for sm_90+ (code from older PTX has no griddepcontrol: it would not wait).
// FP8A2A_EARLY_LAUNCH=0 turns it off (to tell an ordering bug from another one).
template <typename Kernel>
bool early_launch_ok(Kernel kernel, int device) {
  static int cache[256] = {0};  // 1 yes, 2 no
  static const bool off = [] {
    const char* v = std::getenv("FP8A2A_EARLY_LAUNCH");
    return v != nullptr && std::string(v) == "0";
  }();
  if (off || device < 0 || device >= 256) return false;
  if (cache[device] == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    cache[device] = major >= 9 && attr.ptxVersion >= 90 ? 1 : 2;
  }
  return cache[device] == 1;
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int round_up32(int64_t n) { return static_cast<int>(std::max<int64_t>(32, (n + 31) / 32 * 32)); }

// Units (16 elements) per thread for the vectorized row kernels: 1 (H <= 8192), 2 (H <= 32768).
// Returns 0 when the row is too wide for them (scalar path). prefer2: two units per thread from
// H >= 4096 on (dispatch_pack, where it measured faster; quantize gains nothing from it).
inline int units_per_thread(int64_t units, bool prefer2 = false) {
  if (units <= (prefer2 ? 255 : 512)) return 1;
  if (units <= 2048) return 2;
  return 0;
}

inline int threads_for(int64_t units, int upt) { return round_up32((units + upt - 1) / upt); }

#define FP8A2A_DISPATCH_FLOAT_AND_DOUBLE(TYPE, NAME, ...)                             \
  [&] {                                                                               \
    if ((TYPE) == at::kDouble) {                                                      \
      using scalar_t = double;                                                        \
      return __VA_ARGS__();                                                           \
    }                                                                                 \
    return FP8A2A_DISPATCH_FLOAT(TYPE, NAME, __VA_ARGS__);                            \
  }()

#define FP8A2A_DISPATCH_FLOAT(TYPE, NAME, ...)                                        \
  [&] {                                                                               \
    switch (TYPE) {                                                                   \
      case at::kFloat: {                                                              \
        using scalar_t = float;                                                       \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case at::kHalf: {                                                               \
        using scalar_t = c10::Half;                                                   \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case at::kBFloat16: {                                                           \
        using scalar_t = c10::BFloat16;                                               \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      default:                                                                        \
        TORCH_CHECK(false, "fp8a2a: ", NAME, ": unsupported dtype ", TYPE);           \
    }                                                                                 \
  }()

}  // namespace fp8a2a
