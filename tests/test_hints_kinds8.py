"""Hints the eighth and ninth held-back sets prompted, with the fault on ours and on the reference: a
block run post-norm where the other side runs it pre-norm (read from the order each side produced the
layer's nodes), a dropout left on the residual branch before its add, one term of a norm's input
weighted otherwise (the embedding scaled before the learned positions are added), a bias not scaled
with its weight (``tests/test_heldout8_faults.py`` holds the user models that first showed them)."""

from __future__ import annotations

import pytest
import torch

import parity
from tests.test_hints_either_side import SIDES, pair_of, patch
from tests.test_hints_kinds import side_name


def _post_norm_ours(self, x, cos=None, sin=None, padding_mask=None, cache=None):
    x = self.norm1(x + self.att(x, cos, sin, padding_mask, cache))
    return self.norm2(x + self.ff(x))


def _post_norm_reference(self, hidden_states, *args, **kwargs):
    attn, _ = self.attn(hidden_states, *args, **kwargs)
    hidden_states = self.ln_1(hidden_states + attn)
    return self.ln_2(hidden_states + self.mlp(hidden_states))


@pytest.mark.parametrize("side", SIDES)
def test_a_post_norm_block_is_named_from_the_order_of_its_nodes(side):
    """GPT-2's first block run post-norm (``norm(x + attn(x))``: OPT's ``do_layer_norm_before`` read the
    wrong way round) on one side: the first node that fails (the norm; the projection where the
    reference runs it first) names the side that ran the norm after the attention's output projection."""
    pair = pair_of("gpt2")
    if side == "ours":
        patch(pair.ours.blocks[0], _post_norm_ours)
    else:
        patch(pair.reference.transformer.h[0], _post_norm_reference)
    res = parity.check(pair, mode="chained")
    bad = res.first_mismatch
    # walked in the reference's order: a post-norm reference runs the attention's projection first
    first = "transformer.h.0.ln_1" if side == "ours" else "transformer.h.0.attn.c_attn"
    assert bad is not None and bad.name == first, res.verdict()
    assert bad.hint is not None and bad.hint.kind == "norm_placement", bad.hint
    post = "ours" if side == "ours" else "the reference"
    assert f"{post} runs ln_1 after c_proj" in bad.hint.text, bad.hint
    assert bad.hint.evidence["post_norm"] == ("ours" if side == "ours" else "reference"), bad.hint


@pytest.mark.parametrize("side", SIDES)
def test_a_dropout_on_the_residual_branch_is_named_at_the_norm_after_it(side):
    """GPT-2's attention output dropped out before the residual add (``F.dropout(attn_out, p)`` without
    ``training=``) on one side: the next norm's input is the stream plus the branch masked and scaled
    by 1 / (1 - p), read against the reference's c_proj output."""
    pair = pair_of("gpt2")
    torch.manual_seed(0)

    def dropped(module, args, out):
        return torch.nn.functional.dropout(out, p=0.25, training=True)

    if side == "ours":
        pair.ours.blocks[0].att.register_forward_hook(dropped)
    else:
        pair.reference.transformer.h[0].attn.resid_dropout.p = 0.25
        pair.reference.transformer.h[0].attn.resid_dropout.train()
    res = parity.check(pair, mode="chained")
    bad = res.first_mismatch
    assert bad is not None and bad.name == "transformer.h.0.ln_2@input", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "dropout", bad.hint
    assert "at the branch transformer.h.0.attn.c_proj, before the residual add" in bad.hint.text, bad.hint
    assert bad.hint.evidence["side"] == side_name(side) and abs(bad.hint.evidence["p"] - 0.25) < 1e-6, bad.hint


@pytest.mark.parametrize("side", SIDES)
def test_the_embedding_scaled_before_the_positions_are_added_is_one_term_of_the_sum(side):
    """GPT-2's first norm reading ``sqrt(hidden_size) * wte + wpe`` (fairseq's ``embed_scale`` kept in a
    port whose embeddings agree: the scale applied to the token embedding's output before the learned
    positions are added) on one side: its input is fitted as a sum of the two embeddings on both sides
    and the term weighted otherwise is named with its constant."""
    pair = pair_of("gpt2")
    scale = float(pair.facts.hidden_size) ** 0.5
    model = pair.ours if side == "ours" else pair.reference
    table = model.tok_emb if side == "ours" else model.transformer.wte
    norm = model.blocks[0].norm1 if side == "ours" else model.transformer.h[0].ln_1
    held: dict[str, torch.Tensor] = {}
    table.register_forward_hook(lambda module, args, out: held.update(tokens=out) and None)
    norm.register_forward_pre_hook(lambda module, args: (args[0] + (scale - 1) * held["tokens"],))
    res = parity.check(pair, mode="chained")
    bad = res.first_mismatch
    assert bad is not None and bad.name == "transformer.h.0.ln_1", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "scale", bad.hint
    ours, ref = (f"{scale:.4g} x wte", "1 x wte") if side == "ours" else ("1 x wte", f"{scale:.4g} x wte")
    assert f"ours' input is {ours} + 1 x wpe" in bad.hint.text, bad.hint
    assert f"the reference's {ref} + 1 x wpe" in bad.hint.text, bad.hint
    assert "sqrt(hidden_size" in bad.hint.text, bad.hint
