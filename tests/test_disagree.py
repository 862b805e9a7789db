"""Inputs that differ on one rank (issue 19): exactly one rank of two is bad, and every rank must
raise (or, in combine, see NaN where the bad rank's rows land), never hang. Every multi-rank case
runs under run_ranks' hard timeout (a hang fails the test) and ends with a good dispatch + combine
on the same Dispatcher, which must work on every rank."""
import pytest
import torch

import fp8a2a
from fp8a2a import ops

from .distributed import run_ranks
from .test_dispatch import make_inputs

E, H, K, T = 8, 64, 2, 8
TIMEOUT = 120


def _good_step(rank, world, d, dtype=torch.bfloat16, tokens=T):
    """A good dispatch + combine (+ backward) on `d`; returns y."""
    xs, idxs, ws = make_inputs(world, tokens, H, E, K, dtype, seed=7)
    x = xs[rank].clone().requires_grad_()
    out = d.dispatch(x, idxs[rank], ws[rank])
    y = d.combine(out.dequantized(dtype) * 2, out.handle)
    y.float().sum().backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(x.grad.float()).all()
    return y


def _raises_then_recovers(bad_call, good_dispatcher):
    """fn(rank, world) for run_ranks: bad_call(rank, world) must raise on every rank; then a good
    step on good_dispatcher(rank, world) must work. Returns every rank's message."""
    def fn(rank, world):
        try:
            bad_call(rank, world)
        except (ValueError, RuntimeError, TypeError) as e:
            msg = str(e)
        else:
            msg = None
        _good_step(rank, world, good_dispatcher(rank, world))
        return msg
    msgs = run_ranks(2, fn, timeout=TIMEOUT)
    assert all(m is not None for m in msgs), msgs
    return msgs


# ---- Dispatcher options ------------------------------------------------------------------------

OPTIONS = {  # option -> (rank 0's value, rank 1's value)
    "fp8_combine": (False, True),
    "fp8_dispatch_backward": (False, True),
    "capacity_factor": (2.0, 2.0000000000000004),  # one float64 ulp: compared exactly
    "capacity_factor_off": (None, 2.0),
    "granularity": ("row", "block128"),
    "expert_tp_size": (1, 2),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_set_differently_on_one_rank_raises_naming_it(option):
    name = option.replace("_off", "")

    def bad(rank, world):
        fp8a2a.Dispatcher(E, **{name: OPTIONS[option][rank]})

    msgs = _raises_then_recovers(bad, lambda rank, world: fp8a2a.Dispatcher(E))
    assert all(f"disagree on the Dispatcher option(s) {name} (per rank:" in m for m in msgs), msgs


def test_several_options_differ_all_are_named():
    def bad(rank, world):
        fp8a2a.Dispatcher(E if rank == 0 else 2 * E, fp8_combine=bool(rank))

    msgs = _raises_then_recovers(bad, lambda rank, world: fp8a2a.Dispatcher(E))
    assert all("num_experts (per rank: [8, 16])" in m and "fp8_combine (per rank: [False, True])" in m
               for m in msgs), msgs


def test_options_that_may_differ():
    # bf16_below_bytes is agreed per call (FP8 wins); always_communicate only matters at group size 1
    def fn(rank, world):
        d = fp8a2a.Dispatcher(E, bf16_below_bytes=0 if rank == 0 else 1 << 30, always_communicate=bool(rank))
        _good_step(rank, world, d)
    run_ranks(2, fn, timeout=TIMEOUT)


INVALID = {  # an option rank 1 alone gets wrong: it raises before the agreement, which its peer is in
    "granularity": dict(granularity="rows"),
    "num_experts": dict(num_experts=9),
    "expert_tp_size": dict(expert_tp_size=3),
    "capacity_factor": dict(capacity_factor=-1.0),
    "capacity_factor_nan": dict(capacity_factor=float("nan")),
    "capacity_factor_inf": dict(capacity_factor=float("inf")),
    "config_and_arguments": dict(config=fp8a2a.DispatcherConfig(), fp8_combine=True),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_option_invalid_on_one_rank_raises_on_every_rank(case):
    def bad(rank, world):
        fp8a2a.Dispatcher(**dict(dict(num_experts=E), **(INVALID[case] if rank == 1 else {})))

    msgs = _raises_then_recovers(bad, lambda rank, world: fp8a2a.Dispatcher(E))
    assert "ranks [1] were given invalid Dispatcher options" in msgs[0], msgs
    assert "ranks [1]" not in msgs[1], msgs  # the invalid rank raises its own error


# ---- autograd: the backward exchanges are the same on every rank ----------------------------------

@pytest.mark.parametrize("wire", ["fp8", "raw"])
def test_router_weights_requiring_grad_on_one_rank_only(wire):
    """Rank 0's router weights require grad, rank 1's do not (x does on both): dispatch's backward
    rows have one width on every rank, and rank 0's gradients equal those of a step where every
    rank's weights require grad."""
    def fn(rank, world):
        d = fp8a2a.Dispatcher(E, bf16_below_bytes=0 if wire == "fp8" else 1 << 30)
        xs, idxs, ws = make_inputs(world, T, H, E, K, torch.float32, seed=3)

        def step(grad_here):
            x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_(grad_here)
            out = d.dispatch(x, idxs[rank], w)
            d.combine(out.dequantized(torch.float32) * 0.5, out.handle).sum().backward()
            return x.grad, w.grad

        got, ref = step(rank == 0), step(True)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
        if rank == 0:
            torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
        return got[1] is not None

    assert run_ranks(2, fn, timeout=TIMEOUT) == [True, False]


@pytest.mark.parametrize("wire", ["fp8", "raw", "capacity"])
@pytest.mark.parametrize("which", ["x", "topk_weights"])
def test_grad_required_on_one_rank_only_raises_on_every_rank(which, wire):
    """Rank 0's x (or router weights) requires grad, rank 1's nothing: rank 0's backward would wait
    in an exchange rank 1 never enters. The counts header carries each rank's flag, so both raise
    in the forward, naming it, and the same Dispatcher then works."""
    made = {}

    def dispatcher(rank, world):
        if "d" not in made:
            opts = dict(capacity_factor=2.0) if wire == "capacity" else {}
            made["d"] = fp8a2a.Dispatcher(E, bf16_below_bytes=1 << 30 if wire == "raw" else 0, **opts)
        return made["d"]

    def bad(rank, world):
        xs, idxs, ws = make_inputs(world, T, H, E, K, torch.float32, seed=5)
        x, w = xs[rank], ws[rank]
        if rank == 0:
            x, w = (x.requires_grad_(), w) if which == "x" else (x, w.requires_grad_())
        out = dispatcher(rank, world).dispatch(x, idxs[rank], w)
        dispatcher(rank, world).combine(out.dequantized(torch.float32), out.handle).sum()

    msgs = _raises_then_recovers(bad, dispatcher)
    assert all("requires grad on some ranks only: [True, False]" in m for m in msgs), msgs


@pytest.mark.parametrize("how", ["dual_input", "torch_func_jvp"])
def test_forward_ad_on_one_rank_raises_on_every_rank(how):
    """Rank 1 dispatches a dual tensor, or calls dispatch inside torch.func.jvp with inputs that
    carry no tangent: neither is supported, and both are rejected before any collective."""
    import torch.autograd.forward_ad as fwAD
    made = {}

    def dispatcher(rank, world):
        return made.setdefault("d", fp8a2a.Dispatcher(E, bf16_below_bytes=0))

    def bad(rank, world):
        xs, idxs, ws = make_inputs(world, T, H, E, K, torch.float32)
        d = dispatcher(rank, world)

        def step(x, scale=1.0):
            out = d.dispatch(x, idxs[rank], ws[rank])
            return d.combine(out.dequantized(torch.float32), out.handle) * scale

        if rank == 0:
            step(xs[0])
        elif how == "dual_input":
            with fwAD.dual_level():
                step(fwAD.make_dual(xs[1], torch.ones_like(xs[1])))
        else:
            torch.func.jvp(lambda s: step(xs[1], s), (torch.tensor(1.0),), (torch.tensor(1.0),))

    msgs = _raises_then_recovers(bad, dispatcher)
    cause = "x is a dual tensor" if how == "dual_input" else "torch.func transforms"
    assert "ranks [1] rejected their dispatch input" in msgs[0] and cause in msgs[1], msgs


def test_empty_rank_raw_wire_backward_of_a_sum():
    """A rank without tokens gets the gradient of y.sum() as an empty expanded tensor (contiguous by
    torch's rule, zero strides): its raw (BF16) combine backward must still pack it and join the
    exchange."""
    def fn(rank, world):
        d = fp8a2a.Dispatcher(E)  # small inputs: the raw wire
        xs, idxs, ws = make_inputs(world, [T, 0], H, E, K, torch.bfloat16, seed=5)
        x = xs[rank].clone().requires_grad_()
        out = d.dispatch(x, idxs[rank], ws[rank])
        d.combine(out.dequantized(torch.bfloat16) * 2, out.handle).sum().backward()
        routed = (idxs[rank] >= 0).float() * ws[rank]  # d(sum of 2 * w * x over the routed slots)/dx
        torch.testing.assert_close(x.grad, (2 * routed.sum(1, keepdim=True)).expand(-1, H).to(x.dtype))
        return out.handle.wire.label, tuple(x.grad.shape)

    assert run_ranks(2, fn, timeout=TIMEOUT) == [("raw", (T, H)), ("raw", (0, H))]


# ---- dispatch inputs: device, dtype ------------------------------------------------------------

DISPATCH_BAD = ["x_meta", "idx_meta", "weights_meta", "all_meta", "cpu_on_nccl", "idx_float", "weights_int",
                "x_sparse", "idx_sparse"]


def _bad_dispatch_input(case, x, idx, w):
    if case == "x_meta":
        return x.to("meta"), idx, w
    if case == "idx_meta":
        return x, idx.to("meta"), w
    if case == "weights_meta":
        return x, idx, w.to("meta")
    if case == "all_meta":
        return x.to("meta"), idx.to("meta"), w.to("meta")
    if case == "idx_float":
        return x, idx.float(), w
    if case == "weights_int":
        return x, idx, (w * 10).int()
    if case == "x_sparse":  # tensor mode would take its amax before the pack: rejected before that
        return x.to_sparse(), idx, w
    if case == "idx_sparse":
        return x, idx.to_sparse(), w
    return x, idx, w


@pytest.mark.parametrize("mode", ["default", "tensor", "capacity"])
@pytest.mark.parametrize("case", DISPATCH_BAD)
def test_dispatch_input_rejected_on_one_rank_raises_on_every_rank(case, mode):
    opts = {"default": {}, "tensor": dict(granularity="tensor"), "capacity": dict(capacity_factor=2.0)}[mode]
    made = {}

    def dispatcher(rank, world):
        if "d" not in made:
            made["d"] = fp8a2a.Dispatcher(E, bf16_below_bytes=0, **opts)
        return made["d"]

    def bad(rank, world):
        d = dispatcher(rank, world)
        xs, idxs, ws = make_inputs(world, T, H, E, K, torch.bfloat16)
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        if rank == 1:
            x, idx, w = _bad_dispatch_input(case, x, idx, w)
            if case == "cpu_on_nccl":  # what a Dispatcher on an NCCL group requires (CPU here: gloo)
                d._needs_cuda = True
        try:
            d.dispatch(x, idx, w)
        finally:
            d._needs_cuda = False

    # the bad call is the first of its shape on this Dispatcher (capacity mode reads the header then)
    msgs = _raises_then_recovers(bad, dispatcher)
    assert "ranks [1] rejected their dispatch input" in msgs[0], msgs
    cause = {"idx_float": "topk_idx must be int64 or int32", "weights_int": "topk_weights floating-point",
             "cpu_on_nccl": "(NCCL) needs CUDA tensors", "all_meta": "meta tensors outside",
             "x_sparse": "strided (dense) tensors", "idx_sparse": "strided (dense) tensors"}.get(case, "one device")
    assert cause in msgs[1], msgs


@pytest.mark.parametrize("which", ["x", "topk_idx", "topk_weights"])
def test_meta_inputs_never_reach_a_kernel(which):
    x, idx, w = torch.randn(T, H), torch.randint(0, E, (T, K)), torch.rand(T, K)
    args = {"x": x, "topk_idx": idx, "topk_weights": w}
    args[which] = args[which].to("meta")
    d = fp8a2a.Dispatcher(E)
    with pytest.raises(ValueError, match="one device"):
        d.dispatch(*args.values())
    with pytest.raises(ValueError, match="meta tensors outside"):
        d.dispatch(x.to("meta"), idx.to("meta"), w.to("meta"))
    # the ops themselves: a meta tensor among CPU ones picks the fake kernel, which must refuse
    with pytest.raises(RuntimeError, match="is on"):
        ops.dispatch_pack(args["x"], args["topk_idx"].int(), args["topk_weights"], E, 1, 0, None)
    out = d.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="expert_out is on meta"):
        d.combine(out.dequantized().to("meta"), out.handle)
    d.combine(out.dequantized(), out.handle)


# ---- combine inputs ----------------------------------------------------------------------------

COMBINE_BAD = ["shape", "dtype_int", "dtype_fp8", "meta", "quantized", "sparse"]


def _bad_expert_out(case, rows):
    if case == "shape":
        return rows[:, : H // 2]
    if case == "dtype_int":
        return rows.int()
    if case == "dtype_fp8":
        return rows.to(torch.float8_e4m3fn)
    if case == "meta":
        return rows.to("meta")
    if case == "sparse":
        return rows.to_sparse()
    return fp8a2a.quantize(rows.float())


@pytest.mark.parametrize("mode", ["bf16", "fp8_combine", "capacity", "float32"])
@pytest.mark.parametrize("case", COMBINE_BAD)
def test_combine_input_rejected_on_one_rank_poisons_its_tokens_on_every_peer(case, mode):
    """No collective and no host sync can be added to combine, so the peers cannot raise: the bad
    rank sends rows of 0xFF bytes and raises; each peer's y is NaN in exactly the tokens routed to an
    expert of the bad rank, and finite elsewhere."""
    opts = {"bf16": {}, "fp8_combine": dict(fp8_combine=True), "capacity": dict(capacity_factor=4.0),
            "float32": {}}[mode]
    dtype = torch.float32 if mode == "float32" else torch.bfloat16

    def fn(rank, world):
        d = fp8a2a.Dispatcher(E, bf16_below_bytes=0, **opts)
        xs, idxs, ws = make_inputs(world, 16, H, E, K, dtype)
        out = d.dispatch(xs[rank], idxs[rank], ws[rank])
        rows = out.dequantized(dtype)
        msg = None
        try:
            y = d.combine(_bad_expert_out(case, rows) if rank == 1 else rows, out.handle)
        except (ValueError, TypeError) as e:
            msg = str(e)
        if rank == 0:
            served = ((idxs[0] >= E // world) & (idxs[0] < E)).any(1)  # tokens routed to rank 1's experts
            assert served.any() and not served.all()
            assert y[served].isnan().all(), y
            assert torch.isfinite(y[~served].float()).all()
        _good_step(rank, world, d, dtype)
        return msg

    msgs = run_ranks(2, fn, timeout=TIMEOUT)
    assert msgs[0] is None and "expert_out" in msgs[1], msgs


def test_combine_rejects_bad_input_at_world_size_one():
    d = fp8a2a.Dispatcher(E)
    out = d.dispatch(torch.randn(T, H), torch.randint(0, E, (T, K)), torch.rand(T, K))
    rows = out.dequantized()
    for case in COMBINE_BAD:
        with pytest.raises((ValueError, TypeError), match="expert_out"):
            d.combine(_bad_expert_out(case, rows), out.handle)
    with pytest.raises(TypeError, match="DispatchHandle"):
        d.combine(rows, None)
    assert torch.isfinite(d.combine(rows.double(), out.handle)).all()  # float64 is converted


# ---- capacity mode: out-of-range ids are counted, never raised ---------------------------------

def test_capacity_mode_counts_out_of_range_ids_on_every_call():
    def fn(rank, world):
        d = fp8a2a.Dispatcher(E, capacity_factor=2.0)
        seen = []
        for call in range(3):  # the first call of the shape too
            xs, idxs, ws = make_inputs(world, T, H, E, K, torch.bfloat16, seed=call)
            if rank == 1 and call != 1:
                idxs[1][0, 0], idxs[1][3, 1] = E, -7  # out of range on one rank
            out = d.dispatch(xs[rank], idxs[rank], ws[rank])
            d.combine(out.dequantized(), out.handle)
            seen.append(int(out.handle.invalid_ids))
        return seen
    assert run_ranks(2, fn, timeout=TIMEOUT) == [[0, 0, 0], [2, 0, 2]]


def test_capacity_mode_counts_out_of_range_ids_once_under_expert_tp():
    """Expert TP replicates each id over its TP ranks: invalid_ids counts the caller's ids."""
    def fn(rank, world):
        idx = torch.tensor([[0, 1], [1, 7], [0, -1], [1, 0]])  # one out-of-range id on each rank
        out = fp8a2a.Dispatcher(2, capacity_factor=2.0, expert_tp_size=2).dispatch(torch.randn(4, 16), idx,
                                                                                   torch.rand(4, 2))
        return int(out.handle.invalid_ids)
    assert run_ranks(2, fn, timeout=TIMEOUT) == [1, 1]


def test_capacity_mode_counts_out_of_range_ids_at_world_size_one():
    d = fp8a2a.Dispatcher(E, capacity_factor=1.0)
    idx = torch.randint(0, E, (T, K))
    idx[2, 0] = E + 3
    out = d.dispatch(torch.randn(T, H), idx, torch.rand(T, K))
    assert int(out.handle.invalid_ids) == 1
    with pytest.raises(ValueError, match="expert ids outside"):  # the default mode still raises
        fp8a2a.Dispatcher(E).dispatch(torch.randn(T, H), idx, torch.rand(T, K))


# ---- x dtype differing across ranks (the counts header's DTYPE column) ---------------------------

@pytest.mark.parametrize("wire", ["fp8", "raw", "mixed", "capacity"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)])
def test_x_dtype_differing_on_one_rank_raises_on_every_rank(dtypes, wire):
    opts = dict(capacity_factor=2.0) if wire == "capacity" else {}
    made = {}

    def dispatcher(rank, world):
        if "d" not in made:
            below = {"fp8": 0, "raw": 1 << 30, "mixed": [0, 1 << 30][rank], "capacity": 0}[wire]
            made["d"] = fp8a2a.Dispatcher(E, bf16_below_bytes=below, **opts)
        return made["d"]

    def bad(rank, world):
        xs, idxs, ws = make_inputs(world, T, H, E, K, torch.float32)
        dispatcher(rank, world).dispatch(xs[rank].to(dtypes[rank]), idxs[rank], ws[rank])

    msgs = _raises_then_recovers(bad, dispatcher)
    want = f"ranks dispatch x of different dtypes: ['{str(dtypes[0])[6:]}', '{str(dtypes[1])[6:]}']"
    assert all(want in m for m in msgs), msgs


# ---- tensor granularity: the documented rule --------------------------------------------------

def _near_rounding_ties(amax: float) -> torch.Tensor:
    """[rows, 256] float32 whose every row has amax `amax` and whose values, times 448 / amax, lie
    within a few ulps of e4m3's rounding midpoints: a one-ulp change of the multiplier moves bytes."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    base = torch.div((codes[:-1] + codes[1:]) / 2, torch.div(torch.tensor(448.0), torch.tensor(amax)))
    x = torch.cat([base * (1 + k * 1e-7) for k in range(-20, 21)])
    x = torch.cat([x, -x, torch.zeros((-2 * x.numel()) % 256)]).view(-1, 256)
    x[:, 7] = amax
    return x


def test_tensor_granularity_bytes_equal_row_granularity_for_the_same_amax():
    # every row's amax is the tensor's, so 'row' and 'tensor' must quantize alike: data = e4m3(x * (448 / amax))
    for amax in (3.8469135761260986, 7.478944778442383, 3.0):
        x = _near_rounding_ties(amax)
        row, tensor = fp8a2a.quantize(x, "row"), fp8a2a.quantize(x, "tensor")
        assert torch.equal(row.data.view(torch.uint8), tensor.data.view(torch.uint8)), amax
        assert torch.equal(row.scale, tensor.scale.expand(x.shape[0]))
        # the Dispatcher's tensor scale comes from the (all-reduced) amax too
        idx, w = torch.arange(x.shape[0]).remainder(E).unsqueeze(1), torch.ones(x.shape[0], 1)
        rows = [fp8a2a.Dispatcher(E, granularity=gr, bf16_below_bytes=0).dispatch(x, idx, w).tokens.data
                for gr in ("row", "tensor")]
        assert torch.equal(rows[0].view(torch.uint8), rows[1].view(torch.uint8)), amax
        if amax != 3.0:  # where 1 / (amax / 448) != 448 / amax, the old multiplier moved bytes here
            old = (x * torch.div(torch.ones(()), row.scale[0])).to(torch.float8_e4m3fn)
            assert not torch.equal(old.view(torch.uint8), row.data.view(torch.uint8))
    # a given tensor_scale has no amax: its multiplier is 1 / scale (IEEE division)
    s = torch.tensor(0.37 / 448)
    want = (x * torch.div(torch.ones(()), s)).to(torch.float8_e4m3fn)
    assert torch.equal(fp8a2a.quantize(x, "tensor", s).data.view(torch.uint8), want.view(torch.uint8))
