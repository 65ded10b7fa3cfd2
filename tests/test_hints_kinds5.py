"""Hints the fifth held-back set prompted, each with the fault on ours and on the reference: a mask's
finite fill value on future keys, a residual add's coefficients against the config's multipliers, an
attention scale named on both sides (``tests/test_heldout5_faults.py`` holds the user models that
first showed them)."""

from __future__ import annotations

import pytest
import torch

import parity
from tests.test_heldout4_faults import MODELS, checkpoints  # noqa: F401 (the Granite checkpoint fixture)
from tests.test_hints_either_side import SIDES, located, pair_of
from tests.test_hints_kinds import side_name, softmax_patched


@pytest.mark.parametrize("side", SIDES)
def test_a_causal_mask_filled_with_zero_is_the_causal_mask_with_its_fill_value(side, monkeypatch):
    """Every masked score (the future keys) set to 0 instead of the dtype's lowest value."""

    def zero_filled(x, dim, real):
        if x.dim() == 4:
            x = torch.where(x < -1e30, torch.zeros_like(x), x)
        return real(x, dim=dim)

    softmax_patched(monkeypatch, side, zero_filled)
    hint = located(pair_of("llama3"), "model.layers.0.self_attn.probs", "causal_mask")
    assert hint.evidence["side"] == side_name(side) and hint.evidence["fill_value"] == 0.0, hint


def granite_reference(monkeypatch, **attributes) -> None:
    """Transformers' Granite decoder layers (and attention) built with these attributes changed."""
    from transformers.models.granite import modeling_granite as m

    for cls in (m.GraniteDecoderLayer, m.GraniteAttention):
        init = cls.__init__
        names = [k for k in attributes if k in ("residual_multiplier", "scaling")]

        def patched(self, *a, _init=init, _names=names, **k):
            _init(self, *a, **k)
            for name in _names:
                if hasattr(self, name):
                    setattr(self, name, attributes[name])

        monkeypatch.setattr(cls, "__init__", patched)


def granite_check(checkpoints, bug: str = ""):  # noqa: F811 (the fixture's value)
    MODELS["granite"].BUG = bug
    try:
        return parity.check_model(MODELS["granite"].build, reference=str(checkpoints["granite"]), seq_len=24)
    finally:
        MODELS["granite"].BUG = ""


@pytest.mark.parametrize("side", SIDES)
def test_a_residual_multiplier_from_another_field_is_named_on_its_side(side, checkpoints, monkeypatch):  # noqa: F811
    """The attention branch added with the embedding multiplier (6) where Granite's residual_multiplier
    (0.22) belongs: both sides fit ``a x + b f(x)`` exactly, each coefficient named by its constant."""
    if side == "ours":
        res = granite_check(checkpoints, "resmul_from_emb_field")
    else:
        granite_reference(monkeypatch, residual_multiplier=6.0)
        res = granite_check(checkpoints)
    bad = res.first_mismatch
    assert bad is not None and bad.name == "model.layers.0.post_attention_layernorm", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "residual", bad.hint
    ours, ref = ("6", "0.22") if side == "ours" else ("0.22", "6")
    assert f"the reference 1 x + {ref} f(x)" in bad.hint.text and f"ours computes 1 x + {ours} f(x)" in bad.hint.text
    assert "(= the config's embedding_multiplier (6))" in bad.hint.text, bad.hint


@pytest.mark.parametrize("side", SIDES)
def test_an_attention_scale_is_named_on_both_sides(side, checkpoints, monkeypatch):  # noqa: F811
    """1/sqrt(head_dim) where Granite scales by its attention_multiplier (0.0625): each side's scale is
    read from its own scores and q k^T, and named."""
    if side == "ours":
        res = granite_check(checkpoints, "attn_mult_on_output")
    else:
        granite_reference(monkeypatch, scaling=0.25)
        res = granite_check(checkpoints)
    bad = res.first_mismatch
    assert bad is not None and bad.name == "model.layers.0.self_attn.scores", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "attention_scale", bad.hint
    ours, ref = (0.25, 0.0625) if side == "ours" else (0.0625, 0.25)
    assert f"ours scales q k^T by {ours:g}" in bad.hint.text and f"the reference by {ref:g}" in bad.hint.text
    assert "1/sqrt(head_dim=16)" in bad.hint.text and "attention_multiplier" in bad.hint.text, bad.hint


def test_a_cos_sin_table_laid_out_for_the_other_pairing_is_named_on_the_reference():
    """The reference's cos/sin table repeats each frequency per pair (GPT-J's layout) while its pairs are
    the halves (i, i + d/2): each pair then turns by two frequencies, no rotation a fit could read. The
    ours side is the fifth set's Cohere (``rope_cat_freqs``: the other way round)."""
    pair = pair_of("llama3")
    rotary = pair.reference.model.rotary_emb

    def repeated(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = freqs.repeat_interleave(2, dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    rotary.forward = repeated.__get__(rotary)
    hint = located(pair, "model.layers.0.self_attn.q_rot", "rope_pairing")
    assert hint.evidence["reference"][1] == "repeated per pair" and hint.evidence["ours"][1].startswith("concatenated")
