"""The tests' multi-rank launcher: run_ranks(world, fn, *args, timeout=...) runs fn(rank, world, *args)
on `world` forked CPU processes joined by gloo (forking keeps a launch well under a second) and
returns every rank's result, in rank order. The ranks meet in a file store in a fresh temporary
directory: no port to find, none that another process can take in between.

A rank's exception fails the call with that rank's traceback. The timeout is hard: a call that
has not finished after `timeout` seconds kills every rank and raises, so that a hang (a rank
waiting in a collective its peers never join) fails the test instead of stalling CI."""
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 300.0
GRACE = 10.0  # after a rank fails: how long the others get to report before they are killed


def _rank_main(rank, world, store, fn, args, results, timeout):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        try:
            report = (rank, None, fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        report = (rank, traceback.format_exc(), None)
    results.put(report)


def run_ranks(world, fn, *args, timeout=DEFAULT_TIMEOUT):
    with tempfile.TemporaryDirectory(prefix="fp8a2a-ranks-") as tmp:
        return _run(world, fn, args, timeout, os.path.join(tmp, "store"))


def _run(world, fn, args, timeout, store):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, fn, args, results, timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out, errors, done = [None] * world, {}, set()
    try:
        while len(done) < world and time.monotonic() < deadline:
            try:
                rank, err, res = results.get(timeout=0.2)
            except queue.Empty:  # a rank that died without reporting (a crash, a kill) fails now
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode not in (None, 0):
                        done.add(r)
                        errors[r] = f"exited with code {p.exitcode} without reporting"
                continue
            done.add(rank)
            out[rank] = res
            if err:
                errors[rank] = err
                deadline = min(deadline, time.monotonic() + GRACE)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    missing = [r for r in range(world) if r not in done]
    if errors or missing:
        text = "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
        if missing:
            text += f"\nranks {missing} did not finish within {timeout:g} s (killed)"
        raise (RuntimeError if errors else TimeoutError)(f"run_ranks: a rank failed\n{text}")
    return out
