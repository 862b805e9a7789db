// The expert GEMMs with the counts on the host: one cuBLASLt matmul per expert, all launched from
// one host call. torch._scaled_mm builds its descriptors and asks cuBLASLt's heuristic on every
// call, and a Python loop over experts adds its slicing: a host cost per expert that the step waits
// on (the GPU idles from the dispatch's sync to the first GEMM, and between the forward and the
// backward). Here the descriptors are built once per call and each algorithm is found once and
// reused (the key: the device, the output and reduced sizes, an expert's rows in buckets of 128 or
// its padded width, the out dtype), with the settings torch uses (its handle and workspace).
// - mm_fp8_per_expert: row-scaled FP8 (the forward, the FP8 dgrad): one scale per row of a and per
//   output channel of b (cuBLASLt's outer-vector scales).
// - wgrad_fp8_per_expert: the FP8 weight gradient, 1 x 128 scales on both operands.
// Built with a toolkit older than CUDA 12.9 (neither scale mode in its headers) both refuse, and
// experts.py runs its grouped GEMMs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda.h>

#include <cstdint>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "../ops.h"

namespace fp8a2a {
namespace {

void check_lt(cublasStatus_t status, const char* op, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "fp8a2a: ", op, ": ", what, " failed: ", cublasLtGetStatusString(status));
}

// Owns a cuBLASLt descriptor.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T h = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (h) Destroy(h);
  }
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// (op kind, device, m, n, k, out type) -> the heuristic's algorithm (each op says what its n and k
// stand for). The leading dimensions are left out (LtGemm::run).
using AlgoKey = std::tuple<int, int, int64_t, int64_t, int64_t, int>;
std::mutex algo_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> algo_cache;

// One op call's cuBLASLt state: a "TN" FP8 matmul D = op(A) B (column-major, as cuBLAS is), both
// operands e4m3, fp32 accumulation, with torch's handle, workspace and stream.
struct LtGemm {
  const char* op;
  MatmulDesc desc;
  Layout la, lb, lc;
  Preference pref;
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  uint64_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = at::cuda::getCUDABlasLtWorkspace();

  LtGemm(const char* op_name, int32_t scale_mode, bool fast_accum) : op(op_name) {
    check_lt(cublasLtMatmulDescCreate(&desc.h, CUBLAS_COMPUTE_32F, CUDA_R_32F), op, "cublasLtMatmulDescCreate");
    set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
#if CUDA_VERSION >= 12090
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode);
#endif
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum));
    check_lt(cublasLtMatmulPreferenceCreate(&pref.h), op, "cublasLtMatmulPreferenceCreate");
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                  sizeof(ws_size)),
             op, "cublasLtMatmulPreferenceSetAttribute");
  }

  template <typename V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    check_lt(cublasLtMatmulDescSetAttribute(desc.h, attr, &value, sizeof(value)), op, "cublasLtMatmulDescSetAttribute");
  }

  void layouts(uint64_t k, uint64_t m, int64_t lda, uint64_t n, int64_t ldb, cudaDataType_t out_type) {
    check_lt(cublasLtMatrixLayoutCreate(&la.h, CUDA_R_8F_E4M3, k, m, lda), op, "cublasLtMatrixLayoutCreate");
    check_lt(cublasLtMatrixLayoutCreate(&lb.h, CUDA_R_8F_E4M3, k, n, ldb), op, "cublasLtMatrixLayoutCreate");
    check_lt(cublasLtMatrixLayoutCreate(&lc.h, out_type, m, n, m), op, "cublasLtMatrixLayoutCreate");
  }

  void set_layout(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, uint64_t v) {
    check_lt(cublasLtMatrixLayoutSetAttribute(l, attr, &v, sizeof(v)), op, "cublasLtMatrixLayoutSetAttribute");
  }

  cublasLtMatmulAlgo_t heuristic() {
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.h, la.h, lb.h, lc.h, lc.h, pref.h, 1, &result, &found), op,
             "cublasLtMatmulAlgoGetHeuristic");
    uint64_t rows = 0, cols = 0, m = 0;
    size_t size = 0;
    cublasLtMatrixLayoutGetAttribute(la.h, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof(rows), &size);
    cublasLtMatrixLayoutGetAttribute(la.h, CUBLASLT_MATRIX_LAYOUT_COLS, &m, sizeof(m), &size);
    cublasLtMatrixLayoutGetAttribute(lb.h, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols), &size);
    TORCH_CHECK(found > 0, "fp8a2a: ", op, ": cuBLASLt has no algorithm for this scaled FP8 GEMM at m=", m, " n=",
                cols, " k=", rows);
    return result.algo;
  }

  // D = op(A) B with the cached algorithm of `key` (found by `find` on a miss). Where cuBLASLt refuses
  // it for this problem's leading dimensions or sizes, the heuristic's for the problem as set runs
  // instead, uncached: the cache holds only `find`'s answers.
  template <typename Find>
  void run(const AlgoKey& key, Find&& find, const void* a, const void* b, void* d) {
    const float alpha = 1.0f, beta = 0.0f;
    cublasLtMatmulAlgo_t algo;
    {
      std::lock_guard<std::mutex> lock(algo_mutex);
      auto it = algo_cache.find(key);
      if (it != algo_cache.end()) {
        algo = it->second;
      } else {
        algo = find();
        algo_cache.emplace(key, algo);
      }
    }
    auto matmul = [&] {
      return cublasLtMatmul(handle, desc.h, &alpha, a, la.h, b, lb.h, &beta, d, lc.h, d, lc.h, &algo, ws, ws_size,
                            stream);
    };
    cublasStatus_t status = matmul();
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
      algo = heuristic();
      status = matmul();
    }
    check_lt(status, op, "cublasLtMatmul");
  }
};

constexpr int kWgrad = 0, kRowScaled = 1, kRowScaledFastAccum = 2;  // AlgoKey's op kinds
constexpr int64_t kRowsBucket = 128;  // mm_fp8_per_expert: experts' rows of one cached algorithm

// Segments of a float vector copied to new offsets in one launch: mm_fp8_per_expert's row scales
// moved so that every expert's starts on 16 bytes (one block per segment).
constexpr int kMaxSegments = 128;  // per launch: the parameters stay within a kernel's 4 KiB
struct Segments {
  int64_t src[kMaxSegments], dst[kMaxSegments], n[kMaxSegments];
};

__global__ void copy_segments_kernel(const float* __restrict__ src, float* __restrict__ dst, Segments s) {
  const int64_t from = s.src[blockIdx.x], to = s.dst[blockIdx.x], n = s.n[blockIdx.x];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[to + i] = src[from + i];
}

}  // namespace

Tensor mm_fp8_per_expert_cuda(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                              at::IntArrayRef counts, bool fast_accum) {
  check_mm_fp8_per_expert(a, scale_a, b, scale_b, counts);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(1);
  auto out = at::empty({M, N}, a.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();  // no GEMM: an empty sum
  // cuBLASLt's FP8 GEMMs: dimensions and addresses in 16 bytes (a RuntimeError: experts.py falls back)
  TORCH_CHECK(K % 16 == 0 && N % 16 == 0 && aligned16(a.data_ptr()) && aligned16(b.data_ptr()) &&
                  aligned16(scale_b.data_ptr()),
              "fp8a2a: mm_fp8_per_expert: cuBLASLt's FP8 GEMM needs K and N in multiples of 16 and 16-byte aligned ",
              "operands, got K=", K, " N=", N);
#if CUDA_VERSION >= 12090
  LtGemm g("mm_fp8_per_expert", CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, fast_accum);
  // out's rows of expert e (row-major [n, N]) are D = op(A) B with m = N, n = the expert's rows, k = K:
  // A = b[e] (k x m, ld K, transposed), B = a's rows (k x n, ld K). A's scales are one per output
  // channel (scale_b[e], m of them), B's one per row (scale_a's, n of them), each vector on 16 bytes.
  g.layouts(K, N, K, 1, K, CUDA_R_16BF);
  // Each expert's row scales start on 16 bytes (cuBLASLt's scale vectors), or scale_a is copied by one
  // launch with every expert's start rounded up to 4 floats (not under a TE FP8 recipe, which pads
  // the counts to 16).
  const float* sa = scale_a.data_ptr<float>();
  std::vector<int64_t> sa_start(E);
  bool starts_aligned = aligned16(sa);
  for (int64_t e = 0, r = 0; e < E; r += counts[e], ++e) {
    sa_start[e] = r;
    starts_aligned = starts_aligned && (counts[e] == 0 || r % 4 == 0);
  }
  Tensor sa_copy;
  if (!starts_aligned) {
    sa_copy = at::empty({M + 3 * E}, scale_a.options());
    float* dst = sa_copy.data_ptr<float>();
    Segments seg;
    int used = 0;
    for (int64_t e = 0, to = 0; e < E; ++e) {
      if (counts[e]) {
        seg.src[used] = sa_start[e], seg.dst[used] = to, seg.n[used] = counts[e];
        if (++used == kMaxSegments) {
          copy_segments_kernel<<<used, 256, 0, g.stream>>>(sa, dst, seg);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          used = 0;
        }
      }
      sa_start[e] = to;
      to += (counts[e] + 3) / 4 * 4;
    }
    if (used) {
      copy_segments_kernel<<<used, 256, 0, g.stream>>>(sa, dst, seg);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    sa = dst;
  }
  const auto* pa = static_cast<const uint8_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint8_t*>(b.data_ptr());
  const float* psb = scale_b.data_ptr<float>();
  auto* pout = static_cast<at::BFloat16*>(out.data_ptr());
  const int kind = fast_accum ? kRowScaledFastAccum : kRowScaled;
  for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e) {
    const uint64_t n = static_cast<uint64_t>(counts[e]);
    if (n == 0) continue;
    g.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(psb + e * N));
    g.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(sa + sa_start[e]));
    // the algorithm of a bucket of row counts, found for the bucket's largest: the same bytes for
    // the same inputs whichever counts a process saw first
    const int64_t bucket = (static_cast<int64_t>(n) + kRowsBucket - 1) / kRowsBucket;
    auto find = [&] {
      for (auto* l : {g.lb.h, g.lc.h}) g.set_layout(l, CUBLASLT_MATRIX_LAYOUT_COLS, bucket * kRowsBucket);
      auto algo = g.heuristic();
      for (auto* l : {g.lb.h, g.lc.h}) g.set_layout(l, CUBLASLT_MATRIX_LAYOUT_COLS, n);
      return algo;
    };
    for (auto* l : {g.lb.h, g.lc.h}) g.set_layout(l, CUBLASLT_MATRIX_LAYOUT_COLS, n);
    g.run(AlgoKey{kind, a.get_device(), N, bucket, K, static_cast<int>(CUDA_R_16BF)}, find, pb + e * N * K,
          pa + start * K, pout + start * N);
  }
  return out;
#else
  TORCH_CHECK(false, "fp8a2a: mm_fp8_per_expert needs cuBLAS 12.9+ (outer-vector scales); this build has CUDA ",
              CUDA_VERSION);
  return out;
#endif
}

Tensor wgrad_fp8_per_expert_cuda(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                 at::IntArrayRef widths, at::ScalarType out_dtype) {
  const int64_t total = check_wgrad_fp8_per_expert(a, scale_a, b, scale_b, widths, out_dtype);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t E = static_cast<int64_t>(widths.size()), Na = a.size(0), Nb = b.size(0), M = a.size(1);
  if (total == 0 || Na == 0 || Nb == 0) return at::zeros({E, Na, Nb}, a.options().dtype(out_dtype));  // no GEMM
  // cuBLASLt's FP8 GEMMs: dimensions and addresses in 16 bytes (a RuntimeError: experts.py falls back)
  TORCH_CHECK(Na % 16 == 0 && Nb % 16 == 0 && aligned16(a.data_ptr()) && aligned16(b.data_ptr()) &&
                  aligned16(scale_a.data_ptr()) && aligned16(scale_b.data_ptr()),
              "fp8a2a: wgrad_fp8_per_expert: cuBLASLt's FP8 GEMM needs both operands' rows in multiples of 16 and ",
              "16-byte aligned tensors, got ", Na, " and ", Nb, " rows");
  auto out = at::empty({E, Na, Nb}, a.options().dtype(out_dtype));
#if CUDA_VERSION >= 12090
  // out[e] (row-major [Na, Nb]) is D = op(A) B, m = Nb, n = Na, k = the expert's tokens, with A = b's
  // rows (k x m, ld M, transposed) and B = a's rows (k x n, ld M). Each scale holds one float per 128
  // tokens and row, rows fastest. The cached algorithm's k is an expert's padded width, so a run
  // holds at most one entry per 128 rows of its largest expert.
  const cudaDataType_t out_type = cuda_type(out_dtype);
  LtGemm g("wgrad_fp8_per_expert", CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, /*fast_accum=*/false);
  g.layouts(kBlock, Nb, M, Na, M, out_type);
  const auto* pa = static_cast<const uint8_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint8_t*>(b.data_ptr());
  const float* psa = scale_a.data_ptr<float>();
  const float* psb = scale_b.data_ptr<float>();
  auto* pout = static_cast<uint8_t*>(out.data_ptr());
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const uint64_t k = static_cast<uint64_t>(widths[e]);
    void* d = pout + e * Na * Nb * out.element_size();
    if (k == 0) {
      C10_CUDA_CHECK(cudaMemsetAsync(d, 0, Na * Nb * out.element_size(), g.stream));
      continue;
    }
    for (auto* l : {g.la.h, g.lb.h}) g.set_layout(l, CUBLASLT_MATRIX_LAYOUT_ROWS, k);
    g.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(psb + start / kBlock * Nb));
    g.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(psa + start / kBlock * Na));
    g.run(AlgoKey{kWgrad, a.get_device(), Nb, Na, static_cast<int64_t>(k), static_cast<int>(out_type)},
          [&] { return g.heuristic(); }, pb + start, pa + start, d);
    start += static_cast<int64_t>(k);
  }
  return out;
#else
  TORCH_CHECK(false, "fp8a2a: wgrad_fp8_per_expert needs cuBLAS 12.9+ (1 x 128 block scales); this build has CUDA ",
              CUDA_VERSION);
  return out;
#endif
}

}  // namespace fp8a2a
