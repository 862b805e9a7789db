"""The expert GEMMs alone at a real EP rank's load, against cuBLAS FP8 of the same total size.

    python benchmarks/bench_expert_gemms.py                      # DeepSeek-V3 at EP=32 and EP=8
    python benchmarks/bench_expert_gemms.py --tiles --json out.json

Per (local experts, rows per expert), hidden 7168 and expert FFN 2048 (fc1 7168 -> 4096 SwiGLU,
fc2 2048 -> 7168):
- forward: the FP8 GEMM FP8GroupedMLP runs (row-scaled e4m3 rows and weights) with the counts on the
  device (the grouped GEMM) and on the host (from ExpertsConfig.dense_min_rows_per_expert rows per
  expert: one dense torch._scaled_mm per expert), against one dense torch._scaled_mm of the same
  total size (all rows against one expert's weight), the ceiling a grouped GEMM can reach;
- weight gradient: the BF16 path (a BF16 x_hat from the FP8 rows + torch._grouped_mm) against the
  FP8 path (two fused quantize-transposes at 1 x 128 along the tokens, then either the Triton
  grouped_wgrad_fp8 or, given the counts on the host, one cuBLAS GEMM per expert with 1 x 128
  scales on both operands, all from one extension call: ops.wgrad_fp8_per_expert), each part timed,
  and the dense torch._scaled_mm of the same size with row scales and with the same 1 x 128 block
  scales.
TFLOP/s count 2 * M * N * K of useful work (no padding). --tiles also times other tiles of the
Triton GEMMs. Medians of triton.testing.do_bench (CUDA events).
"""
import argparse
import json

import torch
from triton.testing import do_bench

from fp8a2a import experts, triton_kernels as tk
from fp8a2a.kernels import quantize_rows

HIDDEN, FFN = 7168, 2048
LOADS = {"ep32": (8, 4096), "ep8": (32, 1024)}  # DeepSeek-V3, 4096 tokens x top-8 per rank
FWD_TILES = [(128, 256, 128, 8, 4), (128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3),
             (256, 128, 128, 8, 4)]
WGRAD_TILES = [(128, 128, 8, 8, 3), (128, 128, 8, 8, 4), (128, 128, 4, 8, 3), (128, 256, 8, 8, 3)]


def ms(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def tflops(m, n, k, t_ms):
    return 2 * m * n * k / t_ms / 1e9


def dense_fp8_ms(m, n, k):
    """cuBLAS FP8 (torch._scaled_mm, row and column scales, fast accumulation): [m, k] @ [k, n]."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return ms(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))


def run_load(name, E, R, tiles):
    M = E * R
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * R
    out = {"load": name, "experts": E, "rows_per_expert": R}
    cfg = experts._Cfg(backend="scaled_grouped_mm")
    for gemm, (n, k) in {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}.items():
        xq, xs = quantize_rows(torch.randn(M, k, device="cuda").bfloat16())
        w = (torch.randn(E, n, k, device="cuda") * 0.02).bfloat16()
        wq, sw = experts.fp8_weight(w)
        dense = dense_fp8_ms(M, n, k)
        t = ms(lambda: experts._mm_fp8(cfg, xq, xs, wq, sw, offs))
        host = ms(lambda: experts._mm_fp8(cfg, xq, xs, wq, sw, offs, [R] * E))
        row = {"fwd_ms": t, "fwd_tflops": tflops(M, n, k, t), "dense_fp8_ms": dense,
               "dense_fp8_tflops": tflops(M, n, k, dense), "fwd_of_dense": dense / t,
               "fwd_host_counts_ms": host, "fwd_host_counts_of_dense": dense / host}
        if tiles:
            row["fwd_tiles"] = {str(tl): ms(lambda: tk.grouped_mm_fp8(xq, xs, wq, sw, offs, tile=tl)) for tl in FWD_TILES}
        # weight gradient: dW [E, n, k] = g^T @ x_hat per expert
        g = torch.randn(M, n, device="cuda").bfloat16()
        bf16 = ms(lambda: torch._grouped_mm(g.t(), experts._dequant(xq, xs, torch.bfloat16), offs=offs,
                                            out_dtype=torch.bfloat16))
        pad_offs, mpad = experts._wgrad_padding(offs, M)
        quant_g = ms(lambda: tk.block_col_quant_t(g, offs, pad_offs, mpad))
        quant_x = ms(lambda: tk.block_col_quant_t(xq, offs, pad_offs, mpad, sx=xs))
        a, sa = tk.block_col_quant_t(g, offs, pad_offs, mpad)
        b, sb = tk.block_col_quant_t(xq, offs, pad_offs, mpad, sx=xs)
        gemm_ms = ms(lambda: tk.grouped_wgrad_fp8(a, sa, b, sb, pad_offs))
        whole = ms(lambda: experts._wgrad_fp8(g, xq, xs, offs, torch.bfloat16))
        counts = [R] * E  # the per-expert cuBLAS GEMMs (host counts)
        cublas = experts.ExpertsConfig(cublas_wgrad_min_rows_per_expert=0)
        cublas_gemm = ms(lambda: experts._wgrad_fp8_per_expert(a, sa, b, sb, counts, torch.bfloat16))
        cublas_whole = ms(lambda: experts._wgrad_fp8(g, xq, xs, offs, torch.bfloat16, counts, cublas))
        dense_w = dense_fp8_ms(n, k, M)
        # over the M rows alone (every group here a multiple of 128: no padding between them), not the
        # buffers' padded bound
        dense_block = ms(lambda: torch._scaled_mm(a[:, :M], b[:, :M].t(), scale_a=sa[:M // 128].t(),
                                                  scale_b=sb[:M // 128], out_dtype=torch.bfloat16))
        row.update(wgrad_bf16_ms=bf16, wgrad_bf16_tflops=tflops(n, k, M, bf16), wgrad_fp8_ms=whole,
                   wgrad_fp8_quant_g_ms=quant_g, wgrad_fp8_quant_x_ms=quant_x, wgrad_fp8_gemm_ms=gemm_ms,
                   wgrad_fp8_gemm_tflops=tflops(n, k, M, gemm_ms), wgrad_dense_fp8_tflops=tflops(n, k, M, dense_w),
                   wgrad_fp8_cublas_ms=cublas_whole, wgrad_fp8_cublas_gemm_ms=cublas_gemm,
                   wgrad_fp8_cublas_gemm_tflops=tflops(n, k, M, cublas_gemm),
                   wgrad_dense_block_fp8_tflops=tflops(n, k, M, dense_block))
        if tiles:
            row["wgrad_tiles"] = {}
            for tl in WGRAD_TILES:
                try:
                    row["wgrad_tiles"][str(tl)] = ms(lambda: tk.grouped_wgrad_fp8(a, sa, b, sb, pad_offs, tile=tl))
                except Exception as err:  # a tile this Triton cannot compile
                    print("tile", tl, "failed:", str(err).splitlines()[0][:200])
        out[gemm] = row
    return out


def table(rows):
    lines = ["| load | GEMM | fwd TFLOP/s (of dense) | fwd, host counts | dense FP8 TFLOP/s | wgrad BF16 ms | wgrad FP8 ms "
             "(quant dY + quant x + GEMM) | FP8 wgrad GEMM TFLOP/s | wgrad FP8, cuBLAS per expert: ms, GEMM "
             "TFLOP/s | dense 1 x 128 FP8 TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for gemm in ("fc1", "fc2"):
            x = r[gemm]
            lines.append(f"| {r['experts']} x {r['rows_per_expert']} | {gemm} | {x['fwd_tflops']:.0f} "
                         f"({x['fwd_of_dense']:.2f}) | {x['fwd_host_counts_of_dense']:.2f} of dense | "
                         f"{x['dense_fp8_tflops']:.0f} | {x['wgrad_bf16_ms']:.3f} | "
                         f"{x['wgrad_fp8_ms']:.3f} ({x['wgrad_fp8_quant_g_ms']:.3f} + {x['wgrad_fp8_quant_x_ms']:.3f}"
                         f" + {x['wgrad_fp8_gemm_ms']:.3f}) | {x['wgrad_fp8_gemm_tflops']:.0f} | "
                         f"{x['wgrad_fp8_cublas_ms']:.3f}, {x['wgrad_fp8_cublas_gemm_tflops']:.0f} | "
                         f"{x['wgrad_dense_block_fp8_tflops']:.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("--tiles", action="store_true", help="also time other tiles of the Triton GEMMs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rows = [run_load(name, *LOADS[name], args.tiles) for name in args.loads]
    print(table(rows))
    if args.tiles:
        for r in rows:
            for gemm in ("fc1", "fc2"):
                print(r["load"], gemm, "fwd tiles ms", {k: round(v, 3) for k, v in r[gemm]["fwd_tiles"].items()})
                print(r["load"], gemm, "wgrad tiles ms", {k: round(v, 3) for k, v in r[gemm]["wgrad_tiles"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
