"""Issue 33: one H200 as one rank of EP=n over its PCIe link (the emulated InfiniBand rail) and over
a device copy (the NVLink-class bound): the training-step exchange of fp8a2a against its own BF16
wire and against Megatron's `alltoall` dispatcher with TE's permute fusion.

Cases (per-rank loads, 4096 tokens per rank, uniform random routing): DeepSeek-V3 (256 experts,
top-8, hidden 7168) at EP=8/32/64, Qwen3-235B (128, top-8, 4096) at EP=8/16, Mixtral-8x7B (8,
top-2, 4096) at EP=8. Each case runs in a loopback world of EP ranks (fp8a2a.loopback, this
process rank 0) with Megatron's parallel_state initialized on it (expert_model_parallel_size=EP),
over links none, device and pcie. Variants: fp8a2a.bench.loopback's (dispatch forward, dispatch
fwd+bwd, dispatch+combine fwd+bwd with default precisions, all-FP8, BF16 wire) plus

  step/megatron_fused  megatron-core's MoEAlltoAllTokenDispatcher, moe_permute_fusion=True (TE),
                       dropless, dispatch + combine fwd+bwd, unchanged on the loopback group (its
                       probs multiply the stand-in expert's output, as its experts do)

A row that cannot be built says why; the steps' ratios then use the BF16 wire as the baseline.
Every figure: device time per call, median of each run, median [min-max] over --repeat runs (the
variants' order rotating), ratios per run. Printed with each row: bytes on the link per step, the
link's bandwidth measured alone at those message sizes, the additive model's prediction
(time over `none` + measured link time per message).

Not measured here (TODO, issue 33): the TE-spec MoELayer fwd+bwd (fp8_alltoall with
fp8_experts_spec against alltoall + TE FP8 blockwise) on the loopback group.

    python benchmarks/bench_loopback.py --tests --json results/bench_loopback.json  # ~4 min on an H200
    python benchmarks/bench_loopback.py --quick                                # 2 cases, fewer calls
    python benchmarks/bench_loopback.py --cpu                                  # functional, tiny shapes
--tests first runs tests/gpu/test_loopback_cuda.py (the links move the right bytes; fp8a2a and
Megatron on the group equal world size 1) and records its outcome in the JSON.
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch

from fp8a2a import loopback
from fp8a2a.bench import loopback as lb

POINTS = [("deepseek-v3", 8), ("deepseek-v3", 32), ("deepseek-v3", 64), ("qwen3-235b", 8), ("qwen3-235b", 16),
          ("mixtral-8x7b", 8)]
QUICK = [("deepseek-v3", 32), ("mixtral-8x7b", 8)]
LINKS = ["none", "device", "pcie"]


def _reason(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def megatron_versions():
    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core
        out["megatron_core"] = megatron.core.__version__
    except Exception as e:  # noqa: BLE001
        out["megatron_core"] = f"not importable ({_reason(e)})"
    try:
        import transformer_engine
        out["transformer_engine"] = transformer_engine.__version__
    except Exception as e:  # noqa: BLE001
        out["transformer_engine"] = f"not importable ({_reason(e)})"
    return out


def megatron_variant(fused: bool, parallel_error=None) -> lb.Variant:
    """Megatron's MoEAlltoAllTokenDispatcher on the running world (parallel_state initialized at its
    EP), dispatch + combine forward + backward."""
    def build(inp: lb.Inputs):
        if parallel_error:
            raise RuntimeError(f"parallel_state.initialize_model_parallel failed on the loopback group: "
                               f"{parallel_error}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
            from megatron.core.transformer.transformer_config import TransformerConfig
        if fused:
            import transformer_engine  # noqa: F401 - moe_permute_fusion needs it
        c = inp.case
        cfg = TransformerConfig(num_layers=1, hidden_size=c.hidden, num_attention_heads=8, num_moe_experts=c.experts,
                                moe_router_topk=c.topk, moe_token_dispatcher_type="alltoall", moe_permute_fusion=fused,
                                bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False)
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep", "tp"])
        ep, rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        local = c.experts // ep
        d = MoEAlltoAllTokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), cfg, pg_collection=pgs)
        outs = {}

        def step():
            hs, pr = d.dispatch_preprocess(inp.x, inp.rmap, inp.probs)
            hs, pr = d.token_dispatch(hs, pr)
            hs, _, pr = d.dispatch_postprocess(hs, pr)
            out = lb.expert_stand_in(hs, outs) * pr.unsqueeze(-1).to(hs.dtype)
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
            inp.x.grad = inp.probs.grad = None
            y.backward(inp.gy)
            return y
        return step
    how = "fused" if fused else "unfused"
    return lb.Variant(f"step/megatron_{how}", f"Megatron MoEAlltoAllTokenDispatcher ({how} permute), BF16",
                      lb.precision("bf16", "bf16", "bf16", "bf16"), build)


def init_parallel(ep):
    """Megatron's parallel_state at EP=ep on the loopback world: None, or why it failed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
        ps.initialize_model_parallel(expert_model_parallel_size=ep, create_gloo_process_groups=False)
        return None
    except Exception as e:  # noqa: BLE001
        return _reason(e)


def destroy_parallel():
    try:
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    except Exception:  # noqa: BLE001
        pass


def link_check(device):
    """Each link moves the bytes of an uneven all_to_all_single exactly (in a world of 8)."""
    out = {}
    loopback.init(8, rank=3, link="none", pcie_chunk_bytes=None)
    try:
        import torch.distributed as dist
        splits = [3, 0, 17, 5, 250, 1, 64, 9]
        x = torch.randint(0, 255, (sum(splits), 7168 + 16), dtype=torch.uint8, device=device)
        for link in LINKS:
            loopback.set_link(link)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x, splits, splits)
            out[link] = bool(torch.equal(x, y))
    finally:
        loopback.destroy()
    return out


def gpu_tests(timeout=150):
    """tests/gpu/test_loopback_cuda.py in a process of its own: exit code and the summary's tail."""
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/gpu/test_loopback_cuda.py", "-m", "gpu"]
    try:
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        out = {"rc": p.returncode, "tail": (p.stdout + p.stderr).strip().splitlines()[-25:]}
    except subprocess.TimeoutExpired:
        out = {"rc": None, "tail": [f"timed out after {timeout} s"]}
    print("bench_loopback: GPU tests:\n" + "\n".join(out["tail"]), file=sys.stderr, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the document here")
    ap.add_argument("--quick", action="store_true", help=f"cases {QUICK}, 4 calls per run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, help="timed calls per variant per run (default 8, --quick 4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--points", help="comma-separated model@EP, e.g. deepseek-v3@32 (default: all)")
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="start no new case after this many seconds (the rest are recorded as skipped)")
    ap.add_argument("--cpu", action="store_true", help="functional run on the CPU: tiny shapes, numbers meaningless")
    ap.add_argument("--tests", action="store_true", help="run tests/gpu/test_loopback_cuda.py first (in the JSON)")
    args = ap.parse_args()
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_loopback: needs a CUDA GPU (or --cpu for a functional run)")
    if cuda:
        torch.cuda.set_device(0)
    else:
        from fp8a2a.megatron.standalone import cpu_current_device
        cpu_current_device()
        args.no_megatron = True  # Megatron's alltoall dispatcher needs CUDA streams (tests/test_loopback.py shims them)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    iters = args.iters or (4 if args.quick else 8)
    links = [lk for lk in args.links.split(",") if lk]
    points = QUICK if args.quick else POINTS
    if args.points:
        want = set(args.points.split(","))
        points = [p for p in POINTS if f"{p[0]}@{p[1]}" in want]
    t0 = time.time()
    tests = gpu_tests() if args.tests else None
    versions = megatron_versions()
    doc = {"benchmark": "loopback EP over PCIe / device links (benchmarks/bench_loopback.py)",
           "label": "one GPU, loopback EP=n over PCIe (emulated InfiniBand rail)",
           "functional_only": not cuda, "device": torch.cuda.get_device_name() if cuda else "CPU",
           "torch": torch.__version__, **versions, "timing": lb.TIMING, "repeat": args.repeat, "iters": iters,
           "warmup": args.warmup, "links": links, "link_check": link_check(device), "gpu_tests": tests, "cases": [],
           "todo": "TE-spec MoELayer fwd+bwd (fp8_alltoall + fp8_experts_spec vs alltoall + TE FP8 blockwise) "
                   "on the loopback group: not measured yet"}
    print(f"bench_loopback: link check {doc['link_check']}", file=sys.stderr)
    lt = lb.LinkTimes(device)
    by_ep = {}
    for model, ep in points:
        by_ep.setdefault(ep, []).append(model)
    for ep, models in by_ep.items():
        loopback.init(ep, rank=0, link="none")
        try:
            perr = None if args.no_megatron else init_parallel(ep)
            variants = lb.default_variants(megatron_style=not cuda)
            if not args.no_megatron:
                variants.append(megatron_variant(True, perr))
            for model in models:
                case = lb.Case.of(model, ep)
                if not cuda:
                    case = lb.Case(model, ep, 32, 256, case.experts, case.topk)
                if time.time() - t0 > args.budget_s:
                    doc["cases"].append({"case": vars(case), "skipped": f"over the {args.budget_s:g} s budget"})
                    print(f"== {case.name}: skipped (budget)")
                    continue
                res = lb.run_case(case, links, variants, repeat=args.repeat, iters=iters, warmup=args.warmup,
                                  device=device, link_times=lt)
                res["seconds"] = time.time() - t0
                doc["cases"].append(res)
                print(lb.format_case(res, links), flush=True)
                if cuda:
                    torch.cuda.empty_cache()
        finally:
            if not args.no_megatron:
                destroy_parallel()
            loopback.destroy()
    doc["link_measurements"] = lt.table()
    print(lb.format_links(doc["link_measurements"]))
    doc["seconds"] = time.time() - t0
    print(f"bench_loopback: {doc['seconds']:.0f} s; TODO: {doc['todo']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
