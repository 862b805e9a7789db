"""Process groups for the benchmarks: the sweep's `world` spawned CPU processes joined by gloo
(functional numbers only), and a group of one for the single-GPU benchmarks."""
import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(minutes=10)  # a collective a peer never joins fails instead of hanging


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_group(backend=None, timeout=datetime.timedelta(minutes=5)):
    """torch.distributed at world size 1, this process rank 0: `backend` (default NCCL on GPU 0
    where CUDA is there, else gloo). An in-memory store: no port to pick, none to collide on."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _worker(rank, world, port, fn, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    result = None
    try:
        result = fn(rank, world, *args)
        # every rank done with its exchanges before any leaves: a gloo rank that tears its group down
        # while a peer still reads from it can abort the process (SIGABRT at exit)
        dist.barrier()
    finally:
        if rank == 0:  # always answer, so that the parent never waits on a failed rank 0
            results.put(result)
        dist.destroy_process_group()


def run_cpu_ranks(world, fn, *args):
    """Rank 0's fn(rank, world, *args); a rank's exception is raised here with its traceback."""
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.spawn(_worker, (world, port, fn, args, results), nprocs=world, join=False)
    result = results.get()  # before joining: a large result would block rank 0's exit
    while not procs.join():
        pass
    return result
