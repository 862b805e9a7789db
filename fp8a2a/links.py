"""The links a loopback EP rank's bytes cross (fp8a2a.loopback), and the topologies that pick one per
peer.

Links (`link=` or a per-peer `topology`): what the bytes for a peer cross.
  none    nothing: the remote chunks are copied with the self chunk in one device copy (what any
          all_to_all_single costs at world size 1: the floor)
  device  a device-to-device copy on a link stream (the NVLink-class upper bound: about 2 TB/s on
          an H200, where NVLink carries 450 GB/s per direction)
  pcie    staged through pinned host memory on the copy engines: device-to-host of chunk i + 1
          runs beside host-to-device of chunk i on two streams, so both directions of the PCIe
          link are busy at once (the InfiniBand-class link: 45-48 GB/s each way on an H200, one
          400 Gb/s rail carries 50); on the CPU it degrades to a plain copy and says so
all_to_all_single, alltoall and all_gather move their peer bytes over the link; all_reduce,
broadcast and reduce_scatter are computed locally (no link cost: none of them is on a
dispatcher's path). The self chunk is always a local copy, as NCCL's is.

A topology is a function (rank, peer) -> link name on global ranks: `flat(link)` (every peer the
same) or `two_level(ranks_per_node)` (node peers over `device`, other nodes over `pcie`). Each
collective groups its peer chunks by link and hands each link its byte ranges.
"""
import warnings
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

LINKS = ("none", "device", "pcie")
Topology = Callable[[int, int], str]


# ---- topologies --------------------------------------------------------------------------------

def flat(link: str) -> Topology:
    """Every peer over the same link."""
    _check_link(link)
    return lambda rank, peer: link


def two_level(ranks_per_node: int, intra: str = "device", inter: str = "pcie") -> Topology:
    """Ranks of one node (global rank // ranks_per_node) over `intra`, other nodes over `inter`."""
    _check_link(intra), _check_link(inter)
    if ranks_per_node < 1:
        raise ValueError(f"loopback: ranks_per_node must be >= 1, got {ranks_per_node}")
    return lambda rank, peer: intra if rank // ranks_per_node == peer // ranks_per_node else inter


def _check_link(link):
    if link not in LINKS:
        raise ValueError(f"loopback: link must be one of {LINKS}, got {link!r}")


# ---- links -------------------------------------------------------------------------------------

Pair = Tuple[torch.Tensor, torch.Tensor]  # (destination, source): flat uint8 views of equal length


class Link:
    """Moves byte ranges from a send buffer to a receive buffer. move() is stream-ordered like an
    NCCL collective: it starts after the current stream's prior work, and the current stream's
    later work sees its result."""
    name = "none"

    def move(self, pairs: Sequence[Pair]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    @property
    def note(self) -> str:
        return ""


class DeviceLink(Link):
    """Per-peer device copies on a link stream of their own (CPU: plain copies)."""
    name = "device"

    def __init__(self):
        self._streams: Dict[int, torch.cuda.Stream] = {}

    def move(self, pairs):
        if not pairs or not pairs[0][0].is_cuda:
            return super().move(pairs)
        dev = pairs[0][0].device
        cur = torch.cuda.current_stream(dev)
        side = self._streams.get(dev.index)
        if side is None:
            side = self._streams[dev.index] = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        for dst, src in pairs:  # the caller may free them once it returns: the allocator must wait
            dst.record_stream(side), src.record_stream(side)
        cur.wait_stream(side)


class PcieLink(Link):
    """Send bytes device -> pinned host on one stream, host -> device on another, in chunks: the copy
    engines run D2H of chunk i + 1 while H2D of chunk i runs, so both PCIe directions carry bytes at
    once, as a NIC's send and receive do. One pinned staging buffer per device, grown to the
    largest message; a call's first D2H waits for the previous call's last H2D (its staging bytes).

    chunk_bytes: None picks total / 16 clamped to [1, 8] MiB (the pipeline fill is one chunk: at
    most 1/16 of the time; per-copy overhead is a few us against 20-180 us per chunk)."""
    name = "pcie"
    MIN_CHUNK, MAX_CHUNK, TARGET_CHUNKS = 1 << 20, 8 << 20, 16

    def __init__(self, chunk_bytes: Optional[int] = None):
        self.chunk_bytes = chunk_bytes
        self._state: Dict[int, dict] = {}
        self._warned = False

    def _chunk(self, total):
        if self.chunk_bytes:
            return int(self.chunk_bytes)
        return max(self.MIN_CHUNK, min(self.MAX_CHUNK, -(-total // self.TARGET_CHUNKS)))

    def staging(self, dev, nbytes) -> dict:
        st = self._state.get(dev.index)
        if st is None:
            st = self._state[dev.index] = dict(d2h=torch.cuda.Stream(dev), h2d=torch.cuda.Stream(dev), host=None)
        if st["host"] is None or st["host"].numel() < nbytes:
            # the old buffer's pending copies hold it through the host allocator's events
            st["host"] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return st

    def move(self, pairs):
        if not pairs:
            return
        if not pairs[0][0].is_cuda:
            if not self._warned:
                warnings.warn("fp8a2a.loopback: link 'pcie' on the CPU is a plain copy (no PCIe link to cross)",
                              stacklevel=3)
                self._warned = True
            return super().move(pairs)
        total = sum(src.numel() for _, src in pairs)
        dev = pairs[0][0].device
        st = self.staging(dev, total)
        d2h, h2d, host = st["d2h"], st["h2d"], st["host"]
        cur = torch.cuda.current_stream(dev)
        d2h.wait_stream(cur)  # the send bytes are ready
        d2h.wait_stream(h2d)  # the staging buffer is free (the previous call's H2D)
        h2d.wait_stream(cur)  # the receive buffer is allocated on the current stream
        chunk = self._chunk(total)
        off = 0
        for dst, src in pairs:
            n = src.numel()
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                stage = host[off + a:off + b]
                with torch.cuda.stream(d2h):
                    stage.copy_(src[a:b], non_blocking=True)
                    sent = d2h.record_event()
                h2d.wait_event(sent)
                with torch.cuda.stream(h2d):
                    dst[a:b].copy_(stage, non_blocking=True)
            off += n
        for dst, src in pairs:
            src.record_stream(d2h), dst.record_stream(h2d)
        cur.wait_stream(h2d)


def make_link(name: str, **kw) -> Link:
    _check_link(name)
    return {"none": Link, "device": DeviceLink, "pcie": PcieLink}[name](**kw)
