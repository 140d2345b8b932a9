"""mRoPE and per-token tables against Hugging Face transformers' own functions.

transformers' Qwen2-VL (chunked) and Qwen3-VL (interleaved) rotary modules turn position ids
[3, B, S] into per-token cos/sin; its apply_rotary_pos_emb rotates with them. rope_ops must give
the same rotation from the positions (mrope_section), and from HF's cos/sin directly (pos None).
"""

import pytest
import torch

import rope_ops
from rope_ops._mrope import mrope_axes

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import configuration_qwen2_vl, modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import configuration_qwen3_vl, modeling_qwen3_vl  # noqa: E402

HEAD_DIM, SECTION = 64, [8, 12, 12]


def hf_rotary(interleaved: bool):
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION}
    if interleaved:
        config = configuration_qwen3_vl.Qwen3VLTextConfig(
            hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
            rope_parameters={**params, "mrope_interleaved": True})
        return modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(config), modeling_qwen3_vl
    config = configuration_qwen2_vl.Qwen2VLTextConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2, rope_parameters=params)
    return modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config), modeling_qwen2_vl


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_vl", "qwen3_vl"])
def test_axes_match_hf_recomposition(interleaved):
    """Which axis each frequency follows, read off HF's recomposition with marker positions."""
    module, _ = hf_rotary(interleaved)
    marker = torch.zeros(3, 1, 1, HEAD_DIM // 2)
    for axis in range(3):
        marker[axis] = axis
    recomposed = module.recomposition_frequencies(marker.clone())[..., : HEAD_DIM // 2]
    assert recomposed.flatten().long().tolist() == mrope_axes(SECTION, interleaved).tolist()


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_vl", "qwen3_vl"])
def test_mrope_matches_hf_apply_rotary_pos_emb(interleaved):
    module, modeling = hf_rotary(interleaved)
    gen = torch.Generator().manual_seed(0)
    batch, seq = 2, 9
    q = torch.randn(batch, 4, seq, HEAD_DIM, generator=gen, dtype=torch.float64)  # HF: [B, H, S, D]
    k = torch.randn(batch, 2, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 300, (3, batch, seq), generator=gen)
    cos, sin = module(q, pos)
    hf_q, hf_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = rope_ops.apply(q, k, pos, layout="bhsd", base=10000.0, mrope_section=SECTION,
                                    mrope_interleaved=interleaved)
    # HF's angles are float32 products: off by ~p * 2^-24 rad at position p < 300
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=1e-4)
    # from HF's own cos/sin, per token: the same values, so (nearly) the same bits
    tok_q, tok_k = rope_ops.apply(q, k, None, cos_sin=(cos, sin), layout="bhsd")
    torch.testing.assert_close(tok_q, hf_q, rtol=0, atol=1e-12)
    torch.testing.assert_close(tok_k, hf_k, rtol=0, atol=1e-12)


def test_per_token_tables_match_llama_apply_rotary_pos_emb():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    module = modeling_llama.LlamaRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 7, 64, generator=gen)
    k = torch.randn(2, 2, 7, 64, generator=gen)
    position_ids = torch.randint(0, 500, (1, 7), generator=gen)
    cos, sin = module(q, position_ids)
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = rope_ops.apply(q, k, None, cos_sin=(cos, sin), layout="bhsd")
    # float32: the same products, rounded differently (one fused rounding here)
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=2e-6)


@pytest.mark.parametrize("section", [(32, 0, 0), (0, 32, 0), (10, 0, 22), (0, 0, 32)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_sections_with_an_empty_axis(section, interleaved):
    axes = mrope_axes(section, interleaved)
    assert axes.numel() == 32
    counts = torch.bincount(axes, minlength=3).tolist()
    if not interleaved:
        assert counts == list(section)
    assert all(counts[a] == 0 for a in range(3) if section[a] == 0 and (a > 0 or not interleaved))
