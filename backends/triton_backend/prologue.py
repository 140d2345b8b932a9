"""Host side of the Triton fused prologue (TritonBackend.run_prologue / run_prologue_backward):
launch arguments from PrologueArgs, the launch configuration, and the weight gradients'
final reduction. The kernels are in prologue_kernels.py.

Launches go through triton's JIT (``kernel[grid](...)``); the configuration comes from the rope
kernel's launch policy (``launch_policy``) on the call's class, a chunk holding whole heads.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from rope_ops.backend import PrologueArgs, prologue_forward_torch

from . import (_INTERPRET, CallShape, ChunkRules, DeviceInfo, KernelConfig,
               _angle_pointers, _angle_source, _cdiv, _kernels, _next_pow2, _prev_pow2,
               _stand_in, _strides4, candidate_configs, device_info, launch_policy, parse_label,
               pass_pieces, rotary_pieces)

_FP8 = getattr(torch, "float8_e4m3fn", None)
CACHE_NONE, CACHE_SAME, CACHE_SCALED, CACHE_SCALED_GRID = 0, 1, 2, 3  # prologue_kernels.CACHE_*
# The backward's grid: at most BACKWARD_PROGRAMS_PER_SM programs per SM, each walking token
# blocks pid, pid + programs, ... (one row of weight-gradient partial sums per program) in a loop
# that triton software-pipelines with up to BACKWARD_STAGES stages (the next STAGES - 1 blocks'
# reads copied asynchronously into shared memory while one is computed, as the CUDA backward
# stages its rows), fewer where the staged reads would take more than
# BACKWARD_STAGED_BYTES_PER_WARP per warp of the program. Latency is hidden by blocks in flight,
# not by wide blocks: a token block holds BACKWARD_STEP_BYTES of each chunk's widest piece, read
# by at most 4 warps (8 bytes a thread). Training step [2, 4096], 32/8 heads, D 128, bf16,
# QK-norm, forward + backward on input sets rotated past the L2, triton 3.6, 2026-12-07, each
# GPU's configurations in one run (NOTES.md: the tables): 1 token, 4 warps, 2 stages took
# 139.4 us at 4 programs per SM on an H200 (copy 115.9 us; 3 programs 149.5, 8 programs 144.3,
# 5 or 6 programs 157-165, 3 stages 150.4), and 182.5 us at 4 programs on an H100 (copy 162.0;
# 3 programs 181.3, 3 stages 188.8, 2 warps 226.0, 8 warps 250.8). float32, head_dim 64, H200:
# 71.3 us at 4 programs (2 warps 70.3) against 75.3 at 3.
BACKWARD_PROGRAMS_PER_SM = 4
BACKWARD_STAGES = 2
BACKWARD_STAGED_BYTES_PER_WARP = 14 * 1024  # 4 programs of 4 warps: 224 KiB of an SM's 228
# Shared memory a backward program takes beside its staged reads, kept free under the device's
# per-block maximum (sm_90, triton 3.9: 51.2 KiB in all for 48.1 KiB staged, 100.5 for 94.0;
# tests/test_triton_compile.py checks the bound).
BACKWARD_SHARED_RESERVE = 16 * 1024
BACKWARD_STEP_BYTES = 1024
BACKWARD_MAX_WARPS = 4
# weight_grads' tiles: at most this many rows of partial sums, and floats in all.
WEIGHT_GRAD_ROWS = 1024
WEIGHT_GRAD_TILE = 8192
# The launch policy's rules for the prologue: a chunk holds whole heads in float32 through the
# norm, the rotation and (backward) the input and its gradient at once, so twice the threads of
# the rope kernel per chunk byte and half its chunk (sm_90 compile, W1 shapes, triton 3.9: 16
# heads x 4 tokens x 256 bytes at 8 warps took 145 registers, 8 x 4 at 8 warps 95).
# Warps: 64 bytes per thread in the token walk, 32 in the head grid (H200, triton 3.6, 2026-12-02,
# every candidate timed in one run: prefill QK-norm 108.1 us with 4 warps per 8 KiB chunk against
# 126.7 with 8, in place 93.9 against 106.6, training fwd+bwd 324.0 against 521.5; decode with a
# cache 4.71 us with 4 warps per 4 KiB chunk against 4.77 with 2 (5.85 against 4.82 with fp8)).
PROLOGUE_RULES = ChunkRules(chunk_bytes=8192, chunk_bytes_rotary_only=8192, max_block_h=8,
                            bytes_per_thread=32, walk_bytes_per_thread=64)
# Registers per thread at most (ptxas's .maxnreg): 16 warps per SM. Left free, ptxas schedules
# the unrolled chunks' loads early and takes up to 204 (backward, W4 shapes) without needing
# them (no spills at 128; tests/test_triton_compile.py checks).
PROLOGUE_MAX_REGISTERS = 128


def prologue_pieces(rotary_dim: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(ROT_A, ROT_B, PASS_A, PASS_B, PASS_C) of a head; rotary_dim 0 (no rotation): every dim
    in pass-through pieces."""
    rot = rotary_pieces(rotary_dim) if rotary_dim else (0, 0)
    rest = pass_pieces(rotary_dim, head_dim) if rotary_dim < head_dim else (0, 0, 0)
    return (*rot, *rest)


def prologue_shape(args: PrologueArgs) -> CallShape:
    """The call's class for the launch policy: a chunk moves whole heads (the norm reads every
    dim)."""
    lead = args.qkv.shape[:-1]
    n_tokens = 1
    for n in lead:
        n_tokens *= n
    return CallShape(n_tokens, args.num_q_heads, args.num_kv_heads, args.head_dim,
                     args.rotary_dim if args.rotate else args.head_dim, args.qkv.element_size(),
                     False)


def prologue_policy(args: PrologueArgs) -> KernelConfig:
    """The configuration of the forward and the backward (which walks tokens whatever it says
    about the grid)."""
    return launch_policy(prologue_shape(args), device_info(args.qkv.device), rules=PROLOGUE_RULES)


def prologue_candidates(args: PrologueArgs) -> list[str]:
    """Labels of the configurations worth timing (the policy's first). Tooling only."""
    configs = candidate_configs(prologue_shape(args), device_info(args.qkv.device), PROLOGUE_RULES)
    return [c.label() for c in configs]


def _as_bs(t: torch.Tensor, thd: bool) -> torch.Tensor:
    """A [B, S, ...] view (thd: B = 1)."""
    return t.unsqueeze(0) if thd else t


def _token_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a [B, S, ...] view, 0 where that dim has size 1."""
    return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in (0, 1))


def _tok_split(batch: int, seq: int) -> int:
    return 1 if batch == 1 else (2 if seq == 1 else 0)


def _angle_arguments(args: PrologueArgs, q4: torch.Tensor):
    """(pointers pos, cos, sin, turns; ints after pos_offset, attn_factor; constexprs) of the
    angle stage; placeholders without rotation (never read)."""
    if not args.rotate:
        x = args.qkv
        return (x, x, x, x), (0,) * 8, (0, False, False, 0, 0, False)
    kargs = args.rotation(q4)
    ints, consts = _angle_source(kargs)
    cos, sin = args.cos, args.sin
    if args.angles != "token" and cos.shape[0] == 0:
        cos = sin = _stand_in(cos, args.rotary_dim)
    return _angle_pointers(args.pos, cos, sin, args.freq_turns), ints, consts


def _weight(w: torch.Tensor | None, qkv: torch.Tensor):
    """(pointer, stride, present) of a norm weight."""
    if w is None:
        return qkv, 0, False
    return w, (w.stride(0) if w.shape[0] > 1 else 0), True


@contextlib.contextmanager
def _on_device(device: torch.device):
    """Triton launches on the current device: make it the tensors'."""
    if device.type == "cuda" and device.index is not None and \
            device.index != torch.cuda.current_device():
        with torch.cuda.device(device.index):
            yield
    else:
        yield


def _config(args: PrologueArgs, label: str | None) -> KernelConfig:
    return parse_label(label) if label is not None else prologue_policy(args)


class PrologueLaunch(NamedTuple):
    """One launch of a prologue kernel: grid size, warps, the kernel's arguments in signature
    order (constexprs included, as triton takes them), and the tensors it writes that the
    caller returns."""

    programs: int
    num_warps: int
    arguments: tuple
    max_registers: int | None
    grad_qkv: torch.Tensor | None = None
    partials: tuple = ()

    def options(self) -> dict:
        """Triton's launch options."""
        opts = {"num_warps": self.num_warps}
        if self.max_registers is not None and not _INTERPRET:
            opts["maxnreg"] = self.max_registers
        return opts


def _chunk_heads(args: PrologueArgs, cfg: KernelConfig) -> tuple[int, int]:
    """(q, k) heads of a chunk: the configuration's, at most the call's heads rounded up to a
    power of two."""
    return (min(cfg.block_hq, _next_pow2(args.num_q_heads)),
            min(cfg.block_hk, _next_pow2(args.num_kv_heads)))


def forward_launch(args: PrologueArgs, label: str | None = None,
                   max_registers: int | None = PROLOGUE_MAX_REGISTERS) -> PrologueLaunch | None:
    """The forward's launch, or None where the kernel does not apply (no tokens; outputs
    without stride 1 on head_dim, which rope_ops never allocates: run_prologue then runs the
    torch ops)."""
    thd = args.layout == "thd"
    qkv = args.qkv
    x3 = _as_bs(qkv, thd)
    batch, seq = x3.shape[0], x3.shape[1]
    n_tokens = batch * seq
    hq, hk, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    if n_tokens == 0:
        return None
    heads = x3.unflatten(-1, (hq + 2 * hk, d))
    if args.inplace:
        outs = (heads[:, :, :hq], heads[:, :, hq:hq + hk], heads[:, :, hq:hq + hk])
    else:
        outs = tuple(_as_bs(t, thd) for t in (args.q_out, args.k_out, args.v_out))
    if d > 1 and any(t.stride(-1) != 1 for t in outs):
        return None
    out_strides = [tuple(_strides4(t, t.shape)[:3]) for t in outs]
    cache = CACHE_NONE
    kc = vc = slots = qkv
    n_slots = 0
    cache_ints = (0, 0, 0, 0, 0, 0)
    if args.k_cache is not None:
        kc, vc = args.k_cache, args.v_cache
        cache = CACHE_SAME
        if kc.dtype == _FP8:
            cache = CACHE_SCALED_GRID if _INTERPRET else CACHE_SCALED
        slots = _as_bs(args.slots, thd)
        n_slots = kc.shape[0]
        cache_ints = (kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                      *_token_strides(slots))
    # float8 q (out of place only): q / q_scale, converted exactly as the float8 cache is
    q_fp8 = CACHE_NONE
    if args.q_scale > 0:
        q_fp8 = CACHE_SCALED_GRID if _INTERPRET else CACHE_SCALED
    angle_ptrs, angle_ints, angle_consts = _angle_arguments(args, heads[:, :, :hq])
    qw, s_qw, q_norm = _weight(args.q_weight, qkv)
    kw, s_kw, k_norm = _weight(args.k_weight, qkv)
    r = args.rotary_dim if args.rotate else 0
    cfg = _config(args, label)
    block_hq, block_hk = _chunk_heads(args, cfg)
    store_v = not args.inplace
    n_chunks = _cdiv(hq, block_hq) + _cdiv(hk, block_hk) * (2 if store_v or cache else 1)
    programs = _cdiv(n_tokens, cfg.block_t) * (n_chunks if cfg.head_grid else 1)
    arguments = (
        qkv, *outs, n_tokens, seq, *_token_strides(x3), *out_strides[0], *out_strides[1],
        *out_strides[2],
        qw, kw, s_qw, s_kw, float(args.eps), float(args.weight_offset),
        kc, vc, slots, n_slots, *cache_ints, float(args.k_scale), float(args.v_scale),
        float(args.q_scale) if q_fp8 else 1.0,
        *angle_ptrs, int(args.pos_offset), float(args.attention_factor), *angle_ints,
        hq, hk, d, r, bool(args.interleaved), _tok_split(batch, seq), bool(args.rotate),
        *angle_consts, _kernels()["libdevice"], q_norm, k_norm, store_v, cache, q_fp8,
        *prologue_pieces(r, d), cfg.head_grid, cfg.block_t, block_hq, block_hk)
    return PrologueLaunch(programs, cfg.num_warps, arguments, max_registers)


def staged_bytes(args: PrologueArgs, cfg: KernelConfig, has_grads=(True, True, True)) -> int:
    """Shared memory one stage of the backward's pipelined token-block loop takes with ``cfg``
    (its reads of a token block: the q and k inputs where normalised, the output gradients
    given, the angles' table rows and the weights), padded as the kernel's tiles are."""
    hq, hk, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    block_hq, block_hk = _chunk_heads(args, cfg)
    r = args.rotary_dim if args.rotate else 0
    rot_a, rot_b, pass_a, pass_b, pass_c = prologue_pieces(r, d)
    width = 2 * (rot_a + rot_b) + pass_a + pass_b + pass_c  # a head as its pieces
    heads_q = _cdiv(hq, block_hq) * block_hq
    heads_k = _cdiv(hk, block_hk) * block_hk
    x_heads = heads_q * (args.q_weight is not None) + heads_k * (args.k_weight is not None)
    g_heads = sum(n for n, on in zip((heads_q, heads_k, heads_k), has_grads) if on)
    angles = 2 * (rot_a + rot_b) * 4 + 8  # cos and sin rows (float32) and the position
    weights = 2 * width * 4
    return cfg.block_t * ((x_heads + g_heads) * width * args.qkv.element_size() + angles) + weights


def backward_config(args: PrologueArgs) -> KernelConfig:
    """The backward's configuration (a token walk): the policy's chunks of heads, a token block
    of at least BACKWARD_STEP_BYTES of the chunks' widest piece (16 tokens at most), read by
    warps of 8 bytes a thread, at most BACKWARD_MAX_WARPS (its weight-gradient sums are kept in
    the chunk's shape, a register per element a thread holds)."""
    cfg = prologue_policy(args)
    r = args.rotary_dim if args.rotate else 0
    rot_a, rot_b, pass_a, pass_b, pass_c = prologue_pieces(r, args.head_dim)
    wide = 2 if args.interleaved else 1  # GPT-J pairs are read as one span of 2W elements
    widest = max(rot_a * wide, rot_b * wide, pass_a, pass_b, pass_c, 1)
    block_h = max(_chunk_heads(args, cfg))
    row_bytes = block_h * widest * args.qkv.element_size()  # one token's widest piece
    block_t = 1
    while block_t < 16 and block_t * row_bytes < BACKWARD_STEP_BYTES:
        block_t *= 2
    warps = min(BACKWARD_MAX_WARPS, max(1, _prev_pow2(block_t * row_bytes // (32 * 8))))
    return KernelConfig(False, block_t, cfg.block_hq, cfg.block_hk, warps)


def backward_stages(args: PrologueArgs, cfg: KernelConfig, stages: int,
                    has_grads=(True, True, True), device: DeviceInfo | None = None) -> int:
    """``stages``, or fewer while its staged reads would take more than
    BACKWARD_STAGED_BYTES_PER_WARP per warp or more than the device lets one program have
    (1: no staging)."""
    device = device_info(args.qkv.device) if device is None else device
    per_stage = staged_bytes(args, cfg, has_grads)
    budget = min(BACKWARD_STAGED_BYTES_PER_WARP * cfg.num_warps,
                 device.shared_memory - BACKWARD_SHARED_RESERVE)
    while stages > 1 and (stages - 1) * per_stage > budget:
        stages -= 1
    return stages


class BackwardCandidate(NamedTuple):
    """A backward configuration to time (tooling): the token walk's label, pipeline stages and
    programs per SM, as ``run_prologue_backward`` takes them."""

    label: str
    stages: int
    programs_per_sm: int

    def describe(self) -> str:
        return f"{self.label} st{self.stages} pps{self.programs_per_sm}"


def backward_candidates(args: PrologueArgs) -> list[BackwardCandidate]:
    """The backward policy's choice, then its neighbours: token block x2 and /2, warps x2 and /2,
    a stage more and fewer, programs per SM x2 and /2 (stages stepped down to fit shared memory,
    as the launch does; duplicates dropped). Tooling only."""
    cfg = backward_config(args)
    g, bt, bhq, bhk, w = cfg
    st, pps = BACKWARD_STAGES, BACKWARD_PROGRAMS_PER_SM
    raw = [(cfg, st, pps),
           (KernelConfig(g, bt * 2, bhq, bhk, w), st, pps),
           (KernelConfig(g, bt // 2, bhq, bhk, w), st, pps),
           (KernelConfig(g, bt, bhq, bhk, w * 2), st, pps),
           (KernelConfig(g, bt, bhq, bhk, w // 2), st, pps),
           (cfg, st + 1, pps), (cfg, st - 1, pps), (cfg, st, pps * 2), (cfg, st, pps // 2)]
    out: list[BackwardCandidate] = []
    for c, stages, per_sm in raw:
        if not (1 <= c.block_t <= 16 and 1 <= c.num_warps <= 8 and stages >= 1 and per_sm >= 1):
            continue
        cand = BackwardCandidate(c.label(), backward_stages(args, c, stages), per_sm)
        if cand not in out:
            out.append(cand)
    return out


def backward_launch(args: PrologueArgs, grad_q, grad_k, grad_v, label: str | None = None,
                    max_registers: int | None = PROLOGUE_MAX_REGISTERS,
                    programs_per_sm: int | None = None,
                    stages: int | None = None) -> PrologueLaunch:
    """The backward's launch, with the grad_qkv it writes and the weight gradients' partial
    sums ([programs, D] float32, one row per program). ``label``, ``programs_per_sm``,
    ``stages``: another configuration (tooling)."""
    thd = args.layout == "thd"
    qkv = args.qkv
    hq, hk, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    x3, dx3 = _as_bs(qkv, thd), _as_bs(grad_qkv, thd)
    batch, seq = x3.shape[0], x3.shape[1]
    n_tokens = batch * seq
    cfg = parse_label(label) if label is not None else backward_config(args)
    block_hq, block_hk = _chunk_heads(args, cfg)
    stages = backward_stages(args, cfg, BACKWARD_STAGES if stages is None else int(stages),
                             tuple(g is not None for g in (grad_q, grad_k, grad_v)))
    n_blocks = _cdiv(n_tokens, cfg.block_t)
    per_sm = BACKWARD_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    programs = max(1, min(n_blocks, per_sm * device_info(qkv.device).sm_count))
    grads, g_strides, contig = [], [], True
    for g in (grad_q, grad_k, grad_v):
        if g is None:
            grads.append(qkv)
            g_strides.append((0, 0, 0, 1))
            continue
        g4 = _as_bs(g, thd)
        st = _strides4(g4, g4.shape)
        contig = contig and st[3] == 1
        grads.append(g4)
        g_strides.append(tuple(st))
    partials = tuple(torch.empty(programs if w is not None else 1, d, dtype=torch.float32,
                                 device=qkv.device) for w in (args.q_weight, args.k_weight))
    q4 = x3.unflatten(-1, (hq + 2 * hk, d))[:, :, :hq]
    angle_ptrs, angle_ints, angle_consts = _angle_arguments(args, q4)
    qw, s_qw, q_norm = _weight(args.q_weight, qkv)
    kw, s_kw, k_norm = _weight(args.k_weight, qkv)
    r = args.rotary_dim if args.rotate else 0
    arguments = (
        qkv, grad_qkv, *grads, n_tokens, seq, *_token_strides(x3), *_token_strides(dx3),
        *g_strides[0], *g_strides[1], *g_strides[2],
        qw, kw, s_qw, s_kw, float(args.eps), float(args.weight_offset), *partials,
        *angle_ptrs, int(args.pos_offset), float(args.attention_factor), *angle_ints,
        hq, hk, d, r, bool(args.interleaved), _tok_split(batch, seq), bool(args.rotate),
        *angle_consts, _kernels()["libdevice"], q_norm, k_norm, grad_q is not None,
        grad_k is not None, grad_v is not None, contig,
        *prologue_pieces(r, d), cfg.block_t, block_hq, block_hk, stages)
    return PrologueLaunch(programs, cfg.num_warps, arguments, max_registers, grad_qkv, partials)


def run_prologue(args: PrologueArgs, label: str | None = None,
                 max_registers: int | None = PROLOGUE_MAX_REGISTERS) -> None:
    """The forward: q, k, v into args.q_out/k_out/v_out (or q and k into qkv in place), and
    the cache. ``label``, ``max_registers``: another configuration (tooling)."""
    if args.qkv.numel() == 0:
        return
    launch = forward_launch(args, label, max_registers)
    if launch is None:
        prologue_forward_torch(args)
        return
    with _on_device(args.qkv.device):
        _kernels()["prologue_kernels"].prologue_kernel[(launch.programs,)](
            *launch.arguments, **launch.options())


def run_prologue_backward(args: PrologueArgs, grad_q, grad_k, grad_v, label: str | None = None,
                          max_registers: int | None = PROLOGUE_MAX_REGISTERS,
                          programs_per_sm: int | None = None, stages: int | None = None):
    """(grad_qkv, grad of q_weight, grad of k_weight): the weight gradients float32 [D], None
    where the weight is None. args.qkv is the forward's input; grads may be None (zero).
    ``label``, ``max_registers``, ``programs_per_sm``, ``stages``: another configuration
    (tooling)."""
    launch = backward_launch(args, grad_q, grad_k, grad_v, label, max_registers,
                             programs_per_sm, stages)
    with _on_device(args.qkv.device):
        _kernels()["prologue_kernels"].prologue_backward_kernel[(launch.programs,)](
            *launch.arguments, **launch.options())
        q_grad, k_grad = weight_grads(args, launch.partials, launch.programs)
    return launch.grad_qkv, q_grad, k_grad


def weight_grads(args: PrologueArgs, partials, rows: int) -> list:
    """[q's, k's] weight gradient, float32 [D] (None without that weight): the backward's
    [rows, D] partial sums added up in one launch for both weights (torch's sum over the rows
    took a launch of ~8 us per weight on the training step, H100)."""
    d = args.head_dim
    grads = [None if w is None else torch.empty(d, dtype=torch.float32, device=args.qkv.device)
             for w in (args.q_weight, args.k_weight)]
    if all(g is None for g in grads):
        return grads
    # tiles of up to 8192 floats: up to 1024 rows (the backward's rows in one step: a latency,
    # not a loop of them) x the columns left (8 at 1024 rows: 32 programs at D 128)
    block_r = min(WEIGHT_GRAD_ROWS, _next_pow2(rows))
    block_d = min(_next_pow2(d), max(1, WEIGHT_GRAD_TILE // block_r))
    q_grad, k_grad = (partials[0] if g is None else g for g in grads)  # never written when None
    _kernels()["prologue_kernels"].weight_grad_kernel[(_cdiv(d, block_d), 2)](
        partials[0], partials[1], q_grad, k_grad, rows, d, grads[0] is not None,
        grads[1] is not None, block_r, block_d, num_warps=8)
    return grads
