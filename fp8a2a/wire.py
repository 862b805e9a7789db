"""The codes the extension and Python share, mirroring csrc/fp8_common.h (enum Granularity,
enum CountsCol): one name for each, so that no module writes the bare numbers."""
from enum import IntEnum


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
    def parse(cls, granularity) -> "Granularity":
        """A quantized granularity from its name ('row', 'block128', 'tensor') or its code."""
        if isinstance(granularity, str):
            found = {g.label: g for g in QUANTIZED}.get(granularity)
        else:
            found = next((g for g in QUANTIZED if g == granularity and not isinstance(granularity, bool)), None)
        if found is None:
            raise ValueError(f"fp8a2a: granularity must be one of {sorted(g.label for g in QUANTIZED)}, "
                             f"got {granularity!r}")
        return found


QUANTIZED = (Granularity.ROW, Granularity.BLOCK128, Granularity.TENSOR)


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
