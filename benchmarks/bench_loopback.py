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

--layer (alone, instead of the exchange matrix): Megatron's TE-spec MoELayer, forward + backward,
on the loopback group at DeepSeek-V3's EP=32 (4096 tokens x 7168, ffn 2048, 256 experts, 8 local,
top-8), over links none and pcie (--links), parallel_state at expert_model_parallel_size=EP:

  alltoall + TE FP8 blockwise      MoEAlltoAllTokenDispatcher (moe_permute_fusion) + TEGroupedMLP
                                   under TE's blockwise FP8 recipe (the baseline of the ratios)
  fp8_alltoall + fp8_experts_spec  fp8a2a's dispatcher + FP8 experts, default options (no recipe: BF16
                                   gradient GEMMs)
  ... fp8_dgrad+wgrad              the same with the FP8 dgrad and wgrad (the default under a TE FP8 recipe)

Layers and timing are benchmarks/bench_megatron_layer.py's (each step from an idle GPU; no
back-to-back bursts here): one router for both rows, TE's FP8
weights cast in the first micro-batch and cached after it (quant/step, both rows alike: a step's
first micro-batch minus a plain one; TE after set_is_first_microbatch, fp8a2a with its cached FP8
weights dropped), grads set to None outside the timed region, CUDA events around fwd+bwd, the rows
interleaved; per link --repeat runs of --iters timed steps after --warmup; median [min-max] of the
run medians, ratios per run. A layer or step that fails names the call (innermost Megatron /
TransformerEngine / torch.distributed frame) and why. --cpu: tiny shapes, the local spec
(SequentialMLP, alltoall as the baseline), functional only (tests/test_loopback.py).

    python benchmarks/bench_loopback.py --tests --json results/bench_loopback.json  # ~4 min on an H200
    python benchmarks/bench_loopback.py --quick                                # 2 cases, fewer calls
    python benchmarks/bench_loopback.py --cpu                                  # functional, tiny shapes
    python benchmarks/bench_loopback.py --layer --json results/bench_loopback_layer.json  # < 150 s
--tests first runs tests/gpu/test_loopback_cuda.py (the links move the right bytes; fp8a2a and
Megatron on the group equal world size 1) and records its outcome in the JSON.
"""
import argparse
import json
import os
import statistics
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


# ---- --layer: Megatron's TE-spec MoELayer on the loopback group ---------------------------------

LAYER_POINT = "deepseek-v3@32"
LAYER_FFN = 2048  # DeepSeek-V3's moe_intermediate_size
LAYER_LINKS = ["none", "pcie"]
# name: (dispatcher, experts: te | local | fp8, TE recipe, fp8a2a options), bench_megatron_layer's rows;
# the first is the baseline of the ratios
LAYER_ROWS = {"alltoall + TE FP8 blockwise": ("alltoall", "te", "blockwise", {}),
              "fp8_alltoall + fp8_experts_spec": ("fp8_alltoall", "fp8", None, {}),
              "fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad": ("fp8_alltoall", "fp8", None,
                                                                  {"fp8_dgrad": True, "fp8_wgrad": True})}
CPU_LAYER_ROWS = {"alltoall + SequentialMLP": ("alltoall", "local", None, {}),
                  "fp8_alltoall + fp8_experts_spec": ("fp8_alltoall", "fp8", None, {})}
CPU_LAYER_SHAPE = dict(tokens=64, hidden=128, ffn=64, experts=16, topk=4)  # --cpu: functional only
_WHERE = ("megatron/", "transformer_engine/", "torch/distributed/", "fp8a2a/")


def _bench_megatron_layer():
    """benchmarks/bench_megatron_layer.py as a module (its layers, steps and weight-recast timing)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_megatron_layer
    return bench_megatron_layer


def _where(e, stage):
    """'stage: file:line in function (`code`): Type: message', the frame being the innermost one in
    Megatron, TransformerEngine, torch.distributed or fp8a2a (else the innermost)."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    for keys in (_WHERE[:3], _WHERE[3:]):
        hit = next((f for f in reversed(frames) if any(k in f.filename.replace(os.sep, "/") for k in keys)), None)
        if hit:
            break
    hit = hit or (frames[-1] if frames else None)
    if hit is None:
        return f"{stage}: {_reason(e)}"
    path = hit.filename.replace(os.sep, "/")
    for k in _WHERE:
        if k in path:
            path = k + path.split(k, 1)[1]
            break
    return f"{stage}: {path}:{hit.lineno} in {hit.name} (`{(hit.line or '').strip()[:120]}`): {_reason(e)}"


def run_layer(model, ep, links, *, repeat=3, iters=5, warmup=2, cuda=True, link_times=None, rows=None,
              log=None):
    """Megatron's MoELayer (TE spec on CUDA, local spec on the CPU), fwd+bwd, in the running loopback
    world of `ep` ranks: parallel_state initialized here at expert_model_parallel_size=ep (and torn
    down), each row of `rows` built once with one router, timed over every link. Returns the record
    (rows: per link median [min-max] of the run medians, ratios per run against the first row)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    bm = _bench_megatron_layer()
    import fp8a2a.megatron as fm
    fm.register()
    rows = rows or (LAYER_ROWS if cuda else CPU_LAYER_ROWS)
    base = lb.Case.of(model, ep)
    shape = dict(tokens=base.tokens, hidden=base.hidden, ffn=LAYER_FFN, experts=base.experts, topk=base.topk) \
        if cuda else dict(CPU_LAYER_SHAPE)
    T, H, Fh, E, K = (shape[k] for k in ("tokens", "hidden", "ffn", "experts", "topk"))
    res = {"case": {"model": model if cuda else "tiny (CPU)", "ep": ep, **shape, "local_experts": E // ep}, "links": list(links),
           "baseline": next(iter(rows)), "rows": {}, "ratios": {}}
    w = loopback.world()
    if w is None or w.size != ep:
        raise RuntimeError(f"run_layer: needs a loopback world of {ep} ranks (loopback.init)")
    if E % ep:
        raise ValueError(f"run_layer: {E} experts do not divide over EP={ep}")
    w.num_experts = E  # Megatron's per-expert counts all-gather: relabelled
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    link_times = link_times or lb.LinkTimes(dev)
    loopback.set_link("none")
    from megatron.core import parallel_state as ps, tensor_parallel
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=ep, create_gloo_process_groups=False)
    except Exception as e:  # noqa: BLE001
        res["error"] = _where(e, f"parallel_state.initialize_model_parallel(expert_model_parallel_size={ep}, "
                                 f"create_gloo_process_groups=False) on the loopback group")
        log(f"bench_loopback --layer: {res['error']}")
        return res
    keep, vs = [], []
    try:
        try:
            if cuda:
                tensor_parallel.model_parallel_cuda_manual_seed(123)
            else:
                torch.manual_seed(123)
        except Exception as e:  # noqa: BLE001
            res["error"] = _where(e, "tensor_parallel.model_parallel_cuda_manual_seed(123)")
            log(f"bench_loopback --layer: {res['error']}")
            return res
        g = torch.Generator().manual_seed(w.rank)
        x = torch.randn(T, 1, H, generator=g).to(dev, torch.bfloat16)
        gy = (torch.randn(T, 1, H, generator=g) * 0.01).to(dev, torch.bfloat16)
        router = None
        for name, (disp, experts, recipe, opts) in rows.items():
            rec = res["rows"][name] = {"dispatcher": disp, "experts": experts, "recipe": recipe, "options": opts}
            log(f"bench_loopback --layer: building {name}")
            try:
                layer, cfg = bm.make_layer((T, E, K, H, Fh, "table"), disp, experts, recipe, opts, cuda, ep=ep)
            except Exception as e:  # noqa: BLE001
                rec["error"] = _where(e, f"building MoELayer ({disp}, experts {experts}) at EP={ep}")
                log(f"bench_loopback --layer: {name}: {rec['error']}")
                continue
            rec["local_experts"] = getattr(layer, "num_local_experts", None)
            rec["local_expert_indices"] = list(getattr(layer, "local_expert_indices", []))[:2] + ["..."]
            router = layer.router.weight.detach().clone() if router is None else router
            with torch.no_grad():
                layer.router.weight.copy_(router)  # one routing for every row
            v = bm.layer_variant(name, layer, cfg, x, gy)
            try:  # the first micro-batch (TE casts and caches its FP8 weights), then one metered step
                loopback.set_link("pcie")
                v.step()
                with loopback.metered() as calls:
                    v.step()
                bm.sync(cuda)
            except Exception as e:  # noqa: BLE001
                rec["error"] = _where(e, f"forward + backward of MoELayer ({disp}) on the loopback group")
                log(f"bench_loopback --layer: {name}: {rec['error']}")
                continue
            rec["messages"] = [b for lk, b in calls if lk != "self"]
            rec["link_bytes"] = sum(rec["messages"])
            rec["self_bytes"] = sum(b for lk, b in calls if lk == "self")
            keep.append(layer)
            vs.append(v)
        runs = {(v.name, lk): [] for v in vs for lk in links}
        live = list(vs)
        for r in range(repeat):
            for lk in links:
                loopback.set_link(lk)
                times = {v.name: [] for v in live}
                for it in range(warmup + iters):
                    shift = it % max(1, len(live))
                    for v in live[shift:] + live[:shift]:
                        if v.name not in times:
                            continue
                        try:
                            ms = bm.timed_call(v, cuda)
                        except Exception as e:  # noqa: BLE001
                            res["rows"][v.name]["error"] = _where(e, f"run {r + 1}, link {lk}: fwd+bwd")
                            log(f"bench_loopback --layer: {v.name}: {res['rows'][v.name]['error']}")
                            times.pop(v.name)
                            continue
                        if it >= warmup:
                            times[v.name].append(ms)
                live = [v for v in live if v.name in times]
                for name, t in times.items():
                    runs[(name, lk)].append(statistics.median(t))
        loopback.set_link("none")
        for v in live:
            rec = res["rows"][v.name]
            rec["fwd_bwd_ms"] = {lk: lb.spread(runs[(v.name, lk)]) for lk in links}
            none_ms = rec["fwd_bwd_ms"].get("none", {}).get("median")
            try:  # per optimizer step: TE's recast in a first micro-batch, fp8a2a's weight rebuild
                ref_ms = none_ms if none_ms is not None else rec["fwd_bwd_ms"][links[0]]["median"]
                rec["quant_per_step_ms"] = bm.refresh_ms(v, cuda, ref_ms)
            except Exception as e:  # noqa: BLE001
                rec["quant_error"] = _where(e, "weight recast (first micro-batch)")
            if cuda and none_ms is not None:
                rec["link_ms"], rec["predicted_ms"] = {}, {}
                for lk in links:
                    if lk != "none":
                        t = sum(link_times.ms(lk, b) for b in rec["messages"])
                        rec["link_ms"][lk], rec["predicted_ms"][lk] = t, none_ms + t
        base_name = res["baseline"]
        for lk in links:  # time ratios per run (< 1: faster than the baseline) and speed-ups (their inverse)
            b = runs.get((base_name, lk), [])
            pairs = {v.name: list(zip(runs[(v.name, lk)], b)) for v in live
                     if v.name != base_name and len(b) == repeat and len(runs[(v.name, lk)]) == repeat}
            res["ratios"][lk] = {f"{n} / {base_name}": lb.spread([x / y for x, y in p]) for n, p in pairs.items()}
            res.setdefault("speedups", {})[lk] = {f"{base_name} / {n}": lb.spread([y / x for x, y in p])
                                                  for n, p in pairs.items()}
    finally:
        del keep, vs
        ps.destroy_model_parallel()
        if cuda:
            torch.cuda.empty_cache()
    return res


def format_layer(res):
    c = res["case"]
    out = [f"== MoELayer fwd+bwd on the loopback group: {c['model']} at EP={c['ep']}, {c['tokens']} tokens x "
           f"{c['hidden']}, ffn {c['ffn']}, {c['experts']} experts ({c['local_experts']} local), top-{c['topk']}"]
    if "error" in res:
        return "\n".join(out + [f"unavailable: {res['error']}"])
    links = res["links"]
    w = max([34] + [len(n) + 2 for n in res["rows"]])
    out.append(f"{'row':<{w}}{'MB/step':>9}" + "".join(f"{lk + ' ms':>24}" for lk in links)
               + "".join(f"{'pred ' + lk:>11}" for lk in links if lk != "none") + f"{'quant/step':>11}")
    for name, r in res["rows"].items():
        if "error" in r:
            out.append(f"{name:<{w}}unavailable: {r['error']}")
            continue
        pred = r.get("predicted_ms", {})
        q = r.get("quant_per_step_ms")
        out.append(f"{name:<{w}}{r['link_bytes'] / 1e6:>9.{1 if r['link_bytes'] > 1e7 else 3}f}"
                   + "".join(f"{lb._span(r['fwd_bwd_ms'].get(lk)):>24}" for lk in links)
                   + "".join(f"{(format(pred[lk], '.2f') if lk in pred else '-'):>11}" for lk in links if lk != "none")
                   + f"{('-' if q is None else format(q, '.2f')):>11}")
    for lk in links:
        for (k, s), (k2, s2) in zip(res["ratios"].get(lk, {}).items(), res.get("speedups", {}).get(lk, {}).items()):
            out.append(f"over {lk}: time {k} = {lb._span(s, '{:.3f}')}; speed-up {k2} = {lb._span(s2, '{:.3f}')} "
                       f"(per run)")
    out.append("MB/step: bytes this rank puts on the link per fwd+bwd (metered); pred: time over none + the "
               "link's measured time per message; quant/step: FP8 weights rebuilt per optimizer step (a step's "
               "first micro-batch minus a plain one, both rows; timed steps reuse the cached weights)")
    return "\n".join(out)


def layer_main(args, links, cuda, lt):
    """--layer: run_layer at --layer-point in a loopback world of its own."""
    model, ep = args.layer_point.split("@")
    ep = int(ep)
    if not cuda:
        ep = args.cpu_ep
    loopback.init(ep, rank=0, link="none")
    try:
        res = run_layer(model, ep, links, repeat=args.repeat, iters=args.iters or 5, warmup=args.warmup, cuda=cuda,
                        link_times=lt)
    finally:
        loopback.destroy()
    print(format_layer(res), flush=True)
    return res


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
    ap.add_argument("--links", default=None, help=f"default {','.join(LINKS)}; --layer: {','.join(LAYER_LINKS)}")
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="start no new case after this many seconds (the rest are recorded as skipped)")
    ap.add_argument("--cpu", action="store_true", help="functional run on the CPU: tiny shapes, numbers meaningless")
    ap.add_argument("--tests", action="store_true", help="run tests/gpu/test_loopback_cuda.py first (in the JSON)")
    ap.add_argument("--layer", action="store_true",
                    help="only Megatron's TE-spec MoELayer fwd+bwd (alltoall + TE FP8 blockwise against fp8_alltoall "
                         "+ fp8_experts_spec) at --layer-point; --iters default 5")
    ap.add_argument("--layer-point", default=LAYER_POINT, help=f"model@EP of --layer (default {LAYER_POINT})")
    ap.add_argument("--cpu-ep", type=int, default=4, help="--layer --cpu: the EP size (16 experts)")
    args = ap.parse_args()
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_loopback: needs a CUDA GPU (or --cpu for a functional run)")
    if cuda:
        torch.cuda.set_device(0)
    elif args.layer:
        from fp8a2a.megatron.standalone import cpu_cuda_streams
        cpu_cuda_streams()  # Megatron's alltoall dispatcher makes CUDA streams and events
    else:
        from fp8a2a.megatron.standalone import cpu_current_device
        cpu_current_device()
        args.no_megatron = True  # Megatron's alltoall dispatcher needs CUDA streams (tests/test_loopback.py shims them)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    iters = args.iters or (4 if args.quick else 8)
    links = [lk for lk in (args.links or ",".join(LAYER_LINKS if args.layer else LINKS)).split(",") if lk]
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
           "warmup": args.warmup, "links": links, "link_check": link_check(device), "gpu_tests": tests, "cases": []}
    print(f"bench_loopback: link check {doc['link_check']}", file=sys.stderr)
    lt = lb.LinkTimes(device)
    if args.layer:
        doc["iters"] = args.iters or 5
        doc["layer"] = layer_main(args, links, cuda, lt)
        points = []
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
    print(f"bench_loopback: {doc['seconds']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
