"""The constants the extension and Python share, mirroring csrc/fp8_common.h: the payload format and
the scale rule's numbers, the block size, the wire's granularity codes and the counts header's
columns. The only Python copy: every other module imports them from here, so that none writes the
bare numbers (csrc/fp8_common.h is the source; change both together)."""
from enum import IntEnum

import torch

FP8 = torch.float8_e4m3fn  # the payload (e4m3fn, saturating: fp8_common.h's e4m3_from_f32)
E4M3_MAX = 448.0  # kE4M3Max: the largest e4m3 value; the scale rule maps a row's amax onto it
AMAX_FLOOR = 2.0 ** -117  # kAmaxFloor: a nonzero amax below it counts as it (448 / amax would overflow)
BLOCK = 128  # kBlock: values per scale of block128 granularity


def fits_blocks(hidden) -> bool:
    """Whether rows of `hidden` values split into whole BLOCK-value blocks, as block128 granularity
    needs (csrc/ops.h checks the same). `hidden` may be a SymInt (the fakes)."""
    return hidden % BLOCK == 0


def blocks_error(hidden) -> str:
    """The error for rows of `hidden` values that block128 granularity cannot take (the extension's
    message)."""
    return f"fp8a2a: block128 granularity needs hidden % {BLOCK} == 0, got hidden={hidden}"


class Granularity(IntEnum):
    """What a row carries on the wire: e4m3 with one scale per row, per 128 columns or per tensor,
    or RAW: the activation's own bytes, unquantized (the BF16 fallback and the BF16 gradients)."""
    ROW = 0
    BLOCK128 = 1
    TENSOR = 2
    RAW = 3

    @property
    def label(self) -> str:
        """The user-facing name ('row', 'block128', 'tensor', 'raw')."""
        return self.name.lower()

    @classmethod
    def parse(cls, granularity, names_only: bool = False) -> "Granularity":
        """A quantized granularity from its name ('row', 'block128', 'tensor') or, unless
        names_only, its code."""
        if isinstance(granularity, str):
            found = {g.label: g for g in QUANTIZED}.get(granularity)
        elif names_only or isinstance(granularity, bool):
            found = None
        else:
            found = next((g for g in QUANTIZED if g == granularity), None)
        if found is None:
            raise ValueError(f"fp8a2a: granularity must be one of {sorted(LABELS)}, got {granularity!r}")
        return found


QUANTIZED = (Granularity.ROW, Granularity.BLOCK128, Granularity.TENSOR)
LABELS = tuple(g.label for g in QUANTIZED)  # the names users pass: 'row', 'block128', 'tensor'


class CountsCol(IntEnum):
    """Columns of the per-destination header of the counts exchange (int64); the counts of the
    local experts follow from column EXPERTS on (EXPERTS is the header's width)."""
    HIDDEN = 0
    TOPK = 1
    BAD_IDS = 2  # expert ids out of range on the sender; REJECTED: the sender rejected its input
    WIRE = 3  # the Granularity the sender packed with
    DTYPE = 4  # the sender's activation dtype (ACT_DTYPES: its code)
    GRAD = 5  # 1 if the sender's dispatch input requires grad (it will enter dispatch's backward), else 0
    ROWS = 6  # rows sent to this destination
    EXPERTS = 7


# csrc/fp8_common.h's enum ActDtype: the DTYPE column's codes (0: a uint8 view of unknown dtype)
ACT_DTYPES = {0: "bytes", 1: "float32", 2: "float16", 3: "bfloat16"}

REJECTED = -1  # in the BAD_IDS column (a count is >= 0): the sender failed before packing
