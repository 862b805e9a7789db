"""The all-to-all benchmark: is FP8 dispatch worth it on this cluster?

    python -m fp8a2a.bench                              # 1 GPU, or 4 gloo ranks on the CPU
    torchrun --nnodes N --nproc-per-node 8 -m fp8a2a.bench [--json out.json]
    python -m fp8a2a.bench --model                      # scale model, EP 8..1024 (no sweep)

For each point of the sweep (tokens per rank x hidden x experts x top-k x granularity) it times,
in the same run and in alternating order, three ways of moving the tokens, each as a training step
(the headline: dispatch + combine forward and backward, x and the router weights requiring grad)
and as inference (dispatch + combine forward only, nothing requiring grad):

  megatron       the BF16 baseline as megatron-core's `alltoall` dispatcher does it (unfused
                 path, no TP, dropless): count all-gather, host sync, permute (one copy per
                 expert), all_to_all_single of tokens and of probs, sort_chunks_by_idxs; combine:
                 sort back, all_to_all_single, unpermute (scatter_add).
  fp8a2a-bf16    fp8a2a.Dispatcher with the BF16 wire (what `bf16_below_bytes` falls back to):
                 one row per token and destination rank, one all_to_all_single.
  fp8a2a-fp8     fp8a2a.Dispatcher forced to FP8 (bf16_below_bytes=0).

Experts are the identity. Training step: the same inputs on every side (each its own leaves), the
router weights applied where each side applies them (Megatron's experts multiply each row by its
prob; fp8a2a's combine applies them to the dequantized rows), then y.backward(dy) with one fixed dy;
the gradients are reset before each step, outside the timed region, and the backward is inside it.
Inference: a tensor of the dispatched rows' shape goes to combine, the router weights left to the
experts on both sides, as Megatron does. Every call runs between the same rank alignment and device
sync. It reports median and p10/p90 time (per iteration, the slowest rank) of each call and its
phases (dispatch, combine, and the training step's backward), algorithm and bus bandwidth as
nccl-tests defines them for alltoall (algbw = bytes a rank sends / dispatch time, busbw = algbw *
(n-1)/n), the exact wire bytes of the forward, the speedups, host time per call, and per call the
kernels and host syncs (CUDA, torch.profiler events: fp8a2a.bench.costs). It writes a table (the
training step, with inference's speedup in one column), JSON, CSV and a PNG of speedup against
message size, finds the crossover below which fp8a2a-bf16 wins and recommends `bf16_below_bytes`
(for the training step; inference's apart). Without a GPU the numbers are functional only. (In the
JSON and CSV the variants are megatron_bf16, fp8a2a_bf16 and fp8a2a_fp8, the modes train and infer:
fp8a2a_fp8_train_ms, fp8a2a_fp8_infer_dispatch_ms, ...; see fp8a2a.bench.report.)
"""
# The parts, imported one way (nothing imports cli):
#   cli       the command line (__main__ runs it): the sweep, or --model
#   sweep     what every rank runs, one record per point -> baseline, report
#   baseline  the Megatron-style BF16 dispatcher and the routing both sides get
#   report    statistics, crossover, recommendation; table, JSON, CSV, PNG
#   model     the scale model (--model) -> baseline
#   costs     host syncs, launches, copies from profiler events; back-to-back timing
#   timing    CUDA-event medians, CUDA-graph capture
#   launch    the sweep's gloo ranks on a CPU machine

# The benchmark API: what benchmarks/*.py (and the GPU tests) build on, so that the sweep and the
# single-GPU benchmarks time, count and compare alike. Everything else in this package is the CLI's.
from .baseline import MegatronStyleAlltoAll, make_routing  # the BF16 baseline; uniform routing
from .costs import TIMING, host_reference_us, profile_call, spread, time_calls, top_ops  # counts and timing
from .launch import single_process_group  # a world-size-1 process group (no port)
from .report import percentile
from .timing import capture_cuda_graph, cuda_median_ms

__all__ = ["MegatronStyleAlltoAll", "make_routing", "TIMING", "host_reference_us", "profile_call", "spread",
           "time_calls", "top_ops", "percentile", "capture_cuda_graph", "cuda_median_ms", "single_process_group"]
