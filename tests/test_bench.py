"""The benchmarks' own logic on the CPU: statistics, bandwidth, crossover, the BF16 baseline's
semantics, the command line's refusals, a tiny sweep over 2 gloo ranks (table, JSON, CSV, PNG,
exact wire bytes), host-cost counting from synthetic profiler events, the scale model's arithmetic,
its measured inputs and error report, and the kernel, MoE-layer and dispatch benchmarks at
functional sizes (run as programs: tests import no CLI or benchmark)."""
import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import re

import pytest
import torch

from fp8a2a import DispatcherConfig, ops
from fp8a2a.bench import baseline, costs, model as bench_model, report, sweep
from fp8a2a.wire import CountsCol, Granularity

from .distributed import run_ranks
from .programs import ROOT, default_env, free_port, run


def _run(*argv, **kw):
    """`python ARGV` as a user runs it, from this checkout, on a port of its own: a benchmark that
    starts a process group at world size 1 takes MASTER_PORT, else a fixed one a concurrent run may hold."""
    return run(*argv, env=default_env(MASTER_PORT=str(free_port())), **kw)

DEFAULT_BF16_BELOW_BYTES = DispatcherConfig().bf16_below_bytes


def _bench_command(*argv, **kw):
    return _run("-m", "fp8a2a.bench", *argv, **kw)


def _benchmark(name, *argv):
    """benchmarks/NAME.py ARGV; asserts it succeeded and returns its standard output."""
    done = _run(os.path.join("benchmarks", f"{name}.py"), *argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


# ---- statistics and bandwidth ---------------------------------------------------------------

def test_percentiles_interpolate_like_numpy():
    vals = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert report.percentile(vals, 50) == 3.0
    assert report.percentile(vals, 0) == 1.0 and report.percentile(vals, 100) == 5.0
    assert report.percentile(vals, 10) == pytest.approx(1.4)  # numpy.percentile([1..5], 10)
    assert report.percentile(vals, 90) == pytest.approx(4.6)
    assert report.percentile([7.0], 90) == 7.0
    assert math.isnan(report.percentile([], 50))
    s = report.summarize([1, 2, 3, 4, 10])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3, 1, 10, 5)
    assert s["mean"] == 4 and s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(7.6)


def test_nccl_tests_bandwidth_definitions():
    alg = report.algbw_gbps(8e9, 0.5)  # 8 GB sent by a rank in 0.5 s
    assert alg == pytest.approx(16.0)
    assert report.busbw_gbps(alg, 8) == pytest.approx(14.0)  # * (n - 1) / n
    assert report.busbw_gbps(alg, 1) == 0.0


# ---- crossover and the threshold it recommends ------------------------------------------------

def test_crossover_interpolates_in_log_size():
    c = report.find_crossover([1024, 4096, 16384], [0.5, 0.8, 1.2])
    assert c["status"] == "crosses" and (c["last_loss_bytes"], c["first_win_bytes"]) == (4096, 16384)
    # speedup 1.0 is halfway between 0.8 and 1.2: halfway between 4096 and 16384 in log size
    assert c["crossover_bytes"] == pytest.approx(8192)


def test_crossover_needs_every_larger_size_to_win():
    c = report.find_crossover([1, 2, 4, 8, 16], [1.5, 0.9, 1.1, 0.95, 1.3])  # noisy dips
    assert c["status"] == "crosses" and c["last_loss_bytes"] == 8 and c["first_win_bytes"] == 16
    unsorted = report.find_crossover([16, 1, 8, 4, 2], [1.3, 1.5, 0.95, 1.1, 0.9])
    assert unsorted == c


def test_crossover_edge_cases():
    assert report.find_crossover([1, 2], [1.1, 2.0]) == {
        "status": "fp8_always_wins", "crossover_bytes": 1.0, "last_loss_bytes": None, "first_win_bytes": 1.0}
    never = report.find_crossover([1, 2], [0.5, 0.9])
    assert never["status"] == "bf16_always_wins" and never["crossover_bytes"] is None and never["last_loss_bytes"] == 2
    assert report.find_crossover([1, 2], [None, float("nan")])["status"] == "no_data"
    assert report.find_crossover([1, 2, 4], [0.9, None, 1.1])["status"] == "crosses"


def test_threshold_recommendation():
    cx = {"a": report.find_crossover([1024, 4096], [0.9, 1.3]), "b": report.find_crossover([1024, 4096], [0.5, 1.5]),
          "c": report.find_crossover([1024, 4096], [1.2, 1.3])}
    assert cx["a"]["crossover_bytes"] == pytest.approx(1024 * 4 ** 0.25)  # 1448
    r = report.recommend_threshold(cx)
    assert r["recommended_bytes"] == 2048  # the largest crossover (a), rounded up to a power of two
    assert "a" in r["text"] and r["default_bytes"] == DEFAULT_BF16_BELOW_BYTES
    always = report.recommend_threshold({"c": cx["c"]})
    assert always["recommended_bytes"] == min(DEFAULT_BF16_BELOW_BYTES, 1024)
    none = report.recommend_threshold({"x": report.find_crossover([1, 2], [0.1, 0.2])})
    assert none["recommended_bytes"] is None and "never" in none["text"]
    # every outcome names the knob, so the sweep's summary line does whatever the timings were
    assert all("bf16_below_bytes" in rec["text"] for rec in (r, always, none))


# ---- the BF16 baseline does what Megatron's alltoall dispatcher does ---------------------------

def _baseline_scenario(rank, world):
    T, H, E, K = 12, 32, 8, 3
    xs, maps, probs = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        xs.append(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx, w, rmap, p = baseline.make_routing(T, E, K, "cpu", seed=10 + r)
        maps.append(rmap), probs.append(p)
    m = baseline.MegatronStyleAlltoAll(E)
    rows, tpe, p = m.dispatch(xs[rank], maps[rank], probs[rank])
    # expected: for each local expert, rows from every source rank in order, tokens in order
    L = E // world
    want_rows, want_p, want_tpe = [], [], []
    for le in range(L):
        e = rank * L + le
        n = 0
        for src in range(world):
            for t in range(T):
                if maps[src][t, e]:
                    want_rows.append(xs[src][t]), want_p.append(probs[src][t, e])
                    n += 1
        want_tpe.append(n)
    assert tpe.tolist() == want_tpe
    assert torch.equal(rows, torch.stack(want_rows)) and torch.equal(p, torch.stack(want_p))
    # combine of the rows (identity experts) gives every token back once per routed expert
    y = m.combine(rows)
    assert torch.allclose(y.float(), xs[rank].float() * K, rtol=1e-2, atol=1e-2)
    yw = m.combine(rows, apply_probs=True)  # unpermute with probs: the router-weighted sum
    assert torch.allclose(yw.float(), xs[rank].float() * probs[rank].sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    d_bytes, c_bytes = m.wire_bytes(H)
    assert c_bytes == T * K * H * 2
    assert d_bytes == T * K * (H * 2 + 4) + (E * 8 * world if world > 1 else 0)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_style_baseline(world):
    if world == 1:
        assert _baseline_scenario(0, 1)
    else:
        assert all(run_ranks(world, _baseline_scenario))


def test_megatron_style_baseline_is_differentiable():
    T, H, E, K = 10, 16, 4, 2
    x = torch.randn(T, H, requires_grad=True)
    _, _, rmap, probs = baseline.make_routing(T, E, K, "cpu", seed=3)
    probs.requires_grad_()
    m = baseline.MegatronStyleAlltoAll(E)
    rows, _, p = m.dispatch(x, rmap, probs)
    (m.combine(rows * p.unsqueeze(1)).sum()).backward()
    assert torch.allclose(x.grad, probs.detach().sum(1, keepdim=True).expand(T, H))
    assert probs.grad is not None and torch.all(probs.grad[~rmap] == 0)


# ---- a tiny sweep on 2 gloo ranks: tables, JSON, CSV, PNG, exact wire bytes ----------------

def test_tiny_sweep_writes_json_csv_png(tmp_path):
    out = tmp_path / "a2a.json"
    out.write_text("an earlier run")
    tokens, H, E, K, world = [16, 48], 256, 8, 2, 2
    argv = ("--world", world, "--tokens", ",".join(map(str, tokens)), "--hidden", H, "--experts", E, "--topk", K,
            "--granularity", "row,block128", "--iters", "2", "--warmup", "0", "--json", out, "--quiet")
    refused = _bench_command(*argv)  # results are not overwritten without --force
    assert refused.returncode == 2 and "--force" in refused.stderr and out.read_text() == "an earlier run"
    run = _bench_command(*argv, "--force")
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "FUNCTIONAL NUMBERS ONLY" in text and "bf16_below_bytes" in text and "summary" in text
    table = text.split("benchmark: world size")[1].split("variants:")[0].splitlines()[1:]
    assert table[1].split() == ["series", "tokens", "msg/rank", "megatron", "fp8a2a-fp8", "train", "vs-bf16", "infer",
                                "fp8/meg"]  # the training step first; inference in one column
    assert "train step ms" in table[0] and len(table) == 3 + 2 * len(tokens) and max(map(len, table)) <= 120
    assert "busbw" not in table[1] and "not shown on a CPU" in text  # GPU figures stay off a CPU table
    for name in ("megatron", "fp8a2a-bf16", "fp8a2a-fp8"):  # the legend names every variant
        assert re.search(rf"^  {name} +\S", text, re.M), name
    assert re.search(r"^train step \(the headline\): .*y\.backward\(dy\)", text, re.M)
    assert re.search(r"^infer: inference, dispatch \+ combine forward only", text, re.M)
    assert "training step: " in text and "inference (forward only; dispatch time): " in text  # both recommendations

    doc = json.loads(out.read_text())
    assert doc["functional_only"] is True and doc["meta"]["world"] == world
    assert doc["meta"]["headline"] == "train" and doc["meta"]["modes"] == {
        "train": ["dispatch", "combine", "backward"], "infer": ["dispatch", "combine"]}
    recs = doc["records"]
    assert [(r["series"], r["tokens"]) for r in recs] == [
        (f"H{H}-E{E}-K{K}-{g}", t) for g in ("row", "block128") for t in tokens]
    for r in recs:
        for v in report.VARIANTS:
            assert f"{v}_error" not in r, r[f"{v}_error"]
            for mode, phases in report.PHASES.items():  # every variant has a training row and an inference row
                key = f"{v}_{mode}"
                assert all(r[f"{key}_{ph}_ms"] > 0 for ph in phases), (key, r)
                assert r[f"{key}_ms_min"] <= r[f"{key}_ms"] <= r[f"{key}_ms_max"]
                assert r[f"{key}_dispatch_ms_p10"] <= r[f"{key}_dispatch_ms"] <= r[f"{key}_dispatch_ms_p90"]
                assert r[f"{key}_busbw_GBps"] == pytest.approx(r[f"{key}_algbw_GBps"] * (world - 1) / world)
                assert r[f"{key}_host_us"] > 0 and r[f"{key}_launches"] is None  # counted on CUDA only
            assert f"{v}_infer_backward_ms" not in r  # inference runs no backward
        assert r["speedup_train"] == pytest.approx(r["megatron_bf16_train_ms"] / r["fp8a2a_fp8_train_ms"])
        assert r["speedup_train_vs_bf16_wire"] == pytest.approx(r["fp8a2a_bf16_train_ms"] / r["fp8a2a_fp8_train_ms"])
        assert r["speedup_infer"] == pytest.approx(r["megatron_bf16_infer_ms"] / r["fp8a2a_fp8_infer_ms"])
        # exact wire bytes, averaged over the ranks
        T = r["tokens"]
        assert r["megatron_bf16_wire_bytes"] == T * K * (2 * H + 4) + E * 8 * world
        code = Granularity.parse(r["granularity"])
        rows = []
        for rank in range(world):
            idx = baseline.make_routing(T, E, K, "cpu", sweep.point_seed(0, rank, T) + 1)[0]
            dest = torch.zeros(T, world, dtype=torch.bool).scatter_(1, idx // (E // world), True)
            rows.append(int(dest.sum()))
        counts = world * (CountsCol.EXPERTS + E // world) * 8
        assert r["fp8a2a_fp8_wire_bytes"] == pytest.approx(
            sum(rows) / world * ops.dispatch_row_bytes(H, code, K) + counts)
        assert r["fp8a2a_bf16_wire_bytes"] == pytest.approx(
            sum(rows) / world * ops.dispatch_row_bytes(2 * H, Granularity.RAW, K) + counts)
        assert r["wire_ratio_dispatch"] < 0.6
    an = doc["analysis"]
    for part in (an, an["inference"]):  # the training step's crossovers, and inference's apart
        assert set(part["crossover_vs_bf16_wire"]) == {f"H{H}-E{E}-K{K}-row", f"H{H}-E{E}-K{K}-block128"}
        assert "recommended_bytes" in part["recommendation"]

    with open(tmp_path / "a2a.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == report.CSV_COLUMNS and len(rows) == len(recs)
    assert float(rows[0]["megatron_bf16_wire_bytes"]) == recs[0]["megatron_bf16_wire_bytes"]
    assert float(rows[0]["fp8a2a_fp8_train_backward_ms"]) == pytest.approx(recs[0]["fp8a2a_fp8_train_backward_ms"])

    png = tmp_path / "a2a.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists() and "matplotlib is not installed" in text
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the command line: every wrong usage is refused in one line, before any rank starts ---------

BAD_USAGE = {  # argv: what the one line must say (the flag, the valid values)
    ("--world", "0"): ["--world", ">= 1"],
    ("--world", "3"): ["world size 3", "valid world sizes 1,2,4,8,16"],
    ("--world", "3", "--series", "cpu-h256-k2"): ["cpu-h256-k2: 8", "valid world sizes 1,2,4,8"],
    ("--iters", "0"): ["--iters", ">= 1"],
    ("--iters", "many"): ["--iters", ">= 1"],
    ("--warmup", "-1"): ["--warmup", ">= 0"],
    ("--granularity", "fp4"): ["'fp4'", "row, block128, tensor"],
    ("--granularity", "row,fp4"): ["'fp4'", "row, block128, tensor"],
    ("--tokens", "-5"): ["--tokens", ">= 1"],
    ("--tokens", "64,0"): ["--tokens", ">= 1"],
    ("--tokens", ","): ["--tokens", ">= 1"],
    ("--hidden", "-1"): ["--hidden", ">= 1"],
    ("--experts", "0"): ["--experts", ">= 1"],
    ("--topk", "17"): ["--topk 17", "valid 1..16"],
    ("--hidden", "200", "--granularity", "block128"): ["--hidden 200", "multiple of 128"],
    ("--series", "gpt5"): ["'gpt5'", "deepseek-v3", "cpu-h256-k2"],
    ("--series", "cpu-h256-k2", "--hidden", "512"): ["--series", "one or the other"],
    ("--seed", "-2"): ["--seed", ">= 0"],
    ("--out", "x", "--json", "y.json"): ["--json", "--out"],
    ("--no-profile", "--profile-all"): ["--profile-all", "--no-profile"],
    ("--frobnicate",): ["unrecognized arguments: --frobnicate"],
    ("--ep", "8"): ["--ep", "only applies with --model"],
    ("--model", "--tokens", "64"): ["--tokens", "not to --model"],
    ("--model", "--ep", "0"): ["--ep", ">= 1"],
    ("--model", "--net-gbps", "0"): ["--net-gbps", "> 0"],
    ("--model", "--model-topk", "300"): ["--model-topk 300", "valid 1..256"],
    ("--model", "--kernels-json", "missing.json"): ["--kernels-json missing.json", "no such file"],
}


@pytest.mark.parametrize("argv", list(BAD_USAGE), ids=" ".join)
def test_wrong_usage_is_refused_in_one_line_before_anything_runs(argv, tmp_path):
    run = _bench_command(*argv, *(() if {"--out", "--json", "--model"} & set(argv) else ("--out", tmp_path / "out")),
                         cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    line = run.stderr.strip()
    assert "\n" not in line and line.startswith("python -m fp8a2a.bench: error: "), run.stderr
    for want in BAD_USAGE[argv]:
        assert want in line, (want, line)
    assert list(tmp_path.iterdir()) == []  # no rank started, nothing written


def test_existing_results_need_force(tmp_path):
    (tmp_path / "alltoall.csv").write_text("an earlier run")
    run = _bench_command("--out", tmp_path, "--tokens", "16")
    assert run.returncode == 2 and f"{tmp_path / 'alltoall.csv'} exists" in run.stderr and "--force" in run.stderr
    assert (tmp_path / "alltoall.csv").read_text() == "an earlier run"
    (tmp_path / "m.json").write_text("{}")
    run = _bench_command("--model", "--no-measure", "--json", tmp_path / "m.json")
    assert run.returncode == 2 and "--force" in run.stderr
    assert _bench_command("--model", "--no-measure", "--json", tmp_path / "m.json", "--force").returncode == 0


def test_help_documents_every_flag_with_its_defaults():
    run = _bench_command("--help")
    assert run.returncode == 0
    text = run.stdout
    flags = sorted(set(re.findall(r"\[(--[a-z-]+)", text.split("\n\n")[0])))
    assert len(flags) > 25
    for flag in flags:  # every flag has a line of help after its name
        m = re.search(rf"^  {flag}(?: [A-Z,./]+)?(?:\n {{20,}}| +)(\S.*)$", text, re.M)
        assert m and len(m.group(1)) > 10, flag
    for name in sweep.NAMED_SERIES:  # the series can be picked by name, and are listed
        assert re.search(rf"^  {name} +hidden", text, re.M), name
    flat = " ".join(text.split())  # argparse wraps the help at the terminal's width
    assert all(s in flat for s in ("row, block128, tensor", "CPU 64,512,2048", "(default 4)", "CPU 3, GPU 20"))


def test_nothing_is_written_when_nothing_was_measured(tmp_path):
    rec = {"series": "s", "tokens": 16, "msg_bytes": 4096, **{f"{v}_error": "RuntimeError: no kernel"
                                                             for v in report.VARIANTS}}
    args = argparse.Namespace(json=None, out=str(tmp_path / "out"), no_plot=False)
    out = tmp_path / "stdout.txt"
    with open(out, "w") as f:
        assert report.report([rec], {"functional_only": True, "world": 2, "iters": 1}, args, out=f) is None
    assert "nothing was measured: no file written" in out.read_text() and not (tmp_path / "out").exists()


def _table_record(series, tokens, gpu):
    r = {"series": series, "tokens": tokens, "msg_bytes": tokens * 7168 * 2, "wire_ratio_dispatch": 0.337,
         "speedup_train": 2.5, "speedup_train_vs_bf16_wire": 1.75, "speedup_infer": 1.125, "speedup_infer_dispatch": 9.0}
    for v, ms in (("megatron_bf16", 12.3456), ("fp8a2a_bf16", 5.5), ("fp8a2a_fp8", 0.123456)):
        r.update({f"{v}_train_ms": ms, f"{v}_train_host_us": 1234.5678, f"{v}_train_busbw_GBps": 345.678,
                  f"{v}_train_launches": 11 if gpu else None, f"{v}_train_syncs": 1 if gpu else None,
                  # inference: in the table through its one speedup column only
                  f"{v}_infer_ms": 99.0, f"{v}_infer_host_us": 9e6, f"{v}_infer_busbw_GBps": 9.0,
                  f"{v}_infer_launches": 99 if gpu else None, f"{v}_infer_syncs": 9 if gpu else None})
    return r


@pytest.mark.parametrize("gpu", [False, True])
def test_table_units_precision_and_gpu_columns(gpu):
    recs = [_table_record("deepseek-v3-b128", t, gpu) for t in (128, 16384)]
    lines = report.format_table(recs, gpu=gpu).splitlines()
    assert max(map(len, lines)) <= 120 and len(lines) == 5
    groups, head, row = lines[0], lines[1], lines[3].split()
    assert "train step ms" in groups and "speedup x" in groups and ("GPU" in groups) == gpu
    assert head.split()[5:8] == ["train", "vs-bf16", "infer"]
    assert row[:7] == ["deepseek-v3-b128", "128", "1.8", "MiB", "12.3", "0.123", "2.50"]  # 3 significant digits
    assert row[7:10] == ["1.75", "1.12", "0.337"]
    if gpu:
        assert head.split()[-5:] == ["host", "ms", "busbw", "kernels", "syncs"]
        assert row[10:] == ["1.23/1.23", "346", "11/11", "1/1"]
    else:
        assert len(row) == 10 and not {"busbw", "kernels", "syncs", "host"} & set(head.split())
    legend = report.table_legend({"functional_only": not gpu, "iters": 5})
    assert "median of 5" in legend and ("busbw" in legend) == gpu and "msg/rank: the BF16 input per rank" in legend
    assert "train step (the headline)" in legend and "infer: inference" in legend
    assert ("per training step" in legend) == gpu and max(map(len, legend.splitlines())) <= 120


def test_speedup_bands_are_the_per_iteration_ratios():
    rec = dict(megatron_bf16_infer_dispatch_ms=4.0, megatron_bf16_infer_ms=6.0, fp8a2a_fp8_infer_dispatch_ms=2.0,
               fp8a2a_fp8_infer_ms=3.0, fp8a2a_bf16_infer_dispatch_ms=3.0, fp8a2a_bf16_infer_ms=5.0,
               megatron_bf16_train_ms=12.0, fp8a2a_fp8_train_ms=4.0, fp8a2a_bf16_train_ms=6.0)
    # rows: [ms of each phase..., host us]; the training step's phases: dispatch, combine, backward
    times = {"megatron_bf16_infer": [[4.0, 2.0, 0], [6.0, 1.0, 0]], "fp8a2a_fp8_infer": [[1.0, 1.0, 0], [3.0, 3.0, 0]],
             "fp8a2a_bf16_infer": [[3.0, 2.0, 0], [3.0, 2.0, 0]],
             "megatron_bf16_train": [[1.0, 1.0, 10.0, 0], [2.0, 2.0, 8.0, 0]],
             "fp8a2a_fp8_train": [[1.0, 1.0, 2.0, 0], [1.0, 1.0, 4.0, 0]],
             "fp8a2a_bf16_train": [[1.0, 1.0, 4.0, 0], [1.0, 1.0, 7.0, 99]]}  # host us is no phase
    sweep._speedups(rec, times)
    assert rec["speedup_train"] == 3.0 and (rec["speedup_train_min"], rec["speedup_train_max"]) == (2.0, 3.0)
    assert (rec["speedup_train_vs_bf16_wire_min"], rec["speedup_train_vs_bf16_wire_max"]) == (1.5, 1.5)
    assert rec["speedup_infer_dispatch"] == 2.0
    assert (rec["speedup_infer_dispatch_min"], rec["speedup_infer_dispatch_max"]) == (2.0, 4.0)
    assert rec["speedup_infer"] == 2.0 and (rec["speedup_infer_min"], rec["speedup_infer_max"]) == (7 / 6, 3.0)
    assert (rec["speedup_infer_vs_bf16_wire_dispatch_min"], rec["speedup_infer_vs_bf16_wire_dispatch_max"]) == (1.0, 3.0)


def _training_step_gradients(rank, world):
    """Every side's training step runs its backward and, from the same inputs, computes the same
    gradients of x and of the router weights (fp8a2a-fp8: within FP8 error); inference builds no graph."""
    s = sweep.Series("t", 256, 8, 2)
    variants = sweep.point_variants(s, 24, sweep.make_dispatchers(s), torch.device("cpu"), rank, seed=1)
    idx = baseline.make_routing(24, 8, 2, "cpu", sweep.point_seed(1, rank, 24) + 1)[0]
    grads = {}
    for v in variants:
        train, infer = v.steps["train"], v.steps["infer"]
        assert [t.requires_grad for t in train.leaves] == [True, True] and infer.leaves == ()
        for _ in range(2):  # the second step's gradients are its own, not accumulated onto the first's
            train()
        x, weights = train.leaves
        dense = weights.grad.shape == (24, 8)  # Megatron's probs [T, E]; fp8a2a's topk weights [T, K]
        grads[v.name] = (x.grad.float(), weights.grad.gather(1, idx) if dense else weights.grad)
        assert not infer().requires_grad
    assert all(g.norm() > 0 for g in grads["megatron_bf16"])
    for name, tol in (("fp8a2a_bf16", 0.02), ("fp8a2a_fp8", 0.1)):
        for got, want in zip(grads[name], grads["megatron_bf16"]):
            assert (got - want).norm() <= tol * want.norm(), (name, rank, (got - want).norm() / want.norm())
    return True


def test_training_steps_compute_the_same_gradients():
    assert all(run_ranks(2, _training_step_gradients))


def test_series_skip_when_experts_do_not_split(tmp_path):
    args = sweep.SweepArgs(hidden=[128], experts=[6, 8], topk=[2], tokens=[8])
    assert [s.name for s in sweep.build_series(args, cuda=False)] == ["H128-E6-K2-row", "H128-E8-K2-row"]
    assert [s.name for s in sweep.build_series(sweep.SweepArgs(), cuda=True)] == [s.name for s in sweep.GPU_SERIES]
    recs, meta = run_ranks(4, sweep.run_sweep, sweep.SweepArgs(hidden=[128], experts=[6, 8], topk=[2], tokens=[8],
                                                                iters=1, warmup=0, quiet=True))[0]
    assert meta["skipped_series"] == ["H128-E6-K2-row"] and {r["series"] for r in recs} == {"H128-E8-K2-row"}


# ---- the scale model -----------------------------------------------------------------------

def test_distinct_ranks():
    assert bench_model.distinct_ranks(8, 256, 8) == pytest.approx(5.29, abs=0.01)
    assert bench_model.distinct_ranks(256, 256, 8) == pytest.approx(8.0)  # one expert per rank
    assert bench_model.distinct_ranks(1, 256, 8) == pytest.approx(1.0)


def test_model_arithmetic_at_one_ep_size():
    """project() computes what its docstring says, checked on round inputs (by hand: no input here
    is a real machine's, and nothing is asserted about which side the projection favours)."""
    p = bench_model.Params(tokens=1000, hidden=1024, ffn=512, experts=16, topk=2, gpus_per_node=4, nvlink_gbps=100,
                           net_gbps=10, latency_us=10, per_peer_us=1, megatron_kernel_tbps=1, fp8a2a_kernel_tbps=2,
                           eager_quant_tbps=0.5, megatron_overhead_us=100, fp8a2a_overhead_us=20, hand_fp8_extra_us=30,
                           gemm_bf16_tflops=100, gemm_fp8_tflops=200)
    r = bench_model.project(p, [8])[0]
    row, crow = bench_model._row_bytes(1024, 2)
    D = 8 * (1 - math.comb(14, 2) / math.comb(16, 2))  # a rank holds 2 of the 16 experts
    assert (r["ep"], r["nodes"], r["experts"], r["experts_per_rank"]) == (8, 2, 16, 2)
    assert r["ranks_per_token"] == pytest.approx(D) and r["inter_node_share"] == 0.5  # 4 of 8 ranks off-node
    assert r["bytes_per_token_megatron"] == 2 * (2 * 1024 + 4)  # K copies, BF16 + an fp32 prob
    assert r["bytes_per_token_fp8a2a"] == pytest.approx(D * row)
    assert r["bytes_ratio_fp8a2a"] == pytest.approx(D * row / 4104) and r["dedup_factor"] == pytest.approx(D / 2)
    # wire: the network binds (0.5 / 10 GB/s > 0.375 / 100 GB/s); latency 10 us + 1 us x 7 peers
    wire_ms = lambda b: 1000 * b * 0.5 / 10e9 * 1e3  # noqa: E731
    lat_ms = 17e-3
    # Megatron's dispatch: 100 us + (permute + sort_chunks) 4 x T x K x 2H bytes at 1 TB/s + the exchange
    assert r["dispatch_ms_megatron"] == pytest.approx(0.1 + 4 * 1000 * 2 * 2048 / 1e12 * 1e3 + lat_ms + wire_ms(4104))
    kb = 1000 * 2048 + 2 * 1000 * D * row + 1000 * 2 * (1024 + 8)  # read x, pack D rows, unpack K rows
    assert r["dispatch_ms_fp8a2a"] == pytest.approx(0.02 + kb / 2e12 * 1e3 + lat_ms + wire_ms(D * row))
    kb = 1000 * 2 * 2048 + 2 * 1000 * D * crow + 1000 * 2048  # read K rows, pack D rows, write the token
    assert r["combine_ms_fp8a2a"] == pytest.approx(0.02 + kb / 2e12 * 1e3 + lat_ms + wire_ms(D * crow))
    assert r["combine_ms_megatron"] == pytest.approx(0.1 + 5 * 1000 * 2 * 2048 / 1e12 * 1e3 + lat_ms + wire_ms(4096))
    hand = (0.13 + 4 * 1000 * 2 * 1024 / 1e12 * 1e3 + (5 * 1000 * 1024 + 3 * 1000 * 2 * 1024) / 0.5e12 * 1e3
            + 2 * lat_ms + wire_ms(2 * (1024 + 8)))  # FP8 rows + scale; the scales' own collective
    assert r["dispatch_ms_hand_fp8"] == pytest.approx(hand)
    # the layer: 3 x 2 x T x K x (H x 2F + F x H) FLOPs (fwd + bwd, SwiGLU) + four all-to-alls, no overlap
    gemm = 6 * 1000 * 2 * (1024 * 1024 + 512 * 1024) / 100e12 * 1e3
    assert (r["gemm_ms_bf16"], r["gemm_ms_fp8"]) == (pytest.approx(gemm), pytest.approx(gemm / 2))
    a2a = {k: 2 * (r[f"dispatch_ms_{k}"] + r[f"combine_ms_{k}"]) for k in ("megatron", "fp8a2a")}
    assert r["a2a_ms_megatron"] == pytest.approx(a2a["megatron"]) and r["a2a_ms_fp8a2a"] == pytest.approx(a2a["fp8a2a"])
    assert r["a2a_ms_hand_fp8"] == pytest.approx(2 * (r["dispatch_ms_hand_fp8"] + r["combine_ms_megatron"]))
    bf16_layer = gemm + a2a["megatron"]
    assert r["a2a_share_bf16_layer"] == pytest.approx(a2a["megatron"] / bf16_layer)
    assert r["layer_speedup_fp8_gemm_bf16_a2a"] == pytest.approx(bf16_layer / (gemm / 2 + a2a["megatron"]))
    assert r["layer_speedup_fp8_gemm_fp8a2a"] == pytest.approx(bf16_layer / (gemm / 2 + a2a["fp8a2a"]))
    assert r["dispatch_speedup_fp8a2a"] == pytest.approx(r["dispatch_ms_megatron"] / r["dispatch_ms_fp8a2a"])


def test_model_links_and_expert_counts_across_ep_sizes():
    """Where the bytes go as EP grows: the intra-node share binds within a node, one expert per rank
    at least, and a link twice as fast halves the wire term that binds."""
    p = bench_model.Params(nvlink_gbps=400, net_gbps=50)
    rows = bench_model.project(p, bench_model.EP_SIZES)
    assert [r["ep"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert [r["inter_node_share"] for r in rows] == [(n - 8) / n for n in bench_model.EP_SIZES]
    assert [r["experts_per_rank"] for r in rows] == [32, 16, 8, 4, 2, 1, 1, 1]
    assert rows[-1]["ranks_per_token"] == pytest.approx(8.0)  # one expert per rank: every expert its own rank
    faster = bench_model.project(dataclasses.replace(p, net_gbps=100), [8, 1024])
    assert faster[0]["dispatch_ms_megatron"] == pytest.approx(rows[0]["dispatch_ms_megatron"])  # all NVLink at 8
    wire = p.tokens * rows[-1]["bytes_per_token_megatron"] * (1016 / 1024) / 50e9 * 1e3
    assert rows[-1]["dispatch_ms_megatron"] - faster[1]["dispatch_ms_megatron"] == pytest.approx(wire / 2)


def test_model_command_prints_assumptions_table_and_answer(tmp_path):
    out = tmp_path / "model.json"
    run = _bench_command("--model", "--no-measure", "--json", out)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "inputs (" in text and "NVLink 450 GB/s" in text and "network 50 GB/s" in text
    assert "answer:" in text and "1024" in text
    doc = json.loads(out.read_text())
    assert [r["ep"] for r in doc["rows"]] == list(bench_model.EP_SIZES) and "params" in doc
    run = _bench_command("--model", "--no-measure", "--ep", "8,64", "--net-gbps", "25")
    assert run.returncode == 0, run.stderr
    assert "network 25 GB/s" in run.stdout


def test_model_takes_kernel_figures_from_bench_kernels_json(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"copy_tbps": 4.0, "ops": [{"op": "dispatch_pack", "tbps": 3.0}]}))
    p = bench_model.from_kernels_json(bench_model.Params(), str(path))
    assert p.copy_tbps == 4.0 and p.fp8a2a_kernel_tbps == 3.0 and "k.json" in p.sources["fp8a2a_kernel_tbps"]


# ---- host costs from profiler events ---------------------------------------------------------

def _events(*specs):
    """(name, 'host' | 'dev' | 'note', start_us) -> costs.Event"""
    return [costs.Event(n, kind != "host", t, kind == "note") for n, kind, t in specs]


def test_costs_count_host_syncs_copies_and_kernels_before_the_marker():
    ev = _events(("aten::index_select", "host", 1), ("cudaLaunchKernel", "host", 2), ("cuLaunchKernel", "host", 3),
                 ("cudaMemcpyAsync", "host", 4), ("cudaStreamSynchronize", "host", 5),
                 ("cudaEventSynchronize", "host", 6), ("cudaEventSynchronize_v3020", "host", 7),
                 ("cudaMemcpy", "host", 8), ("cudaLaunchKernel", "host", 9),
                 (costs.MARKER, "host", 20), ("cudaDeviceSynchronize", "host", 21),  # the caller's own sync
                 ("void indexSelectKernel<>", "dev", 3), ("triton_permute", "dev", 4), ("sort_chunks", "dev", 22),
                 ("Memcpy DtoH (Device -> Pinned)", "dev", 5), ("Memcpy DtoD (Device -> Device)", "dev", 6),
                 ("Memset (Device)", "dev", 7), ("Stream Sync", "dev", 8), ("my_range", "note", 3))
    c = costs.count(ev)
    assert c["marker"] and c["syncs"] == 4  # stream + 2 event + blocking cudaMemcpy; not the final sync
    assert c["sync_calls"] == {"cudaEventSynchronize": 2, "cudaMemcpy": 1, "cudaStreamSynchronize": 1}
    assert (c["kernels"], c["copies"], c["d2h"], c["launch_calls"]) == (3, 3, 1, 3)  # device work after it counts


def test_costs_without_marker_take_off_the_final_device_sync():
    ev = _events(("cudaEventSynchronize", "host", 1), ("cudaDeviceSynchronize", "host", 2), ("k", "dev", 1))
    c = costs.count(ev)
    assert not c["marker"] and c["syncs"] == 1 and c["sync_calls"] == {"cudaEventSynchronize": 1}
    assert costs.count([])["syncs"] == 0


def test_costs_busy_time_merges_overlapping_device_work():
    ev = [costs.Event("void ns::(anonymous namespace)::pack_kernel<true, 4>(ns::Params)", True, 1, duration_us=10.0),
          costs.Event("ns::pack_kernel<false>(int)", True, 12, duration_us=5.0),
          costs.Event("ns::unpack_kernel(int)", True, 14, duration_us=2.0),  # launched early: inside 12-17
          costs.Event("ns::scan_kernel(int)", True, 16, duration_us=3.0),  # launched early: overlaps 16-17
          costs.Event("ns::empty_kernel(int)", True, 18, duration_us=0.0),
          costs.Event("Memcpy DtoH (Device -> Pageable)", True, 20, duration_us=2.0),
          costs.Event("my_range", True, 1, annotation=True, duration_us=50.0),  # a range, not work
          costs.Event("cudaLaunchKernel", False, 0, duration_us=7.0)]  # host time, not device work
    c = costs.count(ev)
    assert c["busy_us"] == 19.0  # 1-11, 12-19 and 20-22: the overlapping 14-16 and 16-17 count once
    assert c["busy_us_by_op"] == {"pack_kernel": 15.0, "unpack_kernel": 2.0, "scan_kernel": 3.0, "empty_kernel": 0.0,
                                  "Memcpy DtoH": 2.0}
    assert c["span_us"] == 21.0  # 1 to 22: busy 19, idle 11-12 and 19-20


def test_costs_gaps_name_the_kernels_and_the_host_ranges_around_them():
    ev = [costs.Event("ns::a_kernel(int)", True, 0, duration_us=10.0),
          costs.Event("ns::b_kernel(int)", True, 40, duration_us=5.0),  # 30 us idle before it
          costs.Event("ns::c_kernel(int)", True, 50, duration_us=5.0),  # 5 us idle before it
          costs.Event("MoELayer.forward", False, 0, duration_us=100.0),
          costs.Event("aten::mm", False, 35, duration_us=10.0),  # open when b starts: what the host issued
          costs.Event("cudaLaunchKernel", False, 39, duration_us=2.0),  # API calls are not ranges
          costs.Event("aten::add", False, 20, duration_us=5.0)]  # closed before b: not named
    c = costs.count(ev)
    assert c["span_us"] == 55.0 and c["busy_us"] == 20.0
    assert [(g["us"], g["before"], g["after"]) for g in c["gaps"]] == [(30.0, "a_kernel", "b_kernel"),
                                                                        (5.0, "b_kernel", "c_kernel")]
    assert c["gaps"][0]["host"] == ["aten::mm", "MoELayer.forward"]


def test_costs_idle_by_pair_sums_a_gap_that_recurs():
    """Two steps with the same 30 us gap (a -> b) and one 5 us gap (b -> a) between them: the pair's
    idle time is summed over its gaps, largest first."""
    ev = [costs.Event(f"ns::{k}_kernel(int)", True, t, duration_us=10.0)
          for k, t in (("a", 0), ("b", 40), ("a", 55), ("b", 95))]
    c = costs.count(ev)
    assert c["idle_by_pair"] == [{"us": 60.0, "gaps": 2, "before": "a_kernel", "after": "b_kernel"},
                                 {"us": 5.0, "gaps": 1, "before": "b_kernel", "after": "a_kernel"}]
    assert c["span_us"] - c["busy_us"] == 65.0


def test_costs_timing_and_spread_on_the_cpu():
    calls = []
    dev, host = costs.time_calls(lambda: calls.append(1), iters=4, warmup=2, cuda=False)
    assert len(calls) == 6 and len(dev) == len(host) == 4 and all(t >= 0 for t in host)
    assert costs.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert costs.spread([])["median"] is None
    if not torch.cuda.is_available():
        assert costs.profile_call(lambda: None) is None


# ---- the scale model's measured inputs and its error report -------------------------------------

def _dispatch_doc(fused=True, meg_4096_ms=1.8):
    def point(tokens, meg_ms, fp8_ms):
        v = {"fp8a2a": {"device_ms": {"median": fp8_ms}}, "megatron": {"device_ms": {"median": meg_ms * 1.5}},
             "megatron_fused": {"device_ms": {"median": meg_ms}} if fused else {"unavailable": "no TE"}}
        return {"name": f"ws1-{tokens}", "tokens": tokens, "hidden": 7168, "experts": 256, "topk": 8, "ws1": True,
                "variants": v}
    return {"points": [point(4096, meg_4096_ms, 0.4), point(128, 0.8, 0.2),
                       {"name": "x@EP8", "tokens": 4096, "ws1": False, "variants": {}}]}


def _alltoall_doc():
    def rec(tokens, meg, fp8, wire):
        return {"series": "deepseek-v3", "hidden": 7168, "experts": 256, "topk": 8, "granularity": "row",
                "tokens": tokens, "msg_bytes": wire, "megatron_bf16_wire_bytes": wire, "megatron_bf16_dispatch_ms": meg,
                "megatron_bf16_total_ms": 2 * meg, "fp8a2a_fp8_wire_bytes": wire / 3, "fp8a2a_fp8_dispatch_ms": fp8,
                "fp8a2a_fp8_total_ms": 2 * fp8}
    return {"meta": {"world": 2}, "records": [rec(128, 2.0, 0.6, 1e7), rec(4096, 2.0, 0.7, 4e8),
                                              dict(rec(4096, 2.0, 0.7, 4e8), granularity="block128")]}


def test_model_takes_fixed_costs_and_megatron_bandwidth_from_bench_dispatch_json(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_dispatch_doc()))
    p = bench_model.from_dispatch_json(bench_model.Params(), str(path))
    assert p.megatron_overhead_us == pytest.approx(400) and p.fp8a2a_overhead_us == pytest.approx(100)
    row, crow = bench_model._row_bytes(7168, 8)
    b = [sum(bench_model.kernel_bytes(t, 7168, 8, 1, 256, row, crow)[k] for k in ("megatron_dispatch",
                                                                                "megatron_combine")) for t in (128, 4096)]
    assert p.megatron_kernel_tbps == pytest.approx((b[1] - b[0]) / 1.0e-3 / 1e12)
    assert all(p.sources[k].startswith("measured: ") and "megatron_fused" in p.sources[k]
               for k in ("megatron_overhead_us", "megatron_kernel_tbps"))
    # 4096 tokens barely slower than 128 (host-bound): the slope, above the copy rate, is not kept
    path.write_text(json.dumps(_dispatch_doc(meg_4096_ms=0.81)))
    p = bench_model.from_dispatch_json(bench_model.Params(), str(path))
    assert p.megatron_kernel_tbps == bench_model.Params().megatron_kernel_tbps
    assert p.sources["megatron_kernel_tbps"].startswith("assumed: ") and "host-bound" in p.sources["megatron_kernel_tbps"]
    path.write_text(json.dumps(_dispatch_doc(fused=False)))  # no TE in that run: the unfused row, said so
    p = bench_model.from_dispatch_json(bench_model.Params(), str(path))
    assert p.megatron_overhead_us == pytest.approx(600) and "megatron_fused unavailable" in p.sources[
        "megatron_overhead_us"]


def test_model_link_bound_and_error_against_the_ep2_run(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_alltoall_doc()))
    link = bench_model.link_from_alltoall(_alltoall_doc())
    assert link["gbps"] == pytest.approx(4e8 / 2 / 2e-3 / 1e9) and link["variant"] == "megatron_bf16"
    assert (link["pairs"], link["grew"]) == (2, 1)  # fp8a2a grew 0.6 -> 0.7 ms, Megatron did not
    p = bench_model.Params()
    assert bench_model.from_alltoall_json(p, str(path))["gbps"] == link["gbps"]
    assert p.nvlink_gbps == 450 and p.sources["nvlink_gbps"].startswith("assumed: ")  # a bound below it
    fast = bench_model.Params(nvlink_gbps=50)
    bench_model.from_alltoall_json(fast, str(path))
    assert fast.nvlink_gbps == pytest.approx(link["gbps"]) and fast.sources["nvlink_gbps"].startswith("measured")
    rows = bench_model.check_against(p, str(path))
    assert [r["tokens"] for r in rows] == [128, 4096]  # row granularity only
    want = bench_model.project(dataclasses.replace(p, tokens=4096), [2])[0]
    r = rows[1]
    assert r["fp8a2a_predicted_ms"] == pytest.approx(want["dispatch_ms_fp8a2a"] + want["combine_ms_fp8a2a"])
    assert r["fp8a2a_error"] == pytest.approx(r["fp8a2a_predicted_ms"] / 1.4 - 1)
    assert r["megatron_error"] == pytest.approx(r["megatron_predicted_ms"] / 4.0 - 1)
    text = bench_model.format_check(rows, str(path))
    assert "EP=2" in text and "mean |error|" in text and "at the largest (deepseek-v3, 4096 tokens)" in text


def test_model_reads_the_sweeps_inference_rows_and_older_records_alike(tmp_path):
    """The model projects the forward: from a sweep's records it reads the inference rows (never the
    training step's), and records of older code, which timed the forward only, under their old keys."""
    old = _alltoall_doc()
    new = json.loads(json.dumps(old))
    for r in new["records"]:
        for v in ("megatron_bf16", "fp8a2a_fp8"):
            r[f"{v}_infer_dispatch_ms"], r[f"{v}_infer_ms"] = r.pop(f"{v}_dispatch_ms"), r.pop(f"{v}_total_ms")
            r[f"{v}_train_dispatch_ms"], r[f"{v}_train_ms"] = 1e3, 1e4  # must not be read
    assert bench_model.link_from_alltoall(new) == bench_model.link_from_alltoall(old)
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, doc in zip(paths, (old, new)):
        path.write_text(json.dumps(doc))
    p = bench_model.Params()
    assert bench_model.check_against(p, str(paths[1])) == bench_model.check_against(p, str(paths[0]))


def test_model_command_labels_every_input_and_reports_its_error(tmp_path):
    d, a = tmp_path / "d.json", tmp_path / "a.json"
    d.write_text(json.dumps(_dispatch_doc()))
    a.write_text(json.dumps(_alltoall_doc()))
    run = _bench_command("--model", "--no-measure", "--dispatch-json", d, "--alltoall-json", a, "--json",
                         tmp_path / "m.json")
    assert run.returncode == 0, run.stderr
    inputs = run.stdout.split("inputs")[1].split("\n\n")[0].splitlines()[1:]
    assert inputs and all("measured" in ln or "assumed" in ln or "no overlap" in ln for ln in inputs), inputs
    assert "PROJECTION" in run.stdout and "model check against" in run.stdout
    doc = json.loads((tmp_path / "m.json").read_text())
    assert len(doc["check"]) == 2 and doc["params"]["megatron_overhead_us"] == pytest.approx(400)


# ---- the dispatch benchmark at functional sizes (its JSON feeds the model) ----------------------

def test_bench_dispatch_functional_feeds_the_model(tmp_path):
    out = tmp_path / "d.json"
    text = _benchmark("bench_dispatch", "--cpu", "--points", "ws1-4096,ws1-128,mixtral-8x7b@EP8", "--repeat", "2",
                      "--iters", "1", "--warmup", "0", "--json", out)
    doc = json.loads(out.read_text())
    assert doc["functional_only"] and doc["repeat"] == 2 and "functional" in doc["timing"]
    assert [p["name"] for p in doc["points"]] == ["ws1-4096", "ws1-128", "mixtral-8x7b@EP8"]
    mix = doc["points"][2]
    assert (mix["experts"], mix["topk"]) == (1, 1)  # EP=8 of 8 experts, top-2: 1 local expert, twice the tokens
    assert mix["tokens"] == 2 * doc["points"][0]["tokens"]
    for p in doc["points"]:
        v = p["variants"]
        assert list(v) == ["fp8a2a_train", "megatron_fused_train", "megatron_train", "megatron_fused", "megatron",
                           "fp8a2a", "megatron_pad", "megatron_pad_graph", "fp8a2a_cap", "fp8a2a_cap_graph"]
        for name in ("fp8a2a_train", "fp8a2a", "fp8a2a_cap"):
            assert len(v[name]["device_ms"]["runs"]) == 2 and v[name]["device_ms"]["median"] > 0
        assert "training step" in v["fp8a2a_train"]["label"] and "inference" in v["fp8a2a"]["label"]
        assert v["fp8a2a_cap_graph"]["unavailable"].startswith("RuntimeError: CUDA graphs need CUDA")
        for name, rec in v.items():
            assert ("device_ms" in rec) != ("unavailable" in rec), (name, rec)
            assert f"{name:<22}unavailable: " in text if "unavailable" in rec else True
        for key, s in p["ratios"].items():
            num, den = key.split("/")
            assert s["runs"] == [a / b for a, b in zip(v[num]["device_ms"]["runs"], v[den]["device_ms"]["runs"])]
    assert doc["points"][0]["wire_ratio_8ranks"] < 0.5
    run = _bench_command("--model", "--no-measure", "--dispatch-json", out)
    assert run.returncode == 0, run.stderr
    assert f"fp8a2a_overhead_us: {doc['points'][1]['variants']['fp8a2a']['device_ms']['median'] * 500:.0f} us" \
        in run.stdout


def test_bench_dispatch_training_step_and_its_phases(tmp_path):
    """The training row is the headline, before the inference rows; the report breaks each training
    row's device time into its phases and their top kernels (from the profile a GPU run records)."""
    part = tmp_path / "train.json"
    text = _benchmark("bench_dispatch", "--cpu", "--points", "ws1-128", "--repeat", "1", "--iters", "1", "--warmup",
                      "0", "--variants", "fp8a2a_train,fp8a2a", "--json", part)
    assert "headline: the training step" in text
    assert text.index("fp8a2a_train ") < text.index("-- inference (forward only)") < text.index("\nfp8a2a ")
    doc = json.loads(part.read_text())
    row = doc["points"][0]["variants"]["fp8a2a_train"]
    assert row["device_ms"]["median"] > 0 and row["label"].endswith("training step")
    phase = {"busy_us": 100.0, "kernels": 3, "busy_us_by_op": {"a": 10.0, "b": 60.0, "c": 30.0}}
    row["costs"] = {"phases": {"forward": dict(phase, busy_us=50.0, kernels=2), "backward": phase}}
    part.write_text(json.dumps(doc))
    text = _benchmark("bench_dispatch", "--merge", part)
    assert "fp8a2a_train: forward busy 50.0 us (2 kernels), backward busy 100.0 us (3 kernels), backward / " \
           "forward 2.00" in text
    assert "  backward top kernels us: b 60.0, c 30.0, a 10.0" in text


def test_bench_dispatch_grad_rows_and_merge_refuses_a_mix(tmp_path):
    """--grad: the eager rows run a training forward (inputs requiring grad) and say so; --merge
    refuses parts of which only some ran that way."""
    parts = [tmp_path / "grad.json", tmp_path / "plain.json"]
    texts = [_benchmark("bench_dispatch", "--cpu", "--points", "ws1-128", "--repeat", "1", "--iters", "1", "--warmup",
                        "0", "--variants", "fp8a2a,fp8a2a_cap,megatron", *extra, "--json", part)
             for part, extra in zip(parts, (["--grad"], []))]
    assert "require grad" in texts[0] and "require grad" not in texts[1]
    grad = json.loads(parts[0].read_text())
    assert grad["grad"] is True and json.loads(parts[1].read_text())["grad"] is False
    for name in ("fp8a2a", "fp8a2a_cap"):
        assert grad["points"][0]["variants"][name]["device_ms"]["median"] > 0, name
    done = _run(os.path.join("benchmarks", "bench_dispatch.py"), "--merge", *parts)
    assert done.returncode != 0 and "differ in grad" in done.stderr
    graphs = tmp_path / "graphs.json"  # a part of graph rows only goes with either
    _benchmark("bench_dispatch", "--cpu", "--points", "ws1-128", "--repeat", "1", "--iters", "1", "--warmup", "0",
               "--variants", "fp8a2a_cap_graph", "--json", graphs)
    text = _benchmark("bench_dispatch", "--merge", graphs, parts[0], "--json", tmp_path / "m.json")
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["grad"] is True  # from the part with eager rows
    # the host-speed reference: one figure per process, kept through the merge and printed
    assert len(grad["host_reference_us"]) == 1 and len(merged["host_reference_us"]) == 2
    assert all(u > 0 for u in merged["host_reference_us"]) and "host speed: " in text


def test_bench_dispatch_merges_points_and_variant_groups_run_apart(tmp_path):
    """Variant groups in processes of their own (scripts/gpu_session.sh), then --merge: one document,
    points in order, each row from the run that built it."""
    assert _benchmark("bench_dispatch", "--list").split() == ["ws1-4096", "ws1-128", "deepseek-v3@EP8",
                                                             "deepseek-v3@EP32", "qwen3-235b@EP8", "mixtral-8x7b@EP8"]
    assert _benchmark("bench_dispatch", "--list-groups").split() == [
        "fp8a2a_train,megatron_fused_train,megatron_train", "megatron_fused,megatron,fp8a2a,megatron_pad,fp8a2a_cap",
        "megatron_pad_graph,fp8a2a_cap_graph"]
    parts = []
    for points, variants in (("ws1-128,mixtral-8x7b@EP8", "fp8a2a,fp8a2a_cap"), ("ws1-128", "fp8a2a_cap_graph")):
        parts.append(tmp_path / f"part{len(parts)}.json")
        _benchmark("bench_dispatch", "--cpu", "--points", points, "--repeat", "1", "--iters", "1", "--warmup", "0",
                   "--variants", variants, "--json", parts[-1])
    text = _benchmark("bench_dispatch", "--merge", *parts, "--json", tmp_path / "all.json")
    doc = json.loads((tmp_path / "all.json").read_text())
    assert [p["name"] for p in doc["points"]] == ["ws1-128", "mixtral-8x7b@EP8"]
    assert doc["merged"] == [str(p) for p in parts] and "== mixtral-8x7b@EP8" in text
    first, second = (json.loads(p.read_text())["points"] for p in parts)
    merged = doc["points"][0]["variants"]
    assert merged["fp8a2a"] == first[0]["variants"]["fp8a2a"] and merged["fp8a2a_cap"] == first[0]["variants"]["fp8a2a_cap"]
    assert merged["fp8a2a_cap_graph"] == second[0]["variants"]["fp8a2a_cap_graph"]  # unavailable on a CPU: its reason
    assert merged["megatron"]["unavailable"] == "not measured: no part built it"
    assert doc["points"][1]["variants"]["fp8a2a"] == first[1]["variants"]["fp8a2a"]


def test_bench_dispatch_merge_ratio_across_processes_and_parts_that_differ(tmp_path):
    """The two graph rows of a point from two processes: the ratio of their medians, named so; parts
    run with other settings are refused."""
    parts = []
    for variant, runs in (("fp8a2a_cap_graph", [1.0, 2.0, 3.0]), ("megatron_pad_graph", [4.0, 8.0, 9.0])):
        parts.append(tmp_path / f"{variant}.json")
        _benchmark("bench_dispatch", "--cpu", "--points", "ws1-128", "--repeat", "3", "--iters", "1", "--warmup", "0",
                   "--variants", variant, "--json", parts[-1])
        doc = json.loads(parts[-1].read_text())  # a CPU cannot replay graphs: the timings as a GPU run has them
        doc["points"][0]["variants"][variant] = {"label": variant, "device_ms": costs.spread(runs),
                                                 "host_ms": costs.spread(runs)}
        parts[-1].write_text(json.dumps(doc))
    _benchmark("bench_dispatch", "--merge", *parts, "--json", tmp_path / "m.json")
    ratios = json.loads((tmp_path / "m.json").read_text())["points"][0]["ratios"]
    assert ratios == {"fp8a2a_cap_graph/megatron_pad_graph (medians of two processes)":
                      {"median": 0.25, "min": 0.25, "max": 0.25, "runs": [0.25]}}
    doc["repeat"] = 1
    parts[-1].write_text(json.dumps(doc))
    done = _run(os.path.join("benchmarks", "bench_dispatch.py"), "--merge", *parts)
    assert done.returncode != 0 and "differ in repeat" in done.stderr


# ---- the kernel and MoE-layer benchmarks at functional sizes -------------------------------

def test_bench_kernels_functional(tmp_path):
    out = tmp_path / "k.json"
    text = _benchmark("bench_kernels", "--tokens", "64", "--hidden", "256", "--host-tokens", "16", "--host-hidden",
                      "256", "--iters", "2", "--host-calls", "2", "--experts", "16", "--ranks", "4", "--json", out,
                      "--cpu")
    doc = json.loads(out.read_text())
    assert doc["functional_only"] is True and doc["copy_tbps"] > 0
    names = [r["op"] for r in doc["ops"]]
    assert names == ["quantize_row", "quantize_block128", "dispatch_pack", "dispatch_unpack", "combine_pack",
                     "combine_unpack", "dequantize", "weight_quant_row", "weight_quant_row_t"]
    wq = {r["op"]: r["bytes"] for r in doc["ops"] if r["op"].startswith("weight")}
    fc1, fc2 = 8 * 146 * 256, 8 * 256 * 73  # 8 experts, F = 2 * 256 // 7
    assert wq["weight_quant_row_t"] - wq["weight_quant_row"] == fc1 + fc2  # one more FP8 copy, the same scales
    for r in doc["ops"]:
        assert r["ms"] > 0 and r["eager_ms"] > 0 and r["host_us"] > 0 and r["frac_of_copy"] > 0, r
    assert set(doc["targets"]) == {"dispatch_pack_frac_of_copy", "dispatch_pack_host_us",
                                   "dispatch_pack_host_vs_eager_quantize", "weight_quant_frac_of_copy"}
    assert "FUNCTIONAL" in text and "dispatch_pack" in text and "x copy" in text


def test_bench_moe_layer_functional(tmp_path):
    out = tmp_path / "m.json"
    text = _benchmark("bench_moe_layer", "--shapes", "deepseek", "--iters", "1", "--warmup", "0", "--json", out,
                      "--cpu")
    doc = json.loads(out.read_text())
    rec = doc["shapes"]["deepseek-v3-tiny"]
    assert rec["fp8"]["fwd_bwd_ms"] > 0 and rec["replica_bf16"]["fwd_bwd_ms"] > 0
    assert rec["fp8_bwd"]["fwd_bwd_ms"] > 0 and rec["speedup_fwd_bwd_fp8_bwd"] > 0  # fp8_dgrad + fp8_wgrad
    assert doc["target"]["path"] in ("fp8", "fp8_dgrad", "fp8_bwd") and doc["target"]["default_value"] > 0
    assert rec["rel_err_vs_bf16"] < 0.15  # FP8 rows + FP8 weights against the BF16 path
    assert doc["graphs"]["available"] is False and "not available" in doc["graphs"]["why"]
    assert "target" in text


def test_kernel_classes_split_a_step():
    """costs.by_class: every kernel of a layer's step in one class (the first that matches), all
    classes present in order, the total kept."""
    by_op = {"nvjet_tst_128x256_64x4": 100.0, "device_kernel": 50.0, "_grouped_mm_fp8_kernel": 30.0,
             "_grouped_wgrad_fp8_kernel": 20.0, "sm90_xmma_gemm_e4m3bf16": 10.0, "block_col_quant_t_kernel": 5.0,
             "cast_transpose_kernel": 7.0, "dequantize": 1.0, "_permute_kernel": 9.0, "combine_pack": 4.0,
             "_sort_chunks_by_map_kernel": 2.0, "_act_fwd_kernel": 3.0, "Memcpy DtoH": 1.0,
             "ncclDevKernel_SendRecv": 2.0, "elementwise_kernel": 11.0}
    got = costs.by_class(by_op)
    assert list(got) == ["copy", "nccl", "GEMM", "quantize", "permute", "activation", "other"]
    assert got == {"copy": 1.0, "nccl": 2.0, "GEMM": 210.0, "quantize": 13.0, "permute": 15.0, "activation": 3.0,
                   "other": 11.0}
    assert sum(got.values()) == sum(by_op.values())
