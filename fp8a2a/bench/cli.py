"""`python -m fp8a2a.bench`: the command line, and where the sweep runs (torchrun, one GPU, or
gloo ranks on the CPU). Nothing imports this module but __main__.

Every check of the command line happens here, before any process starts or any file is written:
a wrong usage ends with one line that names the flag and its valid values, and exit status 2."""
import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

from . import __doc__ as DOC
from . import model
from .launch import run_cpu_ranks
from .report import output_paths, report
from .sweep import (CPU_SERIES, CPU_TOKENS, GPU_SERIES, GPU_TOKENS, NAMED_SERIES, SweepArgs, build_series,
                    default_iters, run_sweep)
from ..wire import QUANTIZED

PROG = "python -m fp8a2a.bench"
GRANULARITIES = tuple(g.label for g in QUANTIZED)
# The flags of one mode only: given in the other, they would be silently ignored.
SWEEP_ONLY = ("tokens", "series", "hidden", "experts", "topk", "granularity", "iters", "warmup", "world", "seed",
              "out", "no_plot", "no_profile", "profile_all", "quiet")
EMULATE_ONLY = ("emulate_ep", "link", "emulate_models")
# what --emulate-ep takes from the sweep's flags (--tokens: its first value)
EMULATE_SHARED = ("tokens", "iters", "warmup")
MODEL_ONLY = ("ep", "gpus_per_node", "nvlink_gbps", "net_gbps", "model_tokens", "model_hidden", "model_ffn",
              "model_experts", "model_topk", "kernels_json", "dispatch_json", "alltoall_json", "no_measure")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming the problem (argparse's default prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _ints(lo, example):
    """A comma-separated list of integers, each >= lo, as a flag's type."""
    def parse(text):
        try:
            vals = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            vals = None
        if not vals or min(vals) < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: give integers >= {lo}, comma-separated (e.g. {example})")
        return vals
    return parse


def _int(lo):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= {lo}")
        return v
    return parse


def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number > 0")
    return v


def _choices(valid):
    def parse(text):
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in valid]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) if bad else repr(text)} is not one of "
                                             f"{', '.join(valid)} (comma-separated)")
        return vals
    return parse


def _listed(seq):
    return ",".join(map(str, seq))


def _series_epilog():
    rows = [f"  {s.name:<18} hidden {s.hidden:>5}, {s.experts:>3} experts, top-{s.topk}, {s.granularity}"
            for s in GPU_SERIES + CPU_SERIES]
    return ("built-in series (--series NAME; by default the GPU ones on a GPU, the cpu- ones on a CPU):\n"
            + "\n".join(rows) + "\n\nvariants timed at every point:\n"
            "  megatron      megatron-core's `alltoall` dispatcher path, BF16 (the baseline)\n"
            "  fp8a2a-bf16   fp8a2a.Dispatcher sending BF16 rows (what bf16_below_bytes falls back to)\n"
            "  fp8a2a-fp8    fp8a2a.Dispatcher sending FP8 rows\n"
            "each timed as a training step (the headline: dispatch + combine forward and backward, x and\n"
            "the router weights requiring grad) and as inference (forward only: the table's infer column)\n\n"
            "outputs: a table on stdout; JSON, CSV and a PNG in --out (existing ones need --force).")


def make_parser():
    p = _Parser(prog=PROG, description="\n\n".join(DOC.split("\n\n")[:2]), epilog=_series_epilog(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("the sweep (default mode)")
    s.add_argument("--tokens", type=_ints(1, "256,1024"), metavar="T,...",
                   help=f"tokens per rank, integers >= 1 (default: CPU {_listed(CPU_TOKENS)}; "
                        f"GPU {_listed(GPU_TOKENS)})")
    s.add_argument("--series", type=_choices(tuple(NAMED_SERIES)), metavar="NAME,...",
                   help="built-in series to run, by name (listed below; default: the device's)")
    grid = ("; with any of --hidden/--experts/--topk/--granularity the sweep is their cartesian product, "
            f"the others taken from the device's first series ({CPU_SERIES[0].name} on CPU)")
    s.add_argument("--hidden", type=_ints(1, "1024,4096"), metavar="H,...",
                   help=f"hidden sizes, integers >= 1 (block128: multiples of 128){grid}")
    s.add_argument("--experts", type=_ints(1, "16,64"), metavar="E,...",
                   help="numbers of experts, each a multiple of the world size (default: the series')")
    s.add_argument("--topk", type=_ints(1, "2,8"), metavar="K,...",
                   help="experts per token, 1 <= K <= experts (default: the series')")
    s.add_argument("--granularity", type=_choices(GRANULARITIES), metavar="G,...",
                   help=f"FP8 scale granularities: {', '.join(GRANULARITIES)} (default: the series')")
    s.add_argument("--iters", type=_int(1), metavar="N",
                   help=f"timed iterations per point, >= 1 (default: CPU {default_iters(False)[0]}, "
                        f"GPU {default_iters(True)[0]})")
    s.add_argument("--warmup", type=_int(0), metavar="N",
                   help=f"untimed iterations before them, after one untimed call of each variant, >= 0 (default: "
                        f"CPU {default_iters(False)[1]}, "
                        f"GPU {default_iters(True)[1]})")
    s.add_argument("--world", type=_int(1), metavar="N",
                   help="CPU only: gloo ranks to spawn, >= 1 (default 4); a series whose experts it does not "
                        "divide is skipped; on GPUs: torchrun --nproc-per-node N -m fp8a2a.bench")
    s.add_argument("--seed", type=_int(0), default=0, metavar="S", help="routing and input seed, >= 0 (default 0)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", default="bench_out",
                       help="sweep: output folder for alltoall.json, .csv and .png (default bench_out/)")
    where.add_argument("--json", metavar="PATH",
                       help="JSON output path; the sweep's CSV and PNG go beside it (--model: the projection's)")
    p.add_argument("--force", action="store_true", help="overwrite results that exist (default: refuse)")
    s.add_argument("--no-plot", action="store_true", help="write no PNG (default: write one; needs matplotlib)")
    prof = s.add_mutually_exclusive_group()
    prof.add_argument("--no-profile", action="store_true",
                      help="GPU: skip counting kernels and host syncs (on a CPU nothing is counted)")
    prof.add_argument("--profile-all", action="store_true",
                      help="GPU: count them at every point (default: the smallest and largest tokens of each series)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--model", action="store_true",
                   help="project dispatch time for EP 8..1024 instead of sweeping (flags below)")
    _model_arguments(p)
    _emulate_arguments(p)
    return p


def _emulate_arguments(p):
    from .loopback import MODELS
    from ..links import LINKS
    g = p.add_argument_group("one GPU as a rank of EP=N (--emulate-ep N): a loopback group whose remote bytes "
                             "cross a real link; --tokens (first value), --iters, --warmup, --json apply")
    g.add_argument("--emulate-ep", type=_int(2), metavar="N",
                   help="play rank 0 of an EP=N group on this device (N >= 2): dispatch and the training step of "
                        "every model whose experts divide over N, FP8 against fp8a2a's BF16 wire and a Megatron-style "
                        "BF16 dispatcher")
    g.add_argument("--link", type=_choices(LINKS), default=["pcie"], metavar="LINK",
                   help=f"what the remote bytes cross, one of {_listed(LINKS)} (default pcie: staged through pinned "
                        "host memory, the InfiniBand-class link; device: a device copy, the NVLink-class bound)")
    g.add_argument("--emulate-models", type=_choices(tuple(MODELS)), metavar="NAME,...",
                   help=f"models to emulate, of {_listed(MODELS)} (default: every one whose experts divide over N)")


def _model_arguments(p):
    d = model.Params()
    g = p.add_argument_group("the scale model (--model)")
    g.add_argument("--ep", type=_ints(1, "8,64"), default=list(model.EP_SIZES), metavar="N,...",
                   help=f"EP sizes to project, integers >= 1 (default {_listed(model.EP_SIZES)})")
    g.add_argument("--gpus-per-node", type=_int(1), default=d.gpus_per_node, metavar="G",
                   help=f"GPUs per node, >= 1 (default {d.gpus_per_node})")
    g.add_argument("--nvlink-gbps", type=_positive_float, default=d.nvlink_gbps, metavar="GB/s",
                   help=f"NVLink GB/s per GPU per direction, > 0 (default {d.nvlink_gbps:g})")
    g.add_argument("--net-gbps", type=_positive_float, default=d.net_gbps, metavar="GB/s",
                   help=f"network (InfiniBand) GB/s per GPU per direction, > 0 (default {d.net_gbps:g})")
    for flag, value, what in (("tokens", d.tokens, "tokens per rank per micro-batch"),
                              ("hidden", d.hidden, "hidden size"), ("ffn", d.ffn, "expert FFN size"),
                              ("experts", d.experts, "experts"), ("topk", d.topk, "experts per token")):
        g.add_argument(f"--model-{flag}", type=_int(1), default=value, metavar="N",
                       help=f"{what}, >= 1 (default {value}, DeepSeek-V3)")
    g.add_argument("--kernels-json", metavar="PATH", help="benchmarks/bench_kernels.py --json output: take the "
                                                          "copy and dispatch_pack bandwidths from it")
    g.add_argument("--dispatch-json", metavar="PATH", help="benchmarks/bench_dispatch.py --json output: each "
                                                           "side's fixed cost and Megatron's kernel bandwidth")
    g.add_argument("--alltoall-json", metavar="PATH", help="the JSON of a multi-GPU run of this benchmark: the "
                                                           "link's lower bound, and what the model is checked against")
    g.add_argument("--no-measure", action="store_true",
                   help="measure nothing on this GPU: the built-in H200 figures (always so on a CPU)")


def _parse(p, argv):
    """(the parsed namespace, the destinations of the flags the command line names)."""
    defaults = vars(p.parse_args([]))
    unset = object()  # not a string: argparse leaves it alone, and what no flag set keeps it
    ns = p.parse_args(argv, argparse.Namespace(**{k: unset for k in defaults}))
    given = {k for k, v in vars(ns).items() if v is not unset}
    for k in defaults.keys() - given:
        setattr(ns, k, defaults[k])
    return ns, given


def _sweep_world(args):
    """(world size, where it comes from) of the sweep this command would run."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE"
    if torch.cuda.is_available():
        return 1, "one GPU without torchrun"
    return (4 if args.world is None else args.world), "--world"


def _check_outputs(p, paths, force):
    for path in paths:
        if os.path.isdir(path):
            p.error(f"{path} is a folder: give --json a file path")
        if os.path.exists(path) and not force:
            p.error(f"{path} exists (an earlier run): pass --force to overwrite it, or --out/--json for new files")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            p.error(f"cannot write {path}: {parent} is not a writable folder")


def _check_sweep(p, args, given):
    if "series" in given and given & {"hidden", "experts", "topk", "granularity"}:
        p.error("--series picks built-in series; --hidden/--experts/--topk/--granularity build a grid instead: "
                "give one or the other")
    world, source = _sweep_world(args)
    if "world" in given and source != "--world":
        p.error(f"--world spawns CPU ranks and does not apply here ({source}, world size {world}); "
                "on GPUs: torchrun --nproc-per-node N -m fp8a2a.bench")
    cuda = torch.cuda.is_available()
    series = build_series(SweepArgs.from_namespace(args), cuda)
    for s in series:
        if s.topk > s.experts:
            p.error(f"--topk {s.topk} is more than the {s.experts} experts of series {s.name}: valid 1..{s.experts}")
        if s.granularity == "block128" and s.hidden % 128:
            p.error(f"--hidden {s.hidden} with block128 granularity: hidden must be a multiple of 128 "
                    f"(e.g. {max(128, s.hidden // 128 * 128)})")
    fits = [s for s in series if s.experts % world == 0]
    if not fits:
        valid = sorted({d for s in series for d in range(1, s.experts + 1) if s.experts % d == 0})
        p.error(f"world size {world} ({source}) divides the experts of no series "
                f"({', '.join(f'{s.name}: {s.experts}' for s in series)}): valid world sizes {_listed(valid)}")
    return world, [s.name for s in series if s not in fits]


def _check_model(p, args):
    for flag in ("kernels_json", "dispatch_json", "alltoall_json"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    if args.model_topk > args.model_experts:
        p.error(f"--model-topk {args.model_topk} is more than --model-experts {args.model_experts}: "
                f"valid 1..{args.model_experts}")


def _check_emulate(p, args, given):
    stray = sorted(given & (set(SWEEP_ONLY + MODEL_ONLY + ("model",)) - set(EMULATE_SHARED)))
    if stray:
        p.error(f"{', '.join('--' + k.replace('_', '-') for k in stray)} not used by --emulate-ep (it takes --tokens, --iters, --warmup, --json, --force)")
    if len(args.link) != 1:
        p.error(f"--link takes one link, got {','.join(args.link)}")
    from .loopback import MODELS
    models = args.emulate_models or list(MODELS)
    experts = {m: MODELS[m]["experts"] for m in models}
    if not any(e % args.emulate_ep == 0 for e in experts.values()):
        shown = ", ".join(f"{m}: {e}" for m, e in experts.items())
        p.error(f"--emulate-ep {args.emulate_ep}: no model has a multiple of {args.emulate_ep} experts ({shown})")
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        _check_outputs(p, [args.json], args.force)
    return args


def parse_args(argv=None):
    """The parsed command line, checked as a whole; exits with status 2 and one line if it is wrong."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = make_parser()
    args, given = _parse(p, argv)
    if args.emulate_ep is not None:
        return _check_emulate(p, args, given)
    stray = sorted(given & set((MODEL_ONLY if not args.model else SWEEP_ONLY) + EMULATE_ONLY))
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        p.error(f"{flags} only appl{'ies' if len(stray) == 1 else 'y'} "
                f"{'with --model' if not args.model else 'to the sweep, not to --model'}")
    if args.model:
        _check_model(p, args)
        if args.json and int(os.environ.get("RANK", "0")) == 0:
            _check_outputs(p, [args.json], args.force)
        return args
    args.world_size, args.skipped = _check_sweep(p, args, given)
    if int(os.environ.get("RANK", "0")) == 0:  # the rank that writes
        _check_outputs(p, list(output_paths(args).values()), args.force)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.emulate_ep is not None:
        from .loopback import emulate
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        cuda = torch.cuda.is_available()
        tokens = args.tokens[0] if args.tokens else (4096 if cuda else 64)
        emulate(args.emulate_ep, args.link[0], models=args.emulate_models, tokens=tokens,
                iters=args.iters or (8 if cuda else 2), warmup=args.warmup if args.warmup is not None else 2,
                json_path=args.json)
        return 0
    if args.model:
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        model.run(args)
        return 0
    sweep = SweepArgs.from_namespace(args)
    if args.skipped:
        print(f"{PROG}: skipping {', '.join(args.skipped)}: experts not a multiple of world size {args.world_size}",
              file=sys.stderr)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        try:
            records, meta = run_sweep(rank, dist.get_world_size(), sweep)
            ok = report(records, meta, args) if rank == 0 else True
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    if torch.cuda.is_available():  # one GPU, no process group: world size 1
        records, meta = run_sweep(0, 1, sweep)
        return 0 if report(records, meta, args) else 1
    print(f"{PROG}: no GPU; running {args.world_size} gloo ranks on the CPU (functional numbers only)",
          file=sys.stderr)
    records, meta = run_cpu_ranks(args.world_size, run_sweep, sweep)
    return 0 if report(records, meta, args) else 1
