"""Probe (GPU): torch / cuBLAS ways to compute the grouped weight gradient at ~128 rows per expert
(the DeepSeek-V3 MoE layer at world size 1), against a write-only fill of the same output.

    python scripts/probe_wgrad_torch.py

torch._grouped_mm(g.t(), x) (what FP8GroupedMLP and the BF16 baseline use), the transpose copies a
K-major operand would cost, a loop of torch.mm per expert (host-side counts), and cuBLAS batched
GEMM over experts padded to the longest (padding not timed)."""
import torch
from triton.testing import do_bench


def deepseek_routing(dev, T=4096, E=256, topk=8):
    """(rows per expert, int32 group ends, rows) of T tokens routed top-k of E at random: the
    DeepSeek-V3 MoE layer at world size 1 (~128 rows per expert). Seeds torch with 0."""
    torch.manual_seed(0)
    idx = torch.rand(T, E, device=dev).topk(topk, dim=1).indices
    counts = torch.bincount(idx.flatten(), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return counts, offs, int(offs[-1])


def main():
    dev = "cuda"
    counts, offs, M = deepseek_routing(dev)
    E = counts.numel()
    hc = counts.tolist()
    starts = [0]
    for c in hc:
        starts.append(starts[-1] + c)
    mpad = (max(hc) + 15) // 16 * 16
    print(torch.cuda.get_device_name(), torch.__version__, f"rows {M}, max/expert {max(hc)}, pad {mpad}", flush=True)
    for name, (N, K) in {"fc1 (4096 x 7168)": (4096, 7168), "fc2 (7168 x 2048)": (7168, 2048)}.items():
        g = (torch.randn(M, N, device=dev) * 0.01).to(torch.bfloat16)
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        out_bytes = E * N * K * 2
        ref = torch._grouped_mm(g.t(), x, offs=offs, out_dtype=torch.bfloat16)
        z = torch.empty_like(ref)
        res = {}
        res["zero_ (write roofline)"] = do_bench(lambda: z.zero_(), warmup=3, rep=50)
        res["grouped_mm(g.t(), x)"] = do_bench(lambda: torch._grouped_mm(g.t(), x, offs=offs, out_dtype=torch.bfloat16), warmup=3, rep=80)
        gt = g.t().contiguous()
        res["  transpose copy of g"] = do_bench(lambda: g.t().contiguous(), warmup=3, rep=30)
        res["  transpose copy of x"] = do_bench(lambda: x.t().contiguous(), warmup=3, rep=30)
        def loop():
            out = torch.empty((E, N, K), device=dev, dtype=torch.bfloat16)
            for e in range(E):
                torch.mm(gt[:, starts[e]:starts[e + 1]], x[starts[e]:starts[e + 1]], out=out[e])
            return out
        o = loop()
        print("  loop max err", (o[:8].float() - ref[:8].float()).abs().max().item())
        del o
        res["per-expert torch.mm loop (host counts)"] = do_bench(loop, warmup=2, rep=80)
        # padded batched GEMM (cuBLAS strided batched), operands padded to mpad rows per expert
        gp = torch.zeros(E, N, mpad, device=dev, dtype=torch.bfloat16)
        xp = torch.zeros(E, mpad, K, device=dev, dtype=torch.bfloat16)
        for e in range(E):
            gp[e, :, :hc[e]] = gt[:, starts[e]:starts[e + 1]]
            xp[e, :hc[e]] = x[starts[e]:starts[e + 1]]
        o = torch.bmm(gp, xp)
        print("  bmm max err", (o[:8].float() - ref[:8].float()).abs().max().item())
        del o
        res[f"bmm padded to {mpad} (no pad cost)"] = do_bench(lambda: torch.bmm(gp, xp), warmup=3, rep=80)
        xpt = xp.transpose(1, 2).contiguous().transpose(1, 2)
        res["bmm padded, x K-major"] = do_bench(lambda: torch.bmm(gp, xpt), warmup=3, rep=80)
        base = res["grouped_mm(g.t(), x)"]
        print(f"== {name}: output {out_bytes / 1e9:.2f} GB")
        for k, v in res.items():
            print(f"  {k:42s} {v:8.3f} ms  {out_bytes / v / 1e6:6.0f} GB/s of output  {base / v:5.2f}x grouped_mm")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
