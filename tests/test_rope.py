"""Our RoPE against Transformers, bit for bit: inverse frequencies and attention factor of every
rope_type against ``ROPE_INIT_FUNCTIONS`` (and the models' own default), the cos/sin tables against
the rotary embedding modules, the rotation against each family's ``apply_rotary_pos_emb`` in
bfloat16. This test may import Transformers; the models may not."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_pairs.common.rope import (
    apply_rope,
    default_inv_freq,
    pair_layout,
    rope_cos_sin,
    rope_init,
    yarn_correction_range,
    yarn_inv_freq,
)


def hf_config(params: dict, head_dim: int, max_position_embeddings: int = 4096) -> SimpleNamespace:
    """The few config attributes ``ROPE_INIT_FUNCTIONS`` read, without a config class's own validation."""
    return SimpleNamespace(
        rope_parameters=dict(params),
        head_dim=head_dim,
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        max_position_embeddings=max_position_embeddings,
        standardize_rope_params=lambda: None,
    )


def hf_init(params: dict, head_dim: int, max_position_embeddings: int = 4096) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(params, head_dim, max_position_embeddings)
    if params["rope_type"] == "default":  # no ROPE_INIT_FUNCTIONS entry: the models' own default
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        partial = "partial_rotary_factor" in params  # Llama's default ignores it, Qwen3.5's reads it
        owner = Qwen3_5TextRotaryEmbedding if partial else LlamaRotaryEmbedding
        return owner.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


def assert_bitwise(params: dict, head_dim: int, max_position_embeddings: int = 4096) -> None:
    ours, ours_factor = rope_init(params, head_dim, max_position_embeddings)
    theirs, their_factor = hf_init(params, head_dim, max_position_embeddings)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs), (params, head_dim, (ours - theirs).abs().max())
    assert ours_factor == their_factor, (params, ours_factor, their_factor)


HEAD_DIMS = st.sampled_from([8, 16, 32, 64, 80, 96, 128, 256])
BASES = st.one_of(st.sampled_from([10_000.0, 50_000.0, 500_000.0, 1_000_000.0]), st.floats(100.0, 5e6))
FACTORS = st.one_of(st.sampled_from([2.0, 4.0, 8.0, 12.0, 32.0, 40.0]), st.floats(1.0, 64.0))
PARTIAL = st.sampled_from([None, 0.25, 0.5, 0.75, 1.0])


def with_partial(params: dict, partial: float | None) -> dict:
    return params if partial is None else {**params, "partial_rotary_factor": partial}


@settings(max_examples=150, deadline=None)
@given(head_dim=HEAD_DIMS, base=BASES, partial=PARTIAL)
def test_default_matches_the_models_default_bitwise(head_dim, base, partial):
    assert_bitwise(with_partial({"rope_type": "default", "rope_theta": base}, partial), head_dim)


@settings(max_examples=150, deadline=None)
@given(head_dim=HEAD_DIMS, base=BASES, factor=FACTORS, partial=PARTIAL)
def test_linear_matches_transformers_bitwise(head_dim, base, factor, partial):
    assert_bitwise(with_partial({"rope_type": "linear", "rope_theta": base, "factor": factor}, partial), head_dim)


@settings(max_examples=150, deadline=None)
@given(
    head_dim=HEAD_DIMS,
    base=BASES,
    factor=FACTORS,
    partial=PARTIAL,
    low=st.sampled_from([0.5, 1.0, 2.0]),
    high=st.sampled_from([2.0, 4.0, 8.0]),
    orig=st.sampled_from([64, 256, 2048, 8192]),
)
def test_llama3_matches_transformers_bitwise(head_dim, base, factor, partial, low, high, orig):
    params = {
        "rope_type": "llama3",
        "rope_theta": base,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
    assert_bitwise(with_partial(params, partial), head_dim)


@settings(max_examples=400, deadline=None)
@given(
    head_dim=HEAD_DIMS,
    base=BASES,
    factor=st.one_of(FACTORS, st.none()),
    partial=PARTIAL,
    orig=st.sampled_from([32, 64, 2048, 4096, 8192]),
    beta_fast=st.one_of(st.none(), st.sampled_from([0.0, 16.0, 32.0]), st.floats(2.0, 64.0)),
    beta_slow=st.one_of(st.none(), st.sampled_from([0.0, 1.0, 2.0]), st.floats(0.25, 2.0)),
    attention_factor=st.one_of(st.none(), st.floats(0.5, 3.0)),
    truncate=st.sampled_from([None, True, False]),
    mscale=st.one_of(st.none(), st.floats(0.5, 2.0)),
    mscale_all_dim=st.one_of(st.none(), st.floats(0.0, 2.0)),
)
def test_yarn_matches_transformers_bitwise(
    head_dim, base, factor, partial, orig, beta_fast, beta_slow, attention_factor, truncate, mscale, mscale_all_dim
):
    params = {"rope_type": "yarn", "rope_theta": base, "factor": factor, "original_max_position_embeddings": orig}
    optional = dict(
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        attention_factor=attention_factor,
        truncate=truncate,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    params.update({k: v for k, v in optional.items() if v is not None})
    assert_bitwise(with_partial(params, partial), head_dim, max_position_embeddings=orig * 16)


@settings(max_examples=150, deadline=None)
@given(head_dim=HEAD_DIMS, base=BASES, factor=st.one_of(st.none(), FACTORS), partial=PARTIAL)
def test_proportional_matches_transformers_bitwise(head_dim, base, factor, partial):
    params = with_partial({"rope_type": "proportional", "rope_theta": base}, partial)
    if factor is not None:
        params["factor"] = factor
    assert_bitwise(params, head_dim)
    inv_freq, _ = rope_init(params, head_dim)
    assert inv_freq.shape == (head_dim // 2,)  # full width: the pairs that do not turn have frequency 0


def test_f18_yarn_interpolation_rounds_as_one_over_factor_times_power():
    """F18: ``(1 / base^e) / factor`` and ``1 / (factor * base^e)`` differ by an ulp at factor 12;
    the reference computes the second."""
    params = {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 12.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 2.0,
    }
    assert_bitwise(params, 32)
    pos = 10_000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    assert not torch.equal((1.0 / pos) / 12.0, 1.0 / (12.0 * pos))  # the order matters at this factor


def test_yarn_band_is_the_rounded_clamped_range():
    # OLMo 3 7B: head_dim 128, theta 5e5, original 8192 -> band [floor(18.x), ceil(34.x)] = [18, 35]
    assert yarn_correction_range(128, 500_000.0, 32.0, 1.0, 8192) == (18, 35)
    low, high = yarn_correction_range(128, 500_000.0, 32.0, 1.0, 8192, truncate=False)
    assert 18 < low < 19 and 34 < high < 35
    inv = yarn_inv_freq(128, 500_000.0, 8.0, 8192)
    base = default_inv_freq(128, 500_000.0)
    torch.testing.assert_close(inv[:18], base[:18])  # extrapolated: unchanged
    torch.testing.assert_close(inv[35:], base[35:] / 8)  # interpolated: divided by the factor
    assert torch.all((inv[19:35] < base[19:35]) & (inv[19:35] > base[19:35] / 8))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "longrope", "rope_theta": 1e4}, "rope_type 'longrope' is not supported"),
        ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}, "does not read factor"),
        (
            {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "mrope_section": [1, 2],
            },
            "does not read mrope_section",
        ),
        ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}, "needs 'low_freq_factor'"),
        ({"rope_type": "linear"}, "needs 'rope_theta'"),
    ],
)
def test_rope_init_refuses_what_it_cannot_compute(params, message):
    with pytest.raises(ValueError, match=message):
        rope_init(params, 16)


def test_yarn_without_factor_needs_the_context_lengths():
    params = {"rope_type": "yarn", "rope_theta": 1e4, "factor": None, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope_init(params, 16)
    assert_bitwise(params, 16, max_position_embeddings=640)


# --- tables and rotation against the reference modules, in bfloat16


def reference_tables(model_type: str, params: dict, head_dim: int, seq_len: int, dtype: torch.dtype):
    """cos/sin as the reference's rotary embedding module returns them, ``(1, seq, rotary_dim)``."""
    import transformers

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config_cls = {
        "llama": transformers.LlamaConfig,
        "olmo3": transformers.Olmo3Config,
        "cohere2": transformers.Cohere2Config,
    }[model_type]
    layer_types = {"layer_types": ["full_attention"]} if model_type != "llama" else {}
    rope = {"full_attention": dict(params)} if model_type == "olmo3" else dict(params)
    config = config_cls(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
        rope_parameters=rope,
        max_position_embeddings=8192,
        **layer_types,
    )
    rotary = next(v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding") and "Vision" not in k)(config)
    x = torch.zeros(1, dtype=dtype)
    positions = torch.arange(seq_len)[None]
    return rotary(x, positions, "full_attention") if model_type == "olmo3" else rotary(x, positions)


# model type: (pairing interleaved, tables kept in float32, q/k upcast for the rotation)
ROTATIONS = {"llama": (False, False, False), "olmo3": (False, True, False), "cohere2": (True, False, True)}


@pytest.mark.parametrize("model_type", ROTATIONS)
@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10_000.0},
        {
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 12.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.5,
        },
    ],
    ids=["default", "yarn"],
)
def test_tables_and_rotation_match_the_reference_in_bfloat16(model_type, params):
    interleaved, tables_f32, upcast = ROTATIONS[model_type]
    head_dim, seq_len, dtype = 32, 11, torch.bfloat16
    inv_freq, factor = rope_init(params, head_dim)
    cos, sin = rope_cos_sin(inv_freq, seq_len, factor)
    if not tables_f32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    ref_cos, ref_sin = reference_tables(model_type, params, head_dim, seq_len, dtype)
    assert torch.equal(pair_layout(cos, interleaved)[None], ref_cos)
    assert torch.equal(pair_layout(sin, interleaved)[None], ref_sin)

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    ref_q, ref_k = modeling.apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert torch.equal(apply_rope(q, cos, sin, interleaved=interleaved, upcast=upcast), ref_q)
    assert torch.equal(apply_rope(k, cos, sin, interleaved=interleaved, upcast=upcast), ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_qwen3_5_and_passes_the_rest_through(dtype):
    """Only the first ``rotary_dim`` dims of each head turn (``partial_rotary_factor`` 0.25, Qwen3.5's)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    head_dim, seq_len = 64, 9
    inv_freq, _ = rope_init({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, head_dim)
    assert inv_freq.shape == (8,)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(inv_freq, seq_len))
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    ref_q, ref_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    ours = apply_rope(q, cos, sin)
    assert torch.equal(ours, ref_q) and torch.equal(apply_rope(k, cos, sin), ref_k)
    assert torch.equal(ours[..., 16:], q[..., 16:])  # not rotated
    assert not torch.equal(ours[..., 1:, :16], q[..., 1:, :16])  # rotated past position 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_norm_and_position_zero(interleaved):
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rope_cos_sin(default_inv_freq(8, 10_000.0), 5)
    y = apply_rope(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_interleaved_equals_half_split_after_permutation():
    """Even/odd pairing is half-split pairing on permuted dimensions: the fact behind RoPE-layout bugs."""
    x = torch.randn(1, 1, 6, 8)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved -> half-split order
    cos, sin = rope_cos_sin(default_inv_freq(8, 10_000.0), 6)
    inter = apply_rope(x, cos, sin, interleaved=True)
    half = apply_rope(x[..., perm], cos, sin)
    torch.testing.assert_close(inter[..., perm], half)


@pytest.mark.parametrize(
    ("model_type", "interleaved"), [("helium", True), ("glm4", True), ("llama", False), ("qwen3", False)]
)
def test_the_facts_read_the_pairing_from_the_references_rotate_half(model_type, interleaved):
    """A reference whose ``rotate_half`` pairs ``(2i, 2i + 1)`` (Helium's, GLM-4's) is interleaved in the facts,
    whatever its config says; Llama's and Qwen3's half-split one is not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from parity.model.derive import derive_facts

    config = AutoConfig.for_model(
        model_type, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, pad_token_id=0,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    facts = derive_facts(config, model)
    assert facts.layers[0].rope is not None and facts.layers[0].rope.interleaved is interleaved
