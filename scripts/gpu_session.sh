#!/usr/bin/env bash
# Everything that needs the GPU: build, GPU tests, benchmarks.
#   bash scripts/gpu_session.sh tests     (build, tests/gpu and the CUDA cases of tests/, Megatron on the GPU)
#   bash scripts/gpu_session.sh bench     (every benchmark; REPEAT=3 runs each three times)
#   bash scripts/gpu_session.sh kernels   (benchmarks/bench_kernels.py only, REPEAT times)
#   bash scripts/gpu_session.sh layer     (benchmarks/bench_megatron_layer.py: Megatron's MoELayer under TE recipes)
#   bash scripts/gpu_session.sh dispatch  (benchmarks/bench_dispatch.py: dispatch + combine against Megatron)
#   bash scripts/gpu_session.sh small     (benchmarks/bench_small_model.py: a small GPT-MoE, eager and graphed)
#   bash scripts/gpu_session.sh model     (the scale model from this session's kernel and dispatch JSON)
#   bash scripts/gpu_session.sh training  (Megatron's own training loop: tests/gpu/test_megatron_training.py, then
#                                          benchmarks/bench_megatron_training.py: TRAINING_RUNS (default 3) rounds of
#                                          TRAINING_CONFIGS (default all six), TRAINING_ITERS measured iterations
#                                          (default 50) after 10 of warm-up; TRAINING_ARGS adds Megatron flags; the
#                                          script is .mlm/pretrain_gpt.py when carried, else the test's mock one, or
#                                          TRAINING_SCRIPT; SKIP=megatron_training_test runs the benchmark alone.
#                                          18 runs of ~50 s do not fit one call: the runs are kept in TRAINING_STATE
#                                          (default .training_runs, ignored) and the same command in the next call
#                                          on a warm machine continues them (--resume; the test runs only in the
#                                          call that starts them); each call copies the JSON, the table over all
#                                          runs so far and the run logs to its results. Other settings than the
#                                          kept runs' are refused: TRAINING_FRESH=1 drops the kept runs first)
#   bash scripts/gpu_session.sh multi     (several GPUs: the NCCL suite and the all-to-all sweep on all of them)
#   bash scripts/gpu_session.sh conv      (examples/convergence_megatron.py: seeds $CONV_SEEDS (default "1 2") at
#                                          once, CONV_JOBS processes each, CONV_STEPS steps; on a machine of several
#                                          GPUs they run on the last GPU beside the other modes; merge with --merge.
#                                          A seed as SEED:ARMS runs those arms only ("3:B,C 4:B,C,D,E"); CONV_ARGS
#                                          adds flags (e.g. "--batch 32"), CONV_TAG suffixes the output dirs;
#                                          CONV_CKPT=.conv_ckpt saves the runs the deadline cuts there, per seed,
#                                          and the same command in the next call continues them: runs longer
#                                          than one call, over calls on a warm machine)
#   bash scripts/gpu_session.sh branch    (examples/branched_ab.py: a BF16 trunk, every arm branched from its checkpoints
#                                          and the gradient error at each, in 1 + BRANCH_WORKERS (default 10) processes
#                                          under MPS (MPS=0: time slices); BRANCH_CKPT (default .branch_ckpt) keeps the
#                                          trunk's checkpoints and the finished branches, so the same command in the next
#                                          call continues a cut run; BRANCH_ARGS adds flags (e.g. "--eval-seqs 0"))
#   modes combine: bash scripts/gpu_session.sh tests,kernels
# One device call may take 600 s (BUDGET_S caps this script, default 570).
# EXTRA="commands" runs them last, in the same environment (LOGS=the packed folder).
# SKIP="name ..." leaves those steps out; LAYER_ARGS / DISPATCH_ARGS pass extra flags (e.g. fewer shapes). Logs, JSON, CSV and plots are packed into one file, $OUT/gpu_results.tgz (the
# device tool brings back at most 8 files), default OUT=./gpu_out.
# A machine without internet takes megatron-core (the 0.19.2 cp312 wheel) from .whl/ and TransformerEngine from the
# bundle in .te/ (../shared/tools/te/README.md) when present; without them the Megatron and TE parts skip themselves.
# Each step has its own time limit so one slow step cannot eat the call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
LOGS=$(mktemp -d)/gpu_results
mkdir -p "$OUT" "$LOGS"
export LOGS
stop_mps() {  # conv's MPS daemon, if it started one (the later steps then run without MPS)
  [[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 0
}
trap 'stop_mps; tar czf "$OUT/gpu_results.tgz" -C "$(dirname "$LOGS")" gpu_results' EXIT
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if [[ -f .te/restore.sh ]]; then  # TransformerEngine 2.20.2 for sm_90 (import torch before transformer_engine)
  INSTALL=target TARGET=/tmp/site SMOKE=0 bash .te/restore.sh .te > /tmp/te_restore.log 2>&1 \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "TE restore failed:"; tail -5 /tmp/te_restore.log; }
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# One device command may run 600 s: every step also stops at the overall deadline.
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
step() {  # step NAME SECONDS COMMAND...: run, log to $LOGS/NAME.log, print the tail
  local name=$1 limit=$2; shift 2
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "=== $name: skipped (SKIP)"; return 0; }
  local left=$((DEADLINE - SECONDS))
  (( left < limit )) && limit=$left
  (( limit < 10 )) && { echo "=== $name: skipped, out of time"; return 1; }
  echo "=== $name"
  local t0=$SECONDS rc
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "--- $name: exit $rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$LOGS/$name.log"
  (( rc == 0 )) || FAILED+=" $name"
  return $rc
}
FAILED=
# pip install -e would try to fetch setuptools there (no network): build in place instead
# (a warm machine keeps the build: setup.py rebuilds only what changed).
step build 300 python3 setup.py build_ext --inplace || exit 1
python3 -c "import torch, fp8a2a.ops; print(torch.__version__, torch.cuda.get_device_name())"
mode=,${1:-tests,bench},
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
start_mps() {  # the processes share the GPU through MPS instead of time slices;
  # a private pipe directory keeps the other steps' processes off it; the EXIT trap stops it
  export CUDA_MPS_PIPE_DIRECTORY=$LOGS/../mps_pipe CUDA_MPS_LOG_DIRECTORY=$LOGS/../mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then echo "MPS daemon started"
  else echo "MPS: no daemon (nvidia-cuda-mps-control missing or failed): time slices"; fi
}
branch() {  # examples/branched_ab.py: trunk, branches, evaluations and gradients in one budget, then the tables
  local budget=$((DEADLINE - SECONDS - 30)) rc
  (( budget < 120 )) && { echo "=== branch: skipped, out of time"; return 1; }
  echo "=== branch: time budget $budget s, state ${BRANCH_CKPT:-.branch_ckpt}"
  [[ ${MPS:-1} == 1 ]] && start_mps
  # shellcheck disable=SC2086  # BRANCH_ARGS: flags, split on purpose
  timeout $((budget + 20)) python3 examples/branched_ab.py --state-dir "${BRANCH_CKPT:-.branch_ckpt}" \
    --workers "${BRANCH_WORKERS:-10}" --threads 1 --time-budget "$budget" --out "$LOGS/branch" ${BRANCH_ARGS:-} \
    > "$LOGS/branch.log" 2>&1
  rc=$?
  stop_mps
  echo "--- branch: exit $rc"
  grep -v -i warn "$LOGS/branch.log" | tail -n 60
  return $rc
}
conv() {  # issue 20: examples/convergence_megatron.py, the seeds at once, each seed's arms in processes of their own
  local budget=$((DEADLINE - SECONDS - 60)) pids=() rc=0 seed
  (( budget < 120 )) && { echo "=== convergence: skipped, out of time"; return 1; }
  local twice  # one output directory per seed: one entry per seed, with all its arms
  twice=$(printf '%s\n' "${CONV_SEEDS_A[@]%%:*}" | sort | uniq -d | tr '\n' ' ')
  [[ -n $twice ]] && { echo "=== convergence: seeds ${twice}given twice in CONV_SEEDS"; return 1; }
  echo "=== convergence: seeds ${CONV_SEEDS_A[*]}, ${CONV_STEPS:-3000} steps, time budget $budget s"
  [[ ${MPS:-0} == 1 ]] && start_mps
  local entry arms dirs=()
  for entry in "${CONV_SEEDS_A[@]}"; do  # arms that do not fit the budget are skipped or truncated, and say so
    seed=${entry%%:*} arms=()
    [[ $entry == *:* ]] && arms=(--arms "${entry#*:}")
    local out=$LOGS/conv_seed$seed${CONV_TAG:-}
    dirs+=("$out")
    local ckpt=()  # CONV_CKPT: an ignored folder of the repo, kept while the machine stays warm
    [[ -n ${CONV_CKPT:-} ]] && ckpt=(--checkpoint-dir "$CONV_CKPT/seed$seed${CONV_TAG:-}")
    # shellcheck disable=SC2086  # CONV_ARGS: flags, split on purpose
    timeout $((budget + 45)) python3 examples/convergence_megatron.py --seed "$seed" "${arms[@]}" "${ckpt[@]}" \
      --jobs "${CONV_JOBS:-6}" --steps "${CONV_STEPS:-3000}" --time-budget "$budget" --no-plot --out "$out" \
      ${CONV_ARGS:-} > "$out.log" 2>&1 & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  stop_mps
  for out in "${dirs[@]}"; do tail -n 10 "$out/summary.txt" 2>/dev/null; done
  return $rc
}
read -ra CONV_SEEDS_A <<< "${CONV_SEEDS:-1 2}"
if [[ $mode == *,multi,* ]] && (( NGPU > 1 )); then
  step dispatch_nccl 180 torchrun --standalone --nproc-per-node "$NGPU" -m pytest -q tests/gpu/test_dispatch_nccl.py
  step bench_multi 600 torchrun --standalone --nproc-per-node "$NGPU" -m fp8a2a.bench --quiet \
    --json "$LOGS/multi/alltoall_ep$NGPU.json"
fi
[[ $mode == *,branch,* ]] && { branch || FAILED+=" branch"; }
conv_pid=
if [[ $mode == *,conv,* ]]; then
  if (( NGPU > 1 )); then (export CUDA_VISIBLE_DEVICES=$((NGPU - 1)); conv) & conv_pid=$!
  else conv || FAILED+=" convergence"; fi
fi
REPEAT=${REPEAT:-1}
if [[ $mode == *,tests,* ]]; then
  # tests/gpu: the CUDA ops against the CPU twins byte for byte, dispatch at world size 1, Megatron + TE
  step pytest_gpu 300 python3 -m pytest -q -rs ${PYTEST_GPU:-tests/gpu} -m gpu  # PYTEST_GPU: a subset
  # the CUDA cases of the CPU test files
  step pytest_cuda_cases 240 python3 -m pytest -q tests/test_ops.py tests/test_experts.py tests/test_dispatch.py \
    -k "cuda or gpu or CUDA or single_process"
  step train_moe_megatron 120 python3 examples/train_moe_megatron.py --steps 200 --fp8-experts
fi
if [[ $mode == *,kernels,* || $mode == *,bench,* ]]; then
  for i in $(seq "$REPEAT"); do
    step "bench_kernels_$i" 90 python3 benchmarks/bench_kernels.py --json "$LOGS/kernels_$i.json"
  done
fi
has() { [[ $mode == *,$1,* || $mode == *,bench,* ]]; }  # a mode given, or `bench` (every benchmark)
has layer && step bench_megatron_layer 450 python3 benchmarks/bench_megatron_layer.py --repeat "$REPEAT" \
  --json "$LOGS/megatron_layer.json" ${LAYER_ARGS:-}
if has dispatch; then  # the variant groups in processes of their own (bench_dispatch.py VARIANT_GROUPS), then --merge
  parts=() groups=$(python3 benchmarks/bench_dispatch.py --list-groups)
  [[ -n $groups ]] || { echo "=== bench_dispatch: no variant groups"; FAILED+=" bench_dispatch"; }
  for variants in $groups; do  # every point in one process
    part="dispatch_${variants%%,*}"
    step "bench_$part" 180 python3 benchmarks/bench_dispatch.py --variants "$variants" --repeat "$REPEAT" \
      --json "$LOGS/$part.json" ${DISPATCH_ARGS:-}
    [[ -f $LOGS/$part.json ]] && parts+=("$LOGS/$part.json")  # also a part that failed after writing its rows
  done
  (( ${#parts[@]} )) && step bench_dispatch 30 python3 benchmarks/bench_dispatch.py --merge "${parts[@]}" \
    --json "$LOGS/dispatch.json"
fi
if [[ $mode == *,training,* ]]; then
  tstate=${TRAINING_STATE:-.training_runs}  # an ignored folder of the repo, kept while the machine stays warm
  [[ ${TRAINING_FRESH:-0} == 1 ]] && rm -rf "$tstate"
  mkdir -p "$tstate"
  if [[ -f $tstate/megatron_training.json ]]; then  # a continuing call spends its time on the runs
    echo "=== megatron_training_test: skipped, continuing the runs in $tstate (TRAINING_FRESH=1 starts over)"
  else
    step megatron_training_test 200 python3 -m pytest -q -rs tests/gpu/test_megatron_training.py -m gpu
  fi
  targs=(--resume --runs "${TRAINING_RUNS:-3}" --iters "${TRAINING_ITERS:-50}" --json "$tstate/megatron_training.json"
         --md "$tstate/megatron_training.md" --time-budget $((DEADLINE - SECONDS - 15)))
  [[ -n ${TRAINING_CONFIGS:-} ]] && targs+=(--configs "$TRAINING_CONFIGS")
  [[ -n ${TRAINING_ARGS:-} ]] && targs+=("--args=$TRAINING_ARGS")
  [[ -n ${TRAINING_SCRIPT:-} ]] && targs+=(--script "$TRAINING_SCRIPT")
  TAIL=30 step bench_megatron_training $((DEADLINE - SECONDS - 5)) python3 benchmarks/bench_megatron_training.py \
    "${targs[@]}"
  # this call's view of all the runs so far (the logs of the earlier calls' runs too)
  for f in megatron_training.json megatron_training.md megatron_training_logs; do
    [[ -e $tstate/$f ]] && cp -r "$tstate/$f" "$LOGS/"
  done
fi
has small && step bench_small_model 150 python3 benchmarks/bench_small_model.py --json "$LOGS/small_model.json"
if has model; then
  # this session's measurements where they exist (the scale model says which inputs it measured)
  margs=(--alltoall-json results/alltoall_ep2.json --json "$LOGS/model.json")
  [[ -f $LOGS/kernels_1.json ]] && margs+=(--kernels-json "$LOGS/kernels_1.json")
  [[ -f $LOGS/dispatch.json ]] && margs+=(--dispatch-json "$LOGS/dispatch.json")
  step bench_model 60 python3 -m fp8a2a.bench --model "${margs[@]}"
fi
if [[ $mode == *,bench,* ]]; then
  for i in $(seq "$REPEAT"); do
    step "bench_experts_$i" 180 python3 benchmarks/bench_experts.py --json "$LOGS/experts_$i.json"
    step "bench_moe_layer_$i" 240 python3 benchmarks/bench_moe_layer.py --json "$LOGS/moe_layer_$i.json"
  done
  step bench_alltoall 600 python3 -m fp8a2a.bench --json "$LOGS/alltoall.json"
fi
# EXTRA="cmd; cmd": one-off commands in this environment (TE, megatron-core, the build), logged as step `extra`
[[ -n ${EXTRA:-} ]] && step extra "${EXTRA_S:-300}" bash -c "$EXTRA"
[[ -n $conv_pid ]] && { wait "$conv_pid" || FAILED+=" convergence"; }
[[ -z $FAILED ]] || { echo "=== failed:$FAILED"; exit 1; }
