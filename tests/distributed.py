"""A small launcher for multi-rank tests: forks `world` CPU processes joined by gloo, runs `fn(rank,
world, *args)` in each, and re-raises the first failure (with its traceback) in the test process.
Forking (not spawning) keeps a scenario well under a second on 2 cores."""
import multiprocessing as mp
import socket
import traceback

import torch
import torch.distributed as dist


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, None, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, traceback.format_exc(), None))


def run_ranks(world, fn, *args, timeout=120):
    """Run fn on `world` gloo ranks; returns the per-rank results, raises on any rank's error."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = [None] * world, []
    try:
        for _ in range(world):
            rank, err, res = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results

