"""Probe (GPU): the FP8 grouped GEMMs of the DeepSeek-V3 MoE layer at world size 1 (256 experts,
~128 rows each), against the bytes of FP8 weights they must read.

    python scripts/probe_sgmm.py

torch._scaled_grouped_mm picks its CUTLASS tile from rows / experts: <= 128 gives 64 x 128 x 128
(ping-pong), above it 128 x 256 x 64 (cooperative). The same GEMM is timed on the exact row count
and on an operand with slack rows past the last group (not computed), which moves that choice;
and the package's Triton grouped GEMM."""
import torch
from triton.testing import do_bench

from fp8a2a import triton_kernels as tk
from probe_wgrad_torch import deepseek_routing  # scripts/ is on the path when run as a script


def main():
    dev = "cuda"
    counts, offs, M = deepseek_routing(dev)
    E = counts.numel()
    print(torch.cuda.get_device_name(), torch.__version__, f"rows {M}, experts {E}, max/expert {int(counts.max())}",
          flush=True)
    f8 = torch.float8_e4m3fn
    total = {}
    for name, (N, K) in {"fc1 fwd": (4096, 7168), "fc2 fwd": (7168, 2048), "fc2 dgrad": (2048, 7168),
                         "fc1 dgrad": (7168, 4096)}.items():
        w = (torch.randn(E, N, K, device=dev) * 0.1).to(f8)
        sw = torch.rand(E, N, device=dev) + 0.5
        res = {}
        ref = None
        for label, rows in (("exact rows", M), ("+E slack rows", M + E), ("rows of 2048/expert", E * 2048)):
            a = (torch.randn(rows, K, device=dev)).to(f8)
            sa = torch.rand(rows, device=dev) + 0.5
            fn = lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs,
                                                  out_dtype=torch.bfloat16, use_fast_accum=True)
            out = fn()
            if ref is None:
                a0, sa0, ref = a, sa, out
            else:
                a[:M].copy_(a0[:M]), sa[:M].copy_(sa0[:M])
                err = (fn()[:M].float() - ref.float()).abs().max().item()
                label += f" (max diff {err:.3g})"
            res[label] = do_bench(fn, warmup=5, rep=60)
            del a, sa, out
        try:
            res["triton grouped_mm"] = do_bench(lambda: tk.grouped_mm(a0, w, offs, sa=sa0, sb=sw), warmup=5, rep=60)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print("  triton failed:", repr(e)[:200])
        wbytes = E * N * K
        flops = 2 * M * N * K
        print(f"== {name}: N {N} K {K}, FP8 weights {wbytes / 1e9:.2f} GB, {flops / 1e12:.2f} TFLOP")
        base = next(iter(res.values()))
        for k, v in res.items():
            total[k.split(" (")[0]] = total.get(k.split(" (")[0], 0.0) + v
            print(f"  {k:44s} {v:7.3f} ms  {wbytes / v / 1e9:5.2f} TB/s of weights  {flops / v / 1e9:6.0f} TFLOP/s  "
                  f"{base / v:5.2f}x")
        del w, ref, a0
        torch.cuda.empty_cache()
    print("== sum of the four GEMMs:", ", ".join(f"{k} {v:.3f} ms" for k, v in total.items()))


if __name__ == "__main__":
    main()
