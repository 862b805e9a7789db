#!/usr/bin/env python
"""GPU check of the Megatron adapter: a full megatron-core MoELayer (router, dispatcher, experts)
with --moe-token-dispatcher-type fp8_alltoall against the same layer (same weights, same input)
with Megatron's own `alltoall`, forward and backward, at EP=1 on one GPU (NCCL world size 1).
Prints one line per check with relative L2 errors and PASS/FAIL, then PASS or FAIL (exit code).

    python scripts/gpu_megatron_check.py                 # megatron-core 0.19.2, torch 2.11, one H200
    python scripts/gpu_megatron_check.py --tokens 8192 --hidden 2048
    python scripts/gpu_megatron_check.py --device cpu --tokens 256 --hidden 256 --no-time   # dry run
    (on CPU the reference is Megatron's allgather dispatcher: alltoall needs CUDA streams)

Checks: FP8 wire (row / block128 / tensor scales) with Megatron's SequentialMLP experts; the
unquantized wire (must match alltoall to bf16 rounding); drop-and-pad (fp8a2a's capacity mode vs
alltoall's drop-and-pad); overlapped shared experts; the FP8 experts spec (FP8GroupedMLP on the FP8
rows) against alltoall + SequentialMLP; TEGroupedMLP experts where TransformerEngine is installed;
megatron.training's parser where it is installed. Also times forward+backward of each variant
(EP=1: there is no communication to save here; the timings show the overhead of the adapter).
"""
import argparse
import datetime
import functools
import os
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8a2a.megatron as fm  # noqa: E402

RAW = 1 << 40


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


DEVICE = "cuda"
REFERENCE = "alltoall"


def setup(device):
    global DEVICE, REFERENCE
    DEVICE = device
    warnings.filterwarnings("ignore")
    fm.register()
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        from fp8a2a.megatron.testing import cpu_current_device
        cpu_current_device()
        REFERENCE = "allgather"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(minutes=5))
    from megatron.core import parallel_state as ps, tensor_parallel
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(123, inference_rng_tracker=device == "cpu")


def make_config(a, dispatcher, **over):
    from megatron.core.transformer import TransformerConfig
    fp8 = {k: over.pop(k) for k in list(over) if k.startswith("fp8a2a_")}
    kw = dict(num_layers=1, hidden_size=a.hidden, num_attention_heads=8, ffn_hidden_size=a.ffn,
              num_moe_experts=a.experts, moe_router_topk=a.topk, moe_token_dispatcher_type=dispatcher,
              moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss", add_bias_linear=False,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu, bf16=True,
              params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, moe_router_dtype="fp32")
    kw.update(over)
    cfg = TransformerConfig(**kw)
    for k, v in fp8.items():
        setattr(cfg, k, v)
    return cfg


def moe_spec(a, use_te=False, grouped=False):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    spec = get_moe_module_spec(use_te=use_te, num_experts=a.experts, moe_grouped_gemm=grouped)
    if DEVICE == "cpu":
        from fp8a2a.megatron.testing import with_portable_router
        spec = with_portable_router(spec)
    return spec


def build(spec, cfg):
    from megatron.core.transformer.spec_utils import build_module
    if isinstance(spec, functools.partial):  # megatron-core >= 0.19
        layer = spec(config=cfg)
    else:
        layer = build_module(spec, config=cfg)
    return layer.to(DEVICE)


def run(layer, x, G):
    xi = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, bias = layer(xi)
    assert bias is None
    (y.float() * G.float()).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad.detach(), grads


def timed(layer, x, G, iters):
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    for _ in range(3):
        run(layer, x, G)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        xi = x.detach().clone().requires_grad_()
        y, _ = layer(xi)
        y.backward(G)
    sync()
    return (time.perf_counter() - t) / iters * 1e3


def compare(a, name, mine_over, ref_over=None, tol=None, mine_spec=None, ref_spec=None, expect=None):
    """Builds the alltoall reference and the fp8_alltoall layer with the same weights; returns a result line."""
    ref_over = dict(ref_over if ref_over is not None else {k: v for k, v in mine_over.items()
                                                           if not k.startswith("fp8a2a_")})
    torch.manual_seed(1)
    ref = build(ref_spec or moe_spec(a), make_config(a, REFERENCE, **ref_over))
    mine = build(mine_spec or moe_spec(a), make_config(a, fm.FP8_ALLTOALL, **mine_over))
    from fp8a2a.megatron.dispatcher import FP8AlltoAllTokenDispatcher
    assert isinstance(mine.token_dispatcher, FP8AlltoAllTokenDispatcher), type(mine.token_dispatcher)
    assert list(mine.state_dict()) == list(ref.state_dict()), "parameter layouts differ"
    mine.load_state_dict(ref.state_dict())
    seen = {}

    def hook(module, args):
        seen["tokens"] = type(args[0]).__name__
        seen["tpe"] = torch.as_tensor(args[1]).tolist()
    mine.experts.register_forward_pre_hook(hook)

    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(a.seq, a.tokens // a.seq, a.hidden, device=DEVICE, generator=g, dtype=torch.bfloat16)
    G = torch.randn(x.shape, device=DEVICE, generator=g, dtype=torch.bfloat16)
    y0, gx0, gp0 = run(ref, x, G)
    y1, gx1, gp1 = run(mine, x, G)
    err = {"y": rel(y1, y0), "x.grad": rel(gx1, gx0)}
    router = [n for n in gp0 if "router" in n]
    experts = [n for n in gp0 if "router" not in n]
    err["router.grad"] = max(rel(gp1[n], gp0[n]) for n in router)
    err["expert grads (max)"] = max(rel(gp1[n], gp0[n]) for n in experts)
    tol = tol or {}
    ok = all(err[k] <= tol.get(k, tol.get("*", 0.0)) for k in err) and set(gp0) == set(gp1)
    if expect is not None:
        problem = expect(seen, mine)
        ok = ok and problem is None
    else:
        problem = None
    ms = None
    if a.time:
        ms = (timed(ref, x, G, a.iters), timed(mine, x, G, a.iters))
    line = f"{'PASS' if ok else 'FAIL'}  {name:38s} " + "  ".join(f"{k} {v:.4f}" for k, v in err.items())
    line += f"  | experts got {seen.get('tokens')}"
    if ms:
        line += f"  | fwd+bwd ms {REFERENCE} {ms[0]:.2f} fp8_alltoall {ms[1]:.2f}"
    if problem:
        line += f"  | {problem}"
    del ref, mine
    torch.cuda.empty_cache()
    return ok, line


FP8_TOL = {"y": 0.05, "x.grad": 0.06, "router.grad": 0.1, "expert grads (max)": 0.08}
FP8_EXPERTS_TOL = {"y": 0.08, "x.grad": 0.1, "router.grad": 0.15, "expert grads (max)": 0.1}
RAW_TOL = {"*": 0.01}


def check_parser():
    try:
        from megatron.training import arguments
    except Exception as e:  # noqa: BLE001
        return True, f"SKIP  megatron.training parser: not importable ({type(e).__name__}: {e})"
    old = sys.argv
    sys.argv = ["x", "--moe-token-dispatcher-type", "fp8_alltoall", "--fp8a2a-granularity", "block128",
                "--fp8a2a-bf16-below-bytes", "0", "--num-experts", "8"]
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = old
    ok = args.moe_token_dispatcher_type == "fp8_alltoall" and args.fp8a2a_granularity == "block128"
    opts = fm.resolve(args)
    return ok, f"{'PASS' if ok else 'FAIL'}  megatron.training parser accepts fp8_alltoall; options {opts}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-time", dest="time", action="store_false")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    setup(a.device)
    import megatron.core
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (reference: allgather)"
    print(f"torch {torch.__version__}, megatron-core {getattr(megatron.core, '__version__', '?')}, "
          f"{gpu}, tokens {a.tokens} hidden {a.hidden} ffn {a.ffn} experts {a.experts} "
          f"top-{a.topk}, EP=1", flush=True)
    fp8 = {"fp8a2a_bf16_below_bytes": 0}
    results = []

    def static_rows(factor):
        cap = -(-a.tokens * a.topk * factor // a.experts)

        def expect(seen, mine):
            want = [int(cap)] * a.experts
            return None if seen.get("tpe") == want else f"tokens_per_expert {seen.get('tpe')[:4]}... != {want[:4]}..."
        return expect

    def fp8_input(seen, mine):
        return None if seen.get("tokens") == "QuantizedTensor" and mine.token_dispatcher.deliver_fp8 else \
            "the FP8 experts did not receive FP8 rows"

    checks = [
        ("fp8 row, SequentialMLP", dict(fp8), FP8_TOL, None),
        ("fp8 block128, SequentialMLP", dict(fp8, fp8a2a_granularity="block128"), FP8_TOL, None),
        ("fp8 tensor, SequentialMLP", dict(fp8, fp8a2a_granularity="tensor"), FP8_TOL, None),
        ("unquantized wire, SequentialMLP", {"fp8a2a_bf16_below_bytes": RAW}, RAW_TOL, None),
        ("drop-and-pad (capacity mode) vs alltoall", dict(fp8, moe_expert_capacity_factor=1.0,
                                                          moe_pad_expert_input_to_capacity=True), FP8_TOL,
         static_rows(1.0)),
        ("drop-and-pad, variable, unquantized", dict(moe_expert_capacity_factor=1.0,
                                                     moe_pad_expert_input_to_capacity=True,
                                                     fp8a2a_capacity_mode="variable",
                                                     fp8a2a_bf16_below_bytes=RAW), RAW_TOL, None),
        ("shared experts, unquantized", dict(moe_shared_expert_intermediate_size=a.ffn,
                                            fp8a2a_bf16_below_bytes=RAW), RAW_TOL, None),
        ("shared experts overlapped, unquantized", dict(moe_shared_expert_intermediate_size=a.ffn,
                                                        moe_shared_expert_overlap=True,
                                                        fp8a2a_bf16_below_bytes=RAW), RAW_TOL, None),
        ("shared experts overlapped, fp8", dict(fp8, moe_shared_expert_intermediate_size=a.ffn,
                                                moe_shared_expert_overlap=True), FP8_TOL, None),
    ]
    for name, over, tol, expect in checks:
        if "overlapped" in name and a.device == "cpu":
            print(f"SKIP  {name}: needs CUDA streams", flush=True)
            continue
        try:
            results.append(compare(a, name, over, tol=tol, expect=expect))
        except Exception:  # noqa: BLE001
            results.append((False, f"FAIL  {name}: {traceback.format_exc()}"))
        print(results[-1][1], flush=True)

    # FP8 experts: fp8a2a.megatron.fp8_experts_spec (FP8GroupedMLP on the FP8 rows)
    for name, over in [("FP8 experts spec (FP8GroupedMLP), fp8", dict(fp8)),
                       ("FP8 experts spec, block128", dict(fp8, fp8a2a_granularity="block128"))]:
        try:
            spec = fm.fp8_experts_spec(moe_spec(a))
            results.append(compare(a, name, over, tol=FP8_EXPERTS_TOL, mine_spec=spec, expect=fp8_input))
        except Exception:  # noqa: BLE001
            results.append((False, f"FAIL  {name}: {traceback.format_exc()}"))
        print(results[-1][1], flush=True)

    # TEGroupedMLP, where TransformerEngine exists
    try:
        import transformer_engine  # noqa: F401
        have_te = True
    except Exception:  # noqa: BLE001
        have_te = False
    if have_te:
        for name, spec_fn in [("fp8, TEGroupedMLP", lambda: moe_spec(a, True, True)),
                              ("FP8 experts spec over TEGroupedMLP", lambda: fm.fp8_experts_spec(moe_spec(a, True, True)))]:
            try:
                results.append(compare(a, name, dict(fp8), tol=FP8_EXPERTS_TOL, mine_spec=spec_fn(),
                                       ref_spec=moe_spec(a, True, True)))
            except Exception:  # noqa: BLE001
                results.append((False, f"FAIL  {name}: {traceback.format_exc()}"))
            print(results[-1][1], flush=True)
    else:
        print("SKIP  TEGroupedMLP checks: transformer_engine is not installed", flush=True)

    try:
        results.append(check_parser())
    except Exception:  # noqa: BLE001
        results.append((False, f"FAIL  megatron.training parser: {traceback.format_exc()}"))
    print(results[-1][1], flush=True)

    ok = all(r[0] for r in results)
    print("PASS" if ok else "FAIL", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
