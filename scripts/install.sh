#!/usr/bin/env bash
# Installs fp8a2a and what it needs into the current Python, with what the benchmark's own output
# needs (numpy for torch, matplotlib for its plot). `--test` adds the test dependencies.
# Keeps an existing torch (e.g. a CUDA build); otherwise installs the pinned CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP packaging ninja numpy matplotlib
if [[ "${1:-}" == "--test" ]]; then
  $PIP pytest
  # Megatron-core for the adapter tests; --no-deps so it can never pull another torch or TE.
  python -c "import megatron.core" 2>/dev/null || $PIP --no-deps megatron-core==0.16.1
fi
$PIP --no-build-isolation -e .
python -c "import fp8a2a, fp8a2a.ops; print('fp8a2a', fp8a2a.__version__, 'ready')"
