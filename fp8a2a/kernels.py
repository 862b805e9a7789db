"""Where the expert GEMMs and their weight cache find their shared kernels: the Triton kernels, loaded
lazily (CPU machines need no Triton), whether a tensor can take them, and the extension's row
quantization. A leaf: it imports no other module of the expert path, so experts.py and
weight_cache.py both build on it and neither imports the other's internals."""
import functools
import importlib

import torch

from . import ops
from .wire import Granularity


@functools.lru_cache(None)
def triton_kernels():
    """fp8a2a.triton_kernels, or None where Triton is missing (CPU machines)."""
    try:
        return importlib.import_module(".triton_kernels", __package__)
    except ImportError:
        return None


def capability(device) -> tuple:
    """torch.cuda.get_device_capability(device), asked once per device (the GEMM paths ask per call)."""
    return _properties(_index(device))[0]


def sm_count(device) -> int:
    """The device's multiprocessors, asked once per device."""
    return _properties(_index(device))[1]


def _index(device) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


@functools.lru_cache(None)
def _properties(index: int) -> tuple:
    return torch.cuda.get_device_capability(index), torch.cuda.get_device_properties(index).multi_processor_count


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of a CUDA device (a CPU build has
    no such query: False off CUDA). Host values read now would be frozen into every replay."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def constant(key, make):
    """make(), a small tensor that never changes, made once per key. One made inside a CUDA graph
    capture is not kept: its values are written only by the graph's replays."""
    out = _CONSTANTS.get(key)
    if out is None:
        out = make()
        if not capturing(out.device):
            _CONSTANTS[key] = out
    return out


_CONSTANTS = {}


def triton_ok(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on t: a CUDA tensor, with Triton installed."""
    return t.is_cuda and triton_kernels() is not None


def quantize_rows(x: torch.Tensor):
    """(e4m3 [M, K], scale [M]) of a float [M, K] by the package rule: the extension's quantize kernel."""
    return ops.quantize(x.contiguous(), Granularity.ROW, None)
