// Shared by the CPU and CUDA kernels: the e4m3 conversion, the scale rule and the wire format.
// Everything here is host+device so both backends produce identical bytes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP8A2A_HD __host__ __device__ __forceinline__
#else
#define FP8A2A_HD inline
#endif

namespace fp8a2a {

constexpr float kE4M3Max = 448.0f;
constexpr int kBlock = 128;  // block128 granularity

// kRaw sends the activation's own bytes unquantized (x passed as a uint8 [T, H * elem] view):
// the lossless path for small messages and for BF16 gradients in the dispatch direction.
enum Granularity : int64_t { kRow = 0, kBlock128 = 1, kTensor = 2, kRaw = 3 };

FP8A2A_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
FP8A2A_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// e4m3's NaN as fp8a2a writes it (sign bit clear): what e4m3_from_f32 gives for every NaN.
constexpr uint8_t kE4M3NaN = 0x7f;

// fp32 -> e4m3fn, round-to-nearest-even, saturating to +-448, NaN -> 0x7f.
// Same result as torch's own `.to(torch.float8_e4m3fn)` (which saturates in torch >= 2.13)
// on every input, including the values that torch < 2.13 turned into NaN.
FP8A2A_HD uint8_t e4m3_from_f32(float f) {
  uint32_t bits = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return kE4M3NaN;               // NaN (canonical, as torch's cast gives)
  if (bits >= 0x43e00000u) return sign | 0x7eu;          // >= 448 (inf too): saturate
  if (bits < (121u << 23)) {                             // below 2^-6: subnormal e4m3
    // Adding 2^-9 * 2^? aligns the mantissa so the FPU rounds to nearest even for us.
    const float denorm = bits_f32(141u << 23);
    return sign | static_cast<uint8_t>(f32_bits(bits_f32(bits) + denorm) - (141u << 23));
  }
  const uint32_t odd = (bits >> 20) & 1u;
  bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
  const uint8_t r = static_cast<uint8_t>(bits >> 20);
  return sign | (r > 0x7eu ? 0x7eu : r);                 // rounding up past 448 saturates
}

FP8A2A_HD float f32_from_e4m3(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu, man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_f32(sign | 0x7fc00000u);
  if (exp == 0) return (sign ? -1.0f : 1.0f) * static_cast<float>(man) * 0.001953125f;  // man * 2^-9
  return bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

// NaN-propagating |x| max (fmaxf would drop NaN and give a finite, wrong scale).
FP8A2A_HD float amax_step(float acc, float v) {
  const float a = fabsf(v);
  return (a != a || acc != acc) ? NAN : (a > acc ? a : acc);
}

// The scale rule, for an amax over a row or a block:
//   quant multiplier  q = 448 / amax          (IEEE division, = torch.div)
//   dequant scale     s = amax / 448          (what is stored and sent: x ~= e4m3 * s)
// An all-zero row has amax 0; it gets q = s = 1 so it stays zero and finite.
// A NaN row gives NaN; an Inf row gives q = 0, s = inf: it dequantizes to NaN, never finite.
// A nonzero amax below kAmaxFloor counts as kAmaxFloor: below 448 / FLT_MAX (~1.3e-36) q would
// overflow to inf and turn the row's zeros into NaN; at the floor q is finite and s a normal float.
constexpr float kAmaxFloor = 0x1p-117f;  // ~6.0e-36
FP8A2A_HD float floored_amax(float amax) { return amax < kAmaxFloor ? kAmaxFloor : amax; }  // NaN stays NaN
FP8A2A_HD float quant_multiplier(float amax) { return amax == 0.0f ? 1.0f : kE4M3Max / floored_amax(amax); }
FP8A2A_HD float dequant_scale(float amax) { return amax == 0.0f ? 1.0f : floored_amax(amax) / kE4M3Max; }

// Tensor granularity: one scale for every row cannot mark one, and the cast saturates Inf to 448,
// so a row holding NaN or Inf (an amax that is not finite) is written as kE4M3NaN throughout: it
// dequantizes to NaN, as a row-scaled one does, never to finite wrong values.
FP8A2A_HD bool amax_finite(float amax) { return amax <= 0x1.fffffep127f; }  // false for NaN and Inf

FP8A2A_HD int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// float32 addition, rounded to nearest (on the GPU an add that no multiply can fuse into).
FP8A2A_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The order of combine_backward_rows' row dot products (the router-weight gradient), one order
// for both backends so that they agree bit for bit, in float32 without fused multiply-adds:
//   1. the row in units of kDotUnit = 16 elements, the last one padded with products of +0;
//   2. a unit's 16 products summed as a pairwise tree (sum16_pairwise);
//   3. unit u added to the partial of lane u % kDotLanes (32), in increasing u, each lane from +0;
//   4. the 32 lane partials summed as a tree: at step o = 16, 8, 4, 2, 1 lane l < o adds lane l + o
//      (a warp's xor-shuffle reduction, read at lane 0).
// Each lane sums H / 512 units, so the error grows like a blocked sum's, not a sequential one's.
constexpr int kDotUnit = 16;
constexpr int kDotLanes = 32;

FP8A2A_HD float sum16_pairwise(const float (&p)[kDotUnit]) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = add_rn(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) a[i] = add_rn(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) a[i] = add_rn(a[2 * i], a[2 * i + 1]);
  return add_rn(a[0], a[1]);
}

// Wire rows start on whole 128-byte lines, so that no 32-byte sector is shared by two rows written
// by different blocks. It costs up to 112 bytes a row: at H = 7168, top-8, 7280 -> 7296 (+0.2%),
// quantized combine rows 7184 -> 7296 (+1.6%).
constexpr int64_t kRowAlign = 128;

// Dispatch wire format: one row = one token for one destination rank, H e4m3 bytes followed by
// everything the receiver needs, so a single uint8 all_to_all_single carries it all.
//   [0, H)                      e4m3 payload (raw: H bytes of the activation, H = hidden * elem)
//   [scale_off, +4*num_scales)  f32 dequant scales: 1 (row, tensor), H/128 (block128), 0 (raw)
//   [weight_off, +4*K)          f32 router weight of each top-k slot (0 if that slot's expert
//                               is not on the destination rank)
//   [expert_off, +4*K)          i32 local expert id of each slot on this rank, else -1
//   [pos_off, +4*K)             i32 index of this row among the sender's rows for
//                               (destination rank, that local expert): where it lands
//   zero padding up to a multiple of kRowAlign bytes
// Slots keep the token's top-k order, so the receiver can map a slot back to topk_weights[t, k].
struct DispatchRow {
  int64_t hidden, num_scales, topk, scale_off, weight_off, expert_off, pos_off, bytes;
  FP8A2A_HD DispatchRow(int64_t h, int64_t granularity, int64_t k)
      : hidden(h),
        num_scales(granularity == kBlock128 ? h / kBlock : (granularity == kRaw ? 0 : 1)),
        topk(k),
        scale_off(align_up(h, 4)),
        weight_off(scale_off + 4 * num_scales),
        expert_off(weight_off + 4 * k),
        pos_off(expert_off + 4 * k),
        bytes(align_up(pos_off + 4 * k, kRowAlign)) {}
};

// Combine wire format (expert side -> token side; also dispatch backward):
//   [0, H*elem)            payload: the row in the activation dtype, or e4m3 when quantized
//   [scale_off, +4)        f32 row scale, only when quantized
//   [extra_off, +4*K)      f32 per-slot values (router-weight gradients), only when carried
//   zero padding up to a multiple of kRowAlign bytes
struct CombineRow {
  int64_t hidden, elem, topk, scale_off, extra_off, bytes;
  FP8A2A_HD CombineRow(int64_t h, int64_t elem_size, bool quantized, int64_t extra_k)
      : hidden(h),
        elem(quantized ? 1 : elem_size),
        topk(extra_k),
        scale_off(align_up(h * elem, 4)),
        extra_off(scale_off + (quantized ? 4 : 0)),
        bytes(align_up(extra_off + 4 * extra_k, kRowAlign)) {}
};

// Per-destination header of the counts exchange (int64 columns), followed by one count per
// local expert. Carrying hidden/topk/bad-id counts lets every rank detect a mismatch or bad
// input after the exchange it needs anyway: all ranks raise together, none hangs.
// kColWire is the granularity code the sender packed with (ranks agree on one before sending rows);
// kColDtype its activation's ActDtype (ranks must dispatch one dtype: combine's rows carry it);
// kColGrad 1 if the sender's dispatch input requires grad (its backward will enter the dispatch
// backward's exchange), else 0: every rank learns whether every peer will, at no extra collective.
enum CountsCol : int64_t {
  kColHidden = 0, kColTopk, kColBadIds, kColWire, kColDtype, kColGrad, kColRows, kColExperts
};

// The activation dtype in the counts header (kColDtype); kDtypeBytes: a uint8 view of unknown dtype.
enum ActDtype : int64_t { kDtypeBytes = 0, kDtypeFloat32 = 1, kDtypeFloat16 = 2, kDtypeBFloat16 = 3 };

}  // namespace fp8a2a
