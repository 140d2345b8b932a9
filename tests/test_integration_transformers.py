"""rope_ops inside Hugging Face transformers models (rope_ops.integrations.transformers).

Tiny randomly initialised models of the installed transformers, one per supported family: the
patched model's logits and every parameter gradient equal the unpatched model's (float32: to
rounding; bf16: no further from the float32 model than transformers' own bf16 rotation),
with the model's cos/sin and with exact angles; training steps, generate and torch.compile work
patched; exact angles are exact at long positions where transformers' float32 angles are not;
bad calls are RopeErrors that patch nothing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import rope_ops
from rope_ops import RopeError, registry
from rope_ops._reference import rope_reference
from rope_ops.integrations import transformers as integration
from rope_ops.integrations.transformers import (APPLY, APPLY_MROPE, ExactRotaryEmbedding, classify,
                                                is_patched, patch, patch_model_class)

from _hf_support import rope_ops_calls  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=512)
BATCH, SEQ = 2, 9
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
VISION = {"depth": 1, "hidden_size": 32, "embed_dim": 32, "num_heads": 2, "out_hidden_size": 64,
          "intermediate_size": 32}


def _config(name: str, **overrides):
    t = transformers
    tiny = {**TINY, **overrides}
    if name == "llama":
        return t.LlamaConfig(**tiny)
    if name == "mistral":
        return t.MistralConfig(**tiny)
    if name == "qwen2":
        return t.Qwen2Config(**tiny)
    if name == "qwen3":
        return t.Qwen3Config(**tiny, head_dim=16)
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(**tiny, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2)
    if name == "gemma3":  # a sliding and a full attention layer, each with its own frequencies
        return t.Gemma3TextConfig(**tiny, head_dim=16, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"])
    if name == "phi3":  # partial rotary
        params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return t.Phi3Config(**{"rope_parameters": params, **tiny}, pad_token_id=0)
    if name == "gpt_neox":  # partial rotary (a quarter of the head)
        return t.GPTNeoXConfig(**tiny)
    if name == "glm4":  # interleaved pairs and partial rotary
        return t.Glm4Config(**tiny, head_dim=16, pad_token_id=0)
    if name in ("qwen2_vl", "qwen2_5_vl"):  # mRoPE
        config_class = t.Qwen2VLConfig if name == "qwen2_vl" else t.Qwen2_5_VLConfig
        return config_class(text_config={**tiny, "rope_parameters": dict(MROPE)}, vision_config=VISION,
                            image_token_id=94, video_token_id=95, vision_start_token_id=96)
    raise ValueError(name)


MODEL_CLASSES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "glm4": "Glm4ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
MODELS = list(MODEL_CLASSES)


def make_model(name: str, dtype=torch.float32, seed: int = 0, device: str = "cpu", **overrides):
    """The same weights on every device (initialised on the CPU, then moved)."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[name])(_config(name, **overrides))
    return model.to(device, dtype)


def make_inputs(name: str, seed: int = 1, seq: int = SEQ, start: int = 0, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (BATCH, seq), generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    positions = torch.arange(start, start + seq).expand(BATCH, seq)
    if name in ("qwen2_vl", "qwen2_5_vl"):  # t, h, w axes that differ, as for image tokens
        height = torch.randint(0, 40, (BATCH, seq), generator=gen)
        width = torch.randint(0, 40, (BATCH, seq), generator=gen)
        inputs["position_ids"] = torch.stack([positions, height, width])
    elif start:
        inputs["position_ids"] = positions
    return {key: value.to(device) for key, value in inputs.items()}


def forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # torch.compile wraps the model
    grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    return out.logits.detach().float(), grads


def modeling_module(name: str):
    return sys.modules[getattr(transformers, MODEL_CLASSES[name]).__module__]


# The GPU backends run the models on a CUDA device; the others on the CPU.
GPU_BACKENDS = ("cuda", "triton")


def device_of(backend: str) -> str:
    return "cuda" if backend in GPU_BACKENDS else "cpu"


def _forced(name: str):
    """use_backend(name) (strict: it must take every call), or a skip saying why it can't run."""
    if name not in registry.names():
        pytest.skip(f"backend {name!r} is not registered here (installed entry points: {registry.names()})")
    if device_of(name) == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"backend {name!r}: the models run on a CUDA device, and there is none")
    reasons = registry.availability(registry.get(name))
    if reasons:
        pytest.skip(f"backend {name!r} unavailable here: {'; '.join(reasons)}")
    return rope_ops.use_backend(name)


@pytest.fixture(params=["torch", "cpu", *GPU_BACKENDS])
def backend(request):
    """The backend every rope_ops call of the test is forced to; its models live on
    device_of(backend)."""
    with _forced(request.param):
        yield request.param


@pytest.fixture(params=["auto", *GPU_BACKENDS])
def where(request):
    """(backend, device): automatic selection on the CPU, or a GPU backend forced on CUDA."""
    if request.param == "auto":
        yield None, "cpu"
        return
    with _forced(request.param):
        yield request.param, "cuda"


def assert_grads_close(grads, expected, atol):
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# The patched models compute what transformers computes.


@pytest.mark.parametrize("exact", [False, True], ids=["model_tables", "exact"])
@pytest.mark.parametrize("name", MODELS)
def test_patched_model_matches_transformers(name, exact, backend, rope_ops_calls):
    model = make_model(name, device=device_of(backend))
    inputs = make_inputs(name, device=device_of(backend))
    modeling = modeling_module(name)
    originals = {fn: getattr(modeling, fn) for fn in (APPLY, APPLY_MROPE) if hasattr(modeling, fn)}
    rotary_before = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    hf_logits, hf_grads = forward_backward(model, inputs)

    with patch(model, exact=exact) as handle:
        assert handle.active and handle.exact == exact and modeling.__name__ in handle.modules
        assert any(isinstance(m, ExactRotaryEmbedding) for m in model.modules()) == exact
        logits, grads = forward_backward(model, inputs)
    # every attention layer rotated through rope_ops, forward (backward runs inside its autograd)
    assert len(rope_ops_calls) == TINY["num_hidden_layers"]
    # float32: the same rotation, rounded differently (exact: angles off by < 1e-5 rad here)
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)
    assert_grads_close(grads, hf_grads, atol=2e-5)

    assert not handle.active and not is_patched(modeling)
    assert {fn: getattr(modeling, fn) for fn in originals} == originals
    assert [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")] == rotary_before


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "glm4", "qwen2_vl", "gemma3"])
def test_bf16_within_transformers_own_rounding(name, where):
    """In bf16 the patched model is no further from the float32 model than transformers' own
    bf16 rotation (which rounds after every multiply and add; rope_ops rounds once)."""
    _, device = where
    inputs = make_inputs(name, device=device)
    reference_logits, reference_grads = forward_backward(make_model(name, device=device), inputs)
    model = make_model(name, torch.bfloat16, device=device)
    hf_logits, hf_grads = forward_backward(model, inputs)
    with patch(model):
        logits, grads = forward_backward(model, inputs)

    def error(values, expected):
        return (values.float() - expected).abs().max().item()

    hf_error = error(hf_logits, reference_logits)
    assert 0 < hf_error < 0.5
    assert error(logits, reference_logits) <= 1.5 * hf_error
    hf_grad_error = max(error(hf_grads[n], g) for n, g in reference_grads.items())
    assert max(error(grads[n], g) for n, g in reference_grads.items()) <= 1.5 * hf_grad_error


@pytest.mark.parametrize("exact", [False, True], ids=["model_tables", "exact"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2_vl"])
def test_training_steps_match(name, exact, where):
    _, device = where
    inputs = make_inputs(name, device=device)
    results = []
    for patched in (False, True):
        model = make_model(name, device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with patch(model, exact=exact) if patched else _nothing():
            for _ in range(3):
                optimizer.zero_grad()
                loss = model(**inputs).loss
                loss.backward()
                optimizer.step()
        results.append((loss.item(), [p.detach().clone() for p in model.parameters()]))
    (hf_loss, hf_params), (loss, params) = results
    assert loss == pytest.approx(hf_loss, rel=1e-5)
    for param, hf_param in zip(params, hf_params):
        torch.testing.assert_close(param, hf_param, rtol=0, atol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("exact", [False, True], ids=["model_tables", "exact"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "glm4", "qwen2_vl"])
def test_generate_matches(name, exact, where, rope_ops_calls):
    _, device = where
    model = make_model(name, device=device).eval()
    ids = make_inputs(name, device=device)["input_ids"]
    expected = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with patch(model, exact=exact):
        got = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    # prefill then 4 decode steps (the 5th token needs no new forward), each through every layer
    assert len(rope_ops_calls) == 5 * TINY["num_hidden_layers"]
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("name, exact", [("llama", False), ("llama", True), ("qwen2_vl", True)])
def test_compile_aot_eager_fullgraph(name, exact, where):
    _, device = where
    model = make_model(name, device=device)
    inputs = make_inputs(name, device=device)
    with patch(model, exact=exact):
        eager_logits, eager_grads = forward_backward(model, inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        logits, grads = forward_backward(compiled, inputs)
    torch._dynamo.reset()
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-5)
    assert_grads_close(grads, eager_grads, atol=1e-5)


def test_compile_inductor(where):
    _, device = where
    model = make_model("llama", device=device)
    inputs = make_inputs("llama", device=device)
    hf_logits, hf_grads = forward_backward(model, inputs)
    with patch(model):
        torch._dynamo.reset()
        compiled = torch.compile(model)
        logits, grads = forward_backward(compiled, inputs)
    torch._dynamo.reset()
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)
    assert_grads_close(grads, hf_grads, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Exact angles


def test_exact_angles_are_exact_at_long_positions():
    """At positions past 100k, transformers' float32 angle p * inv_freq is off by ~p * 2^-24 rad;
    exact=True rotates by the float64 angle (to float32 rounding)."""
    head_dim, theta = 16, 500000.0
    model = make_model("llama", head_dim=head_dim, max_position_embeddings=1 << 18,
                       rope_parameters={"rope_type": "default", "rope_theta": theta})
    modeling = modeling_module("llama")
    positions = torch.tensor([[131_077, 200_003, 262_139]])
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, head_dim, generator=gen)
    k = torch.randn(1, 2, 3, head_dim, generator=gen)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected_q = rope_reference(q, positions, layout="bhsd", rotary_dim=head_dim, style="neox", inv_freq=inv_freq)
    expected_k = rope_reference(k, positions, layout="bhsd", rotary_dim=head_dim, style="neox", inv_freq=inv_freq)

    hf_q, hf_k = modeling.apply_rotary_pos_emb(q, k, *model.model.rotary_emb(q, positions))
    with patch(model, exact=True):
        exact_q, exact_k = modeling.apply_rotary_pos_emb(q, k, *model.model.rotary_emb(q, positions))
    with patch(model):
        tables_q, _ = modeling.apply_rotary_pos_emb(q, k, *model.model.rotary_emb(q, positions))

    def error(x, expected):
        return (x.double() - expected).abs().max().item()

    assert error(exact_q, expected_q) < 1e-5 and error(exact_k, expected_k) < 1e-5
    assert error(hf_q, expected_q) > 1e-3  # float32 angles: ~1e-2 rad off at these positions
    torch.testing.assert_close(tables_q, hf_q, rtol=0, atol=1e-5)  # exact=False keeps the model's angles

    # through the whole model, exact=False keeps the model's own angles
    inputs = {"input_ids": torch.randint(0, 90, (1, 3), generator=gen), "position_ids": positions}
    with torch.no_grad():
        hf_logits = model(**inputs).logits
        with patch(model):
            tables_logits = model(**inputs).logits
    torch.testing.assert_close(tables_logits, hf_logits, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name, params, start", [
    ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 40),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
               "original_max_position_embeddings": 16}, 40),
    ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "original_max_position_embeddings": 16,
              "short_factor": [1.0 + 0.1 * i for i in range(4)],
              "long_factor": [1.0 + 0.7 * i for i in range(4)]}, 40),
])
def test_exact_scaled_frequencies_match_transformers(name, params, start):
    """Scaled frequencies (the sequence-length dependent ones too: positions past
    max_position_embeddings stretch dynamic NTK and switch LongRoPE to its long factors)."""
    model = make_model(name, max_position_embeddings=32, rope_parameters=params)
    inputs = make_inputs(name, start=start)
    hf_logits, hf_grads = forward_backward(model, inputs)
    with patch(model, exact=True):
        logits, grads = forward_backward(model, inputs)
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)
    assert_grads_close(grads, hf_grads, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# How patches are kept.


def test_patch_model_class_and_counting():
    modeling = modeling_module("llama")
    original = modeling.apply_rotary_pos_emb
    first = patch_model_class("llama")
    second = patch_model_class(transformers.LlamaForCausalLM)
    third = patch(make_model("llama"))
    assert first.modules == second.modules == third.modules == (modeling.__name__,)
    assert modeling.apply_rotary_pos_emb is not original and is_patched(modeling)
    first.undo()
    first.undo()  # undoing twice changes nothing
    third.undo()
    assert is_patched(modeling)  # `second` still holds it
    second.undo()
    assert modeling.apply_rotary_pos_emb is original and not is_patched(modeling)
    with patch_model_class(modeling) as handle:
        assert "active" in repr(handle)
        # a model of the patched type, made after the patch, rotates with rope_ops too
        model = make_model("llama")
        inputs = make_inputs("llama")
        logits, _ = forward_backward(model, inputs)
    assert "undone" in repr(handle)
    hf_logits, _ = forward_backward(model, inputs)
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)


def test_someone_elses_later_patch_is_kept():
    modeling = modeling_module("mistral")
    original = modeling.apply_rotary_pos_emb
    handle = patch_model_class("mistral")

    def theirs(q, k, cos, sin, unsqueeze_dim=1):
        return original(q, k, cos, sin, unsqueeze_dim)

    modeling.apply_rotary_pos_emb = theirs
    try:
        handle.undo()
        assert modeling.apply_rotary_pos_emb is theirs
    finally:
        modeling.apply_rotary_pos_emb = original


def test_calls_the_replacement_does_not_take_run_the_original(rope_ops_calls):
    modeling = modeling_module("llama")
    gen = torch.Generator().manual_seed(4)
    angles = torch.rand(2, 5, 8, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = torch.randn(2, 5, 4, 16, generator=gen)  # [B, S, H, D]: unsqueeze_dim 2
    k = torch.randn(2, 5, 2, 16, generator=gen)
    expected = modeling.apply_rotary_pos_emb(q, k, cos.float(), sin.float(), unsqueeze_dim=2)
    expected64 = modeling.apply_rotary_pos_emb(q.double(), k.double(), cos, sin, 2)
    with patch_model_class("llama"):
        got = modeling.apply_rotary_pos_emb(q, k, cos.float(), sin.float(), unsqueeze_dim=2)
        assert len(rope_ops_calls) == 1  # [B, S, H, D] is rope_ops' bshd
        got64 = modeling.apply_rotary_pos_emb(q.double(), k.double(), cos, sin, 2)
        assert len(rope_ops_calls) == 1  # float64 tables: transformers' own function
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert torch.equal(got64[0], expected64[0]) and torch.equal(got64[1], expected64[1])


def _fake_modeling_module(name: str, **functions):
    """A modeling module with the given functions and a model class defined in it."""
    module = types.ModuleType(name)
    module.__dict__.update(functions)

    class FakeAttention(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return module.apply_rotary_pos_emb(q, k, cos, sin)

    FakeAttention.__module__ = name
    module.FakeAttention = FakeAttention
    sys.modules[name] = module
    return module


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def old_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers' mRoPE function before its rotary modules recomposed the axes: per-axis
    tables [3, B, S, D]; within each half of D, consecutive chunks of mrope_section follow
    the t, h and w axes."""
    chunks, start = [], 0
    for j, size in enumerate(list(mrope_section) * 2):
        chunks.append((j % 3, start, start + size))
        start += size
    c = torch.cat([cos[axis, ..., a:b] for axis, a, b in chunks], dim=-1).unsqueeze(unsqueeze_dim)
    s = torch.cat([sin[axis, ..., a:b] for axis, a, b in chunks], dim=-1).unsqueeze(unsqueeze_dim)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def test_older_multimodal_function_is_patched(rope_ops_calls):
    """transformers releases with apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)."""
    assert classify(old_apply_multimodal_rotary_pos_emb, APPLY_MROPE) == "mrope"
    module = _fake_modeling_module("fake_modeling_old_mrope",
                                   apply_multimodal_rotary_pos_emb=old_apply_multimodal_rotary_pos_emb)
    try:
        gen = torch.Generator().manual_seed(5)
        section = [2, 3, 3]
        angles = torch.rand(3, 2, 6, 8, generator=gen) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        q = torch.randn(2, 4, 6, 16, generator=gen, requires_grad=True)
        k = torch.randn(2, 2, 6, 16, generator=gen, requires_grad=True)
        expected = old_apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
        expected_grads = torch.autograd.grad(expected[0].sum() + 2 * expected[1].sum(), (q, k))
        with patch(module.FakeAttention()):
            got = module.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
            grads = torch.autograd.grad(got[0].sum() + 2 * got[1].sum(), (q, k))
        assert len(rope_ops_calls) == 1
        for x, y in zip(got + grads, expected + expected_grads):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
        assert module.apply_multimodal_rotary_pos_emb is old_apply_multimodal_rotary_pos_emb
    finally:
        del sys.modules["fake_modeling_old_mrope"]


# ---------------------------------------------------------------------------------------------
# Bad input: a RopeError, and nothing patched.


def test_classify_names_what_each_function_computes():
    assert classify(modeling_module("llama").apply_rotary_pos_emb) == "neox"
    assert classify(modeling_module("glm4").apply_rotary_pos_emb) == "gptj"
    assert classify(modeling_module("gpt_neox").apply_rotary_pos_emb) == "neox"


def test_bad_arguments():
    model = make_model("llama")
    with pytest.raises(RopeError, match="model: expected a torch.nn.Module"):
        patch("llama")
    with pytest.raises(RopeError, match="exact: expected a bool"):
        patch(model, exact="yes")
    with pytest.raises(RopeError, match="nothing to patch"):
        patch(torch.nn.Linear(2, 2))
    with pytest.raises(RopeError, match="model type 'no_such_model'"):
        patch_model_class("no_such_model")
    with pytest.raises(RopeError, match="target: expected"):
        patch_model_class(3)
    with pytest.raises(RopeError, match="unsqueeze_dim"):
        integration.rotate_with_tables(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                       torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), unsqueeze_dim=3)
    assert not any(is_patched(modeling_module(name)) for name in MODELS)


def _wrong_rotation(q, k, cos, sin, unsqueeze_dim=1):  # the sine with the wrong sign
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos - _rotate_half(q) * sin, k * cos - _rotate_half(k) * sin


def _old_signature(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return q, k


def _raises(q, k, cos, sin, unsqueeze_dim=1):
    raise NotImplementedError("no CPU kernel")


@pytest.mark.parametrize("function, message", [
    (_wrong_rotation, "does not reproduce"),
    (_old_signature, "are not transformers'"),
    (_raises, "failed on a standard call"),
])
def test_unknown_functions_are_refused_and_nothing_is_patched(function, message):
    good = modeling_module("qwen2")
    bad = _fake_modeling_module("fake_modeling_bad", apply_rotary_pos_emb=function)
    try:
        model = make_model("qwen2")
        model.extra = bad.FakeAttention()  # a model whose parts come from two modeling modules
        before = good.apply_rotary_pos_emb
        with pytest.raises(RopeError, match=message):
            patch(model)
        assert good.apply_rotary_pos_emb is before and bad.apply_rotary_pos_emb is function
        assert not is_patched(good) and not is_patched(bad)
    finally:
        del sys.modules["fake_modeling_bad"]


def test_exact_refuses_frequencies_that_differ_from_the_model():
    model = make_model("llama")
    rotary = model.model.rotary_emb
    rotary.original_inv_freq.mul_(1.001)  # no longer what the config says
    with pytest.raises(RopeError, match="differ from LlamaRotaryEmbedding's own"):
        patch(model, exact=True)
    assert model.model.rotary_emb is rotary and not is_patched(modeling_module("llama"))
    with pytest.raises(RopeError, match="no rotary module"):
        patch(torch.nn.Sequential(make_model("llama").model.layers[0]), exact=True)


def test_exact_accepts_a_model_cast_to_bfloat16():
    """model.to(bfloat16) rounds the rotary module's inv_freq buffers to bf16: the config's
    frequencies still match them to that precision, and a real difference is still refused."""
    model = make_model("llama").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with patch(model, exact=True) as handle:
        assert handle.exact
    model.model.rotary_emb.original_inv_freq.mul_(1.02)  # several bf16 ulps off
    with pytest.raises(RopeError, match="differ from LlamaRotaryEmbedding's own"):
        patch(model, exact=True)


# ---------------------------------------------------------------------------------------------
# The end-to-end example, at a CPU size.


def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_end_to_end.py"
    spec = importlib.util.spec_from_file_location("hf_end_to_end", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_end_to_end_example_small(tmp_path):
    out = tmp_path / "e2e.json"
    assert _example().main(["--device", "cpu", "--size", "small", "--layers", "1", "--seq", "24",
                            "--prompt", "12", "--decode", "2", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["info"]["layers"] == 1 and data["info"]["seq"] == 24
    assert set(data["results"]) == {"hf", "rope_ops", "rope_ops_exact"}
    for result in data["results"].values():
        assert result["train_step_ms"] > 0 and result["prefill_ms"] > 0 and result["decode_step_ms"] > 0
        assert result["logits_max_abs_diff_vs_hf"] < 1e-4  # float32: the same model, rotated alike


def test_end_to_end_example_arguments():
    example = _example()
    with pytest.raises(SystemExit):
        example.parse_args(["--modes", "hf,turbo"])
    with pytest.raises(SystemExit):
        example.parse_args(["--layers", "0"])
    args = example.parse_args(["--device", "cpu"])
    assert (args.size, args.dtype, args.modes) == ("small", "float32", list(example.MODES))
