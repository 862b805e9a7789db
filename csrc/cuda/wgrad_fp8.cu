// The FP8 weight gradient's GEMMs: one cuBLASLt matmul per expert with 1 x 128 scales on both
// operands, all launched from one host call. torch._scaled_mm builds its descriptors and asks
// cuBLASLt's heuristic on every call, a host cost per expert that the backward waits on (the step is
// host-bound there); here the descriptors are built once per call and the algorithm is found once
// per (device, shape and expert width, out dtype) and reused, with the settings torch uses (its
// handle, workspace, no fast accumulation). Built with a toolkit older than CUDA 12.9 (no 1 x 128
// scale mode in its headers) the op refuses, and experts.py runs the Triton grouped GEMM.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda.h>

#include <cstdint>

#include <map>
#include <mutex>
#include <tuple>

#include "../ops.h"

namespace fp8a2a {
namespace {

void check_lt(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "fp8a2a: wgrad_fp8_per_expert: ", what, " failed: ",
              cublasLtGetStatusString(status));
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

template <typename V>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  check_lt(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), "cublasLtMatmulDescSetAttribute");
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

// (device, m, n, k, out type) -> the heuristic's algorithm; k is an expert's padded width, so a run
// holds at most one entry per 128 rows of its largest expert. The leading dimension (every call's
// token columns) is left out: cuBLASLt refuses an algorithm that does not fit, and then the
// heuristic is asked for that exact problem and its answer kept.
using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int>;
std::mutex algo_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> algo_cache;

}  // namespace

Tensor wgrad_fp8_per_expert_cuda(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                 at::IntArrayRef widths, at::ScalarType out_dtype) {
  const int64_t total = check_wgrad_fp8_per_expert(a, scale_a, b, scale_b, widths, out_dtype);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t E = static_cast<int64_t>(widths.size()), Na = a.size(0), Nb = b.size(0), M = a.size(1);
  if (total == 0 || Na == 0 || Nb == 0) return at::zeros({E, Na, Nb}, a.options().dtype(out_dtype));  // no GEMM
  // cuBLASLt's FP8 GEMMs: dimensions and addresses in 16 bytes (a RuntimeError: experts.py falls back)
  auto aligned = [](const Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; };
  TORCH_CHECK(Na % 16 == 0 && Nb % 16 == 0 && aligned(a) && aligned(b) && aligned(scale_a) && aligned(scale_b),
              "fp8a2a: wgrad_fp8_per_expert: cuBLASLt's FP8 GEMM needs both operands' rows in multiples of 16 and ",
              "16-byte aligned tensors, got ", Na, " and ", Nb, " rows");
  auto out = at::empty({E, Na, Nb}, a.options().dtype(out_dtype));
#if CUDA_VERSION >= 12090
  // cuBLAS is column-major: out[e] (row-major [Na, Nb]) is D = op(A) B, m = Nb, n = Na, k = the
  // expert's tokens, with A = b's rows (k x m, ld M, transposed) and B = a's rows (k x n, ld M): the
  // "TN" layout FP8 needs. Each scale holds one float per 128 tokens and row, rows fastest.
  const cudaDataType_t out_type = cuda_type(out_dtype);
  MatmulDesc desc;
  check_lt(cublasLtMatmulDescCreate(&desc.h, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set_attr(desc.h, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(desc.h, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  const int32_t vec128 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  set_attr(desc.h, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, vec128);
  set_attr(desc.h, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, vec128);
  set_attr(desc.h, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(0));
  Layout la, lb, lc;
  check_lt(cublasLtMatrixLayoutCreate(&la.h, CUDA_R_8F_E4M3, kBlock, Nb, M), "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&lb.h, CUDA_R_8F_E4M3, kBlock, Na, M), "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&lc.h, out_type, Nb, Na, Nb), "cublasLtMatrixLayoutCreate");
  Preference pref;
  check_lt(cublasLtMatmulPreferenceCreate(&pref.h), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = at::cuda::getCUDABlasLtWorkspace();
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                sizeof(ws_size)),
           "cublasLtMatmulPreferenceSetAttribute");
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float alpha = 1.0f, beta = 0.0f;
  auto heuristic = [&](uint64_t k) {
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.h, la.h, lb.h, lc.h, lc.h, pref.h, 1, &result, &found),
             "cublasLtMatmulAlgoGetHeuristic");
    TORCH_CHECK(found > 0, "fp8a2a: wgrad_fp8_per_expert: cuBLASLt has no algorithm for 1 x 128 scaled FP8 at m=",
                Nb, " n=", Na, " k=", k);
    return result.algo;
  };
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
      C10_CUDA_CHECK(cudaMemsetAsync(d, 0, Na * Nb * out.element_size(), stream));
      continue;
    }
    for (auto* l : {la.h, lb.h})
      check_lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &k, sizeof(k)),
               "cublasLtMatrixLayoutSetAttribute");
    set_attr(desc.h, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(psb + start / kBlock * Nb));
    set_attr(desc.h, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(psa + start / kBlock * Na));
    const AlgoKey key{a.get_device(), Nb, Na, static_cast<int64_t>(k), static_cast<int>(out_type)};
    cublasLtMatmulAlgo_t algo;
    {
      std::lock_guard<std::mutex> lock(algo_mutex);
      auto it = algo_cache.find(key);
      algo = it != algo_cache.end() ? it->second : (algo_cache[key] = heuristic(k));
    }
    auto matmul = [&] {
      return cublasLtMatmul(handle, desc.h, &alpha, pb + start, la.h, pa + start, lb.h, &beta, d, lc.h, d, lc.h, &algo,
                            ws, ws_size, stream);
    };
    cublasStatus_t status = matmul();
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
      algo = heuristic(k);  // the cached algorithm does not fit this leading dimension: this one's
      status = matmul();
      if (status == CUBLAS_STATUS_SUCCESS) {
        std::lock_guard<std::mutex> lock(algo_mutex);
        algo_cache[key] = algo;
      }
    }
    check_lt(status, "cublasLtMatmul");
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
