"""block_col_quant_t (the FP8 wgrad's 1 x 128 quantize-transpose) at the layer's four operands,
8 and 32 experts x 4096 tokens top-8 (32768 rows): column tile BC and warps, bytes checked against
the shipped launch, device time and the rate of bytes read + written."""
import torch
import triton

from fp8a2a import triton_kernels as tk
from fp8a2a import wire
from fp8a2a.experts import _wgrad_padding


def timeit(f, n=30):
    for _ in range(3):
        f()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        f()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2] * 1e3


def launch(x, sx, offs, pad_offs, mpad, BC, warps):
    M, C = x.shape
    G = offs.shape[0]
    data = torch.empty((C, mpad), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((mpad // wire.BLOCK, C), device=x.device, dtype=torch.float32)
    x_scale = 0 if sx is None else 1
    s_sxm = sx.stride(0) if sx is not None else 0
    tk._block_col_quant_t_kernel[(mpad // wire.BLOCK, triton.cdiv(C, BC))](
        x, sx if sx is not None else scale, offs, pad_offs, data, scale, C, G, mpad, scale.stride(0),
        x.stride(0), x.stride(1), s_sxm, 0, X_SCALE=x_scale, GB=triton.next_power_of_2(G), BC=BC, num_warps=warps)
    return data, scale


torch.manual_seed(0)
M = 32768
print(torch.cuda.get_device_name())
for E in (8, 32):
    counts = [M // E] * E
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    pad_offs, mpad = _wgrad_padding(offs, M, counts)
    for name, C, fp8 in (("dy of fc2", 7168, False), ("h (fc2 input)", 2048, True),
                         ("dz of fc1", 4096, False), ("x (fc1 input)", 7168, True)):
        if fp8:
            x = torch.randn(M, C, device="cuda").to(torch.float8_e4m3fn)
            sx = torch.rand(M, device="cuda")
        else:
            x, sx = torch.randn(M, C, device="cuda", dtype=torch.bfloat16), None
        ref = tk.block_col_quant_t(x, offs, pad_offs, mpad, sx=sx)
        nbytes = x.numel() * x.element_size() + ref[0].numel() + ref[1].numel() * 4
        base = timeit(lambda: tk.block_col_quant_t(x, offs, pad_offs, mpad, sx=sx))
        row = [f"E={E:2d} {name:14s} shipped {base:7.1f} us {nbytes / base / 1e6:5.2f} TB/s"]
        for BC in (64, 128, 256):
            for warps in (4, 8):
                try:
                    out = launch(x, sx, offs, pad_offs, mpad, BC, warps)
                    same = torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])
                    t = timeit(lambda: launch(x, sx, offs, pad_offs, mpad, BC, warps))
                    row.append(f"BC{BC}/w{warps} {t:6.1f}{'' if same else ' BYTES DIFFER'}")
                except Exception as e:  # noqa: BLE001
                    row.append(f"BC{BC}/w{warps} failed {type(e).__name__}")
        print("  ".join(row), flush=True)
