"""fp8a2a dispatch + combine against megatron-core's MoEAlltoAllTokenDispatcher (BF16), same run.

On one GPU (world size 1): on-GPU time, host time per call, kernel launches and host syncs per
call, peak memory, exact wire bytes (and the bytes an 8-rank EP group would move for the same
routing). Also fp8a2a's capacity mode replayed from a CUDA graph at the small size.

    python benchmarks/bench_dispatch.py [--json OUT.json]
Needs CUDA; the Megatron baseline needs megatron-core (skipped with a message otherwise).
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fp8a2a  # noqa: E402
from fp8a2a import ops  # noqa: E402
from fp8a2a.timing import capture_cuda_graph, cuda_median_ms  # noqa: E402

POINTS = [dict(tokens=4096, hidden=7168, experts=256, topk=8), dict(tokens=128, hidden=7168, experts=256, topk=8)]


def routing(tokens, experts, topk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    w, idx = torch.topk(logits.softmax(-1), topk, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


def host_time(fn, iters=50):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3


def kernels_and_syncs(fn):
    fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset")
                  and "Memcpy" not in e.name)
    copies = sum(1 for e in prof.events() if e.device_type.name == "CUDA" and ("Memcpy" in e.name or "Memset" in e.name))
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode("default")
    syncs = sum(1 for c in caught if "synchroniz" in str(c.message))
    return kernels, copies, syncs


def peak_memory(fn):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def megatron_dispatcher(p):
    try:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        print(f"megatron-core not importable ({e}): Megatron baseline skipped")
        return None
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=p["hidden"], num_attention_heads=8, num_moe_experts=p["experts"],
                            moe_router_topk=p["topk"], moe_token_dispatcher_type="alltoall", bf16=True,
                            params_dtype=torch.bfloat16, add_bias_linear=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep", "tp"])
    return MoEAlltoAllTokenDispatcher(p["experts"], list(range(p["experts"])), cfg, pg_collection=pgs)


def dispatch_combine_step(d, x, idx, w):
    """One dispatch + combine with `d`; the experts' output is a fixed random tensor of the right shape."""
    rows = d.dispatch(x, idx, w).handle.num_rows
    expert_out = torch.randn(rows, x.shape[1], device=x.device, dtype=x.dtype)
    return lambda: d.combine(expert_out, d.dispatch(x, idx, w).handle)


def bench_point(p):
    torch.manual_seed(0)
    t, h, e, k = p["tokens"], p["hidden"], p["experts"], p["topk"]
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    idx, w = routing(t, e, k)
    res = {**p}

    fp8_step = dispatch_combine_step(fp8a2a.Dispatcher(e, bf16_below_bytes=0), x, idx, w)

    res["fp8_ms"] = cuda_median_ms(fp8_step)
    res["fp8_host_ms"] = host_time(fp8_step)
    res["fp8_kernels"], res["fp8_copies"], res["fp8_syncs"] = kernels_and_syncs(fp8_step)
    res["fp8_peak_mib"] = peak_memory(fp8_step)

    # Wire bytes of this routing, as an 8-rank EP group would move them (dispatch direction).
    ranks = 8
    dest = torch.zeros(t, ranks, dtype=torch.bool, device="cuda")
    dest.scatter_(1, idx // (e // ranks), True)
    row = ops.dispatch_row_bytes(h, 0, k)
    # what one rank sends, counted as fp8a2a.bench counts it: rows + its counts row to every rank;
    # Megatron: one copy per (token, expert) with its prob + the tokens-per-expert all-gather
    res["fp8_wire_bytes_8ranks"] = int(dest.sum()) * row + ranks * (ops.COUNTS_HEADER + e // ranks) * 8
    res["bf16_megatron_wire_bytes_8ranks"] = t * k * (2 * h + 4) + e * 8 * ranks
    res["wire_ratio_8ranks"] = res["fp8_wire_bytes_8ranks"] / res["bf16_megatron_wire_bytes_8ranks"]

    # Capacity mode replayed from a CUDA graph (zero host syncs, static shapes).
    cap_step = dispatch_combine_step(fp8a2a.Dispatcher(e, capacity_factor=2.0), x, idx, w)
    graph, _ = capture_cuda_graph(cap_step)
    res["fp8_capacity_eager_ms"] = cuda_median_ms(cap_step)
    res["fp8_capacity_graph_ms"] = cuda_median_ms(graph.replay)
    res["fp8_capacity_graph_host_ms"] = host_time(graph.replay)

    md = megatron_dispatcher(p)
    if md is not None:
        routing_map = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, idx, True)
        probs = torch.zeros(t, e, device="cuda").scatter_(1, idx, w)

        def meg_step():
            hs, pr = md.dispatch_preprocess(x, routing_map, probs)
            hs, pr = md.token_dispatch(hs, pr)
            hs, _, pr = md.dispatch_postprocess(hs, pr)
            hs = md.combine_preprocess(hs)
            hs = md.token_combine(hs)
            return md.combine_postprocess(hs)

        res["megatron_ms"] = cuda_median_ms(meg_step)
        res["megatron_host_ms"] = host_time(meg_step)
        res["megatron_kernels"], res["megatron_copies"], res["megatron_syncs"] = kernels_and_syncs(meg_step)
        res["megatron_peak_mib"] = peak_memory(meg_step)
        res["time_ratio"] = res["fp8_ms"] / res["megatron_ms"]
        res["graph_time_ratio"] = res["fp8_capacity_graph_ms"] / res["megatron_ms"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dispatch: needs a CUDA GPU (the Megatron baseline cannot run on CPU)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    results = [bench_point(p) for p in POINTS]
    print(f"\n{'tokens':>6} {'fp8 ms':>8} {'meg ms':>8} {'ratio':>6} {'graph ms':>9} {'g.ratio':>7} "
          f"{'fp8 k/s':>8} {'meg k/s':>8} {'fp8 host':>9} {'meg host':>9} {'fp8 MiB':>8} {'meg MiB':>8} {'wire@8':>7}")
    for r in results:
        f = lambda key, fmt="{:.3f}": fmt.format(r[key]) if key in r else "-"  # noqa: E731
        print(f"{r['tokens']:>6} {f('fp8_ms'):>8} {f('megatron_ms'):>8} {f('time_ratio', '{:.2f}'):>6} "
              f"{f('fp8_capacity_graph_ms'):>9} {f('graph_time_ratio', '{:.3f}'):>7} "
              f"{r['fp8_kernels']}/{r['fp8_syncs']:>1}{'':>4} "
              f"{(str(r.get('megatron_kernels', '-')) + '/' + str(r.get('megatron_syncs', '-'))):>8} "
              f"{f('fp8_host_ms'):>9} {f('megatron_host_ms'):>9} {f('fp8_peak_mib', '{:.0f}'):>8} "
              f"{f('megatron_peak_mib', '{:.0f}'):>8} {f('wire_ratio_8ranks', '{:.3f}'):>7}")
    print("k/s = kernels / host syncs per dispatch+combine; wire@8 = FP8 bytes / Megatron BF16 bytes at 8 ranks")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
