"""Dispatch and combine over 1, 2 and 4 gloo ranks against plain-torch float64 references.

Each rank regenerates every rank's inputs from one seed, so it can compute what it must receive
(exact FP8 bytes, order, weights, counts) and what combine and the gradients must give."""
import contextlib
import math

import pytest
import torch

import fp8a2a
from fp8a2a.reference import (dequantize_reference, drop_to_capacity_reference, expert_major_reference,
                              quantize_reference)

from .distributed import run_ranks


def make_inputs(world, tokens, hidden, num_experts, topk, dtype, routing="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    per_rank = num_experts // world
    for r in range(world):
        t = tokens[r] if isinstance(tokens, (list, tuple)) else tokens
        x = (torch.randn(t, hidden, generator=g) * torch.rand(t, 1, generator=g) * 4).to(dtype)
        pool = {"uniform": num_experts, "one_rank": per_rank}[routing.replace("skewed", "uniform")]
        idx = torch.stack([torch.randperm(pool, generator=g)[:topk] for _ in range(t)]) if t else \
            torch.zeros(0, topk, dtype=torch.long)
        if routing == "skewed" and t:
            idx[:, 0] = 0
            idx[:, 1:] = torch.where(idx[:, 1:] == 0, (idx[:, 1:] + 1) % num_experts, idx[:, 1:])
        if t > 2 and topk > 1:
            idx[1, -1] = -1  # a slot that is not routed
        w = torch.rand(t, topk, generator=g)
        xs.append(x), idxs.append(idx), ws.append(w)
    return xs, idxs, ws


def quantized_view(xs, granularity, wire_raw):
    """What the experts see of each source rank's tokens."""
    if wire_raw:
        return [x.double() for x in xs]
    amax = None
    if granularity == "tensor":  # the amax of every rank's tokens (the Dispatcher's all-reduce)
        amax = max((x.float().abs().amax() for x in xs if x.numel()), default=torch.tensor(0.0))
    return [dequantize_reference(*quantize_reference(x, granularity, amax=amax), torch.float64) for x in xs]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def scenario(rank, world, cfg):
    E, K, H, dtype = cfg["experts"], cfg["topk"], cfg["hidden"], cfg.get("dtype", torch.bfloat16)
    gran = cfg.get("granularity", "row")
    raw = cfg.get("raw", False)
    xs, idxs, ws = make_inputs(world, cfg["tokens"], H, E, K, dtype, cfg.get("routing", "uniform"))
    d = fp8a2a.Dispatcher(E, granularity=gran, bf16_below_bytes=(1 << 40) if raw else 0,
                          fp8_combine=cfg.get("fp8_combine", False),
                          fp8_dispatch_backward=cfg.get("fp8_dispatch_backward", False),
                          expert_tp_size=cfg.get("tp", 1), capacity_factor=cfg.get("capacity_factor"),
                          always_communicate=cfg.get("always_communicate", False))
    tp = d.tp
    ep_rank, tp_rank = divmod(rank, tp)  # TP-EP group order: tp fastest
    dev = cfg.get("device", "cpu")
    x = xs[rank].to(dev, copy=True).requires_grad_()
    w = ws[rank].to(dev, copy=True).requires_grad_()
    out = d.dispatch(x, idxs[rank].to(dev), w)

    views = quantized_view(xs, gran, raw)
    rows = out.dequantized(torch.float32).cpu().to(torch.float64 if raw else torch.float32)
    assert isinstance(out.tokens, torch.Tensor) == raw
    if "capacity_factor" in cfg:
        # Drop-and-pad: each expert keeps its top-C weights per source; R * C rows per expert.
        c = out.handle.expert_capacity
        kept = [drop_to_capacity_reference(i, w_, c, E) for i, w_ in zip(idxs, ws)]
        assert int(out.handle.dropped) == int(((idxs[rank] >= 0) & (kept[rank] < 0)).sum())
        assert out.tokens_per_expert.tolist() == [world * c] * d.num_local_experts
        idxs = kept
        for le in range(d.num_local_experts):
            e = rank * d.num_local_experts + le
            for src in range(world):
                # what source `src` sends to expert e, in token order
                r_ref, _, _, origin = expert_major_reference([views[src]], [idxs[src]], [ws[src]], 0, E, 1)
                sel = [n for n, (_, t, k) in enumerate(origin) if int(idxs[src][t, k]) == e]
                block = rows[(le * world + src) * c:(le * world + src + 1) * c]
                assert torch.equal(block[:len(sel)].double(), r_ref[sel].to(rows.dtype).double())
                assert torch.all(block[len(sel):] == 0)  # padding
    else:
        # Dispatch: exact rows (the reference quantization of each source token), order, weights, counts.
        rows_ref, w_ref, tpe_ref, origin = expert_major_reference(views, idxs, ws, ep_rank, E, world // tp)
        assert out.tokens_per_expert.tolist() == tpe_ref.tolist()
        assert torch.equal(rows.double(), rows_ref.to(rows.dtype).double()), "dispatched rows differ from the reference"
        assert torch.equal(out.weights.cpu().double(), w_ref)

    # Experts: expert e scales its rows by (e + 1); combine; loss = <y, G>. With expert TP each TP
    # rank returns a partial (shares (j + 1) / sum(1..tp)) that combine must sum.
    local = torch.repeat_interleave(torch.arange(d.num_local_experts), out.tokens_per_expert.cpu())
    share = 2.0 * (tp_rank + 1) / (tp * (tp + 1))
    factor = ((ep_rank * d.num_local_experts + local + 1) * share).to(rows.dtype).unsqueeze(1)
    rows_dev = out.dequantized(torch.float32)  # differentiable (straight-through to x)
    y = d.combine((rows_dev * factor.to(dev, torch.float32)).to(dtype), out.handle)
    G = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
    (y.float() * G.to(dev).float()).sum().backward()
    y, gx, gw = y.detach().cpu(), x.grad.cpu(), w.grad.cpu()

    # float64 references on this rank's tokens (straight-through for the quantization).
    xq, idx, wr = views[rank], idxs[rank], ws[rank].double()
    valid = idx >= 0
    f = torch.where(valid, idx + 1, 0).double()  # expert factor per slot, 0 if not routed
    y_ref = ((wr * f).sum(1, keepdim=True) * xq)
    gx_ref = (wr * f).sum(1, keepdim=True) * G.double()
    gw_ref = f * (G.double() * xq).sum(1, keepdim=True)
    if y.numel():
        tol_y = 0.05 if cfg.get("fp8_combine") else 0.01
        tol_gx = 0.01 if raw and not cfg.get("fp8_dispatch_backward") else 0.06
        assert rel(y, y_ref) < tol_y, rel(y, y_ref)
        assert rel(gx, gx_ref) < tol_gx, rel(gx, gx_ref)
        assert rel(gw, gw_ref) < (0.01 if raw else 0.08), rel(gw, gw_ref)
        assert torch.all(gw[~valid] == 0)
    else:
        assert y.shape == (0, H) and gx.shape == (0, H)
    return out.handle.num_rows


BASE = dict(experts=8, topk=2, hidden=256, tokens=24)
CASES = {
    "uniform": {},
    "k1": dict(topk=1),
    "k8_e16": dict(topk=8, experts=16),
    "skewed": dict(routing="skewed"),
    "hidden7168": dict(hidden=7168, tokens=6),
    "hidden200_row": dict(hidden=200),
    "block128": dict(granularity="block128"),
    "tensor": dict(granularity="tensor"),
    "fp16": dict(dtype=torch.float16),
    "fp32": dict(dtype=torch.float32),
    "bf16_fallback": dict(raw=True),
    "fp8_combine": dict(fp8_combine=True),
    "fp8_dispatch_backward": dict(fp8_dispatch_backward=True),
    "empty_rank": dict(tokens=[24, 0, 24, 24]),
    "receives_nothing": dict(routing="one_rank"),  # every expert lives on rank 0
    "capacity_with_drops": dict(capacity_factor=0.5, routing="skewed"),
    "capacity_no_drops": dict(capacity_factor=4.0, topk=4),
    "capacity_empty": dict(capacity_factor=1.0, tokens=0),  # padding rows only
    "expert_tp2": dict(tp=2),
    "expert_tp2_block128": dict(tp=2, granularity="block128", topk=4),
}


def cases_for_world(world):
    """The CASES that run with `world` ranks, as full configs: per-rank token lists cycled to `world`
    entries, expert-TP cases only where the TP size divides `world` (also used by
    the tests under tests/gpu)."""
    out = {}
    for name, case in CASES.items():
        cfg = {**BASE, **case}
        if world % cfg.get("tp", 1):
            continue
        if isinstance(cfg["tokens"], list):  # e.g. an empty rank in the middle
            cfg["tokens"] = [cfg["tokens"][r % len(cfg["tokens"])] for r in range(world)]
        out[name] = cfg
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_combine(world, name):
    rows = run_ranks(world, scenario, cases_for_world(world)[name])
    if name == "receives_nothing":
        assert rows[1:] == [0] * (world - 1)
    if name.startswith("expert_tp"):
        assert rows[0::2] == rows[1::2]  # both TP ranks of an EP rank receive the same rows


@pytest.mark.parametrize("name", ["uniform", "k8_e16", "block128", "tensor", "bf16_fallback"])
def test_single_process(name):
    """World size 1 without torch.distributed (the path the GPU benchmarks take)."""
    scenario(0, 1, {**BASE, **CASES[name]})


def training_step(rank, world, cfg):
    """Dispatch + combine forward and backward as a training step runs them: x and the router
    weights require grad, expert e returns (e + 1) * its rows (dequantized to rows_dtype), combine
    applies the weights (or, apply_weights=False, the experts multiply by out.weights). x.grad,
    topk_weights.grad and the expert rows' gradient against float64 references of what crosses
    the wire (dy as its FP8 rows on an FP8 wire, straight-through quantization)."""
    E, K, H, dtype, raw = cfg["experts"], cfg["topk"], cfg["hidden"], cfg["dtype"], cfg["raw"]
    rows_dtype, apply_weights = cfg.get("rows_dtype", dtype), cfg.get("apply_weights", True)
    xs, idxs, ws = make_inputs(world, cfg["tokens"], H, E, K, dtype)
    gs = [torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + r)).to(dtype) for r, x in enumerate(xs)]
    d = fp8a2a.Dispatcher(E, bf16_below_bytes=(1 << 40) if raw else 0)
    dev = cfg.get("device", "cpu")
    x, w = xs[rank].to(dev, copy=True).requires_grad_(), ws[rank].to(dev, copy=True).requires_grad_()
    out = d.dispatch(x, idxs[rank].to(dev), w)
    assert isinstance(out.tokens, torch.Tensor) == raw
    per_rank = E // world
    local = torch.repeat_interleave(torch.arange(per_rank, device=dev), out.tokens_per_expert)
    factor = (rank * per_rank + local + 1).to(rows_dtype).unsqueeze(1)
    expert_out = out.dequantized(rows_dtype) * factor
    if not apply_weights:  # Megatron's way: the experts apply the weights
        expert_out = expert_out * out.weights.unsqueeze(1).to(rows_dtype)
    if cfg.get("strided"):  # expert rows as a non-contiguous view: combine (and its backward) take it
        expert_out = expert_out.t().contiguous().t()
        assert not expert_out.is_contiguous()
    expert_out.retain_grad()
    y = d.combine(expert_out, out.handle, apply_weights=apply_weights)
    if dev == "cpu":
        y.backward(gs[rank])
    else:  # the backward makes no host sync
        dy = gs[rank].to(dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    gx, gw, g_rows = x.grad.cpu(), w.grad.cpu(), expert_out.grad.cpu()

    # float64 references. dy as the experts receive it: its row-quantized FP8 rows, or itself.
    gq = [g.double() if raw else dequantize_reference(*quantize_reference(g, "row"), torch.float64) for g in gs]
    views = quantized_view(xs, "row", raw)  # each source's rows as dispatched
    # expert rows as the experts computed them (expert e: (e + 1) * rows in rows_dtype), per slot
    slot_rows = [(v.to(rows_dtype).unsqueeze(1) * torch.where(i >= 0, i + 1, 0).to(rows_dtype).unsqueeze(2)).double()
                 for v, i in zip(views, idxs)]
    idx, wr = idxs[rank], ws[rank].double()
    f = torch.where(idx >= 0, idx + 1, 0).double()
    gx_ref = (wr * f).sum(1, keepdim=True) * gq[rank]
    gw_ref = torch.where(idx >= 0, (slot_rows[rank] * gq[rank].unsqueeze(1)).sum(2), 0.0)
    _, _, _, origin = expert_major_reference(views, idxs, ws, rank, E, world)
    want_rows = torch.stack([ws[s][t, k].double() * gq[s][t] if apply_weights else gq[s][t] for s, t, k in origin]) \
        if origin else torch.zeros(0, H, dtype=torch.float64)
    assert expert_out.dtype == rows_dtype and gx.dtype == dtype and gw.dtype == torch.float32
    eps = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}
    if want_rows.numel():  # the expert rows' gradient: one rounding to rows_dtype of its float32 value
        assert rel(g_rows, want_rows) < eps[rows_dtype], rel(g_rows, want_rows)
    if gx.numel():
        # the rows' gradients into rows_dtype and the summed one into x's dtype; the float32 sums
        tol = 2 * eps[dtype] + 4 * eps[rows_dtype] + 1e-6
        assert rel(gx, gx_ref) < tol, (rel(gx, gx_ref), tol)
        # the router weights' gradient: a float32 dot over the hidden size per slot (the experts'
        # own multiply by the weights: autograd's, in rows_dtype)
        mag = (slot_rows[rank].abs() * gq[rank].abs().unsqueeze(1)).sum(2)
        tol = 1e-5 if apply_weights else 4 * eps[rows_dtype]
        assert bool(((gw.double() - gw_ref).abs() <= tol * mag + 1e-30).all()), (gw, gw_ref)
        assert torch.all(gw[idx < 0] == 0)
    return out.handle.num_rows


TRAIN_BASE = dict(experts=8, topk=4, hidden=256, tokens=24)
TRAIN_CASES = {f"{wire}-{str(dt)[6:]}": dict(raw=wire == "raw", dtype=dt)
               for wire in ("fp8", "raw") for dt in (torch.bfloat16, torch.float16, torch.float32)}
TRAIN_CASES.update({"fp8-bfloat16-rows-float32": dict(raw=False, dtype=torch.bfloat16, rows_dtype=torch.float32),
                    "fp8-bfloat16-experts-weigh": dict(raw=False, dtype=torch.bfloat16, apply_weights=False),
                    "raw-float16-experts-weigh": dict(raw=True, dtype=torch.float16, apply_weights=False),
                    "fp8-bfloat16-hidden200": dict(raw=False, dtype=torch.bfloat16, hidden=200),
                    "fp8-float16-strided-rows": dict(raw=False, dtype=torch.float16, strided=True)})


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_training_step_gradients(world, name):
    cfg = {**TRAIN_BASE, **TRAIN_CASES[name]}
    if world == 1:  # without torch.distributed, as the GPU benchmarks run
        training_step(0, 1, cfg)
    else:
        run_ranks(world, training_step, cfg)


def test_float32_rows_hand_their_gradient_to_dispatch_uncast(monkeypatch):
    """bfloat16 x, rows dequantized to float32: their gradient reaches dispatch's backward in float32
    (no [N, H] cast to bfloat16 first; combine_pack sums it as it is). Rows dequantized to both
    dtypes: the two gradients add up."""
    from fp8a2a import exchange
    seen = []
    real = exchange.combine

    def spy(rows, *args, **kwargs):
        seen.append(rows.dtype)
        return real(rows, *args, **kwargs)
    monkeypatch.setattr(exchange, "combine", spy)
    xs, idxs, ws = make_inputs(1, 16, 128, 8, 2, torch.bfloat16)
    d = fp8a2a.Dispatcher(8, bf16_below_bytes=0)
    grads = {}
    for dtypes in ((torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16)):
        x = xs[0].clone().requires_grad_()
        out = d.dispatch(x, idxs[0], ws[0])
        seen.clear()
        sum(out.dequantized(dt).float().sum(1) * (i + 2) for i, dt in enumerate(dtypes)).sum().backward()
        assert seen == [torch.float32 if torch.float32 in dtypes else torch.bfloat16], (dtypes, seen)
        grads[dtypes] = x.grad.float()
    # each row's gradient is 2 (float32 rows) or 3 (bfloat16 rows): per token, 2 or 5 times its slots
    slots = (idxs[0] >= 0).sum(1, keepdim=True).float()
    assert torch.equal(grads[(torch.float32,)], (2 * slots).expand(-1, 128))
    assert torch.equal(grads[(torch.float32, torch.bfloat16)], (5 * slots).expand(-1, 128))
    x32 = xs[0].float().requires_grad_()  # float32 x: one carrier, the float32 rows use it
    assert d.dispatch(x32, idxs[0], ws[0]).tokens.grad_anchor_float32 is None


def test_backward_fills_no_zeros_for_outputs_without_a_gradient():
    """Autograd's default hands a Function zeros for each output without a gradient, even the
    non-differentiable ones: [N, H] for the e4m3 rows on every dispatch backward. Not any more."""
    from torch.profiler import ProfilerActivity, profile
    xs, idxs, ws = make_inputs(1, 64, 512, 32, 8, torch.bfloat16)
    x, w = xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()
    d = fp8a2a.Dispatcher(32, bf16_below_bytes=0)
    out = d.dispatch(x, idxs[0], w)
    y = d.combine(out.dequantized(), out.handle)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y.backward(torch.ones_like(y))
    n = out.handle.num_rows
    filled = [e.input_shapes[0] for e in prof.events() if e.name == "aten::zero_"]
    assert [n, 512] not in filled and [n] not in filled, filled


def _weights_only(rank, world, weights_grad=True):
    xs, idxs, ws = make_inputs(world, 12, 64, 8, 2, torch.bfloat16)
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_(weights_grad)
    out = fp8a2a.Dispatcher(8, bf16_below_bytes=0).dispatch(x, idxs[rank], w)
    (out.weights * 3).sum().backward()  # the rows get no gradient
    if weights_grad:
        assert torch.equal(w.grad, torch.where(idxs[rank] >= 0, 3.0, 0.0))
    return None if x.grad is None else bool((x.grad == 0).all())


def test_router_weights_gradient_without_a_row_gradient():
    """Only out.weights is used: the weights' gradient comes back, x's is zeros (rows of zeros carry
    the weights' column). With nothing to send and no peer, dispatch's backward makes nothing: no
    [N, H] zeros, x gets no gradient."""
    assert [_weights_only(0, 1)] + run_ranks(2, _weights_only) == [True] * 3
    assert _weights_only(0, 1, weights_grad=False) is None


def test_mixed_sizes_agree_on_one_wire_format():
    # Rank 1 is under the BF16 threshold, rank 0 is not: both must send FP8.
    def fn(rank, world):
        xs, idxs, ws = make_inputs(world, [64, 2], 256, 8, 2, torch.bfloat16)
        d = fp8a2a.Dispatcher(8, bf16_below_bytes=10_000)
        out = d.dispatch(xs[rank], idxs[rank], ws[rank])
        assert isinstance(out.tokens, fp8a2a.QuantizedTensor)
        y = d.combine(out.dequantized(), out.handle)
        return y.shape[0]
    assert run_ranks(2, fn) == [64, 2]


def _expect_error_everywhere(fn, world=2):
    def wrapped(rank, world):
        try:
            fn(rank, world)
        except (ValueError, RuntimeError) as e:
            return str(e)
        return None
    msgs = run_ranks(world, wrapped, timeout=120)  # a hang fails the test instead of stalling CI
    assert all(m is not None for m in msgs), msgs
    return msgs


def test_bad_expert_ids_raise_on_every_rank():
    def fn(rank, world):
        xs, idxs, ws = make_inputs(world, 8, 64, 8, 2, torch.bfloat16)
        if rank == 1:
            idxs[1][3, 0] = 8  # out of range on one rank only
        fp8a2a.Dispatcher(8, bf16_below_bytes=0).dispatch(xs[rank], idxs[rank], ws[rank])
    assert all("expert ids outside [-1, 8) on ranks [1] ([0, 1] ids)" in m for m in _expect_error_everywhere(fn))


def test_bad_expert_ids_under_expert_tp_name_the_callers_range():
    """Expert TP replicates each slot over its TP ranks (virtual experts): the error still states the
    caller's range and counts the caller's ids."""
    def fn(rank, world):
        xs, idxs, ws = make_inputs(world, 8, 64, 4, 2, torch.bfloat16)
        idxs[rank][2, 0] = 5
        fp8a2a.Dispatcher(4, expert_tp_size=2, bf16_below_bytes=0).dispatch(xs[rank], idxs[rank], ws[rank])
    assert all("expert ids outside [-1, 4) on ranks [0, 1] ([1, 1] ids)" in m for m in _expect_error_everywhere(fn))


@pytest.mark.parametrize("case", ["weights_shape", "x_float64", "idx_int16", "tensor_amax", "idx_int16_tensor",
                                  "block128_small_rank"])
def test_input_rejected_on_one_rank_raises_on_every_rank(case):
    # Rank 1's input is bad, rank 0's is fine: rank 0 must raise too, not wait in the exchange.
    def fn(rank, world):
        gran = "tensor" if case.startswith("tensor") or case.endswith("tensor") else "row"
        hidden = 100 if case == "block128_small_rank" else 64
        xs, idxs, ws = make_inputs(world, [2, 64] if case == "block128_small_rank" else 8, hidden, 8, 2, torch.bfloat16)
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        if rank == 1:
            if case == "weights_shape" or case == "tensor_amax":
                w = w[:, :1]
            elif case == "x_float64":
                x = x.double()
            elif case.startswith("idx_int16"):
                idx = idx.to(torch.int16)
        granularity = "block128" if case == "block128_small_rank" else gran
        fp8a2a.Dispatcher(8, granularity=granularity, bf16_below_bytes=1000).dispatch(x, idx, w)
    msgs = _expect_error_everywhere(fn)
    if case == "block128_small_rank":  # a configuration error: every rank finds it itself
        assert all("block128" in m for m in msgs), msgs
    else:
        assert "rejected their dispatch input" in msgs[0] and "ranks [1]" in msgs[0], msgs
        assert "rejected" not in msgs[1], msgs


def test_hidden_mismatch_raises_on_every_rank():
    def fn(rank, world):
        x = torch.randn(8, 64 if rank == 0 else 128, dtype=torch.bfloat16)
        idx = torch.randint(0, 8, (8, 2))
        fp8a2a.Dispatcher(8, bf16_below_bytes=0).dispatch(x, idx, torch.rand(8, 2))
    assert all("hidden" in m for m in _expect_error_everywhere(fn))


def test_tensor_scale_must_agree_and_be_valid():
    def fn(rank, world):
        fp8a2a.Dispatcher(8, granularity="tensor", tensor_scale=torch.tensor(0.01 if rank == 0 else 0.02))
    assert all("disagree" in m for m in _expect_error_everywhere(fn))

    def invalid_on_one_rank(rank, world):  # the valid rank must not wait in the agreement gather
        fp8a2a.Dispatcher(8, granularity="tensor", tensor_scale=torch.tensor(0.01 if rank == 0 else 0.0))
    msgs = _expect_error_everywhere(invalid_on_one_rank)
    assert "ranks [1] were given an invalid tensor_scale" in msgs[0] and "finite and >=" in msgs[1], msgs

    def unreadable_on_one_rank(rank, world):  # not even a number to check: still joins the gather
        fp8a2a.Dispatcher(8, granularity="tensor",
                          tensor_scale=torch.tensor(0.01) if rank == 0 else torch.tensor(0.01, device="meta"))
    msgs = _expect_error_everywhere(unreadable_on_one_rank)
    assert "ranks [1] were given an invalid tensor_scale" in msgs[0], msgs
    with pytest.raises(ValueError, match="finite and >="):
        fp8a2a.Dispatcher(8, granularity="tensor", tensor_scale=torch.tensor(0.0))
    scale = torch.tensor(0.01, dtype=torch.bfloat16)
    assert fp8a2a.Dispatcher(8, granularity="tensor", tensor_scale=scale).tensor_scale is scale  # kept, not copied


def test_tensor_mode_nan_or_inf_poisons_every_rank_alike():
    # Without a given scale the ranks all-reduce their amax; a NaN or Inf must not vanish in it.
    def fn(rank, world, nan_rank, bad):
        xs, idxs, ws = make_inputs(world, 8, 64, 8, 2, torch.float32)
        if rank == nan_rank:
            xs[rank][2, 5] = bad
        out = fp8a2a.Dispatcher(8, granularity="tensor", bf16_below_bytes=0).dispatch(xs[rank], idxs[rank], ws[rank])
        return bool(out.dequantized(torch.float32).isnan().all()), float(out.tokens.scale)
    for nan_rank in (0, 1):
        for bad in (float("nan"), float("inf")):
            res = run_ranks(2, fn, nan_rank, bad, timeout=120)
            assert all(r[0] for r in res) and all(math.isinf(r[1]) for r in res), (nan_rank, bad, res)


def test_num_experts_mismatch_raises_on_every_rank():
    def fn(rank, world):
        fp8a2a.Dispatcher(8 if rank == 0 else 16)
    assert all("disagree" in m for m in _expect_error_everywhere(fn))


def test_wrong_group_and_bad_shapes():
    with pytest.raises(ValueError, match="not initialized"):
        fp8a2a.Dispatcher(8, group=object())
    with pytest.raises(ValueError, match="multiple"):
        fp8a2a.Dispatcher(0)
    d = fp8a2a.Dispatcher(8)
    with pytest.raises(ValueError, match="topk_weights"):
        d.dispatch(torch.randn(4, 16), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 3))
    with pytest.raises(ValueError):
        d.dispatch(torch.randn(4, 16), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))
    for below in (0, 1 << 20):  # also when the input is small enough to go unquantized
        with pytest.raises(ValueError, match="block128"):
            fp8a2a.Dispatcher(8, granularity="block128", bf16_below_bytes=below).dispatch(
                torch.randn(4, 200), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
        for dtype in (torch.int32, torch.float64):
            with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
                fp8a2a.Dispatcher(8, bf16_below_bytes=below).dispatch(
                    torch.zeros(4, 16, dtype=dtype), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    with pytest.raises(TypeError, match="x as a torch.Tensor"):
        d.dispatch(fp8a2a.quantize(torch.randn(4, 16)), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    with pytest.raises(ValueError, match="hidden size 0"):
        d.dispatch(torch.randn(4, 0), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    out = d.dispatch(torch.randn(4, 16), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    with pytest.raises(ValueError, match="expert_out"):
        d.combine(torch.randn(3, 16), out.handle)
    with pytest.raises(TypeError, match="dequantize a QuantizedTensor first"):
        d.combine(fp8a2a.quantize(torch.randn(4, 16)), out.handle)


def test_one_copy_per_destination_rank():
    """A token routed to several experts of one rank crosses the wire once."""
    d = fp8a2a.Dispatcher(8, bf16_below_bytes=0)
    idx = torch.tensor([[0, 1, 2, 3]])  # four experts, one rank (world size 1)
    out = d.dispatch(torch.randn(1, 32), idx, torch.rand(1, 4))
    assert out.handle.send_splits == [1] and out.handle.num_rows == 4


def test_dispatch_is_deterministic_and_nan_rows_stay_nan():
    x = torch.randn(16, 128)
    x[3, 5] = float("nan")
    idx = torch.randint(0, 8, (16, 2))
    d = fp8a2a.Dispatcher(8, bf16_below_bytes=0)
    a, b = d.dispatch(x, idx, torch.rand(16, 2)), d.dispatch(x, idx, torch.rand(16, 2))
    assert torch.equal(a.tokens.data.view(torch.uint8), b.tokens.data.view(torch.uint8))
    rows = a.dequantized(torch.float32)
    nan_rows = rows.isnan().any(1)
    assert nan_rows.sum() == 2 and rows[nan_rows].isnan().all()  # token 3's two rows, all NaN


def test_int32_ids_bf16_weights_and_no_grad():
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    w = torch.rand(16, 2, dtype=torch.bfloat16, requires_grad=True)
    d = fp8a2a.Dispatcher(8, bf16_below_bytes=0)
    out = d.dispatch(x, idx, w)
    d.combine(out.dequantized() * 2, out.handle).float().sum().backward()
    assert w.grad.dtype == torch.bfloat16 and bool(w.grad.abs().sum() > 0)
    assert torch.allclose(x.grad.float(), 2 * w.detach().float().sum(1, keepdim=True).expand(16, 64), rtol=0.02)
    with torch.no_grad():
        out = d.dispatch(x, idx, w)
        assert not d.combine(out.dequantized(), out.handle).requires_grad


def test_torchrun_suite_on_gloo():
    """tests/gpu/test_dispatch_nccl.py is how multi-GPU machines run these scenarios (NCCL, under
    torchrun); keep it working: here on two CPU ranks over gloo (CUDA hidden)."""
    import os

    from .programs import run as run_program
    run = run_program("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pytest",
                      "tests/gpu/test_dispatch_nccl.py", "-q", "-p", "no:cacheprovider",
                      env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(f"{len(CASES)} passed") == 2, run.stdout[-3000:]  # every scenario, on both ranks


@pytest.mark.parametrize("wire", ["fp8", "raw"])
def test_combine_applies_weights_before_converting(wire):
    """fp16 x, float32 expert rows of 1e5 and weights 0.25 on two local experts: the exact 50000
    fits in fp16, the 1e5 of each row does not. combine weights and sums in float32 and converts
    last, so y is 50000, never Inf."""
    d = fp8a2a.Dispatcher(4, bf16_below_bytes=0 if wire == "fp8" else 1 << 30)
    t, h = 4, 256
    x = torch.ones(t, h, dtype=torch.float16)
    idx = torch.tensor([[0, 1]] * t)
    out = d.dispatch(x, idx, torch.full((t, 2), 0.25))
    y = d.combine(torch.full((out.handle.num_rows, h), 1e5), out.handle)
    assert y.dtype == torch.float16
    assert torch.equal(y, torch.full((t, h), 50000.0, dtype=torch.float16))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_given_tensor_scale_makes_a_non_finite_row_nan(bad):
    """With a caller-given tensor scale there is no amax to poison: a row holding Inf or NaN must
    dequantize to NaN in every column (never 448 * scale, never a finite rest of the row), and the
    other rows stay as they were."""
    scale = torch.tensor(4.0 / 448)
    d = fp8a2a.Dispatcher(4, granularity="tensor", tensor_scale=scale, bf16_below_bytes=0)
    x = torch.rand(6, 128) * 3
    x_bad = x.clone()
    x_bad[2, 5] = bad
    idx = torch.arange(6).remainder(4).unsqueeze(1)
    w = torch.ones(6, 1)
    got, ref = (d.dispatch(v, idx, w) for v in (x_bad, x))
    rows_got, rows_ref = got.dequantized(torch.float32), ref.dequantized(torch.float32)
    poisoned = torch.isnan(rows_got).all(1)
    assert poisoned.sum() == 1  # token 2 is one row here (top-1)
    assert torch.equal(rows_got[~poisoned], rows_ref[~poisoned])
    y = d.combine(rows_got, got.handle)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4, 5]]).all()


# ---- what the caller keeps: topk_idx, the tensor scale; second derivatives ----------------------

def _routed(granularity="row", **kw):
    d = fp8a2a.Dispatcher(2, granularity=granularity, bf16_below_bytes=0, **kw)
    x = torch.randn(4, 16, requires_grad=True)
    idx = torch.tensor([[0], [1], [0], [1]])
    w = torch.ones(4, 1, requires_grad=True)
    return d, x, idx, w


@pytest.mark.parametrize("capacity", [None, 2.0])
def test_topk_idx_modified_before_combine_backward(capacity):
    """Combine's backward routes dy by the dispatch's ids: the dispatch keeps its own copy under grad
    mode, so the caller changing its topk_idx in place before that backward changes nothing (no
    rank raises alone while its peers wait in the backward's exchange)."""
    d, x, idx, w = _routed(capacity_factor=capacity)
    grads = []
    # a dispatch under no_grad or inference mode, then a combine with grad (experts trained on
    # frozen rows): the same copy protects combine's backward
    for mode in (contextlib.nullcontext, torch.no_grad, torch.inference_mode):
        for modify in (False, True):
            ids = idx.clone()
            with mode():
                out = d.dispatch(x, ids, w)
            expert_out = out.dequantized(torch.float32).detach().clone().requires_grad_()
            y = d.combine(expert_out, out.handle, apply_weights=mode is contextlib.nullcontext)
            if modify:
                ids[0, 0], ids[1, 0] = 1, 0
            (y * torch.arange(1.0, 1 + y.numel()).view_as(y)).sum().backward()
            grads.append(expert_out.grad)
        assert torch.equal(grads[-2], grads[-1]), mode
        with mode():
            assert d.dispatch(x, ids, w).handle.topk_idx is not ids


def test_dispatcher_options_that_cannot_apply_are_rejected():
    """A tensor scale is read by granularity 'tensor' only; a capacity factor must be finite."""
    with pytest.raises(ValueError, match="only meaningful for granularity='tensor'"):
        fp8a2a.Dispatcher(2, granularity="row", tensor_scale=torch.tensor(0.5))
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="capacity_factor must be positive and finite"):
            fp8a2a.Dispatcher(2, capacity_factor=bad)


def test_tokens_keep_the_tensor_scale_they_were_quantized_with():
    """The caller's tensor_scale is read at each dispatch, but the dispatched tokens hold a copy: an
    update of the caller's scale (e.g. by the next micro-batch) leaves them as they were."""
    scale = torch.tensor([0.01])
    d, x, idx, w = _routed("tensor", tensor_scale=scale)
    out = d.dispatch(x.detach(), idx, w.detach())
    before = out.dequantized(torch.float32).clone()
    scale.mul_(2)
    assert torch.equal(out.dequantized(torch.float32), before)
    later = d.dispatch(x.detach(), idx, w.detach())  # the next dispatch reads the new value
    assert float(later.tokens.scale) == pytest.approx(0.02)


def test_second_derivatives_raise():
    """dispatch and combine have no second derivative: differentiating their gradients raises
    instead of silently dropping the second-order terms."""
    d, x, idx, w = _routed()
    out = d.dispatch(x, idx, w)
    expert_out = out.dequantized(torch.float32).clone().requires_grad_()
    y = d.combine(expert_out, out.handle)
    g, = torch.autograd.grad((y ** 2).sum(), expert_out, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (g * g).sum().backward()
    # dispatch's backward alone: x's gradient through the rows, without combine
    for weighted in (False, True):
        out = d.dispatch(x, idx, w)
        rows = out.dequantized(torch.float32)
        loss = ((rows * out.weights[:, None]) if weighted else rows).pow(2).sum()
        gx, = torch.autograd.grad(loss, x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gx.pow(2).sum().backward()
