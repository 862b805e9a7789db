"""Probe (GPU): Triton FP8 grouped GEMMs for ~128 rows per expert (DeepSeek-V3 at world size 1)
against torch._scaled_grouped_mm, which reads the FP8 weights at ~2.2-2.5 TB/s there
(scripts/probe_sgmm.py).

    python scripts/probe_gmm_triton.py

Row tiles are looked up by binary search in a per-expert tile prefix (no loop over experts), the
tiles of one row block are consecutive programs (its A tile and the expert's weights stay in L2),
operands come through TMA descriptors (or plain pointer loads) and accumulate without promotion
(torch's use_fast_accum=True)."""
import math

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, e, row0, row_end, n0, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS):
        a = a_desc.load([row0, k0])
        b = b_desc.load([e * N + n0, k0])
        acc = tl.dot(a, b.T, acc)
    rm = row0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    m_ok = rm < row_end
    sa = tl.load(sa_ptr + rm, mask=m_ok, other=0.0)
    sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn)
    acc = acc * sa[:, None] * sb[None, :]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=m_ok[:, None])


@triton.jit
def _gmm_kernel(a_desc, at_desc, b_desc, c_ptr, sa_ptr, sb_ptr, offs_ptr, tcum_ptr, nmain_ptr, N, K, E,
                LOG2E: tl.constexpr, BM: tl.constexpr, BMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                WS: tl.constexpr):
    # expert e's row tiles: nmain of BM rows, then (BMT < BM) tail tiles of BMT rows; programs of one
    # row tile are consecutive (its A tile and the expert's weights stay in L2)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    tile_m, tile_n = pid // num_n, pid % num_n
    if tile_m >= tl.load(tcum_ptr + E - 1):
        return
    lo = tl.zeros([], tl.int32)
    hi = tl.full([], E, tl.int32)
    for _ in tl.static_range(LOG2E):  # first expert whose tile prefix passes tile_m
        mid = (lo + hi) // 2
        go = tl.load(tcum_ptr + mid) <= tile_m
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(go, hi, mid)
    e = lo
    t0 = tl.load(tcum_ptr + e - 1, mask=e > 0, other=0)
    r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    row_end = tl.load(offs_ptr + e)
    local = tile_m - t0
    if BMT < BM:
        nm = tl.load(nmain_ptr + e)
        if local < nm:
            _tile(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, e, r0 + local * BM, row_end, tile_n * BN, N, K,
                  BM, BN, BK, WS)
        else:
            _tile(at_desc, b_desc, c_ptr, sa_ptr, sb_ptr, e, r0 + nm * BM + (local - nm) * BMT, row_end,
                  tile_n * BN, N, K, BMT, BN, BK, WS)
    else:
        _tile(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, e, r0 + local * BM, row_end, tile_n * BN, N, K,
              BM, BN, BK, WS)


def gmm(a, sa, w, sw, offs, BM, BN, BK, warps, stages, BMT=None, ws=False):
    """BMT: tail tiles of BMT rows for an expert's last rows when they are <= BM / 2 of them."""
    M, K = a.shape
    E, N, _ = w.shape
    BMT = BMT or BM
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    nmain = counts // BM
    rem = counts - nmain * BM
    if BMT < BM:
        big = rem > BM // 2
        nmain = nmain + big
        ntail = torch.where(big, 0, (rem + BMT - 1) // BMT)
    else:
        nmain, ntail = (counts + BM - 1) // BM, torch.zeros_like(counts)
    tcum = torch.cumsum(nmain + ntail, 0).to(torch.int32)
    nmain = nmain.to(torch.int32)
    out = torch.empty((M, N), device=a.device, dtype=torch.bfloat16)
    w2 = w.view(E * N, K)
    grid = ((triton.cdiv(M, BM) + E * (1 + BM // 2 // BMT)) * triton.cdiv(N, BN),)
    _gmm_kernel[grid](TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(a, [BMT, BK]),
                      TensorDescriptor.from_tensor(w2, [BN, BK]), out, sa, sw, offs, tcum, nmain, N, K, E,
                      LOG2E=math.ceil(math.log2(E + 1)), BM=BM, BMT=BMT, BN=BN, BK=BK, WS=ws,
                      num_warps=warps, num_stages=stages)
    return out


def main():
    torch.manual_seed(0)
    dev = "cuda"
    T, topk = 4096, 8
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    f8 = torch.float8_e4m3fn
    # (BM, BN, BK, warps, stages, tail rows, warp-specialized)
    configs = [(128, 256, 128, 8, 3, None, False), (128, 256, 128, 8, 4, None, False),
               (128, 256, 64, 8, 4, None, False), (128, 256, 64, 8, 6, None, False),
               (64, 256, 128, 4, 4, None, False), (256, 128, 128, 8, 3, None, False),
               (128, 256, 128, 8, 3, 64, False), (128, 256, 128, 8, 3, 32, False),
               (128, 256, 64, 8, 4, 64, False), (128, 256, 128, 8, 3, None, True)]
    total = {}
    shapes = {"fc1 fwd": (256, 4096, 7168), "fc2 fwd": (256, 7168, 2048), "fc2 dgrad": (256, 2048, 7168),
              "fc1 dgrad": (256, 7168, 4096), "qwen3 fc1 fwd": (128, 3072, 4096), "qwen3 fc2 fwd": (128, 4096, 1536)}
    for name, (E, N, K) in shapes.items():
        idx = torch.rand(T, E, device=dev).topk(topk, dim=1).indices
        offs = torch.cumsum(torch.bincount(idx.flatten(), minlength=E), 0).to(torch.int32)
        M = int(offs[-1])
        w = (torch.randn(E, N, K, device=dev) * 0.1).to(f8)
        sw = torch.rand(E, N, device=dev) + 0.5
        a = torch.randn(M, K, device=dev).to(f8)
        sa = torch.rand(M, device=dev) + 0.5
        ref = torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                                       use_fast_accum=True)
        res = {"torch._scaled_grouped_mm": do_bench(lambda: torch._scaled_grouped_mm(
            a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
            warmup=5, rep=60)}
        for cfg in configs:
            label = f"BM{cfg[0]} BN{cfg[1]} BK{cfg[2]} w{cfg[3]} s{cfg[4]}" + \
                    (f" tail{cfg[5]}" if cfg[5] else "") + (" ws" if cfg[6] else "")
            try:
                out = gmm(a, sa, w, sw, offs, *cfg[:5], BMT=cfg[5], ws=cfg[6])
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = do_bench(lambda: gmm(a, sa, w, sw, offs, *cfg[:5], BMT=cfg[5], ws=cfg[6]), warmup=5, rep=60)
                res[f"{label} (err {err:.1e})"] = t
            except Exception as ex:  # noqa: BLE001 - a probe: report and go on
                print(f"  {label}: {type(ex).__name__} {str(ex)[:300]}")
        wbytes, flops = E * N * K, 2 * M * N * K
        print(f"== {name}: {E} experts, {M} rows, N {N} K {K}, FP8 weights {wbytes / 1e9:.2f} GB, {flops / 1e12:.2f} TFLOP", flush=True)
        base = res["torch._scaled_grouped_mm"]
        for k, v in res.items():
            if E == 256:  # the DeepSeek-V3 layer's four GEMMs
                key = k.split(" (")[0]
                total[key] = total.get(key, 0.0) + v
            print(f"  {k:52s} {v:7.3f} ms  {wbytes / v / 1e9:5.2f} TB/s of weights  {flops / v / 1e9:6.0f} TFLOP/s  "
                  f"{base / v:5.2f}x", flush=True)
        del w, a, ref
        torch.cuda.empty_cache()
    print("== sum of the four DeepSeek-V3 GEMMs")
    for k, v in sorted(total.items(), key=lambda kv: kv[1]):
        print(f"  {k:52s} {v:7.3f} ms")


if __name__ == "__main__":
    main()
