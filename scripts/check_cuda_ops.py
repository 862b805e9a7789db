"""Checks every fp8a2a op on CUDA against the CPU implementation (which defines the semantics).

    python scripts/check_cuda_ops.py [--only quantize|dispatch|combine|graph]

For each case it runs the op on CPU and on CUDA with the same random inputs and asserts identical
bytes: exact everywhere, except that two NaNs compare equal whatever their sign and payload (x86
and the GPU make different NaN bit patterns for inf*0 and propagate payloads differently; an e4m3
NaN is 0x7f or 0xff). It also checks that eager CUDA calls make no host sync
(torch.cuda.set_sync_debug_mode) and that the ops record and replay in a torch.cuda.CUDAGraph.
Prints one PASS/FAIL line per check; check_all() raises AssertionError listing the failures.

Importable: `from scripts.check_cuda_ops import check_all; check_all(device="cuda", only="dispatch")`.
"""
import argparse
import os
import sys
import time
import traceback

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8a2a import ops  # noqa: E402

ROWS, HEADER = ops.ROWS, ops.COUNTS_HEADER
RAW = ops.RAW
GRAN_NAMES = {0: "row", 1: "block128", 2: "tensor", 3: "raw"}


# ---------------------------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------------------------
class Mismatch(AssertionError):
    pass


def _first_diff(mask):
    idx = mask.nonzero()
    return idx[0].tolist() if idx.numel() else None


def _float_equal(a, b, name):
    """Bit-identical floats, NaN == NaN regardless of sign/payload."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    if a.numel() == 0:
        return
    ib = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    same = (a.view(ib) == b.view(ib)) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        at = _first_diff(~same)
        raise Mismatch(f"{name}: {int((~same).sum())} elements differ, first at {at}: "
                       f"cpu={a[tuple(at)].item()!r} cuda={b[tuple(at)].item()!r}")


def _e4m3_canon(u8):
    return torch.where(u8 & 0x7F == 0x7F, torch.full_like(u8, 0x7F), u8)


def _fp8_equal(a, b, name):
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    ua = _e4m3_canon(a.view(torch.uint8) if a.dtype != torch.uint8 else a)
    ub = _e4m3_canon(b.view(torch.uint8) if b.dtype != torch.uint8 else b)
    same = ua == ub
    if not bool(same.all()):
        at = _first_diff(~same)
        raise Mismatch(f"{name}: {int((~same).sum())} e4m3 bytes differ, first at {at}: "
                       f"cpu=0x{int(ua[tuple(at)]):02x} cuda=0x{int(ub[tuple(at)]):02x}")


def _exact(a, b, name):
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    if a.numel() and not torch.equal(a, b):
        ne = a != b
        at = _first_diff(ne)
        raise Mismatch(f"{name}: {int(ne.sum())} elements differ, first at {at}: "
                       f"cpu={a[tuple(at)].item()!r} cuda={b[tuple(at)].item()!r}")


def _any_equal(a, b, name):
    if a.dtype == torch.float8_e4m3fn:
        _fp8_equal(a, b, name)
    elif a.is_floating_point():
        _float_equal(a, b, name)
    else:
        _exact(a, b, name)


def dispatch_layout(hidden, gran, k):
    ns = {0: 1, 1: hidden // 128, 2: 1, 3: 0}[gran]
    scale = (hidden + 3) // 4 * 4
    weight = scale + 4 * ns
    return dict(scale=scale, weight=weight, bytes=ops.dispatch_row_bytes(hidden, gran, k))


def _compare_dispatch_rows(a, b, hidden, gran, k, name):
    """a, b: [rows, bytes] uint8 dispatch rows: payload as e4m3 (raw: exact), scales NaN-aware,
    routing fields and padding exact."""
    lay = dispatch_layout(hidden, gran, k)
    if a.shape != b.shape:
        raise Mismatch(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.shape[0] == 0:
        return
    if gran == RAW:
        _exact(a[:, :hidden], b[:, :hidden], name + " payload")
    else:
        _fp8_equal(a[:, :hidden], b[:, :hidden], name + " payload")
    _exact(a[:, hidden:lay["scale"]], b[:, hidden:lay["scale"]], name + " pad")
    sa = a[:, lay["scale"]:lay["weight"]].contiguous().view(torch.float32)
    sb = b[:, lay["scale"]:lay["weight"]].contiguous().view(torch.float32)
    _float_equal(sa, sb, name + " scales")
    _exact(a[:, lay["weight"]:], b[:, lay["weight"]:], name + " routing/pad")


def _compare_combine_rows(a, b, hidden, dtype, quant, extra_k, name):
    elem = 1 if quant else torch.empty((), dtype=dtype).element_size()
    pay = hidden * elem
    scale_off = (pay + 3) // 4 * 4
    if a.shape != b.shape:
        raise Mismatch(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.shape[0] == 0:
        return
    if quant:
        _fp8_equal(a[:, :pay], b[:, :pay], name + " payload")
    else:
        _float_equal(a[:, :pay].contiguous().view(dtype), b[:, :pay].contiguous().view(dtype), name + " payload")
    _exact(a[:, pay:scale_off], b[:, pay:scale_off], name + " pad")
    off = scale_off
    if quant:
        _float_equal(a[:, off:off + 4].contiguous().view(torch.float32), b[:, off:off + 4].contiguous().view(torch.float32),
                     name + " scale")
        off += 4
    _exact(a[:, off:], b[:, off:], name + " extra/pad")


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def make_x(t, h, dtype, g, special=True, scale=1.0):
    """Rows from 1e-6 to 1e3 in magnitude, some with a wide range inside the row (e4m3 subnormals,
    saturation), a row with an amax below the scale rule's floor (2^-117), plus a zero row, a NaN
    row, a -inf row and an all-inf row."""
    if t == 0 or h == 0:
        return torch.zeros(t, h, dtype=dtype)
    x = torch.randn(t, h, generator=g) * torch.logspace(-6, 3, t).unsqueeze(1) * scale
    if t >= 6:
        x[5] *= torch.logspace(-4, 0, h)
    if t >= 7:
        x[6] = x[6] / x[6].abs().amax().clamp_min(1e-30) * 2e-36  # 448 / amax would overflow
    if special and t >= 5:
        x[1] = 0
        x[2, h // 2] = float("nan")
        x[3, 0] = float("-inf")
        x[4] = float("inf")
    if dtype == torch.float16:  # no accidental fp16 infs; keep the planted NaN/inf
        x = torch.where(torch.isfinite(x), x.clamp(-6e4, 6e4), x)
    return x.to(dtype)


def misaligned(x):
    """The same values at an address that is not 16-byte aligned (exercises the scalar kernels)."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    y = flat[1:].view(x.shape)
    y.copy_(x)
    return y


def make_routing(t, k, e, g, bad=False, dup=False, idx_dtype=torch.int64):
    if t == 0:
        return torch.zeros(0, k, dtype=idx_dtype), torch.zeros(0, k)
    if k <= e and not dup:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    else:
        idx = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    if t > 1:
        idx[0, -1] = -1
    if t > 7:
        idx[7] = -1  # a token routed nowhere
    if bad and t > 3:
        idx[2, 0] = e
        idx[3, k - 1] = -7
        if idx_dtype == torch.int64 and t > 4:
            idx[4, 0] = 1 << 40
    return idx.to(idx_dtype), w


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, device, verbose=True):
        self.device = torch.device(device)
        self.verbose = verbose
        self.failures = []
        self.passes = 0

    def check(self, name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report and continue
            msg = f"{type(e).__name__}: {e}"
            self.failures.append(f"{name}: {msg}")
            print(f"FAIL {name}: {msg}", flush=True)
            if self.verbose and not isinstance(e, Mismatch):
                traceback.print_exc()
        else:
            self.passes += 1
            if self.verbose:
                print(f"PASS {name}", flush=True)

    def cuda(self, t):
        return t.to(self.device) if isinstance(t, torch.Tensor) else t

    def no_sync(self, fn, *args):
        """Run on CUDA with synchronizing calls turned into errors."""
        if self.device.type != "cuda":
            return fn(*args)
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize(self.device)
        return out


# ---- quantize / dequantize ----------------------------------------------------------------------
def check_quantize(run: Runner):
    g = torch.Generator().manual_seed(1)
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for h in (7168, 4096, 2048, 256, 200, 7, 16384 + 128, 40960):
            for gran in (0, 1, 2):
                if gran == 1 and h % 128:
                    continue
                for t in (0, 1, 37) if h <= 16384 else (9,):
                    cases.append((dtype, h, gran, t, False))
        cases.append((dtype, 4096, 0, 33, True))
        cases.append((dtype, 4096, 1, 33, True))
        cases.append((dtype, 512, 2, 33, True))
    for dtype, h, gran, t, mis in cases:
        x = make_x(t, h, dtype, g)
        scales = [None] if gran != 2 else [None, torch.tensor(0.5), torch.tensor(3e-3), torch.tensor(float("inf"))]
        for s in scales:
            name = f"quantize {str(dtype)[6:]} T={t} H={h} {GRAN_NAMES[gran]}" + \
                   (f" scale={s.item():g}" if s is not None else "") + (" misaligned" if mis else "")

            def body(x=x, s=s, gran=gran, mis=mis):
                xs = x
                if gran == 2 and s is None:
                    xs = x.clone()
                    xs[2:5] = 0  # a tensor scale from a finite amax (else every byte is NaN)
                d_cpu, s_cpu = ops.quantize(xs, gran, s)
                xc = run.cuda(xs)
                if mis:
                    xc = misaligned(xc)
                d_gpu, s_gpu = run.no_sync(ops.quantize, xc, gran, run.cuda(s))
                _fp8_equal(d_cpu, d_gpu, "data")
                _float_equal(s_cpu, s_gpu, "scale")
                # dequantize of the CPU bytes, every output dtype
                if t and h:
                    for od in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                        y_cpu = ops.dequantize(d_cpu, s_cpu, od)
                        y_gpu = run.no_sync(ops.dequantize, run.cuda(d_cpu), run.cuda(s_cpu), od)
                        _float_equal(y_cpu, y_gpu, f"dequantize->{od}")
            run.check(name, body)

    def every_pattern():  # the cast on every bf16-exact value and a wide random sweep
        f = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)
        f = torch.cat([f, torch.randn(1 << 16, generator=g) * torch.logspace(-12, 4, 1 << 16)])
        for rows in (2, 16):  # H = 65536 (scalar kernel), 8192 (vector kernel)
            fr = f.view(rows, -1)
            for s in (torch.tensor(1.0), torch.tensor(1.0 / 3)):
                d_cpu, _ = ops.quantize(fr, 2, s)
                d_gpu, _ = run.no_sync(ops.quantize, run.cuda(fr), 2, run.cuda(s))
                _fp8_equal(d_cpu, d_gpu, "data")
            d_cpu, s_cpu = ops.quantize(fr, 0, None)
            d_gpu, s_gpu = ops.quantize(run.cuda(fr), 0, None)
            _fp8_equal(d_cpu, d_gpu, "row data")
            _float_equal(s_cpu, s_gpu, "row scale")
    run.check("quantize every float pattern", every_pattern)


# ---- dispatch_pack / dispatch_unpack -------------------------------------------------------------
def _pack_both(run, x, idx, w, e, r, gran, ts, cap=0, mis=False):
    out_cpu = ops.dispatch_pack(x, idx, w, e, r, gran, ts, cap)
    xc = run.cuda(x)
    if mis:
        xc = misaligned(xc)
    out_gpu = run.no_sync(ops.dispatch_pack, xc, run.cuda(idx), run.cuda(w), e, r, gran, run.cuda(ts), cap)
    return out_cpu, out_gpu


def _compare_pack(out_cpu, out_gpu, hidden, gran, k, r, cap):
    send_c, counts_c, spos_c = out_cpu
    send_g, counts_g, spos_g = out_gpu
    _exact(counts_c, counts_g, "counts")
    _exact(spos_c, spos_g, "send_pos")
    if send_c.shape != send_g.shape:
        raise Mismatch(f"send shape {tuple(send_c.shape)} vs {tuple(send_g.shape)}")
    rows = counts_c[:, ROWS].tolist()
    if cap:
        for q in range(r):
            _compare_dispatch_rows(send_c[q * cap:q * cap + rows[q]], send_g[q * cap:q * cap + rows[q]].cpu(),
                                   hidden, gran, k, f"send segment {q}")
    else:
        used = sum(rows)
        _compare_dispatch_rows(send_c[:used], send_g[:used].cpu(), hidden, gran, k, "send")


def _unpack_both(run, recv, counts, hidden, gran, k, n, rcap=0, ecap=0):
    out_cpu = ops.dispatch_unpack(recv, counts, hidden, gran, k, n, rcap, ecap)
    out_gpu = run.no_sync(ops.dispatch_unpack, run.cuda(recv), run.cuda(counts), hidden, gran, k, n, rcap, ecap)
    names = ["data", "scale", "weights", "tokens_per_expert", "slot_pos", "row_src"]
    for nm, a, b in zip(names, out_cpu, out_gpu):
        _any_equal(a, b, "unpack " + nm)
    return out_cpu


def _dispatch_case(run, g, t, h, k, r, e, dtype, gran, idx_dtype=torch.int64, bad=False, dup=False, mis=False,
                   capacity=False, sources=None):
    """Pack on `sources` senders (CPU and CUDA), compare; then unpack what rank 0..r-1 would
    receive from all of them, compare."""
    sources = sources or min(r, 3)
    hidden = h * torch.empty((), dtype=dtype).element_size() if gran == RAW else h
    outs = []
    for s in range(sources):
        x = make_x(t, h, dtype, g)
        idx, w = make_routing(t, k, e, g, bad=bad, dup=dup, idx_dtype=idx_dtype)
        ts = None
        if gran == 2:
            ts = torch.tensor([0.5, 0.01, 2.0][s % 3])
        if gran == RAW:
            x = x.view(torch.uint8).view(t, hidden) if t else torch.zeros(0, hidden, dtype=torch.uint8)
        cap = 0
        if capacity:
            # size the segments from the CPU layout (the caller drops to capacity first)
            _, c0, _ = ops.dispatch_pack(x, idx, w, e, r, gran, ts)
            cap = int(c0[:, ROWS].max()) + 3 if t else 1
        out_cpu, out_gpu = _pack_both(run, x, idx, w, e, r, gran, ts, cap, mis)
        _compare_pack(out_cpu, out_gpu, hidden, gran, k, r, cap)
        outs.append((out_cpu, cap))
    # receive side for each destination rank q (sources in order)
    el = e // r
    for q in range(r):
        counts = torch.stack([o[1][q] for o, _ in outs])
        if capacity:
            rcap = max(c for _, c in outs)
            segs = []
            for (send, c, _), cap in outs:
                seg = send[q * cap:(q + 1) * cap]
                if cap < rcap:
                    seg = torch.cat([seg, torch.zeros(rcap - cap, seg.shape[1], dtype=torch.uint8)])
                segs.append(seg)
            recv = torch.cat(segs)
            ecap = int(counts[:, HEADER:].max()) + 2
            n = el * sources * ecap
            _unpack_both(run, recv, counts, hidden, gran, k, n, rcap, ecap)
        else:
            parts = []
            for (send, c, _), _cap in outs:
                off = int(c[:q, ROWS].sum())
                parts.append(send[off:off + int(c[q, ROWS])])
            recv = torch.cat(parts)
            n = int(counts[:, HEADER:].sum())
            _unpack_both(run, recv, counts, hidden, gran, k, n)


def check_dispatch(run: Runner):
    g = torch.Generator().manual_seed(2)
    cases = [
        # (t, h, k, r, e, dtype, gran, extra)
        (0, 7168, 8, 8, 256, torch.bfloat16, 0, {}),
        (1, 7168, 8, 8, 256, torch.bfloat16, 0, {}),
        (37, 7168, 8, 8, 256, torch.bfloat16, 0, {}),
        (37, 7168, 8, 8, 256, torch.bfloat16, 1, {}),
        (37, 7168, 8, 8, 256, torch.bfloat16, 2, {}),
        (37, 7168, 8, 8, 256, torch.bfloat16, RAW, {}),
        (300, 4096, 2, 2, 64, torch.float16, 0, {"bad": True}),
        (300, 4096, 2, 2, 64, torch.float32, 1, {"idx_dtype": torch.int32, "bad": True}),
        (300, 2048, 1, 1, 8, torch.float32, 2, {}),
        (300, 2048, 3, 8, 64, torch.bfloat16, 0, {"bad": True}),  # K not a divisor of 32
        (300, 2048, 5, 2, 8, torch.bfloat16, 1, {"dup": True}),  # repeated experts in a token
        (200, 200, 8, 8, 64, torch.bfloat16, 0, {}),  # H % 16 != 0: scalar kernels
        (200, 200, 8, 8, 64, torch.float32, 2, {}),
        (200, 200, 8, 8, 64, torch.float16, RAW, {}),
        (100, 203, 2, 2, 8, torch.bfloat16, RAW, {}),  # raw bytes not a multiple of 4
        (100, 2048, 8, 8, 256, torch.bfloat16, 0, {"mis": True}),  # misaligned x: scalar kernels
        (100, 2048, 8, 8, 256, torch.float32, 1, {"mis": True}),
        (100, 17408, 4, 2, 8, torch.bfloat16, 1, {}),  # two units per thread
        (100, 40960, 2, 2, 8, torch.bfloat16, 0, {}),  # wider than the vector kernels
        (2500, 4096, 8, 8, 256, torch.bfloat16, 0, {"bad": True}),  # many layout chunks
        (2500, 1024, 8, 8, 256, torch.bfloat16, 0, {"idx_dtype": torch.int32}),
        (2500, 1024, 8, 64, 256, torch.bfloat16, 0, {"sources": 1}),  # many chunks, rank offsets of > 32 ranks (several groups of 32)
        (3000, 512, 6, 4, 64, torch.float16, 1, {}),  # chunks with tokens straddling warps
        (1500, 1024, 8, 8, 64, torch.bfloat16, 0, {"capacity": True}),
        (700, 2048, 4, 2, 8, torch.float32, 1, {"capacity": True}),
        (300, 2048, 4, 4, 16, torch.bfloat16, RAW, {"capacity": True}),
        (64, 2048, 8, 8, 2048, torch.bfloat16, 0, {}),  # many experts: fewer layout warps
        # one-block layout kernel (small, but not routed by the pack blocks themselves):
        (200, 1024, 16, 8, 64, torch.bfloat16, 0, {"bad": True}),  # top-k above 8
        (40, 1024, 8, 4, 16384, torch.bfloat16, 0, {}),  # expert tables too large for shared memory
        (600, 1024, 4, 4, 32, torch.bfloat16, 1, {"capacity": True}),  # more than 512 tokens
        (16384, 7168, 8, 8, 256, torch.bfloat16, 0, {"sources": 1}),  # the benchmark shape
    ]
    for t, h, k, r, e, dtype, gran, extra in cases:
        tag = " ".join(f"{a}={v if not isinstance(v, torch.dtype) else str(v)[6:]}" for a, v in extra.items())
        name = f"dispatch {str(dtype)[6:]} T={t} H={h} K={k} R={r} E={e} {GRAN_NAMES[gran]} {tag}".rstrip()
        run.check(name, lambda a=(t, h, k, r, e, dtype, gran), kw=extra: _dispatch_case(run, g, *a, **kw))

    def corrupt_rows():  # CPU raises; CUDA must skip the bad slots and not fault
        x = make_x(64, 256, torch.bfloat16, g, special=False)
        idx, w = make_routing(64, 4, 8, g)
        send, counts, _ = ops.dispatch_pack(x, idx, w, 8, 1, 0, None)
        rows = int(counts[0, ROWS])
        recv = send[:rows].clone()
        lay = dispatch_layout(256, 0, 4)
        ex = recv[:, lay["weight"] + 16:lay["weight"] + 32].view(torch.int32)
        ps = recv[:, lay["weight"] + 32:lay["weight"] + 48].view(torch.int32)
        ex[0, 0], ps[1, 0], ps[2, 1], ex[3, 0] = 99, -5, 1 << 30, 8
        n = int(counts[:, HEADER:].sum())
        out = run.no_sync(ops.dispatch_unpack, run.cuda(recv), run.cuda(counts), 256, 0, 4, n)
        sp = out[4].cpu()
        assert sp[0, 0] == -1 and sp[1, 0] == -1 and sp[2, 1] == -1 and sp[3, 0] == -1, sp[:4]
        # too few announced rows and a num_rows too small: no fault either
        out = run.no_sync(ops.dispatch_unpack, run.cuda(recv), run.cuda(counts), 256, 0, 4, max(n - 10, 0))
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    if run.device.type == "cuda":
        run.check("dispatch_unpack corrupt rows are skipped", corrupt_rows)


# ---- combine_pack / combine_unpack --------------------------------------------------------------
def check_combine(run: Runner):
    g = torch.Generator().manual_seed(3)
    cases = [
        # (t, h, k, r, e, dtype)
        (37, 7168, 8, 8, 256, torch.bfloat16),
        (300, 4096, 2, 2, 64, torch.float16),
        (300, 2048, 3, 4, 16, torch.float32),
        (200, 200, 8, 8, 64, torch.bfloat16),  # scalar kernels
        (64, 17408, 4, 2, 8, torch.bfloat16),  # two units per thread
        (16, 40960, 2, 2, 8, torch.float32),  # wider than the vector kernels
        (0, 2048, 4, 2, 8, torch.bfloat16),
        (2048, 7168, 8, 8, 256, torch.bfloat16),
    ]
    for t, h, k, r, e, dtype in cases:
        for quant in (False, True):
            for with_w, with_x in ((True, False), (False, True), (False, False)):
                name = f"combine {str(dtype)[6:]} T={t} H={h} K={k} R={r} E={e} quant={int(quant)} " \
                       f"weights={int(with_w)} extra={int(with_x)}"

                def body(t=t, h=h, k=k, r=r, e=e, dtype=dtype, quant=quant, with_w=with_w, with_x=with_x):
                    x = make_x(t, h, torch.float32, g, special=False)
                    idx, w = make_routing(t, k, e, g)
                    send, counts, send_pos = ops.dispatch_pack(x, idx, w, e, 1, 0, None)
                    rows = int(counts[:, ROWS].sum())
                    n = int(counts[:, HEADER:].sum())
                    _, _, wts, _, slot_pos, _ = ops.dispatch_unpack(send[:rows], counts, h, 0, k, n)
                    eo = make_x(n, h, dtype, g, special=True, scale=1e-2)
                    if n > 8:
                        eo[8] = float("nan")
                    wv = wts if with_w else None
                    xv = torch.rand(n, generator=g) if with_x else None
                    buf_c = ops.combine_pack(eo, slot_pos, wv, xv, quant)
                    buf_g = run.no_sync(ops.combine_pack, run.cuda(eo), run.cuda(slot_pos), run.cuda(wv), run.cuda(xv),
                                        quant)
                    extra_k = k if with_x else 0
                    _compare_combine_rows(buf_c, buf_g.cpu(), h, dtype, quant, extra_k, "combine_pack")
                    # the token side: the rows come back in send order (one sender, R = 1 here), then
                    # with R ranks: send_pos from a dispatch over r ranks and rows of a matching buffer
                    y_c, e_c = ops.combine_unpack(buf_c, send_pos, h, dtype, quant, extra_k)
                    y_g, e_g = run.no_sync(ops.combine_unpack, run.cuda(buf_c), run.cuda(send_pos), h, dtype, quant, extra_k)
                    _float_equal(y_c, y_g, "combine_unpack y")
                    _float_equal(e_c, e_g, "combine_unpack extra")
                    _, counts_r, spos_r = ops.dispatch_pack(x, idx, w, e, r, 0, None)
                    rows_r = int(counts_r[:, ROWS].sum())
                    fake = torch.randint(-1, max(n, 1), (rows_r, k), generator=g, dtype=torch.int32) if n else \
                        torch.full((rows_r, k), -1, dtype=torch.int32)
                    buf_r = ops.combine_pack(eo, fake, wv, xv, quant)
                    y_c, e_c = ops.combine_unpack(buf_r, spos_r, h, dtype, quant, extra_k)
                    y_g, e_g = run.no_sync(ops.combine_unpack, run.cuda(buf_r), run.cuda(spos_r), h, dtype, quant, extra_k)
                    _float_equal(y_c, y_g, f"combine_unpack y (R={r})")
                    _float_equal(e_c, e_g, f"combine_unpack extra (R={r})")
                    if quant:  # float64 output of the quantized wire
                        y_c = ops.combine_unpack(buf_r, spos_r, h, torch.float64, True, extra_k)[0]
                        y_g = ops.combine_unpack(run.cuda(buf_r), run.cuda(spos_r), h, torch.float64, True, extra_k)[0]
                        _float_equal(y_c, y_g, "combine_unpack y float64")
                run.check(name, body)

    def out_of_range():  # CPU raises; CUDA skips entries past the buffer / expert rows
        eo = torch.randn(10, 256)
        sp = torch.tensor([[0, 11], [3, -1], [1 << 30, 2]], dtype=torch.int32)
        buf = run.no_sync(ops.combine_pack, run.cuda(eo), run.cuda(sp), None, None, False)
        ref = ops.combine_pack(eo, torch.where(sp >= 10, -1, sp), None, None, False)
        _compare_combine_rows(ref, buf.cpu(), 256, torch.float32, False, 0, "combine_pack")
        send_pos = torch.tensor([[0, 5], [2, 1 << 30]], dtype=torch.int32)
        y = run.no_sync(ops.combine_unpack, buf, run.cuda(send_pos), 256, torch.float32, False, 0)[0]
        ref_y = ops.combine_unpack(ref, torch.where(send_pos >= 3, -1, send_pos), 256, torch.float32, False, 0)[0]
        _float_equal(ref_y, y, "combine_unpack")
    if run.device.type == "cuda":
        run.check("combine out-of-range positions are skipped", out_of_range)


# ---- CUDA graphs ------------------------------------------------------------------------------
def _graph_check(run, name, fn):
    def body():
        eager = fn()
        s = torch.cuda.Stream(run.device)
        s.wait_stream(torch.cuda.current_stream(run.device))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(run.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn()
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize(run.device)
        eager = eager if isinstance(eager, (tuple, list)) else (eager,)
        captured = captured if isinstance(captured, (tuple, list)) else (captured,)
        for i, (a, b) in enumerate(zip(eager, captured)):
            if a.dtype == torch.uint8 and a.dim() == 2 and a.shape[0] and "dispatch_pack" in name and i == 0:
                continue  # send tail rows are not written: compared through the used rows below
            _any_equal(a, b, f"output {i}")
        if "dispatch_pack" in name:
            used = int(eager[1][:, ROWS].sum())
            _exact(eager[0][:used], captured[0][:used], "send (used rows)")
    run.check("graph " + name, body)


def check_graph(run: Runner):
    g = torch.Generator().manual_seed(4)
    dev = run.device
    x = make_x(2500, 2048, torch.bfloat16, g).to(dev)
    idx, w = make_routing(2500, 8, 256, g, bad=True)
    idx, w = idx.to(dev), w.to(dev)
    ts = torch.tensor(0.25, device=dev)
    _graph_check(run, "quantize row", lambda: ops.quantize(x, 0, None))
    _graph_check(run, "quantize block128", lambda: ops.quantize(x, 1, None))
    _graph_check(run, "quantize tensor (amax on device)", lambda: ops.quantize(x, 2, None))
    _graph_check(run, "quantize tensor (given scale)", lambda: ops.quantize(x, 2, ts))
    q, s = ops.quantize(x, 0, None)
    _graph_check(run, "dequantize", lambda: ops.dequantize(q, s, torch.bfloat16))
    _graph_check(run, "dispatch_pack (multi-chunk layout)", lambda: ops.dispatch_pack(x, idx, w, 256, 8, 0, None))
    _graph_check(run, "dispatch_pack small (one chunk)", lambda: ops.dispatch_pack(x[:16], idx[:16], w[:16], 256, 8, 1, None))
    _graph_check(run, "dispatch_pack tensor", lambda: ops.dispatch_pack(x, idx, w, 256, 8, 2, ts))
    _graph_check(run, "dispatch_pack raw", lambda: ops.dispatch_pack(x.view(torch.uint8), idx, w, 256, 8, RAW, None))
    send, counts, send_pos = ops.dispatch_pack(x, idx, w, 256, 1, 0, None)
    rows, n = int(counts[:, ROWS].sum()), int(counts[:, HEADER:].sum())
    recv = send[:rows]
    _graph_check(run, "dispatch_unpack", lambda: ops.dispatch_unpack(recv, counts, 2048, 0, 8, n))
    cap = rows + 4
    send_c, counts_c, _ = ops.dispatch_pack(x, idx, w, 256, 1, 0, None, cap)
    ecap = int(counts_c[:, HEADER:].max()) + 1
    _graph_check(run, "dispatch_unpack capacity",
                 lambda: ops.dispatch_unpack(send_c, counts_c, 2048, 0, 8, 256 * ecap, cap, ecap))
    data, sc, wts, _, slot_pos, _ = ops.dispatch_unpack(recv, counts, 2048, 0, 8, n)
    eo = ops.dequantize(data, sc, torch.bfloat16)
    _graph_check(run, "combine_pack", lambda: ops.combine_pack(eo, slot_pos, wts, wts, False))
    _graph_check(run, "combine_pack quantized", lambda: ops.combine_pack(eo, slot_pos, wts, None, True))
    buf = ops.combine_pack(eo, slot_pos, wts, wts, False)
    _graph_check(run, "combine_unpack", lambda: ops.combine_unpack(buf, send_pos, 2048, torch.bfloat16, False, 8))
    _graph_check(run, "capacity_drop (one block)", lambda: ops.capacity_drop(idx[:300], w[:300], 256, 4))
    _graph_check(run, "capacity_drop (sort)", lambda: ops.capacity_drop(idx, w, 256, 40))


# ---- capacity_drop -----------------------------------------------------------------------------
def check_capacity_drop(run: Runner):
    g = torch.Generator().manual_seed(5)
    # (tokens, k, experts, capacity, ties): one block up to 4096 slots, the sorting path above
    for t, k, e, cap, ties in [(0, 8, 256, 4, False), (1, 1, 4, 1, False), (128, 8, 256, 8, False),
                               (128, 8, 256, 2, True), (512, 8, 32, 100, True), (500, 8, 8, 300, False),
                               (513, 8, 16, 7, True), (4096, 8, 256, 64, False), (3000, 4, 1000, 3, True),
                               (16384, 8, 256, 600, True), (20000, 2, 2, 9000, False)]:
        for idx_dtype in (torch.int64, torch.int32):
            idx, w = make_routing(t, k, e, g, bad=t > 100, idx_dtype=idx_dtype)
            if ties:  # a few weight values only (and -0 next to +0): ties broken by slot order
                w = (w * 4).round() / 4
                w[::5] = -0.0

            def body(idx=idx, w=w, e=e, cap=cap):
                a = ops.capacity_drop(idx, w, e, cap)
                b = run.no_sync(ops.capacity_drop, run.cuda(idx), run.cuda(w), e, cap)
                _exact(a[0], b[0], "ids")
                _exact(a[1], b[1], "dropped")
            run.check(f"capacity_drop t={t} k={k} e={e} cap={cap} ties={ties} {idx_dtype}", body)


CASES = {"quantize": check_quantize, "dispatch": check_dispatch, "combine": check_combine,
         "capacity_drop": check_capacity_drop, "graph": check_graph}


def check_all(device="cuda", only=None, verbose=True):
    """Runs the checks (all, or one of CASES; 'combine' also runs 'graph'). Raises AssertionError
    listing every failure."""
    run = Runner(device, verbose)
    if run.device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("check_cuda_ops needs CUDA")
    names = [only] if only else list(CASES)
    if run.device.type != "cuda":  # CPU vs CPU: only exercises this script
        names = [n for n in names if n != "graph"]
    if only == "combine" and run.device.type == "cuda":
        names.append("graph")
    t0 = time.time()
    for n in names:
        CASES[n](run)
    print(f"{run.passes} passed, {len(run.failures)} failed in {time.time() - t0:.1f}s", flush=True)
    if run.failures:
        raise AssertionError(f"{len(run.failures)} CUDA op checks failed:\n" + "\n".join(run.failures))
    return run.passes


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    ok = True
    try:
        check_all(only=args.only, verbose=not args.quiet)
    except AssertionError as e:
        print(e)
        ok = False
    sys.exit(0 if ok else 1)
