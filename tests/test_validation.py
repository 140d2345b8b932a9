"""Every bad argument is a RopeError naming it (never another exception type, never a silently
changed default), raised before anything is written; arguments are honoured, never ignored."""

import math

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops._reference import rope_reference

LINEAR = {"rope_type": "linear"}
YARN = {"rope_type": "yarn", "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
            "original_max_position_embeddings": 64}

# name -> (apply keyword arguments, text the message must contain)
BAD_CALLS = {
    "linear factor 0": ({"scaling": {**LINEAR, "factor": 0}}, "factor"),
    "linear factor nan": ({"scaling": {**LINEAR, "factor": float("nan")}}, "factor"),
    "linear factor inf": ({"scaling": {**LINEAR, "factor": math.inf}}, "factor"),
    "linear factor string": ({"scaling": {**LINEAR, "factor": "2"}}, "factor"),
    "yarn original 0": ({"scaling": {**YARN, "factor": 4.0, "original_max_position_embeddings": 0}},
                        "original_max_position_embeddings"),
    "yarn beta_fast negative": ({"scaling": {**YARN, "factor": 4.0, "beta_fast": -1}}, "beta_fast"),
    "yarn mscale nan": ({"scaling": {**YARN, "factor": 4.0, "mscale": float("nan"),
                                     "mscale_all_dim": 1.0}}, "mscale"),
    "yarn base 1": ({"scaling": {**YARN, "factor": 4.0}, "base": 1.0}, "base"),
    "dynamic rotary_dim 2": ({"scaling": {"rope_type": "dynamic", "factor": 2.0}, "rotary_dim": 2,
                              "max_position": 64}, "rotary_dim"),
    "dynamic max_position 0": ({"scaling": {"rope_type": "dynamic", "factor": 2.0},
                                "max_position": 0}, "max_position"),
    "dynamic no max_position": ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, "max_position"),
    "llama3 equal factors": ({"scaling": {**LLAMA3, "factor": 8.0, "high_freq_factor": 1.0}},
                             "high_freq_factor"),
    "llama3 factor 0": ({"scaling": {**LLAMA3, "factor": 0.0}}, "factor"),
    "longrope original 1": ({"scaling": {**LONGROPE, "original_max_position_embeddings": 1,
                                         "factor": 4.0}}, "original_max_position_embeddings"),
    "longrope short factor length": ({"scaling": {**LONGROPE, "short_factor": [1.0] * 3}},
                                     "short_factor"),
    "longrope zero factor": ({"scaling": {**LONGROPE, "short_factor": [0.0] * 16}}, "short_factor"),
    "base list": ({"base": [10000.0]}, "base"),
    "base bool": ({"base": True}, "base"),
    "base nan": ({"base": float("nan")}, "base"),
    "layout list": ({"layout": ["bshd"]}, "layout"),
    "max_position list": ({"max_position": [64]}, "max_position"),
    "max_position float": ({"max_position": 64.5}, "max_position"),
    "seq_len list": ({"seq_len": [100]}, "seq_len"),
    "seq_len string": ({"seq_len": "x"}, "seq_len"),
    "seq_len negative": ({"seq_len": -1}, "seq_len"),
    "backend int": ({"backend": 123}, "backend"),
    "style list": ({"style": ["neox"]}, "style"),
    "rotary_dim float": ({"rotary_dim": 16.0}, "rotary_dim"),
    "inplace int": ({"inplace": 1}, "inplace"),
    "scaling list": ({"scaling": [("rope_type", "linear")]}, "scaling"),
    "scaling per layer type": ({"scaling": {"full_attention": {"rope_type": "default"},
                                            "sliding_attention": {"rope_type": "default"}}},
                               "layer type"),
    "rope_type unhashable": ({"scaling": {"rope_type": ["yarn"]}}, "rope_type"),
    "cos_sin wrong width": ({"cos_sin": (torch.ones(8, 5), torch.ones(8, 5)), "rotary_dim": 32},
                            "cos_sin"),
    "cos_sin with seq_len": ({"cos_sin": (torch.ones(8, 16), torch.ones(8, 16)), "seq_len": 4},
                             "seq_len"),
    "rope and max_position": ({"rope": "ROPE", "max_position": 100}, "rope"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_argument_is_a_rope_error_naming_it(name):
    kwargs, named = BAD_CALLS[name]
    if kwargs.get("rope") == "ROPE":
        kwargs = {**kwargs, "rope": rope_ops.RotaryEmbedding(32)}
    q = torch.randn(2, 4, 3, 32)
    k = torch.randn(2, 4, 1, 32)
    q_before, k_before = q.clone(), k.clone()
    for inplace in (False, True):
        call = {**kwargs}
        call.setdefault("inplace", inplace)
        with pytest.raises(RopeError, match=named) as info:
            rope_ops.apply(q, k, torch.arange(4), **call)
        assert type(info.value) is RopeError
        assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("config, named", [
    ({"hidden_size": 64, "num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 0}, "base"),
    ({"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0}, "partial_rotary_factor"),
    ({"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {"rope_type": "linear", "factor": 0}},
     "factor"),
    ({"hidden_size": 65, "num_attention_heads": 4}, "multiple"),
    ({"num_attention_heads": 4}, "head_dim"),
    ({"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "layer_type"),
])
def test_hf_config_values_are_checked_not_defaulted(config, named):
    with pytest.raises(RopeError, match=named):
        rope_ops.RotaryEmbedding.from_hf_config(config)


def test_hf_config_per_layer_type_needs_and_honours_layer_type():
    config = {"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rope_ops.RotaryEmbedding.from_hf_config(config, layer_type="full_attention").base == 1e6
    assert rope_ops.RotaryEmbedding.from_hf_config(config, layer_type="sliding_attention").base == 1e4
    with pytest.raises(RopeError, match="layer_type"):
        rope_ops.RotaryEmbedding.from_hf_config(config, layer_type="global")


def test_seq_len_with_a_rope_module_is_honoured():
    """apply(rope=dynamic_rope, seq_len=n) scales for n, as a module built for n would."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    rope = rope_ops.RotaryEmbedding(32, scaling=scaling, max_position=64)
    q = torch.randn(1, 5, 2, 32, dtype=torch.float64)
    pos = torch.tensor([3, 70, 200, 1000, 4999])
    plain, _ = rope_ops.apply(q, None, pos, rope=rope)
    stretched, _ = rope_ops.apply(q, None, pos, rope=rope, seq_len=5000)
    built = rope_ops.RotaryEmbedding(32, scaling=scaling, max_position=64, seq_len=5000)
    expected = rope_reference(q, pos, layout="bshd", rotary_dim=32, style="neox", inv_freq=built.inv_freq)
    torch.testing.assert_close(stretched, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(plain, stretched)
    # a module's call takes seq_len too
    again, _ = rope(q, None, pos, seq_len=5000)
    torch.testing.assert_close(again, stretched, rtol=0, atol=0)


def test_seq_len_is_ignored_only_where_the_type_does_not_use_it():
    """For rope types whose frequencies do not depend on the length, seq_len is validated and
    changes nothing (the same tables serve)."""
    from rope_ops._tables import CACHE

    q = torch.randn(1, 3, 2, 32)
    first, _ = rope_ops.apply(q, None, 0, base=2222.0)
    entries = len(CACHE)
    for n in range(1, 40):
        out, _ = rope_ops.apply(q, None, 0, base=2222.0, seq_len=n)
        assert torch.equal(out, first)
    assert len(CACHE) == entries
