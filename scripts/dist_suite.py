"""The dispatch test scenarios (tests/test_dispatch.py) on every rank of a torchrun job: NCCL on GPUs
(one per rank), gloo on CPU. Also a capacity-mode dispatch -> experts -> combine step captured in a
CUDA graph on every rank and replayed (GPUs only).

    torchrun --nproc-per-node 8 scripts/dist_suite.py            # EP = 8
    torchrun --nproc-per-node 4 scripts/dist_suite.py --tp 2     # EP = 2 x expert-TP = 2 only
    torchrun --nproc-per-node 2 scripts/dist_suite.py            # on CPU: gloo
Prints one PASS/FAIL line per scenario (rank 0) and exits non-zero on any failure.
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp8a2a  # noqa: E402
from fp8a2a.timing import capture_cuda_graph  # noqa: E402
from tests.test_dispatch import cases_for_world, make_inputs, scenario  # noqa: E402


def cases(world, only_tp):
    for name, cfg in cases_for_world(world).items():
        if not only_tp or cfg.get("tp", 1) == only_tp:
            yield name, cfg


def graph_replay(rank, world):
    """Capacity mode on every rank: capture one step, replay it on new inputs, compare with eager."""
    d = fp8a2a.Dispatcher(8 * world, capacity_factor=1.0)
    step_inputs = [make_inputs(world, 256, 1024, 8 * world, 4, torch.bfloat16, "skewed", seed=s) for s in (0, 1)]
    sx, sidx, sw = (t[rank].cuda() for t in step_inputs[0])

    def step():
        out = d.dispatch(sx, sidx, sw)
        return d.combine(out.dequantized() * 2, out.handle)

    step()  # validates the shape once (the only sync of capacity mode)
    graph, y = capture_cuda_graph(step)
    for src, dst in zip((t[rank].cuda() for t in step_inputs[1]), (sx, sidx, sw)):
        dst.copy_(src)
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    assert torch.equal(y, expected), "graph replay differs from eager"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=0, help="run only the expert-TP scenarios of this size")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    checks = [(n, lambda c=c: scenario(rank, world, {**c, "device": "cuda" if cuda else "cpu"}))
              for n, c in cases(world, args.tp)]
    if cuda and not args.tp:
        checks.append(("capacity_graph_replay", lambda: graph_replay(rank, world)))
    for name, check in checks:
        try:
            check()
            ok, why = 1, ""
        except Exception as e:  # noqa: BLE001 - reported, and agreed on by all ranks below
            ok, why = 0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        flag = torch.tensor([ok], device="cuda" if cuda else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        results.append((name, bool(flag.item()), why))
        if rank == 0:
            print(f"{'PASS' if flag.item() else 'FAIL'} {name} (world {world}) {why}", flush=True)
    dist.destroy_process_group()
    failed = [n for n, ok, _ in results if not ok]
    if rank == 0:
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
