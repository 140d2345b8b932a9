"""Hugging Face transformers models with rope_ops as their rotary embedding.

    from rope_ops.integrations.transformers import patch

    patch(model)                          # training and inference, until .undo()
    with patch(model, exact=True):        # or for a block
        model.generate(...)

What changes:

- The model's modeling modules (``transformers.models.llama.modeling_llama``, ...) get a rope_ops
  ``apply_rotary_pos_emb`` (and ``apply_multimodal_rotary_pos_emb`` where the module has one)
  with the same signature. Attention layers look these names up when they run, so every model
  of those types in the process uses rope_ops until the last patch of that module is undone,
  as with transformers' ``kernelize`` or Liger's patches. The replacement rotates with the
  cos/sin the model's rotary module computed (per-token tables), forward and backward (the
  backward is rope_ops' inverse rotation).
- ``exact=True`` also replaces this model's rotary modules: they hand the position ids on
  instead of computing float32 cos/sin, and rope_ops takes the angles from frequencies built in
  float64 from the config (``RotaryEmbedding.from_hf_config``, per layer type where the config
  has them; mRoPE from the [3, B, S] positions). HF's float32 angle p * inv_freq is off by up
  to ~p * 2^-24 rad: ~8e-3 rad at position 131072.

Before anything is replaced, each function is called once on a small float64 example and must
compute a rotation rope_ops reproduces: pairs (i, i + r/2) from cat(c, c) tables (Llama and most
models), GLM's interleaved pairs (2i, 2i + 1) from the same tables, or chunked mRoPE from
per-axis tables. Anything else is a RopeError naming the function, and nothing is patched. With
``exact=True`` the frequencies read from the config must equal the rotary module's own inv_freq
and attention scaling, or nothing is patched.

Calls the replacement does not take (an unsqueeze_dim other than 1 or 2, float64 or trainable
cos/sin) run the model's original function. The backend is chosen as for any rope_ops call:
``ROPE_OPS_BACKEND`` or ``rope_ops.use_backend(...)``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import types

import torch

from .. import _api, _select
from .._errors import RopeError
from .._mrope import check_section, mrope_axes
from .._reference import rope_reference
from ..embedding import RotaryEmbedding, hf_rope_parameters
from ..frequencies import SEQ_LEN_TYPES

__all__ = ["patch", "patch_model_class", "Patch", "rotate_with_tables", "ExactAngles",
           "ExactRotaryEmbedding", "APPLY", "APPLY_MROPE"]

APPLY = "apply_rotary_pos_emb"
APPLY_MROPE = "apply_multimodal_rotary_pos_emb"  # transformers before the mRoPE recomposition moved into the rotary module
_PARAMETERS = {APPLY: ("q", "k", "cos", "sin", "unsqueeze_dim"),
               APPLY_MROPE: ("q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim")}
# HF's q and k are [B, H, S, D] (unsqueeze_dim 1, its default) or [B, S, H, D] (unsqueeze_dim 2).
_LAYOUTS = {1: "bhsd", 2: "bshd"}
_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ALL_LAYERS = "all_layers"  # ExactRotaryEmbedding's key when the model has one set of frequencies
# How far a probe's float64 result may be from the reference: rounding only.
_PROBE_TOLERANCE = 1e-12


# ---------------------------------------------------------------------------------------------
# The rotations.


def rotate_with_tables(q, k, cos, sin, unsqueeze_dim: int = 1, style: str = "neox"):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` on rope_ops.

    q, k: [B, H, S, D] (unsqueeze_dim 1) or [B, S, H, D] (unsqueeze_dim 2). cos, sin: [B, S, r]
    (or [1, S, r]) in the duplicated cat(c, c) form the rotary modules return; dims [r, D) pass
    through. ``style`` "neox" pairs i with i + r/2; "gptj" pairs 2i with 2i + 1 taking c_i from
    the first half of the same tables (GLM's apply function). Differentiable in q and k.
    """
    layout = _LAYOUTS.get(unsqueeze_dim)
    if layout is None:
        raise RopeError(f"unsqueeze_dim: expected 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim!r}")
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or cos.dim() == 0:
        raise RopeError("cos, sin: expected the [B, S, r] tensors of a rotary module")
    width = cos.shape[-1]
    if style == "gptj":
        cos, sin = cos[..., : width // 2], sin[..., : width // 2]
    return _api.apply(q, k, None, cos_sin=(cos, sin), rotary_dim=width, style=style, layout=layout,
                      backend=_requested_backend())


def recompose_mrope_tables(cos, sin, mrope_section):
    """Per-token (cos, sin) [B, S, r/2] from per-axis tables [3, B, S, r] (cat(c, c) form, one
    table per position axis t, h, w): frequency i takes its axis' value, in consecutive chunks
    of ``mrope_section``."""
    half = cos.shape[-1] // 2
    section = check_section(mrope_section, 2 * half)
    axes = mrope_axes(section, False).to(cos.device)
    index = axes.view(1, *([1] * (cos.dim() - 2)), half).expand(1, *cos.shape[1:-1], half)
    return (cos[..., :half].gather(0, index).squeeze(0), sin[..., :half].gather(0, index).squeeze(0))


@torch._dynamo.assume_constant_result
def _requested_backend() -> str:
    """The backend request in force (ROPE_OPS_BACKEND, rope_ops.use_backend), passed on as
    ``backend=``: under torch.compile it is read once, when the graph is traced, as dynamo
    cannot trace the context variable rope_ops keeps it in."""
    return _select.current_request()


def _takes_tables(q, k, cos, sin, unsqueeze_dim, table_rank) -> bool:
    """Whether a call is one the replacement rotates itself (the others go to the original)."""
    return (unsqueeze_dim in _LAYOUTS and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and q.dim() == 4 and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
            and cos.dim() == table_rank and cos.shape == sin.shape and cos.dtype in _TABLE_DTYPES
            and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)))


class ExactAngles(torch.nn.Module):
    """The frequencies of one kind of layer under ``exact=True``: a RotaryEmbedding built in
    float64 from the config and, for mRoPE, the section. ExactRotaryEmbedding hands it to the
    attention layers where the sin table used to go."""

    def __init__(self, rope: RotaryEmbedding, mrope_section=None, mrope_interleaved: bool = False):
        super().__init__()
        self.rope = rope
        self.mrope_section = None if mrope_section is None else check_section(mrope_section, rope.rotary_dim)
        self.mrope_interleaved = bool(mrope_interleaved)
        # dynamic NTK and LongRoPE pick frequencies from the sequence length on every forward,
        # as HF's rotary modules do (the same host sync as HF's dynamic_rope_update).
        self.per_length = rope.rope_type in SEQ_LEN_TYPES

    def rotate(self, q, k, positions, unsqueeze_dim: int = 1):
        layout = _LAYOUTS.get(unsqueeze_dim)
        if layout is None:
            raise RopeError(f"unsqueeze_dim: expected 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim!r}")
        seq_len = _api.seq_len_of(positions) if self.per_length else None
        if positions.dim() == 2 and positions.shape[0] == 1 and q.shape[0] != 1:
            # HF's [1, S] positions shared by the batch, as the [B, S] view every backend takes
            positions = positions.expand(q.shape[0], -1)
        backend = _requested_backend()
        if self.mrope_section is None:
            return _api.apply(q, k, positions, rope=self.rope, layout=layout, seq_len=seq_len, backend=backend)
        return _api.apply(q, k, positions, rope=self.rope, layout=layout, seq_len=seq_len, backend=backend,
                          mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved)

    def extra_repr(self) -> str:
        return f"mrope_section={self.mrope_section}, mrope_interleaved={self.mrope_interleaved}"


class ExactRotaryEmbedding(torch.nn.Module):
    """Stands in for a model's rotary module under ``exact=True``: returns (position ids,
    ExactAngles) where the module returned (cos, sin); the patched apply functions rotate from
    them. ``angles`` maps a layer type (Gemma 3) or ``"all_layers"`` to its ExactAngles."""

    def __init__(self, angles: dict[str, ExactAngles]):
        super().__init__()
        self.angles = torch.nn.ModuleDict(angles)

    def forward(self, x, position_ids, layer_type=None):
        angles = self.angles[_ALL_LAYERS if layer_type is None else layer_type]
        if angles.mrope_section is not None and position_ids.dim() == 2:
            position_ids = position_ids.expand(3, -1, -1)  # text-only positions: every axis the same, as in HF
        return position_ids, angles


def _apply_replacement(original, style: str):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if isinstance(sin, ExactAngles):
            return sin.rotate(q, k, cos, unsqueeze_dim)
        if not _takes_tables(q, k, cos, sin, unsqueeze_dim, 3):
            return original(q, k, cos, sin, unsqueeze_dim)
        return rotate_with_tables(q, k, cos, sin, unsqueeze_dim, style)

    apply_rotary_pos_emb.rope_ops_original = original
    return apply_rotary_pos_emb


def _mrope_replacement(original):
    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        if isinstance(sin, ExactAngles):
            return sin.rotate(q, k, cos, unsqueeze_dim)
        if not (_takes_tables(q, k, cos, sin, unsqueeze_dim, 4) and cos.shape[0] == 3):
            return original(q, k, cos, sin, mrope_section, unsqueeze_dim)
        token_cos, token_sin = recompose_mrope_tables(cos, sin, mrope_section)
        return _api.apply(q, k, None, cos_sin=(token_cos, token_sin), rotary_dim=2 * token_cos.shape[-1],
                          layout=_LAYOUTS[unsqueeze_dim], backend=_requested_backend())

    apply_multimodal_rotary_pos_emb.rope_ops_original = original
    return apply_multimodal_rotary_pos_emb


# ---------------------------------------------------------------------------------------------
# What a modeling module's functions compute (checked before anything is patched).


def _parameter_names(function) -> tuple[str, ...] | None:
    # A function that transformers' kernels integration turned into a module keeps its
    # signature on forward.
    target = function.forward if isinstance(function, torch.nn.Module) else function
    try:
        return tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None


def classify(function, name: str = APPLY, where: str | None = None) -> str:
    """What ``function`` (a modeling module's ``apply_rotary_pos_emb`` or
    ``apply_multimodal_rotary_pos_emb``) computes: "neox", "gptj" (GLM's interleaved pairs from
    cat(c, c) tables) or "mrope" (chunked per-axis tables). Found by calling it once on a small
    float64 example; a RopeError if it is none of them."""
    where = where or getattr(function, "__qualname__", name)
    names = _parameter_names(function)
    if names != _PARAMETERS[name]:
        raise RopeError(f"{where}: parameters {names} are not transformers' {_PARAMETERS[name]}; "
                        "rope_ops does not patch it")
    gen = torch.Generator().manual_seed(0)
    batch, seq, dim = 2, 3, 8
    half = dim // 2
    q = torch.randn(batch, 3, seq, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, 2, seq, dim, generator=gen, dtype=torch.float64)
    if name == APPLY_MROPE:
        section = (1, 1, 2)
        angles = torch.rand(3, batch, seq, half, generator=gen, dtype=torch.float64) * 6.0
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        token = recompose_mrope_tables(cos, sin, section)
        candidates = {"mrope": ("neox", token)}
        call = (q, k, cos, sin, list(section))
    else:
        angles = torch.rand(batch, seq, half, generator=gen, dtype=torch.float64) * 6.0
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        token = (angles.cos(), angles.sin())
        candidates = {"neox": ("neox", token), "gptj": ("gptj", token)}
        call = (q, k, cos, sin)
    try:
        with torch.no_grad():
            got_q, got_k = function(*call)
    except Exception as error:  # whatever it raises, it is not a function we can stand in for
        raise RopeError(f"{where}: failed on a standard call ({type(error).__name__}: {error}); "
                        "rope_ops does not patch it") from None
    for kind, (style, tables) in candidates.items():
        expected_q = rope_reference(q, 0, layout="bhsd", rotary_dim=dim, style=style, token_cos_sin=tables)
        expected_k = rope_reference(k, 0, layout="bhsd", rotary_dim=dim, style=style, token_cos_sin=tables)
        if (isinstance(got_q, torch.Tensor) and got_q.shape == q.shape and got_k.shape == k.shape
                and torch.allclose(got_q.double(), expected_q, rtol=0, atol=_PROBE_TOLERANCE)
                and torch.allclose(got_k.double(), expected_k, rtol=0, atol=_PROBE_TOLERANCE)):
            return kind
    raise RopeError(f"{where}: computes a rotation rope_ops does not reproduce (not pairs (i, i + r/2) "
                    "nor interleaved pairs from cat(c, c) tables); rope_ops does not patch it")


# ---------------------------------------------------------------------------------------------
# Patching modeling modules (shared by every model of their types; counted).


class _ModulePatch:
    def __init__(self, module: types.ModuleType, kinds: dict[str, str]):
        self.module = module
        self.kinds = kinds
        self.originals = {name: getattr(module, name) for name in kinds}
        self.replacements = {
            name: (_mrope_replacement(self.originals[name]) if kind == "mrope"
                   else _apply_replacement(self.originals[name], kind))
            for name, kind in kinds.items()}
        self.count = 0


_lock = threading.RLock()
_installed: dict[str, _ModulePatch] = {}


def _function_names(module: types.ModuleType) -> list[str]:
    return [name for name in _PARAMETERS if callable(getattr(module, name, None))]


def _kinds_of(module: types.ModuleType) -> dict[str, str]:
    entry = _installed.get(module.__name__)
    if entry is not None:
        return entry.kinds
    return {name: classify(getattr(module, name), name, f"{module.__name__}.{name}")
            for name in _function_names(module)}


def _install(module: types.ModuleType, kinds: dict[str, str]) -> None:
    entry = _installed.get(module.__name__)
    if entry is None:
        entry = _ModulePatch(module, kinds)
        for name, replacement in entry.replacements.items():
            setattr(module, name, replacement)
        _installed[module.__name__] = entry
    entry.count += 1


def _uninstall(module_name: str) -> None:
    entry = _installed[module_name]
    entry.count -= 1
    if entry.count:
        return
    for name, replacement in entry.replacements.items():
        # Restore only what is still ours: a later patch by someone else stays.
        if getattr(entry.module, name, None) is replacement:
            setattr(entry.module, name, entry.originals[name])
    del _installed[module_name]


def is_patched(module) -> bool:
    """Whether a modeling module (or its name) currently runs rope_ops."""
    return (module if isinstance(module, str) else module.__name__) in _installed


class Patch:
    """What ``patch`` / ``patch_model_class`` changed. ``undo()`` restores it (also on leaving a
    ``with`` block); a modeling module goes back to its own functions when its last patch is
    undone."""

    def __init__(self, modules: list[str], swaps: list[tuple]):
        self.modules = tuple(modules)
        self._swaps = swaps  # (parent module, attribute, original rotary module, replacement)
        self._active = True

    @property
    def active(self) -> bool:
        return self._active

    @property
    def exact(self) -> bool:
        return bool(self._swaps)

    def undo(self) -> None:
        with _lock:
            if not self._active:
                return
            self._active = False
            for parent, attribute, original, replacement in reversed(self._swaps):
                if getattr(parent, attribute, None) is replacement:
                    setattr(parent, attribute, original)
            for name in self.modules:
                _uninstall(name)

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        exact = f", {len(self._swaps)} rotary module(s) exact" if self._swaps else ""
        return f"Patch({state}: {', '.join(self.modules)}{exact})"


# ---------------------------------------------------------------------------------------------
# exact=True: the model's rotary modules.


def _is_rotary_module(module: torch.nn.Module) -> bool:
    """A text rotary module of transformers: a *RotaryEmbedding called with position ids, with
    its config. Vision towers' rotary modules (2-D positions, their own apply functions) are not."""
    name = type(module).__name__
    if isinstance(module, ExactRotaryEmbedding) or not name.endswith("RotaryEmbedding") or "Vision" in name:
        return False
    if getattr(module, "config", None) is None:
        return False
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" in parameters


def _rotary_style(module: torch.nn.Module, kinds: dict[str, dict[str, str]]) -> str:
    """The pairing of the apply function that consumes this rotary module's tables."""
    own = kinds.get(type(module).__module__, {}).get(APPLY)
    if own is not None:
        return "gptj" if own == "gptj" else "neox"
    styles = {"gptj" if kind == "gptj" else "neox" for per_module in kinds.values() for kind in per_module.values()}
    if len(styles) != 1:
        raise RopeError(f"exact=True: cannot tell which apply function uses {type(module).__name__}'s tables")
    return styles.pop()


def _exact_angles(module: torch.nn.Module, style: str) -> dict[str, ExactAngles]:
    config = module.config
    where = type(module).__name__
    layer_types = getattr(module, "layer_types", None)
    keys = list(layer_types) if layer_types else [None]
    angles = {}
    for layer_type in keys:
        prefix = "" if layer_type is None else f"{layer_type}_"
        hf_inv_freq = getattr(module, f"{prefix}original_inv_freq", None)
        if hf_inv_freq is None:
            hf_inv_freq = getattr(module, f"{prefix}inv_freq", None)
        if hf_inv_freq is None:
            if layer_type is not None:
                continue  # a layer type without rotary embedding
            raise RopeError(f"exact=True: {where} has no inv_freq to check the config's frequencies against")
        hf_scaling = float(getattr(module, f"{prefix}attention_scaling", 1.0))
        rope = RotaryEmbedding.from_hf_config(config, style=style, layer_type=layer_type,
                                              device=hf_inv_freq.device)
        ours = rope.inv_freq
        theirs = hf_inv_freq.detach().to("cpu", torch.float64)
        # model.to(bfloat16) casts the module's inv_freq buffers too: compare to their precision
        rtol = max(3e-6, torch.finfo(hf_inv_freq.dtype).eps) if hf_inv_freq.is_floating_point() else 3e-6
        if (ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=rtol, atol=0)
                or abs(rope.attention_factor - hf_scaling) > 1e-6 * max(1.0, abs(hf_scaling))):
            raise RopeError(
                f"exact=True: the frequencies rope_ops builds from {type(config).__name__}"
                f"{'' if layer_type is None else f' ({layer_type})'} (rotary_dim {rope.rotary_dim}, "
                f"rope_type {rope.rope_type!r}, attention factor {rope.attention_factor:.6g}) differ from "
                f"{where}'s own ({2 * theirs.numel()} rotary dims, attention scaling {hf_scaling:.6g}); "
                "not patched")
        params = hf_rope_parameters(config, layer_type)
        section = getattr(module, "mrope_section", None) or params.get("mrope_section")
        interleaved = getattr(module, "mrope_interleaved", None)
        if interleaved is None:
            interleaved = bool(params.get("mrope_interleaved", False))
        angles[_ALL_LAYERS if layer_type is None else layer_type] = ExactAngles(rope, section, interleaved)
    return angles


def _exact_swaps(model: torch.nn.Module, kinds: dict[str, dict[str, str]]) -> list[tuple]:
    """(parent, attribute, original, replacement) for each reference to a rotary module; the
    replacements are built (and checked) here, nothing is changed yet."""
    replacements: dict[int, ExactRotaryEmbedding] = {}
    swaps = []
    already_exact = False
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ExactRotaryEmbedding):
            already_exact = True
            continue
        if not name or not _is_rotary_module(module):
            continue
        replacement = replacements.get(id(module))
        if replacement is None:
            replacement = ExactRotaryEmbedding(_exact_angles(module, _rotary_style(module, kinds)))
            replacements[id(module)] = replacement
        parent_name, _, attribute = name.rpartition(".")
        swaps.append((model.get_submodule(parent_name), attribute, module, replacement))
    if not swaps and not already_exact:
        raise RopeError("exact=True: the model has no rotary module (a *RotaryEmbedding called with "
                        "position_ids, with its config) to take positions from")
    return swaps


# ---------------------------------------------------------------------------------------------
# The entry points.


def _modeling_modules(model: torch.nn.Module) -> list[types.ModuleType]:
    found: dict[str, types.ModuleType] = {}
    for module in model.modules():
        python_module = sys.modules.get(type(module).__module__)
        if python_module is not None and _function_names(python_module):
            found.setdefault(python_module.__name__, python_module)
    return list(found.values())


def patch(model: torch.nn.Module, *, exact: bool = False) -> Patch:
    """Make ``model`` (and every model of its types in this process) rotate with rope_ops.

    Returns a Patch: ``undo()`` it, or use it as a context manager. ``exact=True`` also takes
    this model's angles from its position ids and float64 frequencies instead of its float32
    cos/sin (module docstring). Patch before ``torch.compile(model)``.
    """
    if not isinstance(model, torch.nn.Module):
        raise RopeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(exact, bool):
        raise RopeError(f"exact: expected a bool, got {exact!r}")
    with _lock:
        modules = _modeling_modules(model)
        if not modules:
            raise RopeError(f"model: no modeling module of {type(model).__name__} defines {APPLY} or "
                            f"{APPLY_MROPE}; nothing to patch")
        kinds = {module.__name__: _kinds_of(module) for module in modules}
        swaps = _exact_swaps(model, kinds) if exact else []
        for module in modules:
            _install(module, kinds[module.__name__])
        for parent, attribute, _, replacement in swaps:
            setattr(parent, attribute, replacement)
        return Patch([module.__name__ for module in modules], swaps)


def patch_model_class(target) -> Patch:
    """Make every model of a type rotate with rope_ops (the cos/sin its rotary module computes).

    ``target``: a model_type ("llama", "qwen2_vl"), a model class, or a modeling module. A
    composite model whose parts come from other modeling modules needs ``patch(model)``, which
    finds them all.
    """
    if isinstance(target, str):
        try:
            module = importlib.import_module(f"transformers.models.{target}.modeling_{target}")
        except ImportError as error:
            raise RopeError(f"model type {target!r}: no transformers modeling module ({error})") from None
    elif isinstance(target, types.ModuleType):
        module = target
    elif isinstance(target, type) and target.__module__ in sys.modules:
        module = sys.modules[target.__module__]
    else:
        raise RopeError(f"target: expected a model_type, a model class or a modeling module, got {target!r}")
    with _lock:
        kinds = _kinds_of(module)
        if not kinds:
            raise RopeError(f"{module.__name__} defines neither {APPLY} nor {APPLY_MROPE}; nothing to patch")
        _install(module, kinds)
        return Patch([module.__name__], [])
