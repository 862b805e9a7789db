// routing_map_to_topk: Megatron's dense routing ([T, E] bool map and probs) as the top-k slots the
// dispatch takes, one thread per token (kernel and host entry point).
#include "common.cuh"

namespace fp8a2a {
namespace {

constexpr int kRoutingThreads = 256;

// Token t's routed experts in ascending order into its k slots (the first k where more are routed),
// with their probs; the slots past them -1 and 0. drop_zero: an expert whose prob is 0 is not routed
// (the capacity factor's padding).
template <typename P>
__global__ void routing_map_to_topk_kernel(const bool* __restrict__ map, const P* __restrict__ probs, int64_t T,
                                           int64_t E, int k, bool drop_zero, int64_t* __restrict__ idx,
                                           P* __restrict__ w) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const bool* m = map + t * E;
  const P* p = probs + t * E;
  int64_t* out_idx = idx + t * k;
  P* out_w = w + t * k;
  int j = 0;
  for (int64_t e = 0; e < E && j < k; ++e) {
    if (!m[e]) continue;
    const P v = p[e];
    if (drop_zero && static_cast<double>(v) == 0.0) continue;
    out_idx[j] = e;
    out_w[j] = v;
    ++j;
  }
  for (; j < k; ++j) {
    out_idx[j] = -1;
    out_w[j] = P(0);
  }
}

}  // namespace

std::tuple<Tensor, Tensor> routing_map_to_topk_cuda(const Tensor& routing_map, const Tensor& probs, int64_t topk,
                                                    bool drop_zero) {
  const int64_t k = check_routing_map_to_topk(routing_map, probs, topk);
  const c10::cuda::CUDAGuard guard(routing_map.device());
  const int64_t T = routing_map.size(0), E = routing_map.size(1);
  auto idx = at::empty({T, k}, routing_map.options().dtype(at::kLong));
  auto w = at::empty({T, k}, probs.options());
  if (T == 0) return {idx, w};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto blocks = static_cast<unsigned>((T + kRoutingThreads - 1) / kRoutingThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, probs.scalar_type(), "routing_map_to_topk", [&] {
    routing_map_to_topk_kernel<scalar_t><<<blocks, kRoutingThreads, 0, stream>>>(
        routing_map.data_ptr<bool>(), probs.data_ptr<scalar_t>(), T, E, static_cast<int>(k), drop_zero,
        idx.data_ptr<int64_t>(), w.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {idx, w};
}

}  // namespace fp8a2a
