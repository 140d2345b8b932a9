"""Python mirror of the Ascend kernels' host tiling (ascend_kernels/rope_tiling.h).

Pure integer arithmetic, line for line the same as ``compute_rope_tiling`` in the C header, so the
backend can decide in Python, before any launch, whether a call fits the kernels (and the tests
can check the tiling's invariants over many shapes without an NPU). tests/test_ascend_tiling.py
compiles the header with g++ and checks that both produce identical structs.

No torch import here: this module is importable anywhere.
"""

from __future__ import annotations

import struct

TILING_VERSION = 2
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
    BAD_PARAMS: "unsupported dtype size, rotary_dim, head counts, op or angle source",
    BAD_STRIDES: "a row stride DataCopyPad cannot express (overlapping rows or gap >= 4 GiB)",
    UB_TOO_SMALL: "one token row does not fit in the unified buffer",
    BLOCK_LIMIT: "head_dim too long for one DataCopyPad block",
}

OP_ROTATE, OP_PROLOGUE, OP_PROLOGUE_GRAD = 0, 1, 2
ANGLES_TABLE, ANGLES_TOKEN, ANGLES_MROPE = 0, 1, 2
ANGLE_KINDS = {"table": ANGLES_TABLE, "token": ANGLES_TOKEN, "mrope": ANGLES_MROPE}
POS_OFFSET, POS_INT32, POS_INT64 = 0, 1, 2
TABLE_FP32, TABLE_FP16, TABLE_BF16 = 0, 1, 2

# The struct's fields, in the order of rope_tiling.h (int64 each).
INPUT_FIELDS = (
    "version", "op", "batch", "seq", "qHeads", "kHeads", "headDim", "rotaryDim", "elemSize",
    "interleaved", "inverse", "inplace",
    "qStrideB", "qStrideS", "qStrideH", "kStrideB", "kStrideS", "kStrideH",
    "qoStrideB", "qoStrideS", "qoStrideH", "koStrideB", "koStrideS", "koStrideH",
    "rotate", "angleKind", "posMode", "posStrideA", "posStrideB", "posStrideS", "posOffset",
    "tableRows", "tableDtype", "cosStrideB", "cosStrideR", "sinStrideB", "sinStrideR", "hasFreq",
    "attnFactorBits", "mropeT", "mropeH", "mropeW", "mropeInterleaved",
    "vStrideB", "vStrideS", "vStrideH", "voStrideB", "voStrideS", "voStrideH",
    "xqStrideB", "xqStrideS", "xqStrideH", "xkStrideB", "xkStrideS", "xkStrideH",
    "hasQWeight", "hasKWeight", "epsBits", "weightOffsetBits", "hasGradQ", "hasGradK", "hasGradV",
    "hasCache", "numSlots", "kcStrideS", "kcStrideH", "vcStrideS", "vcStrideH", "slotMode",
    "slotStrideB", "slotStrideS",
)
OUTPUT_FIELDS = (
    "halfDim", "rotPad", "halfPad", "tailDim", "tailPad", "rowPad", "totalRows", "blockDim",
    "formerNum", "formerRows", "tailRows", "tileRows", "rowBytes", "fixedBytes", "ubBytes", "ubSize",
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


def angle_row_bytes(t: dict) -> int:
    """The cos/sin stage's UB bytes per tile row (RotationStage and the sources)."""
    if not t["rotate"]:
        return 0
    w, hp = t["rowPad"], t["halfPad"]
    low = t["tableDtype"] != TABLE_FP32
    # compact cos/sin rows; C, S', expansion offsets, signs; partner offsets, gathered partners
    size = 2 * hp * 4 + 4 * w * 4 + 2 * w * 4
    if t["angleKind"] == ANGLES_MROPE:
        size += 2 * 3 * hp * 4 + hp * 4 + (2 * 3 * hp * 2 if low else 0)
    elif low:
        size += 2 * hp * 2
    return size


def row_bytes(t: dict) -> int:
    """UB bytes per tile row (the kernels' InitBuffer sizes that scale with tileRows)."""
    es, w = t["elemSize"], t["rowPad"]
    size = angle_row_bytes(t)
    if t["op"] == OP_ROTATE:
        # x/y queues, tail queue, float x/y for fp16/bf16
        return size + 2 * 2 * w * es + 2 * t["tailPad"] * es + (0 if es == 4 else 2 * w * 4)
    weights = t["hasQWeight"] + t["hasKWeight"]
    size += 3 * 2 * w * es + w * 4  # in, out and copy queues; float head rows
    if t["op"] == OP_PROLOGUE:
        if es == 2 and t["rotate"]:
            size += w * 4  # rotated rows before the cast
    elif t["rotate"]:
        size += w * 4  # the rotated gradient
    if weights:
        # weight tables, broadcast offsets, products, 1/rms broadcast, statistics and ones
        size += weights * w * 4 + 3 * w * 4 + 2 * BLOCK_BYTES
        if t["op"] == OP_PROLOGUE_GRAD:
            size += w * 4 + weights * w * 4  # x in float, weight-gradient sums
    return size


def fixed_bytes(t: dict) -> int:
    """UB bytes that do not scale with the tile."""
    size = 2 * BLOCK_BYTES if t["rotate"] else 0
    if t["op"] != OP_ROTATE:
        size += BLOCK_BYTES  # the zero block after the float head rows
        if t["hasQWeight"] + t["hasKWeight"]:
            size += t["rowPad"] * 4  # ReduceSum's work area
    return size


def compute_tiling(params: dict, ub_size: int, core_num: int) -> dict:
    """The filled tiling dict for input fields ``params``; raises TilingError where the C code
    returns a non-zero status (the C code then leaves the struct partly filled)."""
    t = {name: 0 for name in FIELDS}
    t.update({k: int(v) for k, v in params.items()})
    t["version"] = TILING_VERSION
    t["ubSize"] = ub_size
    op = t["op"]
    if op not in (OP_ROTATE, OP_PROLOGUE, OP_PROLOGUE_GRAD):
        raise TilingError(BAD_PARAMS)
    if t["elemSize"] not in (2, 4):
        raise TilingError(BAD_PARAMS)
    r, d = t["rotaryDim"], t["headDim"]
    if r < 0 or r > d or (t["rotate"] and (r == 0 or r % 2 != 0)):
        raise TilingError(BAD_PARAMS)
    if t["batch"] < 0 or t["seq"] < 0 or t["qHeads"] < 1 or t["kHeads"] < 0 or core_num < 1:
        raise TilingError(BAD_PARAMS)
    if op != OP_ROTATE and t["kHeads"] < 1:
        raise TilingError(BAD_PARAMS)
    if op == OP_ROTATE and not t["rotate"]:
        raise TilingError(BAD_PARAMS)
    if t["tableRows"] < 0 or t["angleKind"] not in (ANGLES_TABLE, ANGLES_TOKEN, ANGLES_MROPE) \
            or t["tableDtype"] not in (TABLE_FP32, TABLE_FP16, TABLE_BF16):
        raise TilingError(BAD_PARAMS)
    if t["angleKind"] == ANGLES_MROPE and (
            min(t["mropeT"], t["mropeH"], t["mropeW"]) < 0
            or t["mropeT"] + t["mropeH"] + t["mropeW"] != r // 2 or t["posMode"] == POS_OFFSET):
        raise TilingError(BAD_PARAMS)
    es = t["elemSize"]
    per_block = BLOCK_BYTES // es
    t["halfDim"] = r // 2
    t["rotPad"] = _round_up(r, per_block)
    t["halfPad"] = _round_up(t["halfDim"], 8 if t["tableDtype"] == TABLE_FP32 else 16)
    t["tailDim"] = d - r
    if op == OP_ROTATE:
        t["tailPad"] = _round_up(t["tailDim"], per_block) if t["tailDim"] > 0 and not t["inplace"] else 0
        t["rowPad"] = t["rotPad"]
    else:
        t["tailPad"] = 0
        t["rowPad"] = _round_up(d, per_block)
    if (r * es > MAX_BLOCK_LEN or t["tailDim"] * es > MAX_BLOCK_LEN) if op == OP_ROTATE \
            else d * es > MAX_BLOCK_LEN:
        raise TilingError(BLOCK_LIMIT)
    if op == OP_ROTATE:
        for length in (r, t["tailDim"] if t["tailPad"] > 0 else 0):
            if length == 0:
                continue
            strides = [t["qStrideS"], t["qoStrideS"]]
            if t["kHeads"] > 0:
                strides += [t["kStrideS"], t["koStrideS"]]
            if not all(_stride_ok(s, length, es, t["seq"]) for s in strides):
                raise TilingError(BAD_STRIDES)
    else:
        grad = op == OP_PROLOGUE_GRAD
        rows = [("qStrideS", t["hasGradQ"] if grad else 1), ("kStrideS", t["hasGradK"] if grad else 1),
                ("vStrideS", t["hasGradV"] if grad else 1), ("qoStrideS", 1), ("koStrideS", 1),
                ("voStrideS", grad or not t["inplace"]), ("xqStrideS", grad and t["hasQWeight"]),
                ("xkStrideS", grad and t["hasKWeight"])]
        if not all(_stride_ok(t[name], d, es, t["seq"]) for name, used in rows if used):
            raise TilingError(BAD_STRIDES)
        if min(t[k] for k in ("vStrideB", "vStrideH", "voStrideB", "voStrideH", "xqStrideB", "xqStrideH",
                              "xkStrideB", "xkStrideH", "kcStrideS", "kcStrideH", "vcStrideS", "vcStrideH",
                              "slotStrideB", "slotStrideS", "numSlots")) < 0:
            raise TilingError(BAD_STRIDES)
    if min(t[k] for k in ("qStrideB", "qStrideH", "qoStrideB", "qoStrideH", "kStrideB", "kStrideH",
                          "koStrideB", "koStrideH", "posStrideA", "posStrideB", "posStrideS",
                          "cosStrideB", "cosStrideR", "sinStrideB", "sinStrideR")) < 0:
        raise TilingError(BAD_STRIDES)
    t["totalRows"] = t["batch"] * t["seq"]
    t["rowBytes"] = row_bytes(t)
    t["fixedBytes"] = fixed_bytes(t)
    if t["totalRows"] == 0:
        t.update(blockDim=0, formerNum=0, formerRows=0, tailRows=0, tileRows=0, ubBytes=0)
        return t
    t["blockDim"] = min(t["totalRows"], core_num)
    t["tailRows"] = t["totalRows"] // t["blockDim"]
    t["formerNum"] = t["totalRows"] % t["blockDim"]
    t["formerRows"] = t["tailRows"] + (1 if t["formerNum"] > 0 else 0)
    avail = ub_size - UB_RESERVE - t["fixedBytes"]
    fit = avail // t["rowBytes"] if avail > 0 else 0
    if fit < 1:
        raise TilingError(UB_TOO_SMALL)
    widest = t["rowPad"]
    if t["rotate"] and t["angleKind"] == ANGLES_MROPE:
        widest = max(widest, 3 * t["halfPad"])
    vec_rows = MAX_VEC_BYTES // (widest * 4)
    if vec_rows < 1:
        raise TilingError(UB_TOO_SMALL)
    t["tileRows"] = min(fit, t["formerRows"], MAX_TILE_ROWS, vec_rows)
    t["ubBytes"] = t["tileRows"] * t["rowBytes"] + t["fixedBytes"]
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
