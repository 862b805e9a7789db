#!/usr/bin/env bash
# Installs fp8a2a and what it needs into the current Python, with what the benchmark's own output
# needs (numpy for torch, matplotlib for its plot). `--test` adds the test dependencies.
# Keeps an existing torch (e.g. a CUDA build); otherwise installs the pinned CPU wheel.
# The extension's objects are kept in build/: a second run compiles only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
python -c "import torch" 2>/dev/null || { echo "fp8a2a: installing torch (CPU)"; $PIP torch==2.13.0; }
$PIP "setuptools>=64" wheel packaging ninja numpy matplotlib  # the build's tools, the plot's
if [[ "${1:-}" == "--test" ]]; then
  $PIP pytest
  # Megatron-core for the adapter tests; --no-deps so it can never pull another torch or TE.
  python -c "import megatron.core" 2>/dev/null || $PIP --no-deps megatron-core==0.16.1
fi

# The build: pip's own output goes to build/install.log; shown are ninja's files and a line every 30 s.
mkdir -p build
echo "fp8a2a: building the extension (the first build takes a few minutes on 2 cores; log: build/install.log)"
start=$SECONDS
( while sleep 30; do echo "  still building ($((SECONDS - start)) s)"; done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
set +e
python -m pip install -v --disable-pip-version-check --no-build-isolation -e . 2>&1 | tee build/install.log |
  awk '/^ *\[[0-9]+\/[0-9]+\] / { n = split($0, w, " "); src = ""
                                   for (i = 1; i < n; i++) if (w[i] == "-c" && w[i + 1] !~ /^-/) src = w[i + 1]
                                   sub(".*/csrc/", "csrc/", src); print "  " w[1] " compiled " src; fflush() }
       /ninja: no work to do/ { print "  nothing to compile: the extension is up to date"; fflush() }'
status=${PIPESTATUS[0]}
set -e
kill $ticker 2>/dev/null
echo "fp8a2a: build done in $((SECONDS - start)) s"
if [[ $status != 0 ]]; then
  echo "fp8a2a: the build failed; the end of build/install.log:" >&2
  tail -n 40 build/install.log >&2
  exit "$status"
fi
python -c "import fp8a2a, fp8a2a.ops; print('fp8a2a', fp8a2a.__version__, 'ready')"
