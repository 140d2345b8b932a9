"""Rotary frequencies: inv_freq and the attention factor for every Hugging Face ``rope_type``.

Frequency scaling only changes these two values (and so the cos/sin table), never a kernel.
Everything is computed in float64 with the same formulas as Hugging Face transformers'
``ROPE_INIT_FUNCTIONS`` (which compute in float32), so our tables are at least as accurate.

Sequence-length dependent types (SPEC asks us to say how they pick their length):

- ``dynamic`` (NTK): the base is stretched for ``seq_len``, which the caller passes explicitly
  (``RotaryEmbedding(..., seq_len=n)`` or ``rope.with_seq_len(n)``). ``None`` means
  ``max_position`` (the model's max_position_embeddings): no stretch, as Hugging Face does before
  it has seen a longer input. rope_ops never syncs with the device to find the length itself;
  ``rope_ops.seq_len_of(pos)`` does that one documented host sync when the caller wants it.
- ``longrope``: ``long_factor`` when ``seq_len > original_max_position_embeddings``, else
  ``short_factor``; ``seq_len`` is chosen the same explicit way (``None``: short factors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ._errors import RopeError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    if not isinstance(scaling, Mapping):
        raise RopeError(f"scaling: expected a dict like Hugging Face rope_parameters, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise RopeError(f"scaling: unknown rope_type {rope_type!r}; expected one of {ROPE_TYPES}")
    return rope_type


def compute_inv_freq(rotary_dim: int, base: float, scaling: Mapping[str, Any] | None = None, *,
                     max_position: int | None = None, seq_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq float64 [rotary_dim/2] on the CPU, attention factor m) for ``scaling``.

    ``max_position`` is the model's max_position_embeddings (needed by ``dynamic``, and the default
    ``original_max_position_embeddings`` of the others); ``seq_len`` only matters for ``dynamic``
    and ``longrope`` (module docstring).
    """
    if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 0 or math.isinf(base):
        raise RopeError(f"base: expected a finite number > 0 (rope_theta), got {base!r}")
    rope_type = rope_type_of(scaling)
    params = dict(scaling or {})
    if rope_type in ("yarn", "longrope", "llama3") and max_position is not None:
        params.setdefault("original_max_position_embeddings", max_position)
    missing = [key for key in _REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if rope_type == "dynamic" and max_position is None:
        missing.append("max_position (the model's max_position_embeddings)")
    if missing:
        raise RopeError(f"scaling: rope_type {rope_type!r} needs {missing}; got keys {sorted(params)}")

    dim = rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    attention_factor = 1.0

    if rope_type in ("default", "linear"):
        inv_freq = 1.0 / base**exponent
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "dynamic":
        factor = float(params["factor"])
        length = max(seq_len or max_position, max_position)
        base = base * ((factor * length / max_position) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / base**exponent
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(dim, base, params, exponent)
    elif rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        factor = params.get("factor")
        if factor is None:
            factor = (max_position or original) / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        use_long = seq_len is not None and seq_len > original
        ext = torch.tensor(params["long_factor" if use_long else "short_factor"], dtype=torch.float64)
        if ext.shape != (dim // 2,):
            raise RopeError(f"scaling: longrope factors need {dim // 2} entries, got {tuple(ext.shape)}")
        inv_freq = 1.0 / (ext * base**exponent)
    else:  # llama3
        inv_freq = _llama3(base**-exponent, params)
    return inv_freq, float(attention_factor)


def _yarn(dim: int, base: float, params: dict, exponent: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base**exponent
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    original = params["original_max_position_embeddings"]
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def freq_turns_of(inv_freq: torch.Tensor) -> torch.Tensor:
    """Fixed-point turns per position: frac(inv_freq / 2pi) * 2^64, as wrapped int64 [r/2].

    For an integer position p, the wrapping product p * turns is the angle p * inv_freq as a 64-bit
    fraction of a turn, exact but for the rounding of this one constant (2^-65 turn per unit of p):
    that is how kernels compute positions outside the table to SPEC's accuracy without float64.
    """
    values = []
    for f in inv_freq.tolist():
        t = f / (2 * math.pi)
        fixed = int(round((t - math.floor(t)) * 2.0**64)) % 2**64
        values.append(fixed - 2**64 if fixed >= 2**63 else fixed)
    return torch.tensor(values, dtype=torch.int64)


def cos_sin_table(inv_freq: torch.Tensor, attention_factor: float, n_positions: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (m*cos, m*sin) [n_positions, r/2] from float64 angles, rounded once."""
    positions = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    theta = positions * inv_freq.to(torch.float64).unsqueeze(0)
    cos = (attention_factor * torch.cos(theta)).to(torch.float32)
    sin = (attention_factor * torch.sin(theta)).to(torch.float32)
    return cos, sin
