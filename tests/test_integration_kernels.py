"""rope_ops as the ``rotary_pos_emb`` layer of the ``kernels`` package (rope_ops.integrations.kernels_hub).

Offline, through kernels' own machinery: a local repository that ``get_local_kernel`` and
``LocalLayerRepository`` load, a mapping that ``kernelize`` follows in training mode (where the
hub's rotary kernels are inference-only), forward and backward equal to transformers' function.

transformers decorates ``apply_rotary_pos_emb`` only when its supported ``kernels`` versions are
installed; elsewhere the tests decorate it the same way (``use_kernel_forward_from_hub`` and
``use_kernelized_func``, as transformers' modeling files do).
"""

from __future__ import annotations

import json

import pytest
import torch

from rope_ops.integrations import kernels_hub

from _hf_support import rope_ops_calls  # noqa: F401  (fixture)

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


@pytest.fixture
def rotary_func(monkeypatch):
    """Llama's apply_rotary_pos_emb as a kernels function layer named "rotary_pos_emb",
    attached to LlamaAttention for kernelize; everything restored afterwards."""
    func = modeling_llama.apply_rotary_pos_emb
    if getattr(func, "kernel_layer_name", None) != "rotary_pos_emb":
        func = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(func)
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", func)
        monkeypatch.setattr(modeling_llama.LlamaAttention, "__init__", modeling_llama.LlamaAttention.__init__)
        kernels.use_kernelized_func(func)(modeling_llama.LlamaAttention)
    monkeypatch.setattr(func, "forward", func.forward)  # kernelize rebinds it
    return func


def _kernelized_funcs(model):
    """The rotary function modules kernelize rebinds in `model`: kernels >= 0.19.1 gives every
    module decorated with use_kernelized_func its own private copy (`_kernel_funcs`, which calls
    to the function inside that module's forward reach); earlier versions share the
    module-level function."""
    own = [f for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values()
           if getattr(f, "kernel_layer_name", None) == "rotary_pos_emb"]
    return own or [modeling_llama.apply_rotary_pos_emb]


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 16, generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 7, 16, generator=gen).to(dtype).requires_grad_(True)
    angles = torch.rand(1, 7, 8, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    return q, k, cos, sin


def _forward_backward(fn, q, k, cos, sin):
    q_out, k_out = fn(q, k, cos, sin)
    grads = torch.autograd.grad((q_out.float() * 1.5).sum() + (k_out.float() ** 2).sum(), (q, k))
    return q_out, k_out, *grads


def test_local_repository_is_what_kernels_loads(tmp_path):
    repo = kernels_hub.write_local_repository(tmp_path / "repo")
    assert kernels_hub.write_local_repository(repo) == repo  # rewriting is harmless
    for variant, backend in kernels_hub.VARIANTS.items():
        metadata = kernels.Metadata.read_from_file(repo / "build" / variant / "metadata.json")
        assert metadata.name.python_name == "rope_ops_rotary"
        assert json.loads((repo / "build" / variant / "metadata.json").read_text())["backend"] == {"type": backend}
    module = kernels.get_local_kernel(repo)
    assert getattr(module.layers, kernels_hub.LAYER_NAME) is kernels_hub.ApplyRotaryTransformers
    layer = LocalLayerRepository(repo_path=repo, layer_name=kernels_hub.LAYER_NAME).load()
    assert layer is kernels_hub.ApplyRotaryTransformers
    assert layer.has_backward and layer.can_torch_compile


def test_local_repository_records_a_digest_that_kernels_verifies(tmp_path, caplog):
    if not kernels_hub._reads_digests():
        pytest.skip("this kernels does not read digests")
    repo = kernels_hub.write_local_repository(tmp_path)
    with caplog.at_level("WARNING"):
        kernels.get_local_kernel(repo)
    assert "digest" not in caplog.text  # no "cannot be verified" warning
    (repo / "build" / "torch-cpu" / "__init__.py").write_text("raise SystemExit\n")
    with pytest.raises(Exception, match="digest"):
        kernels.get_local_kernel(repo)


def test_mapping_covers_every_mode_and_device(tmp_path):
    mapping = kernels_hub.kernel_mapping(tmp_path)
    per_device = mapping["rotary_pos_emb"]
    assert set(per_device) == set(kernels_hub.DEVICES)
    for modes in per_device.values():
        assert set(modes) == {Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
                              Mode.INFERENCE | Mode.TORCH_COMPILE}


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernelized_function_matches_transformers(tmp_path, rotary_func, rope_ops_calls, mode, dtype):
    repo = kernels_hub.write_local_repository(tmp_path)
    original = modeling_llama.apply_rotary_pos_emb.forward
    inputs = _inputs(dtype)
    expected = _forward_backward(original, *inputs)

    holder = modeling_llama.LlamaAttention(modeling_llama.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2), layer_idx=0)
    with use_kernel_mapping(kernels_hub.kernel_mapping(repo)):
        kernelize(holder, mode=mode, device="cpu", use_fallback=False)  # no silent fallback
    (func,) = _kernelized_funcs(holder)
    assert func.forward.__func__ is kernels_hub.ApplyRotaryTransformers.forward
    got = _forward_backward(func, *inputs)
    assert len(rope_ops_calls) == 1
    for x, y in zip(got, expected):
        assert x.dtype == y.dtype
    if dtype == torch.float32:  # one rounding apart
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
    else:  # bf16: transformers rounds after each multiply and add, rope_ops once
        exact = _forward_backward(original, *(t.detach().double().requires_grad_(t.requires_grad) for t in inputs))
        for x, y, truth in zip(got, expected, exact):
            assert (x.double() - truth).abs().max() <= (y.double() - truth).abs().max()


def test_kernelized_llama_trains_like_transformers(tmp_path, rotary_func, rope_ops_calls):
    repo = kernels_hub.write_local_repository(tmp_path)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    hf_logits, hf_grads = step()
    with use_kernel_mapping(kernels_hub.kernel_mapping(repo)):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    funcs = _kernelized_funcs(model)
    assert funcs and all(f.forward.__func__ is kernels_hub.ApplyRotaryTransformers.forward for f in funcs)
    logits, grads = step()
    assert len(rope_ops_calls) == config.num_hidden_layers
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name], rtol=0, atol=2e-5)


def test_kernelized_function_compiles(tmp_path, rotary_func):
    repo = kernels_hub.write_local_repository(tmp_path)
    holder = modeling_llama.LlamaAttention(modeling_llama.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2), layer_idx=0)
    with use_kernel_mapping(kernels_hub.kernel_mapping(repo)):
        kernelize(holder, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu", use_fallback=False)
    inputs = _inputs(torch.float32, seed=2)
    eager = _forward_backward(modeling_llama.apply_rotary_pos_emb, *inputs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, cos, sin: modeling_llama.apply_rotary_pos_emb(q, k, cos, sin),
                             backend="aot_eager", fullgraph=True)
    got = _forward_backward(compiled, *inputs)
    torch._dynamo.reset()
    for x, y in zip(got, eager):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_command_line(tmp_path, capsys):
    assert kernels_hub.main([str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "build" / "torch-cuda" / "__init__.py").is_file()
    assert str(tmp_path / "cli") in capsys.readouterr().out
    assert kernels_hub.main([]) == 2
    assert kernels_hub.main(["--help"]) == 2
