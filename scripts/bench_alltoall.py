#!/usr/bin/env python
"""The multi-node all-to-all benchmark: a thin wrapper over `python -m fp8a2a.bench`.

    python scripts/bench_alltoall.py                     # 1 GPU, or 4 gloo ranks on the CPU
    torchrun --nnodes N --nproc-per-node 8 scripts/bench_alltoall.py --json out.json
    python scripts/bench_alltoall.py --model             # scale model, EP 8..1024
See `python -m fp8a2a.bench --help`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8a2a.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
