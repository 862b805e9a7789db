"""benchmarks/profile_layer_host.py's trace analysis: the device-idle time each host frame covers."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import profile_layer_host as plh  # noqa: E402


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_idle_by_frame_splits_each_idle_stretch_among_the_innermost_frames():
    """Device busy [0, 10] and [20, 30] (two kernels overlapping in the first), idle [10, 20]; on the
    host, step [0, 30] holds a [5, 14] and b [14, 25] with b's child c [16, 18]: the idle stretch is
    4 us in a, 4 in b itself, 2 in c; inclusive, step covers all 10. Another thread's frame over
    the stretch counts for that frame too."""
    events = [_x("k1", "kernel", 0, 8), _x("k2", "kernel", 2, 8), _x("k3", "kernel", 20, 10),
              _x("step", "python_function", 0, 30), _x("a", "cpu_op", 5, 9), _x("b", "cpu_op", 14, 11),
              _x("c", "cuda_runtime", 16, 2), _x("other", "cpu_op", 11, 2, tid=2),
              {"ph": "i", "name": "marker", "ts": 12}]
    span, idle, self_us, incl_us = plh.idle_by_frame(events)
    assert (span, idle) == (30, 10)
    assert self_us == pytest.approx({"step": 0, "a": 4, "b": 4, "c": 2, "other": 2})
    assert incl_us == pytest.approx({"step": 10, "a": 4, "b": 6, "c": 2, "other": 2})


def test_idle_by_frame_counts_a_recursive_frame_once():
    events = [_x("k1", "kernel", 0, 1), _x("k2", "kernel", 9, 1),
              _x("f", "python_function", 0, 10), _x("f", "python_function", 2, 6)]
    _, idle, self_us, incl_us = plh.idle_by_frame(events)
    assert idle == 8 and incl_us == {"f": 8} and self_us == pytest.approx({"f": 8})
