"""RotaryEmbedding: the frequencies of one model and its float32 cos/sin tables per device."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ._errors import RopeError
from .frequencies import compute_inv_freq, cos_sin_table, freq_turns_of, rope_type_of

DEFAULT_TABLE_POSITIONS = 8192


class RotaryEmbedding:
    """Frequencies (inv_freq, attention factor) of one model, and its cos/sin tables.

    Args:
        head_dim: size of each head.
        rotary_dim: leading dims that rotate (even, <= head_dim); default head_dim.
        base: rope_theta; default 10000 (or ``scaling["rope_theta"]`` when given there).
        scaling: Hugging Face ``rope_parameters`` / ``rope_scaling`` dict (``rope_type`` default,
            linear, dynamic, yarn, longrope, llama3, and that type's keys).
        max_position: the model's max_position_embeddings; also the number of table rows
            (default 8192). Positions beyond the table are computed on the fly, exactly as well.
        style: "neox" (half-split) or "gptj" (interleaved).
        device: where the first table is built; tables for other devices are built on first use.
        seq_len: the sequence length that ``dynamic`` and ``longrope`` scale for (see
            ``rope_ops.frequencies``); ignored by the other types.

    Calling it, ``rope(q, k, pos, layout=None, inplace=False, backend=None)``, is ``rope_ops.apply``
    with these parameters.
    """

    def __init__(self, head_dim: int, *, rotary_dim: int | None = None, base: float | None = None,
                 scaling: Mapping[str, Any] | None = None, max_position: int | None = None,
                 style: str = "neox", device: torch.device | str | None = None,
                 seq_len: int | None = None):
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise RopeError(f"head_dim: expected a positive int, got {head_dim!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        check_rotary_dim(rotary_dim, head_dim)
        if style not in ("neox", "gptj"):
            raise RopeError(f"style: expected 'neox' or 'gptj', got {style!r}")
        if max_position is not None and (not isinstance(max_position, int) or max_position < 0):
            raise RopeError(f"max_position: expected an int >= 0, got {max_position!r}")
        rope_type_of(scaling)  # validates the type before anything else
        if base is None:
            base = (scaling or {}).get("rope_theta", 10000.0)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.scaling = dict(scaling) if scaling else None
        self.max_position = max_position
        self.style = style
        self.seq_len = seq_len
        self.inv_freq, self.attention_factor = compute_inv_freq(
            rotary_dim, base, scaling, max_position=max_position, seq_len=seq_len)
        self.table_positions = DEFAULT_TABLE_POSITIONS if max_position is None else max_position
        self._freq_turns = freq_turns_of(self.inv_freq)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.key = f"rope{next(_KEYS)}"
        _ROPES_BY_KEY[self.key] = self
        if device is not None:
            self.tables(torch.device(device))

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.scaling)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, freq_turns) on ``device``: float32 [P, r/2] twice and int64 [r/2]."""
        found = self._tables.get(device)
        if found is None:
            with self._lock:
                found = self._tables.get(device)
                if found is None:
                    cos, sin = cos_sin_table(self.inv_freq, self.attention_factor, self.table_positions)
                    found = (cos.to(device), sin.to(device), self._freq_turns.to(device))
                    self._tables[device] = found
        return found

    def with_seq_len(self, seq_len: int) -> RotaryEmbedding:
        """The same model's frequencies for ``seq_len`` (dynamic NTK / LongRoPE); cached."""
        return cached_rope(self.head_dim, self.rotary_dim, self.base, self.scaling, self.max_position,
                           self.style, seq_len)

    @classmethod
    def from_hf_config(cls, config, *, style: str | None = None, device=None,
                       seq_len: int | None = None) -> RotaryEmbedding:
        """Build from a Hugging Face config object or dict: rope_theta, rope_parameters /
        rope_scaling, partial_rotary_factor, head_dim and max_position_embeddings are read from
        it, so they always match the model. ``style`` defaults to neox (gptj for model_type gptj
        and codegen, whose checkpoints use interleaved pairs)."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        params = dict(get("rope_parameters") or get("rope_scaling") or {})
        base = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        partial = params.pop("partial_rotary_factor", None) or get("partial_rotary_factor") or 1.0
        rotary_dim = get("rotary_dim") or int(head_dim * partial)
        max_position = get("max_position_embeddings")
        if "original_max_position_embeddings" not in params and get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = get("original_max_position_embeddings")
        if style is None:
            style = "gptj" if get("model_type") in ("gptj", "codegen") else "neox"
        return cls(head_dim, rotary_dim=rotary_dim, base=float(base), scaling=params or None,
                   max_position=max_position, style=style, device=device, seq_len=seq_len)

    def __call__(self, q, k, pos, *, layout: str | None = None, inplace: bool = False,
                 backend: str | None = None):
        from ._api import apply

        return apply(q, k, pos, layout=layout, inplace=inplace, backend=backend, rope=self)

    def __repr__(self) -> str:
        return (f"RotaryEmbedding(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"base={self.base}, rope_type={self.rope_type!r}, style={self.style!r}, "
                f"attention_factor={self.attention_factor:.6g}, table_positions={self.table_positions})")


def check_rotary_dim(rotary_dim, head_dim: int) -> None:
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise RopeError(f"rotary_dim: expected an int, got {rotary_dim!r}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise RopeError(f"rotary_dim: expected an even int in (0, head_dim={head_dim}], got {rotary_dim}")


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}
# Every RotaryEmbedding by its key: traced code (torch.compile) refers to one by key and the op
# fetches its tables on the tensors' device when it runs.
_ROPES_BY_KEY: weakref.WeakValueDictionary[str, RotaryEmbedding] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def rope_by_key(key: str) -> RotaryEmbedding:
    rope = _ROPES_BY_KEY.get(key)
    if rope is None:
        raise RopeError(f"rope: no RotaryEmbedding with key {key!r} (it was garbage-collected)")
    return rope


def _freeze(value):
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@torch._dynamo.assume_constant_result
def cached_rope_key(head_dim: int, rotary_dim: int | None, base: float | None, scaling, max_position,
                    style: str, seq_len: int | None = None) -> str:
    """cached_rope(...).key, evaluated once outside tracing under torch.compile."""
    return cached_rope(head_dim, rotary_dim, base, scaling, max_position, style, seq_len).key


def cached_rope(head_dim: int, rotary_dim: int | None, base: float | None, scaling, max_position,
                style: str, seq_len: int | None = None) -> RotaryEmbedding:
    """One RotaryEmbedding per set of parameters, reused by ``apply`` calls without ``rope=``."""
    key = (head_dim, rotary_dim, base, _freeze(scaling) if scaling else None, max_position, style, seq_len)
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, base=base, scaling=scaling,
                               max_position=max_position, style=style, seq_len=seq_len)
        _ROPE_CACHE[key] = rope
    return rope
