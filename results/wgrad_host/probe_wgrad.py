"""Host and device time of the FP8 wgrad's per-expert GEMMs: torch._scaled_mm per expert (the old
loop) against ops.wgrad_fp8_per_expert (one extension call)."""
import statistics, time, torch, sys
from fp8a2a import ops

def old_loop(a, sa, b, sb, widths, out_dtype):
    out = torch.empty((len(widths), a.shape[0], b.shape[0]), device=a.device, dtype=out_dtype)
    blocks = [w // 128 for w in widths]
    for out_e, n, a_e, bt_e, sat_e, sb_e in zip(out.unbind(0), widths, a.split(widths, 1), b.t().split(widths, 0),
                                               sa.t().split(blocks, 1), sb.split(blocks, 0)):
        torch._scaled_mm(a_e, bt_e, scale_a=sat_e, scale_b=sb_e, out_dtype=out_dtype, out=out_e)
    return out

def host_us(fn, n=30):
    ts = []
    for _ in range(n):
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)

def dev_ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)

torch.manual_seed(0)
for E, R in ((8, 4096), (32, 1024)):
    for name, Na, Nb in (("fc1", 4096, 7168), ("fc2", 7168, 2048)):
        # uneven counts around R, padded to 128
        counts = [max(0, R + (i % 5 - 2) * 200) for i in range(E)]
        widths = [-(-n // 128) * 128 for n in counts]
        M = sum(widths)
        a = (torch.randn(Na, M, device="cuda") * 4).to(torch.float8_e4m3fn)
        b = (torch.randn(Nb, M, device="cuda") * 4).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(M // 128, Na, device="cuda") + 0.5, torch.rand(M // 128, Nb, device="cuda") + 0.5
        f_old = lambda: old_loop(a, sa, b, sb, widths, torch.bfloat16)
        f_new = lambda: ops.wgrad_fp8_per_expert(a, sa, b, sb, widths, torch.bfloat16)
        diff = (f_old().float() - f_new().float()).abs().max().item()
        eq = torch.equal(f_old(), f_new())
        ho, hn = host_us(f_old), host_us(f_new)
        do, dn = dev_ms(f_old), dev_ms(f_new)
        fl = 2 * Na * Nb * sum(counts)
        print(f"{E}x{R} {name}: host us old {ho:.0f} new {hn:.0f} ({ho/hn:.1f}x); device ms old {do:.3f} new {dn:.3f} "
              f"({fl/do/1e9:.0f} / {fl/dn/1e9:.0f} TFLOP/s); equal {eq} maxdiff {diff:.3g}", flush=True)
