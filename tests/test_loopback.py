"""fp8a2a.loopback on the CPU: the loopback group against real gloo ranks, and dispatchers on it.

The model (fp8a2a/loopback.py): virtual rank j holds rank r's data with its expert blocks relabelled
by r - j, so what j sends r is what r sends j. Real gloo ranks whose inputs have that symmetry
(a symmetric send matrix; routing relabel_experts(B, E, n, -a) on rank a) must receive on rank r
exactly what the loopback group returns to rank r alone. Each loopback rank runs in a forked child
(the loopback world is torch.distributed's default group)."""
import contextlib
import json
import functools
import io
import multiprocessing as mp
import queue
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import fp8a2a
from fp8a2a import loopback

from .distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def portable(fn):
    """fn's result as torch.save bytes: tensors sent through a multiprocessing queue travel as shared
    memory handles, which die with the child that made them."""
    @functools.wraps(fn)
    def wrapped(*args):
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        return buf.getvalue()
    return wrapped


def unpack(blob):
    return torch.load(io.BytesIO(blob), weights_only=False)


def ranks(n, fn, *args):
    """run_ranks with tensors in the results."""
    return [unpack(b) for b in run_ranks(n, portable(fn), *args)]


def in_child(fn, *args, timeout=240):
    """fn(*args) in a forked process (its own torch.distributed state); its result or its traceback."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def main():
        try:
            torch.set_num_threads(1)
            q.put((None, portable(fn)(*args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            q.put((traceback.format_exc(), None))

    p = ctx.Process(target=main, daemon=True)
    p.start()
    try:
        err, res = q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"in_child: no answer within {timeout} s") from None
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    if err:
        raise RuntimeError(f"in_child failed:\n{err}")
    return unpack(res)


@contextlib.contextmanager
def loopback_world(n, rank, link="none", **kw):
    loopback.init(n, rank=rank, link=link, **kw)
    try:
        yield loopback.world()
    finally:
        loopback.destroy()


def all_gather_flat(out, inp, group=None):
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_flat(out, inp, group=None):
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)


# ---- the collectives against gloo -------------------------------------------------------------

E_COUNTS = 12  # per-expert counts gathered with relabelling (divisible by 2, 3 and 4 ranks)


def pair_rows(a, b):
    return 1 + (a + b) % 3  # symmetric: rows a sends b == rows b sends a


def pair_chunk(a, b, width=5, rows=None):
    g = torch.Generator().manual_seed(100 * min(a, b) + max(a, b))
    return torch.randn(pair_rows(a, b) if rows is None else rows, width, generator=g)


def collective_inputs(rank, n):
    """Rank `rank`'s inputs: symmetric all-to-all chunks, identical tensors, and per-expert counts
    relabelled by -rank from one base (relabel_experts' model)."""
    g = torch.Generator().manual_seed(7)
    same = torch.randint(-50, 50, (6, 4), generator=g).float()  # exact sums in float32
    base = torch.randint(0, 100, (E_COUNTS,), generator=g)
    counts = base.view(n, -1).roll(-rank, 0).reshape(-1)  # counts of relabel_experts(B, E, n, -rank)
    send = torch.cat([pair_chunk(rank, j) for j in range(n)])
    splits = [pair_rows(rank, j) for j in range(n)]
    return same, counts, send, splits


def run_collectives(rank, n):
    same, counts, send, splits = collective_inputs(rank, n)
    out = {}
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, splits, splits)
    out["all_to_all_single"] = recv
    outs = [torch.empty(2, 5) for j in range(n)]  # gloo's list form: equal sizes
    dist.all_to_all(outs, [pair_chunk(rank, j, rows=2) for j in range(n)])
    out["all_to_all"] = torch.cat(outs)
    lst = [torch.empty_like(same) for _ in range(n)]
    dist.all_gather(lst, same)
    out["all_gather"] = torch.stack(lst)
    flat = counts.new_empty(n * E_COUNTS)
    all_gather_flat(flat, counts)
    out["all_gather_counts"] = flat
    lst = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(lst, counts)
    out["all_gather_counts_list"] = torch.stack(lst)
    for op in ("SUM", "MAX", "MIN"):
        t = same.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = t
        t = counts.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_counts_{op}"] = t
    t = same.clone()
    dist.broadcast(t, src=n - 1)
    out["broadcast"] = t
    t = counts.clone()
    dist.broadcast(t, src=0)
    out["broadcast_counts"] = t
    rs = same.new_empty(same.numel() // 2 // n * 2) if same.numel() % n == 0 else None
    if rs is not None:
        try:
            reduce_scatter_flat(rs, same.reshape(-1)[: rs.numel() * n])
            out["reduce_scatter"] = rs
        except RuntimeError as e:  # gloo may not implement it
            out["reduce_scatter_unsupported"] = str(e)[:80]
    dist.barrier()
    return out


def loopback_collectives(n, rank, link):
    with loopback_world(n, rank, link, num_experts=E_COUNTS):
        return run_collectives(rank, n)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_match_gloo(n):
    real = ranks(n, run_collectives)
    for rank in range(n):
        for link in ("none", "device", "pcie"):
            mine = in_child(loopback_collectives, n, rank, link)
            skip = {k for k in real[rank] if k.endswith("_unsupported")}
            assert set(mine) >= set(real[rank]) - skip
            for key, want in real[rank].items():
                if key in skip:
                    continue
                assert torch.equal(mine[key], want), (n, rank, link, key, mine[key], want)


def test_asymmetric_splits_raise():
    def body():
        with loopback_world(4, 1):
            x = torch.zeros(8)
            with pytest.raises(ValueError, match="differ from send splits"):
                dist.all_to_all_single(torch.zeros(8), x, [2, 2, 2, 2], [1, 3, 2, 2])
        return True
    assert in_child(body)


def test_two_level_topology_and_bytes():
    topo = loopback.two_level(4)
    assert [topo(5, p) for p in range(8)] == ["pcie"] * 4 + ["device"] * 4

    def body():
        with loopback_world(8, 5, topology=topo):
            by = loopback.bytes_over_links([1, 2, 3, 4, 5, 6, 7, 8], 10)
            x = torch.arange(36 * 3.0).view(36, 3)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x, [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8])
            return by, torch.equal(x, y)
    by, same = in_child(body)
    assert by == {"pcie": 100, "device": (5 + 7 + 8) * 10, "self": 60} and same


def test_relabel_experts_is_symmetric():
    n, E = 4, 16
    g = torch.Generator().manual_seed(1)
    base = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(20)])
    base[0, 1] = -1
    per = E // n
    routed = [loopback.relabel_experts(base, E, n, -a) for a in range(n)]

    def sent(idx, dst):  # per token, the local ids of its experts on rank dst
        return [sorted(e % per for e in row if e >= 0 and e // per == dst) for row in idx.tolist()]
    for a in range(n):
        for b in range(n):  # what a sends b (tokens with their local ids) == what b sends a
            assert sent(routed[a], b) == sent(routed[b], a)
    assert routed[1][0, 1] == -1


# ---- fp8a2a dispatch + combine ----------------------------------------------------------------

def make_routing(tokens, hidden, experts, topk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * torch.rand(tokens, 1, generator=g) * 4).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[1, -1] = -1  # a slot that is not routed
    w = torch.rand(tokens, topk, generator=g)
    grad = torch.randn(tokens, hidden, generator=g)
    return x, idx, w, grad


def fp8a2a_step(x, idx, w, grad, experts, local, **opts):
    """dispatch, experts (local expert l scales by l + 2, l = the expert id mod `local`), combine,
    backward of <y, grad>: (tokens per expert, dispatched rows, weights, y, dx, dw)."""
    d = fp8a2a.Dispatcher(experts, **opts)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = d.dispatch(x, idx, w)
    rows = out.dequantized(torch.float32)
    tpe = out.tokens_per_expert
    lid = torch.repeat_interleave(torch.arange(tpe.numel(), device=tpe.device), tpe) % local
    y = d.combine((rows * (lid + 2).unsqueeze(1)).to(x.dtype), out.handle)
    (y.float() * grad.to(y.device)).sum().backward()
    return [t.detach().cpu() for t in (tpe, rows, out.weights, y, x.grad, w.grad)]


def loopback_fp8a2a(n, rank, link, x, idx, w, grad, experts, opts):
    with loopback_world(n, rank, link):
        return fp8a2a_step(x, idx, w, grad, experts, experts // n, **opts)


def gloo_fp8a2a(rank, n, experts, opts, cfg):
    x, base, w, grad = make_routing(*cfg)
    idx = loopback.relabel_experts(base, experts, n, -rank)
    return fp8a2a_step(x, idx, w, grad, experts, experts // n, **opts)


WIRES = {"fp8": dict(bf16_below_bytes=0), "bf16": dict(bf16_below_bytes=1 << 40),
         "fp8_all": dict(bf16_below_bytes=0, fp8_combine=True, fp8_dispatch_backward=True),
         "block128": dict(bf16_below_bytes=0, granularity="block128")}


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_dispatch_equals_real_gloo_run(wire):
    """4 gloo ranks routing relabel_experts(B, E, 4, -a): every byte each rank receives, its combine
    and its gradients equal what the loopback group gives that rank alone."""
    n, E, cfg = 4, 16, (24, 256, 16, 4, torch.bfloat16)
    real = ranks(n, gloo_fp8a2a, E, WIRES[wire], cfg)
    x, base, w, grad = make_routing(*cfg)
    for rank in (0, 3):
        idx = loopback.relabel_experts(base, E, n, -rank)
        mine = in_child(loopback_fp8a2a, n, rank, "pcie", x, idx, w, grad, E, WIRES[wire])
        for name, a, b in zip(("tokens_per_expert", "rows", "weights", "y", "dx", "dw"), mine, real[rank]):
            assert torch.equal(a, b), (wire, rank, name)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("wire", list(WIRES))
def test_dispatch_combine_equals_single_rank(n, wire):
    """EP=n on the loopback group against world size 1 with the same experts (expert e = local expert
    e mod E/n): the same rows reach the same expert functions, so y and the gradients agree but for
    the order of the sums (float32 activations: to rounding)."""
    E = 32
    x, idx, w, grad = make_routing(32, 256, E, 6, torch.float32)
    ref = fp8a2a_step(x, idx, w, grad, E, E // n, **WIRES[wire])
    for rank, link in ((0, "none"), (n - 1, "pcie"), (n // 2, "device")):
        got = in_child(loopback_fp8a2a, n, rank, link, x, idx, w, grad, E, WIRES[wire])
        assert torch.equal(got[0], ref[0].view(n, E // n).sum(0))  # a real rank's expert load
        assert got[1].shape == ref[1].shape
        for name, a, b in zip(("y", "dx", "dw"), got[3:], ref[3:]):
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-6, (wire, rank, name, err)


# ---- Megatron's alltoall dispatcher -------------------------------------------------------------

def _megatron_on_cpu(gloo=False):
    from fp8a2a.megatron.standalone import cpu_cuda_streams
    cpu_cuda_streams()
    if gloo:  # on the CPU Megatron's splits stay tensors (it converts CUDA ones); gloo takes lists only
        a2a = dist.all_to_all_single

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
            as_list = lambda s: s.tolist() if isinstance(s, torch.Tensor) else s
            return a2a(output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw)
        dist.all_to_all_single = all_to_all_single


def megatron_step(ep, rank, x, routing_map, probs, grad, experts, local, topk, fused=False):
    """Megatron's MoEAlltoAllTokenDispatcher (dropless; `fused`: moe_permute_fusion) at expert
    parallelism `ep`, on x's device: dispatch, experts (local expert l scales by (l mod `local`) + 2,
    probs applied), combine, backward of <y, grad>: (tokens per expert, y, dx, dprobs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    ps.initialize_model_parallel(expert_model_parallel_size=ep, create_gloo_process_groups=False)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=x.shape[1], num_attention_heads=4, num_moe_experts=experts,
                                moe_router_topk=topk, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                                use_cpu_initialization=True, moe_permute_fusion=fused)
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep", "tp"])
        n_local = experts // ep
        d = MoEAlltoAllTokenDispatcher(n_local, list(range(rank * n_local, (rank + 1) * n_local)), cfg,
                                       pg_collection=pgs)
        x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
        hs, pr = d.dispatch_preprocess(x, routing_map, probs)
        hs, pr = d.token_dispatch(hs, pr)
        hs, tpe, pr = d.dispatch_postprocess(hs, pr)
        tpe = torch.as_tensor(tpe).cpu()
        lid = (torch.repeat_interleave(torch.arange(n_local), tpe) % local).to(hs.device)
        out = hs * (lid + 2).unsqueeze(1).to(hs.dtype) * pr.unsqueeze(1).to(hs.dtype)
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
        (y.float() * grad.to(y.device)).sum().backward()
        return [t.detach().cpu() for t in (tpe, y, x.grad, probs.grad)]
    finally:
        ps.destroy_model_parallel()


def megatron_inputs(tokens, hidden, experts, topk, seed=0):
    x, idx, w, grad = make_routing(tokens, hidden, experts, topk, torch.float32, seed)
    idx[1, -1] = next(e for e in range(experts) if e not in idx[1, :-1].tolist())  # Megatron routes every slot
    return x, idx, w, grad


def _maps(idx, w, experts):
    rmap = torch.zeros(idx.shape[0], experts, dtype=torch.bool).scatter_(1, idx, True)
    return rmap, torch.zeros(idx.shape[0], experts).scatter_(1, idx, w)


def loopback_megatron(n, rank, link, x, idx, w, grad, experts, topk):
    _megatron_on_cpu()
    rmap, probs = _maps(idx, w, experts)
    with loopback_world(n, rank, link, num_experts=experts):
        return megatron_step(n, rank, x, rmap, probs, grad, experts, experts // n, topk)


def world_of_one_megatron(x, idx, w, grad, experts, local, topk):
    _megatron_on_cpu()
    rmap, probs = _maps(idx, w, experts)
    with loopback_world(1, 0):
        return megatron_step(1, 0, x, rmap, probs, grad, experts, local, topk)


def gloo_megatron(rank, n, experts, topk, cfg):
    _megatron_on_cpu(gloo=True)
    x, base, w, grad = megatron_inputs(*cfg)
    idx = loopback.relabel_experts(base, experts, n, -rank)
    rmap, probs = _maps(idx, w, experts)
    return megatron_step(n, rank, x, rmap, probs, grad, experts, experts // n, topk)


@pytest.mark.parametrize("n", [4, 8])
def test_megatron_alltoall_dispatcher_equals_world_size_1(n):
    pytest.importorskip("megatron.core")
    E, K = 16, 4
    x, idx, w, grad = megatron_inputs(40, 64, E, K)
    ref = in_child(world_of_one_megatron, x, idx, w, grad, E, E // n, K)
    for rank, link in ((0, "pcie"), (n - 1, "none")):
        got = in_child(loopback_megatron, n, rank, link, x, idx, w, grad, E, K)
        assert torch.equal(got[0], ref[0].view(n, E // n).sum(0))
        for name, a, b in zip(("y", "dx", "dprobs"), got[1:], ref[1:]):
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-6, (n, rank, name, err)


def test_megatron_alltoall_dispatcher_equals_real_gloo_run():
    pytest.importorskip("megatron.core")
    n, E, K = 4, 16, 4
    cfg = (24, 64, E, K)
    real = ranks(n, gloo_megatron, E, K, cfg)
    x, base, w, grad = megatron_inputs(*cfg)
    for rank in (0, 2):
        idx = loopback.relabel_experts(base, E, n, -rank)
        mine = in_child(loopback_megatron, n, rank, "device", x, idx, w, grad, E, K)
        for name, a, b in zip(("tokens_per_expert", "y", "dx", "dprobs"), mine, real[rank]):
            assert torch.equal(a, b), (rank, name)


def test_meter_counts_the_bytes_per_link():
    def body():
        with loopback_world(4, 2, topology=loopback.two_level(2)):
            x = torch.zeros(10, 4)
            with loopback.metered() as calls:
                dist.all_to_all_single(torch.empty_like(x), x, [1, 2, 3, 4], [1, 2, 3, 4])
            loopback.set_link("none")
            with loopback.metered() as calls2:
                dist.all_to_all_single(torch.empty_like(x), x, [1, 2, 3, 4], [1, 2, 3, 4])
            return sorted(calls), sorted(calls2)
    calls, calls2 = in_child(body)
    assert calls == [("device", 64), ("pcie", 48), ("self", 48)]
    assert calls2 == [("none", 112), ("self", 48)]


# ---- the emulation benchmark (functional on the CPU) ----------------------------------------------

def test_bench_case_runs_and_meters_the_wire():
    from fp8a2a.bench import loopback as lb

    def body():
        case = lb.Case("tiny", 4, 48, 1024, 16, 4)
        with loopback_world(4, 0):
            res = lb.run_case(case, ["none", "pcie"], lb.default_variants(), repeat=2, iters=1, warmup=0,
                              log=lambda s: None)
        return res
    res = in_child(body)
    v = res["variants"]
    assert not [n for n, r in v.items() if "unavailable" in r]
    assert res["baseline"] == "step/megatron_style"
    # FP8 rows: 1024 payload bytes + scale + routing against 2048 in BF16
    assert v["dispatch_fwd/fp8"]["link_bytes"] < 0.6 * v["dispatch_fwd/bf16"]["link_bytes"]
    assert v["step/fp8_all"]["link_bytes"] < v["step/fp8"]["link_bytes"] < v["step/bf16"]["link_bytes"]
    assert all(len(r["device_ms"][lk]["runs"]) == 2 for r in v.values() for lk in ("none", "pcie"))
    assert set(res["ratios"]["pcie"]) >= {"step/fp8 / step/megatron_style", "dispatch_fwd/fp8 / dispatch_fwd/bf16"}
    assert v["step/fp8"]["precision"] == dict(dispatch="fp8 row", combine="bf16", combine_backward="fp8 row",
                                              dispatch_backward="bf16")


# ---- Megatron's MoELayer on the loopback group (bench_loopback.py --layer, functional on the CPU) ----

def _bench_loopback():
    import os
    import sys
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_loopback
    return bench_loopback


def test_megatron_moe_layer_on_loopback_ep4():
    """The local-spec MoELayer at EP=4 (4 of 16 experts local) on the loopback group, fwd+bwd with
    fp8_alltoall + fp8_experts_spec and with alltoall (the baseline row); a row Megatron cannot
    build here (flex: DeepEP) names the call."""
    pytest.importorskip("megatron.core")

    def body():
        bl = _bench_loopback()
        from fp8a2a.megatron.standalone import cpu_cuda_streams
        cpu_cuda_streams()
        rows = {**bl.CPU_LAYER_ROWS, "flex + SequentialMLP": ("flex", "local", None, {})}
        with loopback_world(4, 1):
            res = bl.run_layer("deepseek-v3", 4, ["none", "pcie"], repeat=2, iters=1, warmup=1, cuda=False,
                               rows=rows, log=lambda s: None)
            from megatron.core import parallel_state as ps
            torn_down = not ps.model_parallel_is_initialized()
        return res, bl.format_layer(res), torn_down
    res, table, torn_down = in_child(body)
    assert torn_down
    base, fp8, flex = (res["rows"][k] for k in ("alltoall + SequentialMLP", "fp8_alltoall + fp8_experts_spec",
                                                 "flex + SequentialMLP"))
    for r in (base, fp8):
        assert "error" not in r, r.get("error")
        assert r["local_experts"] == 4 and r["local_expert_indices"][:2] == [4, 5]  # rank 1 of 4
        assert all(len(r["fwd_bwd_ms"][lk]["runs"]) == 2 for lk in ("none", "pcie"))
        assert r["link_bytes"] > 0 and r["quant_per_step_ms"] >= 0
    assert fp8["link_bytes"] < base["link_bytes"]  # FP8 rows on the wire (dispatch 1 byte/elem + scales)
    assert set(res["ratios"]["pcie"]) == {"fp8_alltoall + fp8_experts_spec / alltoall + SequentialMLP"}
    assert len(res["speedups"]["none"]["alltoall + SequentialMLP / fp8_alltoall + fp8_experts_spec"]["runs"]) == 2
    assert flex["error"].startswith("building MoELayer (flex") and "megatron/" in flex["error"], flex["error"]
    assert "fp8_alltoall + fp8_experts_spec" in table and "unavailable: building MoELayer (flex" in table


def test_bench_loopback_layer_cli_cpu(tmp_path):
    pytest.importorskip("megatron.core")
    import json
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = tmp_path / "layer.json"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "bench_loopback.py"), "--layer", "--cpu", "--repeat", "2",
           "--iters", "1", "--warmup", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    layer = doc["layer"]
    assert layer["case"]["ep"] == 4 and layer["links"] == ["none", "pcie"] and doc["cases"] == []
    assert not [k for k, v in layer["rows"].items() if "error" in v]
    assert "MoELayer fwd+bwd on the loopback group" in r.stdout


def test_bench_cli_emulate_ep_runs_on_the_cpu(tmp_path):
    """`python -m fp8a2a.bench --emulate-ep N --link L`: rank 0 of a loopback EP=N world, every
    chosen model's rows over `none` and the link, written to --json; the world is torn down after."""
    from fp8a2a.bench import cli
    out = tmp_path / "emu.json"
    assert cli.main(["--emulate-ep", "8", "--link", "device", "--emulate-models", "mixtral-8x7b", "--iters", "1",
                     "--warmup", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["links"] == ["none", "device"] and len(doc["cases"]) == 1
    assert loopback.world() is None and not dist.is_initialized()


@pytest.mark.parametrize("argv, says", [
    (["--emulate-ep", "3"], "no model has a multiple of 3 experts"),
    (["--emulate-ep", "1"], "--emulate-ep"),
    (["--emulate-ep", "8", "--link", "ib"], "is not one of none, device, pcie"),
    (["--emulate-ep", "8", "--link", "pcie,device"], "--link takes one link"),
    (["--emulate-ep", "8", "--world", "2"], "--world not used by --emulate-ep"),
    (["--link", "device"], "--link only applies with"),
])
def test_bench_cli_emulate_ep_refuses_bad_usage(argv, says, capsys):
    from fp8a2a.bench import cli
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err
