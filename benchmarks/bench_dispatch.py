"""fp8a2a dispatch + combine against megatron-core's `alltoall` dispatcher at its best realistic
configuration, same run, one GPU (world size 1). The headline is the training step.

Variants, per point (a row that cannot be built or captured says "unavailable: <reason>"):
  training step (forward + backward; x and the router weights require grad, y.backward(dy)):
            fp8a2a_train          fp8a2a.Dispatcher, FP8 wire: identity experts (out.dequantized() rows
                                  into combine), the router weights applied in combine
            megatron_fused_train  MoEAlltoAllTokenDispatcher with moe_permute_fusion: identity experts
                                  that multiply the rows by their probs (as Megatron's experts apply them)
            megatron_train        the same without moe_permute_fusion
  inference (forward only; --grad: its inputs require grad, nothing runs backward):
  dropless  megatron_fused      MoEAlltoAllTokenDispatcher with moe_permute_fusion (TE's fused permute)
            megatron            the same without moe_permute_fusion
            fp8a2a              fp8a2a.Dispatcher, FP8 wire (bf16_below_bytes=0)
  capacity  megatron_pad        Megatron's drop-and-pad (moe_expert_capacity_factor=1.0 +
                                moe_pad_expert_input_to_capacity; permute fusion when TE imports), eager
            megatron_pad_graph  the same, replayed from a CUDA graph (where it captures)
            fp8a2a_cap          fp8a2a capacity mode (capacity_factor=1.0), eager
            fp8a2a_cap_graph    the same, replayed from a CUDA graph
Megatron's drop runs in its router (apply_router_token_dropping), once, outside the timing;
fp8a2a's is inside its dispatch. No expert compute on either side (inference: a fixed tensor of
the dispatched rows' shape goes to combine). Ratios: fp8a2a / Megatron, per run, eager vs eager and
graph vs graph.

Timing: see fp8a2a.bench.TIMING (device time of calls launched back to back, not wall time from an idle
GPU). --repeat N runs the whole measurement N times in one process, the variants' order rotating
from run to run; per run the median over --iters calls; every figure is the median [min-max] of
the run medians. Host syncs, D2H copies, kernels and copies/memsets: fp8a2a.bench.costs, from
torch.profiler events of one call after warm-up; for the training rows also of the forward and of
the backward alone, with the kernels that took the most device time in each (where each
millisecond of the step goes).

    python benchmarks/bench_dispatch.py --points ws1-4096,ws1-128 [--repeat 3] [--json OUT.json]
    python benchmarks/bench_dispatch.py --cpu     functional only: tiny shapes, no CUDA
Needs megatron-core for the Megatron rows and TransformerEngine for moe_permute_fusion.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import fp8a2a
from fp8a2a import ops
from fp8a2a.bench import single_process_group
from fp8a2a.bench import (TIMING, capture_cuda_graph, host_reference_us, profile_call, spread, time_calls,
                          top_ops)
from fp8a2a.wire import CountsCol, Granularity

EMULATION = (
    "EP=n rows emulate one rank of an EP=n run at world size 1, its expert side: with balanced routing "
    "the rank receives T*K rows (T tokens per rank, top-K) for its L = E/n local experts. Here num_experts = L, "
    "top-k k = min(K, L) and T*K/k tokens: the same rows on the same experts. Not emulated: the exchange; "
    "the send side's routing over all E experts (Megatron permutes with a [T, E] map, here [T*K/k, L]) and "
    "Megatron's sort over n*L chunks (L here); fp8a2a's one row per token and destination rank (about 5.3 "
    "rows per token for DeepSeek-V3 at EP=8, 1 here). Both sides lose the same exchange; the rows measure "
    "each dispatcher's local kernels and host costs at that run's expert-side shape.")
WS1 = [dict(name="ws1-4096", tokens=4096, hidden=7168, experts=256, topk=8, ws1=True, emulates="world size 1"),
       dict(name="ws1-128", tokens=128, hidden=7168, experts=256, topk=8, ws1=True, emulates="world size 1")]
EP_RUNS = [("deepseek-v3", 4096, 7168, 256, 8, 8), ("deepseek-v3", 4096, 7168, 256, 8, 32),
           ("qwen3-235b", 4096, 4096, 128, 8, 8), ("mixtral-8x7b", 4096, 4096, 8, 2, 8)]
TRAIN_VARIANTS = ["fp8a2a_train", "megatron_fused_train", "megatron_train"]
VARIANTS = TRAIN_VARIANTS + ["megatron_fused", "megatron", "fp8a2a", "megatron_pad", "megatron_pad_graph",
                             "fp8a2a_cap", "fp8a2a_cap_graph"]
GRAPHED = ("megatron_pad_graph", "fp8a2a_cap_graph")  # replayed from a CUDA graph; the others run eager
# The processes scripts/gpu_session.sh runs (--list-groups), each over every point: the training
# rows (the headline), the eager inference rows, and the graph rows apart from the eager ones, since a
# fault in a replay leaves the process's CUDA context unusable.
VARIANT_GROUPS = [list(TRAIN_VARIANTS), [v for v in VARIANTS if v not in GRAPHED and v not in TRAIN_VARIANTS],
                  list(GRAPHED)]
RATIOS = [("fp8a2a_train", "megatron_fused_train"), ("fp8a2a_train", "megatron_train"),
          ("fp8a2a", "megatron_fused"), ("fp8a2a", "megatron"), ("fp8a2a_cap", "megatron_pad"),
          ("fp8a2a_cap_graph", "megatron_pad_graph")]
TOP_KERNELS = 8  # kernels per phase in the report's breakdown of a training step
NAME_W = 22  # the report's variant column
CAPACITY_FACTOR = 1.0
NOT_SELECTED = "not selected (--variants)"


def ep_point(model, tokens, hidden, experts, topk, ep):
    """One rank's expert side of an EP=ep run, at world size 1 (EMULATION)."""
    local = experts // ep
    k = min(topk, local)
    return dict(name=f"{model}@EP{ep}", tokens=tokens * topk // k, hidden=hidden, experts=local, topk=k, ws1=False,
                emulates=f"EP={ep}: {tokens} tokens/rank, top-{topk} of {experts} experts, {local} local")


POINTS = WS1 + [ep_point(*r) for r in EP_RUNS]


def routing(tokens, experts, topk, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=device, generator=g)
    w, idx = torch.topk(logits.softmax(-1), topk, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


class Variant:
    def __init__(self, name):
        self.name, self.label, self.fn, self.unavailable, self.graph = name, name, None, None, False
        self.device_ms, self.host_ms, self.costs, self.peak_mib = [], [], None, None

    def build(self, make, wanted=None):
        """make() -> (fn, label), then one trial call; any failure makes the row unavailable with its
        reason. A variant not in `wanted` (None: all) is not built."""
        if wanted is not None and self.name not in wanted:
            self.unavailable = NOT_SELECTED
            return
        # a CUDA fault cannot be caught: the last line printed names the variant that caused it
        print(f"bench_dispatch: building {self.name}", file=sys.stderr, flush=True)
        try:
            self.fn, self.label = make()
            self.fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a baseline that cannot be built or run is a row, not a crash
            self.unavailable = _reason(e)
            self.fn = None

    def record(self):
        out = {"label": self.label}
        if self.unavailable:
            out["unavailable"] = self.unavailable
        if self.device_ms:
            out.update(device_ms=spread(self.device_ms), host_ms=spread(self.host_ms),
                       costs=self.costs, peak_mib=self.peak_mib)
        return out


def _reason(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


# ---- the two sides --------------------------------------------------------------------------

class TrainStep:
    """One training step: forward() -> y, then backward(y): y.backward(dy), the leaves' gradients
    reset first (each step computes them afresh). A call runs both; the phases are profiled apart."""

    def __init__(self, forward, leaves, dy):
        self.forward, self.leaves, self.dy = forward, leaves, dy

    def backward(self, y):
        for t in self.leaves:
            t.grad = None
        y.backward(self.dy)

    def __call__(self):
        y = self.forward()
        self.backward(y)
        return y


def fp8a2a_train_step(x, idx, w, experts, dy):
    """fp8a2a dispatch + identity experts (the dequantized rows) + combine with the router weights,
    forward + backward; x and w require grad."""
    d = fp8a2a.Dispatcher(experts, bf16_below_bytes=0)

    def forward():
        out = d.dispatch(x, idx, w)
        return d.combine(out.dequantized(x.dtype), out.handle)
    return TrainStep(forward, (x, w), dy)


def fp8a2a_step(x, idx, w, experts, **kw):
    """One fp8a2a dispatch + combine; the experts' output is a fixed random tensor of the right shape."""
    d = fp8a2a.Dispatcher(experts, bf16_below_bytes=0, **kw)
    rows = d.dispatch(x, idx, w).handle.num_rows
    expert_out = torch.randn(rows, x.shape[1], device=x.device, dtype=x.dtype)
    return lambda: d.combine(expert_out, d.dispatch(x, idx, w).handle)


class Megatron:
    """megatron-core's MoEAlltoAllTokenDispatcher at world size 1 (its collectives are bypassed)."""

    def __init__(self):
        from megatron.core import __version__, parallel_state
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        self.version = __version__
        try:
            import transformer_engine
            self.te, self.te_error = transformer_engine.__version__, None
        except Exception as e:  # noqa: BLE001
            self.te, self.te_error = None, _reason(e)

    def dispatcher(self, p, fused, pad):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
        if fused and self.te is None:
            raise RuntimeError(f"TransformerEngine not importable ({self.te_error}): no moe_permute_fusion")
        e, k = p["experts"], p["topk"]
        cfg = TransformerConfig(num_layers=1, hidden_size=p["hidden"], num_attention_heads=8, num_moe_experts=e,
                                moe_router_topk=k, moe_router_pre_softmax=k == 1, moe_token_dispatcher_type="alltoall",
                                moe_permute_fusion=fused, moe_expert_capacity_factor=CAPACITY_FACTOR if pad else None,
                                moe_pad_expert_input_to_capacity=pad, bf16=True, params_dtype=torch.bfloat16,
                                add_bias_linear=False)
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep", "tp"])
        return MoEAlltoAllTokenDispatcher(e, list(range(e)), cfg, pg_collection=pgs)

    def step(self, p, x, rmap, probs, fused=False, pad=False):
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
        d, k = self.dispatcher(p, fused, pad), p["topk"]
        if pad:  # the router's drop-and-pad: exactly `capacity` tokens per expert
            probs, rmap = apply_router_token_dropping(probs, rmap, router_topk=k, capacity_factor=CAPACITY_FACTOR,
                                                      pad_to_capacity=True)

        def step():
            hs, pr = d.dispatch_preprocess(x, rmap, probs)
            hs, pr = d.token_dispatch(hs, pr)
            hs, _, pr = d.dispatch_postprocess(hs, pr)
            return d.combine_postprocess(d.token_combine(d.combine_preprocess(hs)))
        return step

    def train_step(self, p, x, rmap, probs, dy, fused=False):
        """Dispatch + identity experts that multiply each row by its prob (where Megatron's experts
        apply them) + combine, forward + backward; x and probs require grad."""
        d = self.dispatcher(p, fused, False)

        def forward():
            hs, pr = d.dispatch_preprocess(x, rmap, probs)
            hs, pr = d.token_dispatch(hs, pr)
            hs, _, pr = d.dispatch_postprocess(hs, pr)
            out = hs * pr.unsqueeze(-1).to(hs.dtype)
            return d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
        return TrainStep(forward, (x, probs), dy)


def graph_of(step, cuda):
    """A replay of step captured in a CUDA graph. The replay holds step (its closure holds the
    graph's static inputs and the dispatcher) and the outputs: a graph reads and writes those
    addresses, and memory freed to the allocator goes to the next point's tensors."""
    if not cuda:
        raise RuntimeError("CUDA graphs need CUDA")
    try:
        graph, out = capture_cuda_graph(step)
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()  # a failed capture must leave the device usable for the other rows
        raise RuntimeError(f"CUDA graph capture failed: {_reason(e)}") from e
    keep = (step, out)

    def replay():
        graph.replay()
        return keep
    return replay


def build_point(p, cuda, megatron, wanted=None, grad=False):
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    t, h, e, k = p["tokens"], p["hidden"], p["experts"], p["topk"]
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    idx, w = routing(t, e, k, dev)
    rmap = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, idx, True)
    probs = torch.zeros(t, e, device=dev).scatter_(1, idx, w)
    # grad: the eager rows' activations and router weights require grad, as in a training forward
    # (autograd's bookkeeping counts); the graph rows capture the plain tensors
    xe, we, pe = (x.clone().requires_grad_(), w.clone().requires_grad_(), probs.clone().requires_grad_()) if grad \
        else (x, w, probs)
    v = {n: Variant(n) for n in VARIANTS}

    def meg(fused, pad, graph=False):
        if isinstance(megatron, str):
            raise RuntimeError(megatron)
        s = megatron.step(p, x if graph else xe, rmap, probs if graph else pe, fused=fused, pad=pad)
        how = ("fused" if fused else "unfused") + (", drop-and-pad cf 1.0" if pad else ", dropless")
        return (graph_of(s, cuda), f"Megatron {megatron.version} ({how}), CUDA graph, inference") if graph else \
            (s, f"Megatron {megatron.version} ({how}), inference")

    # the training rows: their own leaves requiring grad, and the output gradient dy
    dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16)

    def meg_train(fused):
        if isinstance(megatron, str):
            raise RuntimeError(megatron)
        s = megatron.train_step(p, x.clone().requires_grad_(), rmap, probs.clone().requires_grad_(), dy, fused=fused)
        return s, f"Megatron {megatron.version} ({'fused' if fused else 'unfused'}, dropless), training step"
    v["fp8a2a_train"].build(lambda: (fp8a2a_train_step(x.clone().requires_grad_(), idx, w.clone().requires_grad_(),
                                                       e, dy), "fp8a2a (FP8 rows, dropless), training step"), wanted)
    v["megatron_fused_train"].build(lambda: meg_train(True), wanted)
    v["megatron_train"].build(lambda: meg_train(False), wanted)
    pad_fused = not isinstance(megatron, str) and megatron.te is not None
    v["megatron_pad_graph"].build(lambda: meg(pad_fused, True, graph=True), wanted)
    v["fp8a2a"].build(lambda: (fp8a2a_step(xe, idx, we, e), "fp8a2a (FP8 rows, dropless), inference"), wanted)
    v["fp8a2a_cap"].build(lambda: (fp8a2a_step(xe, idx, we, e, capacity_factor=CAPACITY_FACTOR),
                                   "fp8a2a capacity mode cf 1.0, inference"), wanted)
    v["fp8a2a_cap_graph"].build(lambda: (graph_of(fp8a2a_step(x, idx, w, e, capacity_factor=CAPACITY_FACTOR),
                                                  cuda), "fp8a2a capacity mode cf 1.0, CUDA graph, inference"), wanted)
    v["megatron_fused"].build(lambda: meg(True, False), wanted)
    v["megatron"].build(lambda: meg(False, False), wanted)
    v["megatron_pad"].build(lambda: meg(pad_fused, True), wanted)
    for name in GRAPHED:
        v[name].graph = True
    res = {key: p[key] for key in ("name", "tokens", "hidden", "experts", "topk", "ws1", "emulates")}
    if p["ws1"] and e % 8 == 0:
        res.update(wire_bytes_8ranks(idx, h, e, k))
    return res, v


def wire_bytes_8ranks(idx, h, e, k, ranks=8):
    """The dispatch bytes one rank would send for this routing in an 8-rank EP group: fp8a2a's rows and
    counts (as fp8a2a.bench counts them), Megatron's copy per (token, expert) + prob + counts all-gather."""
    dest = torch.zeros(idx.shape[0], ranks, dtype=torch.bool, device=idx.device)
    dest.scatter_(1, idx // (e // ranks), True)
    fp8 = int(dest.sum()) * ops.dispatch_row_bytes(h, Granularity.ROW, k) + ranks * (CountsCol.EXPERTS + e // ranks) * 8
    mega = idx.shape[0] * k * (2 * h + 4) + e * 8 * ranks
    return {"fp8_wire_bytes_8ranks": fp8, "bf16_megatron_wire_bytes_8ranks": mega, "wire_ratio_8ranks": fp8 / mega}


# ---- measuring ------------------------------------------------------------------------------

def peak_mib(fn, cuda):
    if not cuda:
        return None
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def characterize(variants, cuda):
    """Once per variant: host syncs / launches / copies of one call, peak memory of eager calls; for
    a training step also its forward and its backward apart ("phases": where the time goes)."""
    for v in variants.values():
        if v.fn is None:
            continue
        try:
            v.costs = profile_call(v.fn)
            if v.costs is not None and isinstance(v.fn, TrainStep):
                v.costs["phases"] = {"forward": profile_call(v.fn.forward),
                                     "backward": profile_call(v.fn.backward, setup=v.fn.forward)}
            v.peak_mib = None if v.graph else peak_mib(v.fn, cuda)
        except Exception as e:  # noqa: BLE001 - a missing count must not stop the benchmark
            v.costs = dict(v.costs or {}, error=_reason(e))


def measure(points, repeat, iters, warmup, cuda):
    for r in range(repeat):
        for _, variants in points:
            live = [v for v in variants.values() if v.fn is not None]
            shift = r % max(1, len(live))
            for v in live[shift:] + live[:shift]:
                try:
                    dev, host = time_calls(v.fn, iters, warmup, cuda)
                except Exception as e:  # noqa: BLE001
                    v.unavailable, v.fn = f"failed in run {r + 1}: {_reason(e)}", None
                    continue
                v.device_ms.append(statistics.median(dev))
                v.host_ms.append(statistics.median(host))


def ratios(variants, runs):
    out = {}
    for num, den in RATIOS:
        a, b = variants[num].device_ms, variants[den].device_ms
        if len(a) == len(b) == runs and runs:
            out[f"{num}/{den}"] = spread([x / y for x, y in zip(a, b)])
    return out


# ---- output ---------------------------------------------------------------------------------

def _span(s, fmt="{:.3f}"):
    if not s or s.get("median") is None:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def format_report(doc):
    lines = [f"fp8a2a dispatch + combine vs Megatron's alltoall dispatcher, world size 1, {doc['device']}",
             "headline: the training step (the *_train rows: forward + backward, x and the router weights "
             "requiring grad); the other rows are inference (forward only)",
             f"timing: {doc['timing']}; {doc['repeat']} run(s) x {doc['iters']} calls: median [min-max] of the run "
             "medians" + ("; the inference rows' activations and router weights require grad (a training forward)"
                          if doc.get("grad") else ""),
             f"peers: megatron-core {doc['megatron_core']}, TransformerEngine {doc['transformer_engine']}",
             "host speed: " + (", ".join(f"{u:.2f}" for u in doc.get("host_reference_us") or []) or "-")
             + " us per one-element in-place add (fp8a2a.bench.host_reference_us; one figure per process): the "
             "host-bound rows scale with it between machines",
             f"emulation: {EMULATION}", ""]
    head = (f"{'variant':<{NAME_W}}{'device ms':>26}{'host ms':>26}{'busy ms':>8}{'kernels':>8}{'copies':>7}{'syncs':>6}"
            f"{'d2h':>5}{'calls':>6}{'MiB':>7}  label")
    for p in doc["points"]:
        lines += [f"== {p['name']}: {p['tokens']} tokens x {p['hidden']}, {p['experts']} experts, top-{p['topk']} "
                  f"({p['emulates']})", head]
        for name in VARIANTS:
            if name == VARIANTS[len(TRAIN_VARIANTS)]:
                lines.append("-- inference (forward only)")
            v = p["variants"][name]
            if "device_ms" not in v:
                lines.append(f"{name:<{NAME_W}}unavailable: {v.get('unavailable', 'not measured')}")
                continue
            c = v.get("costs") or {}
            cnt = "".join(f"{c.get(key, '-') if c.get(key) is not None else '-':>{wd}}"
                          for key, wd in (("kernels", 8), ("copies", 7), ("syncs", 6), ("d2h", 5),
                                          ("launch_calls", 6)))
            mib = "-" if v.get("peak_mib") is None else f"{v['peak_mib']:.0f}"
            busy = "-" if c.get("busy_us") is None else f"{c['busy_us'] / 1e3:.3f}"
            note = (f" (counts failed: {c['error']})" if c.get("error") else "") + \
                (f" ({v['unavailable']})" if v.get("unavailable") else "")
            lines.append(f"{name:<{NAME_W}}{_span(v['device_ms']):>26}{_span(v['host_ms']):>26}{busy:>8}{cnt}{mib:>7}  "
                         f"{v['label']}{note}")
        for name in ("fp8a2a", "fp8a2a_cap"):  # where fp8a2a's device time goes
            ops = (p["variants"].get(name, {}).get("costs") or {}).get("busy_us_by_op")
            if ops:
                lines.append(f"{name} kernel us: " + ", ".join(f"{k} {u:.1f}" for k, u in ops.items()))
        lines += phase_lines(p)
        rs = "; ".join(f"{k} {_span(s, '{:.2f}')}" for k, s in p["ratios"].items()) or "none (a side unavailable)"
        lines += [f"ratios (device time, per run): {rs}", ""]
    lines.append("syncs: host calls that block on the GPU (cudaStream/Event/DeviceSynchronize, blocking cudaMemcpy); "
                 "d2h: device-to-host copies; kernels and copies/memsets: device events; busy ms: the time the device ran "
                 "them in one profiled call (their spans merged; the per-kernel lines sum each kernel's durations); "
                 "calls: host launch calls "
                 "(kernel and graph launches); MiB: peak memory above the inputs of one eager call")
    return "\n".join(lines)


def phase_lines(p):
    """Where each training row's device time goes: forward and backward busy time, and the kernels
    with the most device time in each phase (summed durations, us)."""
    out = []
    for name in TRAIN_VARIANTS:
        phases = (p["variants"].get(name, {}).get("costs") or {}).get("phases") or {}
        if not all(phases.get(k) for k in ("forward", "backward")):
            continue
        fwd, bwd = phases["forward"]["busy_us"], phases["backward"]["busy_us"]
        out.append(f"{name}: forward busy {fwd:.1f} us ({phases['forward']['kernels']} kernels), backward busy "
                   f"{bwd:.1f} us ({phases['backward']['kernels']} kernels), backward / forward "
                   f"{bwd / fwd if fwd else float('nan'):.2f}")
        for phase in ("forward", "backward"):
            top = top_ops(phases[phase]["busy_us_by_op"], TOP_KERNELS)
            out.append(f"  {phase} top kernels us: " + ", ".join(f"{k} {u:.1f}" for k, u in top))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the whole measurement (default 3)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per variant per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--points", help="comma-separated point names (default: all)")
    ap.add_argument("--variants", help=f"comma-separated variants to build (default: all of {', '.join(VARIANTS)})")
    ap.add_argument("--cpu", action="store_true", help="functional run on the CPU: tiny shapes, numbers meaningless")
    ap.add_argument("--grad", action="store_true",
                    help="the eager inference rows' activations and router weights require grad (a training "
                         "forward; the *_train rows always run forward + backward)")
    ap.add_argument("--list", action="store_true", help="print the point names and exit")
    ap.add_argument("--list-groups", action="store_true",
                    help="print the variant groups that run in processes of their own (comma-separated, each "
                         "over every point)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="measure nothing: one report (and --json) from runs of other points (one process each, so "
                         "that a device fault costs one point)")
    args = ap.parse_args()
    if args.list:
        return print(" ".join(p["name"] for p in POINTS))
    if args.list_groups:
        return print(" ".join(",".join(g) for g in VARIANT_GROUPS))
    if args.merge:
        return write_report(merge_runs(args.merge), args.json)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_dispatch: needs a CUDA GPU (or --cpu for a functional run)")
    if not dist.is_initialized():
        single_process_group("nccl" if cuda else "gloo")
    points = [p for p in POINTS if not args.points or p["name"] in args.points.split(",")]
    if args.cpu:
        points = [dict(p, tokens=max(2, p["tokens"] // 64), hidden=256) for p in points]
    try:
        megatron = Megatron()
    except Exception as e:  # noqa: BLE001
        megatron = f"megatron-core not usable ({_reason(e)})"
    t0 = time.time()
    wanted = set(args.variants.split(",")) if args.variants else None
    built = [build_point(p, cuda, megatron, wanted, grad=args.grad) for p in points]
    host_ref = host_reference_us(torch.device("cuda") if cuda else torch.device("cpu"))
    measure(built, args.repeat, args.iters, args.warmup, cuda)
    for _, variants in built:  # after the timing: a profiler that stays attached must not slow it
        characterize(variants, cuda)
    doc = {"benchmark": "fp8a2a dispatch + combine vs Megatron (benchmarks/bench_dispatch.py)",
           "functional_only": args.cpu, "device": torch.cuda.get_device_name() if cuda else "CPU",
           "torch": torch.__version__, "megatron_core": getattr(megatron, "version", megatron),
           "transformer_engine": getattr(megatron, "te", None) or getattr(megatron, "te_error", None) or "-",
           "timing": TIMING if cuda else "functional (CPU): wall time per call, calls back to back",
           "repeat": args.repeat, "iters": args.iters, "warmup": args.warmup, "grad": args.grad,
           "host_reference_us": [host_ref],
           "capacity_factor": CAPACITY_FACTOR, "emulation": EMULATION,
           "points": [dict(res, variants={n: v.record() for n, v in variants.items()},
                           ratios=ratios(variants, args.repeat)) for res, variants in built],
           "seconds": round(time.time() - t0, 1), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_report(doc, args.json)


def merge_runs(paths):
    """One document from runs of other points or other variants of a point (--variants): a row comes
    from the run that built it, a ratio from the run that measured both sides; a pair measured only
    in two processes gets the ratio of their medians, named so."""
    docs, points, merged = [], {}, []
    for path in paths:
        with open(path) as fh:
            docs.append(json.load(fh))
        merged += docs[-1].get("merged", [str(path)])

    def grad(d):  # --grad applies to the eager rows only; parts written before it had none
        eager = any(n not in GRAPHED and v.get("unavailable") != NOT_SELECTED for p in d["points"]
                    for n, v in p["variants"].items())
        return d.get("grad", False) if eager else None
    grads = [grad(d) for d in docs]
    for key, values in [(k, [d.get(k) for d in docs]) for k in ("repeat", "iters", "warmup", "functional_only")] + \
            [("grad", grads)]:
        if len({json.dumps(v) for v in values if not (key == "grad" and v is None)}) > 1:
            raise SystemExit(f"bench_dispatch --merge: the parts differ in {key}: {values}")
    source = {}  # (point, variant): the part its row came from
    for part, d in enumerate(docs):
        for p in d["points"]:
            have = points.setdefault(p["name"], dict(p, variants={}, ratios={}))
            for n, v in p["variants"].items():
                if n not in have["variants"] or v.get("unavailable") != NOT_SELECTED:
                    have["variants"][n], source[p["name"], n] = v, part
            have["ratios"].update(p["ratios"])
    for p in points.values():
        for name, v in p["variants"].items():
            if v.get("unavailable") == NOT_SELECTED:
                v["unavailable"] = "not measured: no part built it"
        for num, den in RATIOS:
            a, b = (p["variants"].get(n, {}).get("device_ms", {}).get("median") for n in (num, den))
            apart = source.get((p["name"], num)) != source.get((p["name"], den))
            if f"{num}/{den}" not in p["ratios"] and a and b and apart:
                p["ratios"][f"{num}/{den} (medians of two processes)"] = spread([a / b])
    refs = [u for d in docs for u in d.get("host_reference_us") or []]
    return dict(docs[0], points=list(points.values()), seconds=sum(d["seconds"] for d in docs), merged=merged,
                host_reference_us=refs,
                grad=next((g for g in grads if g is not None), False))


def write_report(doc, path):
    print(format_report(doc))
    if path:
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
