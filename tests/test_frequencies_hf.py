"""Our frequencies equal Hugging Face transformers' for every scaling type.

HF computes in float32, we in float64: inv_freq and the attention factor must agree to float32
precision, and the cos/sin that HF's own rotary module produces (float32 angles) must agree with
ours to what float32 angles allow at those positions.
"""

import math

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops.frequencies import compute_inv_freq, freq_turns_of

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HEAD_DIM = 64
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 512,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 24, "beta_slow": 2},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
}


def hf_config(scaling: dict, theta: float = 500000.0, partial: float | None = None) -> LlamaConfig:
    params = {**scaling, "rope_theta": theta}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=4096, rope_parameters=params)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 3000, 9000])
def test_inv_freq_and_attention_factor_match_hf(name, seq_len):
    scaling = SCALINGS[name]
    config = hf_config(scaling)
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        hf_inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        hf_factor = 1.0
    else:
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    ours = rope_ops.RotaryEmbedding.from_hf_config(config, seq_len=seq_len)
    torch.testing.assert_close(ours.inv_freq, hf_inv.double(), rtol=3e-6, atol=0)
    assert ours.attention_factor == pytest.approx(hf_factor, rel=1e-12)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_match_hf_module(name):
    config = hf_config(SCALINGS[name])
    hf_module = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 100, 1023, 1500, 4095]])
    hf_cos, hf_sin = hf_module(torch.zeros(1, positions.shape[1], HEAD_DIM), positions)
    # HF's module re-picks dynamic/longrope frequencies from max(position_ids) + 1 on each
    # forward (a host sync); with rope_ops the caller says the length explicitly.
    ours = rope_ops.RotaryEmbedding.from_hf_config(config, seq_len=int(positions.max()) + 1)
    cos, sin, _, _ = ours.tables(torch.device("cpu"))
    # HF returns full-width [.., D] tables (cat(c, c)); ours are [P, r/2].
    ours_cos = cos[positions[0]].repeat(1, 2)
    ours_sin = sin[positions[0]].repeat(1, 2)
    # HF's float32 angle p*inv_freq is off by up to ~p * 2^-24 rad: scale the tolerance by p.
    atol = (positions[0].double() * 2.0**-22 + 1e-6).unsqueeze(1)
    assert ((ours_cos.double() - hf_cos[0].double()).abs() <= atol).all()
    assert ((ours_sin.double() - hf_sin[0].double()).abs() <= atol).all()


def test_partial_rotary_factor_from_config():
    config = hf_config(SCALINGS["default"], partial=0.5)
    ours = rope_ops.RotaryEmbedding.from_hf_config(config)
    assert ours.rotary_dim == HEAD_DIM // 2
    expected = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM // 2, 2, dtype=torch.float64) / (HEAD_DIM // 2)))
    torch.testing.assert_close(ours.inv_freq, expected)


def test_from_hf_config_accepts_dict_and_legacy_rope_scaling():
    legacy = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2.0}}
    ours = rope_ops.RotaryEmbedding.from_hf_config(legacy)
    assert ours.rope_type == "linear" and ours.base == 10000.0 and ours.max_position == 2048
    torch.testing.assert_close(ours.inv_freq[:1], torch.tensor([0.5], dtype=torch.float64))
    gptj = rope_ops.RotaryEmbedding.from_hf_config({"model_type": "gptj", "n_embd": 4096, "hidden_size": 4096,
                                                    "num_attention_heads": 16, "rotary_dim": 64})
    assert gptj.style == "gptj" and gptj.rotary_dim == 64 and gptj.head_dim == 256


def test_dynamic_and_longrope_switch_with_seq_len():
    dyn = rope_ops.RotaryEmbedding(HEAD_DIM, scaling=SCALINGS["dynamic"], max_position=4096)
    assert torch.equal(dyn.inv_freq, rope_ops.RotaryEmbedding(HEAD_DIM, max_position=4096).inv_freq)
    stretched = dyn.with_seq_len(16384)
    assert (stretched.inv_freq[1:] < dyn.inv_freq[1:]).all()
    assert stretched.freqs is dyn.with_seq_len(16384).freqs  # computed once
    # frequencies made for one stretched length get no table: a new length every decode step
    # must not build (and keep) a table per step; every row is computed on the fly instead
    assert stretched.table_rows == 0 and stretched.cos_table.numel() == 0
    lr = rope_ops.RotaryEmbedding(HEAD_DIM, scaling=SCALINGS["longrope"], max_position=4096)
    assert not torch.equal(lr.inv_freq, lr.with_seq_len(2000).inv_freq)
    assert torch.equal(lr.inv_freq, lr.with_seq_len(1000).inv_freq)


@pytest.mark.parametrize("scaling, missing", [
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "yarn"}, "factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32}, "long_factor"),
])
def test_missing_keys_named(scaling, missing):
    with pytest.raises(RopeError, match=missing):
        compute_inv_freq(HEAD_DIM, 10000.0, scaling)


def test_dynamic_needs_max_position():
    with pytest.raises(RopeError, match="max_position"):
        compute_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("base", [0, -5.0, float("inf"), "10000"])
def test_bad_base(base):
    with pytest.raises(RopeError, match="base"):
        compute_inv_freq(HEAD_DIM, base)


def test_freq_turns_reproduce_exact_angles():
    """p * turns (wrapping) is p's angle as a 64-bit fraction of a turn, within |p| * 2^-65 turn
    of exact for every int64 position (the constant is exact to half a unit of 2^-64)."""
    from fractions import Fraction

    from rope_ops.frequencies import reduced_angle

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    turns = freq_turns_of(inv_freq)
    for p in (0, 1, 12345, (1 << 20) - 1, -77777, 1 << 30, 1 << 36, -(1 << 40), (1 << 62) - 1):
        for i in (0, 5, 63):
            fixed = (p * int(turns[i])) % 2**64
            got = Fraction(fixed, 2**64)
            exact = Fraction(reduced_angle(p, float(inv_freq[i]))) / Fraction(2 * math.pi)  # in turns
            err = abs(got - exact) % 1
            err = min(err, 1 - err)
            assert err <= Fraction(abs(p) + 2, 2**65) + Fraction(1, 2**50), (p, i, float(err))


def test_reduced_angle_is_exact_where_float64_is_not():
    """The reference's angle reduction is exact: at 2^40 a float64 product p * inv_freq would be
    off by ~2^-13 rad."""
    from rope_ops.frequencies import reduced_angle

    f = 0.8659643233600653  # a typical inv_freq
    p = 1 << 40
    exact = reduced_angle(p, f)
    # the same reduction done by hand with Fractions and a 200-digit pi
    from fractions import Fraction
    pi = Fraction("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899"
                  "8628034825342117067982148086513282306647093844609550582231725359408128481117450284"
                  "1027019385211055596446229489549303819644288109756659334461284756482337867831652712"
                  "019091456485669234603486104543266482133936072602491412737245870066063155881748815209209628")
    angle = p * Fraction(f)
    turns = angle / (2 * pi)
    r = (turns - round(turns)) * 2 * pi
    assert abs(exact - float(r)) < 1e-15


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_types_match_hf_beyond_max_position(name):
    config = hf_config(SCALINGS[name])
    hf_module = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 3, 5000, 8999]])
    hf_cos, hf_sin = hf_module(torch.zeros(1, 4, HEAD_DIM), positions)
    ours = rope_ops.RotaryEmbedding.from_hf_config(config, seq_len=9000)
    torch.testing.assert_close(ours.inv_freq, hf_module.inv_freq.double(), rtol=3e-6, atol=0)
    theta = positions[0].double().unsqueeze(1) * ours.inv_freq
    atol = (positions[0].double() * 2.0**-22 + 1e-6).unsqueeze(1)
    assert ((ours.attention_factor * theta.cos() - hf_cos[0, :, : HEAD_DIM // 2].double()).abs() <= atol).all()
