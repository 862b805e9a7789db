"""The `gpu` marker: tests that need a CUDA device. They are skipped, with the reason, where torch
sees none, so `python -m pytest tests` passes on a CPU machine; `python -m pytest tests/gpu -m gpu`
runs them on the GPU machine (the module docstrings under tests/gpu give each file's command)."""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the GPU machine)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a gpu test: run it on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line with the skipped tests counted by reason (under -q pytest gives only their number)."""
    reasons = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_line("skipped: " + "; ".join(
            f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
