"""The all-to-all benchmark: is FP8 dispatch worth it on this cluster?

    python -m fp8a2a.bench                              # 1 GPU, or 4 gloo ranks on the CPU
    torchrun --nnodes N --nproc-per-node 8 -m fp8a2a.bench [--json out.json]
    python -m fp8a2a.bench --model                      # scale model, EP 8..1024 (no sweep)

For each point of the sweep (tokens per rank x hidden x experts x top-k x granularity) it times,
in the same run and in alternating order, three ways of moving the tokens:

  megatron_bf16  the BF16 baseline as megatron-core's `alltoall` dispatcher does it (unfused
                 path, no TP, dropless): count all-gather, host sync, permute (one copy per
                 expert), all_to_all_single of tokens and of probs, sort_chunks_by_idxs; combine:
                 sort back, all_to_all_single, unpermute (scatter_add).
  fp8a2a_bf16    fp8a2a.Dispatcher with the BF16 wire (what `bf16_below_bytes` falls back to):
                 one row per token and destination rank, one all_to_all_single.
  fp8a2a_fp8     fp8a2a.Dispatcher forced to FP8 (bf16_below_bytes=0).

Experts are the identity (the combine input is the dispatched rows' shape in BF16) and router
weights are left to the experts on both sides, as Megatron does. It reports median and p10/p90
time (per iteration, the slowest rank), algorithm and bus bandwidth as nccl-tests defines them
for alltoall (algbw = bytes a rank sends / time, busbw = algbw * (n-1)/n), the exact wire bytes,
the speedups, host time per call and kernel launches per call (CUDA, torch.profiler). It writes
a table, JSON, CSV and a PNG of speedup against message size, finds the crossover below which
BF16 wins and recommends `bf16_below_bytes`. Without a GPU the numbers are functional only.
"""
import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .dispatcher import DEFAULT_BF16_BELOW_BYTES

VARIANTS = ("megatron_bf16", "fp8a2a_bf16", "fp8a2a_fp8")


# ------------------------------------------------------------------------------------------
# statistics, bandwidth, crossover (pure functions: tested on synthetic data)

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    vals = [float(v) for v in values]
    return {"median": percentile(vals, 50), "p10": percentile(vals, 10), "p90": percentile(vals, 90),
            "mean": sum(vals) / len(vals) if vals else float("nan"),
            "min": min(vals) if vals else float("nan"), "max": max(vals) if vals else float("nan"),
            "n": len(vals)}


def algbw_gbps(bytes_per_rank: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: bytes a rank sends (its whole send buffer) / time, GB/s."""
    return bytes_per_rank / seconds / 1e9 if seconds > 0 else float("nan")


def busbw_gbps(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth for alltoall: algbw * (n - 1) / n."""
    return algbw * (world - 1) / world if world > 0 else float("nan")


def find_crossover(sizes: Sequence[float], speedups: Sequence[Optional[float]], threshold: float = 1.0) -> dict:
    """Smallest message size from which FP8 wins (speedup >= threshold) at every larger size.

    status: 'crosses' (crossover_bytes interpolated in log(size) between the last losing and the
    first winning size), 'fp8_always_wins' (crossover_bytes: the smallest size measured, an upper
    bound), 'bf16_always_wins' (FP8 never wins for good: crossover above the largest size; None)
    or 'no_data'."""
    pts = sorted((float(s), float(v)) for s, v in zip(sizes, speedups)
                 if v is not None and not math.isnan(float(v)))
    if not pts:
        return {"status": "no_data", "crossover_bytes": None, "last_loss_bytes": None, "first_win_bytes": None}
    k = len(pts)
    while k > 0 and pts[k - 1][1] >= threshold:
        k -= 1
    if k == 0:
        return {"status": "fp8_always_wins", "crossover_bytes": pts[0][0], "last_loss_bytes": None,
                "first_win_bytes": pts[0][0]}
    if k == len(pts):
        return {"status": "bf16_always_wins", "crossover_bytes": None, "last_loss_bytes": pts[-1][0],
                "first_win_bytes": None}
    (s0, v0), (s1, v1) = pts[k - 1], pts[k]
    t = (threshold - v0) / (v1 - v0) if v1 != v0 else 0.5
    cross = math.exp(math.log(s0) + min(max(t, 0.0), 1.0) * (math.log(s1) - math.log(s0)))
    return {"status": "crosses", "crossover_bytes": cross, "last_loss_bytes": s0, "first_win_bytes": s1}


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def recommend_threshold(crossovers: Dict[str, dict], default: int = DEFAULT_BF16_BELOW_BYTES) -> dict:
    """One `bf16_below_bytes` for all series: the largest crossover, rounded up to a power of two
    (so FP8 wins above it in every series that crosses)."""
    crossing = {k: c for k, c in crossovers.items() if c["status"] == "crosses"}
    never = sorted(k for k, c in crossovers.items() if c["status"] == "bf16_always_wins")
    always = {k: c for k, c in crossovers.items() if c["status"] == "fp8_always_wins"}
    notes = []
    if never:
        notes.append(f"FP8 did not win for good at any measured size in: {', '.join(never)}")
    if crossing:
        worst = max(crossing, key=lambda k: crossing[k]["crossover_bytes"])
        value = _pow2_ceil(crossing[worst]["crossover_bytes"])
        text = (f"recommended bf16_below_bytes = {value} ({fmt_bytes(value)}): the largest crossover "
                f"({worst}, {fmt_bytes(crossing[worst]['crossover_bytes'])}) rounded up to a power of two")
    elif always:
        smallest = min(c["crossover_bytes"] for c in always.values())
        value = min(default, int(smallest))
        text = (f"FP8 won at every size measured (down to {fmt_bytes(smallest)}): keep bf16_below_bytes "
                f"<= {fmt_bytes(smallest)}; recommended {value} ({fmt_bytes(value)})")
    else:
        value = None
        text = (f"no crossover found: FP8 never won for good in this sweep; no bf16_below_bytes to recommend "
                f"(keep the default {fmt_bytes(default)} or measure larger sizes)")
    return {"recommended_bytes": value, "text": "; ".join([text] + notes), "default_bytes": default}


def fmt_bytes(n) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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


def build_series(args, cuda: bool) -> List[Series]:
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
# the BF16 baseline: megatron-core's alltoall dispatcher, unfused path, in plain torch

def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd (Megatron's _AllToAll)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _all_gather_flat(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, inp, group=group)


class MegatronStyleAlltoAll:
    """What megatron-core's MoEAlltoAllTokenDispatcher does (no TP, dropless, moe_permute_fusion
    off), op for op: tokens-per-expert all-gather, one host sync, permute (masked_select +
    index_select, one copy of a token per expert), all_to_all_single of tokens and of probs,
    sort_chunks_by_idxs to expert-major order (split + cat); combine: the reverse and an
    unpermute (scatter_add). At world size 1 the collectives are skipped, as Megatron does.
    Differentiable (used by the MoE-layer benchmark too).

    dispatch(x [T, H], routing_map bool [T, E], probs [T, E]) -> (rows [N, H] expert-major,
    tokens_per_expert (host int64 [local]), probs [N]); combine(rows [N, H], apply_probs=False) -> [T, H]."""

    def __init__(self, num_experts: int, group=None):
        self.group = group
        self.rank, self.world = _group_info(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} is not a multiple of the group size {self.world}")
        self.num_experts, self.local = num_experts, num_experts // self.world
        idx = torch.arange(num_experts)
        self.sort_input = idx.reshape(-1, self.local).T.ravel().tolist()
        self.restore_output = idx.reshape(self.local, -1).T.ravel().tolist()

    def dispatch(self, x, routing_map, probs):
        T, E, L = x.shape[0], self.num_experts, self.local
        per_expert = routing_map.sum(0).long()  # [E]
        if self.world > 1:
            in_splits = per_expert.reshape(self.world, L).sum(1)
            every = per_expert.new_empty(self.world * E)
            _all_gather_flat(every, per_expert, self.group)
            chunks = every.view(self.world, E)[:, self.rank * L:(self.rank + 1) * L]  # [world, L]
            out_splits = chunks.sum(1)
            tpe = chunks.sum(0)
            host = torch.cat([in_splits, out_splits, chunks.reshape(-1), tpe]).cpu()  # the host sync
            w = self.world
            self.in_splits, self.out_splits = host[:w].tolist(), host[w:2 * w].tolist()
            self.chunks = host[2 * w:2 * w + w * L].view(w, L)
            tpe_host = host[2 * w + w * L:]
        else:
            tpe_host = per_expert.cpu()
            self.chunks = tpe_host.view(1, E)
        rmap = routing_map.T.contiguous()  # [E, T]
        self.sorted_indices = torch.arange(T, device=x.device).unsqueeze(0).expand(E, -1).masked_select(rmap)
        self.permuted_probs = probs.T.contiguous().masked_select(rmap)
        self.shape = x.shape
        rows = x.index_select(0, self.sorted_indices)
        p = self.permuted_probs
        if self.world > 1:
            rows = _AllToAll.apply(rows, self.out_splits, self.in_splits, self.group)
            p = _AllToAll.apply(p, self.out_splits, self.in_splits, self.group)
        if L > 1:
            sizes = self.chunks.reshape(-1).tolist()
            rows_parts, p_parts = torch.split(rows, sizes), torch.split(p, sizes)  # split once: E*R views
            rows = torch.cat([rows_parts[i] for i in self.sort_input])
            p = torch.cat([p_parts[i] for i in self.sort_input])
        return rows, tpe_host, p

    def combine(self, rows, apply_probs: bool = False):
        if self.local > 1:
            sizes = self.chunks.T.reshape(-1).tolist()
            parts = torch.split(rows, sizes)
            rows = torch.cat([parts[i] for i in self.restore_output])
        if self.world > 1:
            rows = _AllToAll.apply(rows, self.in_splits, self.out_splits, self.group)
        dtype = rows.dtype
        if apply_probs:
            rows = rows * self.permuted_probs.unsqueeze(-1)
        out = torch.zeros(self.shape, dtype=rows.dtype, device=rows.device)
        out = out.scatter_add(0, self.sorted_indices.unsqueeze(1).expand(-1, self.shape[1]), rows)
        return out.to(dtype)

    def wire_bytes(self, hidden: int, elem: int = 2, prob_bytes: int = 4):
        """(dispatch, combine) bytes this rank sends: tokens + probs (+ the counts all-gather)."""
        rows = sum(self.in_splits) if self.world > 1 else int(self.chunks.sum())
        counts = self.num_experts * 8 * self.world if self.world > 1 else 0
        return rows * (hidden * elem + prob_bytes) + counts, rows * hidden * elem


def make_routing(tokens: int, experts: int, topk: int, device, seed: int):
    """Uniform random top-k routing: (topk_idx int64 [T, K], topk_weights f32 [T, K],
    routing_map bool [T, E], probs f32 [T, E])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    val, idx = scores.topk(topk, dim=1)
    w = torch.softmax(val, dim=1)
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros(tokens, experts).scatter_(1, idx, w)
    return idx.to(device), w.to(device), rmap.to(device), probs.to(device)


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


_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
_COPY_APIS = ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset")


def count_launches(fn: Callable[[], object], device):
    """(kernels, memcpy + memset) one call of fn puts on the GPU, by torch.profiler; (None, None)
    off CUDA or when the profiler fails."""
    if device.type != "cuda":
        return None, None
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        events = list(prof.events())
        dev = [e for e in events if getattr(getattr(e, "device_type", None), "name", "") == "CUDA"]
        if dev:
            copies = sum(1 for e in dev if "Memcpy" in e.name or "Memset" in e.name)
            return len(dev) - copies, copies
        # older profilers: count the runtime's launch calls instead
        return (sum(1 for e in events if e.name in _LAUNCH_APIS), sum(1 for e in events if e.name in _COPY_APIS))
    except Exception:  # noqa: BLE001 - a missing count must not stop the benchmark
        return None, None


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
    from . import ops
    state = {}

    def dispatch():
        return disp.dispatch(x, idx, w)

    def combine(out):
        if "y" not in state or state["y"].shape[0] != out.handle.num_rows:
            state["y"] = torch.randn(out.handle.num_rows, hidden, dtype=x.dtype, device=device)
        return disp.combine(state["y"], out.handle, apply_weights=False)

    def wire(out):
        h = out.handle
        rows_hidden = hidden * x.element_size() if h.wire == ops.RAW else hidden
        counts = disp.world * (ops.COUNTS_HEADER + disp.num_local_experts) * 8 if disp.world > 1 else 0
        d_bytes = sum(h.send_splits) * ops.dispatch_row_bytes(rows_hidden, h.wire, topk) + counts
        c_bytes = sum(h.recv_splits) * ops.combine_row_bytes(hidden, x.dtype, disp.fp8_combine, 0)
        return d_bytes, c_bytes, h.wire

    return _Variant(name, dispatch, combine, wire)


def point_seed(seed: int, rank: int, tokens: int) -> int:
    return seed * 1000003 + rank * 7919 + tokens


def run_point(series: Series, tokens: int, dispatchers, device, group, rank, world, iters, warmup,
              profile_launches=True, seed=0):
    hidden, E, K = series.hidden, series.experts, series.topk
    g = torch.Generator(device=device).manual_seed(point_seed(seed, rank, tokens))
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    idx, w, rmap, probs = make_routing(tokens, E, K, device, point_seed(seed, rank, tokens) + 1)
    mega = dispatchers["megatron"]
    variants = [
        _Variant("megatron_bf16", lambda: mega.dispatch(x, rmap, probs), lambda s: mega.combine(s[0]),
                 lambda s: mega.wire_bytes(hidden) + (3,)),
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
            rec["fp8_wire_format"] = {0: "row", 1: "block128", 2: "tensor", 3: "bf16"}.get(wire, str(wire))
        ok.append(v)
    _sync(device)
    for v in ok:
        rec[f"{v.name}_launches"], rec[f"{v.name}_copies"] = \
            count_launches(lambda v=v: v.combine(v.dispatch()), device) if profile_launches else (None, None)
    times = _time_variants(ok, iters, warmup, device, group, world)
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
            rec[f"{v.name}_{key}_p10"] = s["p10"]
            rec[f"{v.name}_{key}_p90"] = s["p90"]
        rec[f"{v.name}_host_us"] = host["median"]
        alg = algbw_gbps(rec[f"{v.name}_wire_bytes"], d["median"] / 1e3)
        rec[f"{v.name}_algbw_GBps"] = alg
        rec[f"{v.name}_busbw_GBps"] = busbw_gbps(alg, world)
    _speedups(rec)
    return rec


def _ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


def _speedups(rec):
    m, r, f = "megatron_bf16", "fp8a2a_bf16", "fp8a2a_fp8"
    rec["speedup_dispatch"] = _ratio(rec.get(f"{m}_dispatch_ms"), rec.get(f"{f}_dispatch_ms"))
    rec["speedup_total"] = _ratio(rec.get(f"{m}_total_ms"), rec.get(f"{f}_total_ms"))
    rec["speedup_fp8_vs_bf16_wire_dispatch"] = _ratio(rec.get(f"{r}_dispatch_ms"), rec.get(f"{f}_dispatch_ms"))
    rec["wire_ratio_dispatch"] = _ratio(rec.get(f"{f}_wire_bytes"), rec.get(f"{m}_wire_bytes"))


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


def run_sweep(rank, world, args, group=None):
    from .dispatcher import Dispatcher
    cuda = torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend(group) == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    series = build_series(args, cuda)
    tokens = args.tokens or list(GPU_TOKENS if cuda else CPU_TOKENS)
    iters = args.iters if args.iters is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    skipped = [s.name for s in series if s.experts % world]
    series = [s for s in series if s.experts % world == 0]
    bar = Progress(len(series) * len(tokens), enabled=(rank == 0 and not args.quiet))
    records = []
    for s in series:
        disp = {"megatron": MegatronStyleAlltoAll(s.experts, group),
                "raw": Dispatcher(s.experts, group, s.granularity, bf16_below_bytes=1 << 62),
                "fp8": Dispatcher(s.experts, group, s.granularity, bf16_below_bytes=0)}
        for t in tokens:
            profile = not args.no_profile and (args.profile_all or t in (min(tokens), max(tokens)))
            records.append(run_point(s, t, disp, device, group, rank, world, iters, warmup,
                                     profile_launches=profile, seed=args.seed))
            bar.step(f"{s.name} T={t}")
        if cuda:
            torch.cuda.empty_cache()
    meta = {"world": world, "backend": dist.get_backend(group) if dist.is_initialized() else "none",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "functional_only": not cuda, "torch": torch.__version__, "iters": iters, "warmup": warmup,
            "series": [asdict(s) for s in series], "skipped_series": skipped, "tokens": list(tokens),
            "nodes": max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    return records, meta


def analyse(records, default=DEFAULT_BF16_BELOW_BYTES):
    """Crossovers per series (FP8 vs the BF16 wire of the same dispatcher, which is what
    bf16_below_bytes falls back to, and FP8 vs the Megatron baseline) and the threshold."""
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    vs_wire, vs_mega = {}, {}
    for name, rs in by.items():
        sizes = [r["msg_bytes"] for r in rs]
        vs_wire[name] = find_crossover(sizes, [r.get("speedup_fp8_vs_bf16_wire_dispatch") for r in rs])
        vs_mega[name] = find_crossover(sizes, [r.get("speedup_total") for r in rs])
    return {"crossover_vs_bf16_wire": vs_wire, "crossover_vs_megatron": vs_mega,
            "recommendation": recommend_threshold(vs_wire, default)}


CSV_COLUMNS = ["series", "hidden", "experts", "topk", "granularity", "tokens", "world", "msg_bytes"] + [
    f"{v}_{k}" for v in VARIANTS for k in (
        "dispatch_ms", "dispatch_ms_p10", "dispatch_ms_p90", "combine_ms", "combine_ms_p10", "combine_ms_p90",
        "total_ms", "wire_bytes", "combine_wire_bytes", "algbw_GBps", "busbw_GBps", "host_us", "launches",
        "copies")] + [
    "speedup_dispatch", "speedup_total", "speedup_fp8_vs_bf16_wire_dispatch", "wire_ratio_dispatch"]


def _clean(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json(path, records, meta, analysis):
    doc = {"benchmark": "fp8a2a all-to-all (python -m fp8a2a.bench)", "functional_only": meta["functional_only"],
           "meta": meta, "analysis": analysis, "records": records}
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1)


def write_csv(path, records):
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in records:
            wr.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})


def write_plot(path, records, meta, analysis=None) -> Optional[str]:
    """PNG of speedup against message size, one line per series; returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), sharey=True)
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    rec = (analysis or {}).get("recommendation", {}).get("recommended_bytes")
    panels = ((axes[0], "speedup_dispatch", "dispatch: Megatron BF16 / fp8a2a FP8"),
              (axes[1], "speedup_total", "dispatch + combine: Megatron BF16 / fp8a2a FP8"),
              (axes[2], "speedup_fp8_vs_bf16_wire_dispatch", "dispatch: fp8a2a BF16 wire / FP8 wire"))
    for ax, key, title in panels:
        for name, rs in by.items():
            pts = sorted((r["msg_bytes"], r[key]) for r in rs if r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        if rec and key == "speedup_fp8_vs_bf16_wire_dispatch":
            ax.axvline(rec, color="red", linestyle=":", linewidth=1, label=f"bf16_below_bytes {fmt_bytes(rec)}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v).replace(".0 ", " ")))
        ax.set_xlabel("message per rank (tokens x hidden x 2 B)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup (> 1: FP8 faster)")
    axes[2].legend(fontsize=8)
    label = "FUNCTIONAL ONLY (CPU/gloo)" if meta["functional_only"] else meta["device"]
    fig.suptitle(f"fp8a2a all-to-all: {label}, world size {meta['world']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _f(v, spec=".2f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(records) -> str:
    head = (f"{'series':<20}{'T':>6}{'msg':>10} | {'BF16 disp ms [p10,p90]':>24} | {'FP8 disp ms [p10,p90]':>24}"
            f" | {'xdisp':>6}{'xtotal':>7}{'xwire':>6} | {'wire MB bf16/fp8':>17} | {'busbw':>6}"
            f" | {'host us bf16/fp8':>16} | {'launch':>7}")
    lines = [head, "-" * len(head)]
    m, f = "megatron_bf16", "fp8a2a_fp8"
    for r in records:
        def span(v):
            if r.get(f"{v}_dispatch_ms") is None:
                return "-"
            return (f"{r[f'{v}_dispatch_ms']:.3f} [{r[f'{v}_dispatch_ms_p10']:.3f},"
                    f"{r[f'{v}_dispatch_ms_p90']:.3f}]")
        wire = f"{_f(_mb(r.get(f'{m}_wire_bytes')))}/{_f(_mb(r.get(f'{f}_wire_bytes')))}"
        host = f"{_f(r.get(f'{m}_host_us'), '.0f')}/{_f(r.get(f'{f}_host_us'), '.0f')}"
        launch = f"{_f(r.get(f'{m}_launches'), 'd')}/{_f(r.get(f'{f}_launches'), 'd')}"
        lines.append(f"{r['series']:<20}{r['tokens']:>6}{fmt_bytes(r['msg_bytes']):>10} | {span(m):>24} | "
                     f"{span(f):>24} | {_f(r.get('speedup_dispatch')):>6}{_f(r.get('speedup_total')):>7}"
                     f"{_f(r.get('speedup_fp8_vs_bf16_wire_dispatch')):>6} | {wire:>17} | "
                     f"{_f(r.get(f'{f}_busbw_GBps'), '.1f'):>6} | {host:>16} | {launch:>7}")
    return "\n".join(lines)


def _mb(b):
    return None if b is None else b / 1e6


def format_summary(records, analysis) -> str:
    lines = ["summary (per series): speedup of fp8a2a FP8 over Megatron BF16 (dispatch+combine) at the largest "
             "size, best speedup, FP8 crossovers", f"{'series':<20}{'largest':>9}{'best':>7}"
             f"{'  crossover vs BF16 wire':>26}{'  crossover vs Megatron':>26}"]
    by = {}
    for r in records:
        by.setdefault(r["series"], []).append(r)
    for name, rs in by.items():
        big = max(rs, key=lambda r: r["msg_bytes"])
        sp = [r["speedup_total"] for r in rs if r.get("speedup_total") is not None]

        def cx(c):
            return {"crosses": fmt_bytes(c["crossover_bytes"]), "fp8_always_wins": f"<= {fmt_bytes(c['crossover_bytes'])}",
                    "bf16_always_wins": f"> {fmt_bytes(c['last_loss_bytes'])}"}.get(c["status"], "-")
        lines.append(f"{name:<20}{_f(big.get('speedup_total')):>9}{_f(max(sp) if sp else None):>7}"
                     f"{cx(analysis['crossover_vs_bf16_wire'][name]):>26}{cx(analysis['crossover_vs_megatron'][name]):>26}")
    lines.append(analysis["recommendation"]["text"])
    return "\n".join(lines)


def report(records, meta, args, out=None):
    out = out or sys.stdout
    analysis = analyse(records)
    errors = sorted({f"{v}: {r[f'{v}_error']}" for r in records for v in VARIANTS if r.get(f"{v}_error")})
    label = ("FUNCTIONAL NUMBERS ONLY: CPU, gloo ranks in one machine; says nothing about a GPU cluster"
             if meta["functional_only"] else f"{meta['device']}, backend {meta['backend']}")
    print(f"\nfp8a2a all-to-all benchmark: world size {meta['world']}; {label}", file=out)
    print("times: per iteration the slowest rank's, median [p10, p90] over "
          f"{meta['iters']} iterations; xdisp/xtotal: Megatron BF16 / fp8a2a FP8; xwire: fp8a2a BF16 wire / FP8 "
          "(dispatch); busbw: nccl-tests alltoall bus bandwidth of the FP8 dispatch, GB/s", file=out)
    print(format_table(records), file=out)
    for e in errors:
        print(f"not measured: {e}", file=out)
    if meta.get("skipped_series"):
        print(f"skipped (experts not a multiple of world size {meta['world']}): {', '.join(meta['skipped_series'])}",
              file=out)
    print("", file=out)
    print(format_summary(records, analysis), file=out)
    if meta["functional_only"]:
        print("(functional run: the crossover and threshold above say nothing about a GPU cluster)", file=out)
    paths = output_paths(args)
    os.makedirs(os.path.dirname(os.path.abspath(paths["json"])), exist_ok=True)
    write_json(paths["json"], records, meta, analysis)
    write_csv(paths["csv"], records)
    why = None if args.no_plot else write_plot(paths["png"], records, meta, analysis)
    written = [paths["json"], paths["csv"]] + ([paths["png"]] if not args.no_plot and why is None else [])
    print(f"wrote {', '.join(written)}", file=out)
    if why:
        print(f"plot: {why}", file=out)
    return analysis


def output_paths(args):
    if args.json:
        stem = args.json[:-5] if args.json.endswith(".json") else args.json
        return {"json": args.json, "csv": stem + ".csv", "png": stem + ".png"}
    return {k: os.path.join(args.out, f"alltoall.{k}") for k in ("json", "csv", "png")}


# ------------------------------------------------------------------------------------------
# launching: torchrun, one GPU, or forked gloo ranks on the CPU

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world, port, fn, args, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, None, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, traceback.format_exc(), None))


def spawn_gloo(world, fn, *args, timeout=600):
    """Run fn(rank, world, *args) on `world` forked CPU processes joined by gloo (forking keeps a
    launch well under a second); returns every rank's result, raises with the failing ranks'
    tracebacks. The tests use it too."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = [None] * world, []
    try:
        for _ in range(world):
            rank, err, res = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("fp8a2a: a rank failed\n" + "\n".join(errors))
    return results


def _sweep_entry(rank, world, args):
    return run_sweep(rank, world, args)


def _ints(s):
    return [int(v) for v in s.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fp8a2a.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=_ints, help="tokens per rank, comma-separated (default: 128..16384 on GPU)")
    p.add_argument("--hidden", type=_ints, help="hidden sizes (with --experts/--topk/--granularity: a cartesian "
                                               "sweep instead of the embedded model series)")
    p.add_argument("--experts", type=_ints)
    p.add_argument("--topk", type=_ints)
    p.add_argument("--granularity", type=lambda s: [v for v in s.split(",") if v])
    p.add_argument("--iters", type=int, help="timed iterations per point (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--world", type=int, default=4, help="CPU ranks to fork when not under torchrun (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="output folder (default bench_out/)")
    p.add_argument("--json", help="JSON output path (the CSV and PNG go beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="skip counting kernel launches")
    p.add_argument("--profile-all", action="store_true", help="count launches at every point (default: the "
                                                              "smallest and largest tokens of each series)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--model", action="store_true", help="project dispatch time for EP 8..1024 instead of sweeping")
    from . import bench_model
    bench_model.add_arguments(p)
    args = p.parse_args(argv)
    if args.granularity:
        bad = [g for g in args.granularity if g not in ("row", "block128", "tensor")]
        if bad:
            p.error(f"unknown granularity {bad}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.model:
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        from . import bench_model
        bench_model.run(args)
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            records, meta = run_sweep(rank, world, args)
            if rank == 0:
                report(records, meta, args)
        finally:
            dist.destroy_process_group()
        return 0
    if torch.cuda.is_available():  # one GPU, no process group: world size 1
        records, meta = run_sweep(0, 1, args)
        report(records, meta, args)
        return 0
    print(f"fp8a2a.bench: no GPU; running {args.world} gloo ranks on the CPU (functional numbers only)",
          file=sys.stderr)
    records, meta = spawn_gloo(args.world, _sweep_entry, args)[0]
    report(records, meta, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
