"""Python mirror of the Ascend kernels' host tiling (ascend_kernels/rope_tiling.h).

Pure integer arithmetic, line for line the same as ``compute_rope_tiling`` in the C header, so the
backend can decide in Python, before any launch, whether a call fits the kernels (and the tests
can check the tiling's invariants over many shapes without an NPU). tests/test_ascend_tiling.py
compiles the header with g++ and checks that both produce identical structs.

No torch import here: this module is importable anywhere.
"""

from __future__ import annotations

import struct

TILING_VERSION = 1
UB_RESERVE = 2048
BLOCK_BYTES = 32
MAX_BLOCK_COUNT = 4095
MAX_BLOCK_LEN = 2097151
MAX_STRIDE = 4294967295
MAX_TILE_ROWS = 4095
MAX_VEC_BYTES = 65280  # one vector instruction: 255 repeats of 256 bytes

OK, BAD_PARAMS, BAD_STRIDES, UB_TOO_SMALL, BLOCK_LIMIT = range(5)
STATUS_TEXT = {
    OK: "ok",
    BAD_PARAMS: "unsupported dtype size, rotary_dim or head counts",
    BAD_STRIDES: "a row stride DataCopyPad cannot express (overlapping rows or gap >= 4 GiB)",
    UB_TOO_SMALL: "one token row does not fit in the unified buffer",
    BLOCK_LIMIT: "head_dim too long for one DataCopyPad block",
}

POS_OFFSET, POS_INT32, POS_INT64 = 0, 1, 2

# The struct's fields, in the order of rope_tiling.h (int64 each).
INPUT_FIELDS = (
    "version", "batch", "seq", "qHeads", "kHeads", "headDim", "rotaryDim", "elemSize",
    "interleaved", "inverse", "inplace",
    "qStrideB", "qStrideS", "qStrideH", "kStrideB", "kStrideS", "kStrideH",
    "qoStrideB", "qoStrideS", "qoStrideH", "koStrideB", "koStrideS", "koStrideH",
    "posMode", "posStrideB", "posStrideS", "posOffset", "tableRows", "hasFreq", "attnFactorBits",
)
OUTPUT_FIELDS = (
    "halfDim", "rotPad", "halfPad", "tailDim", "tailPad", "totalRows", "blockDim", "formerNum",
    "formerRows", "tailRows", "tileRows", "rowBytes", "ubBytes", "ubSize",
)
FIELDS = INPUT_FIELDS + OUTPUT_FIELDS


class TilingError(ValueError):
    def __init__(self, status: int):
        super().__init__(STATUS_TEXT.get(status, f"status {status}"))
        self.status = status


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _stride_ok(stride: int, length: int, elem_size: int, seq: int) -> bool:
    if seq <= 1:
        return True
    if stride < length:
        return False
    return (stride - length) * elem_size <= MAX_STRIDE


def row_bytes(t: dict) -> int:
    """UB bytes per tile row (the kernel's InitBuffer sizes divided by tileRows), by stage."""
    es = t["elemSize"]
    # cos/sin stage: compact cos/sin rows; full-width C, S', expansion offsets, signs
    compact = 2 * t["halfPad"] * 4
    expanded = 4 * t["rotPad"] * 4
    # rotate stage: x/y queues, tail queue, partner offsets + rotated x, float x/y for fp16/bf16
    io = 2 * 2 * t["rotPad"] * es
    tail = 2 * t["tailPad"] * es
    rotate = 2 * t["rotPad"] * 4
    cast = 0 if es == 4 else 2 * t["rotPad"] * 4
    return compact + expanded + io + tail + rotate + cast


def compute_tiling(params: dict, ub_size: int, core_num: int) -> dict:
    """The filled tiling dict for input fields ``params``; raises TilingError where the C code
    returns a non-zero status (the C code then leaves the struct partly filled)."""
    t = {name: 0 for name in FIELDS}
    t.update({k: int(v) for k, v in params.items()})
    t["version"] = TILING_VERSION
    t["ubSize"] = ub_size
    if t["elemSize"] not in (2, 4):
        raise TilingError(BAD_PARAMS)
    r, d = t["rotaryDim"], t["headDim"]
    if r <= 0 or r % 2 != 0 or r > d:
        raise TilingError(BAD_PARAMS)
    if t["batch"] < 0 or t["seq"] < 0 or t["qHeads"] < 1 or t["kHeads"] < 0 or core_num < 1:
        raise TilingError(BAD_PARAMS)
    if t["tableRows"] < 0:
        raise TilingError(BAD_PARAMS)
    es = t["elemSize"]
    per_block = BLOCK_BYTES // es
    t["halfDim"] = r // 2
    t["rotPad"] = _round_up(r, per_block)
    t["halfPad"] = _round_up(t["halfDim"], 8)
    t["tailDim"] = d - r
    t["tailPad"] = _round_up(t["tailDim"], per_block) if t["tailDim"] > 0 and not t["inplace"] else 0
    if r * es > MAX_BLOCK_LEN or t["tailDim"] * es > MAX_BLOCK_LEN:
        raise TilingError(BLOCK_LIMIT)
    for length in (r, t["tailDim"] if t["tailPad"] > 0 else 0):
        if length == 0:
            continue
        strides = [t["qStrideS"], t["qoStrideS"]]
        if t["kHeads"] > 0:
            strides += [t["kStrideS"], t["koStrideS"]]
        if not all(_stride_ok(s, length, es, t["seq"]) for s in strides):
            raise TilingError(BAD_STRIDES)
    if min(t[k] for k in ("qStrideB", "qStrideH", "qoStrideB", "qoStrideH", "kStrideB", "kStrideH",
                          "koStrideB", "koStrideH", "posStrideB", "posStrideS")) < 0:
        raise TilingError(BAD_STRIDES)
    t["totalRows"] = t["batch"] * t["seq"]
    if t["totalRows"] == 0:
        t.update(blockDim=0, formerNum=0, formerRows=0, tailRows=0, tileRows=0, ubBytes=0)
        t["rowBytes"] = row_bytes(t)
        return t
    t["blockDim"] = min(t["totalRows"], core_num)
    t["tailRows"] = t["totalRows"] // t["blockDim"]
    t["formerNum"] = t["totalRows"] % t["blockDim"]
    t["formerRows"] = t["tailRows"] + (1 if t["formerNum"] > 0 else 0)
    t["rowBytes"] = row_bytes(t)
    avail = ub_size - UB_RESERVE
    fit = avail // t["rowBytes"] if avail > 0 else 0
    if fit < 1:
        raise TilingError(UB_TOO_SMALL)
    vec_rows = MAX_VEC_BYTES // (t["rotPad"] * 4)
    if vec_rows < 1:
        raise TilingError(UB_TOO_SMALL)
    t["tileRows"] = min(fit, t["formerRows"], MAX_TILE_ROWS, vec_rows)
    t["ubBytes"] = t["tileRows"] * t["rowBytes"]
    return t


def core_rows(t: dict, block_idx: int) -> tuple[int, int]:
    """(first row, row count) of core ``block_idx``: what the kernel's Init computes."""
    if block_idx < t["formerNum"]:
        return block_idx * t["formerRows"], t["formerRows"]
    start = t["formerNum"] * t["formerRows"] + (block_idx - t["formerNum"]) * t["tailRows"]
    return start, t["tailRows"]


def tiles(t: dict, block_idx: int) -> list[tuple[int, int]]:
    """(first row, rows) of each UB pass of core ``block_idx``."""
    start, count = core_rows(t, block_idx)
    out, done = [], 0
    while done < count:
        n = min(t["tileRows"], count - done)
        out.append((start + done, n))
        done += n
    return out


def segments(t: dict, row0: int, n: int) -> list[tuple[int, int, int]]:
    """(batch, first seq index, rows) runs of a tile that stay inside one batch entry: each is one
    strided DataCopyPad per head."""
    out, row = [], row0
    while row < row0 + n:
        b, s = divmod(row, t["seq"])
        length = min(t["seq"] - s, row0 + n - row)
        out.append((b, s, length))
        row += length
    return out


def pack(t: dict) -> bytes:
    """The struct's bytes, as the host glue copies them to the device (little-endian int64)."""
    return struct.pack(f"<{len(FIELDS)}q", *(t[name] for name in FIELDS))


def float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]
