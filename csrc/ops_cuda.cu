// CUDA implementations of the fp8a2a ops, registered for the CUDA dispatch key.
//
// Every op gives the bytes of ops_cpu.cpp: the same e4m3 rounding (the sm_89+ hardware conversions,
// checked equal to fp8_common.h's e4m3_from_f32 / f32_from_e4m3 on all 2^32 floats; older GPUs use
// fp8_common.h's code), the same scale rule with IEEE division, the same accumulation order with no
// fused multiply-add (__fmul_rn/__fadd_rn), the same float -> bf16/fp16 rounding as c10's host code.
// The one thing that can differ is the sign or payload of a NaN made by arithmetic (x86 makes inf*0
// a negative NaN, the GPU a positive one): compare NaNs as NaNs (scripts/check_cuda_ops.py does).
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
//   capacity_drop     1 up to 4096 slots (one block sorts); above: keys, a torch sort, the drop
//   dispatch_unpack   1 (each block builds the small rank/expert offset tables from recv_counts)
//   combine_pack      1
//   combine_unpack    1
// Corrupt input cannot raise on the GPU without a sync: out-of-range positions are skipped instead
// (their slot_pos entries are -1), out-of-range expert ids are counted in the bad-ids column, rows
// over a rank's capacity are not written (send_pos -1).
//
// Measured on one H200 (T=16384, H=7168, K=8, R=8, E=256, bf16; scripts/bench_kernels.py,
// BENCHMARKS.md): dispatch_pack 0.244-0.246 ms (layout 8.5 us, scan and pack overlapping it; pack
// alone 229 us, within 3% of scripts/pack_roofline.cu's kernel with precomputed destinations):
// 0.85-0.87 of a copy of the same bytes; the others at 0.76-1.06 of copy bandwidth.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cub/block/block_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "ops.h"

namespace fp8a2a {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxLayoutSteps = 8;
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
// sign/payload of NaN can differ. scripts/check_cuda_ops.py checks both against fp8_common.h on
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
int num_sms(int device) {
  static int cache[256] = {0};
  if (device < 0 || device >= 256) return 132;
  if (cache[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = n > 0 ? n : 132;
  }
  return cache[device];
}

int max_smem_optin(int device) {
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
template <typename Kernel>
bool early_launch_ok(Kernel kernel, int device) {
  static int cache[256] = {0};  // 1 yes, 2 no
  if (device < 0 || device >= 256) return false;
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

int round_up32(int64_t n) { return static_cast<int>(std::max<int64_t>(32, (n + 31) / 32 * 32)); }

// Units (16 elements) per thread for the vectorized row kernels: 1 (H <= 8192), 2 (H <= 32768).
// Returns 0 when the row is too wide for them (scalar path). prefer2: two units per thread from
// H >= 4096 on (dispatch_pack: 276 vs 290 us at T=16384, H=7168 on an H200; quantize: no change).
int units_per_thread(int64_t units, bool prefer2 = false) {
  if (units <= (prefer2 ? 255 : 512)) return 1;
  if (units <= 2048) return 2;
  return 0;
}

int threads_for(int64_t units, int upt) { return round_up32((units + upt - 1) / upt); }

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
  if (p.partials != nullptr) {
    s = scale_of(reduce_partials(p.partials, p.num_partials, s_red));
  } else {
    s = __ldg(p.tscale);
  }
  q = 1.0f / s;  // IEEE division, as ops_cpu.cpp's tensor_scales()
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
  if (p.gran == kTensor) {
    float s;
    tensor_qs(p, s_red, q[0], s);
#pragma unroll
    for (int j = 1; j < UPT; ++j) q[j] = q[0];
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
    if (u < U) reinterpret_cast<uint4*>(out)[u] = quantize_unit<T>(w[j], q[j]);
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
  if (p.gran == kTensor) {
    float q, s;
    tensor_qs(p, s_red, q, s);
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) out[h] = e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), q));
    return;
  }
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
  float m = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) m = amax_step(m, Elem<T>::load1(xrow + h));
  m = warp_amax(m);
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < nwarps; ++i) m = amax_step(m, s_red[i]);
  const float q = quant_multiplier(m);
  if (threadIdx.x == 0) p.scales[t] = scale_of(m);
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) out[h] = e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), q));
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

// =============================================================================================
// dispatch_pack: layout kernel
// =============================================================================================
// The flattened slots (t, k) of topk_idx are cut into chunks of chunk_slots; each chunk is one block
// of W warps, each warp owning `steps` consecutive groups of 32 slots. Positions follow the slot
// order, which is token order: (rank, local expert) positions count slots, rank rows count the
// first slot of each token that reaches the rank ("rank leader").
// Per chunk: pass 0 counts per warp (match_any groups equal keys), the counts are scanned across
// warps (chunk totals go to chunk_off[chunk]), pass 1 assigns in-chunk positions.
// The last block to finish scans chunk_off across chunks (exclusive) and writes counts and rank_off.
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
};

// counts[r, c] of a header column c < kColRows (the same for every destination rank r)
__device__ __forceinline__ int64_t count_header(int c, int64_t H, int64_t K, int64_t bad_ids, int64_t gran) {
  return c == kColHidden ? H : c == kColTopk ? K : c == kColBadIds ? bad_ids : gran;
}

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
        p.counts[static_cast<int64_t>(r) * C + c] = count_header(c, p.H, p.K, total, p.gran);
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

// =============================================================================================
// dispatch_pack: pack kernel (one block per token: read once, quantize once, write per rank)
// =============================================================================================
struct PackParams {
  const void* x;
  const void* idx;
  const float* w;
  const float* tscale;
  const int2* slot_rank;
  const int* chunk_off;
  const int* rank_off;
  uint8_t* send;
  int* send_pos;
  int64_t T, H, row_bytes, cap;
  int K, E, El, R, cols, chunk_slots, gran;
  int scale_off, weight_off, expert_off, pos_off;
  bool vec;  // raw: 16-byte copies
  int64_t* counts;  // self routing: [R, kColExperts + El], written here
  int self_off;     // self routing: byte offset of its shared memory area
};

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
                                                             : count_header(c, p.H, K, *bad, p.gran);
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
  if (off < p.weight_off) {
    if (p.gran == kBlock128) return __float_as_uint(scale_of(s.amax[(off - p.scale_off) >> 2]));
    return __float_as_uint(row_scale);
  }
  if (off < p.expert_off) {
    const int k = static_cast<int>((off - p.weight_off) >> 2);
    return s.rank[k] == r ? __float_as_uint(s.w[k]) : 0u;
  }
  if (off < p.pos_off) {
    const int k = static_cast<int>((off - p.expert_off) >> 2);
    return s.rank[k] == r ? static_cast<uint32_t>(s.le[k]) : 0xffffffffu;
  }
  if (off < p.pos_off + 4 * static_cast<int64_t>(p.K)) {
    const int k = static_cast<int>((off - p.pos_off) >> 2);
    return s.rank[k] == r ? static_cast<uint32_t>(s.pos[k]) : 0xffffffffu;
  }
  return 0u;
}

// The tail of one send row for rank r (bytes [H, row_bytes)): zeros up to scale_off, then the
// words of dispatch_tail_word; thread i of n writes every n-th byte / word (coalesced).
__device__ __forceinline__ void write_dispatch_tail(const PackParams& p, uint8_t* dst, int r, float row_scale,
                                                    const RouteSmem& s, int i, int n) {
  for (int64_t h = p.H + i; h < p.scale_off; h += n) dst[h] = 0;
  for (int64_t off = p.scale_off + 4 * static_cast<int64_t>(i); off < p.row_bytes; off += 4 * static_cast<int64_t>(n))
    *reinterpret_cast<uint32_t*>(dst + off) = dispatch_tail_word(p, off, r, row_scale, s);
}

// H % 16 == 0, 16-byte aligned x: UPT units of 16 elements per thread.
template <typename T, typename IdxT, int UPT, bool SELF>
__global__ void __launch_bounds__(UPT == 1 ? 512 : 1024) dispatch_pack_vec_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x;
  const int64_t U = p.H / 16;
  const T* xrow = reinterpret_cast<const T*>(p.x) + t * p.H;
  // self routing first: its counters and the row would not fit in registers together
  if constexpr (SELF) route_token<IdxT, SELF>(p, t, s, smem);
  uint32_t w[UPT][Elem<T>::kWords];
  load_units<T, UPT>(xrow, U, w);
  if constexpr (!SELF) route_token<IdxT, SELF>(p, t, s, smem);  // overlaps the row's loads

  // each branch has one __syncthreads(): the routing in shared memory is complete after it
  float q[UPT];
  float row_scale = 0.0f;
  if (p.gran == kRow) {
    const float m = amax_value(block_max_u32(units_amax_bits<T, UPT>(w, U), reinterpret_cast<uint32_t*>(s.red)));
#pragma unroll
    for (int j = 0; j < UPT; ++j) q[j] = quant_multiplier(m);
    row_scale = scale_of(m);
  } else {
    if (p.gran == kTensor) {
      row_scale = __ldg(p.tscale);
      const float tq = 1.0f / row_scale;  // IEEE division, as ops_cpu.cpp
#pragma unroll
      for (int j = 0; j < UPT; ++j) q[j] = tq;
    } else {
      block128_multipliers<T, UPT>(w, U, q, [&](int64_t b, float m) { s.amax[b] = m; });
    }
    __syncthreads();
  }
  uint4 out[UPT];
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) out[j] = quantize_unit<T>(w[j], q[j]);
  }
  write_send_pos(p, t, s);

  // row n's tail is written by warp n % warps, so no warp computes every tail
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int n = 0;
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.row_bytes;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (u < U) reinterpret_cast<uint4*>(dst)[u] = out[j];
    }
    if (warp == n++ % nwarps) write_dispatch_tail(p, dst, s.rank[k], row_scale, s, threadIdx.x & 31, 32);
  }
}

// Any H, any alignment of x: element by element.
template <typename T, typename IdxT, bool SELF>
__global__ void __launch_bounds__(256) dispatch_pack_scalar_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x, H = p.H;
  const T* xrow = reinterpret_cast<const T*>(p.x) + t * H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  route_token<IdxT, SELF>(p, t, s, smem);
  float rm = 0.0f;
  if (p.gran == kBlock128) {
    const int64_t nb = H / kBlock;
    for (int64_t b = warp; b < nb; b += nwarps) {
      float m = 0.0f;
      for (int i = lane; i < kBlock; i += 32) m = amax_step(m, Elem<T>::load1(xrow + b * kBlock + i));
      m = warp_amax(m);
      if (lane == 0) s.amax[b] = m;
    }
  } else if (p.gran == kRow) {
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) rm = amax_step(rm, Elem<T>::load1(xrow + h));
    rm = warp_amax(rm);
    if (lane == 0) s.red[warp] = rm;
  }
  __syncthreads();
  float q = 0.0f, row_scale = 0.0f;
  if (p.gran == kTensor) {
    row_scale = __ldg(p.tscale);
    q = 1.0f / row_scale;
  } else if (p.gran == kRow) {
    rm = 0.0f;
    for (int i = 0; i < nwarps; ++i) rm = amax_step(rm, s.red[i]);
    q = quant_multiplier(rm);
    row_scale = scale_of(rm);
  }
  write_send_pos(p, t, s);
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    const int r = s.rank[k];
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.row_bytes;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const float qh = p.gran == kBlock128 ? quant_multiplier(s.amax[h / kBlock]) : q;
      dst[h] = e4m3_1(__fmul_rn(Elem<T>::load1(xrow + h), qh));
    }
    write_dispatch_tail(p, dst, r, row_scale, s, threadIdx.x, blockDim.x);
  }
}

// Raw wire: the activation's own bytes (x is a uint8 [T, H] view), read once, written per rank.
template <typename IdxT, bool SELF>
__global__ void __launch_bounds__(512) dispatch_pack_raw_kernel(PackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const RouteSmem s = carve_route_smem(smem, p.K);
  const int64_t t = blockIdx.x, H = p.H;
  const uint8_t* xrow = reinterpret_cast<const uint8_t*>(p.x) + t * H;
  route_token<IdxT, SELF>(p, t, s, smem);
  __syncthreads();
  write_send_pos(p, t, s);
  if (p.vec) {
    for (int64_t u = threadIdx.x; u < H / 16; u += blockDim.x) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(xrow) + u);
      for (int k = 0; k < p.K; ++k) {
        const int row = s.row[k];
        if (row >= 0) reinterpret_cast<uint4*>(p.send + static_cast<int64_t>(row) * p.row_bytes)[u] = v;
      }
    }
  } else {
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const uint8_t v = xrow[h];
      for (int k = 0; k < p.K; ++k) {
        const int row = s.row[k];
        if (row >= 0) p.send[static_cast<int64_t>(row) * p.row_bytes + h] = v;
      }
    }
  }
  for (int k = 0; k < p.K; ++k) {
    const int row = s.row[k];
    if (row < 0) continue;
    const int r = s.rank[k];
    uint8_t* dst = p.send + static_cast<int64_t>(row) * p.row_bytes;
    write_dispatch_tail(p, dst, r, 0.0f, s, threadIdx.x, blockDim.x);
  }
}

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
  int64_t Nr, N, H, row_bytes;
  int64_t rcap, ecap;  // capacity mode: rank_capacity, expert_capacity (0: compact)
  int K, R, El, C, ns;
  int split;  // warps per received row (each writes every split-th target): few rows, many targets
  int scale_off, weight_off, expert_off, pos_off;
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

__global__ void __launch_bounds__(256) dispatch_unpack_kernel(UnpackParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* s_counts = reinterpret_cast<int64_t*>(smem);  // [R, C]
  int64_t* s_base = s_counts + p.R * p.C;                  // [R, El] first expert-major row of (r, e)
  int64_t* s_est = s_base + p.R * p.El;                    // [El] tokens per expert, then expert start
  int64_t* s_rst = s_est + p.El;                           // [R + 1] first received row of each rank
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  int* s_tgt = reinterpret_cast<int*>(s_rst + p.R + 1) + warp * p.K;
  const bool capacity = p.ecap > 0;

  // ---- tables (a few hundred int64: every block builds its own copy) ----
  for (int i = threadIdx.x; i < p.R * p.C; i += blockDim.x)
    s_counts[i] = __ldg(reinterpret_cast<const long long*>(p.counts) + i);
  __syncthreads();
  for (int e = threadIdx.x; e < p.El; e += blockDim.x) {
    int64_t sum = 0;
    for (int r = 0; r < p.R; ++r) sum += s_counts[r * p.C + kColExperts + e];
    s_est[e] = sum;
    if (blockIdx.x == 0) p.tpe[e] = sum;
  }
  for (int r = threadIdx.x; r < p.R; r += blockDim.x) s_rst[r] = s_counts[r * p.C + kColRows];
  __syncthreads();
  if (warp == 0) warp_exclusive_scan(s_est, p.El);
  if (warp == W - 1) {
    const int64_t total = warp_exclusive_scan(s_rst, p.R);
    if (lane == 0) s_rst[p.R] = total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.El; e += blockDim.x) {
    int64_t run = s_est[e];
    for (int r = 0; r < p.R; ++r) {
      // Capacity mode: expert e owns rows [e * R * C, (e + 1) * R * C), source r a slice of C.
      s_base[r * p.El + e] = capacity ? (static_cast<int64_t>(e) * p.R + r) * p.ecap : run;
      run += s_counts[r * p.C + kColExperts + e];
    }
  }
  __syncthreads();

  const int64_t U = p.H / 16;
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * W + warp, nwarps = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t item = gwarp; item < p.Nr * p.split; item += nwarps) {
    const int64_t i = item / p.split;
    const int part = static_cast<int>(item - i * p.split);  // this warp's share of row i's targets
    // source rank of row i, or -1 when no source announced it
    int r = -1;
    if (capacity) {
      const int64_t rr = i / p.rcap;
      if (rr < p.R && i - rr * p.rcap < s_counts[rr * p.C + kColRows]) r = static_cast<int>(rr);
    } else if (i < s_rst[p.R]) {
      int lo = 0, hi = p.R - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_rst[mid] <= i) lo = mid;
        else hi = mid - 1;
      }
      r = lo;
    }
    const uint8_t* row = p.recv + i * p.row_bytes;
    const uint4* src = reinterpret_cast<const uint4*>(row);
    constexpr int PB = 8;  // 16-byte loads in flight per lane
    uint4 buf[PB];
    const bool early = p.vec && p.split == 1;  // split rows: only warps with targets read the payload
    if (early) {  // the payload's first batch does not depend on the routing fields: load it now
#pragma unroll
      for (int a = 0; a < PB; ++a)
        if (lane + a * 32 < U) buf[a] = __ldg(src + lane + a * 32);
    }
    int ntgt = 0;
    for (int k0 = 0; k0 < p.K; k0 += 32) {
      const int k = k0 + lane;
      int n = -1;
      float wt = 0.0f;
      if (k < p.K && r >= 0) {
        const int ex = __ldg(reinterpret_cast<const int*>(row + p.expert_off) + k);
        const int ps = __ldg(reinterpret_cast<const int*>(row + p.pos_off) + k);
        if (ex >= 0 && ex < p.El && ps >= 0 && ps < s_counts[r * p.C + kColExperts + ex] && (!capacity || ps < p.ecap)) {
          const int64_t nn = s_base[r * p.El + ex] + ps;
          if (nn >= 0 && nn < p.N) n = static_cast<int>(nn);
        }
        wt = __ldg(reinterpret_cast<const float*>(row + p.weight_off) + k);
      }
      if (part == 0) {
        if (k < p.K) p.slot_pos[i * p.K + k] = n;
        if (n >= 0) {
          p.weights[n] = wt;
          p.row_src[n] = static_cast<int>(i);
        }
      }
      const unsigned m = __ballot_sync(kFull, n >= 0);
      if (n >= 0) s_tgt[ntgt + __popc(m & ((1u << lane) - 1u))] = n;
      ntgt += __popc(m);
    }
    __syncwarp();
    if (part >= ntgt) continue;  // nothing of this row for this warp (uniform across the warp)
    for (int j = part; j < ntgt; j += p.split) {
      const int64_t n = s_tgt[j];
      for (int c = lane; c < p.ns; c += 32)
        p.scale[n * p.ns + c] = __ldg(reinterpret_cast<const float*>(row + p.scale_off) + c);
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
          uint4* dst = reinterpret_cast<uint4*>(p.data + static_cast<int64_t>(s_tgt[j]) * p.H);
#pragma unroll
          for (int a = 0; a < PB; ++a)
            if (v0 + a * 32 < U) dst[v0 + a * 32] = buf[a];
        }
      }
    } else {
      for (int64_t hh = lane; hh < p.H; hh += 32) {
        const uint8_t b = row[hh];
        for (int j = part; j < ntgt; j += p.split) p.data[static_cast<int64_t>(s_tgt[j]) * p.H + hh] = b;
      }
    }
    __syncwarp();
  }

  // ---- capacity mode: padding rows are zero (data, scales, weight) with no source (-1) ----
  if (capacity) {
    const int64_t seg = static_cast<int64_t>(p.R) * p.ecap;
    for (int64_t n = gwarp; n < p.N; n += nwarps) {
      const int64_t e = n / seg, rem = n - e * seg, r = rem / p.ecap, pos = rem - r * p.ecap;
      const int64_t cnt = s_counts[r * p.C + kColExperts + e];
      if (pos < cnt) continue;  // a real row, written above
      if (p.vec) {
        for (int64_t v = lane; v < U; v += 32) reinterpret_cast<uint4*>(p.data + n * p.H)[v] = make_uint4(0, 0, 0, 0);
      } else {
        for (int64_t hh = lane; hh < p.H; hh += 32) p.data[n * p.H + hh] = 0;
      }
      for (int c = lane; c < p.ns; c += 32) p.scale[n * p.ns + c] = 0.0f;
      if (lane == 0) {
        p.weights[n] = 0.0f;
        p.row_src[n] = -1;
      }
    }
  }
}

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
// combine_pack: one block per received row
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

template <typename T, int UPT>
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
    store_units<T, UPT>(acc, reinterpret_cast<T*>(dst), U);
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

template <typename T>
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
    T* out = reinterpret_cast<T*>(dst);
    for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) Elem<T>::store1(out + h, combine_acc<T>(p, i, h));
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

// =============================================================================================
// Host entry points
// =============================================================================================
std::tuple<Tensor, Tensor> quantize_cuda(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale) {
  check_activation(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_granularity(granularity, H);
  TORCH_CHECK(granularity != kRaw, "fp8a2a: quantize takes granularity row, block128 or tensor");
  if (granularity == kTensor && scale.has_value()) check_tensor_scale(scale, x);
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

std::tuple<Tensor, Tensor, Tensor> dispatch_pack_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                                      int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                                      const std::optional<Tensor>& tensor_scale, int64_t rank_capacity) {
  check_routing(x, topk_idx, topk_weights, num_experts, num_ranks, granularity);
  const int64_t T = x.size(0), H = x.size(1), K = topk_idx.size(1), R = num_ranks, El = num_experts / num_ranks;
  check_granularity(granularity, H);
  if (granularity == kTensor) check_tensor_scale(tensor_scale, x);
  TORCH_CHECK(rank_capacity >= 0, "fp8a2a: rank_capacity must be >= 0, got ", rank_capacity);
  const DispatchRow L(H, granularity, K);
  const int64_t TK = T * K;
  const int64_t cols = num_experts + R + 1;  // per-expert slots, per-rank rows, bad ids
  const int64_t send_rows = send_buffer_rows(T, K, R, rank_capacity);
  TORCH_CHECK(TK < INT_MAX && num_experts < INT_MAX / 2 && send_rows < INT_MAX,
              "fp8a2a: dispatch_pack on CUDA supports fewer than 2^31 slots and rows");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int device = x.get_device();

  auto counts = at::empty({R, kColExperts + El}, x.options().dtype(at::kLong));
  auto send_pos = at::empty({T, R}, x.options().dtype(at::kInt));

  // ---- layout geometry: chunks of W warps x steps groups of 32 slots, about one per SM ----
  int W = 16;
  while (W > 1 && static_cast<int64_t>(W) * cols * 4 > kSmemDefault) W /= 2;
  const size_t layout_smem = static_cast<size_t>(W) * cols * 4;
  const int64_t per_step = static_cast<int64_t>(W) * 32;
  const int64_t sms = num_sms(device);
  // Up to W * 32 * kMaxLayoutSteps slots one chunk (one block: no cross-block scan, no counter to
  // clear, one launch less); above, about one chunk per SM.
  const int64_t one_chunk_steps = (TK + per_step - 1) / per_step;
  const int steps = static_cast<int>(one_chunk_steps <= kMaxLayoutSteps
      ? std::max<int64_t>(1, one_chunk_steps)
      : std::min<int64_t>(kMaxLayoutSteps, (TK + per_step * sms - 1) / (per_step * sms)));
  const int64_t chunk_slots = per_step * steps;
  const int64_t nchunks = std::max<int64_t>(1, (TK + chunk_slots - 1) / chunk_slots);
  TORCH_CHECK(2 * nchunks * cols < INT_MAX, "fp8a2a: dispatch_pack: too many tokens x experts for the CUDA layout");

  // Small batches (the host-bound regime): no layout kernel, each pack block routes its own token.
  const size_t route_bytes = route_smem_bytes(K, granularity == kBlock128 ? H / kBlock : 0);
  const bool self_route = T > 0 && T <= kSelfMaxTokens && TK <= kSelfMaxSlots && K <= kSelfMaxK &&
                          route_bytes + self_smem_bytes(TK, num_experts, R, K) <= static_cast<size_t>(kSmemDefault);

  // scratch: [rank_off R][chunk_off nchunks x cols][chunk_tot nchunks x cols][slot_rank 2 x TK]
  // int32, in the send buffer's allocation, after the rows (one allocation less per call). The scan
  // kernel reads chunk_tot and writes chunk_off: no block reads what another one writes.
  const int64_t slot_off = (R + 2 * nchunks * cols + 1) / 2 * 2;
  const int64_t send_bytes = send_rows * L.bytes;  // a multiple of kRowAlign: the scratch stays aligned
  auto send_alloc = at::empty({send_bytes + (self_route ? 0 : 4 * (slot_off + 2 * TK))}, x.options().dtype(at::kByte));
  auto send = send_alloc.narrow(0, 0, send_rows * L.bytes).view({send_rows, L.bytes});
  int* sp = reinterpret_cast<int*>(send_alloc.data_ptr<uint8_t>() + send_bytes);
  // the kernels after the layout kernel start early and wait for it (programmatic dependent launch)
  const bool pdl = early_launch_ok(dispatch_scan_kernel, device);
  LayoutParams lp{};  // all null on the self-routed path: no layout tables
  if (!self_route) {
    lp.idx = topk_idx.data_ptr();
    lp.TK = TK;
    lp.K = static_cast<int>(K);
    lp.E = static_cast<int>(num_experts);
    lp.El = static_cast<int>(El);
    lp.R = static_cast<int>(R);
    lp.cols = static_cast<int>(cols);
    lp.chunk_slots = static_cast<int>(chunk_slots);
    lp.steps = steps;
    lp.nchunks = static_cast<int>(nchunks);
    lp.H = H;
    lp.gran = granularity;
    lp.cap = rank_capacity;
    lp.rank_off = sp;
    lp.chunk_off = sp + R;
    lp.chunk_tot = sp + R + nchunks * cols;
    lp.slot_rank = reinterpret_cast<int2*>(sp + slot_off);
    lp.counts = counts.data_ptr<int64_t>();
    if (topk_idx.scalar_type() == at::kLong) {
      ensure_smem(dispatch_layout_kernel<int64_t>, layout_smem, device, "dispatch_pack layout");
      dispatch_layout_kernel<int64_t><<<nchunks, W * 32, layout_smem, stream>>>(lp);
    } else {
      ensure_smem(dispatch_layout_kernel<int32_t>, layout_smem, device, "dispatch_pack layout");
      dispatch_layout_kernel<int32_t><<<nchunks, W * 32, layout_smem, stream>>>(lp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (nchunks > 1)  // a block per kScanCols columns, and one for the rank offsets
      launch_kernel(dispatch_scan_kernel, (cols + kScanCols - 1) / kScanCols + 1, kScanCols * kScanRows, 0, stream,
                    pdl, lp);
  }
  if (T == 0) return {send, counts, send_pos};

  PackParams p{};
  p.x = x.data_ptr();
  p.idx = topk_idx.data_ptr();
  p.w = topk_weights.data_ptr<float>();
  p.tscale = granularity == kTensor ? tensor_scale->data_ptr<float>() : nullptr;
  p.slot_rank = lp.slot_rank;  // null when self-routed
  p.chunk_off = lp.chunk_off;
  p.rank_off = lp.rank_off;
  p.send = send.data_ptr<uint8_t>();
  p.send_pos = send_pos.data_ptr<int>();
  p.T = T;
  p.H = H;
  p.row_bytes = L.bytes;
  p.cap = rank_capacity;
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(num_experts);
  p.El = static_cast<int>(El);
  p.R = static_cast<int>(R);
  p.cols = static_cast<int>(cols);
  p.chunk_slots = static_cast<int>(chunk_slots);
  p.gran = static_cast<int>(granularity);
  p.scale_off = static_cast<int>(L.scale_off);
  p.weight_off = static_cast<int>(L.weight_off);
  p.expert_off = static_cast<int>(L.expert_off);
  p.pos_off = static_cast<int>(L.pos_off);
  p.vec = H % 16 == 0 && aligned16(x.data_ptr());
  p.counts = counts.data_ptr<int64_t>();
  p.self_off = static_cast<int>(route_bytes);
  const size_t smem = route_bytes + (self_route ? self_smem_bytes(TK, num_experts, R, K) : 0);
  auto launch_pack = [&](auto kernel, int threads) {
    ensure_smem(kernel, smem, device, "dispatch_pack");
    launch_kernel(kernel, T, threads, smem, stream, pdl && !self_route, p);
  };
  auto launch = [&](auto idx_tag, auto self_tag) {
    using IdxT = decltype(idx_tag);
    constexpr bool SELF = decltype(self_tag)::value;
    if (granularity == kRaw) {
      launch_pack(dispatch_pack_raw_kernel<IdxT, SELF>,
                  static_cast<int>(std::min<int64_t>(512, round_up32(p.vec ? H / 16 : H))));
      return;
    }
    const int64_t U = H / 16;
    const int upt = p.vec ? units_per_thread(U, /*prefer2=*/true) : 0;
    FP8A2A_DISPATCH_FLOAT(x.scalar_type(), "dispatch_pack", [&] {
      if (upt == 1) launch_pack(dispatch_pack_vec_kernel<scalar_t, IdxT, 1, SELF>, threads_for(U, 1));
      else if (upt == 2) launch_pack(dispatch_pack_vec_kernel<scalar_t, IdxT, 2, SELF>, threads_for(U, 2));
      else launch_pack(dispatch_pack_scalar_kernel<scalar_t, IdxT, SELF>, 256);
    });
  };
  const bool wide = topk_idx.scalar_type() == at::kLong;
  if (wide && self_route) launch(int64_t{}, std::true_type{});
  else if (wide) launch(int64_t{}, std::false_type{});
  else if (self_route) launch(int32_t{}, std::true_type{});
  else launch(int32_t{}, std::false_type{});
  return {send, counts, send_pos};
}

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
  p.Nr = Nr;
  p.N = num_rows;
  p.H = H;
  p.row_bytes = L.bytes;
  p.rcap = rank_capacity;
  p.ecap = expert_capacity;
  p.K = static_cast<int>(topk);
  p.R = static_cast<int>(R);
  p.El = static_cast<int>(El);
  p.C = static_cast<int>(C);
  p.ns = static_cast<int>(L.num_scales);
  p.scale_off = static_cast<int>(L.scale_off);
  p.weight_off = static_cast<int>(L.weight_off);
  p.expert_off = static_cast<int>(L.expert_off);
  p.pos_off = static_cast<int>(L.pos_off);
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

Tensor combine_pack_cuda(const Tensor& expert_out, const Tensor& slot_pos, const std::optional<Tensor>& weights,
                         const std::optional<Tensor>& extra, bool quantize) {
  check_activation(expert_out, "expert_out");
  check_index(slot_pos, 2, "slot_pos");
  check_same_device(expert_out, slot_pos, "slot_pos");
  const int64_t N = expert_out.size(0), H = expert_out.size(1), Nr = slot_pos.size(0), K = slot_pos.size(1);
  check_f32_vector(weights, N, expert_out, "weights");
  check_f32_vector(extra, N, expert_out, "extra");
  const CombineRow L(H, expert_out.element_size(), quantize, extra.has_value() ? K : 0);
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
  FP8A2A_DISPATCH_FLOAT(expert_out.scalar_type(), "combine_pack", [&] {
    if (upt == 1) combine_pack_vec_kernel<scalar_t, 1><<<Nr, threads_for(U, 1), 0, stream>>>(p);
    else if (upt == 2) combine_pack_vec_kernel<scalar_t, 2><<<Nr, threads_for(U, 2), 0, stream>>>(p);
    else combine_pack_scalar_kernel<scalar_t><<<Nr, 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// =============================================================================================
// capacity_drop: sort slots by (expert, weight descending, slot); a slot at sorted position i is
// kept iff i < capacity or the slot at i - capacity has another expert.
// =============================================================================================
constexpr int kDropThreads = 512;

// Up to 4096 slots: one block, one launch (the CUDA-graph step at small batch sizes).
template <typename IdxT, int ITEMS>
__global__ void __launch_bounds__(kDropThreads)
    capacity_drop_block_kernel(const IdxT* idx, const float* w, IdxT* out, int64_t* dropped, int n, int E, int cap,
                               int slot_bits, int end_bit) {
  using Sort = cub::BlockRadixSort<unsigned long long, kDropThreads, ITEMS>;
  __shared__ union {
    typename Sort::TempStorage sort;
    unsigned long long keys[kDropThreads * ITEMS];
  } sm;
  __shared__ int s_drop;
  if (threadIdx.x == 0) s_drop = 0;
  const int ebit = 32 + slot_bits;
  unsigned long long key[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int slot = threadIdx.x * ITEMS + j;  // blocked arrangement: slot order
    key[j] = ~0ull;                            // padding sorts last (expert field all ones > E)
    if (slot < n) {
      const int64_t e = load_idx<IdxT>(idx + slot);
      const unsigned long long ex = (e >= 0 && e < E) ? static_cast<unsigned long long>(e) : E;
      key[j] = (ex << ebit) | (static_cast<unsigned long long>(weight_desc_key(__float_as_uint(w[slot]))) << slot_bits) |
               static_cast<unsigned long long>(slot);
    }
  }
  Sort(sm.sort).Sort(key, 0, end_bit);
  __syncthreads();  // the sort's storage becomes the sorted keys
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) sm.keys[threadIdx.x * ITEMS + j] = key[j];
  __syncthreads();
  const unsigned long long slot_mask = (1ull << slot_bits) - 1;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j;
    if (i >= n) continue;
    const int slot = static_cast<int>(key[j] & slot_mask);
    const unsigned long long ex = key[j] >> ebit;
    if (ex >= static_cast<unsigned long long>(E)) {
      out[slot] = idx[slot];  // -1 or a bad id: unchanged
      continue;
    }
    const bool keep = i < cap || (sm.keys[i - cap] >> ebit) != ex;
    out[slot] = keep ? static_cast<IdxT>(ex) : static_cast<IdxT>(-1);
    if (!keep) atomicAdd(&s_drop, 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) *dropped = s_drop;
}

// More slots: (expert, weight) keys for a stable at::sort.
template <typename IdxT>
__global__ void capacity_drop_keys_kernel(const IdxT* idx, const float* w, int64_t* keys, int64_t n, int E) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < n;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = load_idx<IdxT>(idx + s);
    const int64_t ex = (e >= 0 && e < E) ? e : E;
    keys[s] = (ex << 32) | static_cast<int64_t>(weight_desc_key(__float_as_uint(w[s])));
  }
}

template <typename IdxT>
__global__ void capacity_drop_sorted_kernel(const int64_t* sorted, const int64_t* perm, IdxT* out,
                                            unsigned long long* dropped, int64_t n, int E, int64_t cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t ex = sorted[i] >> 32;
    if (ex < E && i >= cap && (sorted[i - cap] >> 32) == ex) {
      out[perm[i]] = static_cast<IdxT>(-1);
      atomicAdd(dropped, 1ull);
    }
  }
}

std::tuple<Tensor, Tensor> capacity_drop_cuda(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                              int64_t capacity) {
  check_capacity_drop(topk_idx, topk_weights, num_experts, capacity);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t n = topk_idx.numel();
  const int E = static_cast<int>(num_experts);
  const int cap = static_cast<int>(std::min<int64_t>(capacity, INT_MAX));
  const int expert_bits = 32 - __builtin_clz(static_cast<unsigned>(E) + 1u);  // E itself (not routed) < all ones
  int slot_bits = 1;
  while ((int64_t{1} << slot_bits) < n) ++slot_bits;
  if (n <= kDropThreads * 8 && 32 + slot_bits + expert_bits <= 64) {
    auto out = at::empty_like(topk_idx);
    auto dropped = at::empty({}, topk_idx.options().dtype(at::kLong));
    AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "capacity_drop", [&] {
      auto kernel = n <= kDropThreads * 2 ? capacity_drop_block_kernel<index_t, 2> : capacity_drop_block_kernel<index_t, 8>;
      kernel<<<1, kDropThreads, 0, stream>>>(topk_idx.data_ptr<index_t>(), topk_weights.data_ptr<float>(),
                                             out.data_ptr<index_t>(), dropped.data_ptr<int64_t>(), static_cast<int>(n), E,
                                             cap, slot_bits, 32 + slot_bits + expert_bits);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return {out, dropped};
  }
  auto out = topk_idx.clone();
  auto dropped = at::zeros({}, topk_idx.options().dtype(at::kLong));
  auto keys = at::empty({n}, topk_idx.options().dtype(at::kLong));
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 8 * num_sms(topk_idx.get_device())));
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "capacity_drop", [&] {
    capacity_drop_keys_kernel<index_t><<<blocks, 256, 0, stream>>>(topk_idx.data_ptr<index_t>(),
                                                                   topk_weights.data_ptr<float>(),
                                                                   keys.data_ptr<int64_t>(), n, E);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto [sorted, perm] = keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
    capacity_drop_sorted_kernel<index_t><<<blocks, 256, 0, stream>>>(
        sorted.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), out.data_ptr<index_t>(),
        reinterpret_cast<unsigned long long*>(dropped.data_ptr<int64_t>()), n, E, capacity);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, dropped};
}

TORCH_LIBRARY_IMPL(fp8a2a, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dispatch_pack", &dispatch_pack_cuda);
  m.impl("dispatch_unpack", &dispatch_unpack_cuda);
  m.impl("combine_pack", &combine_pack_cuda);
  m.impl("combine_unpack", &combine_unpack_cuda);
  m.impl("capacity_drop", &capacity_drop_cuda);
}

}  // namespace fp8a2a
