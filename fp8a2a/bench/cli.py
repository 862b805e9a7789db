"""`python -m fp8a2a.bench`: the command line, and where the sweep runs (torchrun, one GPU, or
gloo ranks on the CPU). Nothing imports this module but __main__."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from . import __doc__ as DOC
from . import model
from .launch import run_cpu_ranks
from .report import report
from .sweep import SweepArgs, run_sweep
from ..wire import QUANTIZED


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fp8a2a.bench", description=DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=model.ints, help="tokens per rank, comma-separated (default: 128..16384 on GPU)")
    p.add_argument("--hidden", type=model.ints, help="hidden sizes (with --experts/--topk/--granularity: a "
                                                    "cartesian sweep instead of the embedded model series)")
    p.add_argument("--experts", type=model.ints)
    p.add_argument("--topk", type=model.ints)
    p.add_argument("--granularity", type=lambda s: [v for v in s.split(",") if v])
    p.add_argument("--iters", type=int, help="timed iterations per point (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--world", type=int, default=4, help="CPU ranks to spawn when not under torchrun (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="output folder (default bench_out/)")
    p.add_argument("--json", help="JSON output path (the CSV and PNG go beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="skip counting kernels and host syncs")
    p.add_argument("--profile-all", action="store_true", help="count launches at every point (default: the "
                                                              "smallest and largest tokens of each series)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--model", action="store_true", help="project dispatch time for EP 8..1024 instead of sweeping")
    model.add_arguments(p)
    args = p.parse_args(argv)
    if args.granularity:
        bad = [g for g in args.granularity if g not in {q.label for q in QUANTIZED}]
        if bad:
            p.error(f"unknown granularity {bad}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.model:
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        model.run(args)
        return 0
    sweep = SweepArgs.from_namespace(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            records, meta = run_sweep(rank, world, sweep)
            if rank == 0:
                report(records, meta, args)
        finally:
            dist.destroy_process_group()
        return 0
    if torch.cuda.is_available():  # one GPU, no process group: world size 1
        records, meta = run_sweep(0, 1, sweep)
        report(records, meta, args)
        return 0
    print(f"fp8a2a.bench: no GPU; running {args.world} gloo ranks on the CPU (functional numbers only)",
          file=sys.stderr)
    records, meta = run_cpu_ranks(args.world, run_sweep, sweep)
    report(records, meta, args)
    return 0
