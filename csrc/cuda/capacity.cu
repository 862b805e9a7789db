// capacity_drop: per expert, keep the `capacity` slots with the largest router weight (kernels and
// host entry point).
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace fp8a2a {

// =============================================================================================
// capacity_drop: an expert keeps its slots in (weight descending, slot) order up to the capacity.
// Up to 4096 slots one block sorts all slots by (expert, weight, slot): a slot at sorted position i
// is kept iff i < capacity or the slot at i - capacity has another expert. Above, only the experts
// over capacity can drop: their slots go to buckets, and a radix select per bucket finds the cut.
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

// More slots: each over-capacity expert's routed slots go to a bucket, where a radix select finds
// the capacity-th smallest key (weight key, then slot) without sorting; no other slot can drop.
constexpr int kBucketThreads = 256;
constexpr int kSelectThreads = 256;    // one histogram bin (8-bit digit) per thread
constexpr int kSelectSmemKeys = 4096;  // a bucket up to this size is selected in shared memory

// atomicAdd(counter, 1) for each calling lane, one atomic per distinct key in the warp (a skewed
// routing puts a whole warp on one expert); returns the lane's old value. `active`: the callers.
__device__ __forceinline__ int warp_atomic_inc(int* counter, int key, unsigned active) {
  const unsigned same = __match_any_sync(active, key);
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(same) - 1;
  int old = 0;
  if (lane == leader) old = atomicAdd(counter, __popc(same));
  return __shfl_sync(same, old, leader) + __popc(same & ((1u << lane) - 1u));
}

// Per-expert counts of routed slots. The last block to finish gives each over-capacity expert a
// bucket (its count becomes the bucket's fill cursor, -1 for the others), lists the buckets and
// writes the dropped total: an expert drops exactly its count minus the capacity.
template <typename IdxT>
__global__ void __launch_bounds__(kBucketThreads)
    capacity_drop_count_kernel(const IdxT* idx, int* counts, int* blocks_done, int* buckets, int* num_buckets,
                               int64_t* dropped, int64_t n, int E, int cap) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // whole warps step together (the warp atomics need every lane's id)
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s - (threadIdx.x & 31) < n;
       s += stride) {
    const int64_t e = s < n ? load_idx<IdxT>(idx + s) : -1;
    const bool routed = e >= 0 && e < E;
    const unsigned active = __ballot_sync(kFull, routed);
    if (routed) warp_atomic_inc(counts + e, static_cast<int>(e), active);
  }
  __shared__ bool s_last;
  __shared__ int s_fill, s_listed;
  __shared__ unsigned long long s_dropped;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: the fence and the ticket on one thread, after the block's atomics
    s_last = atomicAdd(blocks_done, 1) == static_cast<int>(gridDim.x) - 1;
    s_fill = 0;
    s_listed = 0;
    s_dropped = 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int count = __ldcg(counts + e);  // other blocks' atomics live in L2
    int cursor = -1;
    if (count > cap) {
      cursor = atomicAdd(&s_fill, count);  // bucket order is free: the select ranks by the full key
      const int b = atomicAdd(&s_listed, 1);
      buckets[2 * b] = cursor;
      buckets[2 * b + 1] = count;
      atomicAdd(&s_dropped, static_cast<unsigned long long>(count - cap));
    }
    counts[e] = cursor;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *num_buckets = s_listed;
    *dropped = static_cast<int64_t>(s_dropped);
  }
}

// Copies the ids to out and files each slot of an over-capacity expert into its bucket as
// weight key << slot_bits | slot: unique, and ascending in the CPU's keep order.
template <typename IdxT>
__global__ void __launch_bounds__(kBucketThreads)
    capacity_drop_scatter_kernel(const IdxT* idx, const float* w, IdxT* out, int* cursors,
                                 unsigned long long* bucket, int64_t n, int E, int slot_bits) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s - (threadIdx.x & 31) < n;
       s += stride) {
    int64_t e = -1;
    if (s < n) {
      const IdxT v = idx[s];
      out[s] = v;
      e = static_cast<int64_t>(v);
    }
    const bool filed = e >= 0 && e < E && __ldcg(cursors + e) >= 0;  // the sign never changes under the atomics
    const unsigned active = __ballot_sync(kFull, filed);
    if (filed) {
      const int pos = warp_atomic_inc(cursors + e, static_cast<int>(e), active);
      bucket[pos] = (static_cast<unsigned long long>(weight_desc_key(__float_as_uint(w[s]))) << slot_bits) |
                    static_cast<unsigned long long>(s);
    }
  }
}

// One block per bucket (grid-stride over the list): MSB-first radix select of the capacity-th
// smallest key, 8 bits a pass, stopping once every key left under the prefix is kept; the keys
// above it drop.
template <typename IdxT>
__global__ void __launch_bounds__(kSelectThreads)
    capacity_drop_select_kernel(const unsigned long long* bucket, const int* buckets, const int* num_buckets,
                                IdxT* out, int cap, int slot_bits, int key_bits) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ unsigned long long s_keys[kSelectSmemKeys];
  __shared__ int s_hist[256];
  __shared__ typename Scan::TempStorage s_scan;
  __shared__ unsigned long long s_prefix;
  __shared__ int s_rank, s_done;
  const unsigned long long slot_mask = (1ull << slot_bits) - 1;
  const int lane = threadIdx.x & 31;
  const int listed = *num_buckets;
  for (int b = blockIdx.x; b < listed; b += gridDim.x) {
    const int m = buckets[2 * b + 1];
    const unsigned long long* keys = bucket + buckets[2 * b];
    if (m <= kSelectSmemKeys) {
      for (int j = threadIdx.x; j < m; j += blockDim.x) s_keys[j] = keys[j];
      keys = s_keys;
    }
    unsigned long long prefix = 0, mask = 0;
    int rank = cap;  // keys still to keep among those under the prefix (1 <= rank <= their count)
    for (int shift = key_bits - 8;; shift -= 8) {
      s_hist[threadIdx.x] = 0;
      __syncthreads();
      for (int64_t j0 = threadIdx.x - lane; j0 < m; j0 += blockDim.x) {  // m may be near INT_MAX
        const int64_t j = j0 + lane;
        const unsigned long long k = j < m ? keys[j] : 0;
        const bool under = j < m && (k & mask) == prefix;
        const int digit = static_cast<int>((k >> shift) & 255);
        const unsigned active = __ballot_sync(kFull, under);
        if (under) warp_atomic_inc(s_hist + digit, digit, active);  // ties share a digit
      }
      __syncthreads();
      const int count = s_hist[threadIdx.x];
      int upto;
      Scan(s_scan).InclusiveSum(count, upto);
      const int below = upto - count;
      if (below < rank && rank <= upto) {  // the capacity-th key has this digit
        s_prefix = prefix | (static_cast<unsigned long long>(threadIdx.x) << shift);
        s_rank = rank - below;
        s_done = rank - below == count;  // the unique keys end here at the latest
      }
      __syncthreads();
      prefix = s_prefix;
      rank = s_rank;
      mask |= 255ull << shift;
      const bool done = s_done;
      __syncthreads();  // s_prefix and s_hist are rewritten next pass
      if (done) break;
    }
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
      const unsigned long long k = keys[j];
      if ((k & mask) > prefix) out[k & slot_mask] = static_cast<IdxT>(-1);
    }
    __syncthreads();  // s_keys is refilled for the next bucket
  }
}

std::tuple<Tensor, Tensor> capacity_drop_cuda(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                              int64_t capacity) {
  check_capacity_drop(topk_idx, topk_weights, num_experts, capacity);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t n = topk_idx.numel();
  // the bucket counts and cursors are int, and a key holds the slot in its low 32 bits
  TORCH_CHECK(n < INT_MAX, "fp8a2a: capacity_drop on CUDA supports fewer than 2^31 slots, got ", n);
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
  // The ids' counts and a done ticket (zeroed), the bucket list, and the buckets: sized by n and E.
  const int64_t max_buckets = std::max<int64_t>(1, std::min<int64_t>(E, n / (static_cast<int64_t>(cap) + 1)));
  auto work = at::empty({E + 2 + 2 * max_buckets}, topk_idx.options().dtype(at::kInt));
  int* counts = work.data_ptr<int>();
  int* blocks_done = counts + E;
  int* num_buckets = counts + E + 1;
  int* buckets = counts + E + 2;
  auto bucket = at::empty({n}, topk_idx.options().dtype(at::kLong));
  auto out = at::empty_like(topk_idx);
  auto dropped = at::empty({}, topk_idx.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(counts, 0, (E + 1) * sizeof(int), stream));
  const int sms = num_sms(topk_idx.get_device());
  const int blocks = static_cast<int>(std::clamp<int64_t>((n + kBucketThreads - 1) / kBucketThreads, 1, 8 * sms));
  const int select_blocks = static_cast<int>(std::min<int64_t>(max_buckets, 4 * sms));
  const int key_bits = (32 + slot_bits + 7) / 8 * 8;
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "capacity_drop", [&] {
    capacity_drop_count_kernel<index_t><<<blocks, kBucketThreads, 0, stream>>>(
        topk_idx.data_ptr<index_t>(), counts, blocks_done, buckets, num_buckets, dropped.data_ptr<int64_t>(), n, E,
        cap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto* keys = reinterpret_cast<unsigned long long*>(bucket.data_ptr<int64_t>());
    capacity_drop_scatter_kernel<index_t><<<blocks, kBucketThreads, 0, stream>>>(
        topk_idx.data_ptr<index_t>(), topk_weights.data_ptr<float>(), out.data_ptr<index_t>(), counts, keys, n, E,
        slot_bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    capacity_drop_select_kernel<index_t><<<select_blocks, kSelectThreads, 0, stream>>>(
        keys, buckets, num_buckets, out.data_ptr<index_t>(), cap, slot_bits, key_bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, dropped};
}

}  // namespace fp8a2a
