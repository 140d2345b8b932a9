"""Who is measured: rope_ops' backends and the peers (Liger-Kernel's Triton rope, torch.compile of
Hugging Face's eager form, the eager form itself).

A provider turns a case and its input sets into closures, one per set, that each run the case
once and return (q_out, k_out) (the gradients (dq, dk) for train cases), or raises ``Skip``.
Peers get their cos/sin precomputed per set, outside the timed call, as models compute them
once per forward pass and share them between layers.
"""

from __future__ import annotations

import functools

import torch

import rope_ops
from rope_ops import registry

from .cases import Case
from .inputs import InputSet, peer_cos_sin

PEERS = ("liger", "hf-compile", "hf-eager")
GPU_DEFAULT = ("cuda", "triton", "liger", "hf-compile", "hf-eager")
CPU_DEFAULT = ("cpu", "torch", "hf-eager", "hf-compile")


class Skip(Exception):
    """This provider cannot run this case (the reason is the message)."""


def valid_names() -> list[str]:
    """Every name --providers accepts: rope_ops' backends (registered or built-in) and the peers."""
    return sorted(set(registry.names()) | set(registry.BUILTINS)) + list(PEERS)


def display_name(name: str) -> str:
    return name if name in PEERS else f"rope_ops:{name}"


def canonical(name: str) -> str:
    return name.removeprefix("rope_ops:")


class Provider:
    name = ""

    def build(self, case: Case, sets: list[InputSet], rope) -> list:
        raise NotImplementedError

    def layout_outputs(self, case: Case, outputs):
        """(q_out, k_out) in the case's layout from what a closure returned."""
        return outputs[0], outputs[1]


def _train_leaves(s: InputSet):
    return s.q.detach().requires_grad_(True), s.k.detach().requires_grad_(True)


class RopeOps(Provider):
    """``rope_ops.apply`` with one backend named; training through autograd."""

    def __init__(self, backend: str):
        self.backend = backend
        self.name = display_name(backend)

    def build(self, case, sets, rope):
        try:
            backend = registry.get(self.backend)
        except rope_ops.BackendError as error:
            raise Skip(str(error).splitlines()[0]) from None
        reasons = registry.availability(backend)
        if reasons:
            raise Skip("; ".join(reasons))
        closures = []
        for s in sets:
            pos, options = _angle_arguments(case, s, rope)
            options.update(layout=case.layout, backend=self.backend)
            if not closures:
                try:
                    rope_ops.select_backend(s.q, s.k, pos, inplace=case.inplace, **options)
                except rope_ops.BackendError as error:
                    raise Skip(" ".join(str(error).split())[:300]) from None
            if case.train:
                q, k = _train_leaves(s)

                def run(q=q, k=k, s=s, pos=pos, options=options):
                    q_out, k_out = rope_ops.apply(q, k, pos, **options)
                    return torch.autograd.grad((q_out, k_out), (q, k), (s.grad_q, s.grad_k))
            elif case.inplace:
                def run(s=s, pos=pos, options=options):
                    return rope_ops.apply(s.q, s.k, pos, inplace=True, **options)
            else:
                def run(s=s, pos=pos, options=options):
                    return rope_ops.apply(s.q, s.k, pos, **options)
            closures.append(run)
        return closures


def _angle_arguments(case: Case, s: InputSet, rope) -> tuple:
    """(pos, apply's angle keywords) of a set: positions with the case's RotaryEmbedding; the
    peers' per-token tables (pos None); or mRoPE's [3, ...] positions (t = h = w, text tokens),
    built outside the timed call as a model builds them once per forward pass."""
    if case.angles == "token":
        cos, sin = peer_tables(case, s, rope)
        if case.layout == "thd":
            cos, sin = cos[0], sin[0]
        return None, dict(cos_sin=(cos, sin), rotary_dim=case.rot, style=case.style)
    if case.angles == "mrope":
        every = s.positions.reshape(-1) if case.layout == "thd" else s.positions
        pos = every.unsqueeze(0).expand(3, *every.shape).contiguous()
        return pos, dict(rope=rope, mrope_section=case.mrope_section,
                         mrope_interleaved=case.mrope_interleaved)
    return s.pos, dict(rope=rope)


# ---------------------------------------------------------------------------------------------
# Hugging Face's eager form: q * cos + rotate(q) * sin on cos/sin rows gathered per token, in
# the input dtype; partial rotary splits the head and concatenates the pass-through dims back
# (Phi, GPT-NeoX); GPT-J interleaves.


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _neox_apply(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _gptj_apply(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_every_two(q) * sin, k * cos + _rotate_every_two(k) * sin


@functools.cache
def transformers_apply():
    """transformers' own ``apply_rotary_pos_emb`` (Llama's), or None without transformers."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except Exception:  # not installed, or a version that moved it
        return None
    return apply_rotary_pos_emb


def hf_form(q, k, cos, sin, unsqueeze_dim: int, rotary_dim: int, style: str, hf_apply):
    apply = _gptj_apply if style == "gptj" else (hf_apply or _neox_apply)
    if rotary_dim == q.shape[-1]:
        return apply(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_rot, k_rot = apply(q_rot, k_rot, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


def hf_form_inplace(q, k, cos, sin, unsqueeze_dim: int, rotary_dim: int, style: str, hf_apply):
    """The eager form written back into q and k's rotary dims (no in-place form exists)."""
    q_new, k_new = hf_form(q, k, cos, sin, unsqueeze_dim, rotary_dim, style, hf_apply)
    q[..., :rotary_dim].copy_(q_new[..., :rotary_dim])
    k[..., :rotary_dim].copy_(k_new[..., :rotary_dim])
    return q, k


def compile_static(fn):
    """torch.compile(fullgraph, static shapes), allowed one graph per case: every case is a new
    shape, more than dynamo's default limit of recompilations per function."""
    import torch._dynamo

    config = torch._dynamo.config
    for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                        ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
        if hasattr(config, name):
            setattr(config, name, value)
    return torch.compile(fn, fullgraph=True, dynamic=False)


@functools.cache
def _compiled(inplace: bool):
    return compile_static(hf_form_inplace if inplace else hf_form)


def hf_module_cos_sin(case: Case, positions: torch.Tensor, device, dtype):
    """cos/sin [B, S, D] from transformers' Llama rotary module, or None where it does not apply
    (GPT-J pairs, partial rotary, transformers missing)."""
    if case.style != "neox" or case.rot != case.head_dim or transformers_apply() is None:
        return None
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = LlamaConfig(hidden_size=case.head_dim * case.q_heads, num_attention_heads=case.q_heads,
                             num_key_value_heads=case.k_heads, head_dim=case.head_dim,
                             max_position_embeddings=max(131072, int(positions.max()) + 1),
                             rope_parameters={"rope_type": "default", "rope_theta": case.base})
        module = LlamaRotaryEmbedding(config).to(device)
        with torch.no_grad():
            return module(torch.empty(0, device=device, dtype=dtype), positions)
    except Exception:  # a transformers version whose config or module differ
        return None


def peer_tables(case: Case, s: InputSet, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B or 1, S, r] ([1, T, r] for thd) for a set: from Hugging Face's rotary module
    where it applies, else float64 angles rounded once. Positions shared by the batch (arange)
    give one row per position, [1, S, r], as models broadcast them."""
    positions = s.positions
    shared = case.layout != "thd" and s.pos.dim() == 1
    if shared:
        positions = positions[:1]
    found = hf_module_cos_sin(case, positions, s.q.device, s.q.dtype)
    if found is None:
        found = peer_cos_sin(case, rope.inv_freq, rope.attention_factor, positions, s.q.dtype)
    return found


def hf_broadcast(case: Case, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos/sin of peer_tables arranged for the case's layout, and the unsqueeze_dim that makes
    them broadcast over heads."""
    if case.layout == "thd":
        return cos[0], sin[0], 1
    if case.layout == "sbhd":
        return cos.transpose(0, 1).contiguous(), sin.transpose(0, 1).contiguous(), 2
    return cos, sin, (2 if case.layout == "bshd" else 1)


class HuggingFace(Provider):
    """Hugging Face's eager form (``hf-eager``) or torch.compile of it (``hf-compile``)."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.name = "hf-compile" if compiled else "hf-eager"

    def build(self, case, sets, rope):
        if self.compiled:
            fn = _compiled(case.inplace)
        else:
            fn = hf_form_inplace if case.inplace else hf_form
        hf_apply = transformers_apply()
        closures = []
        for s in sets:
            cos, sin, dim = hf_broadcast(case, *peer_tables(case, s, rope))
            constants = (dim, case.rot, case.style, hf_apply)
            if case.train:
                q, k = _train_leaves(s)

                def run(q=q, k=k, s=s, cos=cos, sin=sin, constants=constants):
                    q_out, k_out = fn(q, k, cos, sin, *constants)
                    return torch.autograd.grad((q_out, k_out), (q, k), (s.grad_q, s.grad_k))
            else:
                def run(s=s, cos=cos, sin=sin, constants=constants):
                    return fn(s.q, s.k, cos, sin, *constants)
            closures.append(run)
        return closures


# ---------------------------------------------------------------------------------------------
# Liger-Kernel: its Triton rope takes q [B, H, S, D] over memory laid out [B, S, H, D] (other
# layouts it copies to that first), cos/sin [B or 1, S, D]; NeoX pairs over the whole head only.
# It writes its inputs in place.

_TO_LIGER = {
    "bshd": lambda t: t.transpose(1, 2),
    "sbhd": lambda t: t.permute(1, 2, 0, 3),
    "bhsd": lambda t: t,
    "thd": lambda t: t.unsqueeze(0).transpose(1, 2),
}
_FROM_LIGER = {
    "bshd": lambda t: t.transpose(1, 2),
    "sbhd": lambda t: t.permute(2, 0, 1, 3),
    "bhsd": lambda t: t,
    "thd": lambda t: t.transpose(1, 2).squeeze(0),
}


@functools.cache
def liger_function():
    """Liger-Kernel's rope autograd Function; ImportError when Liger is not installed."""
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction


class Liger(Provider):
    name = "liger"

    def build(self, case, sets, rope):
        try:
            function = liger_function()
        except Exception as error:  # ImportError, or a Liger that fails to import here
            raise Skip(f"liger_kernel not importable ({type(error).__name__}: {error})") from None
        if sets[0].q.device.type != "cuda":
            raise Skip("Liger-Kernel runs on CUDA devices only")
        if case.style != "neox" or case.rot != case.head_dim:
            raise Skip("Liger's rope rotates NeoX pairs over the whole head only")
        if case.inplace:
            raise Skip("Liger has no in-place call for these tensors (it writes in place only into "
                       "contiguous [B, S, H, D] memory)")
        to_liger = _TO_LIGER[case.layout]
        closures = []
        for s in sets:
            cos, sin = peer_tables(case, s, rope)
            if case.train:
                q, k = _train_leaves(s)
                gq, gk = to_liger(s.grad_q), to_liger(s.grad_k)

                def run(q=q, k=k, cos=cos, sin=sin, gq=gq, gk=gk):
                    out = function.apply(to_liger(q), to_liger(k), cos, sin)
                    return torch.autograd.grad((out[0], out[1]), (q, k), (gq, gk))
            else:
                def run(s=s, cos=cos, sin=sin):
                    out = function.apply(to_liger(s.q), to_liger(s.k), cos, sin)
                    return out[0], out[1]
            closures.append(run)
        return closures

    def layout_outputs(self, case, outputs):
        if case.train:  # gradients w.r.t. the case-layout leaves
            return outputs[0], outputs[1]
        back = _FROM_LIGER[case.layout]
        return back(outputs[0]), back(outputs[1])


def make(name: str) -> Provider:
    name = canonical(name)
    if name == "liger":
        return Liger()
    if name in ("hf-compile", "hf-eager"):
        return HuggingFace(compiled=name == "hf-compile")
    return RopeOps(name)
