"""Where the host time of a Megatron MoELayer training step goes (4096 tokens x 8 local experts,
DeepSeek-V3's EP=32 load, or 32, its EP=8 load; world size 1): fp8a2a's all-FP8 experts against
alltoall + TE experts (FP8 blockwise, or --te-recipe). A diagnostic for the host-path work, not a
table row: bench_megatron_layer.py's table is the measured figure.

    python benchmarks/profile_layer_host.py --out DIR     (CUDA, TE: timings, traces, host costs)
    python benchmarks/profile_layer_host.py --out DIR --experts 32 --te-recipe bf16
    python benchmarks/profile_layer_host.py --analyze DIR/trace_fp8.json.gz ...   (any machine)

On the GPU it prints, per row (one run: a diagnostic): the step's device time (median and min of 20
cached steps, the gradients set to None before each, untimed, as bench_megatron_layer.py does); the
host time of the forward and of the backward (perf_counter around each, no sync in between: how
long the host takes to launch each; the dispatch's sync inside the forward included) and the
step's wall time; it writes one profiled step of each row as a chrome trace (DIR/trace_ROW.json.gz,
with Python stacks in trace_ROW_stack.json.gz); then the host time per call of the FP8 experts'
pieces, launched behind a long device sleep so that no call waits on the device.
--analyze reads such traces: the device's idle stretches and, for each host frame, the device-idle
time while that frame ran (self and inclusive): what the device waited on.
"""
import argparse
import bisect
import gzip
import json
import os
import statistics
import time
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def idle_by_frame(events):
    """(span us, idle us, {frame: device-idle us while it ran, less its children's},
    {frame: the same with its children's, a recursive frame counted once}) of a chrome trace's
    events: the device's busy spans merged, the host frames nested per thread."""
    evs = [e for e in events if e.get("ph") == "X"]
    busy = []
    for e in sorted((e for e in evs if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], t)
        else:
            busy.append([s, t])
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    starts = [a for a, _ in idle]

    def idle_in(s, t):
        tot, j = 0.0, max(0, bisect.bisect_right(starts, s) - 1)
        while j < len(idle) and idle[j][0] < t:
            tot += max(0.0, min(idle[j][1], t) - max(idle[j][0], s))
            j += 1
        return tot

    self_us, incl_us = defaultdict(float), defaultdict(float)
    for tid in {e["tid"] for e in evs if e.get("cat") in HOST_CATS}:
        host = sorted((e for e in evs if e.get("tid") == tid and e.get("cat") in HOST_CATS),
                      key=lambda e: (e["ts"], -e["dur"]))
        stack, parent = [], []
        for i, e in enumerate(host):
            while stack and host[stack[-1]]["ts"] + host[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            parent.append(stack[-1] if stack else None)
            stack.append(i)
        ov = [idle_in(e["ts"], e["ts"] + e["dur"]) for e in host]
        own = list(ov)
        for i, p in enumerate(parent):
            if p is not None:
                own[p] -= ov[i]
        for i, e in enumerate(host):
            self_us[e["name"]] += own[i]
            p = parent[i]
            while p is not None and host[p]["name"] != e["name"]:
                p = parent[p]
            if p is None:
                incl_us[e["name"]] += ov[i]
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    return span, sum(b - a for a, b in idle), dict(self_us), dict(incl_us)


def analyze(path, top=25):
    with gzip.open(path, "rt") as f:
        span, idle, self_us, incl_us = idle_by_frame(json.load(f)["traceEvents"])
    print(f"{path}: span {span / 1e3:.2f} ms, busy {(span - idle) / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms")
    for title, table in (("self", self_us), ("inclusive", incl_us)):
        print(f"  device-idle us while each host frame ran, {title} (top {top}):")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {us:9.1f}  {name[:140]}")


def profile(out, experts=8, te_recipe="blockwise"):
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    import bench_megatron_layer as bm  # this script's own directory is on sys.path
    import fp8a2a.megatron as fm
    from fp8a2a.bench import costs
    from fp8a2a.megatron.standalone import fp8_context, world_of_one

    fm.register()
    teardown = world_of_one()
    shape = next(v for v in bm.GPU_SHAPES.values() if v[1] == experts)
    T, E, K, H, _, _ = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, 1, H, generator=g).cuda().to(torch.bfloat16)
    gy = (torch.randn(T, 1, H, generator=g) * 0.01).cuda().to(torch.bfloat16)
    rows = {"fp8": ("fp8_alltoall", "fp8", None, {"fp8_dgrad": True, "fp8_wgrad": True}),
            "te": ("alltoall", "te", None if te_recipe == "bf16" else te_recipe, {})}
    layers, router = {}, None
    for name, (dispatcher, impl, recipe, opts) in rows.items():
        layer, cfg = bm.make_layer(shape, dispatcher, impl, recipe, opts, True)
        router = layer.router.weight.detach().clone() if router is None else router
        with torch.no_grad():
            layer.router.weight.copy_(router)  # one routing for both rows
        layers[name] = (layer, cfg)

    def forward(name):
        layer, cfg = layers[name]
        with fp8_context(cfg):
            return layer(x.detach().requires_grad_())[0]

    def step(name):
        forward(name).backward(gy)

    def clear(name):  # the gradients set to None before each timed or profiled step, outside it
        layers[name][0].zero_grad(set_to_none=True)

    for name in rows:  # warm-up: TE and fp8a2a cache their FP8 weights in the first call
        for _ in range(5):
            clear(name)
            step(name)
    for name in rows:
        dev = []
        for _ in range(20):
            clear(name)
            dev.append(bm.timed_ms(lambda: step(name), True))
        host = []
        for _ in range(10):
            clear(name)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = forward(name)
            t1 = time.perf_counter()
            y.backward(gy)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            host.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
        fwd, bwd, wall = (statistics.median(h[i] for h in host) * 1e3 for i in range(3))
        print(f"{name}: step {statistics.median(dev):.3f} ms (min {min(dev):.3f}); host: forward {fwd:.3f} ms, "
              f"backward {bwd:.3f} ms, wall {wall:.3f} ms")
    for name in rows:
        for stack in (False, True):
            clear(name)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
                step(name)
                torch.cuda.synchronize()
            path = os.path.join(out, f"trace_{name}{'_stack' if stack else ''}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
                z.write(f.read())
            os.remove(path)

    from fp8a2a import experts as fx, triton_gemm as tg
    from fp8a2a.weight_cache import fp8_weight

    mlp = layers["fp8"][0].experts
    w1, _ = mlp._fp8_weights()
    w1q, s1 = fp8_weight(w1)
    M = T * K
    xq = torch.randn(M, H, device="cuda").to(torch.float8_e4m3fn)
    xs = torch.rand(M, device="cuda")
    counts = torch.tensor([M // E] * E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    cfg = fx._Cfg("scaled_grouped_mm", True, True, "swiglu", True)
    # fc1's FP8 weight-gradient operands (g^T [2 * ffn, tokens], x_hat^T [hidden, tokens], 1 x 128 scales)
    width = sum(-(-n // 128) * 128 for n in counts.tolist())
    ga, xa = (torch.randn(n, width, device="cuda").to(torch.float8_e4m3fn) for n in (2 * shape[4], H))
    gs, xas = (torch.rand(width // 128, n, device="cuda") + 0.5 for n in (2 * shape[4], H))
    pieces = {"expert weight stand-ins (_fp8_weights)": mlp._fp8_weights,
              "FP8 weight cache hit (fp8_weight)": lambda: fp8_weight(w1),
              "offsets from host counts (_offsets)": lambda: fx._offsets(counts, M, E, xq.device, None),
              "output allocation (torch.empty)": lambda: torch.empty((M, 4096), device="cuda", dtype=torch.bfloat16),
              "two TMA descriptors": lambda: (tg.TensorDescriptor.from_tensor(xq, [128, 128]),
                                              tg.TensorDescriptor.from_tensor(w1q.view(-1, H), [256, 128])),
              "grouped FP8 GEMM launch (grouped_mm_fp8)": lambda: tg.grouped_mm_fp8(xq, xs, w1q, s1, offs),
              "forward GEMM call (_mm_fp8)": lambda: fx._mm_fp8(cfg, xq, xs, w1q, s1, offs),
              "fc1's FP8 wgrad GEMMs, one per expert, one call (_wgrad_fp8_per_expert)":
                  lambda: fx._wgrad_fp8_per_expert(ga, gs, xa, xas, counts.tolist(), torch.bfloat16)}
    print(f"host us per call (a one-element add: {costs.host_reference_us('cuda'):.1f} us):")
    for what, fn in pieces.items():
        # about a second of device work queued ahead of every call
        print(f"  {costs.host_us(fn, warmup=1, device_ahead_cycles=int(2e9)):7.1f}  {what}")
    teardown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".", help="where the traces go")
    ap.add_argument("--analyze", nargs="*", help="chrome traces (.json.gz) to analyze instead")
    ap.add_argument("--experts", type=int, default=8, choices=(8, 32), help="local experts (default 8)")
    ap.add_argument("--te-recipe", default="blockwise", choices=("blockwise", "tensorwise", "bf16"),
                    help="the TE row's recipe (default blockwise)")
    args = ap.parse_args()
    if args.analyze:
        for path in args.analyze:
            analyze(path)
    else:
        os.makedirs(args.out, exist_ok=True)
        profile(args.out, args.experts, args.te_recipe)


if __name__ == "__main__":
    main()
