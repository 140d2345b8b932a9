"""The fused prologue against Hugging Face's Qwen3 and Gemma 3 modules.

HF runs q_norm/k_norm (Qwen3RMSNorm, Gemma3RMSNorm) and then apply_rotary_pos_emb with cos/sin
in the activation dtype, rounding between the steps; rope_ops rounds once. The difference is
bounded by a few units in the last place of the dtype: measured here, stated in docs/spec.md.
"""

import pytest
import torch

import rope_ops
from rope_ops._reference import rms_norm_reference
from rope_ops.testing.tolerances import pair_indices, ulp

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

HQ, HK, D = 4, 2, 64


def hf_prologue(qkv, position_ids, q_norm, k_norm, dtype):
    """HF's steps; returns (q, k, v, cos, sin) with its cos/sin as its rotary module gives them."""
    config = LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK,
                         max_position_embeddings=4096, rope_theta=1e6)
    rotary = LlamaRotaryEmbedding(config)
    t = qkv.shape[0]
    heads = qkv.view(1, t, HQ + 2 * HK, D)
    q, k, v = heads.split([HQ, HK, HK], dim=2)
    q = q_norm(q).transpose(1, 2)
    k = k_norm(k).transpose(1, 2)
    cos, sin = rotary(qkv.view(1, t, -1), position_ids)
    cos, sin = cos.to(dtype), sin.to(dtype)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q.transpose(1, 2)[0], k.transpose(1, 2)[0], v[0], cos[0], sin[0]


# (dtype, angles, ulps): with HF's own cos/sin (per token) only the rounding steps differ; from
# positions, bf16 also absorbs HF's float32-angle error at positions < 4000
@pytest.mark.parametrize("dtype, angles, max_ulps", [(torch.bfloat16, "hf_cos_sin", 3),
                                                      (torch.float32, "hf_cos_sin", 3),
                                                      (torch.bfloat16, "positions", 3)])
@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
def test_prologue_matches_hf_within_a_few_ulps(model, dtype, angles, max_ulps):
    gen = torch.Generator().manual_seed(0)
    t = 64
    qkv = torch.randn(t, (HQ + 2 * HK) * D, generator=gen).to(dtype)
    if model == "qwen3":
        q_norm, k_norm = Qwen3RMSNorm(D, eps=1e-6), Qwen3RMSNorm(D, eps=1e-6)
        offset = 0.0
    else:
        q_norm, k_norm = Gemma3RMSNorm(D, eps=1e-6), Gemma3RMSNorm(D, eps=1e-6)
        offset = 1.0
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.randn(D, generator=gen) * 0.3 + (0.0 if offset else 1.0))
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    position_ids = torch.randint(0, 4000, (1, t), generator=gen)
    with torch.no_grad():
        hq, hk, hv, cos, sin = hf_prologue(qkv, position_ids, q_norm, k_norm, dtype)
        rotation = ({"cos_sin": (cos, sin)} if angles == "hf_cos_sin"
                    else {"base": 1e6, "max_position": 4096})
        q, k, v = rope_ops.qkv_prologue(qkv, None if angles == "hf_cos_sin" else position_ids[0],
                                        num_q_heads=HQ, num_kv_heads=HK, head_dim=D,
                                        q_norm=q_norm.weight, k_norm=k_norm.weight, eps=1e-6,
                                        norm_offset=offset, **rotation)
    assert torch.equal(v, hv)
    heads = qkv.double().view(t, HQ + 2 * HK, D)
    first, second = pair_indices(D, "neox")
    for ours, theirs, x, norm, name in ((q, hq, heads[:, :HQ], q_norm, "q"),
                                        (k, hk, heads[:, HQ:HQ + HK], k_norm, "k")):
        # errors of rounding steps are relative to the pair's (normalised) magnitude, not to the
        # result, which may cancel to near zero
        n = rms_norm_reference(x, norm.weight, 1e-6, offset)
        magnitude = (n[..., first].abs() + n[..., second].abs()).repeat(1, 1, 2)
        unit = ulp(magnitude, torch.bfloat16) if dtype == torch.bfloat16 else magnitude * 2.0**-23
        units = (ours.double() - theirs.double()).abs() / unit
        assert units.max() <= max_ulps, f"{model} {name}: {units.max().item():.1f} ulps"
