#!/usr/bin/env python
"""Kernel benchmark: each fp8a2a op's effective bandwidth against a device copy and against the
eager-torch way of doing the same, plus host time per call.

    python benchmarks/bench_kernels.py [--json out.json]

For quantize (row, block128), dispatch_pack, dispatch_unpack, combine_pack, combine_unpack and
dequantize: effective bandwidth = the bytes the op must read and write / its median time, next
to a device-to-device copy measured in the same run (bytes read + written / time) and next to the
eager-torch equivalent (fp8a2a.reference.quantize_reference: amax, div, cast; index_select /
index_add for the reorders), at T=16384 tokens, H=7168, top-8 of 256 experts over 8 ranks
(random routing; one rank's view: what it packs, and the same rows received back). Host time per
call: a loop of N calls at 256 x 4096 timed on the host without synchronizing, divided by N.
Device times: calls launched back to back, each between two CUDA events (median); dispatch_pack
is also timed from an idle GPU (host latency to the first launch included), printed below the table,
with the split of each op of several kernels over them (one profiled call).
The FP8 expert weights an optimizer step rebuilds (fp8a2a.weight_cache.fp8_weight, cache invalidated
before each call): 8 experts of fc1 [2F, H] and fc2 [H, F], F = 2H/7 (DeepSeek-V3's 2048 at H=7168),
row-wise (weight_quant_row) and row-wise plus the transposed copy the FP8 dgrad reads
(weight_quant_row_t); their bytes are the floor: the weights read once, every FP8 copy written once.
Targets: dispatch_pack >= 0.9 of copy bandwidth and <= 15 us host time per call; weight_quant_row_t
within 1.5x of its floor (>= 0.67 of copy bandwidth).
Without a GPU it runs small sizes on the CPU, labelled functional (the numbers mean nothing)."""
import argparse
import json
import math
import os
import sys
import time

import torch

from fp8a2a import ops
from fp8a2a.bench import percentile, profile_call
from fp8a2a.reference import dequantize_reference, quantize_reference
from fp8a2a.weight_cache import fp8_weight, invalidate_fp8_weight_cache
from fp8a2a.wire import BLOCK, CountsCol, Granularity

TARGET_PACK_FRAC = 0.9
TARGET_HOST_US = 15.0
# The issue states the host target next to eager row quantization on its machine (126 us): the same
# bound as a ratio against eager quantization timed in this run, for hosts of another speed.
TARGET_HOST_RATIO = TARGET_HOST_US / 126.0
TARGET_WEIGHT_FRAC = 1 / 1.5
WEIGHT_EXPERTS = 8


def median_ms(fn, device, iters, warmup=3, from_idle=False):
    """Median device time of one call. Calls are launched back to back, each between two events,
    so the host runs ahead as in a training step and the time is the GPU's (host_us measures the
    host). from_idle: synchronize before each call instead, so the time also holds the host's
    latency to its first launch ("wall time from an idle GPU")."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return percentile(ts, 50)
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        if from_idle:
            torch.cuda.synchronize(device)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize(device)
    return percentile([a.elapsed_time(b) for a, b in events], 50)


def copy_ms(nbytes, device, iters, from_idle=False):
    """Median time of a device-to-device copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), device, iters, from_idle=from_idle)


def host_us(fn, device, n):
    """Host time per call: n calls without synchronizing, / n (the GPU may still be busy after)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return t


class Case:
    """Inputs of every op at one size, built once from one rank's random routing, plus the
    eager-torch equivalents' inputs (not timed)."""

    def __init__(self, T, H, K, E, R, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.T, self.H, self.K, self.E, self.R = T, H, K, E, R
        self.x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
        self.idx = torch.rand(T, E, generator=g, device=device).topk(K, dim=1).indices
        self.w = torch.rand(T, K, generator=g, device=device)
        row = int(Granularity.ROW)
        self.row_bytes = ops.dispatch_row_bytes(H, row, K)
        self.send, self.counts, self.send_pos = ops.dispatch_pack(self.x, self.idx, self.w, E, R, row, None)
        self.S = int(self.counts[:, CountsCol.ROWS].sum())
        # Received: as if every rank sent what this one sends (same statistics), source r's chunk
        # carrying local expert ids of "this" rank.
        self.recv = self.send[: self.S]
        self.recv_counts = self.counts
        self.N = int(self.counts[:, CountsCol.EXPERTS:].sum())
        (self.data, self.scale, self.weights, self.tpe, self.slot_pos, self.row_src) = ops.dispatch_unpack(
            self.recv, self.recv_counts, H, row, K, self.N)
        self.expert_out = torch.randn(self.N, H, generator=g, device=device).to(torch.bfloat16)
        self.crow = ops.combine_row_bytes(H, torch.bfloat16, False, 0)
        self.cbuf = ops.combine_pack(self.expert_out, self.slot_pos, self.weights, None, False)
        # eager-torch inputs: per (rank, token) send row, the routing of each received row
        local = E // R
        dest = self.idx // local
        mask = torch.zeros(T, R, dtype=torch.bool, device=device).scatter_(1, dest, True)
        r_of_row, t_of_row = mask.T.nonzero(as_tuple=True)  # rows grouped by destination rank
        self.t_of_row = t_of_row
        ids = self.idx.index_select(0, t_of_row)
        self.local_ids = torch.where(ids // local == r_of_row.unsqueeze(1), ids % local, torch.full_like(ids, -1))
        valid = self.local_ids >= 0
        s_idx, k_idx = valid.nonzero(as_tuple=True)
        order = torch.argsort(self.local_ids[s_idx, k_idx], stable=True)
        self.src_row = s_idx[order]  # received row of each expert-major row
        q, s = quantize_reference(self.x, "row")
        self.eager_recv_q, self.eager_recv_s = q.index_select(0, t_of_row), s.index_select(0, t_of_row)
        self.eager_w = self.w.index_select(0, t_of_row)
        self.eager_cbuf = torch.randn(t_of_row.shape[0], H, generator=g, device=device).to(torch.bfloat16)
        F = max(16, H * 2 // 7)
        self.expert_w = [torch.randn(WEIGHT_EXPERTS, n, k, generator=g, device=device).to(torch.bfloat16)
                         for n, k in ((2 * F, H), (H, F))]  # fc1, fc2

    # --- the ops, their bytes, their eager equivalents --------------------------------------
    def table(self):
        T, H, K, E, R, S, N = self.T, self.H, self.K, self.E, self.R, self.S, self.N
        x, idx, w = self.x, self.idx, self.w
        row, blk = int(Granularity.ROW), int(Granularity.BLOCK128)
        routing = T * K * (idx.element_size() + 4)
        return [
            ("quantize_row", T * H * 2 + T * H + T * 4,
             lambda: ops.quantize(x, row, None), lambda: quantize_reference(x, "row")),
            ("quantize_block128", T * H * 2 + T * H + T * (H // BLOCK) * 4,
             lambda: ops.quantize(x, blk, None), lambda: quantize_reference(x, "block128")),
            ("dispatch_pack", T * H * 2 + routing + S * self.row_bytes + T * R * 4,
             lambda: ops.dispatch_pack(x, idx, w, E, R, row, None), self._eager_pack),
            ("dispatch_unpack", S * self.row_bytes + N * (H + 4 + 4 + 4) + S * K * 4,
             lambda: ops.dispatch_unpack(self.recv, self.recv_counts, H, row, K, N), self._eager_unpack),
            ("combine_pack", N * H * 2 + N * 4 + S * K * 4 + S * self.crow,
             lambda: ops.combine_pack(self.expert_out, self.slot_pos, self.weights, None, False),
             self._eager_combine_pack),
            ("combine_unpack", S * self.crow + T * R * 4 + T * H * 2,
             lambda: ops.combine_unpack(self.cbuf, self.send_pos, H, torch.bfloat16, False, 0),
             self._eager_combine_unpack),
            ("dequantize", N * H + N * 4 + N * H * 2,
             lambda: ops.dequantize(self.data, self.scale, torch.bfloat16),
             lambda: dequantize_reference(self.data, self.scale, torch.bfloat16)),
            ("weight_quant_row", self._weight_bytes(False), lambda: self._weight_quant(False),
             lambda: self._eager_weight_quant(False)),
            ("weight_quant_row_t", self._weight_bytes(True), lambda: self._weight_quant(True),
             lambda: self._eager_weight_quant(True)),
        ]

    def _weight_bytes(self, transposed):  # read once, each FP8 copy written once, the scales once
        copies = 2 if transposed else 1
        return sum(w.numel() * 2 + copies * w.numel() + w.shape[0] * w.shape[1] * 4 for w in self.expert_w)

    def _weight_quant(self, transposed):  # as an FP8 dgrad's forward and backward ask for them
        invalidate_fp8_weight_cache()  # what every optimizer step does
        out = [fp8_weight(w) for w in self.expert_w]
        if transposed:
            out += [fp8_weight(w, transposed=True) for w in self.expert_w]
        return out

    def _eager_weight_quant(self, transposed):
        out = [quantize_reference(w.reshape(-1, w.shape[2]), "row") for w in self.expert_w]
        if transposed:
            out += [q.view(w.shape).transpose(-2, -1).contiguous() for (q, _), w in zip(out, self.expert_w)]
        return out

    def _eager_pack(self):
        # what a user writes: quantize (amax, div, cast), then gather a row per destination rank
        q, s = quantize_reference(self.x, "row")
        dest = self.idx // (self.E // self.R)
        mask = torch.zeros(self.T, self.R, dtype=torch.bool, device=self.x.device).scatter_(1, dest, True)
        _, t = mask.T.nonzero(as_tuple=True)
        return q.index_select(0, t), s.index_select(0, t), self.idx.index_select(0, t), self.w.index_select(0, t)

    def _eager_unpack(self):
        valid = self.local_ids >= 0
        s_idx, k_idx = valid.nonzero(as_tuple=True)
        order = torch.argsort(self.local_ids[s_idx, k_idx], stable=True)
        src = s_idx[order]
        return (self.eager_recv_q.index_select(0, src), self.eager_recv_s.index_select(0, src),
                self.eager_w[src, k_idx[order]])

    def _eager_combine_pack(self):
        y = self.expert_out.float() * self.weights.unsqueeze(1)
        out = torch.zeros(self.t_of_row.shape[0], self.H, device=y.device).index_add_(0, self.src_row, y)
        return out.to(torch.bfloat16)

    def _eager_combine_unpack(self):
        out = torch.zeros(self.T, self.H, device=self.x.device).index_add_(0, self.t_of_row, self.eager_cbuf.float())
        return out.to(torch.bfloat16)


def run(args):
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    T = args.tokens or (16384 if cuda else 1024)
    H = args.hidden or (7168 if cuda else 1024)
    calls = args.host_calls or (200 if cuda else 10)
    iters = args.iters or (20 if cuda else 5)
    E, K, R = args.experts, args.topk, args.ranks
    result = {"benchmark": "fp8a2a kernels (benchmarks/bench_kernels.py)", "functional_only": not cuda,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": {"tokens": T, "hidden": H, "topk": K, "experts": E, "ranks": R},
              "host_shape": {"tokens": args.host_tokens, "hidden": args.host_hidden}, "iters": iters, "ops": []}
    try:
        case = Case(T, H, K, E, R, device)
    except (NotImplementedError, RuntimeError) as e:
        msg = str(e).splitlines()[0][:200]
        print(f"bench_kernels: fp8a2a's ops cannot run on {device} in this build ({type(e).__name__}: {msg}).\n"
              "Build the extension with a CUDA torch (pip install --no-build-isolation -e .) on the GPU machine.",
              file=sys.stderr)
        result["error"] = msg
        _write(args, result)
        return 2
    n = T * H * 2  # a copy of x: read + write
    copy_tbps = 2 * n / (copy_ms(n, device, iters) / 1e3) / 1e12
    result["copy_tbps"], result["copy_bytes"] = copy_tbps, 2 * n
    if cuda:  # the earlier method, for comparison with older records
        result["copy_tbps_from_idle"] = 2 * n / (copy_ms(n, device, iters, from_idle=True) / 1e3) / 1e12
    small = Case(args.host_tokens, args.host_hidden, K, E, R, device, seed=1)
    small_ops = {name: (fn, eager) for name, _, fn, eager in small.table()}
    for name, nbytes, fn, eager in case.table():
        rec = {"op": name, "bytes": nbytes}
        try:
            ms = median_ms(fn, device, iters)
            rec.update(ms=ms, tbps=nbytes / (ms / 1e3) / 1e12)
            rec["frac_of_copy"] = rec["tbps"] / copy_tbps
            if name == "dispatch_pack" and cuda:
                rec["ms_from_idle"] = median_ms(fn, device, iters, from_idle=True)
                rec["frac_of_copy_from_idle"] = (nbytes / (rec["ms_from_idle"] / 1e3) / 1e12
                                                 / result["copy_tbps_from_idle"])
            rec["host_us"] = host_us(small_ops[name][0], device, calls)
        except (NotImplementedError, RuntimeError) as e:
            rec["error"] = str(e).splitlines()[0][:200]
        try:
            ems = median_ms(eager, device, max(3, iters // 2), warmup=1)
            rec.update(eager_ms=ems, eager_tbps=nbytes / (ems / 1e3) / 1e12)
            rec["eager_host_us"] = host_us(small_ops[name][1], device, max(3, calls // 10))
            if "ms" in rec:
                rec["speedup_vs_eager"] = ems / rec["ms"]
        except (NotImplementedError, RuntimeError) as e:
            rec["eager_error"] = str(e).splitlines()[0][:200]
        result["ops"].append(rec)
    if cuda:  # which kernel of an op takes its time; after every timing (a profiler can slow what follows)
        for (name, _, fn, _), rec in zip(case.table(), result["ops"]):
            try:
                counted = profile_call(fn, device)
                if counted is not None:
                    rec["kernel_us"] = counted["busy_us_by_op"]
            except Exception as e:  # noqa: BLE001 - a profiler failure costs the split, not the row
                rec["kernel_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    pack = next(r for r in result["ops"] if r["op"] == "dispatch_pack")
    result["targets"] = {
        "dispatch_pack_frac_of_copy": {"target": TARGET_PACK_FRAC, "value": pack.get("frac_of_copy"),
                                       "ok": (pack.get("frac_of_copy") or 0) >= TARGET_PACK_FRAC},
        "dispatch_pack_host_us": {"target": TARGET_HOST_US, "value": pack.get("host_us"),
                                  "ok": pack.get("host_us") is not None and pack["host_us"] <= TARGET_HOST_US}}
    wq = next(r for r in result["ops"] if r["op"] == "weight_quant_row_t")
    result["targets"]["weight_quant_frac_of_copy"] = {
        "target": round(TARGET_WEIGHT_FRAC, 3), "value": wq.get("frac_of_copy"),
        "ok": (wq.get("frac_of_copy") or 0) >= TARGET_WEIGHT_FRAC}
    quant = next(r for r in result["ops"] if r["op"] == "quantize_row")
    if pack.get("host_us") is not None and quant.get("eager_host_us"):
        ratio = pack["host_us"] / quant["eager_host_us"]
        result["targets"]["dispatch_pack_host_vs_eager_quantize"] = {
            "target": round(TARGET_HOST_RATIO, 3), "value": ratio, "ok": ratio <= TARGET_HOST_RATIO}
    print(format_table(result))
    _write(args, result)
    return 0


def _f(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _gb(tbps):
    return None if tbps is None else tbps * 1e3


def format_table(res):
    s = res["shape"]
    label = "FUNCTIONAL NUMBERS ONLY (CPU)" if res["functional_only"] else res["device"]
    lines = [f"fp8a2a kernels on {label}: T={s['tokens']} H={s['hidden']} top-{s['topk']} of {s['experts']} experts, "
             f"{s['ranks']} ranks; host time at {res['host_shape']['tokens']} x {res['host_shape']['hidden']}",
             f"device copy: {res['copy_tbps'] * 1e3:.1f} GB/s (bytes read + written); GB/s below: bytes the op "
             "must read + write / median time; speedup: eager time / fp8a2a time",
             f"{'op':<18}{'MB moved':>9}{'ms':>9}{'GB/s':>8}{'x copy':>8} | {'eager ms':>9}{'GB/s':>8}"
             f"{'speedup':>8} | {'host us':>9}{'eager':>9}"]
    lines.append("-" * len(lines[-1]))
    for r in res["ops"]:
        lines.append(f"{r['op']:<18}{r['bytes'] / 1e6:>9.1f}{_f(r.get('ms'), '.3f'):>9}{_f(_gb(r.get('tbps')), '.1f'):>8}"
                     f"{_f(r.get('frac_of_copy'), '.2f'):>8} | {_f(r.get('eager_ms'), '.3f'):>9}"
                     f"{_f(_gb(r.get('eager_tbps')), '.1f'):>8}{_f(r.get('speedup_vs_eager'), '.1f'):>8} | "
                     f"{_f(r.get('host_us'), '.1f'):>9} {_f(r.get('eager_host_us'), '.1f'):>8}")
        for key in ("error", "eager_error"):
            if r.get(key):
                lines.append(f"  {key}: {r[key]}")
    pack = next((r for r in res["ops"] if r["op"] == "dispatch_pack"), {})
    if pack.get("ms_from_idle"):
        lines.append(f"dispatch_pack timed from an idle GPU (host latency included, copy likewise): "
                     f"{pack['ms_from_idle']:.3f} ms, {pack['frac_of_copy_from_idle']:.2f} x copy")
    for r in res["ops"]:
        if len(r.get("kernel_us") or {}) > 1:
            lines.append(f"{r['op']} kernels, us in one profiled call: "
                         + ", ".join(f"{k} {u:.1f}" for k, u in r["kernel_us"].items()))
    t = res["targets"]
    for name, v in t.items():
        lines.append(f"target {name}: {_f(v['value'], '.3f' if 'vs' in name else '.2f')} (target {'>=' if 'frac' in name else '<='} "
                     f"{v['target']}): {'PASS' if v['ok'] else 'FAIL'}"
                     + (" (functional run: not meaningful)" if res["functional_only"] else ""))
    return "\n".join(lines)


def _write(args, result):
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, help="default 16384 on GPU, 1024 on CPU")
    p.add_argument("--hidden", type=int, help="default 7168 on GPU, 1024 on CPU")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--iters", type=int)
    p.add_argument("--host-tokens", type=int, default=256)
    p.add_argument("--host-hidden", type=int, default=4096)
    p.add_argument("--host-calls", type=int, help="calls in the host-time loop (default 200 GPU, 10 CPU)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU (functional)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
