"""Triton backend of rope_ops: one launch for q and k, any layout through strides.

Importing this module imports neither triton nor touches a device: triton and the kernels are
imported on the first ``availability()`` / ``run()``. See NOTES.md for the kernel design.

On CPU tensors the backend runs only under ``TRITON_INTERPRET=1`` (set before triton is imported),
for tests; automatic selection never picks it there.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from rope_ops.backend import Backend, KernelArgs, bshd_view

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Chunk size targets (elements of one head-chunk tile of one program).
_SMALL_TOKENS = 512  # at most this many tokens: decode plan (one token per program, head grid)
_TILE_ELEMS = 8192  # prefill tile: W1/W4/W5 (4, 16, 128) (H200 sweep: W1 85.2 us vs 86.4 us)
_TILE_ELEMS_INPLACE = 4096  # in place (rotary dims only): W3 (4, 16, 64)
_MAX_WASTE = 1.25  # padded heads / heads allowed for a wider chunk (W1: 16-head chunks, 1.2)
_DECODE_BLOCK_H = 16  # decode head chunk: W2 -> 256 tokens x 3 chunks of [1, 16, 128], 2 warps
_MAX_PLANS = 512


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    """Largest power of two <= n (1 for n < 1): block sizes feed tl.arange."""
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)


def _warps_for(elems_half: int) -> int:
    """num_warps so each thread holds ~8 elements of a half tile (a 16-byte bf16 vector per
    half, two per head): fewer threads would serialize, more would split the vectors."""
    return 1 << (max(1, min(8, elems_half // 256)).bit_length() - 1)


def _pick_blocks(n_tokens: int, hq: int, hk: int, head_dim: int, rotary_dim: int,
                 copy_pass: bool) -> tuple:
    """(BLOCK_T, BLOCK_H, num_warps[, head_grid[, stream[, pdl]]]) for one shape class.

    head_grid (default False): one program per (token block, head chunk) instead of one per
    token block walking all chunks. stream (default False): streaming cache hints on the q/k
    loads (.cg: not kept in L1) and stores (.cs: evict first). pdl (default False, GPU only):
    programmatic dependent launch. The GPU check's sweep passes these tuples directly.
    """
    half_p = _next_pow2(rotary_dim // 2)
    rot_p = 2 * half_p
    pass_p = _next_pow2(head_dim) if copy_pass else 0
    per_head = rot_p + pass_p
    heads = hq + hk
    hmax = _next_pow2(max(hq, hk))
    if n_tokens <= _SMALL_TOKENS:
        # Latency-bound: the most parallelism, the shortest programs. One program per
        # (token, chunk of <= 8 heads): each loads its chunk, then its position and cos/sin row,
        # rotates and stores; W2 runs 768 programs of 4 warps. (With 8-head chunks and 2 warps the
        # [1, 64] cos/sin row is loaded one element per thread and transposed through shared
        # memory, 3 barriers on the latency path; with 128 threads it loads as 16-byte vectors.)
        block_h = _prev_pow2(min(hmax, _DECODE_BLOCK_H, 4096 // per_head))
        # Half the warps of a prefill tile: H200 sweep, W2 3.45 us with 2 warps, 3.76 with 4.
        return 1, block_h, max(1, _warps_for(block_h * (half_p + pass_p // 2)) // 2), True
    # Partial rotary (W3) keeps the 4096-element tile of the measured W3 rows: in place it moves
    # only the rotary dims, out of place the tile includes the pass-through copy.
    tile = _TILE_ELEMS_INPLACE if rotary_dim < head_dim else _TILE_ELEMS
    cap = max(1, min(16, tile // per_head))
    block_h = 1
    best = None
    bh = 1
    while bh <= min(cap, hmax):
        waste = (-(-hq // bh) + -(-hk // bh)) * bh / heads
        if waste <= _MAX_WASTE:
            block_h = bh  # the largest low-waste chunk
        if best is None or waste < best[0]:
            best = (waste, bh)
        bh *= 2
    if (-(-hq // block_h) + -(-hk // block_h)) * block_h / heads > _MAX_WASTE:
        block_h = best[1]
    block_t = _prev_pow2(min(16, tile // (per_head * block_h), _next_pow2(n_tokens)))
    # ~8 elements per thread per half tile (the prefetched chunk doubles it): W1 (4, 16, 128)
    # and W3 in place (4, 16, 64) both get 8 warps by this; the W3 in place sweep winner was
    # (4, 16, 4), so the in-place tile is capped at 4 warps.
    warps = _warps_for(block_t * block_h * (half_p + pass_p // 2))
    if rotary_dim < head_dim and not copy_pass:
        warps = min(warps, 4)
    return block_t, block_h, warps, False


class _Plan:
    """Everything derived from one exact shape/stride class: ints, grid, compiled kernel."""

    __slots__ = ("ints", "consts", "grid", "num_warps", "runner", "has_pos", "tail", "n_tokens",
                 "seq", "n_rows", "pdl")

    def __init__(self, ints, consts, grid, num_warps, has_pos):
        self.ints = ints
        self.consts = consts
        self.n_tokens, self.seq, self.n_rows = ints[:3]
        self.tail = (*ints[3:], *consts)  # strides then constexprs, in signature order
        self.grid = grid
        self.num_warps = num_warps
        self.runner = None
        self.has_pos = has_pos
        self.pdl = False


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

    def __init__(self) -> None:
        self._kernel = None
        self._plans: dict = {}
        # Direct launches of the compiled kernel (skipping triton's per-call argument binding);
        # turned off for good on the first failure, and never used when interpreting.
        self.fast_launch = not _INTERPRET and os.environ.get("ROPE_OPS_TRITON_FAST", "1") != "0"

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
            return [f"no active triton driver: {type(e).__name__}: {e}"]
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

    # -- run ------------------------------------------------------------------------------

    def _get_kernel(self):
        if self._kernel is None:
            from . import kernels

            self._kernel = kernels
        return self._kernel

    def run(self, args: KernelArgs):
        """Out of place with ``q_out is None``: allocate the outputs and return (q_out, k_out);
        otherwise write into the given outputs and return None."""
        q, k, qo, ko, pos = args.q, args.k, args.q_out, args.k_out, args.pos
        made = None
        if qo is None:
            # empty_like keeps q's strides where q is dense (else row-major): the plan key below
            # holds the outputs' strides, so either is fine.
            qo = torch.empty_like(q)
            ko = None if k is None else torch.empty_like(k)
            made = (qo, ko)
        # Everything a plan derives from, flat (cheap to hash). pos shapes follow from q's
        # (validated by the core), so pos strides and dtype suffice.
        dev = q.get_device()
        # The 16-byte alignment of every pointer is part of triton's specialization, so of the key.
        align = q.data_ptr() | qo.data_ptr() | args.cos.data_ptr() | args.sin.data_ptr()
        if k is None:
            kkey = None
        else:
            kkey = k.shape
            align |= k.data_ptr() | ko.data_ptr()
        if pos is not None:
            align |= pos.data_ptr()
        if args.freq_turns is not None:
            align |= args.freq_turns.data_ptr()
        key = (
            args.layout, q.shape, q.stride(), None if qo is q else qo.stride(),
            kkey, None if k is None else k.stride(), None if ko is k else ko.stride(),
            None if pos is None else pos.stride(), None if pos is None else pos.dtype,
            args.cos.shape[0], args.freq_turns is None, args.rotary_dim, args.interleaved,
            args.inverse, args.inplace, q.dtype, dev, align & 15,
        )
        if dev >= 0 and dev != torch.cuda.current_device():
            # triton launches on the current device: make it q's for this call.
            with torch.cuda.device(dev):
                self._run(key, args, qo, ko)
        else:
            self._run(key, args, qo, ko)
        return made

    def _run(self, key, args: KernelArgs, qo, ko) -> None:
        q, k, pos = args.q, args.k, args.pos
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(args if args.q_out is not None else
                                   args._replace(q_out=qo, k_out=ko))
            if plan is None:
                return  # no tokens
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        cos, sin, turns = args.cos, args.sin, args.freq_turns
        if cos.shape[0] == 0:  # an empty table: every load is masked, but pass a real pointer
            cos = sin = torch.zeros(1, max(1, args.rotary_dim // 2), device=q.device)
        off = args.pos_offset
        ptrs = (q, q if k is None else k, qo, qo if ko is None else ko,
                cos if pos is None else pos, cos, sin, cos if turns is None else turns)
        # An offset outside int32 changes the compiled signature: leave it to triton's binder.
        if plan.runner is not None and -(1 << 31) <= off < (1 << 31):
            try:
                plan.runner(*ptrs, plan.n_tokens, plan.seq, plan.n_rows, off,
                            float(args.attention_factor), *plan.tail)
                return
            except (TypeError, ValueError, SystemError, AttributeError):
                # a triton whose launcher takes other arguments (checked before launching):
                # never try again
                self.fast_launch = False
                for p in self._plans.values():
                    p.runner = None
        self._launch_jit(plan, ptrs, off, float(args.attention_factor))

    def _launch_jit(self, plan, ptrs, off, m) -> None:
        # Exactly the positional arguments the direct launch passes (signature order,
        # constexprs included), so the interpreter tests check that order too.
        extra = {"launch_pdl": True} if plan.pdl else {}  # the direct runner inherits it
        ck = self._get_kernel().rope_kernel[plan.grid](
            *ptrs, plan.n_tokens, plan.seq, plan.n_rows, off, m, *plan.tail,
            num_warps=plan.num_warps, **extra)
        if self.fast_launch and ck is not None and -(1 << 31) <= off < (1 << 31):
            try:
                plan.runner = ck[plan.grid]
            except Exception:
                self.fast_launch = False

    def _make_plan(self, args: KernelArgs) -> _Plan | None:
        layout = args.layout
        q4 = bshd_view(args.q, layout)
        qo4 = bshd_view(args.q_out, layout)
        batch, seq, hq, head_dim = q4.shape
        n_tokens = batch * seq
        if n_tokens == 0:
            return None
        if args.k is not None:
            k4 = bshd_view(args.k, layout)
            ko4 = bshd_view(args.k_out, layout)
            hk = k4.shape[2]
            if k4.shape[2] == 0:
                k4 = ko4 = None
                hk = 0
        else:
            k4 = ko4 = None
            hk = 0
        if hq == 0 and hk == 0:
            return None
        rotary_dim = args.rotary_dim
        copy_pass = (not args.inplace) and rotary_dim < head_dim
        cfg = _pick_blocks(n_tokens, hq, hk, head_dim, rotary_dim, copy_pass)
        block_t, block_h, num_warps = cfg[:3]
        head_grid = bool(cfg[3]) if len(cfg) > 3 else False
        stream = bool(cfg[4]) if len(cfg) > 4 else False
        pdl = bool(cfg[5]) if len(cfg) > 5 and not _INTERPRET else False  # no PDL interpreted
        sq = list(q4.stride())
        sqo = list(qo4.stride())
        sk = list(k4.stride()) if k4 is not None else [0, 0, 0, 1]
        sko = list(ko4.stride()) if ko4 is not None else [0, 0, 0, 1]
        # A size-1 dim's stride is never used to move; make it 0 so odd values do not matter.
        for strides, t in ((sq, q4), (sqo, qo4), (sk, k4), (sko, ko4)):
            if t is not None:
                for dim in range(3):
                    if t.shape[dim] == 1:
                        strides[dim] = 0
                if t.shape[3] == 1:
                    strides[3] = 1
        d_contig = all(s[3] == 1 for s in (sq, sqo, sk, sko))
        pos = args.pos
        if pos is None:
            sp = [0, 0]
        elif pos.dim() == 1:
            sp = [0, pos.stride(0) if pos.shape[0] > 1 else 0]
        else:
            sp = [pos.stride(0) if pos.shape[0] > 1 else 0,
                  pos.stride(1) if pos.shape[1] > 1 else 0]
        n_rows = args.cos.shape[0]
        ints = (n_tokens, seq, n_rows, *sq, *sk, *sqo, *sko, *sp)
        consts = (
            hq, hk, head_dim, rotary_dim, _next_pow2(rotary_dim // 2),
            _next_pow2(head_dim) if copy_pass else 1,
            block_t, block_h, bool(args.interleaved), bool(args.inverse), copy_pass,
            pos is not None, args.freq_turns is not None, d_contig,
            (not _INTERPRET) and self._get_kernel().libdevice is not None,
            2 if block_t == 1 else 1,  # EARLY: decode loads q and k chunks before the position
            head_grid,
            1 if batch == 1 else (2 if seq == 1 else 0),  # TOK_SPLIT: token -> (b, s) division-free
            # STREAM: q/k loads .cg, stores .cs (eviction_policy would cost a 64-bit policy
            # register: W4 (4, 16, 8) 86 instead of 79 registers, 2 CTAs/SM instead of 3, 3.6)
            stream,
            pdl,  # PDL: launched with programmatic dependent launch (griddepcontrol wait/launch)
        )
        n_chunks = -(-hq // block_h) + -(-hk // block_h)
        grid = (-(-n_tokens // block_t) * (n_chunks if head_grid else 1), 1, 1)
        plan = _Plan(ints, consts, grid, num_warps, pos is not None)
        plan.pdl = pdl
        return plan
