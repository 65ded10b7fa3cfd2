"""Our RoPE variants against the formulas Transformers uses (this test may import Transformers;
the models may not)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_pairs.common.rope import apply_rope, default_inv_freq, rope_cos_sin, yarn_correction_range, yarn_inv_freq


def hf_yarn(head_dim, base, factor, orig, beta_fast, beta_slow):
    from transformers import Olmo3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", rope_theta=base, factor=factor, original_max_position_embeddings=orig,
                  beta_fast=beta_fast, beta_slow=beta_slow)
    config = Olmo3Config(hidden_size=head_dim * 2, num_attention_heads=2, num_hidden_layers=4,
                         max_position_embeddings=int(orig * factor),
                         rope_parameters={"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": base}})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu", layer_type="full_attention")


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([8, 16, 64, 128]),
    base=st.sampled_from([10_000.0, 500_000.0, 1_000_000.0]),
    factor=st.sampled_from([2.0, 4.0, 8.0, 12.0, 32.0, 40.0]),
    orig=st.sampled_from([2048, 4096, 8192]),
    beta_fast=st.sampled_from([16.0, 32.0]),
    beta_slow=st.sampled_from([1.0, 2.0]),
)
def test_yarn_inv_freq_matches_transformers(head_dim, base, factor, orig, beta_fast, beta_slow):
    ours = yarn_inv_freq(head_dim, base, factor, orig, beta_fast, beta_slow)
    theirs, _ = hf_yarn(head_dim, base, factor, orig, beta_fast, beta_slow)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_f18_yarn_with_factor_12_is_bit_identical():
    """F18: ``(1/base^e)/factor`` is an ulp off ``1/(factor*base^e)``, which the reference computes."""
    ours = yarn_inv_freq(32, 10_000.0, 12.0, 64)
    theirs, _ = hf_yarn(32, 10_000.0, 12.0, 64, 32.0, 1.0)
    assert torch.equal(ours, theirs)


def test_olmo3_yarn_band_is_the_rounded_clamped_range():
    # OLMo 3 7B: head_dim 128, theta 5e5, original 8192 -> band [floor(18.1), ceil(35.0)] = [18, 36]? computed:
    low, high = yarn_correction_range(128, 500_000.0, 32.0, 1.0, 8192)
    assert (low, high) == (18, 35)
    inv = yarn_inv_freq(128, 500_000.0, 8.0, 8192)
    base = default_inv_freq(128, 500_000.0)
    torch.testing.assert_close(inv[:18], base[:18])  # extrapolated: unchanged
    torch.testing.assert_close(inv[35:], base[35:] / 8)  # interpolated: divided by the factor
    assert torch.all((inv[19:35] < base[19:35]) & (inv[19:35] > base[19:35] / 8))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_norm_and_position_zero(interleaved):
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rope_cos_sin(default_inv_freq(8, 10_000.0), 5, interleaved=interleaved)
    y = apply_rope(x, cos, sin, interleaved)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_interleaved_equals_half_split_after_permutation():
    """Even/odd pairing is half-split pairing on permuted dimensions: the fact behind RoPE-layout bugs."""
    x = torch.randn(1, 1, 6, 8)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved -> half-split order
    inv = default_inv_freq(8, 10_000.0)
    inter = apply_rope(x, *rope_cos_sin(inv, 6, interleaved=True), interleaved=True)
    half = apply_rope(x[..., perm], *rope_cos_sin(inv, 6))
    torch.testing.assert_close(inter[..., perm], half)
