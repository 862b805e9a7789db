"""A loopback expert-parallel group: one process plays rank r of an EP=n group on one device, and the
bytes that would leave the rank cross a real link of your choice.

    from fp8a2a import loopback
    world = loopback.init(8, rank=0, link="pcie")    # torch.distributed's world: rank 0 of 8, one process
    world.num_experts = 256                           # only for Megatron's counts all-gather (see below)
    ...                                               # fp8a2a.Dispatcher, Megatron's parallel_state, unchanged
    loopback.destroy()

The traffic model: symmetric traffic. Every virtual rank j holds rank r's data with the expert
blocks (the experts of one rank) relabelled: a token of j goes to expert e + (r - j) * L (mod E,
L = E / n experts per rank) where r's goes to e (relabel_experts(topk_idx, E, n, r - j)). Then
the rows j sends to r are exactly the rows r sends to j, local expert ids included (a wire row
carries the destination's local ids, which the relabelling keeps), so each collective returns
r's own bytes:

  all_to_all_single  the chunk received from j is r's chunk for j (so receive splits must equal send
                     splits: a caller whose receive sizes differ broke the model and gets an error)
  all_gather         j's contribution is r's tensor; an integer tensor whose last dimension is
                     `num_experts` (per-expert counts, as Megatron gathers them) is j's view of it:
                     its expert blocks rolled by r - j, so the counts match the all-to-all's sizes
  all_reduce         the reduction of the n views (identical ranks: sum = n * value, max = value)
  broadcast          the root's view; reduce_scatter, gather: likewise; barrier: nothing to wait for

This is what an EP=n rank sees when routing is statistically the same on every rank (uniform or
any rank-symmetric routing): pack, dedup, unpack, expert load and combine are a real rank's, and
values stay checkable: dispatch + combine equals the single-rank reference whose expert e is local
expert e mod L. It is not the traffic of an identical-routing run (there, every rank would receive
n copies of its self chunk and its send sizes would not match); no such model is self-consistent.

Links (`link=` or a per-peer `topology`; fp8a2a.links): what the bytes for a peer cross: `none`,
`device` (a device copy: the NVLink-class bound) or `pcie` (staged through pinned host memory on
both copy engines at once: the InfiniBand-class link)."""
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .links import LINKS, DeviceLink, Link, Pair, PcieLink, Topology, flat, make_link, two_level  # noqa: F401

BACKEND = "fp8a2a_loopback"


# ---- the world ---------------------------------------------------------------------------------

@dataclass
class LoopbackWorld:
    """The emulated run: this process's global rank, the world size, the topology, and the experts
    whose per-expert counts all-gathers are relabelled (None: no relabelling). Every group of the
    world reads it at call time: set num_experts between runs of different models."""
    rank: int
    size: int
    topology: Topology
    num_experts: Optional[int] = None
    pcie_chunk_bytes: Optional[int] = None
    traffic: Optional[list] = None  # while metered(): (link name, bytes) of each link hand-off

    def link_name(self, peer: int) -> str:
        return self.topology(self.rank, peer)


_WORLD: Optional[LoopbackWorld] = None
_LINKS: Dict[str, Dict[str, Link]] = {}  # per device, one link object of each kind (streams, staging)


def _links(device) -> Dict[str, Link]:
    key = str(device)
    if key not in _LINKS:
        chunk = _WORLD.pcie_chunk_bytes if _WORLD is not None else None
        _LINKS[key] = {"none": Link(), "device": DeviceLink(), "pcie": PcieLink(chunk)}
    return _LINKS[key]


def measure_link(link: str, nbytes: int, device=None, iters: int = 5, warmup: int = 2) -> dict:
    """The link alone at one message size: `nbytes` out and the same bytes back in (one
    all_to_all_single's remote part), median time over `iters`; GB/s each way = nbytes / time.
    Off CUDA: wall time of the copy (functional only)."""
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    lk = _links(device).get(link) or make_link(link)
    src = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    cuda = device.type == "cuda"
    for i in range(warmup + iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            lk.move([(dst, src)])
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            lk.move([(dst, src)])
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    times.sort()
    ms = times[len(times) // 2]
    return {"link": link, "bytes": int(nbytes), "ms": ms, "gbps_each_way": nbytes / ms / 1e6 if ms > 0 else None,
            "device": str(device), "functional_only": not cuda}


def world() -> Optional[LoopbackWorld]:
    """The loopback world of this process (None when init() was not called)."""
    return _WORLD


def _done(result=None):
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _ints(splits, n, total) -> List[int]:
    if splits is None or len(splits) == 0:
        if total % n:
            raise ValueError(f"loopback: {total} rows do not split evenly over {n} ranks")
        return [total // n] * n
    return [int(s) for s in splits]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_REDUCE = {}


def _reduce_ops():
    if not _REDUCE:
        R = dist.ReduceOp
        _REDUCE.update({R.SUM: lambda ts: _fold(ts, torch.add), R.PRODUCT: lambda ts: _fold(ts, torch.mul),
                        R.MIN: lambda ts: _fold(ts, torch.minimum), R.MAX: lambda ts: _fold(ts, torch.maximum),
                        R.BAND: lambda ts: _fold(ts, torch.bitwise_and),
                        R.BOR: lambda ts: _fold(ts, torch.bitwise_or),
                        R.BXOR: lambda ts: _fold(ts, torch.bitwise_xor),
                        R.AVG: lambda ts: _fold(ts, torch.add) / len(ts)})
    return _REDUCE


def _fold(ts, op):
    acc = ts[0].clone()
    for t in ts[1:]:
        acc = op(acc, t)
    return acc


class LoopbackGroup(dist.ProcessGroup):
    """One group of the loopback world (the world itself, or a group of new_group): this process is
    its rank `rank`; `ranks` are the group's global ranks (the topology's coordinates)."""

    def __init__(self, rank: int, size: int, ranks: Sequence[int]):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._ranks = list(ranks) if ranks else list(range(size))

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"LoopbackGroup(rank {self._rank} of {self._size}, global ranks {self._ranks})"

    # ---- the model ---------------------------------------------------------------------------

    def _peer_view(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        """Group rank `peer`'s copy of this rank's tensor t (see the module docstring)."""
        e = _WORLD.num_experts if _WORLD is not None else None
        if (peer == self._rank or not e or t.dim() == 0 or t.shape[-1] != e or e % self._size
                or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            return t
        return t.unflatten(-1, (self._size, e // self._size)).roll(self._rank - peer, dims=-2).flatten(-2)

    def _relabels(self, t: torch.Tensor) -> bool:
        return self._size > 1 and self._peer_view(t, (self._rank + 1) % self._size) is not t

    def _link(self, peer: int, device) -> Link:
        if _WORLD is None:
            raise RuntimeError("fp8a2a.loopback: the loopback world is gone (destroy() was called)")
        return _links(device)[_WORLD.topology(self._ranks[self._rank], self._ranks[peer])]

    def _send(self, pairs_by_peer: Dict[int, List[Pair]]):
        """Hand each link the pairs of its peers (the self pairs: a local copy)."""
        by_link: Dict[object, Tuple[Link, List[Pair]]] = {}
        self_link = None
        for peer, pairs in pairs_by_peer.items():
            if not pairs:
                continue
            if peer == self._rank:  # a local copy, kept apart from the peers' (for the meter)
                link = self_link = Link()
                key = "self"
            else:
                link = self._link(peer, pairs[0][0].device)
                key = id(link)
            by_link.setdefault(key, (link, []))[1].extend(pairs)
        traffic = _WORLD.traffic if _WORLD is not None else None
        for link, pairs in by_link.values():
            link.move(pairs)
            if traffic is not None:
                traffic.append(("self" if link is self_link else link.name, sum(p[1].numel() for p in pairs)))

    # ---- all-to-all --------------------------------------------------------------------------

    @torch.no_grad()
    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._size
        if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
            raise ValueError(f"loopback all_to_all_single: output {output.dtype} {tuple(output.shape)} and input "
                             f"{input.dtype} {tuple(input.shape)} differ in dtype or row shape")
        send = _ints(input_split_sizes, n, input.shape[0])
        recv = _ints(output_split_sizes, n, output.shape[0])
        if send != recv:
            raise ValueError(
                f"loopback all_to_all_single: receive splits {recv} differ from send splits {send}. Symmetric "
                f"traffic receives from each peer what this rank sends it; sizes that differ come from counts "
                f"exchanged without the relabelling (per-expert counts all-gathered while the loopback world's "
                f"num_experts is not the model's: set loopback.world().num_experts)")
        if sum(send) != input.shape[0] or output.shape[0] != input.shape[0]:
            raise ValueError(f"loopback all_to_all_single: splits {send} do not cover input {input.shape[0]} / "
                             f"output {output.shape[0]} rows")
        src = input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        links = {self._link(j, src.device).name for j in range(n) if j != self._rank and send[j]}
        if links <= {"none"}:  # nothing crosses a link: one copy, self chunk included
            dst.copy_(src)
            if _WORLD.traffic is not None:
                row = src[0].numel() * src.element_size() if src.shape[0] else 0
                self_bytes = send[self._rank] * row
                _WORLD.traffic += [("self", self_bytes), ("none", sum(send) * row - self_bytes)]
        else:
            sb, db = _flat_bytes(src), _flat_bytes(dst)
            row = src[0].numel() * src.element_size() if src.shape[0] else 0
            # one byte range per run of neighbouring peers on the same link (fewer, longer copies)
            runs, off = [], 0  # [peer that names the run's link, start, stop]
            for j, rows in enumerate(send):
                if not rows:
                    continue
                a, b = off, off + rows * row
                off = b
                key = "self" if j == self._rank else self._link(j, src.device).name
                if runs and runs[-1][0] == key and runs[-1][3] == a:
                    runs[-1][3] = b
                else:
                    runs.append([key, j, a, b])
            pairs = {}
            for _, j, a, b in runs:
                pairs.setdefault(j, []).append((db[a:b], sb[a:b]))
            self._send(pairs)
        if dst is not output:
            output.copy_(dst)
        return _done([output])

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall_base(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    @torch.no_grad()
    def alltoall(self, output_tensors, input_tensors, opts=None):
        pairs = {}
        for j, (o, i) in enumerate(zip(output_tensors, input_tensors)):
            if o.shape != i.shape or o.dtype != i.dtype:
                raise ValueError(f"loopback alltoall: output {j} {o.dtype} {tuple(o.shape)} differs from what this "
                                 f"rank sends to rank {j}, {i.dtype} {tuple(i.shape)} (symmetric traffic)")
            if o.numel():
                if not o.is_contiguous():
                    o.copy_(i)
                    continue
                pairs[j] = [(_flat_bytes(o), _flat_bytes(i.contiguous()))]
        self._send(pairs)
        return _done(output_tensors)

    # ---- gathers -----------------------------------------------------------------------------

    @torch.no_grad()
    def _gather_into(self, outs: List[torch.Tensor], t: torch.Tensor):
        pairs = {}
        for j, o in enumerate(outs):
            v = self._peer_view(t, j).reshape(o.shape)
            if o.is_contiguous() and o.numel():
                pairs[j] = [(_flat_bytes(o), _flat_bytes(v.contiguous().to(o.dtype)))]
            else:
                o.copy_(v)
        self._send(pairs)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            self._gather_into(list(outs), t)
        return _done(output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def _all_gather_flat(self, output, input, opts=None):
        self._gather_into(list(output.view(-1).chunk(self._size)) if output.is_contiguous() else
                          list(output.chunk(self._size)), input)
        return _done([output])

    all_gather_single = _allgather_base = _all_gather_flat

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._all_gather_flat(o, i)
        return _done(outputs)

    all_gather_into_tensor_coalesced = allgather_into_tensor_coalesced

    @torch.no_grad()
    def gather(self, output_tensors, input_tensors, opts=None):
        if self._rank == opts.rootRank:
            self._gather_into(list(output_tensors[0]), input_tensors[0])
        return _done(output_tensors)

    # ---- reductions (local: no link) ---------------------------------------------------------

    def _reduced(self, t, op):
        if self._size == 1:
            return t
        red = op.op if hasattr(op, "op") else op
        if not self._relabels(t):  # identical ranks: no n-fold temporary for the common cases
            R = dist.ReduceOp
            if red in (R.MIN, R.MAX, R.BAND, R.BOR, R.AVG):
                return t
            if red == R.SUM and t.dtype != torch.bool:
                return t * self._size
        fn = _reduce_ops().get(red)
        if fn is None:
            raise NotImplementedError(f"loopback: reduce op {red} is not supported")
        return fn([self._peer_view(t, j) for j in range(self._size)]).to(t.dtype)

    @torch.no_grad()
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            r = self._reduced(t, op)
            if r is not t:
                t.copy_(r)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @torch.no_grad()
    def _reduce_scatter_flat(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        full = self._reduced(input.contiguous(), op)
        output.copy_(full.reshape(-1).chunk(self._size)[self._rank].view(output.shape))
        return _done([output])

    reduce_scatter_single = _reduce_scatter_base = _reduce_scatter_flat

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_flat(o, i, opts)
        return _done(outputs)

    @torch.no_grad()
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for o, ins in zip(output_tensors, input_lists):
            # peer j's list is this rank's (relabelled by the views of the stacked list)
            full = self._reduced(torch.stack([i.reshape(o.shape) for i in ins]), op)
            o.copy_(full[self._rank])
        return _done(output_tensors)

    # ---- the rest ----------------------------------------------------------------------------

    @torch.no_grad()
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if root != self._rank:
            for t in tensors:
                v = self._peer_view(t, root)
                if v is not t:
                    t.copy_(v.clone())
        return _done(tensors)

    def barrier(self, opts=None):
        return _done(None)

    def scatter(self, output_tensors, input_tensors, opts=None):
        if self._rank == opts.rootRank:
            output_tensors[0].copy_(input_tensors[0][self._rank])
            return _done(output_tensors)
        raise NotImplementedError("loopback: scatter to a non-root rank (it holds no data to mirror)")

    def send(self, *args, **kwargs):
        raise NotImplementedError("loopback: point-to-point send/recv have no symmetric model")

    recv = send
    recv_anysource = send


def _create(opts, backend_options=None):
    if _WORLD is None:
        raise RuntimeError("fp8a2a.loopback: call loopback.init() to create the loopback world")
    ranks = list(getattr(opts, "global_ranks_in_group", None) or [])
    size = opts.group_size
    if not ranks:  # the world itself
        ranks = list(range(size))
    return LoopbackGroup(opts.group_rank, size, ranks)


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def init(world_size: int, rank: int = 0, link: str = "pcie", topology: Optional[Topology] = None,
         num_experts: Optional[int] = None, pcie_chunk_bytes: Optional[int] = None) -> LoopbackWorld:
    """Make this process rank `rank` of a loopback world of `world_size` ranks (torch.distributed's
    default group; new_group makes loopback groups too). `topology` (default: flat(link)) picks each
    peer's link; `num_experts` turns on the relabelling of per-expert counts all-gathers (set it
    later on the returned world as the model changes)."""
    global _WORLD
    if dist.is_initialized():
        raise RuntimeError("fp8a2a.loopback: torch.distributed is already initialized")
    if not 0 <= rank < world_size:
        raise ValueError(f"loopback: rank {rank} is not in a world of {world_size}")
    if os.environ.get("TORCH_DIST_INIT_BARRIER", "0") not in ("", "0"):
        # new_group would wait in the store for the other ranks' arrival, which never comes
        raise RuntimeError("fp8a2a.loopback: unset TORCH_DIST_INIT_BARRIER (new_group's store barrier waits for "
                           "ranks that a loopback world does not have)")
    _WORLD = LoopbackWorld(rank, world_size, topology or flat(link), num_experts, pcie_chunk_bytes)
    _LINKS.clear()
    _register()
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    except Exception:
        _WORLD = None
        raise
    return _WORLD


def destroy():
    """Tear down torch.distributed and the loopback world."""
    global _WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
    _LINKS.clear()


def set_link(link: str = None, topology: Optional[Topology] = None):
    """Change the links of the running world (all its groups) between measurements."""
    if _WORLD is None:
        raise RuntimeError("fp8a2a.loopback: no loopback world")
    _WORLD.topology = topology or flat(link)


def relabel_experts(topk_idx: torch.Tensor, num_experts: int, ranks: int, shift: int) -> torch.Tensor:
    """topk_idx with every expert moved `shift` expert blocks up (mod `ranks` blocks of num_experts /
    ranks experts; local ids and unrouted -1 kept). In the symmetric model virtual rank j routes as
    relabel_experts(r's routing, E, n, r - j). Equivalently, from any base routing B, ranks a = 0..n-1
    routing relabel_experts(B, E, n, -a) send each other exactly what they receive (a -> b equals
    b -> a): a real run with those routings is what the loopback group reproduces on each rank."""
    per = num_experts // ranks
    e = topk_idx.long()
    moved = ((torch.div(e, per, rounding_mode="floor") + shift) % ranks) * per + e % per
    return torch.where((e >= 0) & (e < num_experts), moved, e).to(topk_idx.dtype)


@contextlib.contextmanager
def metered():
    """Within the block, every link hand-off of the world's collectives is appended to the yielded
    list as (link name, bytes); the self chunk counts as 'self'."""
    if _WORLD is None:
        raise RuntimeError("fp8a2a.loopback: no loopback world")
    calls = []
    before, _WORLD.traffic = _WORLD.traffic, calls
    try:
        yield calls
    finally:
        _WORLD.traffic = before


def bytes_over_links(send_splits: Sequence[int], row_bytes: int, rank: int = None) -> Dict[str, int]:
    """Bytes of one all_to_all_single that cross each link (the self chunk under 'self')."""
    w = _WORLD
    rank = w.rank if rank is None else rank
    out: Dict[str, int] = {}
    for j, rows in enumerate(send_splits):
        name = "self" if j == rank else w.topology(rank, j)
        out[name] = out.get(name, 0) + int(rows) * row_bytes
    return out


__all__ = ["init", "destroy", "world", "set_link", "flat", "two_level", "measure_link", "make_link", "LINKS",
           "LoopbackWorld", "LoopbackGroup", "bytes_over_links", "relabel_experts", "metered", "BACKEND"]
