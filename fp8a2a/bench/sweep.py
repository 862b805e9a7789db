"""The sweep every rank runs: for each series and token count, the three variants timed in the same
run and in alternating order, each as a training step (forward + backward, the headline) and as
inference (forward only); see the package docstring. One record per point."""
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import Dispatcher, ops
from ..wire import CountsCol, Granularity
from .baseline import MegatronStyleAlltoAll, make_routing
from .costs import profile_call
from .report import MODES, PHASES, algbw_gbps, busbw_gbps, summarize

# ------------------------------------------------------------------------------------------
# the sweep's definition

@dataclass(frozen=True)
class Series:
    name: str
    hidden: int
    experts: int
    topk: int
    granularity: str = "row"


# Full sweep on GPUs: the expert shapes of DeepSeek-V3, Qwen3 and Mixtral, tokens 128 .. 16384.
GPU_SERIES = (
    Series("deepseek-v3", 7168, 256, 8, "row"),
    Series("deepseek-v3-b128", 7168, 256, 8, "block128"),
    Series("qwen3-235b", 4096, 128, 8, "row"),
    Series("mixtral-8x7b", 4096, 8, 2, "row"),
    Series("qwen3-30b", 2048, 128, 8, "row"),
)
GPU_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A short sweep for CPU/gloo (functional numbers; about half a minute on 2 cores).
CPU_SERIES = (
    Series("cpu-h1024", 1024, 16, 4, "row"),
    Series("cpu-h1024-b128", 1024, 16, 4, "block128"),
    Series("cpu-h256-k2", 256, 8, 2, "row"),
)
CPU_TOKENS = (64, 512, 2048)
NAMED_SERIES = {s.name: s for s in GPU_SERIES + CPU_SERIES}


def default_iters(cuda: bool):
    """(timed iterations, warm-up iterations) per point when the command line gives none."""
    return (20, 3) if cuda else (3, 0)  # CPU: run_point's first calls are the warm-up


@dataclass(frozen=True)
class SweepArgs:
    """What the sweep takes from the command line (None: the default for the device)."""
    tokens: Optional[Sequence[int]] = None
    series: Optional[Sequence[str]] = None  # built-in series by name
    hidden: Optional[Sequence[int]] = None
    experts: Optional[Sequence[int]] = None
    topk: Optional[Sequence[int]] = None
    granularity: Optional[Sequence[str]] = None
    iters: Optional[int] = None
    warmup: Optional[int] = None
    seed: int = 0
    quiet: bool = False
    no_profile: bool = False
    profile_all: bool = False

    @classmethod
    def from_namespace(cls, ns) -> "SweepArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def build_series(args: SweepArgs, cuda: bool) -> List[Series]:
    if args.series:
        return [NAMED_SERIES[name] for name in args.series]
    if not any(v is not None for v in (args.hidden, args.experts, args.topk, args.granularity)):
        return list(GPU_SERIES if cuda else CPU_SERIES)
    base = (GPU_SERIES if cuda else CPU_SERIES)[0]
    out = []
    for h in args.hidden or [base.hidden]:
        for e in args.experts or [base.experts]:
            for k in args.topk or [base.topk]:
                for g in args.granularity or [base.granularity]:
                    out.append(Series(f"H{h}-E{e}-K{k}-{g}", h, e, k, g))
    return out

# ------------------------------------------------------------------------------------------
# timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _align(device, group, world):
    """Start every rank's iteration together (and with an idle GPU)."""
    _sync(device)
    if world > 1:
        if device.type == "cuda":
            t = torch.zeros(1, device=device)
            dist.all_reduce(t, group=group)
            _sync(device)
        else:
            dist.barrier(group=group)


def profile_costs(pending, device):
    """Fill each record's kernels, copies, host syncs and D2H copies per call (costs.profile_call).
    Run after all timing: the profiler stays attached to CUDA (CUPTI) once used and slows launches.
    Off CUDA, or where the profiler fails, they stay None (a missing count must not stop the sweep)."""
    for rec, calls in pending:
        for name, fn in calls:
            try:
                c = profile_call(fn, device) if device.type == "cuda" else None
            except Exception:  # noqa: BLE001
                c = None
            for key, field_ in (("kernels", "launches"), ("copies", "copies"), ("syncs", "syncs"), ("d2h", "d2h")):
                rec[f"{name}_{field_}"] = (c or {}).get(key)


# Each variant is timed in two modes (report.MODES), in the same loop: the training step (the
# headline) and inference (forward only); report.PHASES: the phases of each, timed apart in one call.


class _Step:
    """One timed call of a variant in one mode: `phases` run in order, each taking the previous
    one's result (the first takes None). `leaves`: the tensors requiring grad (the training step's),
    whose gradients reset() clears before each call, outside the timed region."""

    def __init__(self, name, phases, leaves=()):
        self.name, self.phases, self.leaves = name, phases, leaves

    def reset(self):
        for t in self.leaves:
            t.grad = None  # each step computes its gradients afresh

    def __call__(self):  # the whole call, as profile_costs counts it
        self.reset()
        state = None
        for phase in self.phases:
            state = phase(state)
        return state


class _Variant:
    """One way of moving the tokens: a _Step per mode, and wire(dispatch output) -> (dispatch
    bytes, combine bytes, wire format) of the forward."""

    def __init__(self, name, infer, train, wire):
        self.name, self.steps, self.wire, self.error = name, {"infer": infer, "train": train}, wire, None


def _time_steps(steps: List[_Step], iters: int, warmup: int, device, group, world):
    """Per step: one row per iteration, [ms of each phase..., host us of the whole call], the steps
    in rotating order, every one between the same rank alignment and device sync; each
    iteration's figures are the slowest rank's."""
    cuda = device.type == "cuda"
    raw = {s.name: [] for s in steps}
    for it in range(warmup + iters):
        shift = it % len(steps)
        for s in steps[shift:] + steps[:shift]:
            s.reset()
            _align(device, group, world)
            n = len(s.phases)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if cuda else []
            if cuda:
                ev[0].record()
            host = [time.perf_counter()]
            state = None
            for i, phase in enumerate(s.phases):
                state = phase(state)
                host.append(time.perf_counter())
                if cuda:
                    ev[i + 1].record()
            _sync(device)
            del state
            if it < warmup:
                continue
            ms = [ev[i].elapsed_time(ev[i + 1]) if cuda else (host[i + 1] - host[i]) * 1e3 for i in range(n)]
            raw[s.name].append(ms + [(host[n] - host[0]) * 1e6])
    out = {}
    for name, rows in raw.items():
        t = torch.tensor(rows, dtype=torch.float64, device=device)
        if world > 1:
            every = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(every, t, group=group)
            t = torch.stack(every).amax(0)
        out[name] = t.cpu().tolist()
    return out


# ------------------------------------------------------------------------------------------
# one point of the sweep

def _leaf(t):
    """A copy of t that requires grad: each training step has leaves of its own, with the same values."""
    return t.detach().clone().requires_grad_()


def _megatron_variant(mega, x, rmap, probs, dy, hidden):
    """Inference: dispatch, then combine of the dispatched rows (identity experts; the probs left to
    them). Training: x and probs require grad, identity experts that multiply each row by its prob
    (where Megatron's experts apply them), combine, y.backward(dy)."""
    xg, pg = _leaf(x), _leaf(probs)

    def train_combine(s):
        rows, _, p = s
        return mega.combine(rows * p.unsqueeze(-1).to(rows.dtype))

    infer = _Step("megatron_bf16_infer", (lambda _: mega.dispatch(x, rmap, probs), lambda s: mega.combine(s[0])))
    train = _Step("megatron_bf16_train", (lambda _: mega.dispatch(xg, rmap, pg), train_combine,
                                          lambda y: y.backward(dy)), (xg, pg))
    return _Variant("megatron_bf16", infer, train, lambda s: mega.wire_bytes(hidden) + (Granularity.RAW,))


def _fp8a2a_variant(name, disp, x, idx, w, dy, hidden, topk, device):
    """Inference: dispatch, then combine of a fixed tensor of the rows' shape (identity experts; the
    weights left to them). Training: x and w require grad, identity experts (the dequantized rows),
    combine applying the router weights, y.backward(dy)."""
    state = {}
    xg, wg = _leaf(x), _leaf(w)

    def infer_combine(out):
        if "y" not in state or state["y"].shape[0] != out.handle.num_rows:
            state["y"] = torch.randn(out.handle.num_rows, hidden, dtype=x.dtype, device=device)
        return disp.combine(state["y"], out.handle, apply_weights=False)

    def train_combine(out):
        return disp.combine(out.dequantized(x.dtype), out.handle)

    def wire(out):
        h = out.handle
        rows_hidden = hidden * x.element_size() if h.wire == Granularity.RAW else hidden
        counts = disp.world * (CountsCol.EXPERTS + disp.num_local_experts) * 8 if disp.world > 1 else 0
        d_bytes = sum(h.send_splits) * ops.dispatch_row_bytes(rows_hidden, h.wire, topk) + counts
        c_bytes = sum(h.recv_splits) * ops.combine_row_bytes(hidden, x.dtype, disp.fp8_combine, 0)
        return d_bytes, c_bytes, h.wire

    infer = _Step(f"{name}_infer", (lambda _: disp.dispatch(x, idx, w), infer_combine))
    train = _Step(f"{name}_train", (lambda _: disp.dispatch(xg, idx, wg), train_combine, lambda y: y.backward(dy)),
                  (xg, wg))
    return _Variant(name, infer, train, wire)


def point_seed(seed: int, rank: int, tokens: int) -> int:
    return seed * 1000003 + rank * 7919 + tokens


def make_dispatchers(series: Series, group=None) -> dict:
    """The three sides of a series: the Megatron-style baseline, fp8a2a's BF16 wire, fp8a2a's FP8 wire."""
    return {"megatron": MegatronStyleAlltoAll(series.experts, group),
            "raw": Dispatcher(series.experts, group, series.granularity, bf16_below_bytes=1 << 62),
            "fp8": Dispatcher(series.experts, group, series.granularity, bf16_below_bytes=0)}


def point_variants(series: Series, tokens: int, dispatchers, device, rank, seed=0) -> List[_Variant]:
    """The variants of one point, all fed the same x, routing and (training) dy."""
    hidden, E, K = series.hidden, series.experts, series.topk
    g = torch.Generator(device=device).manual_seed(point_seed(seed, rank, tokens))
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)  # the training steps' dL/dy
    idx, w, rmap, probs = make_routing(tokens, E, K, device, point_seed(seed, rank, tokens) + 1)
    return [_megatron_variant(dispatchers["megatron"], x, rmap, probs, dy, hidden),
            _fp8a2a_variant("fp8a2a_bf16", dispatchers["raw"], x, idx, w, dy, hidden, K, device),
            _fp8a2a_variant("fp8a2a_fp8", dispatchers["fp8"], x, idx, w, dy, hidden, K, device)]


def run_point(series: Series, tokens: int, dispatchers, device, group, rank, world, iters, warmup,
              profile_launches: Optional[list] = None, seed=0):
    """One record; with a list as profile_launches, the calls to profile are appended to it."""
    hidden = series.hidden
    variants = point_variants(series, tokens, dispatchers, device, rank, seed)
    rec = {"series": series.name, "hidden": hidden, "experts": series.experts, "topk": series.topk,
           "granularity": series.granularity, "tokens": tokens, "world": world, "msg_bytes": tokens * hidden * 2}
    ok = []
    for v in variants:  # first calls: warm-up, wire bytes; a variant that cannot run is left out
        try:
            infer = v.steps["infer"]
            s = infer.phases[0](None)
            d_b, c_b, wire = v.wire(s)
            infer.phases[1](s)
            del s
            v.steps["train"]()
        except (NotImplementedError, RuntimeError) as e:  # e.g. no CUDA kernels in this build
            v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
        t = torch.tensor([d_b, c_b], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(t, group=group)
            t /= world
        rec[f"{v.name}_wire_bytes"], rec[f"{v.name}_combine_wire_bytes"] = t.tolist()
        if v.name == "fp8a2a_fp8":
            rec["fp8_wire_format"] = "bf16" if wire == Granularity.RAW else Granularity(wire).label
        ok.append(v)
    _sync(device)
    times = _time_steps([v.steps[m] for m in MODES for v in ok], iters, warmup, device, group, world)
    for v in ok:
        rec.update({f"{v.name}_{m}_{k}": None for m in MODES for k in ("launches", "copies", "syncs", "d2h")})
    if profile_launches is not None:  # counted once the whole sweep is timed (profile_costs)
        profile_launches.append((rec, [(v.steps[m].name, v.steps[m]) for m in MODES for v in ok]))
    for v in variants:
        if v.error:
            rec[f"{v.name}_error"] = v.error
            continue
        for mode in MODES:
            key, rows = f"{v.name}_{mode}", times[f"{v.name}_{mode}"]
            stats = {"ms": summarize([sum(r[:-1]) for r in rows])}  # the whole call: its phases' sum
            stats.update({f"{ph}_ms": summarize([r[i] for r in rows]) for i, ph in enumerate(PHASES[mode])})
            for what, s in stats.items():
                rec[f"{key}_{what}"] = s["median"]
                for q in ("p10", "p90", "min", "max"):
                    rec[f"{key}_{what}_{q}"] = s[q]
            rec[f"{key}_host_us"] = summarize([r[-1] for r in rows])["median"]
            alg = algbw_gbps(rec[f"{v.name}_wire_bytes"], rec[f"{key}_dispatch_ms"] / 1e3)
            rec[f"{key}_algbw_GBps"] = alg
            rec[f"{key}_busbw_GBps"] = busbw_gbps(alg, world)
    _speedups(rec, times)
    return rec


def _ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


# speedup key: (numerator step, denominator step, the phase compared: None for the whole call)
SPEEDUPS = {"speedup_train": ("megatron_bf16_train", "fp8a2a_fp8_train", None),
            "speedup_train_vs_bf16_wire": ("fp8a2a_bf16_train", "fp8a2a_fp8_train", None),
            "speedup_infer": ("megatron_bf16_infer", "fp8a2a_fp8_infer", None),
            "speedup_infer_dispatch": ("megatron_bf16_infer", "fp8a2a_fp8_infer", "dispatch"),
            "speedup_infer_vs_bf16_wire_dispatch": ("fp8a2a_bf16_infer", "fp8a2a_fp8_infer", "dispatch")}


def _speedups(rec, times=None):
    """Each speedup as the ratio of the two medians; with the timing rows, also the min and max
    of the per-iteration ratios (both steps of an iteration ran back to back)."""
    for key, (num, den, phase) in SPEEDUPS.items():
        what = "ms" if phase is None else f"{phase}_ms"
        rec[key] = _ratio(rec.get(f"{num}_{what}"), rec.get(f"{den}_{what}"))
        if times and num in times and den in times:
            col = None if phase is None else PHASES[num.rsplit("_", 1)[1]].index(phase)
            value = (lambda r: sum(r[:-1])) if col is None else (lambda r, c=col: r[c])
            per_iter = [_ratio(value(a), value(b)) for a, b in zip(times[num], times[den])]
            per_iter = [v for v in per_iter if v is not None]
            rec[f"{key}_min"] = min(per_iter) if per_iter else None
            rec[f"{key}_max"] = max(per_iter) if per_iter else None
    rec["wire_ratio_dispatch"] = _ratio(rec.get("fp8a2a_fp8_wire_bytes"), rec.get("megatron_bf16_wire_bytes"))


# ------------------------------------------------------------------------------------------
# the sweep (every rank), reporting (rank 0 / the launcher)

class Progress:
    """A plain progress bar on stderr (no tqdm needed); one line per 10% when stderr is not a terminal."""

    def __init__(self, total, enabled=True, width=30):
        self.total, self.enabled, self.width, self.n, self.t0 = total, enabled, width, 0, time.time()
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def step(self, label=""):
        self.n += 1
        if not self.enabled:
            return
        frac = self.n / max(self.total, 1)
        done = int(self.width * frac)
        text = f"[{'#' * done}{'.' * (self.width - done)}] {self.n}/{self.total} {time.time() - self.t0:5.0f}s {label}"
        if self.tty:
            sys.stderr.write(f"\r{text:<100}" + ("\n" if self.n >= self.total else ""))
        elif int(frac * 10) > self.shown:
            self.shown = int(frac * 10)
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def run_sweep(rank, world, args: SweepArgs, group=None):
    cuda = torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend(group) == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    series = build_series(args, cuda)
    tokens = args.tokens or list(GPU_TOKENS if cuda else CPU_TOKENS)
    iters = args.iters if args.iters is not None else default_iters(cuda)[0]
    warmup = args.warmup if args.warmup is not None else default_iters(cuda)[1]
    skipped = [s.name for s in series if s.experts % world]
    series = [s for s in series if s.experts % world == 0]
    bar = Progress(len(series) * len(tokens), enabled=(rank == 0 and not args.quiet))
    records, pending = [], []
    for s in series:
        disp = make_dispatchers(s, group)
        for t in tokens:
            profile = not args.no_profile and (args.profile_all or t in (min(tokens), max(tokens)))
            records.append(run_point(s, t, disp, device, group, rank, world, iters, warmup,
                                     profile_launches=pending if profile else None, seed=args.seed))
            bar.step(f"{s.name} T={t}")
        if cuda:
            torch.cuda.empty_cache()
    profile_costs(pending, device)
    meta = {"world": world, "backend": dist.get_backend(group) if dist.is_initialized() else "none",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "functional_only": not cuda, "torch": torch.__version__, "iters": iters, "warmup": warmup,
            "headline": "train", "modes": {m: list(PHASES[m]) for m in MODES},
            "series": [asdict(s) for s in series], "skipped_series": skipped, "tokens": list(tokens),
            "nodes": max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    return records, meta
