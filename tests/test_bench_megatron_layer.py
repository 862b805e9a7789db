"""benchmarks/bench_megatron_layer.py runs (CPU functional mode, as a subprocess) and writes its table as JSON."""
import json
import os

import pytest

from .programs import run

pytest.importorskip("megatron.core")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_bench_megatron_layer_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = run(os.path.join(ROOT, "benchmarks", "bench_megatron_layer.py"), "--cpu", "--iters", "2", "--big-iters", "1",
            "--warmup", "1", "--repeat", "2", "--profile", "--json", out, timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and [s["experts"] for s in res["shapes"]] == [4, 16]
    table, big = (s["rows"] for s in res["shapes"])
    assert set(table) == {"fp8_alltoall row + SequentialMLP", "fp8_alltoall + fp8_experts_spec",
                          "fp8_alltoall + fp8_experts_spec fp8_dgrad", "fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad",
                          "fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad, torch._scaled_mm loop + six-op routing"}
    assert len(big) == 6
    for rows in (table, big):
        for name, row in rows.items():
            assert "error" not in row, (name, row)
            assert len(row["run_medians_ms"]) == 2 and row["runs_min_ms"] <= row["fwd_bwd_ms"] <= row["runs_max_ms"]
            assert set(row["step_ms"]) == {"1", "8", "32"} and row["refresh_ms"] >= 0
            if "ratio" in row:
                assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
            if rows is big:  # no bursts at 256 experts (their host work would differ between the rows)
                assert "back_to_back_ms" not in row and "back_to_back_ratio" not in row
                continue
            bursts = row["back_to_back_run_medians_ms"]  # the back-to-back bursts: one median per run
            assert len(bursts) == 2 and min(bursts) <= row["back_to_back_ms"] <= max(bursts) and min(bursts) > 0
            assert ("ratio" in row) == ("back_to_back_ratio" in row)
            if "ratio" in row:
                assert row["back_to_back_ratio_min"] <= row["back_to_back_ratio"] <= row["back_to_back_ratio_max"]
    for name, row in big.items():  # fp8_experts_spec against FP8GroupedMLP with the same options
        assert (row.get("ratio_vs") or "").startswith("FP8GroupedMLP") == name.startswith("fp8_alltoall"), name
    assert table["fp8_alltoall row + SequentialMLP"]["refresh_ms"] == 0  # nothing cached: BF16 experts
    assert not any("profile" in row for rows in (table, big) for row in rows.values())  # --profile: CUDA only
    assert "fp8_alltoall + fp8_experts_spec" in r.stdout  # the table


def test_format_table_reads_a_gpu_run():
    """The table of a GPU run (results/megatron_layer_h100_1d62e26.json, with --profile) formats again
    from its JSON: each profiled row's back-to-back burst (idle per step, the recurring gaps) and the
    first micro-batch's extra kernel time, the profile fields only a CUDA run writes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_megatron_layer",
                                                  os.path.join(ROOT, "benchmarks", "bench_megatron_layer.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with open(os.path.join(ROOT, "results", "megatron_layer_h100_1d62e26.json")) as f:
        res = json.load(f)
    text = bench.format_table(res)
    row = res["shapes"][0]["rows"]["fp8_alltoall + fp8_experts_spec fp8_dgrad+wgrad"]["profile"]
    b = row["burst"]
    assert b["steps"] == 4 and b["busy_ms"] < b["span_ms"] and b["idle_by_pair"]
    assert f"4 steps back to back: span {b['span_ms']:.2f} ms, busy {b['busy_ms']:.2f}" in text
    assert f"idle {(b['span_ms'] - b['busy_ms']) / 4:.2f} ms per step" in text
    assert f"its kernels {row['first_extra_kernel_ms']:+.2f} ms" in text
    assert text.count("steps back to back: span") == sum(
        "burst" in (r.get("profile") or {}) for s in res["shapes"] for r in s["rows"].values())
