"""Multi-rank tests run on forked gloo ranks through the benchmark's own launcher (one launcher
in the project): run_ranks(world, fn, *args) -> every rank's fn(rank, world, *args)."""
from fp8a2a.bench import spawn_gloo as run_ranks  # noqa: F401
