"""Probe (GPU): Triton grouped weight-gradient kernels at ~128 rows per expert (the DeepSeek-V3 MoE
layer at world size 1: 4096 tokens, top-8 of 256 experts) against torch._grouped_mm, same run.

    python scripts/probe_wgrad.py

out[e] = g_e^T @ x_e for fc1 (4096 x 7168) and fc2 (7168 x 2048): pointer loads with a tl.store or a
copy-engine (tensor descriptor) store, copy-engine loads through host or per-expert device
descriptors, over tile configs; each checked against torch (an expert without rows, an inf in the
next expert's first row that must not leak). BENCHMARKS.md records what it found."""
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile(pid, N, K, BN: tl.constexpr, BK: tl.constexpr):
    tiles_n = N // BN
    tiles_k = K // BK
    per_e = tiles_n * tiles_k
    e = pid // per_e
    r = pid % per_e
    return e, r // tiles_k, r % tiles_k


@triton.jit
def wgrad_hostdesc_kernel(g_desc, x_desc, offs_ptr, out_desc, N, K,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, tile_n, tile_k = _tile(tl.program_id(0), N, K, BN, BK)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    acc = tl.zeros([BN, BK], tl.float32)
    for m0 in range(start, end, BM):
        ok = (m0 + tl.arange(0, BM)) < end
        g = tl.where(ok[:, None], g_desc.load([m0, tile_n * BN]), 0.0)
        x = tl.where(ok[:, None], x_desc.load([m0, tile_k * BK]), 0.0)
        acc = tl.dot(tl.trans(g), x, acc)
    out_desc.store([e * N + tile_n * BN, tile_k * BK], acc.to(tl.bfloat16))


@triton.jit
def wgrad_devdesc_kernel(g_ptr, x_ptr, offs_ptr, out_desc, N, K,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, tile_n, tile_k = _tile(tl.program_id(0), N, K, BN, BK)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    rows = end - start
    # per-expert descriptors: the copy engine zero-fills rows past the expert's last one
    g_desc = tl.make_tensor_descriptor(g_ptr + start.to(tl.int64) * N, shape=[rows, N], strides=[N, 1], block_shape=[BM, BN])
    x_desc = tl.make_tensor_descriptor(x_ptr + start.to(tl.int64) * K, shape=[rows, K], strides=[K, 1], block_shape=[BM, BK])
    acc = tl.zeros([BN, BK], tl.float32)
    for m0 in range(0, rows, BM):
        g = g_desc.load([m0, tile_n * BN])
        x = x_desc.load([m0, tile_k * BK])
        acc = tl.dot(tl.trans(g), x, acc)
    out_desc.store([e * N + tile_n * BN, tile_k * BK], acc.to(tl.bfloat16))


@triton.jit
def wgrad_ptr_kernel(g_ptr, x_ptr, offs_ptr, out_ptr, out_desc, N, K, STORE: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Pointer loads; STORE 0: tl.store, 1: the copy engine (tensor descriptor), 2: tl.store .cs."""
    e, tile_n, tile_k = _tile(tl.program_id(0), N, K, BN, BK)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    rn = tile_n * BN + tl.arange(0, BN)
    rk = tile_k * BK + tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    for m0 in range(start, end, BM):
        rm = m0 + tl.arange(0, BM)
        m_ok = rm < end
        rm64 = rm.to(tl.int64)
        g = tl.load(g_ptr + rm64[:, None] * N + rn[None, :], mask=m_ok[:, None], other=0.0)
        x = tl.load(x_ptr + rm64[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(g), x, acc)
    if STORE == 1:
        out_desc.store([e * N + tile_n * BN, tile_k * BK], acc.to(tl.bfloat16))
    else:
        o = out_ptr + e.to(tl.int64) * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
        tl.store(o, acc.to(tl.bfloat16), cache_modifier=".cs" if STORE == 2 else "")


def run(g, x, offs, E, cfg, kind):
    BM, BN, BK, w, s = cfg
    M, N = g.shape
    K = x.shape[1]
    out = torch.empty((E, N, K), device=g.device, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(out.view(E * N, K), [BN, BK])
    grid = (E * (N // BN) * (K // BK),)
    kw = dict(BM=BM, BN=BN, BK=BK, num_warps=w, num_stages=s)
    if kind.startswith("ptr_load"):
        store = 1 if kind == "ptr_load+tma_store" else 2
        fn = lambda: wgrad_ptr_kernel[grid](g, x, offs, out, desc, N, K, STORE=store, **kw)  # noqa: E731
    elif kind == "host_desc":
        gd = TensorDescriptor.from_tensor(g, [BM, BN])
        xd = TensorDescriptor.from_tensor(x, [BM, BK])
        fn = lambda: wgrad_hostdesc_kernel[grid](gd, xd, offs, desc, N, K, **kw)  # noqa: E731
    elif kind == "dev_desc":
        fn = lambda: wgrad_devdesc_kernel[grid](g, x, offs, desc, N, K, **kw)  # noqa: E731
    return fn, out


def main():
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dev = "cuda"
    T, E, topk = 4096, 256, 8
    idx = torch.rand(T, E, device=dev).topk(topk, dim=1).indices
    counts = torch.bincount(idx.flatten(), minlength=E)
    counts[3] = 0  # an expert without rows (its gradient must be zeros)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    M = int(offs[-1])
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, f"rows {M}, per expert min "
          f"{int(counts.min())} max {int(counts.max())}", flush=True)
    configs = [(64, 128, 128, 4, 2), (64, 128, 128, 4, 3), (128, 128, 128, 4, 1), (128, 128, 128, 4, 2),
               (32, 128, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 256, 8, 2)]
    kinds = ["ptr_load+tma_store", "host_desc", "dev_desc", "ptr_load+st.cs"]
    for name, (N, K) in {"fc1 (4096 x 7168)": (4096, 7168), "fc2 (7168 x 2048)": (7168, 2048)}.items():
        g = (torch.randn(M, N, device=dev) * 0.01).to(torch.bfloat16)
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        x[offs[3]] = float("inf")  # first row of expert 4: must not leak into expert 2's tail tile
        keep = torch.tensor([0, 1, 2, 3, 5, 100, 255], device=dev)  # experts checked (4 holds the inf row)
        out_bytes = E * N * K * 2
        ref = torch._grouped_mm(g.t(), x, offs=offs, out_dtype=torch.bfloat16)
        t_torch = do_bench(lambda: torch._grouped_mm(g.t(), x, offs=offs, out_dtype=torch.bfloat16), warmup=5, rep=100)
        print(f"== {name}: output {out_bytes / 1e9:.2f} GB; torch._grouped_mm {t_torch:.3f} ms "
              f"({out_bytes / t_torch / 1e6:.0f} GB/s of output)", flush=True)
        todo = configs if N == 4096 else [(64, 128, 128, 4, 2), (64, 128, 128, 4, 3), (128, 128, 128, 4, 1), (64, 128, 64, 4, 3)]
        for kind in kinds:
            for cfg in todo:
                try:
                    fn, out = run(g, x, offs, E, cfg, kind)
                    fn()
                    torch.cuda.synchronize()
                    err = ((out[keep].float() - ref[keep].float()).norm() / ref[keep].float().norm()).item()
                    zero3 = bool((out[3] == 0).all()) and bool(out[2].isfinite().all())
                    t = do_bench(fn, warmup=3, rep=60)
                    del out
                    print(f"  {kind:20s} cfg {cfg}: {t:.3f} ms ({out_bytes / t / 1e6:.0f} GB/s) "
                          f"{t_torch / t:.2f}x torch, rel err {err:.1e}, empty expert zeros + no leak {zero3}", flush=True)
                except Exception as exc:  # out of resources etc.
                    print(f"  {kind:20s} cfg {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                torch.cuda.empty_cache()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"probe done in {time.time() - t0:.0f} s", file=sys.stderr)
