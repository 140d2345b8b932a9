"""Rotary frequencies: inv_freq and the attention factor for every Hugging Face ``rope_type``.

Frequency scaling only changes these two values (and so the cos/sin table), never a kernel.
Everything is computed in float64 with the same formulas as Hugging Face transformers'
``ROPE_INIT_FUNCTIONS`` (which compute in float32), so our tables are at least as accurate.
Every parameter is validated: a bad value is a ``RopeError`` naming it, never a Python
arithmetic error and never a silently changed default.

Sequence-length dependent types (the caller passes the length; rope_ops never syncs with the
device to find it, ``rope_ops.seq_len_of(pos)`` does that one host sync when wanted):

- ``dynamic`` (NTK): the base is stretched for ``seq_len > max_position``; ``None`` or a shorter
  length means no stretch, as Hugging Face before it has seen a longer input.
- ``longrope``: ``long_factor`` when ``seq_len > original_max_position_embeddings``, else
  ``short_factor`` (``None``: short factors).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import threading
from collections import OrderedDict
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
# Types whose frequencies depend on the sequence length.
SEQ_LEN_TYPES = ("dynamic", "longrope")


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name: str, value, *, integer: bool = False, minimum=None) -> float:
    """A finite number > 0 (an int >= ``minimum`` when ``integer``), or RopeError naming it."""
    if integer:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise RopeError(f"{name}: expected an int, got {value!r}")
        low = 1 if minimum is None else minimum
        if value < low:
            raise RopeError(f"{name}: expected an int >= {low}, got {value!r}")
        return int(value)
    if not is_number(value) or not math.isfinite(value) or not value > 0:
        raise RopeError(f"{name}: expected a finite number > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise RopeError(f"{name}: expected a number >= {minimum}, got {value!r}")
    return float(value)


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise RopeError(f"scaling: expected a dict like Hugging Face rope_parameters, got "
                        f"{type(scaling).__name__}")
    nested = sorted(k for k, v in scaling.items() if isinstance(v, Mapping))
    if nested:
        raise RopeError(f"scaling: parameters per layer type {nested}; pass the dict of one layer type")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise RopeError(f"scaling: unknown rope_type {rope_type!r}; expected one of {ROPE_TYPES}")
    return rope_type


def check_seq_len(seq_len) -> int | None:
    if seq_len is None:
        return None
    return check_positive("seq_len", seq_len, integer=True, minimum=0)


def compute_inv_freq(rotary_dim: int, base: float, scaling: Mapping[str, Any] | None = None, *,
                     max_position: int | None = None, seq_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq float64 [rotary_dim/2] on the CPU, attention factor m) for ``scaling``.

    ``max_position`` is the model's max_position_embeddings (needed by ``dynamic``, and the default
    ``original_max_position_embeddings`` of the others); ``seq_len`` only matters for ``dynamic``
    and ``longrope`` (module docstring).
    """
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim <= 0 or rotary_dim % 2:
        raise RopeError(f"rotary_dim: expected an even int > 0, got {rotary_dim!r}")
    base = check_positive("base", base)
    rope_type = rope_type_of(scaling)
    if max_position is not None:
        max_position = check_positive("max_position", max_position, integer=True)
    seq_len = check_seq_len(seq_len)
    params = dict(scaling or {})
    if rope_type in ("yarn", "longrope", "llama3") and params.get("original_max_position_embeddings") is None \
            and max_position is not None:
        params["original_max_position_embeddings"] = max_position
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
            inv_freq = inv_freq / check_positive("scaling['factor']", params["factor"])
    elif rope_type == "dynamic":
        factor = check_positive("scaling['factor']", params["factor"])
        if dim <= 2:
            raise RopeError(f"rotary_dim: rope_type 'dynamic' needs rotary_dim > 2, got {dim}")
        length = max(seq_len or max_position, max_position)
        stretch = (factor * length / max_position) - (factor - 1)
        if not stretch > 0:
            raise RopeError(f"scaling['factor']: {factor} gives a non-positive NTK stretch at "
                            f"seq_len {length} (max_position {max_position})")
        base = base * stretch ** (dim / (dim - 2))
        inv_freq = 1.0 / base**exponent
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(dim, base, params, exponent)
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(dim, base, params, exponent, max_position, seq_len)
    else:  # llama3
        inv_freq = _llama3(base**-exponent, params)
    if not bool(torch.isfinite(inv_freq).all()) or not math.isfinite(attention_factor):
        raise RopeError(f"scaling: {dict(scaling or {})!r} with base {base} gives non-finite frequencies")
    return inv_freq, float(attention_factor)


def _yarn(dim: int, base: float, params: dict, exponent: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = check_positive("scaling['factor']", params["factor"])
    original = check_positive("scaling['original_max_position_embeddings']",
                              params["original_max_position_embeddings"], integer=True)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = check_positive("scaling['attention_factor']", attention_factor)
    else:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        for name, value in (("mscale", ms), ("mscale_all_dim", ms_all)):
            if value is not None and (not is_number(value) or not math.isfinite(value)):
                raise RopeError(f"scaling['{name}']: expected a finite number, got {value!r}")
        attention_factor = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
        if not math.isfinite(attention_factor) or attention_factor <= 0:
            raise RopeError(f"scaling: mscale {ms!r} / mscale_all_dim {ms_all!r} give attention "
                            f"factor {attention_factor!r}")
    beta_fast = params.get("beta_fast")
    beta_slow = params.get("beta_slow")
    beta_fast = 32.0 if beta_fast is None else check_positive("scaling['beta_fast']", beta_fast)
    beta_slow = 1.0 if beta_slow is None else check_positive("scaling['beta_slow']", beta_slow)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RopeError(f"scaling['truncate']: expected a bool, got {truncate!r}")

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    if base == 1.0:
        raise RopeError("base: rope_type 'yarn' needs base != 1 (its ramp divides by log(base))")
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base**exponent
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope(dim, base, params, exponent, max_position, seq_len) -> tuple[torch.Tensor, float]:
    original = check_positive("scaling['original_max_position_embeddings']",
                              params["original_max_position_embeddings"], integer=True)
    factor = params.get("factor")
    factor = (max_position or original) / original if factor is None else check_positive(
        "scaling['factor']", factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = check_positive("scaling['attention_factor']", attention_factor)
    elif factor <= 1.0:
        attention_factor = 1.0
    elif original < 2:
        raise RopeError("scaling['original_max_position_embeddings']: longrope derives its attention "
                        f"factor from log(original); it needs original >= 2, got {original}")
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = seq_len is not None and seq_len > original
    name = "long_factor" if use_long else "short_factor"
    values = params[name]
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise RopeError(f"scaling['{name}']: expected a list of {dim // 2} numbers, got {values!r}")
    values = list(values.tolist() if isinstance(values, torch.Tensor) else values)
    if len(values) != dim // 2:
        raise RopeError(f"scaling['{name}']: longrope factors need {dim // 2} entries (rotary_dim/2), "
                        f"got {len(values)}")
    for v in values:
        check_positive(f"scaling['{name}'] entries", v)
    ext = torch.tensor(values, dtype=torch.float64)
    return 1.0 / (ext * base**exponent), float(attention_factor)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = check_positive("scaling['factor']", params["factor"])
    low_freq_factor = check_positive("scaling['low_freq_factor']", params["low_freq_factor"])
    high_freq_factor = check_positive("scaling['high_freq_factor']", params["high_freq_factor"])
    if high_freq_factor == low_freq_factor:
        raise RopeError(f"scaling: llama3 needs high_freq_factor != low_freq_factor (both "
                        f"{low_freq_factor}); its smoothing divides by their difference")
    original = check_positive("scaling['original_max_position_embeddings']",
                              params["original_max_position_embeddings"], integer=True)
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# ---------------------------------------------------------------------------------------------
# Fixed-point turns: how kernels compute any integer position's angle without float64.


def _pi_scaled(bits: int) -> int:
    """floor(pi * 2**bits) (Machin's formula in integer arithmetic, 32 guard bits)."""
    guard = bits + 32
    one = 1 << guard

    def arctan_inv(x: int) -> int:
        total, term, n, sign = 0, one // x, 1, 1
        while term:
            total += sign * (term // n)
            term //= x * x
            n += 2
            sign = -sign
        return total

    return (16 * arctan_inv(5) - 4 * arctan_inv(239)) >> 32


_TWO_PI_BITS = 256
_TWO_PI_SCALED = 2 * _pi_scaled(_TWO_PI_BITS)  # 2*pi * 2**256, error < 2**-255 relative


def freq_turns_of(inv_freq: torch.Tensor) -> torch.Tensor:
    """Fixed-point turns per position: frac(inv_freq / 2pi) * 2^64, rounded, as wrapped int64.

    Computed exactly from the float64 value of each inv_freq (integer arithmetic with 2pi to 256
    bits), so each constant is within 2^-65 turn of the true frac(inv_freq / 2pi). For an integer
    position p the wrapping product p * turns is p's angle as a 64-bit fraction of a turn, off by
    at most |p| * 2^-65 turn: kernels take its top 32 bits, so the angle of any |p| < 2^40 is
    within 2^-24 turn (3.7e-7 rad) of exact. That is how positions outside the table meet SPEC's
    accuracy without float64 arithmetic on the device.
    """
    values = []
    for f in inv_freq.tolist():
        numerator, denominator = float(f).as_integer_ratio()  # exact; denominator a power of two
        scaled = numerator << (64 + _TWO_PI_BITS)
        divisor = denominator * _TWO_PI_SCALED
        fixed = ((2 * scaled + divisor) // (2 * divisor)) % 2**64  # round to nearest
        values.append(fixed - 2**64 if fixed >= 2**63 else fixed)
    return torch.tensor(values, dtype=torch.int64)


def reduced_angle(position: int, inv_freq: float) -> float:
    """The exact angle position * inv_freq (inv_freq taken as its float64 value), reduced to
    [-pi, pi), as a float64: the reference for positions where a float64 product is not exact."""
    numerator, denominator = float(inv_freq).as_integer_ratio()
    scaled = position * numerator << _TWO_PI_BITS  # angle * 2^256 * denominator
    period = _TWO_PI_SCALED * denominator
    reduced = (scaled + period // 2) % period - period // 2
    return reduced / (denominator << _TWO_PI_BITS)  # int / int: correctly rounded


def cos_sin_table(inv_freq: torch.Tensor, attention_factor: float, n_positions: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (m*cos, m*sin) [n_positions, r/2] from float64 angles, rounded once."""
    positions = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    theta = positions * inv_freq.to(torch.float64).unsqueeze(0)
    cos = (attention_factor * torch.cos(theta)).to(torch.float32)
    sin = (attention_factor * torch.sin(theta)).to(torch.float32)
    return cos, sin


# ---------------------------------------------------------------------------------------------
# Frequencies: the content every table is built from, identified by value.


class Frequencies:
    """inv_freq (float64, CPU), the attention factor and the fixed-point turns of one model at
    one sequence length. ``key`` identifies the content (not the object): two models with the
    same frequencies share tables."""

    __slots__ = ("rotary_dim", "inv_freq", "attention_factor", "freq_turns", "key", "rope_type",
                 "per_length")

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, rope_type: str = "default",
                 per_length: bool = False):
        # long-lived (tables and modules share them), so never inference tensors, even when
        # built under inference_mode: a later training call saves their tables for backward
        with torch.inference_mode(False):
            self.inv_freq = inv_freq.to(torch.float64).clone()
            self.freq_turns = freq_turns_of(self.inv_freq)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.attention_factor = float(attention_factor)
        self.rope_type = rope_type
        # Derived for one sequence length (dynamic NTK past max_position): a new length gives
        # new frequencies, so such frequencies get no table (every row on the fly).
        self.per_length = per_length
        digest = hashlib.blake2b(self.inv_freq.numpy().tobytes(), digest_size=12)
        digest.update(repr(self.attention_factor).encode())
        self.key = f"r{self.rotary_dim}-{digest.hexdigest()}"

    def __repr__(self) -> str:
        return f"Frequencies({self.key}, rope_type={self.rope_type!r}, attention_factor={self.attention_factor:.6g})"


def freeze(value):
    """A hashable form of a scaling dict (nested lists and dicts included)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.tolist()) if value.dim() else value.item())
    try:
        hash(value)
    except TypeError:
        raise RopeError(f"scaling: unsupported value {value!r} ({type(value).__name__})") from None
    return value


def seq_len_key(rope_type: str, seq_len: int | None, scaling, max_position) -> int | None:
    """The part of seq_len that changes the frequencies: nothing for most types, whether the
    long factors apply for longrope, the stretch length for dynamic (None: no stretch)."""
    if seq_len is None or rope_type not in SEQ_LEN_TYPES:
        return None
    if rope_type == "longrope":
        original = (scaling or {}).get("original_max_position_embeddings") or max_position
        return 1 if original is not None and seq_len > original else 0
    return seq_len if max_position is not None and seq_len > max_position else None


_CACHE_ENTRIES = 256  # small CPU objects (r/2 float64 values each)
_cache: OrderedDict[tuple, Frequencies] = OrderedDict()
_cache_lock = threading.Lock()


def frequencies(rotary_dim: int, base, scaling, max_position, seq_len) -> Frequencies:
    """The Frequencies for these parameters, from a small LRU keyed only by what changes them."""
    rope_type = rope_type_of(scaling)
    seq_len = check_seq_len(seq_len)
    key = (rotary_dim, base, freeze(scaling) if scaling else None, max_position,
           seq_len_key(rope_type, seq_len, scaling, max_position))
    try:
        found = _cache.get(key)
    except TypeError:
        raise RopeError(f"base/max_position: unhashable value in {key!r}") from None
    if found is not None:
        return found
    inv_freq, factor = compute_inv_freq(rotary_dim, base, scaling, max_position=max_position,
                                        seq_len=seq_len)
    made = Frequencies(inv_freq, factor, rope_type, per_length=rope_type == "dynamic" and key[-1] is not None)
    with _cache_lock:
        _cache[key] = made
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_ENTRIES:
            _cache.popitem(last=False)
    return made
