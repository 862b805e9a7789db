"""Time block_col_quant_t's tile width / warps at the layer's shapes; check bytes equal to the default."""
import torch, triton, itertools, sys
import fp8a2a.triton_kernels as tk
from fp8a2a import wire
from fp8a2a.experts import _wgrad_padding

def run(x, offs, pad, mpad, sx, BC, W):
    M, C = x.shape
    G = offs.shape[0]
    data = torch.empty((C, mpad), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((mpad // wire.BLOCK, C), device=x.device, dtype=torch.float32)
    xs = 0 if sx is None else 1
    tk._block_col_quant_t_kernel[(mpad // wire.BLOCK, triton.cdiv(C, BC))](
        x, sx if sx is not None else scale, offs, pad, data, scale, C, G, mpad, scale.stride(0),
        x.stride(0), x.stride(1), sx.stride(0) if sx is not None else 0, 0, X_SCALE=xs,
        GB=triton.next_power_of_2(G), BC=BC, num_warps=W)
    return data, scale

def timeit(f, n=20):
    for _ in range(3): f()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record(); f(); b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2] * 1e3

torch.manual_seed(0)
M = 32768
for E in (8, 32):
    counts = torch.full((E,), M // E)
    counts[0] += 37; counts[-1] -= 37
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    pad, mpad = _wgrad_padding(offs, M, counts.tolist())
    for name, C, fp8 in (("dy", 7168, False), ("xq", 7168, True), ("dz", 4096, False), ("hq", 2048, True)):
        v = torch.randn(M, C, device="cuda")
        if fp8:
            x = (v * 100).clamp(-448, 448).to(torch.float8_e4m3fn); sx = torch.rand(M, device="cuda") + 0.5
        else:
            x = v.to(torch.bfloat16); sx = None
        ref = run(x, offs, pad, mpad, sx, 64, 4)
        gb = (x.numel() * x.element_size() + C * mpad) / 1e9
        row = []
        for BC, W in itertools.product((32, 64, 128, 256), (2, 4, 8)):
            try:
                out = run(x, offs, pad, mpad, sx, BC, W)
                same = torch.equal(out[0].view(torch.uint8)[:, :int(pad[-1])], ref[0].view(torch.uint8)[:, :int(pad[-1])]) \
                    and torch.equal(out[1], ref[1])
                us = timeit(lambda: run(x, offs, pad, mpad, sx, BC, W))
                row.append((us, BC, W, same))
            except Exception as e:  # noqa
                row.append((float("inf"), BC, W, repr(e)[:40]))
        row.sort()
        print(f"E={E} {name} [{M},{C}] {'fp8' if fp8 else 'bf16'}: default(64,4) "
              f"{[r for r in row if r[1:3] == (64, 4)][0][0]:.1f} us; best:",
              ", ".join(f"{us:.1f}us BC={b} w={w} eq={s} {gb / us * 1e6 / 1e3:.2f}TB/s" for us, b, w, s in row[:4]),
              flush=True)

# grouped_mm_fp8 tiles at the layer's GEMM shapes (8 experts, 32768 rows), against a dense rowwise _scaled_mm
from fp8a2a.triton_gemm import grouped_mm_fp8, FP8_TILE
E = 8
counts = torch.full((E,), M // E)
offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
for name, N, K in (("fc1", 4096, 7168), ("fc2", 7168, 2048), ("dgrad_fc2", 2048, 7168), ("dgrad_fc1", 7168, 4096)):
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(E, N, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(M, device="cuda"); sw = torch.rand(E, N, device="cuda")
    fl = 2 * M * N * K
    big = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    dense = timeit(lambda: torch._scaled_mm(a, big.t(), torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda"),
                                            out_dtype=torch.bfloat16, use_fast_accum=True))
    ref = grouped_mm_fp8(a, sa, w, sw, offs)
    res = []
    for tile in [FP8_TILE, (128, 256, 128, 8, 3), (128, 256, 128, 8, 5), (128, 256, 64, 8, 4), (128, 256, 64, 8, 6),
                 (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 6), (256, 128, 128, 8, 4),
                 (128, 256, 128, 12, 4), (256, 128, 64, 8, 5)]:
        try:
            out = grouped_mm_fp8(a, sa, w, sw, offs, tile=tile)
            ok = torch.equal(out, ref)
            us = timeit(lambda: grouped_mm_fp8(a, sa, w, sw, offs, tile=tile))
            res.append((us, tile, ok))
        except Exception as e:  # noqa
            res.append((float("inf"), tile, repr(e)[:60]))
    print(f"{name} N={N} K={K}: dense {dense:.0f} us {fl / dense / 1e6:.0f} TF/s;",
          "; ".join(f"{t} {us:.0f}us {fl / us / 1e6:.0f}TF/s {fl / us / 1e6 / (fl / dense / 1e6):.3f} eq={ok}"
                    for us, t, ok in res), flush=True)
