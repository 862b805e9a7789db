"""Probe (GPU): fp8a2a's TMA Triton FP8 grouped GEMM (triton_kernels.grouped_mm_fp8) against
torch._scaled_grouped_mm (fast accumulation), over rows per expert at 32768 rows in all, for the
DeepSeek-V3 expert GEMMs and a few tile sizes: where FP8_TMA_MAX_ROWS_PER_EXPERT sits.

    python scripts/probe_gmm_triton.py

torch's op picks a 64 x 128 tile at <= 128 rows per expert and 128 x 256 x 64 above (up to 2048);
it reads the FP8 weights at ~2.2-2.5 TB/s at 128 rows per expert (scripts/probe_sgmm.py). An earlier
version of this probe (git history; results/h200_2026-11-29/probe_gmm_triton_s5_variants.txt) also
tried tail tiles for each expert's last rows, Triton's warp specialization and 256-row tiles: none
was faster than 128 x 256 x 128."""
import torch
import triton
from triton.testing import do_bench

from fp8a2a import triton_kernels as tk

TILES = [tk.FP8_TILE, (128, 256, 128, 8, 3), (64, 256, 128, 4, 4), (128, 128, 128, 8, 4)]


def main():
    torch.manual_seed(0)
    dev, f8, M = "cuda", torch.float8_e4m3fn, 32768
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, f"{M} rows", flush=True)
    rows_sweep = (128, 256, 512, 1024, 2048, 4096)
    summary = {}
    for name, (N, K) in {"fc1 fwd": (4096, 7168), "fc2 fwd": (7168, 2048), "fc2 dgrad": (2048, 7168),
                         "fc1 dgrad": (7168, 4096)}.items():
        for rows in rows_sweep:
            E = M // rows
            idx = torch.randint(0, E, (M,), device=dev)  # uneven groups around `rows`
            offs = torch.cumsum(torch.bincount(idx, minlength=E), 0).to(torch.int32)
            w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.1).to(f8)
            sw = torch.rand(E, N, device=dev) + 0.5
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16).to(f8)
            sa = torch.rand(M, device=dev) + 0.5
            torch_mm = lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs,  # noqa: E731
                                                        out_dtype=torch.bfloat16, use_fast_accum=True)
            ref = torch_mm().float()
            base = do_bench(torch_mm, warmup=5, rep=50)
            line = f"{name:10s} {rows:5d} rows/expert ({E:3d} experts): torch {base:6.3f} ms"
            for tile in TILES:
                out = tk.grouped_mm_fp8(a, sa, w, sw, offs, tile=tile)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                t = do_bench(lambda: tk.grouped_mm_fp8(a, sa, w, sw, offs, tile=tile), warmup=5, rep=50)
                line += f" | {'x'.join(map(str, tile[:3]))} w{tile[3]} s{tile[4]} {base / t:4.2f}x (err {err:.0e})"
                summary.setdefault((rows, tile), []).append(base / t)
            print(line, flush=True)
            del w, a, ref
            torch.cuda.empty_cache()
    print("== speedup over torch._scaled_grouped_mm, geometric mean of the four GEMMs")
    for rows in rows_sweep:
        print(f"  {rows:5d} rows/expert: " + " | ".join(
            f"{'x'.join(map(str, tile[:3]))} w{tile[3]} s{tile[4]} "
            f"{torch.tensor(summary[(rows, tile)]).log().mean().exp().item():4.2f}x" for tile in TILES))


if __name__ == "__main__":
    main()
