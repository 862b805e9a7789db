#!/usr/bin/env python
"""MoE layer benchmark: fp8a2a dispatch -> FP8GroupedMLP -> combine, forward and backward, against
the BF16 path a Megatron user has today, in the same run, on DeepSeek-V3, Mixtral and Qwen3 expert
shapes.

    python benchmarks/bench_moe_layer.py [--json out.json]            # one GPU (world size 1)
    torchrun --nproc-per-node 8 benchmarks/bench_moe_layer.py         # expert parallel over 8 GPUs

BF16 paths: megatron-core's MoEAlltoAllTokenDispatcher + a BF16 grouped MLP on torch._grouped_mm
(GPU with megatron-core importable), and always the plain-torch replica of that dispatcher
(fp8a2a.bench.MegatronStyleAlltoAll) + the same grouped MLP. Router probs are applied inside the
MLP's activation on every path (Megatron's place); the weights are shared by all paths.
Also: eager against CUDA-graph replay (the Dispatcher's capacity mode) at a small size.
Target on one H200 at world size 1: fp8a2a >= 1.8x forward+backward at the DeepSeek shape
(4096 tokens, 256 experts, top-8, 7168 -> 2048), by the best FP8 path (default; fp8_dgrad; fp8_bwd =
fp8_dgrad + fp8_wgrad), the default path's ratio reported next to it. Without a GPU it runs small
shapes on the CPU (functional numbers only)."""
import argparse
import importlib.util
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8a2a
from fp8a2a.bench import costs, single_process_group
from fp8a2a.bench import MegatronStyleAlltoAll, capture_cuda_graph, cuda_median_ms, make_routing, percentile

TARGET_SPEEDUP = 1.8
# FP8GroupedMLP options timed next to the default "fp8" path: fp8_dgrad, and fp8_bwd (fp8_dgrad + fp8_wgrad)
FP8_OPTION_PATHS = ("fp8_dgrad", "fp8_bwd")
# name: (tokens per rank, experts, top-k, hidden, expert ffn)
GPU_SHAPES = {
    "deepseek-v3": (4096, 256, 8, 7168, 2048),
    "mixtral-8x7b": (4096, 8, 2, 4096, 14336),
    "qwen3-235b": (4096, 128, 8, 4096, 1536),
}
CPU_SHAPES = {  # same structure, scaled down: functional only
    "deepseek-v3-tiny": (128, 32, 8, 256, 64),
    "mixtral-tiny": (128, 8, 2, 256, 512),
    "qwen3-tiny": (128, 16, 8, 256, 96),
}
GRAPH_SHAPE = (256, 32, 4, 2048, 1024)


# ------------------------------------------------------------------------------------------
# the BF16 expert MLP (what Megatron's grouped MLP computes), on torch._grouped_mm

def bf16_grouped_mlp(rows, tokens_per_expert, probs, fc1, fc2):
    """rows [N, H] bf16 expert-major; fc1 [E, 2F, H] (gate rows, then up), fc2 [E, H, F]."""
    offs = torch.cumsum(torch.as_tensor(tokens_per_expert).to(rows.device, non_blocking=True), 0,
                        dtype=torch.int32)
    z = torch._grouped_mm(rows, fc1.transpose(-2, -1), offs=offs)
    gate, up = z.chunk(2, dim=-1)
    a = (F.silu(gate.float()) * up.float() * probs.float().unsqueeze(-1)).to(torch.bfloat16)
    return torch._grouped_mm(a, fc2.transpose(-2, -1), offs=offs)


# ------------------------------------------------------------------------------------------
# paths

class Paths:
    def __init__(self, shape, device, group, rank, world, fp8_backend="auto"):
        T, E, K, H, Fh = shape
        self.shape, self.device, self.world = shape, device, world
        if E % world:
            raise ValueError(f"{E} experts do not split over {world} ranks")
        L = E // world
        g = torch.Generator().manual_seed(1234 + rank)
        self.x = (torch.randn(T, H, generator=g) * 0.5).to(device=device, dtype=torch.bfloat16)
        self.idx, w, self.rmap, probs = make_routing(T, E, K, device, seed=99 + rank)
        self.w, self.probs = w.requires_grad_(), probs.requires_grad_()
        self.gy = (torch.randn(T, H, generator=g) * 0.01).to(device=device, dtype=torch.bfloat16)
        self.mlp = fp8a2a.FP8GroupedMLP(L, H, Fh, "swiglu", backend=fp8_backend, device=device)
        self.fc1, self.fc2 = self.mlp.fc1_weight, self.mlp.fc2_weight
        # the same experts with FP8 input-gradient GEMMs (fp8_dgrad), and with FP8 input- and
        # weight-gradient GEMMs (fp8_bwd: fp8_dgrad + fp8_wgrad); shared weights
        self.mlp_fp8_dgrad = self._shared_mlp(fp8_backend, fp8_dgrad=True)
        self.mlp_fp8_bwd = self._shared_mlp(fp8_backend, fp8_dgrad=True, fp8_wgrad=True)
        self.disp = fp8a2a.Dispatcher(E, group)
        self.replica = MegatronStyleAlltoAll(E, group)
        self.megatron = None
        self.megatron_note = None

    def _shared_mlp(self, backend, **options):
        _, _, _, H, Fh = self.shape
        m = fp8a2a.FP8GroupedMLP(self.mlp.num_local_experts, H, Fh, "swiglu", backend=backend, device="meta", **options)
        m.fc1_weight, m.fc2_weight = self.fc1, self.fc2
        return m

    def _x(self):
        return self.x.detach().requires_grad_()

    def _zero(self):
        self.fc1.grad = self.fc2.grad = None
        self.w.grad = self.probs.grad = None

    def fp8(self, mlp=None):
        x = self._x()
        out = self.disp.dispatch(x, self.idx, self.w)
        h = (mlp or self.mlp)(out.tokens, out.tokens_per_expert, router_weights=out.weights)
        return x, self.disp.combine(h, out.handle, apply_weights=False)

    def fp8_dgrad(self):
        return self.fp8(self.mlp_fp8_dgrad)

    def fp8_bwd(self):
        return self.fp8(self.mlp_fp8_bwd)

    def replica_bf16(self):
        x = self._x()
        rows, tpe, p = self.replica.dispatch(x, self.rmap, self.probs)
        h = bf16_grouped_mlp(rows, tpe, p, self.fc1, self.fc2)
        return x, self.replica.combine(h)

    def megatron_bf16(self):
        x = self._x()
        d = self.megatron
        if hasattr(d, "dispatch_preprocess"):
            tok, p = d.dispatch_preprocess(x, self.rmap, self.probs)
            tok, p = d.token_dispatch(tok, p)
            tok, tpe, p = d.dispatch_postprocess(tok, p)
            h = bf16_grouped_mlp(tok, tpe, p, self.fc1, self.fc2)
            h = d.combine_preprocess(h)
            h = d.token_combine(h)
            return x, d.combine_postprocess(h)
        tok, tpe, p = d.token_permutation(x, self.probs, self.rmap)  # older megatron-core
        h = bf16_grouped_mlp(tok, tpe, p, self.fc1, self.fc2)
        y, _ = d.token_unpermutation(h, None)
        return x, y


def make_megatron_dispatcher(shape, world):
    """megatron-core's MoEAlltoAllTokenDispatcher, or (None, why not)."""
    T, E, K, H, Fh = shape
    try:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as e:  # noqa: BLE001 - optional baseline
        return None, f"megatron-core not importable ({type(e).__name__}: {str(e)[:120]})"
    try:
        if not dist.is_initialized():
            return None, "needs torch.distributed (run under torchrun, or on a GPU at world size 1)"
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=Fh,
                                moe_ffn_hidden_size=Fh, num_moe_experts=E, moe_router_topk=K,
                                moe_token_dispatcher_type="alltoall", bf16=True, params_dtype=torch.bfloat16,
                                add_bias_linear=False, expert_model_parallel_size=world,
                                use_cpu_initialization=True)
        L = E // world
        first = parallel_state.get_expert_model_parallel_rank() * L
        kw = {}
        params = inspect.signature(MoEAlltoAllTokenDispatcher.__init__).parameters
        if "pg_collection" in params:
            from megatron.core.process_groups_config import ProcessGroupCollection
            kw["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["ep", "expt_tp", "tp_ep", "tp"])
        d = MoEAlltoAllTokenDispatcher(L, list(range(first, first + L)), config=cfg, **kw)
        return d, None
    except Exception as e:  # noqa: BLE001
        return None, f"megatron-core dispatcher could not be built ({type(e).__name__}: {str(e)[:160]})"


# ------------------------------------------------------------------------------------------
# timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_paths(paths: Paths, names, iters, warmup):
    """Per path: forward ms, backward ms, host us per step (medians), alternating order."""
    dev = paths.device
    cuda = dev.type == "cuda"
    res = {n: [] for n in names}
    for it in range(warmup + iters):
        shift = it % len(names)
        for n in names[shift:] + names[:shift]:
            paths._zero()
            _sync(dev)
            if cuda:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
            h0 = time.perf_counter()
            x, y = getattr(paths, n)()
            h1 = time.perf_counter()
            if cuda:
                ev[1].record()
            y.backward(paths.gy)
            h2 = time.perf_counter()
            if cuda:
                ev[2].record()
            _sync(dev)
            if it < warmup:
                continue
            f_ms, b_ms = (ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])) if cuda else \
                ((h1 - h0) * 1e3, (h2 - h1) * 1e3)
            res[n].append((f_ms, b_ms, (h2 - h0) * 1e6))
    out = {}
    for n, rows in res.items():
        t = torch.tensor(rows, dtype=torch.float64, device=dev)
        if paths.world > 1:
            every = [torch.empty_like(t) for _ in range(paths.world)]
            dist.all_gather(every, t)
            t = torch.stack(every).amax(0)
        rows = t.cpu().tolist()
        out[n] = {"fwd_ms": percentile([r[0] for r in rows], 50), "bwd_ms": percentile([r[1] for r in rows], 50),
                  "fwd_bwd_ms": percentile([r[0] + r[1] for r in rows], 50),
                  "fwd_bwd_ms_p10": percentile([r[0] + r[1] for r in rows], 10),
                  "fwd_bwd_ms_p90": percentile([r[0] + r[1] for r in rows], 90),
                  "host_us": percentile([r[2] for r in rows], 50)}
    return out


def rel_err(paths: Paths, a, b):
    """Relative L2 distance of two paths' outputs (same inputs, same weights)."""
    with torch.no_grad():
        _, ya = getattr(paths, a)()
        _, yb = getattr(paths, b)()
        return ((ya.float() - yb.float()).norm() / yb.float().norm().clamp_min(1e-30)).item()


def graph_part(device, rank, world, iters, shape=None, capacity_factor=2.0):
    """Eager against CUDA-graph replay at a small size: the Dispatcher's capacity mode (static
    shapes, no host sync) lets a whole dispatch -> MLP -> combine step, forward and backward, be
    captured; the default mode (one host sync per dispatch) runs eagerly next to it."""
    shape = shape or GRAPH_SHAPE
    res = {"shape": dict(zip(("tokens", "experts", "topk", "hidden", "ffn"), shape)), "available": False}
    if device.type != "cuda":
        res["why"] = "not available: CUDA graphs need a GPU"
        return res
    if shape[1] % world:
        res["why"] = f"not available: {shape[1]} experts do not split over {world} ranks"
        return res
    p = Paths(shape, device, None, rank, world)
    p_cap = Paths(shape, device, None, rank, world)
    p_cap.disp = fp8a2a.Dispatcher(shape[1], capacity_factor=capacity_factor)
    res["capacity_factor"] = capacity_factor

    def step(paths):
        def run():
            paths._zero()
            _, y = paths.fp8()
            y.backward(paths.gy)
        return run

    def fwd(paths):
        def run():
            with torch.no_grad():
                return paths.fp8()[1]
        return run

    def clear_grads():
        p_cap.fc1.grad = p_cap.fc2.grad = None

    def capture(fn):
        return capture_cuda_graph(fn, warmup=3, before_capture=clear_grads)[0]

    try:
        res["eager_ms"] = cuda_median_ms(step(p), iters)
        res["eager_host_us"] = costs.host_us(step(p), 20)
        res["eager_fwd_ms"] = cuda_median_ms(fwd(p), iters)
        res["eager_capacity_ms"] = cuda_median_ms(step(p_cap), iters)
        res["eager_capacity_host_us"] = costs.host_us(step(p_cap), 20)
        res["eager_capacity_fwd_ms"] = cuda_median_ms(fwd(p_cap), iters)
    except Exception as e:  # noqa: BLE001
        res["why"] = f"eager step failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return res
    try:  # forward only first (what the capacity-mode tests capture), then forward + backward
        g = capture(fwd(p_cap))
        res["graph_fwd_ms"] = cuda_median_ms(g.replay, iters)
        res["graph_fwd_host_us"] = costs.host_us(g.replay, 50)
        res["available"] = True
        del g

        def fwd_bwd():
            _, y = p_cap.fp8()
            y.backward(p_cap.gy)
        g = capture(fwd_bwd)
        res["graph_ms"] = cuda_median_ms(g.replay, iters)
        res["graph_host_us"] = costs.host_us(g.replay, 50)
        res["graph_speedup_vs_eager"] = res["eager_ms"] / res["graph_ms"]
    except Exception as e:  # noqa: BLE001 - report why, keep the rest of the results
        what = "forward + backward" if res["available"] else "forward"
        res["why"] = f"{what} capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return res


# ------------------------------------------------------------------------------------------

def run(args):
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available() and not args.cpu
    if torchrun:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    elif cuda and args.megatron and importlib.util.find_spec("megatron") is not None:
        # megatron-core needs a process group even at world size 1
        single_process_group("nccl")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if any(k.startswith(s) for s in args.shapes)}
    iters = args.iters or (10 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    result = {"benchmark": "fp8a2a MoE layer (benchmarks/bench_moe_layer.py)", "functional_only": not cuda,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": world,
              "torch": torch.__version__, "iters": iters, "shapes": {}, "notes": []}
    for name, shape in shapes.items():
        T, E, K, H, Fh = shape
        rec = {"tokens": T, "experts": E, "topk": K, "hidden": H, "ffn": Fh}
        try:
            paths = Paths(shape, device, None, rank, world)
        except ValueError as e:
            rec["skipped"] = str(e)
            result["shapes"][name] = rec
            continue
        names = ["fp8", *FP8_OPTION_PATHS, "replica_bf16"]
        if cuda and args.megatron:
            paths.megatron, why = make_megatron_dispatcher(shape, world)
            if paths.megatron is None:
                result["notes"].append(f"{name}: megatron-core baseline skipped: {why}")
            else:
                names.append("megatron_bf16")
        elif args.megatron and "megatron-core baseline skipped: needs a GPU" not in result["notes"]:
            result["notes"].append("megatron-core baseline skipped: needs a GPU")
        for n in list(names):
            try:  # a path that cannot run here (missing CUDA kernels, refused GEMM shape) is reported
                paths._zero()
                _, y = getattr(paths, n)()
                y.backward(paths.gy)
            except Exception as e:  # noqa: BLE001
                rec[f"{n}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                names.remove(n)
        rec.update(time_paths(paths, names, iters, warmup) if names else {})
        base = "megatron_bf16" if "megatron_bf16" in names else "replica_bf16"
        rec["baseline"] = base
        if "fp8" in names and base in names:
            rec["speedup_fwd_bwd"] = rec[base]["fwd_bwd_ms"] / rec["fp8"]["fwd_bwd_ms"]
            rec["speedup_fwd"] = rec[base]["fwd_ms"] / rec["fp8"]["fwd_ms"]
            rec["rel_err_vs_bf16"] = rel_err(paths, "fp8", base)
        for n in FP8_OPTION_PATHS:
            if n in names and base in names:
                rec[f"speedup_fwd_bwd_{n}"] = rec[base]["fwd_bwd_ms"] / rec[n]["fwd_bwd_ms"]
        if "fp8" in names and "replica_bf16" in names:
            rec["speedup_fwd_bwd_vs_replica"] = rec["replica_bf16"]["fwd_bwd_ms"] / rec["fp8"]["fwd_bwd_ms"]
        result["shapes"][name] = rec
        del paths
        if cuda:
            torch.cuda.empty_cache()
    ds = next((v for k, v in result["shapes"].items() if k.startswith("deepseek")), None) or {}
    # the best FP8 path decides the target; the default path's ratio is reported next to it
    speedups = {n: ds.get("speedup_fwd_bwd" + ("" if n == "fp8" else f"_{n}")) for n in ("fp8", *FP8_OPTION_PATHS)}
    best = max((n for n in speedups if speedups[n] is not None), key=speedups.get, default=None)
    result["target"] = {"shape": "deepseek-v3", "target": TARGET_SPEEDUP, "path": best,
                        "value": speedups[best] if best else None, "default_value": speedups["fp8"],
                        "ok": bool(best and speedups[best] >= TARGET_SPEEDUP and world == 1)}
    result["graphs"] = graph_part(device, rank, world, iters) if not args.no_graph else {"why": "skipped (--no-graph)"}
    if not cuda:  # the small-size eager step on the CPU, for the record
        p = Paths(CPU_SHAPES["deepseek-v3-tiny"], device, None, rank, world)
        t = time_paths(p, ["fp8"], iters, warmup)["fp8"]
        result["graphs"].update(eager_ms=t["fwd_bwd_ms"], eager_host_us=t["host_us"],
                                shape=dict(zip(("tokens", "experts", "topk", "hidden", "ffn"),
                                               CPU_SHAPES["deepseek-v3-tiny"])))
    if rank == 0:
        print(format_table(result))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _f(v, spec=".2f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(res):
    label = "FUNCTIONAL NUMBERS ONLY (CPU)" if res["functional_only"] else res["device"]
    lines = [f"fp8a2a MoE layer (dispatch -> grouped MLP -> combine, forward + backward), world size {res['world']}, "
             f"{label}; median of {res['iters']} steps",
             f"{'shape':<18}{'T':>6}{'E':>5}{'K':>3}{'H->F':>12} | {'path':<14}{'fwd ms':>9}{'bwd ms':>9}"
             f"{'f+b ms [p10,p90]':>26}{'host us':>10}"]
    lines.append("-" * len(lines[-1]))
    for name, r in res["shapes"].items():
        head = f"{name:<18}{r['tokens']:>6}{r['experts']:>5}{r['topk']:>3}{str(r['hidden']) + '->' + str(r['ffn']):>12}"
        if r.get("skipped"):
            lines.append(f"{head} | skipped: {r['skipped']}")
            continue
        first = True
        for path in ("megatron_bf16", "replica_bf16", "fp8", *FP8_OPTION_PATHS):
            t = r.get(path)
            if t is None:
                continue
            span = f"{t['fwd_bwd_ms']:.3f} [{t['fwd_bwd_ms_p10']:.3f},{t['fwd_bwd_ms_p90']:.3f}]"
            lines.append(f"{head if first else ' ' * len(head)} | {path:<14}{t['fwd_ms']:>9.3f}{t['bwd_ms']:>9.3f}"
                         f"{span:>26}{t['host_us']:>10.0f}")
            first = False
        for k, v in r.items():
            if k.endswith("_error"):
                lines.append(f"{' ' * len(head)} | {k}: {v}")
        extra = f" (vs replica_bf16 {_f(r.get('speedup_fwd_bwd_vs_replica'))}x)" \
            if r.get("baseline") == "megatron_bf16" else ""
        lines.append(f"{' ' * len(head)} | speedup vs {r.get('baseline', '-')}: fwd+bwd {_f(r.get('speedup_fwd_bwd'))}x"
                     f"{extra}, fwd {_f(r.get('speedup_fwd'))}x, fwd+bwd with fp8_dgrad "
                     f"{_f(r.get('speedup_fwd_bwd_fp8_dgrad'))}x, with fp8_bwd (fp8_dgrad + fp8_wgrad) "
                     f"{_f(r.get('speedup_fwd_bwd_fp8_bwd'))}x; output rel. error vs BF16 "
                     f"{_f(r.get('rel_err_vs_bf16'), '.4f')}")
    t = res["target"]
    lines.append(f"target: >= {t['target']}x forward+backward at {t['shape']} (one GPU, world size 1): "
                 f"{_f(t['value'])}x with {t['path'] or '-'} {'PASS' if t['ok'] else 'FAIL'} "
                 f"(default path {_f(t['default_value'])}x)"
                 + (" (functional run: not meaningful)" if res["functional_only"] else ""))
    g = res["graphs"]
    line = f"small size {g.get('shape', '-')}: eager fwd+bwd {_f(g.get('eager_ms'), '.3f')} ms, host " \
           f"{_f(g.get('eager_host_us'), '.0f')} us/step"
    if g.get("available"):
        line += (f", forward {_f(g.get('eager_fwd_ms'), '.3f')} ms; capacity mode eager {_f(g.get('eager_capacity_ms'), '.3f')}"
                 f" ms (forward {_f(g.get('eager_capacity_fwd_ms'), '.3f')}), host {_f(g.get('eager_capacity_host_us'), '.0f')}"
                 f" us; CUDA-graph replay: forward {_f(g.get('graph_fwd_ms'), '.3f')} ms (host "
                 f"{_f(g.get('graph_fwd_host_us'), '.0f')} us), forward+backward {_f(g.get('graph_ms'), '.3f')} ms (host "
                 f"{_f(g.get('graph_host_us'), '.0f')} us, {_f(g.get('graph_speedup_vs_eager'))}x the default eager step)")
        if g.get("why"):
            line += f"; {g['why']}"
    else:
        line += f"; CUDA-graph replay: {g.get('why')}"
    lines.append(line)
    for n in res["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: s.split(","), help="deepseek,mixtral,qwen3 (prefixes)")
    p.add_argument("--iters", type=int, help="timed steps (default 10 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--no-megatron", dest="megatron", action="store_false",
                   help="skip the megatron-core baseline (the plain-torch replica always runs)")
    p.add_argument("--no-graph", action="store_true", help="skip the eager vs CUDA-graph part")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU (functional)")
    p.add_argument("--json", help="write the results here")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
