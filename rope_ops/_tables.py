"""The cos/sin tables rope_ops builds, per frequencies, row count and device: a cache bounded
in bytes (and in entries).

A table is keyed by what its values depend on (the frequencies' content key, the row count and
the device), never by a user object, so discarding a RotaryEmbedding or calling with a thousand
different ``seq_len`` values keeps nothing alive and grows nothing. The least recently used
tables are dropped once the cache holds more than ``ROPE_OPS_TABLE_CACHE_MB`` (default 512 MiB)
per device; a caller still holding a dropped table keeps using it safely (tensors are reference
counted), it is just not shared any more.

Under ``torch.compile``, a call whose tables are not at hand as tensors (functional calls, a
RotaryEmbedding used on another device or at another seq_len) passes the op a ``spec``: the
frequency parameters as text. The op turns it into tables when it runs (``tables_from_spec``),
so a compiled graph depends on no object and on no cache entry: a dropped table is rebuilt.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from .frequencies import Frequencies, cos_sin_table, frequencies


class Tables(NamedTuple):
    cos: torch.Tensor  # float32 [rows, r/2], m*cos
    sin: torch.Tensor  # float32 [rows, r/2], m*sin
    freq_turns: torch.Tensor  # int64 [r/2] fixed-point turns (frequencies.freq_turns_of)
    attention_factor: float  # m, for rows computed on the fly

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self[:3])


MAX_ENTRIES = 512  # tables of on-the-fly frequencies are tiny: bound their number too


def _budget_bytes() -> int:
    raw = os.environ.get("ROPE_OPS_TABLE_CACHE_MB", "512")
    try:
        value = float(raw)
    except ValueError:
        value = 512.0
    return max(0, int(value * (1 << 20)))


class TableCache:
    """LRU of Tables per (frequency key, rows, device), at most ``budget`` bytes per device."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self._entries: OrderedDict[str, Tables] = OrderedDict()  # least recently used first
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        # Called (no arguments) whenever an entry is dropped: holders of derived state (the
        # plans of rope_ops.apply) forget what might still reference it.
        self.on_evict: list = []

    @property
    def budget(self) -> int:
        return _budget_bytes() if self._budget is None else self._budget

    def get(self, freqs: Frequencies, rows: int, device: torch.device) -> Tables:
        key = table_key(freqs, rows, device)
        found = self._entries.get(key)
        if found is not None:
            try:
                self._entries.move_to_end(key)  # least recently used goes first
            except KeyError:  # dropped by another thread meanwhile: still a valid table
                pass
            return found
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                found = build_tables(freqs, rows, device)
                self._insert(key, found)
        return found

    def _insert(self, key: str, tables: Tables) -> None:
        device = str(tables.cos.device)
        self._entries[key] = tables
        self._bytes[device] = self._bytes.get(device, 0) + tables.nbytes
        evicted = False
        budget = self.budget
        for old in list(self._entries):
            if self._bytes[device] <= budget and len(self._entries) <= MAX_ENTRIES:
                break
            if old == key:
                continue
            old_device = str(self._entries[old].cos.device)
            if old_device != device and len(self._entries) <= MAX_ENTRIES:
                continue
            self._bytes[old_device] -= self._entries.pop(old).nbytes
            evicted = True
        if evicted:
            for callback in self.on_evict:
                callback()

    def by_key(self, key: str) -> Tables:
        """The entry ``key`` (made by ``get``); KeyError when it was dropped."""
        return self._entries[key]

    def bytes_held(self, device=None) -> int:
        if device is None:
            return sum(self._bytes.values())
        return self._bytes.get(str(torch.device(device)), 0)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes.clear()
        for callback in self.on_evict:
            callback()


def table_key(freqs: Frequencies, rows: int, device: torch.device) -> str:
    return f"{freqs.key}|{rows}|{device}"


def build_tables(freqs: Frequencies, rows: int, device: torch.device) -> Tables:
    # Never inference tensors, though built under inference_mode (a first call, a module made
    # there): tables outlive the call, and a later training call saves them for backward.
    with torch.inference_mode(False):
        cos, sin = cos_sin_table(freqs.inv_freq, freqs.attention_factor, rows)
        return Tables(cos.to(device), sin.to(device), freqs.freq_turns.to(device),
                      freqs.attention_factor)


CACHE = TableCache()


def freqs_spec(base: float, scaling, max_position, rows: int) -> str:
    """The frequency parameters of a call as text (what tables_from_spec takes)."""
    return json.dumps({"base": base, "scaling": scaling, "max_position": max_position, "rows": rows},
                      sort_keys=True)


_parsed: dict[str, dict] = {}


def tables_from_spec(spec: str, rotary_dim: int, seq_len: int | None, device: torch.device) -> Tables:
    """The tables a freqs_spec describes, for ``rotary_dim`` frequencies at ``seq_len``, from
    the cache (built if missing)."""
    params = _parsed.get(spec)
    if params is None:
        params = json.loads(spec)
        if len(_parsed) >= 256:
            _parsed.clear()
        _parsed[spec] = params
    freqs = frequencies(rotary_dim, params["base"], params["scaling"], params["max_position"], seq_len)
    rows = 0 if freqs.per_length else params["rows"]
    return CACHE.get(freqs, rows, device)
