"""Triton backend of rope_ops: one launch for q and k, any layout through strides.

Importing this module imports neither triton nor touches a device: triton and the kernel are
imported on the first ``availability()`` / ``run()``. NOTES.md explains the kernel and the launch
policy.

On CPU tensors the backend runs only under ``TRITON_INTERPRET=1`` (set before triton is imported),
for tests; automatic selection never picks it there.

Besides the backend, two functions for benchmark tooling, not part of rope_ops' API (labels and
behaviour may change with the kernel): ``kernel_candidates(args)`` and ``run_with(args, label)``.
"""

from __future__ import annotations

import os
import re
from typing import ClassVar, NamedTuple

import torch

from rope_ops.backend import Backend, KernelArgs, PrologueArgs, RopeCall, bshd_view

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    """Largest power of two <= n (1 for n < 1): block sizes feed tl.arange."""
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# What the launch policy reads: the call's shape class and the device.


class DeviceInfo(NamedTuple):
    sm_count: int
    # shared memory one program may take (the opt-in maximum per block; H100 / H200: 227 KiB)
    shared_memory: int = 227 * 1024


# The interpreter's stand-in for a GPU: small, so the tests' few dozen tokens reach both grids.
_INTERPRETER_DEVICE = DeviceInfo(sm_count=2)
_device_infos: dict[int, DeviceInfo] = {}


def _shared_memory_per_block(index: int, props) -> int:
    """The opt-in maximum of shared memory per block: torch's property, else triton's driver,
    else the 48 KiB every CUDA GPU gives a block."""
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    try:
        from triton.runtime import driver
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # an older triton or another driver: the guaranteed minimum
        return 48 * 1024


def device_info(device: torch.device) -> DeviceInfo:
    """The properties the policy uses, read once per device (they never change)."""
    if device.type != "cuda":
        return _INTERPRETER_DEVICE
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _device_infos.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        info = DeviceInfo(props.multi_processor_count, _shared_memory_per_block(index, props))
        _device_infos[index] = info
    return info


class CallShape(NamedTuple):
    """The class of a call, as far as the launch policy cares."""

    n_tokens: int
    q_heads: int
    k_heads: int  # 0 without k
    head_dim: int
    rotary_dim: int
    elem_size: int  # bytes of one q/k element
    inplace: bool


def shape_of(args: KernelArgs) -> CallShape:
    q4 = bshd_view(args.q, args.layout)
    hk = 0 if args.k is None else bshd_view(args.k, args.layout).shape[2]
    return CallShape(q4.shape[0] * q4.shape[1], q4.shape[2], hk, q4.shape[3], args.rotary_dim,
                     args.q.element_size(), bool(args.inplace))


class KernelConfig(NamedTuple):
    """How one call is launched. head_grid False (token walk): a program per block of block_t
    tokens, walking all their heads in chunks of block_hq q heads, then block_hk k heads. True
    (head grid): a program per (token block, head chunk)."""

    head_grid: bool
    block_t: int
    block_hq: int
    block_hk: int
    num_warps: int

    def label(self) -> str:
        kind = "grid" if self.head_grid else "walk"
        return f"{kind} t{self.block_t} hq{self.block_hq} hk{self.block_hk} w{self.num_warps}"


_LABEL = re.compile(r"(walk|grid) t(\d+) hq(\d+) hk(\d+) w(\d+)")


def parse_label(label: str) -> KernelConfig:
    m = _LABEL.fullmatch(label.strip()) if isinstance(label, str) else None
    if m is None:
        raise ValueError(f"not a triton kernel configuration label: {label!r} "
                         f"(expected e.g. 'walk t4 hq16 hk8 w8')")
    cfg = KernelConfig(m[1] == "grid", int(m[2]), int(m[3]), int(m[4]), int(m[5]))
    for name, v in zip(("block_t", "block_hq", "block_hk"), cfg[1:4]):
        if v < 1 or v > 256 or v & (v - 1):
            raise ValueError(f"{label!r}: {name} must be a power of two in [1, 256], got {v}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{label!r}: num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps}")
    return cfg


# ---------------------------------------------------------------------------------------------
# The launch policy: a pure function of the call's shape class and the device.

# Bytes of q/k one chunk (the tile a program loads at once) moves: the H200 best of W1 in the
# 2026-12-01 sweep (4 tokens x 16 heads x 128 dims bf16; 8 KiB chunks 1.4 % slower) for
# dense heads; half that where a head moves only its rotary dims in place (W3 in place:
# 4 x 16 x 64 dims bf16 beat 8 x 16 x 64). Chunks are sized in bytes, not elements, so fp32
# keeps the register footprint (and the CTAs per SM) of bf16.
CHUNK_BYTES = 16384
CHUNK_BYTES_ROTARY_ONLY = 8192
# Threads: one per 64 bytes of a chunk (two 16-byte vectors of x and of y): W1 8 warps, W2 2
# (H200, 2026-12-01 W2 sweep: 2 warps 3.45 us/call, 4 warps 3.76).
CHUNK_BYTES_PER_THREAD = 64
MAX_BLOCK_H = 16
MAX_BLOCK_T = 32
# A head chunk wider than the head count's power-of-two divisor pads lanes that load nothing;
# allowed up to this share of padded heads (hq 28 -> chunks of 4, not 16 with 4 padded).
MAX_HEAD_PADDING = 1.125
# Token walk when it has at least this many programs per SM (a few waves of the ~3 resident);
# fewer, and the head grid multiplies the programs by the chunk count.
WALK_PROGRAMS_PER_SM = 4
# Head grid: tokens per program halved until it has this many programs per SM, then (few-token
# decode) heads per chunk halved until every SM has a program.
GRID_PROGRAMS_PER_SM = 4


def _heads_per_chunk(heads: int, cap: int) -> int:
    """The widest power-of-two chunk <= cap whose padding stays within MAX_HEAD_PADDING."""
    bh = _prev_pow2(max(1, min(cap, _next_pow2(heads))))
    while bh > 1 and _cdiv(heads, bh) * bh > heads * MAX_HEAD_PADDING:
        bh //= 2
    return bh


def _head_bytes(shape: CallShape) -> int:
    """Bytes of one head of one token a program moves: the rotary dims in place, the whole head
    out of place (the pass-through dims are copied)."""
    dims = shape.rotary_dim if shape.inplace else shape.head_dim
    return dims * shape.elem_size


def _warps_for(chunk_bytes: int, bytes_per_thread: int = CHUNK_BYTES_PER_THREAD) -> int:
    return max(1, min(8, _prev_pow2(chunk_bytes // (bytes_per_thread * 32))))


def _programs(shape: CallShape, bt: int, bhq: int, bhk: int, head_grid: bool) -> int:
    blocks = _cdiv(shape.n_tokens, bt)
    if not head_grid:
        return blocks
    return blocks * (_cdiv(shape.q_heads, bhq) + _cdiv(shape.k_heads, bhk))


class ChunkRules(NamedTuple):
    """The constants of launch_policy: bytes a chunk moves (dense heads; rotary dims only in
    place), heads per chunk at most, bytes per thread (warps) in the head grid and in the token
    walk (None: the same)."""

    chunk_bytes: int = CHUNK_BYTES
    chunk_bytes_rotary_only: int = CHUNK_BYTES_ROTARY_ONLY
    max_block_h: int = MAX_BLOCK_H
    bytes_per_thread: int = CHUNK_BYTES_PER_THREAD
    walk_bytes_per_thread: int | None = None


ROPE_RULES = ChunkRules()


def launch_policy(shape: CallShape, device: DeviceInfo, narrow_heads: bool = True,
                  rules: ChunkRules = ROPE_RULES) -> KernelConfig:
    """The kernel configuration for a call. A chunk moves rules.chunk_bytes: heads per chunk the
    widest power of two that pads little, then tokens to fill it. The token walk when its
    programs fill the GPU; else the head grid, with fewer tokens per program (and, unless
    narrow_heads is False, narrower chunks) until it has enough programs. Warps by chunk bytes.
    The fused prologue has its own rules (prologue.PROLOGUE_RULES)."""
    head_bytes = _head_bytes(shape)
    rotary_only = shape.inplace and shape.rotary_dim < shape.head_dim
    chunk = rules.chunk_bytes_rotary_only if rotary_only else rules.chunk_bytes
    cap = max(1, min(rules.max_block_h, chunk // head_bytes))
    bhq = _heads_per_chunk(shape.q_heads, cap)
    bhk = _heads_per_chunk(shape.k_heads, cap) if shape.k_heads else 1
    bt = _prev_pow2(max(1, min(MAX_BLOCK_T, chunk // (bhq * head_bytes),
                               _next_pow2(shape.n_tokens))))
    head_grid = _programs(shape, bt, bhq, bhk, False) < WALK_PROGRAMS_PER_SM * device.sm_count
    if head_grid:
        target = GRID_PROGRAMS_PER_SM * device.sm_count
        while bt > 1 and _programs(shape, bt, bhq, bhk, True) < target:
            bt //= 2
        while narrow_heads and max(bhq, bhk) > 1 and \
                _programs(shape, bt, bhq, bhk, True) < device.sm_count:
            if bhq >= bhk:
                bhq //= 2
            else:
                bhk //= 2
    per_thread = rules.bytes_per_thread
    if not head_grid and rules.walk_bytes_per_thread is not None:
        per_thread = rules.walk_bytes_per_thread
    return KernelConfig(head_grid, bt, bhq, bhk, _warps_for(bt * bhq * head_bytes, per_thread))


def candidate_configs(shape: CallShape, device: DeviceInfo,
                      rules: ChunkRules = ROPE_RULES) -> list[KernelConfig]:
    """The policy's choice, then its neighbours: tokens x2 and /2, heads x2 and /2 (tokens the
    other way, same chunk bytes), warps x2 and /2, the other grid kind, and the head grid
    without narrowed chunks."""
    best = launch_policy(shape, device, rules=rules)
    g, bt, bhq, bhk, w = best
    raw = [best,
           KernelConfig(g, bt * 2, bhq, bhk, w), KernelConfig(g, bt // 2, bhq, bhk, w),
           KernelConfig(g, bt // 2, bhq * 2, bhk * 2, w),
           KernelConfig(g, bt * 2, bhq // 2, bhk // 2, w),
           KernelConfig(g, bt, bhq, bhk, w * 2), KernelConfig(g, bt, bhq, bhk, w // 2),
           KernelConfig(not g, bt, bhq, bhk, w),
           launch_policy(shape, device, narrow_heads=False, rules=rules)]
    hq_max = min(2 * MAX_BLOCK_H, _next_pow2(shape.q_heads))
    hk_max = min(2 * MAX_BLOCK_H, _next_pow2(max(1, shape.k_heads)))
    t_max = max(bt, min(2 * MAX_BLOCK_T, _next_pow2(shape.n_tokens)))
    out: list[KernelConfig] = []
    for c in raw:
        if (1 <= c.block_t <= t_max and 1 <= c.block_hq <= hq_max and 1 <= c.block_hk <= hk_max
                and 1 <= c.num_warps <= 8 and c not in out):
            out.append(c)
    return out


# ---------------------------------------------------------------------------------------------
# Pieces: power-of-two tiles covering a head's rotary pairs and pass-through dims.


def rotary_pieces(rotary_dim: int) -> tuple[int, int]:
    """(ROT_A, ROT_B): pairs [0, A) and [A, A + B), B masked at R/2 (0: no second piece)."""
    half = rotary_dim // 2
    a = _prev_pow2(half)
    return a, (_next_pow2(half - a) if half > a else 0)


def pass_pieces(rotary_dim: int, head_dim: int) -> tuple[int, int, int]:
    """(PASS_A, PASS_B, PASS_C): widths of tiles covering dims [R, D) one after the other, each
    starting at a multiple of its width (so its accesses are as wide as the data allows); the
    third, if needed, is masked at D. Zeros where fewer are needed. R may be 0 (the fused
    prologue without rotation: every dim passes through)."""
    widths = []
    off = rotary_dim
    while off < head_dim and len(widths) < 2:
        w = _prev_pow2(head_dim - off) if off == 0 else min(off & -off, _prev_pow2(head_dim - off))
        widths.append(w)
        off += w
    if off < head_dim:
        widths.append(_next_pow2(head_dim - off))
    return tuple(widths + [0] * (3 - len(widths)))


# ---------------------------------------------------------------------------------------------
# Launching.

_triton_state: dict = {}


def _kernels() -> dict:
    """The kernel module and what launching needs from the installed triton (imported once)."""
    if not _triton_state:
        import triton

        from . import kernels, prologue_kernels

        direct = not _INTERPRET and os.environ.get("ROPE_OPS_TRITON_DIRECT", "1") != "0"
        try:
            runtime = triton.knobs.runtime  # the launch hooks (profilers) live here
            stream = triton.runtime.driver.active.get_current_stream
        except Exception:
            direct, runtime, stream = False, None, None
        libdevice = (not _INTERPRET) and kernels.libdevice is not None
        _triton_state.update(kernels=kernels, prologue_kernels=prologue_kernels,
                             libdevice=libdevice, direct=direct, runtime=runtime, stream=stream)
    return _triton_state


class _Launch:
    """One compiled specialization of the kernel with its launch arguments: everything but the
    tensors, the position offset and the attention factor, for one exact call class.

    The first launch goes through triton's JIT (``kernel[grid](...)``), which compiles or finds
    the kernel and returns it; later ones call that compiled kernel's launcher directly, as
    triton's own ``CompiledKernel[grid]`` runner does, skipping triton's per-call argument
    binding and specialization: the call class fixes both (shapes, strides, dtypes and the
    16-byte alignment of every pointer are in the key). ROPE_OPS_TRITON_DIRECT=0 turns the
    direct launch off; so does a launcher that refuses the arguments (before launching).
    """

    __slots__ = ("grid", "num_warps", "data_ints", "tail", "compiled", "device_index")

    def __init__(self, grid, num_warps, data_ints, tail, device_index):
        self.grid = grid
        self.num_warps = num_warps
        self.data_ints = data_ints  # n_tokens, seq_len, q/k/q_out/k_out strides
        self.tail = tail  # the angle source's ints, then the constexprs: signature order
        self.compiled = None
        self.device_index = device_index

    def arguments(self, q, k, qo, ko, pos, cos, sin, turns, pos_offset, attn_factor) -> tuple:
        """The kernel's arguments in signature order (constexprs included, as triton passes)."""
        return (q, k, qo, ko, *self.data_ints, pos, cos, sin, turns, pos_offset, attn_factor,
                *self.tail)

    def launch_pointers(self, q, k, qo, ko, pos, cos, sin, turns, pos_offset, attn_factor) -> bool:
        """The direct launch, the tensors given as device pointers (ints: triton's launcher
        then skips a data_ptr() call and a CUDA pointer query per pointer). False, launching
        nothing, where it cannot: not compiled yet, an offset outside int32, launch hooks set
        (profilers: the JIT launch calls them), or the direct launch off."""
        ck = self.compiled
        state = _triton_state
        if ck is None or not state["direct"] or not -(1 << 31) <= pos_offset < (1 << 31):
            return False
        runtime = state["runtime"]
        if runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None:
            return False
        try:
            ck.run(self.grid[0], 1, 1, state["stream"](self.device_index), ck.function,
                   ck.packed_metadata, None, None, None, q, k, qo, ko, *self.data_ints, pos, cos,
                   sin, turns, pos_offset, attn_factor, *self.tail)
        except (TypeError, ValueError, SystemError, AttributeError):
            state["direct"] = False  # a launcher that takes other arguments: the JIT from now on
            return False
        return True

    def __call__(self, q, k, qo, ko, pos, cos, sin, turns, pos_offset, attn_factor) -> None:
        if self.compiled is not None and self.launch_pointers(
                q.data_ptr(), k.data_ptr(), qo.data_ptr(), ko.data_ptr(), pos.data_ptr(),
                cos.data_ptr(), sin.data_ptr(), turns.data_ptr(), pos_offset, attn_factor):
            return
        kernel = _kernels()["kernels"].rope_kernel
        ck = kernel[self.grid](*self.arguments(q, k, qo, ko, pos, cos, sin, turns, pos_offset,
                                               attn_factor), num_warps=self.num_warps)
        # An offset outside int32 compiles another signature (i64): keep the i32 one.
        if ck is not None and not _INTERPRET and -(1 << 31) <= pos_offset < (1 << 31):
            self.compiled = ck


def _strides4(t, shape4) -> list[int]:
    """A [B, S, H, D] view's strides with those of size-1 dims made canonical (0; 1 on D), so
    views that differ only there share a specialization."""
    st = list(t.stride())
    for dim in range(3):
        if shape4[dim] == 1:
            st[dim] = 0
    if shape4[3] == 1:
        st[3] = 1
    return st


def _make_launch(args: KernelArgs, cfg: KernelConfig | None, libdevice: bool) -> _Launch | None:
    """The launch of one call class (outputs given in args), or None when there is nothing to
    do. cfg None: the policy's."""
    layout = args.layout
    q4, qo4 = bshd_view(args.q, layout), bshd_view(args.q_out, layout)
    batch, seq, hq, head_dim = q4.shape
    n_tokens = batch * seq
    hk = 0
    k4 = ko4 = None
    if args.k is not None:
        k4, ko4 = bshd_view(args.k, layout), bshd_view(args.k_out, layout)
        hk = k4.shape[2]
        if hk == 0:
            k4 = ko4 = None
    if n_tokens == 0 or (hq == 0 and hk == 0):
        return None
    shape = CallShape(n_tokens, hq, hk, head_dim, args.rotary_dim, args.q.element_size(),
                      bool(args.inplace))
    if cfg is None:
        cfg = launch_policy(shape, device_info(args.q.device))
    sq, sqo = _strides4(q4, q4.shape), _strides4(qo4, q4.shape)
    sk = _strides4(k4, k4.shape) if k4 is not None else [0, 0, 0, 1]
    sko = _strides4(ko4, k4.shape) if k4 is not None else [0, 0, 0, 1]
    rot_a, rot_b = rotary_pieces(args.rotary_dim)
    copy_pass = (not args.inplace) and args.rotary_dim < head_dim
    pass_a, pass_b, pass_c = pass_pieces(args.rotary_dim, head_dim) if copy_pass else (0, 0, 0)
    angle_ints, angle_consts = _angle_source(args)
    block_hq = min(cfg.block_hq, _next_pow2(max(hq, 1)))
    block_hk = min(cfg.block_hk, _next_pow2(max(hk, 1)))
    consts = (
        hq, hk, head_dim, args.rotary_dim, bool(args.interleaved), bool(args.inverse),
        all(s[3] == 1 for s in (sq, sqo, sk, sko)),  # D_CONTIG: dims at compile-time offsets
        1 if batch == 1 else (2 if seq == 1 else 0),  # TOK_SPLIT: no division where not needed
        *angle_consts, libdevice,
        rot_a, rot_b, pass_a, pass_b, pass_c,
        cfg.head_grid, cfg.block_t, block_hq, block_hk,
    )
    n_programs = _cdiv(n_tokens, cfg.block_t)
    if cfg.head_grid:
        n_programs *= _cdiv(hq, block_hq) + _cdiv(hk, block_hk)
    return _Launch((n_programs, 1, 1), cfg.num_warps, (n_tokens, seq, *sq, *sk, *sqo, *sko),
                   (*angle_ints, *consts), args.q.get_device())


_ANGLE_KINDS = {"table": 0, "token": 1, "mrope": 2}  # kernels.ANGLES_POSITIONS / _TOKEN / _MROPE


def _angle_source(args: KernelArgs) -> tuple[tuple, tuple]:
    """The angle stage's launch arguments: (ints after pos_offset and attn_factor: n_rows,
    sp_b, sp_s, sc_row, ss_row, sp_a, sc_b, ss_b; constexprs ANGLES, HAS_POS, HAS_TURNS,
    MROPE_S1, MROPE_S2, MROPE_INTERLEAVED). Strides of size-1 dims are 0 (canonical)."""
    def stride(t, dim):
        return t.stride(dim) if t.shape[dim] > 1 else 0

    kind = args.angles
    pos = args.pos
    if kind == "token":
        # cos/sin [B, S, R/2]: the (batch, token) strides take the place of the row stride.
        return ((0, 0, 0, stride(args.cos, 1), stride(args.sin, 1), 0, stride(args.cos, 0),
                 stride(args.sin, 0)),
                (_ANGLE_KINDS[kind], False, args.freq_turns is not None, 0, 0, False))
    sp_a = 0
    if pos is None:
        sp = (0, 0)
    elif kind == "mrope":  # [3, B, S], or [3, S] shared by the batch / [3, T]
        sp_a = pos.stride(0)
        sp = (stride(pos, 1), stride(pos, 2)) if pos.dim() == 3 else (0, stride(pos, 1))
    elif pos.dim() == 1:
        sp = (0, stride(pos, 0))
    else:
        sp = (stride(pos, 0), stride(pos, 1))
    n_rows = args.cos.shape[0]
    # Table rows may be strided (cos and sin the halves of one [P, R] cache); canonical when
    # there is at most one row.
    rows = tuple(t.stride(0) if n_rows > 1 else args.rotary_dim // 2 for t in (args.cos, args.sin))
    if kind == "mrope":
        section = tuple(args.mrope_section)
        mrope = (section[1], section[2], bool(args.mrope_interleaved))
    else:
        mrope = (0, 0, False)
    return ((n_rows, *sp, *rows, sp_a, 0, 0),
            (_ANGLE_KINDS[kind], pos is not None, args.freq_turns is not None, *mrope))


def _angle_pointers(pos, cos, sin, turns) -> tuple:
    """pos_ptr, cos_ptr, sin_ptr, turns_ptr (the table where an argument is absent)."""
    return (cos if pos is None else pos, cos, sin, cos if turns is None else turns)


def _aligned(t) -> bool:
    return t.data_ptr() & 15 == 0


def _stand_in(cos: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """A pointer for the table when it has no rows (every load of it is masked)."""
    return torch.zeros(1, max(1, rotary_dim // 2), dtype=cos.dtype, device=cos.device)


class TritonBackend(Backend):
    name: ClassVar[str] = "triton"
    # Out of place, run() may get q_out = k_out = None: it allocates and returns them.
    allocates_outputs: ClassVar[bool] = True
    priority: ClassVar[int] = 10
    device_types: ClassVar[frozenset[str]] = (
        frozenset({"cuda", "cpu"}) if _INTERPRET else frozenset({"cuda"})
    )
    auto_device_types: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16}
    )
    # Angles from position tables, per-token cos/sin and mRoPE positions (kernels.ANGLES_*);
    # caller tables in any float dtype the data may have (read, then float32).
    angle_kinds: ClassVar[frozenset[str]] = frozenset({"table", "token", "mrope"})
    table_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16}
    )
    # The fused prologue (prologue_kernels.py); float8 e4m3 caches and q (PrologueArgs.q_scale)
    # where the GPU converts to it (compute capability 8.9 and later; see supports()).
    supports_prologue: ClassVar[bool] = True
    prologue_cache_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None}
    )
    prologue_q_dtypes: ClassVar[frozenset[torch.dtype]] = prologue_cache_dtypes

    def __init__(self) -> None:
        self._launches: dict = {}

    # -- environment ----------------------------------------------------------------------

    def availability(self) -> list[str]:
        try:
            import triton
        except Exception as e:  # ImportError, or a broken install
            return [f"triton not importable: {type(e).__name__}: {e}"]
        if _INTERPRET:
            return []
        try:
            triton.runtime.driver.active.get_current_target()
        except Exception as e:  # RuntimeError "0 active drivers", driver load failures
            return [f"no GPU driver for triton ({type(e).__name__}: {e})"]
        try:
            if not torch.cuda.is_available():
                return ["no GPU (torch.cuda.is_available() is False) and TRITON_INTERPRET unset"]
        except Exception as e:
            return [f"no GPU: {type(e).__name__}: {e}"]
        return []

    def describe(self) -> dict:
        d = super().describe()
        d["interpret"] = _INTERPRET
        return d

    def supports(self, call: RopeCall) -> list[str]:
        reasons = super().supports(call)
        if call.op == "prologue" and call.device_type == "cuda" and not _INTERPRET:
            fp8_cache = (call.cache_dtype is not None
                         and call.cache_dtype in self.prologue_cache_dtypes)
            fp8_q = call.q_out_dtype is not None and call.q_out_dtype in self.prologue_q_dtypes
            if (fp8_cache or fp8_q) and torch.cuda.get_device_capability() < (8, 9):
                reasons.append("float8 " + ("cache write" if fp8_cache else "q")
                               + " needs compute capability 8.9 or later")
        return reasons

    # -- run ------------------------------------------------------------------------------

    def run(self, args: KernelArgs):
        """Out of place with ``q_out is None``: allocate the outputs and return (q_out, k_out);
        otherwise write into the given outputs and return None."""
        made = None
        if args.q_out is None:
            made = (torch.empty_like(args.q), None if args.k is None else torch.empty_like(args.k))
            args = args._replace(q_out=made[0], k_out=made[1])
        self._run(args, None)
        return made

    def _run(self, args: KernelArgs, cfg: KernelConfig | None) -> None:
        q, k, qo, ko, pos = args.q, args.k, args.q_out, args.k_out, args.pos
        cos, sin, turns = args.cos, args.sin, args.freq_turns
        # Everything a launch derives from, flat (cheap to hash); pos's shape follows from q's
        # (validated by the core). Pointer alignment is part of triton's specialization.
        aligned = (_aligned(q), _aligned(qo), _aligned(cos), _aligned(sin),
                   None if k is None else (_aligned(k), _aligned(ko), k.shape, k.stride(),
                                           ko.stride()),
                   None if pos is None else (_aligned(pos), pos.stride(), pos.dtype),
                   None if turns is None else _aligned(turns))
        key = (args.layout, q.shape, q.stride(), qo.stride(), aligned, cos.shape, cos.stride(),
               sin.stride(), cos.dtype, sin.dtype, args.rotary_dim, args.interleaved, args.inverse,
               args.inplace, q.dtype, q.get_device(), cfg, args.angles, args.mrope_section,
               args.mrope_interleaved)
        launch = self._launches.get(key, False)
        if launch is False:
            launch = _make_launch(args, cfg, _kernels()["libdevice"])
            if len(self._launches) >= _MAX_LAUNCHES:
                self._launches.clear()
            self._launches[key] = launch
        if launch is None:
            return  # no tokens or no heads
        if cos.shape[0] == 0:
            cos = sin = _stand_in(cos, args.rotary_dim)
        ptrs = (q, q if k is None else k, qo, qo if ko is None else ko,
                *_angle_pointers(pos, cos, sin, turns))
        _on_device(launch, ptrs, args.pos_offset, float(args.attention_factor))

    # -- the fused prologue -----------------------------------------------------------------

    def run_prologue(self, args: PrologueArgs) -> None:
        from .prologue import run_prologue

        run_prologue(args)

    def run_prologue_backward(self, args: PrologueArgs, grad_q, grad_k, grad_v):
        from .prologue import run_prologue_backward

        return run_prologue_backward(args, grad_q, grad_k, grad_v)

    # -- bound launchers (rope_ops.apply's cached plans) ------------------------------------

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved,
             inverse):
        """``(q, k, pos, pos_offset) -> (q_out, k_out)`` for repeated eager out-of-place calls
        with these tables and constants, with ``guarded(q, k, pos)`` for exact repeats."""
        if torch.compiler.is_compiling():
            return None
        return _Bound(cos, sin, freq_turns, float(attention_factor), layout, int(rotary_dim),
                      bool(interleaved), bool(inverse))


_MAX_LAUNCHES = 512


def _on_device(launch: _Launch, ptrs, pos_offset, attn_factor) -> None:
    """Launch on the tensors' device: triton launches on the current one (with one GPU, that
    is the tensors' device; no need to ask)."""
    index = launch.device_index
    if index > 0 or (index == 0 and _gpu_count() > 1):
        if index != torch.cuda.current_device():
            with torch.cuda.device(index):
                launch(*ptrs, pos_offset, attn_factor)
            return
    launch(*ptrs, pos_offset, attn_factor)


_gpu_counts: list = []


def _gpu_count() -> int:
    if not _gpu_counts:
        _gpu_counts.append(torch.cuda.device_count())
    return _gpu_counts[0]


class _Bound:
    """TritonBackend.bind's launcher: the tables and constants of one call kind fixed, one
    launch per shape class (kept here, so a repeat builds a small key and launches)."""

    def __init__(self, cos, sin, turns, attn, layout, rotary_dim, interleaved, inverse):
        if cos.shape[0] == 0:
            cos = sin = _stand_in(cos, rotary_dim)
            self.n_rows_zero = True
        else:
            self.n_rows_zero = False
        self.cos, self.sin, self.turns, self.attn = cos, sin, turns, attn
        self.layout, self.rotary_dim = layout, rotary_dim
        self.interleaved, self.inverse = interleaved, inverse
        self.tables_aligned = _aligned(cos) and _aligned(sin) and (turns is None or _aligned(turns))
        self.launches: dict = {}

    def _args(self, q, k, qo, ko, pos, pos_offset) -> KernelArgs:
        cos = self.cos[:0] if self.n_rows_zero else self.cos
        return KernelArgs(q, k, qo, ko, pos, pos_offset, cos, self.sin, self.turns, self.attn,
                          self.layout, self.rotary_dim, self.interleaved, self.inverse, False)

    def _launch_for(self, q, k, qo, ko, pos):
        key = (q.shape, q.stride(), q.dtype, q.get_device(), _aligned(q),
               None if k is None else (k.shape, k.stride(), _aligned(k)),
               None if pos is None else (pos.shape, pos.stride(), pos.dtype, _aligned(pos)))
        launch = self.launches.get(key, False)
        if launch is False:
            launch = _make_launch(self._args(q, k, qo, ko, pos, 0), None, _kernels()["libdevice"])
            if len(self.launches) >= _MAX_LAUNCHES:
                self.launches.clear()
            self.launches[key] = launch
        return launch

    def _ptrs(self, q, k, qo, ko, pos):
        return (q, q if k is None else k, qo, qo if ko is None else ko,
                *_angle_pointers(pos, self.cos, self.sin, self.turns))

    def __call__(self, q, k, pos, pos_offset):
        qo = torch.empty_like(q)
        ko = None if k is None else torch.empty_like(k)
        launch = self._launch_for(q, k, qo, ko, pos)
        if launch is not None:
            _on_device(launch, self._ptrs(q, k, qo, ko, pos), pos_offset, self.attn)
        return qo, ko

    def guarded(self, q, k, pos):
        """A launcher for exact repeats of this call (q's and k's sizes, strides, dtype and
        device; pos's sizes, strides, dtype and device, or an int offset in int32), 16-byte
        aligned, needing no gradient; it returns None for any other call. Its checks are all
        it does before allocating the outputs and launching."""
        if not self.tables_aligned or type(q) is not torch.Tensor or \
                (k is not None and type(k) is not torch.Tensor) or not (q.is_cuda or _INTERPRET):
            return None
        qo = torch.empty_like(q)
        ko = None if k is None else torch.empty_like(k)
        pos_tensor = pos if isinstance(pos, torch.Tensor) else None
        if not all(_aligned(t) for t in (q, k, qo, ko, pos_tensor) if t is not None):
            return None
        launch = self._launch_for(q, k, qo, ko, pos_tensor)
        if launch is None or (q.is_cuda and launch.device_index != torch.cuda.current_device()):
            return None
        return _make_guard(self, launch, q, k, pos_tensor)


def _make_guard(bound: _Bound, launch: _Launch, q, k, pos):
    """The guard of one exact call (see _Bound.guarded): a closure over locals, the cheapest
    checks Python has; it launches with the pointers its alignment checks read."""
    tensor_type = torch.Tensor
    grad_enabled = torch.is_grad_enabled
    empty_like = torch.empty_like
    q_meta = (q.shape, q.stride(), q.dtype)
    dtype = q.dtype
    on_cuda = q.is_cuda
    index = q.get_device()
    check_current = on_cuda and _gpu_count() > 1  # with one GPU it is always q's
    current_device = torch.cuda.current_device
    no_k = k is None
    k_meta = None if no_k else (k.shape, k.stride())
    pos_is_int = pos is None
    pos_meta = None if pos_is_int else (pos.shape, pos.stride(), pos.dtype)
    cos, sin, attn = bound.cos, bound.sin, bound.attn  # kept alive by the bound launcher
    turns = cos if bound.turns is None else bound.turns
    cos_p, sin_p, turns_p = cos.data_ptr(), sin.data_ptr(), turns.data_ptr()
    low, high = -(1 << 31), 1 << 31
    direct = launch.launch_pointers

    def guard(q, k, pos):
        if (type(q) is not tensor_type or (q.shape, q.stride(), q.dtype) != q_meta
                or q.is_cuda is not on_cuda or q.get_device() != index):
            return None
        q_p = q.data_ptr()
        if q_p & 15:
            return None
        if no_k:
            if k is not None:
                return None
            needs_grad = q.requires_grad
        else:
            if (type(k) is not tensor_type or (k.shape, k.stride()) != k_meta
                    or k.dtype != dtype or k.is_cuda is not on_cuda or k.get_device() != index):
                return None
            k_p = k.data_ptr()
            if k_p & 15:
                return None
            needs_grad = q.requires_grad or k.requires_grad
        if needs_grad and grad_enabled():
            return None
        if pos_is_int:
            if type(pos) is not int or not low <= pos < high:
                return None
            pos_p, offset = cos_p, pos
        else:
            if (type(pos) is not tensor_type or (pos.shape, pos.stride(), pos.dtype) != pos_meta
                    or pos.is_cuda is not on_cuda or pos.get_device() != index):
                return None
            pos_p, offset = pos.data_ptr(), 0
            if pos_p & 15:
                return None
        if check_current and current_device() != index:
            return None
        # Outputs as _Bound.__call__ makes them: the launch was made for their strides.
        qo = empty_like(q)
        if no_k:
            qo_p = qo.data_ptr()
            if not direct(q_p, q_p, qo_p, qo_p, pos_p, cos_p, sin_p, turns_p, offset, attn):
                launch(q, q, qo, qo, cos if pos_is_int else pos, cos, sin, turns, offset, attn)
            return qo, None
        ko = empty_like(k)
        if not direct(q_p, k_p, qo.data_ptr(), ko.data_ptr(), pos_p, cos_p, sin_p, turns_p,
                      offset, attn):
            launch(q, k, qo, ko, cos if pos_is_int else pos, cos, sin, turns, offset, attn)
        return qo, ko

    return guard


# ---------------------------------------------------------------------------------------------
# For benchmark tooling (not rope_ops API).

_study_backend: list = []


def kernel_candidates(args: KernelArgs) -> list[str]:
    """Labels of the kernel configurations worth timing for this call, the launch policy's
    choice first (see candidate_configs). For benchmarks only; not API."""
    return [c.label() for c in candidate_configs(shape_of(args), device_info(args.q.device))]


def run_with(args: KernelArgs, candidate: str) -> None:
    """Run the call with the configuration of a kernel_candidates label, into args.q_out /
    args.k_out (given; in place, q and k). For benchmarks only; not API."""
    cfg = parse_label(candidate)
    if args.inplace:
        args = args._replace(q_out=args.q, k_out=args.k)
    elif args.q_out is None or (args.k is not None and args.k_out is None):
        raise ValueError("run_with: args.q_out (and k_out) must be given")
    if not _study_backend:
        _study_backend.append(TritonBackend())
    _study_backend[0]._run(args, cfg)
