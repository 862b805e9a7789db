// capacity_drop: per expert, keep the `capacity` slots with the largest router weight (kernels and
// host entry point).
#include <cub/block/block_radix_sort.cuh>

#include "common.cuh"

namespace fp8a2a {

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

}  // namespace fp8a2a
