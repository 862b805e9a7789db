"""What one call costs: host syncs, launches and copies counted from torch.profiler events, and
its time (device time of calls launched back to back, host time per call). The all-to-all sweep
and benchmarks/bench_dispatch.py use these, so both sides of their comparisons are counted the
same way (the layer benchmarks time whole steps with their own CUDA-event loops).

Counting (count(): pure, tested on synthetic events). One call is profiled after warm-up; the
profile ends with a torch.cuda.synchronize() inside a record_function(MARKER) range, and only host
events that start before that marker count, so neither the warm-up nor that final sync is seen.
  syncs     host calls that block on the GPU: cudaStreamSynchronize, cudaEventSynchronize (how
            megatron-core 0.19 waits for its token counts), cudaDeviceSynchronize, a blocking
            cudaMemcpy (and their driver-API twins). torch.cuda.set_sync_debug_mode sees only
            torch's own syncs, not cudaEventSynchronize: this counts what the host actually did.
  d2h       device-to-host copies: the profiler's "Memcpy DtoH" device events (async or not).
  kernels   device events that are kernels; copies: Memcpy / Memset device events, apart.
  busy_us   the time the device ran any of those events (their spans merged: a kernel launched early,
            programmatic dependent launch, overlaps the one before it): the call's device work
            without its gaps; a device time far above it is host-bound (launches, or the wait after
            a host sync). busy_us_by_op: each kernel's (or copy kind's) summed durations, unmerged.
  span_us   first device event's start to the last one's end; gaps: the longest idle stretches in
            it, with the kernels around them and the host ranges open where each ends; idle_by_pair:
            the idle time summed per pair of kernels around it (a gap that recurs in every step).
"""
import re
import statistics
import time
from collections import Counter
from typing import Callable, Iterable, List, NamedTuple, Optional, Tuple

MARKER = "fp8a2a.costs.final_sync"
SYNC_APIS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
             "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
               "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch")
_CUDA_API = re.compile(r"cuda?[A-Z]")  # runtime (cudaXxx) and driver (cuXxx) calls: not host ranges
_NOT_KERNELS = ("Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event")  # CUPTI sync records


class Event(NamedTuple):
    """One profiler event, reduced to what counting needs."""
    name: str
    device: bool  # a GPU-side event (kernel, Memcpy, Memset), not a host call
    start_us: float
    annotation: bool = False  # a record_function range (host or its GPU shadow), not work
    duration_us: float = 0.0


def from_profiler(events) -> List[Event]:
    """torch.profiler FunctionEvents -> Events."""
    out = []
    for e in events:
        kind = getattr(getattr(e, "device_type", None), "name", "CPU")
        out.append(Event(e.name, kind != "CPU", float(e.time_range.start),
                         bool(getattr(e, "is_user_annotation", False)),
                         float(e.time_range.end - e.time_range.start)))
    return out


def _api(name: str) -> str:
    return re.sub(r"_v\d+$", "", name)  # some CUPTI versions suffix the API version


def _short(name: str) -> str:
    """A kernel's function name without namespaces, template arguments and parameters; a copy's kind."""
    if name.startswith(("Memcpy", "Memset")):
        return " ".join(name.split()[:2])
    name = name.replace("(anonymous namespace)", "")
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)
    words = name.split("(")[0].split()
    return (words[-1] if words else name).split("::")[-1]


def _covered_us(work: List[Event]) -> float:
    """Length of the union of the events' [start, start + duration) spans."""
    total, end = 0.0, float("-inf")
    for e in sorted(work, key=lambda e: e.start_us):
        stop = e.start_us + e.duration_us
        if stop > end:
            total += stop - max(e.start_us, end)
            end = stop
    return total


def _all_gaps(work: List[Event]) -> List[tuple]:
    """(us, event before, event after) of every stretch between the device's first and last event
    with nothing running."""
    gaps, end, last = [], None, None
    for e in sorted(work, key=lambda e: e.start_us):
        if end is not None and e.start_us > end:
            gaps.append((e.start_us - end, last, e))
        if end is None or e.start_us + e.duration_us > end:
            end, last = e.start_us + e.duration_us, e
    return gaps


def _idle_by_pair(gaps: List[tuple], n: int = 8) -> List[dict]:
    """The device's idle time summed per pair of kernels around it (_all_gaps' gaps; e.g. the same gap
    in every step of a profiled burst), the n largest sums, with how many gaps each holds."""
    total, times = Counter(), Counter()
    for us, before, after in gaps:
        key = (_short(before.name), _short(after.name))
        total[key] += us
        times[key] += 1
    return [{"us": us, "gaps": times[k], "before": k[0], "after": k[1]} for k, us in total.most_common(n)]


def _gaps(gaps: List[tuple], host: List[Event], n: int = 5) -> List[dict]:
    """The n longest stretches between the device's first and last event with nothing running:
    their length, the kernels on either side, and the innermost host ranges (aten ops, autograd
    nodes, record_function ranges) open where the gap ends, i.e. what the host was issuing then."""
    out = []
    for us, before, after in sorted(gaps, key=lambda g: -g[0])[:n]:
        open_ = sorted((h for h in host if h.start_us <= after.start_us <= h.start_us + h.duration_us
                        and not _CUDA_API.match(h.name)), key=lambda h: h.duration_us)
        out.append({"us": us, "before": _short(before.name), "after": _short(after.name),
                    "host": [h.name for h in open_[:3]]})
    return out


def _by_op(work: List[Event]) -> dict:
    out = Counter()
    for e in work:
        out[_short(e.name)] += e.duration_us
    return dict(out)


def count(events: Iterable[Event], marker: str = MARKER) -> dict:
    """Syncs, D2H copies, kernels, copies/memsets and host launch calls of one profiled call.
    Host events from the marker on are the caller's final sync; without a marker, one
    cudaDeviceSynchronize (that final sync) is taken off instead."""
    events = list(events)
    cut = min((e.start_us for e in events if not e.device and e.name == marker), default=None)
    host_events = [e for e in events if not e.device and (cut is None or e.start_us < cut)]
    host = [_api(e.name) for e in host_events]
    work = [e for e in events if e.device and not e.annotation and e.name != marker
            and not e.name.startswith(_NOT_KERNELS)]
    dev = [e.name for e in work]
    calls = Counter(n for n in host if n in SYNC_APIS)
    if cut is None and calls["cudaDeviceSynchronize"]:
        calls["cudaDeviceSynchronize"] -= 1
    copies = [n for n in dev if n.startswith(("Memcpy", "Memset"))]
    gaps = _all_gaps(work)
    return {"syncs": sum(calls.values()), "sync_calls": {k: v for k, v in sorted(calls.items()) if v},
            "d2h": sum(1 for n in copies if n.startswith("Memcpy DtoH")), "kernels": len(dev) - len(copies),
            "copies": len(copies), "launch_calls": sum(1 for n in host if n in LAUNCH_APIS),
            "busy_us": _covered_us(work), "busy_us_by_op": _by_op(work),
            "span_us": (max(e.start_us + e.duration_us for e in work) - min(e.start_us for e in work)) if work else 0.0,
            "gaps": _gaps(gaps, host_events), "idle_by_pair": _idle_by_pair(gaps), "marker": cut is not None}


def profile_call(fn: Callable[..., object], device=None, warmup: int = 1,
                 setup: Optional[Callable[[], object]] = None) -> Optional[dict]:
    """count() of one fn() after `warmup` calls; None off CUDA. Profiler failures propagate.
    setup: each call is fn(setup()), setup's work outside the profile (e.g. the forward whose
    backward fn is: one phase of a training step)."""
    import torch
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    args = (lambda: (setup(),)) if setup is not None else (lambda: ())
    for _ in range(warmup):
        fn(*args())
    a = args()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*a)
        with record_function(MARKER):
            torch.cuda.synchronize(device)
    return count(from_profiler(prof.events()))


# Kernel classes of a layer's step, by short kernel name (first match; case-insensitive): copies;
# NCCL; cuBLAS (xmma, nvjet), CUTLASS (device_kernel) and the Triton GEMMs; TE's and fp8a2a's
# quantizations and casts; the dispatchers' permutes, sorts, packs; the activation kernels.
KERNEL_CLASSES = (("copy", r"^Memcpy|^Memset"), ("nccl", r"nccl"),
                  ("GEMM", r"gemm|xmma|nvjet|cutlass|device_kernel|_mm|matmul|wgrad|dgrad|cublas"),
                  ("quantize", r"quant|cast|amax|fp8|transpose"),
                  ("permute", r"permute|sort|chunk|dispatch|combine|pack|scatter|gather|index|layout|scan|row_id"),
                  ("activation", r"act|silu|swiglu|gelu|glu|relu"))


def by_class(by_op: dict) -> dict:
    """us per kernel class (KERNEL_CLASSES, then "other") of a count()'s busy_us_by_op; every class
    present, in that order."""
    out = {name: 0.0 for name, _ in KERNEL_CLASSES + (("other", ""),)}
    for op, us in by_op.items():
        out[next((name for name, pat in KERNEL_CLASSES if re.search(pat, op, re.I)), "other")] += us
    return out


def top_ops(by_op: dict, n: int = 8) -> List[Tuple[str, float]]:
    """The n kernels (or copy kinds) of a count()'s busy_us_by_op with the most device time, most first."""
    return sorted(by_op.items(), key=lambda kv: -kv[1])[:n]


def host_reference_us(device, calls: int = 2000, runs: int = 5) -> float:
    """Host time of the cheapest device op (an in-place add on one element: one launch, no sync), us
    per call, median of `runs` loops: host-bound figures differ between machines by this factor."""
    import torch
    t = torch.zeros(1, device=device)
    per_call = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            t.add_(1)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return statistics.median(per_call)


TIMING = ("device time: CUDA events around each call, calls launched back to back (no sync between "
          "calls); host time: perf_counter around each call, no added syncs")


def host_us(fn: Callable[[], object], calls: int = 50, warmup: int = 0, device_ahead_cycles: int = 0) -> float:
    """Host time per call of fn (us) over `calls` back-to-back calls after `warmup`, no sync between
    them (CUDA). device_ahead_cycles: a device sleep that long queued first, so that no timed call
    waits on the device (its launches queue behind the sleep): the host's own cost."""
    import torch
    torch.cuda.synchronize()
    if device_ahead_cycles:
        torch.cuda._sleep(device_ahead_cycles)
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def time_calls(fn: Callable[[], object], iters: int = 20, warmup: int = 3,
               cuda: bool = True) -> Tuple[List[float], List[float]]:
    """(device ms, host ms) of each of `iters` back-to-back calls (see TIMING); off CUDA the
    device list is the host wall time per call."""
    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)] \
        if cuda else []
    host = []
    for i in range(iters):
        if cuda:
            marks[i][0].record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            marks[i][1].record()
    sync()
    return ([a.elapsed_time(b) for a, b in marks] if cuda else list(host)), host


def spread(values: List[float]) -> dict:
    """Median and min-max of per-run figures (e.g. run medians), and the runs themselves."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}
