"""The Ascend kernels' tiling as a tested module (no NPU needed).

* backends/ascend_backend/tiling.py (Python mirror) == ascend_kernels/rope_tiling.h
  (compute_rope_tiling, compiled with g++ via the CPU simulation library), field for field;
* invariants over many shapes, dtypes, UB sizes and core counts (hypothesis): every row covered
  exactly once, buffers within the UB, 32-byte aligned buffers, DataCopyPad limits;
* golden cases computed by hand.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_ops_backends.ascend_backend import tiling as tl

from ascend import fakes

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "ascend_kernels"


@pytest.fixture(scope="module")
def sim():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    return fakes.load_sim()


def test_field_order_matches_header():
    text = (KERNELS / "rope_tiling.h").read_text()
    body = text[text.index("typedef struct RopeTiling {"): text.index("} RopeTiling;")]
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in re.findall(r"int64_t\s+([^;]+);", body):
        names += [n.strip() for n in decl.split(",")]
    assert tuple(names) == tl.FIELDS


def test_constants_match_header():
    text = (KERNELS / "rope_tiling.h").read_text()
    consts = dict(re.findall(r"#define (ROPE_[A-Z_]+) (\d+)", text))
    assert int(consts["ROPE_TILING_VERSION"]) == tl.TILING_VERSION
    assert int(consts["ROPE_UB_RESERVE"]) == tl.UB_RESERVE
    assert int(consts["ROPE_BLOCK_BYTES"]) == tl.BLOCK_BYTES
    assert int(consts["ROPE_MAX_BLOCK_COUNT"]) == tl.MAX_BLOCK_COUNT
    assert int(consts["ROPE_MAX_BLOCK_LEN"]) == tl.MAX_BLOCK_LEN
    assert int(consts["ROPE_MAX_TILE_ROWS"]) == tl.MAX_TILE_ROWS
    assert int(consts["ROPE_MAX_VEC_BYTES"]) == tl.MAX_VEC_BYTES


UB_SIZES = [196608, 262144, 260096, 65536, 16384, 4096, 1 << 20]
CORES = [1, 2, 7, 20, 24, 40, 48, 64]


@st.composite
def shapes(draw):
    es = draw(st.sampled_from([2, 4]))
    d = draw(st.integers(1, 300)) * 2 if draw(st.booleans()) else draw(st.sampled_from([2, 14, 64, 80, 128, 256, 576, 1022]))
    r = draw(st.integers(1, d // 2)) * 2
    batch = draw(st.integers(0, 9))
    seq = draw(st.integers(0, 3000)) if draw(st.booleans()) else draw(st.integers(0, 40))
    hq = draw(st.integers(1, 40))
    op = draw(st.sampled_from([tl.OP_ROTATE, tl.OP_ROTATE, tl.OP_PROLOGUE, tl.OP_PROLOGUE_GRAD]))
    hk = draw(st.integers(0 if op == tl.OP_ROTATE else 1, 8))
    inplace = draw(st.booleans()) and op != tl.OP_PROLOGUE_GRAD
    layout = draw(st.sampled_from(["bshd", "sbhd", "bhsd", "thd", "packed"]))
    if op != tl.OP_ROTATE:
        layout = draw(st.sampled_from(["thd", "packed"]))  # slices of qkv rows

    def strides(h):
        if layout == "bshd":
            return seq * h * d, h * d, d
        if layout == "sbhd":
            return h * d, batch * h * d, d
        if layout == "bhsd":
            return h * seq * d, d, seq * d
        if layout == "thd":
            return 0, h * d, d
        return seq * (hq + 2 * hk) * d, (hq + 2 * hk) * d, d  # slices of a packed qkv tensor

    p = {"op": op, "batch": 1 if layout == "thd" else batch, "seq": seq, "qHeads": hq, "kHeads": hk,
         "headDim": d, "rotaryDim": r, "elemSize": es, "interleaved": int(draw(st.booleans())),
         "inverse": int(draw(st.booleans())), "inplace": int(inplace),
         "rotate": 1 if op == tl.OP_ROTATE else int(draw(st.booleans()))}
    names = ["q", "k", "qo", "ko"] + (["v", "vo", "xq", "xk"] if op != tl.OP_ROTATE else [])
    for name in names:
        p[name + "StrideB"], p[name + "StrideS"], p[name + "StrideH"] = strides(max(hk if "k" in name else hq, 1))
    kind = draw(st.sampled_from([tl.ANGLES_TABLE, tl.ANGLES_TOKEN, tl.ANGLES_MROPE]))
    pos_mode = tl.POS_OFFSET if kind == tl.ANGLES_TOKEN else draw(st.sampled_from([tl.POS_OFFSET, tl.POS_INT32,
                                                                                     tl.POS_INT64]))
    if kind == tl.ANGLES_MROPE and pos_mode == tl.POS_OFFSET:
        pos_mode = tl.POS_INT64
    half = r // 2
    t_sec = draw(st.integers(0, half))
    h_sec = draw(st.integers(0, half - t_sec))
    p.update(angleKind=kind, posMode=pos_mode, posStrideA=seq * max(batch, 1) if kind == tl.ANGLES_MROPE else 0,
             posStrideB=0 if pos_mode == tl.POS_OFFSET else draw(st.sampled_from([0, seq])),
             posStrideS=0 if pos_mode == tl.POS_OFFSET else 1, posOffset=draw(st.integers(-5, 10**6)),
             tableRows=0 if kind == tl.ANGLES_TOKEN else draw(st.integers(0, 1 << 20)),
             tableDtype=draw(st.sampled_from([tl.TABLE_FP32, tl.TABLE_FP16, tl.TABLE_BF16])),
             cosStrideB=seq * half if kind == tl.ANGLES_TOKEN else 0, cosStrideR=draw(st.sampled_from([half, r, 0])),
             sinStrideB=seq * half if kind == tl.ANGLES_TOKEN else 0, sinStrideR=half,
             hasFreq=int(draw(st.booleans())), attnFactorBits=tl.float_bits(1.0),
             mropeT=t_sec if kind == tl.ANGLES_MROPE else 0, mropeH=h_sec if kind == tl.ANGLES_MROPE else 0,
             mropeW=half - t_sec - h_sec if kind == tl.ANGLES_MROPE else 0,
             mropeInterleaved=int(draw(st.booleans())))
    if op != tl.OP_ROTATE:
        p.update(hasQWeight=int(draw(st.booleans())), hasKWeight=int(draw(st.booleans())),
                 epsBits=tl.float_bits(1e-6), weightOffsetBits=tl.float_bits(1.0))
    if op == tl.OP_PROLOGUE_GRAD:
        p.update(hasGradQ=int(draw(st.booleans())), hasGradK=int(draw(st.booleans())),
                 hasGradV=int(draw(st.booleans())))
    if op == tl.OP_PROLOGUE and draw(st.booleans()):
        p.update(hasCache=1, numSlots=draw(st.integers(0, 5000)), kcStrideS=hk * d, kcStrideH=d, vcStrideS=hk * d,
                 vcStrideH=d, slotMode=draw(st.sampled_from([tl.POS_INT32, tl.POS_INT64])), slotStrideB=seq,
                 slotStrideS=1)
    return p


def _c_vs_py(sim, p, ub, cores):
    status, c = sim.c_tiling(p, tl.FIELDS, ub, cores)
    try:
        py = tl.compute_tiling(p, ub, cores)
    except tl.TilingError as e:
        assert status == e.status, (status, e.status, p)
        return None
    assert status == tl.OK, (status, p)
    assert c == py
    return py


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=shapes(), ub=st.sampled_from(UB_SIZES), cores=st.sampled_from(CORES))
def test_python_mirror_equals_c_tiling(sim, p, ub, cores):
    _c_vs_py(sim, p, ub, cores)


def check_invariants(t: dict, cores: int) -> None:
    es = t["elemSize"]
    rotation = t["op"] == tl.OP_ROTATE
    # Cores and rows.
    assert 0 <= t["blockDim"] <= cores
    if t["totalRows"] == 0:
        assert t["blockDim"] == 0
        return
    assert t["blockDim"] >= 1
    covered = []
    for blk in range(t["blockDim"]):
        start, count = tl.core_rows(t, blk)
        assert count >= 1
        for row0, n in tl.tiles(t, blk):
            assert 1 <= n <= t["tileRows"] <= tl.MAX_TILE_ROWS
            covered.extend(range(row0, row0 + n))
            # One DataCopyPad per segment and head: its limits.
            segs = tl.segments(t, row0, n)
            assert sum(s[2] for s in segs) == n
            for b, s, length in segs:
                assert 0 <= b < t["batch"] and 0 <= s and s + length <= t["seq"]
                assert 1 <= length <= tl.MAX_BLOCK_COUNT
    assert covered == list(range(t["totalRows"])), "rows not covered exactly once, in order"
    rows = [tl.core_rows(t, b)[1] for b in range(t["blockDim"])]
    assert max(rows) - min(rows) <= 1, "unbalanced split"
    # UB: everything the kernel allocates fits, every buffer is a whole number of 32-byte blocks.
    assert t["ubBytes"] == t["tileRows"] * t["rowBytes"] + t["fixedBytes"]
    assert t["ubBytes"] + tl.UB_RESERVE <= t["ubSize"]
    assert (t["rotPad"] * es) % 32 == 0 and t["rotPad"] >= t["rotaryDim"] and t["rotPad"] - t["rotaryDim"] < 32 // es
    table_es = 4 if t["tableDtype"] == tl.TABLE_FP32 else 2
    assert (t["halfPad"] * table_es) % 32 == 0 and t["halfPad"] >= t["halfDim"]
    assert (t["rowPad"] * es) % 32 == 0 and (t["rowPad"] * 4) % 32 == 0
    assert t["rowPad"] == (t["rotPad"] if rotation else -(-t["headDim"] // (32 // es)) * (32 // es))
    assert (t["tailPad"] * es) % 32 == 0
    if rotation and t["tailDim"] > 0 and not t["inplace"]:
        assert t["tailPad"] >= t["tailDim"]
    else:
        assert t["tailPad"] == 0
    # DataCopyPad: block lengths and GM strides fit their fields.
    if rotation:
        assert t["rotaryDim"] * es <= tl.MAX_BLOCK_LEN and t["tailDim"] * es <= tl.MAX_BLOCK_LEN
        if t["seq"] > 1:
            lens = [t["rotaryDim"]] + ([t["tailDim"]] if t["tailPad"] else [])
            names = ["qStrideS", "qoStrideS"] + (["kStrideS", "koStrideS"] if t["kHeads"] else [])
            for length in lens:
                for name in names:
                    assert 0 <= (t[name] - length) * es <= tl.MAX_STRIDE
    else:
        assert t["headDim"] * es <= tl.MAX_BLOCK_LEN
        if t["seq"] > 1:
            for name in ("qStrideS", "kStrideS", "qoStrideS", "koStrideS"):
                grad_input = t["op"] == tl.OP_PROLOGUE_GRAD and name in ("qStrideS", "kStrideS")
                if not grad_input or t["hasGrad" + name[0].upper()]:
                    assert 0 <= (t[name] - t["headDim"]) * es <= tl.MAX_STRIDE
    # Every vector instruction (a whole tile of floats) stays within 255 repeats of 256 bytes.
    assert t["tileRows"] * t["rowPad"] * 4 <= 255 * 256
    if t["rotate"] and t["angleKind"] == tl.ANGLES_MROPE:
        assert t["tileRows"] * 3 * t["halfPad"] * 4 <= 255 * 256
    # Gather byte offsets (uint32) stay inside the tile buffers.
    assert t["tileRows"] * t["rowPad"] * 4 < 2**32
    assert 2 * t["tileRows"] * t["halfPad"] * 4 < 2**32


@settings(max_examples=400, deadline=None)
@given(p=shapes(), ub=st.sampled_from(UB_SIZES), cores=st.sampled_from(CORES))
def test_invariants(p, ub, cores):
    try:
        t = tl.compute_tiling(p, ub, cores)
    except tl.TilingError as e:
        # Refusals must be justified.
        if e.status == tl.UB_TOO_SMALL:
            t = {**{k: 0 for k in tl.FIELDS}, **p}
            es = p["elemSize"]
            pb = 32 // es
            rotation = p["op"] == tl.OP_ROTATE
            t["rotPad"] = -(-p["rotaryDim"] // pb) * pb
            t["rowPad"] = t["rotPad"] if rotation else -(-p["headDim"] // pb) * pb
            t["halfPad"] = -(-(p["rotaryDim"] // 2) // (8 if p["tableDtype"] == tl.TABLE_FP32 else 16)) * (
                8 if p["tableDtype"] == tl.TABLE_FP32 else 16)
            tail = p["headDim"] - p["rotaryDim"]
            t["tailPad"] = -(-tail // pb) * pb if tail and not p["inplace"] and rotation else 0
            widest = max(t["rowPad"], 3 * t["halfPad"] if p["angleKind"] == tl.ANGLES_MROPE and p["rotate"] else 0)
            assert tl.row_bytes(t) + tl.fixed_bytes(t) > ub - tl.UB_RESERVE or widest * 4 > tl.MAX_VEC_BYTES
        elif e.status == tl.BAD_STRIDES:
            assert p["seq"] > 1
        return
    check_invariants(t, cores)


def _params(**kw):
    p = {"batch": 1, "seq": 64, "qHeads": 2, "kHeads": 0, "headDim": 64, "rotaryDim": 64, "elemSize": 2,
         "interleaved": 0, "inverse": 0, "inplace": 0, "rotate": 1, "posMode": 0, "posStrideB": 0, "posStrideS": 0,
         "posOffset": 0, "tableRows": 4096, "cosStrideR": 32, "sinStrideR": 32, "hasFreq": 1,
         "attnFactorBits": tl.float_bits(1.0)}
    p.update(kw)
    h, d, s = p["qHeads"], p["headDim"], p["seq"]
    for name in ("q", "qo"):
        p.setdefault(name + "StrideB", s * h * d)
        p.setdefault(name + "StrideS", h * d)
        p.setdefault(name + "StrideH", d)
    for name in ("k", "ko"):
        p.setdefault(name + "StrideB", 0)
        p.setdefault(name + "StrideS", 0)
        p.setdefault(name + "StrideH", 0)
    return p


def test_golden_fp16_d64_40_cores(sim):
    # rotPad 64, halfPad 32; per row: io 2*2*64*2=512, cs 2*32*4=256, f32 6*64*4=1536, cast 512.
    t = _c_vs_py(sim, _params(), 196608, 40)
    assert (t["rotPad"], t["halfPad"], t["tailPad"], t["rowBytes"]) == (64, 32, 0, 2816)
    # 64 rows on 40 cores: 24 cores take 2 rows, 16 take 1; tiles of 2 rows.
    assert (t["blockDim"], t["formerNum"], t["formerRows"], t["tailRows"], t["tileRows"]) == (40, 24, 2, 1, 2)
    assert t["fixedBytes"] == 64 and t["ubBytes"] == 2 * 2816 + 64  # + the two constant blocks


def test_golden_fp32_partial_rotary_many_rows(sim):
    # D 128, r 64, not in place: tail 64 floats. Per row: io 2*2*64*4=1024, tail 2*64*4=512,
    # cs 2*32*4=256, f32 6*64*4=1536, no cast buffers -> 3328 bytes.
    t = _c_vs_py(sim, _params(batch=4, seq=1000, qHeads=32, kHeads=8, headDim=128, rotaryDim=64, elemSize=4,
                              kStrideB=1000 * 8 * 128, kStrideS=8 * 128, kStrideH=128,
                              koStrideB=1000 * 8 * 128, koStrideS=8 * 128, koStrideH=128), 262144, 48)
    assert (t["rotPad"], t["halfPad"], t["tailDim"], t["tailPad"], t["rowBytes"]) == (64, 32, 64, 64, 3328)
    # 4000 rows on 48 cores: 4000 = 48*83 + 16 -> 16 cores with 84, 32 with 83.
    assert (t["blockDim"], t["formerNum"], t["formerRows"], t["tailRows"]) == (48, 16, 84, 83)
    # (262144 - 2048 - 64) // 3328 = 78 rows per tile.
    assert t["tileRows"] == 78 and t["ubBytes"] == 78 * 3328 + 64


def test_golden_unaligned_bf16(sim):
    # D 14, r 10 (unaligned halves): rotPad 16, halfPad 8, tail 4 -> tailPad 16 elements.
    t = _c_vs_py(sim, _params(seq=46, qHeads=3, headDim=14, rotaryDim=10, elemSize=2, interleaved=1), 196608, 40)
    assert (t["rotPad"], t["halfPad"], t["tailDim"], t["tailPad"]) == (16, 8, 4, 16)
    assert (t["blockDim"], t["formerNum"], t["formerRows"], t["tailRows"], t["tileRows"]) == (40, 6, 2, 1, 2)


def test_golden_inplace_drops_tail(sim):
    t = _c_vs_py(sim, _params(headDim=128, rotaryDim=64, inplace=1), 196608, 40)
    assert t["tailDim"] == 64 and t["tailPad"] == 0


def test_ub_size_is_a_runtime_input(sim):
    small = _c_vs_py(sim, _params(seq=5000), 16384, 1)
    big = _c_vs_py(sim, _params(seq=5000), 262144, 1)
    assert small["ubSize"] == 16384 and big["ubSize"] == 262144
    assert small["tileRows"] == (16384 - 2048 - 64) // 2816 and big["tileRows"] == (262144 - 2048 - 64) // 2816


def test_zero_rows(sim):
    t = _c_vs_py(sim, _params(seq=0), 196608, 40)
    assert t["blockDim"] == 0 and t["tileRows"] == 0


def test_refusals(sim):
    with pytest.raises(tl.TilingError) as e:
        tl.compute_tiling(_params(headDim=30000, rotaryDim=30000), 196608, 40)
    assert e.value.status == tl.UB_TOO_SMALL
    assert sim.c_tiling(_params(headDim=30000, rotaryDim=30000), tl.FIELDS, 196608, 40)[0] == tl.UB_TOO_SMALL
    # Rows that overlap (stride smaller than the rotary width) cannot be one strided copy.
    with pytest.raises(tl.TilingError) as e:
        tl.compute_tiling(_params(qStrideS=32), 196608, 40)
    assert e.value.status == tl.BAD_STRIDES
    for bad in (dict(rotaryDim=63), dict(rotaryDim=0), dict(rotaryDim=66), dict(elemSize=8)):
        with pytest.raises(tl.TilingError) as e:
            tl.compute_tiling(_params(**bad), 196608, 40)
        assert e.value.status == tl.BAD_PARAMS
    with pytest.raises(tl.TilingError) as e:
        tl.compute_tiling(_params(headDim=2 * 1048576, rotaryDim=1048576 * 2), 1 << 40, 40)
    assert e.value.status == tl.BLOCK_LIMIT


def test_pack_roundtrip():
    t = tl.compute_tiling(_params(), 196608, 40)
    raw = tl.pack(t)
    assert len(raw) == 8 * len(tl.FIELDS)
    import struct

    assert dict(zip(tl.FIELDS, struct.unpack(f"<{len(tl.FIELDS)}q", raw))) == t


def _prologue_params(op, **kw):
    hq, hk, d = 16, 4, 128
    width = (hq + 2 * hk) * d
    p = _params(op=op, seq=4096, qHeads=hq, kHeads=hk, headDim=d, rotaryDim=d, hasQWeight=1, hasKWeight=1,
                cosStrideR=d // 2, sinStrideR=d // 2, epsBits=tl.float_bits(1e-6))
    for name, off in (("q", 0), ("k", 0), ("v", 0), ("qo", 0), ("ko", 0), ("vo", 0), ("xq", 0), ("xk", 0)):
        p[name + "StrideB"], p[name + "StrideS"], p[name + "StrideH"] = 0, width, d
    p.update(kw)
    return p


def test_golden_prologue_forward_qwen3_shape(sim):
    # fp16, D = r = 128, both norms: rowPad 128, halfPad 64. Per row: cos/sin stage 2*64*4 +
    # 6*128*4 = 3584; in/out/copy queues 3*2*128*2 = 1536; float rows 512; rotated rows 512;
    # norm: 2 weight tables + broadcast offsets, products, 1/rms 5*512 + 2 blocks = 2624 -> 8768.
    # Fixed: constant blocks 64 + zero block 32 + ReduceSum work 512 = 608.
    t = _c_vs_py(sim, _prologue_params(tl.OP_PROLOGUE), 196608, 40)
    assert (t["rowPad"], t["halfPad"], t["rowBytes"], t["fixedBytes"]) == (128, 64, 8768, 608)
    # 4096 rows on 40 cores: 16 take 103, 24 take 102; (196608 - 2048 - 608) // 8768 = 22 per tile.
    assert (t["blockDim"], t["formerNum"], t["formerRows"], t["tileRows"]) == (40, 16, 103, 22)


def test_golden_prologue_backward(sim):
    # As the forward, plus x in float (512) and two weight-gradient sum tables (1024), the rotated
    # gradient instead of the rotated rows: 10304 per row; 193952 // 10304 = 18 per tile.
    t = _c_vs_py(sim, _prologue_params(tl.OP_PROLOGUE_GRAD, inverse=1, hasGradQ=1, hasGradK=1, hasGradV=1),
                 196608, 40)
    assert (t["rowBytes"], t["fixedBytes"], t["tileRows"]) == (10304, 608, 18)
    # Without norms or rotation: the queues and float rows only.
    t = _c_vs_py(sim, _prologue_params(tl.OP_PROLOGUE, rotate=0, hasQWeight=0, hasKWeight=0), 196608, 40)
    assert (t["rowBytes"], t["fixedBytes"]) == (1536 + 512, 32)


def test_golden_mrope_and_low_precision_tables(sim):
    # bf16 tables: halfPad rounds r/2 = 20 to 32 (16 per block); a 16-bit staging row per table.
    t = _c_vs_py(sim, _params(rotaryDim=40, headDim=40, tableDtype=tl.TABLE_BF16), 196608, 40)
    assert t["halfPad"] == 32
    base = 2 * 32 * 4 + 6 * t["rowPad"] * 4 + 2 * 2 * t["rowPad"] * 2 + 2 * t["rowPad"] * 4
    assert t["rowBytes"] == base + 2 * 32 * 2
    # mRoPE, fp32 tables: three rows per token and table, the axis offsets.
    t = _c_vs_py(sim, _params(angleKind=tl.ANGLES_MROPE, posMode=tl.POS_INT64, posStrideA=64, posStrideS=1,
                              mropeT=16, mropeH=8, mropeW=8), 196608, 40)
    assert t["rowBytes"] == 2816 + 2 * 3 * 32 * 4 + 32 * 4
    for bad in (dict(mropeT=15), dict(posMode=tl.POS_OFFSET), dict(mropeW=-1, mropeT=17)):
        with pytest.raises(tl.TilingError) as e:
            good = dict(angleKind=tl.ANGLES_MROPE, posMode=tl.POS_INT64, mropeT=16, mropeH=8, mropeW=8)
            tl.compute_tiling(_params(**{**good, **bad}), 196608, 40)
        assert e.value.status == tl.BAD_PARAMS
