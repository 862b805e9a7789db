"""Benchmark fp8a2a.FP8GroupedMLP against a BF16 grouped MLP (torch._grouped_mm), same shapes, same run.

    python benchmarks/bench_experts.py                       # DeepSeek shape: 8 experts x 2048 rows, 7168 -> 2048
    python benchmarks/bench_experts.py --shapes deepseek mixtral qwen3 --json bench_out/experts.json

Times are medians of triton.testing.do_bench (CUDA events) when Triton is there, else of CUDA-event
loops. 'fwd' is the forward with autograd recording (what training runs), 'fwd+bwd' adds backward
with a random upstream gradient. 'saved MB' counts the bytes autograd keeps for backward
(saved_tensors_hooks, unique storages, parameters excluded); 'fc1 in MB' is the part of it that is
fc1's input (FP8 rows + scales for fp8a2a, the BF16 rows for the baseline). FP8 weight copies are
cached across calls (refreshed when the weights change: once per optimizer step); their refresh is
timed on its own ('weight requant ms'). The input is the dispatcher's: expert-major FP8 rows with
row scales (block128 variants: 128-value block scales) and tokens_per_expert on the GPU.
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import fp8a2a
from fp8a2a import experts
from fp8a2a.experts import FP8GroupedMLP, fp8_weight, invalidate_fp8_weight_cache, resolve_backend
from fp8a2a.quant import QuantizedTensor
from fp8a2a.reference import quantize_reference

SHAPES = {"deepseek": (7168, 2048), "mixtral": (4096, 14336), "qwen3": (2048, 768)}


def bench(fn, grad_to_none=None):
    try:
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    except ImportError:
        for _ in range(5):
            fn()
        times = []
        for _ in range(30):
            for t in grad_to_none or []:
                t.grad = None
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


def saved_bytes(fn, params, fc1_input):
    """(all saved activation bytes, those of fc1's input) over one forward."""
    seen, fc1 = {}, set(t.untyped_storage().data_ptr() for t in fc1_input)
    skip = set(p.untyped_storage().data_ptr() for p in params)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values()), sum(v for k, v in seen.items() if k in fc1)


def act_bf16(z, act):
    if act == "swiglu":
        a, b = z.chunk(2, dim=-1)
        return F.silu(a) * b
    return F.gelu(z) if act == "gelu" else F.relu(z)


def bf16_mlp(x, w1, w2, offs, act):
    z = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(act_bf16(z, act), w2.transpose(-2, -1), offs=offs)


def run_shape(name, hidden, ffn, args):
    dev = "cuda"
    E, rows = args.experts, args.rows
    M = E * rows
    torch.manual_seed(0)
    tpe = torch.full((E,), rows, dtype=torch.int64, device=dev)
    offs = torch.cumsum(tpe, 0, dtype=torch.int32)
    x = torch.randn(M, hidden, device=dev, dtype=torch.bfloat16)
    fc1_out = (2 if args.act == "swiglu" else 1) * ffn
    flops = 2 * M * hidden * (fc1_out + ffn)  # forward; backward is twice that
    dy = torch.randn(M, hidden, device=dev, dtype=torch.bfloat16)
    results = []

    # baseline: BF16 rows (what a BF16 dispatcher delivers), torch._grouped_mm, eager activation
    mlp0 = FP8GroupedMLP(E, hidden, ffn, args.act, device=dev)
    w1 = mlp0.fc1_weight.detach().clone().requires_grad_()
    w2 = mlp0.fc2_weight.detach().clone().requires_grad_()
    xb = x.clone().requires_grad_()
    fwd = lambda: bf16_mlp(xb, w1, w2, offs, args.act)  # noqa: E731
    t_f = bench(fwd, [xb, w1, w2])
    t_fb = bench(lambda: fwd().backward(dy), [xb, w1, w2])
    sv, sv1 = saved_bytes(fwd, [w1, w2], [xb])
    base = dict(shape=name, variant="bf16 torch._grouped_mm", fwd_ms=t_f, fwd_bwd_ms=t_fb, saved_mb=sv / 2**20,
                fc1_in_mb=sv1 / 2**20, fwd_tflops=flops / t_f / 1e9, fwd_bwd_tflops=3 * flops / t_fb / 1e9)
    results.append(base)

    # (granularity, backend, fp8_dgrad, fp8_wgrad, fast_accum, block128 consumed natively)
    variants = [("row", "auto", False, False, True, True), ("row", "auto", True, False, True, True),
                ("row", "auto", True, True, True, True),
                ("row", "auto", False, False, False, True), ("row", "triton", False, False, True, True),
                ("block128", "auto", False, False, True, True), ("block128", "auto", False, False, True, False)]
    if args.quick:
        variants = variants[:3]
    for gran, backend, fp8_dgrad, fp8_wgrad, fast_accum, native in variants:
        be = resolve_backend(backend, torch.device(dev))
        mlp = FP8GroupedMLP(E, hidden, ffn, args.act, backend=backend, fp8_dgrad=fp8_dgrad, fp8_wgrad=fp8_wgrad,
                            fast_accum=fast_accum, device=dev, config=experts.ExpertsConfig(block128_native=native))
        mlp.load_state_dict(mlp0.state_dict())
        xa = x.clone().requires_grad_()  # the gradient anchor (the dispatcher's input)
        data, scale = quantize_reference(x, gran)
        q = QuantizedTensor(data, scale, gran, grad_anchor=xa)
        fwd = lambda: mlp(q, tpe)  # noqa: E731
        params = list(mlp.parameters())
        t_f = bench(fwd, [xa] + params)
        t_fb = bench(lambda: fwd().backward(dy), [xa] + params)
        sv, sv1 = saved_bytes(fwd, params, [data, scale])

        def requant():  # what an optimizer step triggers (its hook), without touching the weights
            invalidate_fp8_weight_cache()
            with torch.no_grad():
                for p in params:
                    fp8_weight(p)
                    if fp8_dgrad:
                        fp8_weight(p, transposed=True)
        t_rq = bench(requant)
        label = (f"fp8 {gran} {be}" + (" fp8-dgrad" if fp8_dgrad else "") + (" fp8-wgrad" if fp8_wgrad else "")
                 + ("" if fast_accum else " exact-accum")
                 + ("" if gran == "row" else (" (triton fwd)" if native else " (converted)")))
        results.append(dict(shape=name, variant=label, fwd_ms=t_f, fwd_bwd_ms=t_fb, saved_mb=sv / 2**20,
                            fc1_in_mb=sv1 / 2**20, fwd_tflops=flops / t_f / 1e9, fwd_bwd_tflops=3 * flops / t_fb / 1e9,
                            fwd_x=base["fwd_ms"] / t_f, fwd_bwd_x=base["fwd_bwd_ms"] / t_fb,
                            saved_ratio=sv / (base["saved_mb"] * 2**20), fc1_in_ratio=sv1 / (base["fc1_in_mb"] * 2**20),
                            weight_requant_ms=t_rq))
        print(json.dumps(results[-1]), flush=True)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["deepseek"], choices=list(SHAPES))
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=2048, help="rows per expert")
    p.add_argument("--act", default="swiglu", choices=["swiglu", "gelu", "relu"])
    p.add_argument("--quick", action="store_true",
                   help="only the default, fp8-dgrad and fp8-dgrad + fp8-wgrad variants")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_experts: needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, fp8a2a {fp8a2a.__version__}, "
          f"{args.experts} experts x {args.rows} rows, {args.act}", flush=True)
    results = []
    for name in args.shapes:
        results += run_shape(name, *SHAPES[name], args)
    hdr = f"{'shape':9} {'variant':48} {'fwd ms':>7} {'fwd x':>6} {'f+b ms':>7} {'f+b x':>6} {'saved MB':>9} {'fc1 in MB':>9} {'requant ms':>10}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        print(f"{r['shape']:9} {r['variant']:48} {r['fwd_ms']:7.3f} {r.get('fwd_x', 1):6.2f} {r['fwd_bwd_ms']:7.3f} "
              f"{r.get('fwd_bwd_x', 1):6.2f} {r['saved_mb']:9.1f} {r['fc1_in_mb']:9.1f} {r.get('weight_requant_ms', 0):10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
