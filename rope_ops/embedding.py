"""RotaryEmbedding: the frequencies of one model and its cos/sin tables, as a torch.nn.Module."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._errors import RopeError
from ._tables import CACHE, Tables, build_tables, freqs_spec
from .frequencies import Frequencies, check_positive, check_seq_len, frequencies, rope_type_of

DEFAULT_TABLE_ROWS = 8192  # rows when the model's max_position is not given
MAX_DEFAULT_TABLE_ROWS = 1 << 17  # positions past the table are computed on the fly, as exactly


def check_rotary_dim(rotary_dim, head_dim: int) -> int:
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise RopeError(f"rotary_dim: expected an int, got {rotary_dim!r}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise RopeError(f"rotary_dim: expected an even int in (0, head_dim={head_dim}], got {rotary_dim}")
    return rotary_dim


def check_style(style) -> str:
    if style not in ("neox", "gptj"):
        raise RopeError(f"style: expected 'neox' or 'gptj', got {style!r}")
    return style


def check_base(base):
    if base is None:
        return None
    return check_positive("base", base)


def check_max_position(max_position):
    if max_position is None:
        return None
    return check_positive("max_position", max_position, integer=True)


def default_table_rows(max_position: int | None) -> int:
    return DEFAULT_TABLE_ROWS if max_position is None else min(max_position, MAX_DEFAULT_TABLE_ROWS)


def rows_for(freqs: Frequencies, rows: int) -> int:
    """Table rows for these frequencies: none for dynamic NTK stretched to one sequence length
    (a new length gives new frequencies each decode step; every row is computed on the fly
    instead of building a table per step)."""
    return 0 if freqs.per_length else rows


def resolve_base(base, scaling) -> float:
    """base, else scaling['rope_theta'], else 10000 (the Hugging Face default)."""
    if base is None and scaling is not None and scaling.get("rope_theta") is not None:
        base = scaling["rope_theta"]
    return 10000.0 if base is None else check_positive("base", base)


class RotaryEmbedding(torch.nn.Module):
    """Frequencies (inv_freq, attention factor) of one model, and its cos/sin tables as buffers.

    Args:
        head_dim: size of each head.
        rotary_dim: leading dims that rotate (even, <= head_dim); default head_dim.
        base: rope_theta; default ``scaling["rope_theta"]`` when given there, else 10000.
        scaling: Hugging Face ``rope_parameters`` / ``rope_scaling`` dict (``rope_type`` default,
            linear, dynamic, yarn, longrope, llama3, and that type's keys).
        max_position: the model's max_position_embeddings.
        style: "neox" (half-split) or "gptj" (interleaved).
        device: where the tables are built (default the CPU; ``.to(device)`` moves them).
        seq_len: the sequence length ``dynamic`` and ``longrope`` scale for (see
            ``rope_ops.frequencies``); ignored by the other types, whose frequencies do not
            depend on it.
        table_rows: rows of the cos/sin table (default max_position capped at 131072, or 8192).
            Positions outside the table are computed on the fly, to the same accuracy.

    The tables are non-persistent buffers (derived from the arguments, never saved in a state
    dict) and stay float32 (int64 for the fixed-point frequencies) whatever dtype the module is
    cast to. Calling it, ``rope(q, k, pos, ...)``, is ``rope_ops.apply(q, k, pos, rope=rope, ...)``.
    """

    def __init__(self, head_dim: int, *, rotary_dim: int | None = None, base: float | None = None,
                 scaling: Mapping[str, Any] | None = None, max_position: int | None = None,
                 style: str = "neox", device: torch.device | str | None = None,
                 seq_len: int | None = None, table_rows: int | None = None):
        super().__init__()
        head_dim = check_positive("head_dim", head_dim, integer=True)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        check_rotary_dim(rotary_dim, head_dim)
        check_style(style)
        max_position = check_max_position(max_position)
        rope_type_of(scaling)  # the type first: its errors are the clearest
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = resolve_base(base, scaling)
        self.scaling = dict(scaling) if scaling else None
        self.max_position = max_position
        self.style = style
        self.seq_len = check_seq_len(seq_len)
        if table_rows is None:
            table_rows = default_table_rows(max_position)
        else:
            table_rows = check_positive("table_rows", table_rows, integer=True, minimum=0)
        self.freqs = frequencies(rotary_dim, self.base, self.scaling, max_position, self.seq_len)
        self.attention_factor = self.freqs.attention_factor
        self.rope_type = self.freqs.rope_type
        self.table_rows = rows_for(self.freqs, table_rows)
        self._default_rows = table_rows
        # the frequency parameters as text: what a compiled call passes its op when this
        # module's own tables do not serve it (another device, another seq_len)
        self.freqs_spec = freqs_spec(self.base, self.scaling, max_position, table_rows)
        tables = build_tables(self.freqs, self.table_rows,
                              torch.device("cpu") if device is None else torch.device(device))
        self.register_buffer("cos_table", tables.cos, persistent=False)
        self.register_buffer("sin_table", tables.sin, persistent=False)
        self.register_buffer("freq_turns", tables.freq_turns, persistent=False)
        # rope_ops.apply's cached plans for calls with this module: they die with it.
        self._plans: dict = {}
        self._guards: dict = {}

    # -- what the tables are -------------------------------------------------------------

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.freqs.inv_freq

    def frequencies_for(self, seq_len: int | None) -> Frequencies:
        """The frequencies at ``seq_len`` (this module's own when the type ignores it)."""
        if seq_len is None or self.freqs.rope_type not in ("dynamic", "longrope"):
            return self.freqs
        return frequencies(self.rotary_dim, self.base, self.scaling, self.max_position, seq_len)

    def tables(self, device: torch.device, seq_len: int | None = None) -> Tables:
        """(cos, sin, freq_turns, attention factor) on ``device`` for ``seq_len``: this module's
        buffers where they fit, else from rope_ops' byte-bounded table cache."""
        freqs = self.frequencies_for(seq_len) if seq_len is not None else self.freqs
        if freqs.key == self.freqs.key and self.cos_table.device == device:
            return Tables(self.cos_table, self.sin_table, self.freq_turns, freqs.attention_factor)
        return CACHE.get(freqs, rows_for(freqs, self._default_rows), device)

    def with_seq_len(self, seq_len: int) -> RotaryEmbedding:
        """This model's embedding for ``seq_len`` (dynamic NTK / LongRoPE). Prefer
        ``rope(q, k, pos, seq_len=n)``, which builds no module."""
        return RotaryEmbedding(self.head_dim, rotary_dim=self.rotary_dim, base=self.base,
                               scaling=self.scaling, max_position=self.max_position,
                               style=self.style, device=self.cos_table.device, seq_len=seq_len,
                               table_rows=self._default_rows)

    # -- nn.Module ---------------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        device = self.cos_table.device
        super()._apply(fn, recurse)
        # A dtype cast (model.half(), .to(torch.bfloat16)) must not round the tables, and a move
        # by to_empty() (a model initialised on the meta device) leaves them uninitialised:
        # rebuild them exactly whenever dtype or device changed.
        if (self.cos_table.dtype != torch.float32 or self.freq_turns.dtype != torch.int64
                or self.cos_table.device != device):
            tables = build_tables(self.freqs, self.table_rows, self.cos_table.device)
            self.cos_table, self.sin_table, self.freq_turns = tables.cos, tables.sin, tables.freq_turns
        self._plans.clear()
        self._guards.clear()
        return self

    def forward(self, q, k, pos, *, layout: str | None = None, inplace: bool = False,
                backend: str | None = None, seq_len: int | None = None):
        from ._api import apply

        return apply(q, k, pos, layout=layout, inplace=inplace, backend=backend, rope=self,
                     seq_len=seq_len)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
                f"rope_type={self.rope_type!r}, style={self.style!r}, "
                f"attention_factor={self.attention_factor:.6g}, table_rows={self.table_rows}")

    # -- Hugging Face ------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config, *, style: str | None = None, device=None,
                       seq_len: int | None = None, layer_type: str | None = None) -> RotaryEmbedding:
        """Build from a Hugging Face config object or dict.

        rope_theta, rope_parameters / rope_scaling, partial_rotary_factor (rotary_pct), head_dim,
        rotary_dim and max_position_embeddings are read from it, so they always match the model;
        a value that is present but invalid (a zero base or factor, say) is a RopeError, never
        replaced by a default. Models whose rope_parameters differ per layer type (Gemma 3:
        ``sliding_attention`` / ``full_attention``) need ``layer_type``. ``style`` defaults to
        neox (gptj for model_type gptj and codegen, whose checkpoints use interleaved pairs).
        """
        params = hf_rope_parameters(config, layer_type)
        get = _getter(config)
        base = params.pop("rope_theta", None)
        for name in ("rope_theta", "rotary_emb_base"):
            if base is None:
                base = get(name)
        if base is None:
            base = 10000.0
        head_dim = get("head_dim")
        if head_dim is None:
            hidden, heads = get("hidden_size"), get("num_attention_heads")
            if hidden is None or heads is None:
                raise RopeError("config: needs head_dim, or hidden_size and num_attention_heads")
            heads = check_positive("config.num_attention_heads", heads, integer=True)
            hidden = check_positive("config.hidden_size", hidden, integer=True)
            if hidden % heads:
                raise RopeError(f"config: hidden_size {hidden} is not a multiple of "
                                f"num_attention_heads {heads}")
            head_dim = hidden // heads
        head_dim = check_positive("config.head_dim", head_dim, integer=True)
        partial = params.pop("partial_rotary_factor", None)
        for name in ("partial_rotary_factor", "rotary_pct"):
            if partial is None:
                partial = get(name)
        rotary_dim = get("rotary_dim")
        if rotary_dim is None:
            partial = 1.0 if partial is None else check_positive("config.partial_rotary_factor", partial)
            if partial > 1:
                raise RopeError(f"config.partial_rotary_factor: expected a fraction in (0, 1], got {partial}")
            rotary_dim = int(head_dim * partial)
            if rotary_dim < 2:
                raise RopeError(f"config.partial_rotary_factor: {partial} of head_dim {head_dim} "
                                f"leaves rotary_dim {rotary_dim}")
            rotary_dim -= rotary_dim % 2
        max_position = get("max_position_embeddings")
        if params.get("original_max_position_embeddings") is None and get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = get("original_max_position_embeddings")
        for key in ("mrope_section", "mrope_interleaved"):
            params.pop(key, None)
        if style is None:
            style = "gptj" if get("model_type") in ("gptj", "codegen") else "neox"
        return cls(head_dim, rotary_dim=rotary_dim, base=base, scaling=params or None,
                   max_position=max_position, style=style, device=device, seq_len=seq_len)


def _getter(config):
    if isinstance(config, Mapping):
        return config.get
    return lambda key, default=None: getattr(config, key, default)


def hf_rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope_parameters (or rope_scaling) as a new dict; per-layer-type parameters
    (a dict of dicts) need ``layer_type``, and a layer_type the config does not have is an error."""
    get = _getter(config)
    params = get("rope_parameters")
    if params is None:
        params = get("rope_scaling")
    params = dict(params or {})
    nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
    if nested:
        if layer_type is None:
            raise RopeError(f"config: rope_parameters are given per layer type {sorted(nested)}; "
                            "pass layer_type= to choose one")
        if layer_type not in nested:
            raise RopeError(f"layer_type: {layer_type!r} not in the config's {sorted(nested)}")
        return dict(nested[layer_type])
    if layer_type is not None:
        raise RopeError(f"layer_type: {layer_type!r} given, but the config's rope_parameters are "
                        "the same for every layer")
    return params
