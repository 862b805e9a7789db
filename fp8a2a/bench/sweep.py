"""The sweep every rank runs: for each series and token count, the three variants timed in the same
run and in alternating order (see the package docstring), one record per point."""
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
from .report import algbw_gbps, busbw_gbps, summarize

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
# A short sweep for CPU/gloo (functional numbers; under a minute on 2 cores).
CPU_SERIES = (
    Series("cpu-h1024", 1024, 16, 4, "row"),
    Series("cpu-h1024-b128", 1024, 16, 4, "block128"),
    Series("cpu-h256-k2", 256, 8, 2, "row"),
)
CPU_TOKENS = (64, 256, 1024, 2048)
NAMED_SERIES = {s.name: s for s in GPU_SERIES + CPU_SERIES}


def default_iters(cuda: bool):
    """(timed iterations, warm-up iterations) per point when the command line gives none."""
    return (20, 3) if cuda else (5, 1)


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


class _Variant:
    def __init__(self, name, dispatch, combine, wire):
        self.name, self.dispatch, self.combine, self.wire = name, dispatch, combine, wire
        self.error = None


def _time_variants(variants: List[_Variant], iters: int, warmup: int, device, group, world):
    """Per variant: lists of (dispatch ms, combine ms, host us per dispatch+combine) per iteration,
    the variants in rotating order; each iteration's time is the slowest rank's."""
    cuda = device.type == "cuda"
    raw = {v.name: [] for v in variants}
    for it in range(warmup + iters):
        shift = it % len(variants)
        for v in variants[shift:] + variants[:shift]:
            _align(device, group, world)
            if cuda:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
            h0 = time.perf_counter()
            state = v.dispatch()
            h1 = time.perf_counter()
            if cuda:
                ev[1].record()
            v.combine(state)
            h2 = time.perf_counter()
            if cuda:
                ev[2].record()
            _sync(device)
            if it < warmup:
                continue
            if cuda:
                d_ms, c_ms = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
            else:
                d_ms, c_ms = (h1 - h0) * 1e3, (h2 - h1) * 1e3
            raw[v.name].append((d_ms, c_ms, (h2 - h0) * 1e6))
            del state
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

def _fp8a2a_variant(name, disp, x, idx, w, hidden, topk, device):
    state = {}

    def dispatch():
        return disp.dispatch(x, idx, w)

    def combine(out):
        if "y" not in state or state["y"].shape[0] != out.handle.num_rows:
            state["y"] = torch.randn(out.handle.num_rows, hidden, dtype=x.dtype, device=device)
        return disp.combine(state["y"], out.handle, apply_weights=False)

    def wire(out):
        h = out.handle
        rows_hidden = hidden * x.element_size() if h.wire == Granularity.RAW else hidden
        counts = disp.world * (CountsCol.EXPERTS + disp.num_local_experts) * 8 if disp.world > 1 else 0
        d_bytes = sum(h.send_splits) * ops.dispatch_row_bytes(rows_hidden, h.wire, topk) + counts
        c_bytes = sum(h.recv_splits) * ops.combine_row_bytes(hidden, x.dtype, disp.fp8_combine, 0)
        return d_bytes, c_bytes, h.wire

    return _Variant(name, dispatch, combine, wire)


def point_seed(seed: int, rank: int, tokens: int) -> int:
    return seed * 1000003 + rank * 7919 + tokens


def run_point(series: Series, tokens: int, dispatchers, device, group, rank, world, iters, warmup,
              profile_launches: Optional[list] = None, seed=0):
    """One record; with a list as profile_launches, the calls to profile are appended to it."""
    hidden, E, K = series.hidden, series.experts, series.topk
    g = torch.Generator(device=device).manual_seed(point_seed(seed, rank, tokens))
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    idx, w, rmap, probs = make_routing(tokens, E, K, device, point_seed(seed, rank, tokens) + 1)
    mega = dispatchers["megatron"]
    variants = [
        _Variant("megatron_bf16", lambda: mega.dispatch(x, rmap, probs), lambda s: mega.combine(s[0]),
                 lambda s: mega.wire_bytes(hidden) + (Granularity.RAW,)),
        _fp8a2a_variant("fp8a2a_bf16", dispatchers["raw"], x, idx, w, hidden, K, device),
        _fp8a2a_variant("fp8a2a_fp8", dispatchers["fp8"], x, idx, w, hidden, K, device),
    ]
    rec = {"series": series.name, "hidden": hidden, "experts": E, "topk": K, "granularity": series.granularity,
           "tokens": tokens, "world": world, "msg_bytes": tokens * hidden * 2}
    ok = []
    for v in variants:  # first call: warm-up, wire bytes; a variant that cannot run is left out
        try:
            s = v.dispatch()
            d_b, c_b, wire = v.wire(s)
            v.combine(s)
            del s
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
    times = _time_variants(ok, iters, warmup, device, group, world)
    for v in ok:
        rec.update({f"{v.name}_{k}": None for k in ("launches", "copies", "syncs", "d2h")})
    if profile_launches is not None:  # counted once the whole sweep is timed (profile_costs)
        profile_launches.append((rec, [(v.name, lambda v=v: v.combine(v.dispatch())) for v in ok]))
    for v in variants:
        if v.error:
            rec[f"{v.name}_error"] = v.error
            continue
        rows = times[v.name]
        d = summarize([r[0] for r in rows])
        c = summarize([r[1] for r in rows])
        tot = summarize([r[0] + r[1] for r in rows])
        host = summarize([r[2] for r in rows])
        for key, s in (("dispatch_ms", d), ("combine_ms", c), ("total_ms", tot)):
            rec[f"{v.name}_{key}"] = s["median"]
            for q in ("p10", "p90", "min", "max"):
                rec[f"{v.name}_{key}_{q}"] = s[q]
        rec[f"{v.name}_host_us"] = host["median"]
        alg = algbw_gbps(rec[f"{v.name}_wire_bytes"], d["median"] / 1e3)
        rec[f"{v.name}_algbw_GBps"] = alg
        rec[f"{v.name}_busbw_GBps"] = busbw_gbps(alg, world)
    _speedups(rec, times)
    return rec


def _ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


# speedup key: (numerator variant, denominator variant, summed columns of a timing row)
SPEEDUPS = {"speedup_dispatch": ("megatron_bf16", "fp8a2a_fp8", (0,)),
            "speedup_total": ("megatron_bf16", "fp8a2a_fp8", (0, 1)),
            "speedup_fp8_vs_bf16_wire_dispatch": ("fp8a2a_bf16", "fp8a2a_fp8", (0,))}


def _speedups(rec, times=None):
    """Each speedup as the ratio of the two medians; with the timing rows, also the min and max
    of the per-iteration ratios (both variants of an iteration ran back to back)."""
    for key, (num, den, cols) in SPEEDUPS.items():
        what = "total_ms" if cols == (0, 1) else "dispatch_ms"
        rec[key] = _ratio(rec.get(f"{num}_{what}"), rec.get(f"{den}_{what}"))
        if times and num in times and den in times:
            per_iter = [_ratio(sum(a[c] for c in cols), sum(b[c] for c in cols))
                        for a, b in zip(times[num], times[den])]
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
        disp = {"megatron": MegatronStyleAlltoAll(s.experts, group),
                "raw": Dispatcher(s.experts, group, s.granularity, bf16_below_bytes=1 << 62),
                "fp8": Dispatcher(s.experts, group, s.granularity, bf16_below_bytes=0)}
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
            "series": [asdict(s) for s in series], "skipped_series": skipped, "tokens": list(tokens),
            "nodes": max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    return records, meta
