"""Hints the seventh held-back set prompted, with the fault on ours and on the reference where the
reference can hold it: a norm's weight offset read from both outputs (``2 + w``: the 1 added twice), an
element-wise activation outside every known one read back at a few points, and a partial-rotary cos/sin
table built for the whole head and cut to the rotary dims (``tests/test_heldout7_faults.py`` holds the
user models that first showed them; the MoE sum's detectors read ours' stacked experts, a layout the
reference never has)."""

from __future__ import annotations

import pytest
import torch

import parity
from tests.test_heldout7_faults import MODELS, checkpoints  # noqa: F401 (the Phi checkpoint fixture)
from tests.test_hints_either_side import SIDES, eps_of, located, pair_of
from tests.test_hints_kinds import side_name


@pytest.mark.parametrize("side", SIDES)
def test_a_norm_scaling_by_two_plus_w_is_the_weight_offset_on_its_side(side):
    """Gemma 3's RMSNorm scales by ``1 + w``; one side adds the 1 again (a loader that folded it into the
    weight, and a forward that adds it): both offsets are read from the two outputs."""
    pair = pair_of("gemma3")
    norm = pair.ours.blocks[0].input_layernorm if side == "ours" else pair.reference.model.layers[0].input_layernorm
    eps = eps_of(norm)

    def twice(self, x):
        h = x.float()
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (y * (2.0 + self.weight.float())).to(x.dtype)

    norm.forward = twice.__get__(norm)
    hint = located(pair, "model.layers.0.input_layernorm", "norm_weight_offset")
    ours, ref = ("2 + w", "1 + w") if side == "ours" else ("1 + w", "2 + w")
    assert f"ours multiplies by {ours}" in hint.text and f"the reference by {ref}" in hint.text, hint
    assert hint.evidence["side"] == side_name(side), hint


@pytest.mark.parametrize("side", SIDES)
def test_an_activation_outside_the_known_ones_is_read_back_at_points(side):
    """GPT-2's MLP with ``x * sigmoid(1.5 x)`` (no activation Transformers names) on one side: the
    projection's input after it fails, read as a function of c_fc's output on both sides, and the two
    functions are shown at a few points."""
    pair = pair_of("gpt2")

    class Swish15(torch.nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(1.5 * x)

    if side == "ours":
        pair.ours.blocks[0].ff.act = Swish15()
    else:
        pair.reference.transformer.h[0].mlp.act = Swish15()
    res = parity.check(pair, mode="chained")
    bad = res.first_mismatch
    assert bad is not None and bad.name == "transformer.h.0.mlp.c_proj@input", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "activation", bad.hint
    swish_at_one = f"{torch.sigmoid(torch.tensor(1.5)).item():.3g}"  # 0.818; gelu_new(1) is 0.841
    if side == "ours":
        text = "ours is another element-wise function of the reference's transformer.h.0.mlp.c_fc than the reference's gelu_new"
        assert text in bad.hint.text, bad.hint
        ours_values, ref_values = bad.hint.text.split("ours gives ")[1].split(", the reference ")
        assert swish_at_one in ours_values and "0.841" in ref_values, bad.hint
    else:
        text = (
            "ours equals gelu_new (tanh approximation, op by op) of the reference's transformer.h.0.mlp.c_fc, the "
            "reference another function (at x = "
        )
        assert text in bad.hint.text, bad.hint
        assert swish_at_one in bad.hint.text.split("it gives ")[1], bad.hint


def test_a_rope_table_cut_from_the_whole_head_is_named_on_the_reference(checkpoints, monkeypatch):  # noqa: F811
    """Phi's partial rotary (8 of 16 dims) with the reference's cos/sin table built from the whole head's
    frequencies theta^(-2i/16) and cut to the rotary dims: each pair then turns by two frequencies, no
    single rotation. The ours side is the seventh set's Nemotron (``cos_sliced_from_full``)."""
    from transformers.models.phi import modeling_phi

    def cut_from_whole_head(self, x, position_ids):
        head_dim = 2 * self.inv_freq.numel() * 2  # partial_rotary_factor 0.5
        inv = 1.0 / (20000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)[..., : head_dim // 2]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(modeling_phi.PhiRotaryEmbedding, "forward", cut_from_whole_head)
    MODELS["phi"].BUG = ""
    res = parity.check_model(MODELS["phi"].build, reference=str(checkpoints["phi"]), seq_len=24, mode="chained")
    bad = res.first_mismatch
    assert bad is not None and bad.name == "model.layers.0.self_attn.q_rot", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "rope_pairing", bad.hint
    assert "built for the whole head" in bad.hint.evidence["reference"][1], bad.hint
    assert bad.hint.evidence["ours"][1].startswith("concatenated"), bad.hint
