// CPU implementations of every op. They define the semantics (the CUDA kernels must give the
// same bytes) and let the whole system run on machines without a GPU.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../ops.h"

namespace fp8a2a {
namespace {

template <typename T>
float amax_of(const T* p, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = amax_step(m, static_cast<float>(p[i]));
  return m;
}

// Quantizes one row into `out` (H bytes) and `scales` (num_scales floats).
template <typename T>
void quantize_row(const T* x, int64_t hidden, int64_t granularity, float tensor_q, float tensor_s, uint8_t* out,
                  float* scales) {
  if (granularity == kTensor) {  // a row holding NaN or Inf: NaN throughout (amax_finite)
    const bool finite = amax_finite(amax_of(x, hidden));
    for (int64_t h = 0; h < hidden; ++h)
      out[h] = finite ? e4m3_from_f32(static_cast<float>(x[h]) * tensor_q) : kE4M3NaN;
    scales[0] = tensor_s;
    return;
  }
  if (hidden == 0) {  // an empty row: amax 0, so scale 1 (row); block128 has no blocks
    if (granularity == kRow) scales[0] = dequant_scale(0.0f);
    return;
  }
  const int64_t span = granularity == kRow ? hidden : kBlock;
  for (int64_t b = 0, j = 0; b < hidden; b += span, ++j) {
    const float amax = amax_of(x + b, span);
    const float q = quant_multiplier(amax);
    for (int64_t h = b; h < b + span; ++h) out[h] = e4m3_from_f32(static_cast<float>(x[h]) * q);
    scales[j] = dequant_scale(amax);
  }
}

// (q, s) of a tensor scale: [s, q] as given, or s alone, q = 1 / s (IEEE division).
std::pair<float, float> tensor_scales(int64_t granularity, const std::optional<Tensor>& scale) {
  if (granularity != kTensor) return {0.0f, 0.0f};
  const Tensor sq = scale->to(at::kCPU).reshape({-1});
  const float s = sq[0].item<float>();
  return {sq.numel() == 2 ? sq[1].item<float>() : 1.0f / s, s};
}

template <typename T>
void accumulate_row(float* acc, const uint8_t* row, int64_t hidden, float w) {
  const T* p = reinterpret_cast<const T*>(row);
  for (int64_t h = 0; h < hidden; ++h) acc[h] += w * static_cast<float>(p[h]);
}

void accumulate_fp8_row(float* acc, const uint8_t* row, int64_t hidden, float scale, float w) {
  for (int64_t h = 0; h < hidden; ++h) acc[h] += w * (f32_from_e4m3(row[h]) * scale);
}

}  // namespace

std::tuple<Tensor, Tensor> quantize_cpu(const Tensor& x, int64_t granularity, const std::optional<Tensor>& scale) {
  check_quantize(x, granularity, scale);
  const int64_t T = x.size(0), H = x.size(1);
  std::optional<Tensor> s = scale;
  float tq = 0.0f, ts = 0.0f;
  if (granularity == kTensor) {
    if (!s.has_value()) {  // one scale for the tensor from its own amax, by the scale rule (as row's)
      float m = 0.0f;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fp8a2a_amax",
                                      [&] { m = amax_of(x.data_ptr<scalar_t>(), x.numel()); });
      tq = quant_multiplier(m);
      ts = dequant_scale(m);
      s = at::full({}, ts, x.options().dtype(at::kFloat));
    } else {
      std::tie(tq, ts) = tensor_scales(granularity, s);
    }
  }
  auto data = at::empty({T, H}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scales = granularity == kTensor ? s->reshape({}).clone()
                                       : at::empty(scale_shape(T, H, granularity), x.options().dtype(at::kFloat));
  const int64_t ns = granularity == kBlock128 ? H / kBlock : (granularity == kRow ? 1 : 0);
  std::vector<float> dummy(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fp8a2a_quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    auto* out = reinterpret_cast<uint8_t*>(data.data_ptr());
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
      float tensor_slot;
      for (int64_t t = lo; t < hi; ++t)
        quantize_row(xp + t * H, H, granularity, tq, ts, out + t * H, ns ? sp + t * ns : &tensor_slot);
    });
  });
  return {data, scales};
}

Tensor dequantize_cpu(const Tensor& data, const Tensor& scale, at::ScalarType dtype) {
  const int64_t per_scale = check_dequantize(data, scale, dtype);
  const int64_t T = data.size(0), H = data.size(1);
  const int64_t span = per_scale ? per_scale : std::max<int64_t>(T * H, 1);  // elements per scale
  auto out = at::empty({T, H}, data.options().dtype(dtype));
  const auto* in = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const float* sp = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fp8a2a_dequantize", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T * H, 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) op[i] = static_cast<scalar_t>(f32_from_e4m3(in[i]) * sp[i / span]);
    });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> dispatch_pack_cpu(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                                                     int64_t num_experts, int64_t num_ranks, int64_t granularity,
                                                     const std::optional<Tensor>& tensor_scale, int64_t rank_capacity,
                                                     bool needs_grad) {
  const int64_t dtype = act_dtype_code(x_in);
  const Tensor x = check_dispatch_pack(x_in, topk_idx, topk_weights, num_experts, num_ranks, granularity, tensor_scale,
                                       rank_capacity);
  const int64_t T = x.size(0), H = x.size(1), K = topk_idx.size(1), R = num_ranks, El = num_experts / num_ranks;
  const DispatchRow L(H, granularity, K);
  const auto idx = topk_idx.to(at::kLong);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = topk_weights.data_ptr<float>();

  auto counts = at::zeros({R, kColExperts + El}, x.options().dtype(at::kLong));
  auto send_pos = at::full({T, R}, -1, x.options().dtype(at::kInt));
  auto slot_pos = std::vector<int32_t>(T * K, -1);  // index within (rank, local expert)
  int64_t* cp = counts.data_ptr<int64_t>();
  int32_t* spos = send_pos.data_ptr<int32_t>();
  int64_t bad = 0;
  // Layout pass: tokens in order, so rows for a rank are in token order (the CUDA kernel matches).
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k];
      if (e < 0 || e >= num_experts) {
        bad += (e != -1);
        continue;
      }
      const int64_t r = e / El;
      slot_pos[t * K + k] = static_cast<int32_t>(cp[r * (kColExperts + El) + kColExperts + e % El]++);
      if (spos[t * R + r] < 0) spos[t * R + r] = static_cast<int32_t>(cp[r * (kColExperts + El) + kColRows]++);
    }
  }
  std::vector<int64_t> rank_off(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    int64_t* row = cp + r * (kColExperts + El);
    row[kColHidden] = H;
    row[kColTopk] = K;
    row[kColBadIds] = bad;
    row[kColWire] = granularity;
    row[kColDtype] = dtype;
    row[kColGrad] = needs_grad ? 1 : 0;
    // Capacity mode: fixed segments of rank_capacity rows (static all_to_all splits).
    TORCH_CHECK(rank_capacity == 0 || row[kColRows] <= rank_capacity, "fp8a2a: ", row[kColRows],
                " rows for rank ", r, " exceed its capacity of ", rank_capacity, " (drop to capacity first)");
    rank_off[r + 1] = rank_capacity ? (r + 1) * rank_capacity : rank_off[r] + row[kColRows];
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < R; ++r)
      if (spos[t * R + r] >= 0) spos[t * R + r] += static_cast<int32_t>(rank_off[r]);

  auto send = at::empty({send_buffer_rows(T, K, R, rank_capacity), L.bytes}, x.options().dtype(at::kByte));
  uint8_t* sb = send.data_ptr<uint8_t>();
  const auto [tq, ts] = tensor_scales(granularity, tensor_scale);
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kByte, x.scalar_type(), "fp8a2a_dispatch_pack", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> row(L.bytes);
      for (int64_t t = lo; t < hi; ++t) {
        bool any = false;
        for (int64_t r = 0; r < R; ++r) any |= spos[t * R + r] >= 0;
        if (!any) continue;
        std::fill(row.begin(), row.end(), 0);
        // Each token is read and quantized once, then written once per destination rank.
        if (granularity == kRaw)
          std::memcpy(row.data(), xp + t * H, H);
        else
          quantize_row(xp + t * H, H, granularity, tq, ts, row.data(), reinterpret_cast<float*>(row.data() + L.scale_off));
        for (int64_t r = 0; r < R; ++r) {
          const int32_t s = spos[t * R + r];
          if (s < 0) continue;
          auto* w = reinterpret_cast<float*>(row.data() + L.weight_off);
          auto* ex = reinterpret_cast<int32_t*>(row.data() + L.expert_off);
          auto* ps = reinterpret_cast<int32_t*>(row.data() + L.pos_off);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ip[t * K + k];
            const bool mine = e >= 0 && e < num_experts && e / El == r;
            w[k] = mine ? wp[t * K + k] : 0.0f;
            ex[k] = mine ? static_cast<int32_t>(e % El) : -1;
            ps[k] = mine ? slot_pos[t * K + k] : -1;
          }
          std::memcpy(sb + s * L.bytes, row.data(), L.bytes);
        }
      }
    });
  });
  return {send, counts, send_pos};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dispatch_unpack_cpu(const Tensor& recv, const Tensor& recv_counts,
                                                                               int64_t hidden, int64_t granularity,
                                                                               int64_t topk, int64_t num_rows,
                                                                               int64_t rank_capacity,
                                                                               int64_t expert_capacity) {
  const DispatchRow L =
      check_unpack(recv, recv_counts, hidden, granularity, topk, num_rows, rank_capacity, expert_capacity);
  const auto counts = recv_counts.contiguous();
  const int64_t R = counts.size(0), C = counts.size(1), El = C - kColExperts, Nr = recv.size(0), H = hidden;
  const int64_t* cp = counts.data_ptr<int64_t>();
  const bool capacity = expert_capacity > 0;
  // Counts come from other ranks: bound them before they index recv and the outputs (the CUDA
  // kernel skips out-of-range rows instead, as checking there would need a host sync), each by
  // the buffer or the output, so that their sums cannot overflow either.
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = kColRows; c < C; ++c) {
      const int64_t v = cp[r * C + c];
      TORCH_CHECK(v >= 0 && (c != kColRows || !capacity || v <= rank_capacity), "fp8a2a: recv_counts[", r, ", ", c,
                  "] = ", v, " is out of range", c == kColRows && capacity ? " (over rank_capacity)" : "");
      if (capacity) continue;  // fixed slots; otherwise no count can exceed the totals checked below
      TORCH_CHECK(c != kColRows || v <= Nr, "fp8a2a: counts announce ", v, " rows but ", Nr,
                  " were received (from rank ", r, " alone)");
      TORCH_CHECK(c == kColRows || v <= num_rows, "fp8a2a: counts announce ", v, " expert rows but num_rows is ",
                  num_rows, " (from rank ", r, " alone)");
    }
  // Expert-major destination of (source rank r, local expert e): rows of expert e, source ranks in order.
  std::vector<int64_t> base(R * El), row_start(R + 1, 0);
  auto tpe = at::zeros({El}, recv.options().dtype(at::kLong));
  int64_t* tp = tpe.data_ptr<int64_t>();
  for (int64_t e = 0, off = 0; e < El; ++e) {
    for (int64_t r = 0; r < R; ++r) {
      // Capacity mode: expert e owns rows [e * R * C, (e + 1) * R * C), source r a slice of C.
      base[r * El + e] = capacity ? (e * R + r) * expert_capacity : off;
      off += cp[r * C + kColExperts + e];
      tp[e] += cp[r * C + kColExperts + e];
    }
  }
  for (int64_t r = 0; r < R; ++r) row_start[r + 1] = row_start[r] + cp[r * C + kColRows];
  int64_t total = 0;
  for (int64_t e = 0; e < El; ++e) total += tp[e];
  if (!capacity) {
    TORCH_CHECK(row_start[R] == Nr, "fp8a2a: counts announce ", row_start[R], " rows but ", Nr, " were received");
    TORCH_CHECK(total == num_rows, "fp8a2a: counts announce ", total, " expert rows but num_rows is ", num_rows);
  }

  // Padding rows of capacity mode stay zero (scale 0: they dequantize to 0, weight 0, no source).
  auto alloc = [&](at::IntArrayRef shape, at::ScalarType t) {
    return capacity ? at::zeros(shape, recv.options().dtype(t)) : at::empty(shape, recv.options().dtype(t));
  };
  auto data = alloc({num_rows, H}, granularity == kRaw ? at::kByte : at::kFloat8_e4m3fn);
  auto scale = alloc(granularity == kTensor ? std::vector<int64_t>{num_rows} : scale_shape(num_rows, H, granularity),
                     at::kFloat);
  auto weights = alloc({num_rows}, at::kFloat);
  auto slot_pos = at::full({Nr, topk}, -1, recv.options().dtype(at::kInt));
  auto row_src = capacity ? at::full({num_rows}, -1, recv.options().dtype(at::kInt))
                          : at::empty({num_rows}, recv.options().dtype(at::kInt));
  const uint8_t* rb = recv.data_ptr<uint8_t>();
  auto* dp = reinterpret_cast<uint8_t*>(data.data_ptr());
  float* sp = scale.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int32_t* pp = slot_pos.data_ptr<int32_t>();
  int32_t* rs = row_src.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t first = capacity ? r * rank_capacity : row_start[r];
    for (int64_t i = first; i < first + cp[r * C + kColRows]; ++i) {
      const uint8_t* row = rb + i * L.bytes;
      const auto* w = reinterpret_cast<const float*>(row + L.weight_off);
      const auto* ex = reinterpret_cast<const int32_t*>(row + L.expert_off);
      const auto* ps = reinterpret_cast<const int32_t*>(row + L.pos_off);
      for (int64_t k = 0; k < topk; ++k) {
        if (ex[k] < 0) continue;
        TORCH_CHECK(ex[k] < El && ps[k] >= 0 && ps[k] < cp[r * C + kColExperts + ex[k]] &&
                        (!capacity || ps[k] < expert_capacity),
                    "fp8a2a: corrupt dispatch row ", i, " from rank ", r, " (expert ", ex[k], ", position ", ps[k], ")");
        const int64_t n = base[r * El + ex[k]] + ps[k];
        std::memcpy(dp + n * H, row, H);
        std::memcpy(sp + n * L.num_scales, row + L.scale_off, 4 * L.num_scales);
        wp[n] = w[k];
        rs[n] = static_cast<int32_t>(i);
        pp[i * topk + k] = static_cast<int32_t>(n);
      }
    }
  }
  // Tensor granularity keeps one scale per row on the wire too, so the result is uniform;
  // callers that want the single scale take scale[0].
  return {data, scale, weights, tpe, slot_pos, row_src};
}

Tensor combine_pack_cpu(const Tensor& expert_out, const Tensor& slot_pos, const std::optional<Tensor>& weights,
                        const std::optional<Tensor>& extra, bool quantize, std::optional<at::ScalarType> dtype) {
  const auto checked = check_combine_pack(expert_out, slot_pos, weights, extra, quantize, dtype);
  const CombineRow L = checked.first;
  const int64_t N = expert_out.size(0), H = expert_out.size(1), Nr = slot_pos.size(0), K = slot_pos.size(1);
  auto buf = at::zeros({Nr, L.bytes}, expert_out.options().dtype(at::kByte));
  const int32_t* pp = slot_pos.data_ptr<int32_t>();
  const float* wp = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  const float* xp = extra.has_value() ? extra->data_ptr<float>() : nullptr;
  uint8_t* bp = buf.data_ptr<uint8_t>();
  // expert_out's own dtype in (in_t), the wire row's out (out_t; a quantized row is e4m3 whatever it)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, expert_out.scalar_type(), "fp8a2a_combine_pack", [&] {
    using in_t = scalar_t;
    const in_t* ep = expert_out.data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, checked.second, "fp8a2a_combine_pack", [&] {
      using out_t = scalar_t;
      at::parallel_for(0, Nr, 8, [&](int64_t lo, int64_t hi) {
        std::vector<float> acc(H);
        for (int64_t i = lo; i < hi; ++i) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          uint8_t* row = bp + i * L.bytes;
          for (int64_t k = 0; k < K; ++k) {
            const int32_t n = pp[i * K + k];
            if (n < 0) continue;
            TORCH_CHECK(n < N, "fp8a2a: slot_pos entry ", n, " out of range for ", N, " expert rows");
            const float w = wp ? wp[n] : 1.0f;
            for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(ep[n * H + h]);
            if (xp) reinterpret_cast<float*>(row + L.extra_off)[k] = xp[n];
          }
          if (quantize) {
            quantize_row(acc.data(), H, kRow, 0.0f, 0.0f, row, reinterpret_cast<float*>(row + L.scale_off));
          } else {
            auto* out = reinterpret_cast<out_t*>(row);
            for (int64_t h = 0; h < H; ++h) out[h] = static_cast<out_t>(acc[h]);
          }
        }
      });
    });
  });
  return buf;
}

std::tuple<Tensor, Tensor> combine_unpack_cpu(const Tensor& buf, const Tensor& send_pos, int64_t hidden,
                                              at::ScalarType dtype, bool quantized, int64_t extra_k) {
  const CombineRow L = check_combine_buffer(buf, send_pos, hidden, dtype, quantized, extra_k);
  const int64_t T = send_pos.size(0), R = send_pos.size(1), H = hidden;
  auto y = at::empty({T, H}, buf.options().dtype(dtype));
  auto extra = at::zeros({T, extra_k}, buf.options().dtype(at::kFloat));
  const int32_t* sp = send_pos.data_ptr<int32_t>();
  const uint8_t* bp = buf.data_ptr<uint8_t>();
  float* xp = extra.data_ptr<float>();
  const int64_t rows = buf.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fp8a2a_combine_unpack", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(H);
      for (int64_t t = lo; t < hi; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t r = 0; r < R; ++r) {
          const int32_t s = sp[t * R + r];
          if (s < 0) continue;
          TORCH_CHECK(s < rows, "fp8a2a: send_pos entry ", s, " out of range for ", rows, " rows");
          const uint8_t* row = bp + s * L.bytes;
          if (quantized)
            accumulate_fp8_row(acc.data(), row, H, *reinterpret_cast<const float*>(row + L.scale_off), 1.0f);
          else
            accumulate_row<scalar_t>(acc.data(), row, H, 1.0f);
          for (int64_t k = 0; k < extra_k; ++k) xp[t * extra_k + k] += reinterpret_cast<const float*>(row + L.extra_off)[k];
        }
        for (int64_t h = 0; h < H; ++h) yp[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return {y, extra};
}

std::tuple<Tensor, Tensor> capacity_drop_cpu(const Tensor& topk_idx, const Tensor& topk_weights, int64_t num_experts,
                                             int64_t capacity) {
  check_capacity_drop(topk_idx, topk_weights, num_experts, capacity);
  auto out = topk_idx.clone();
  const int64_t n = topk_idx.numel();
  const float* w = topk_weights.data_ptr<float>();
  int64_t dropped = 0;
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "capacity_drop", [&] {
    index_t* idx = out.data_ptr<index_t>();
    // (expert, weight key, slot) of every routed slot, sorted: each expert's first `capacity` stay.
    std::vector<std::tuple<int64_t, uint32_t, int64_t>> order;
    for (int64_t s = 0; s < n; ++s)
      if (idx[s] >= 0 && idx[s] < num_experts) order.emplace_back(idx[s], weight_desc_key(f32_bits(w[s])), s);
    std::sort(order.begin(), order.end());
    for (size_t i = 0; i < order.size(); ++i) {
      const int64_t e = std::get<0>(order[i]);
      if (i >= static_cast<size_t>(capacity) && std::get<0>(order[i - capacity]) == e) {
        idx[std::get<2>(order[i])] = -1;
        ++dropped;
      }
    }
  });
  return {out, at::scalar_tensor(dropped, topk_idx.options().dtype(at::kLong))};
}


namespace {

// One row of combine_backward_rows. D: the rows' element type (uint8_t: e4m3 bytes, scaled by s),
// T: the gradient's and expert_out's.
template <typename D, typename T>
void combine_backward_row(const D* dy, float s, const float* w, const T* eo, int64_t H, T* grad, float* grad_w) {
  constexpr bool fp8 = std::is_same<D, uint8_t>::value;
  auto value = [&](int64_t h) {
    if constexpr (fp8) return f32_from_e4m3(dy[h]);
    else return static_cast<float>(dy[h]);
  };
  // the gradient: e4m3 * (scale * weight) (what dequantize(data, scale * w) gives), raw * weight
  const float m = fp8 ? (w ? s * *w : s) : (w ? *w : 1.0f);
  const bool scaled = fp8 || w;
  for (int64_t h = 0; h < H; ++h) grad[h] = static_cast<T>(scaled ? value(h) * m : value(h));
  if (!eo) return;
  // the dot product in fp8_common.h's order (kDotUnit, sum16_pairwise, kDotLanes)
  float lane[kDotLanes] = {};
  for (int64_t u = 0; u * kDotUnit < H; ++u) {
    float p[kDotUnit];
    for (int e = 0; e < kDotUnit; ++e) {
      const int64_t h = u * kDotUnit + e;
      p[e] = h < H ? value(h) * static_cast<float>(eo[h]) : 0.0f;
    }
    lane[u % kDotLanes] = add_rn(lane[u % kDotLanes], sum16_pairwise(p));
  }
  for (int o = kDotLanes / 2; o > 0; o >>= 1)
    for (int l = 0; l < o; ++l) lane[l] = add_rn(lane[l], lane[l + o]);
  *grad_w = fp8 ? lane[0] * s : lane[0];
}

}  // namespace

std::tuple<Tensor, Tensor> combine_backward_rows_cpu(const Tensor& data, const std::optional<Tensor>& scale,
                                                     const std::optional<Tensor>& weights,
                                                     const std::optional<Tensor>& expert_out, at::ScalarType dtype) {
  const bool fp8 = check_combine_backward_rows(data, scale, weights, expert_out, dtype);
  const int64_t N = data.size(0), H = data.size(1);
  auto grad = at::empty({N, H}, data.options().dtype(dtype));
  auto grad_w = at::empty({expert_out.has_value() ? N : 0}, data.options().dtype(at::kFloat));
  const float* sp = fp8 ? scale->data_ptr<float>() : nullptr;
  const float* wp = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  float* gwp = grad_w.data_ptr<float>();
  // e4m3 rows as their bytes (uint8_t), raw rows in their own type
  const at::ScalarType rows = fp8 ? at::kByte : data.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kByte, rows, "fp8a2a_combine_backward_rows", [&] {
    using d_t = scalar_t;
    const auto* dp = reinterpret_cast<const d_t*>(data.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fp8a2a_combine_backward_rows", [&] {
      const scalar_t* ep = expert_out.has_value() ? expert_out->data_ptr<scalar_t>() : nullptr;
      scalar_t* gp = grad.data_ptr<scalar_t>();
      at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t n = lo; n < hi; ++n)
          combine_backward_row<d_t, scalar_t>(dp + n * H, fp8 ? sp[n] : 1.0f, wp ? wp + n : nullptr,
                                              ep ? ep + n * H : nullptr, H, gp + n * H, gwp + n);
      });
    });
  });
  return {grad, grad_w};
}


// Each token's routed experts in ascending order in its first slots (the first `k` where more are
// routed), with their probs; the slots past them -1 and 0. drop_zero: an expert whose prob is 0 is
// not routed.
std::tuple<Tensor, Tensor> routing_map_to_topk_cpu(const Tensor& routing_map, const Tensor& probs, int64_t topk,
                                                   bool drop_zero) {
  const int64_t k = check_routing_map_to_topk(routing_map, probs, topk);
  const int64_t T = routing_map.size(0), E = routing_map.size(1);
  auto idx = at::empty({T, k}, routing_map.options().dtype(at::kLong));
  auto w = at::empty({T, k}, probs.options());
  const bool* map = routing_map.data_ptr<bool>();
  int64_t* pidx = idx.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, probs.scalar_type(), "routing_map_to_topk", [&] {
    const scalar_t* p = probs.data_ptr<scalar_t>();
    scalar_t* pw = w.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      int64_t j = 0;
      for (int64_t e = 0; e < E && j < k; ++e) {
        const scalar_t v = p[t * E + e];
        if (!map[t * E + e] || (drop_zero && static_cast<double>(v) == 0.0)) continue;
        pidx[t * k + j] = e;
        pw[t * k + j] = v;
        ++j;
      }
      for (; j < k; ++j) {
        pidx[t * k + j] = -1;
        pw[t * k + j] = scalar_t(0);
      }
    }
  });
  return {idx, w};
}

// The semantics of the row-scaled per-expert GEMMs: each operand dequantized (a's rows times their
// scale, b[e]'s rows times theirs), one float32 matmul per expert, rounded to bfloat16 once (the
// product fp8a2a/experts.py's reference backend computes). cuBLAS's accumulation order differs, so
// the CUDA op matches this one to a tolerance, not to the byte.
Tensor mm_fp8_per_expert_cpu(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                             at::IntArrayRef counts, bool /*fast_accum: cuBLAS's, no effect here*/) {
  check_mm_fp8_per_expert(a, scale_a, b, scale_b, counts);
  auto out = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kBFloat16));
  int64_t start = 0;
  for (int64_t e = 0; e < b.size(0); ++e) {
    const int64_t n = counts[e];
    if (n > 0) {
      auto x = a.narrow(0, start, n).to(at::kFloat) * scale_a.narrow(0, start, n).unsqueeze(1);
      auto w = b[e].to(at::kFloat) * scale_b[e].unsqueeze(1);
      out.narrow(0, start, n).copy_(at::matmul(x, w.t()));
    }
    start += n;
  }
  return out;
}

// The semantics of the FP8 weight gradient's per-expert GEMMs: each operand dequantized (its e4m3
// values times the scale of their 128-column block), one float32 matmul per expert (the product
// fp8a2a/experts.py's _wgrad_fp8_reference emulates from its own quantization). cuBLAS's
// accumulation order differs, so the CUDA op matches this one to a tolerance, not to the byte.
Tensor wgrad_fp8_per_expert_cpu(const Tensor& a, const Tensor& scale_a, const Tensor& b, const Tensor& scale_b,
                                at::IntArrayRef widths, at::ScalarType out_dtype) {
  check_wgrad_fp8_per_expert(a, scale_a, b, scale_b, widths, out_dtype);
  const int64_t E = static_cast<int64_t>(widths.size());
  auto out = at::zeros({E, a.size(0), b.size(0)}, a.options().dtype(out_dtype));
  auto dequant = [](const Tensor& q, const Tensor& s, int64_t start, int64_t w) {
    const int64_t n = q.size(0), blocks = w / kBlock;
    auto per_col = s.narrow(0, start / kBlock, blocks).t().unsqueeze(2).expand({n, blocks, kBlock}).reshape({n, w});
    return q.narrow(1, start, w).to(at::kFloat) * per_col;
  };
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t w = widths[e];
    if (w > 0) out[e].copy_(at::matmul(dequant(a, scale_a, start, w), dequant(b, scale_b, start, w).t()));
    start += w;
  }
  return out;
}

}  // namespace fp8a2a
