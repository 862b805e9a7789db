"""The cases of tests/gpu/test_cuda_ops.py: inputs, the CPU-vs-CUDA comparisons and the case tables.

The CPU implementation defines the semantics; every op on CUDA must give identical bytes: exact
everywhere, except that two NaNs compare equal whatever their sign and payload (x86 and the GPU
make different NaN bit patterns for inf*0 and propagate payloads differently; an e4m3 NaN is 0x7f
or 0xff). Each case draws its inputs from a generator seeded by its name (seeded()), so a case
gets the same inputs when run alone (-k) as in the whole file.
"""
import zlib

import torch

from fp8a2a import ops
from fp8a2a.quant import scale_rule
from fp8a2a.wire import BLOCK, CountsCol, Granularity

ROWS, HEADER = CountsCol.ROWS, CountsCol.EXPERTS
RAW = int(Granularity.RAW)
GRAN_NAMES = {0: "row", 1: "block128", 2: "tensor", 3: "raw"}
DEVICE = torch.device("cuda")


# ---------------------------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------------------------
class Mismatch(AssertionError):
    pass


def first_diff(mask):
    idx = mask.nonzero()
    return idx[0].tolist() if idx.numel() else None


def float_equal(a, b, name):
    """Bit-identical floats, NaN == NaN regardless of sign/payload."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    if a.numel() == 0:
        return
    ib = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    same = (a.view(ib) == b.view(ib)) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        at = first_diff(~same)
        raise Mismatch(f"{name}: {int((~same).sum())} elements differ, first at {at}: "
                       f"cpu={a[tuple(at)].item()!r} cuda={b[tuple(at)].item()!r}")


def e4m3_canon(u8):
    return torch.where(u8 & 0x7F == 0x7F, torch.full_like(u8, 0x7F), u8)


def fp8_equal(a, b, name):
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    ua = e4m3_canon(a.view(torch.uint8) if a.dtype != torch.uint8 else a)
    ub = e4m3_canon(b.view(torch.uint8) if b.dtype != torch.uint8 else b)
    same = ua == ub
    if not bool(same.all()):
        at = first_diff(~same)
        raise Mismatch(f"{name}: {int((~same).sum())} e4m3 bytes differ, first at {at}: "
                       f"cpu=0x{int(ua[tuple(at)]):02x} cuda=0x{int(ub[tuple(at)]):02x}")


def exact(a, b, name):
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    if a.numel() and not torch.equal(a, b):
        ne = a != b
        at = first_diff(ne)
        raise Mismatch(f"{name}: {int(ne.sum())} elements differ, first at {at}: "
                       f"cpu={a[tuple(at)].item()!r} cuda={b[tuple(at)].item()!r}")


def any_equal(a, b, name):
    if a.dtype == torch.float8_e4m3fn:
        fp8_equal(a, b, name)
    elif a.is_floating_point():
        float_equal(a, b, name)
    else:
        exact(a, b, name)


def dispatch_layout(hidden, gran, k):
    ns = {0: 1, 1: hidden // BLOCK, 2: 1, 3: 0}[gran]
    scale = (hidden + 3) // 4 * 4
    weight = scale + 4 * ns
    return dict(scale=scale, weight=weight, bytes=ops.dispatch_row_bytes(hidden, gran, k))


def compare_dispatch_rows(a, b, hidden, gran, k, name):
    """a, b: [rows, bytes] uint8 dispatch rows: payload as e4m3 (raw: exact), scales NaN-aware,
    routing fields and padding exact."""
    lay = dispatch_layout(hidden, gran, k)
    if a.shape != b.shape:
        raise Mismatch(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.shape[0] == 0:
        return
    if gran == RAW:
        exact(a[:, :hidden], b[:, :hidden], name + " payload")
    else:
        fp8_equal(a[:, :hidden], b[:, :hidden], name + " payload")
    exact(a[:, hidden:lay["scale"]], b[:, hidden:lay["scale"]], name + " pad")
    sa = a[:, lay["scale"]:lay["weight"]].contiguous().view(torch.float32)
    sb = b[:, lay["scale"]:lay["weight"]].contiguous().view(torch.float32)
    float_equal(sa, sb, name + " scales")
    exact(a[:, lay["weight"]:], b[:, lay["weight"]:], name + " routing/pad")


def compare_combine_rows(a, b, hidden, dtype, quant, extra_k, name):
    elem = 1 if quant else torch.empty((), dtype=dtype).element_size()
    pay = hidden * elem
    scale_off = (pay + 3) // 4 * 4
    if a.shape != b.shape:
        raise Mismatch(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.shape[0] == 0:
        return
    if quant:
        fp8_equal(a[:, :pay], b[:, :pay], name + " payload")
    else:
        float_equal(a[:, :pay].contiguous().view(dtype), b[:, :pay].contiguous().view(dtype), name + " payload")
    exact(a[:, pay:scale_off], b[:, pay:scale_off], name + " pad")
    off = scale_off
    if quant:
        float_equal(a[:, off:off + 4].contiguous().view(torch.float32), b[:, off:off + 4].contiguous().view(torch.float32),
                     name + " scale")
        off += 4
    exact(a[:, off:], b[:, off:], name + " extra/pad")


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
# the device side
# ---------------------------------------------------------------------------------------------
def seeded(name):
    """A CPU generator seeded from a case's name (stable across runs and selections)."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def dev(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


def no_sync(fn, *args):
    """Run on CUDA with synchronizing calls turned into errors."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(*args)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize(DEVICE)
    return out


# ---------------------------------------------------------------------------------------------
# dispatch_pack / dispatch_unpack
# ---------------------------------------------------------------------------------------------
def _pack_both(x, idx, w, e, r, gran, ts, cap=0, mis=False, needs_grad=False):
    out_cpu = ops.dispatch_pack(x, idx, w, e, r, gran, ts, cap, needs_grad)
    xc = dev(x)
    if mis:
        xc = misaligned(xc)
    out_gpu = no_sync(ops.dispatch_pack, xc, dev(idx), dev(w), e, r, gran, dev(ts), cap, needs_grad)
    return out_cpu, out_gpu


def _compare_pack(out_cpu, out_gpu, hidden, gran, k, r, cap, needs_grad):
    send_c, counts_c, spos_c = out_cpu
    send_g, counts_g, spos_g = out_gpu
    exact(counts_c, counts_g, "counts")
    if counts_c[:, CountsCol.GRAD].tolist() != [int(needs_grad)] * r:
        raise Mismatch(f"counts' GRAD column {counts_c[:, CountsCol.GRAD].tolist()}, needs_grad={needs_grad}")
    exact(spos_c, spos_g, "send_pos")
    if send_c.shape != send_g.shape:
        raise Mismatch(f"send shape {tuple(send_c.shape)} vs {tuple(send_g.shape)}")
    rows = counts_c[:, ROWS].tolist()
    if cap:
        for q in range(r):
            compare_dispatch_rows(send_c[q * cap:q * cap + rows[q]], send_g[q * cap:q * cap + rows[q]].cpu(),
                                   hidden, gran, k, f"send segment {q}")
    else:
        used = sum(rows)
        compare_dispatch_rows(send_c[:used], send_g[:used].cpu(), hidden, gran, k, "send")


def _unpack_both(recv, counts, hidden, gran, k, n, rcap=0, ecap=0):
    out_cpu = ops.dispatch_unpack(recv, counts, hidden, gran, k, n, rcap, ecap)
    out_gpu = no_sync(ops.dispatch_unpack, dev(recv), dev(counts), hidden, gran, k, n, rcap, ecap)
    names = ["data", "scale", "weights", "tokens_per_expert", "slot_pos", "row_src"]
    for nm, a, b in zip(names, out_cpu, out_gpu):
        any_equal(a, b, "unpack " + nm)
    return out_cpu


def dispatch_case(g, t, h, k, r, e, dtype, gran, idx_dtype=torch.int64, bad=False, dup=False, mis=False,
                   capacity=False, sources=None):
    """Pack on `sources` senders (CPU and CUDA), compare (odd senders pack with needs_grad); then
    unpack what rank 0..r-1 would receive from all of them, compare."""
    sources = sources or min(r, 3)
    hidden = h * torch.empty((), dtype=dtype).element_size() if gran == RAW else h
    outs = []
    for s in range(sources):
        x = make_x(t, h, dtype, g)
        idx, w = make_routing(t, k, e, g, bad=bad, dup=dup, idx_dtype=idx_dtype)
        ts = None
        if gran == 2:  # a given scale (multiplier 1 / s), or [s, 448 / amax] as the Dispatcher passes
            amax = x.float().abs().amax() if x.numel() else torch.zeros(())
            ts = torch.stack(scale_rule(amax)[::-1]) if s % 3 == 2 else torch.tensor([0.5, 0.01][s % 3])
        if gran == RAW and s != 1:  # source 1 passes x itself (the op views it as bytes)
            x = x.view(torch.uint8).view(t, hidden) if t else torch.zeros(0, hidden, dtype=torch.uint8)
        cap = 0
        if capacity:
            # size the segments from the CPU layout (the caller drops to capacity first)
            _, c0, _ = ops.dispatch_pack(x, idx, w, e, r, gran, ts)
            cap = int(c0[:, ROWS].max()) + 3 if t else 1
        needs_grad = s % 2 == 1
        out_cpu, out_gpu = _pack_both(x, idx, w, e, r, gran, ts, cap, mis, needs_grad)
        _compare_pack(out_cpu, out_gpu, hidden, gran, k, r, cap, needs_grad)
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
            _unpack_both(recv, counts, hidden, gran, k, n, rcap, ecap)
        else:
            parts = []
            for (send, c, _), _cap in outs:
                off = int(c[:q, ROWS].sum())
                parts.append(send[off:off + int(c[q, ROWS])])
            recv = torch.cat(parts)
            n = int(counts[:, HEADER:].sum())
            _unpack_both(recv, counts, hidden, gran, k, n)



# A given tensor scale and rows holding NaN or Inf: (dtype, hidden, misaligned x) for the vector
# kernels (one unit per thread, two), the scalar ones by H and by address
TENSOR_NONFINITE_CASES = [(dtype, h, mis) for dtype in (torch.bfloat16, torch.float16, torch.float32)
                          for h, mis in ((2048, False), (17408, False), (200, False), (2048, True))]


def tensor_nonfinite_name(dtype, h, mis):
    return f"tensor-scale nonfinite {_dtype_name(dtype)} H={h}" + (" misaligned" if mis else "")


def _nan_payload(rows, hidden, name):
    """Every payload byte of these rows is kE4M3NaN (0x7f exactly: written, not cast)."""
    exact(rows[:, :hidden], torch.full((rows.shape[0], hidden), 0x7F, dtype=torch.uint8), name)


def tensor_nonfinite_case(g, dtype, h, mis):
    """quantize and dispatch_pack with a given tensor scale ([s]; dispatch also [s, q]) on rows that
    hold NaN or Inf: each such row is e4m3 NaN throughout on both devices, the others finite bytes.
    dispatch_pack with 40 tokens (self-routed pack blocks) and 600 (layout kernels)."""
    x = make_x(600, h, dtype, g)  # rows 2 (a NaN), 3 (a -inf), 4 (all inf)
    x[9, h - 1], x[500, 0] = float("inf"), float("nan")  # one in the row's last unit, one in its first
    bad = ~torch.isfinite(x.float()).all(1)
    assert bad.nonzero().flatten().tolist() == [2, 3, 4, 9, 500]
    xc = misaligned(dev(x)) if mis else dev(x)
    s = torch.tensor(0.02)
    d_cpu, _ = ops.quantize(x, 2, s)
    d_gpu, _ = no_sync(ops.quantize, xc, 2, dev(s))
    fp8_equal(d_cpu, d_gpu, "quantize data")
    u = d_gpu.cpu().view(torch.uint8)
    _nan_payload(u[bad], h, "quantize: NaN rows")
    if (u[~bad] == 0x7F).all(1).any():
        raise Mismatch("quantize: a finite row came out all NaN")
    idx, w = make_routing(600, 8, 64, g)
    for ts in (torch.tensor([0.02]), torch.stack(scale_rule(torch.tensor(300.0))[::-1])):
        for n in (40, 600):
            out_cpu, out_gpu = _pack_both(x[:n], idx[:n], w[:n], 64, 4, 2, ts, 0, mis)
            _compare_pack(out_cpu, out_gpu, h, 2, 8, 4, 0, False)
            send, _, send_pos = (o.cpu() for o in out_gpu)
            rows = send_pos[bad[:n]]
            rows = rows[rows >= 0].long()
            if rows.numel() == 0:
                raise Mismatch("no row of a non-finite token was sent")
            _nan_payload(send[rows], h, f"dispatch_pack n={n}: NaN rows")


DISPATCH_CASES = [
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


def _dtype_name(dtype):
    return str(dtype)[6:]


def dispatch_name(t, h, k, r, e, dtype, gran, extra):
    tag = " ".join(f"{a}={_dtype_name(v) if isinstance(v, torch.dtype) else v}" for a, v in extra.items())
    return f"dispatch {_dtype_name(dtype)} T={t} H={h} K={k} R={r} E={e} {GRAN_NAMES[gran]} {tag}".rstrip()


def case_id(name):
    """A case name as a pytest id: without the op's name, words joined by '-'."""
    return name.split(" ", 1)[1].replace(" ", "-")


# ---------------------------------------------------------------------------------------------
# the other case tables
# ---------------------------------------------------------------------------------------------
def quantize_cases():
    """(name, dtype, hidden, granularity, tokens, misaligned, given tensor scale or None); the cases
    of one input differ in the given scale only and share the input (seeded by the name without it)."""
    shapes = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for h in (7168, 4096, 2048, 256, 200, 7, 16384 + 128, 40960):
            for gran in (0, 1, 2):
                if gran == 1 and h % 128:
                    continue
                for t in (0, 1, 37) if h <= 16384 else (9,):
                    shapes.append((dtype, h, gran, t, False))
        shapes.append((dtype, 4096, 0, 33, True))
        shapes.append((dtype, 4096, 1, 33, True))
        shapes.append((dtype, 512, 2, 33, True))
    out = []
    for dtype, h, gran, t, mis in shapes:
        for s in [None] if gran != 2 else [None, 0.5, 3e-3, float("inf")]:
            out.append((dtype, h, gran, t, mis, s))
    return out


def quantize_name(dtype, h, gran, t, mis, s):
    return f"quantize {_dtype_name(dtype)} T={t} H={h} {GRAN_NAMES[gran]}" + \
        (f" scale={s:g}" if s is not None else "") + (" misaligned" if mis else "")


# (t, h, k, r, e, dtype)
COMBINE_CASES = [
    (37, 7168, 8, 8, 256, torch.bfloat16),
    (300, 4096, 2, 2, 64, torch.float16),
    (300, 2048, 3, 4, 16, torch.float32),
    (200, 200, 8, 8, 64, torch.bfloat16),  # scalar kernels
    (64, 17408, 4, 2, 8, torch.bfloat16),  # two units per thread
    (16, 40960, 2, 2, 8, torch.float32),  # wider than the vector kernels
    (0, 2048, 4, 2, 8, torch.bfloat16),
    (2048, 7168, 8, 8, 256, torch.bfloat16),
]
# (quant, with_w, with_x) for each of COMBINE_CASES
COMBINE_MODES = [(quant, with_w, with_x) for quant in (False, True)
                 for with_w, with_x in ((True, False), (False, True), (False, False))]

# combine_pack with expert rows in one dtype and the wire row in another, each pair, both wires:
# (h, misaligned expert rows) for one unit per thread, two, the scalar kernel by H and by address
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COMBINE_DTYPE_SHAPES = [(2048, False), (17408, False), (200, False), (2048, True)]
COMBINE_DTYPE_CASES = [(h, mis, eo_dtype, wire, quant) for h, mis in COMBINE_DTYPE_SHAPES for eo_dtype in FLOAT_DTYPES
                       for wire in FLOAT_DTYPES for quant in (False, True)]


def combine_dtype_name(h, mis, eo_dtype, wire, quant):
    return f"combine_pack H={h} {_dtype_name(eo_dtype)}->{_dtype_name(wire)} quant={int(quant)}" + \
        (" misaligned" if mis else "")

# combine_backward_rows: (rows, hidden, dy's rows: "e4m3" or a raw dtype, the gradient's dtype,
# misaligned rows and expert_out). One warp per row: H % 16 == 0 and 16-byte aligned rows take the
# vector kernel, any other the scalar one; both sum the router-weight gradient in fp8_common.h's order.
COMBINE_BACKWARD_CASES = [
    (0, 7168, "e4m3", torch.bfloat16, False),
    (37, 7168, "e4m3", torch.bfloat16, False),
    (37, 7168, "e4m3", torch.float16, False),
    (37, 7168, "e4m3", torch.float32, False),
    (37, 7168, "e4m3", torch.float64, False),
    (37, 7168, torch.bfloat16, torch.bfloat16, False),
    (37, 4096, torch.float16, torch.float32, False),
    (37, 2048, torch.float32, torch.bfloat16, False),
    (37, 2048, torch.float32, torch.float64, False),
    (300, 200, "e4m3", torch.bfloat16, False),  # H % 16 != 0: scalar kernel
    (300, 200, torch.bfloat16, torch.float16, False),
    (33, 31, torch.float16, torch.float16, False),
    (5, 1, "e4m3", torch.float32, False),
    (100, 2048, "e4m3", torch.bfloat16, True),  # misaligned: scalar kernel
    (100, 2048, torch.float32, torch.float32, True),
    (64, 17408, "e4m3", torch.bfloat16, False),  # 34 units per lane
    (16, 40960, "e4m3", torch.float32, False),
    (4096, 7168, "e4m3", torch.bfloat16, False),  # the benchmark's rows (a share of them)
]


def combine_backward_name(n, h, rows, dtype, mis):
    rows = rows if isinstance(rows, str) else _dtype_name(rows)
    return f"combine_backward_rows N={n} H={h} {rows}->{_dtype_name(dtype)}" + (" misaligned" if mis else "")


def combine_backward_case(g, n, h, rows, dtype, mis):
    """CPU against CUDA with and without weights and expert_out: the gradient's bytes and the
    router-weight gradient's bytes (NaNs as NaNs), rows with NaN, Inf, zeros and 1e-6..1e3 spans."""
    x = make_x(n, h, torch.float32, g)
    data, scale = ops.quantize(x, 0, None) if rows == "e4m3" else (x.to(rows), None)
    eo = make_x(n, h, dtype, g, special=n > 20, scale=1e-2)
    w = torch.rand(n, generator=g)
    if n > 9:
        w[9] = float("nan")
    put = misaligned if mis else (lambda t: t)
    for weights in (w, None):
        for expert_out in (eo, None):
            want = ops.combine_backward_rows(data, scale, weights, expert_out, dtype)
            got = no_sync(ops.combine_backward_rows, put(dev(data)), dev(scale), dev(weights),
                          None if expert_out is None else put(dev(expert_out)), dtype)
            tag = f"weights={int(weights is not None)} expert_out={int(expert_out is not None)}"
            float_equal(want[0], got[0], "grad " + tag)
            float_equal(want[1], got[1], "grad_weights " + tag)


# (tokens, k, experts, capacity, weights): one block up to 4096 slots (and few enough experts),
# buckets and a radix select above. weights: "rand", "ties" (a few values, -0 next to +0), "nan"
# (NaNs of both signs and payloads, infinities, zeros), "one" (every routed slot on one expert,
# with ties and NaNs), "skew" (most slots on three experts).
CAPACITY_DROP_CASES = [(0, 8, 256, 4, "rand"), (1, 1, 4, 1, "rand"), (128, 8, 256, 8, "rand"),
                       (128, 8, 256, 2, "ties"), (512, 8, 32, 100, "ties"), (500, 8, 8, 300, "rand"),
                       (513, 8, 16, 7, "ties"), (4096, 8, 256, 64, "rand"), (3000, 4, 1000, 3, "ties"),
                       (16384, 8, 256, 600, "ties"), (20000, 2, 2, 9000, "rand"),
                       (4097, 1, 1, 1, "one"), (4099, 3, 8, 1000, "nan"), (5003, 7, 64, 300, "skew"),
                       (12345, 3, 2048, 4, "ties"), (9001, 5, 256, 1, "nan"), (33333, 1, 3, 11111, "rand"),
                       (20011, 7, 16, 5000, "one"), (40009, 8, 256, 1, "one"), (100, 8, 1 << 22, 1, "skew")]


def capacity_drop_inputs(t, k, e, weights, g, idx_dtype):
    idx, w = make_routing(t, k, e, g, bad=t > 100, dup=e > 4096, idx_dtype=idx_dtype)
    if weights == "skew":
        few = torch.randint(0, min(e, 3), idx.shape, generator=g).to(idx_dtype)
        idx = torch.where((idx >= 0) & (idx < e) & (torch.rand(idx.shape, generator=g) < 0.8), few, idx)
    if weights == "one":
        idx = torch.where((idx >= 0) & (idx < e), e // 2, idx)
    if weights in ("ties", "one"):  # ties broken by slot order
        w = (w * 4).round() / 4
        w[::5] = -0.0
    if weights in ("nan", "one"):
        f = w.view(-1)
        f[::7] = float("nan")
        f.view(torch.int32)[3::11] = 0x7fc00001
        f.view(torch.int32)[5::13] = -0x400000  # 0xffc00000: a negative NaN
        f[6::17], f[8::19], f[10::29] = float("-inf"), float("inf"), 0.0
        f[9::23] = -f[9::23]
    return idx, w


def combine_name(t, h, k, r, e, dtype, quant, with_w, with_x):
    return f"combine {_dtype_name(dtype)} T={t} H={h} K={k} R={r} E={e} quant={int(quant)} " \
           f"weights={int(with_w)} extra={int(with_x)}"


def capacity_drop_name(t, k, e, cap, weights, idx_dtype):
    return f"capacity_drop t={t} k={k} e={e} cap={cap} weights={weights} {idx_dtype}"
