"""Hints the eleventh held-back set prompted, each read with the fault on ours and on the reference where
both sides can hold it (the user models that first showed them, ``tests/test_heldout11_faults.py``, run
the fault on ours only): a sinusoid position table of another convention, a norm's statistic taken over
the whole projection output it was cut from, an attention parity could not read in ours judged at its
output projection (its temperature fitted, else the attention named), and values zero-padded per head."""

from __future__ import annotations

import math

import pytest
import torch

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.attention_refit import unread_attention
from parity.diagnose.detectors import diagnose
from parity.diagnose.embeddings import position_term
from parity.diagnose.evidence import Evidence
from parity.diagnose.norms import norm_statistic
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
STEM = "model.layers.0.self_attn"
T, D = 12, 32


def _evidence(name, ours, ref, ours_trace, ref_trace, facts, positions=None) -> Evidence:
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts, positions)


def _sinusoids(positions: torch.Tensor, dim: int, cos_first: bool = False) -> torch.Tensor:
    """fairseq's table (XGLM's): ``[sin | cos]`` of ``p * exp(-i log(10000) / (half - 1))``."""
    half = dim // 2
    angle = positions.double()[..., None] * torch.exp(torch.arange(half) * -(math.log(10000) / (half - 1)))
    parts = (angle.cos(), angle.sin()) if cos_first else (angle.sin(), angle.cos())
    return torch.cat(parts, -1).float()


@pytest.mark.parametrize("side", SIDES)
def test_a_sinusoid_table_laid_cos_first_names_the_side_that_lays_it(side):
    """XGLM's first layer reads the scaled token embedding plus sinusoids at position + 2; one side lays
    the table's halves cos|sin. The side whose term fits the other's formula is the subject."""
    from transformers import XGLMConfig

    facts = derive_facts(XGLMConfig(vocab_size=64, d_model=D, num_layers=1, attention_heads=4, ffn_dim=64))
    name = "model.layers.0.self_attn_layer_norm"
    positions = torch.arange(T)[None]
    embed = torch.randn(1, T, D, generator=torch.Generator().manual_seed(0))
    correct, faulty = embed + _sinusoids(positions + 2, D), embed + _sinusoids(positions + 2, D, cos_first=True)
    x_ours, x_ref = (faulty, correct) if side == "ours" else (correct, faulty)
    norm = lambda x: torch.nn.functional.layer_norm(x, (D,))
    ref_trace = Trace(tensors={facts.embed_module: embed, name: norm(x_ref)}, inputs={name: x_ref})
    ours_trace = Trace(tensors={name: norm(x_ours)}, inputs={name: x_ours})
    e = _evidence(name, norm(x_ours), norm(x_ref), ours_trace, ref_trace, facts, positions)
    hint = position_term(e)
    assert hint is not None and hint.kind == "position_offset", hint
    assert f"the position embedding in {side}" in hint.text, hint
    laid = "cos|sin where ours lays them sin|cos" if side == "the reference" else "cos|sin where the reference"
    assert f"its halves laid {laid}" in hint.text, hint


@pytest.mark.parametrize("side", SIDES)
def test_a_norm_statistic_over_the_whole_projection_it_was_cut_from(side):
    """DeepSeek's kv_a_layernorm normalises the latent (the first 32 of kv_a_proj_with_mqa's 40 outputs);
    one side takes the RMS over all 40 (normed before the split). Once read as "a normalisation applied on
    one side only"."""
    from transformers import DeepseekV3Config

    facts = derive_facts(
        DeepseekV3Config(
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    full = torch.randn(1, T, 40, generator=g)
    latent, w = full[..., :32], 1 + 0.5 * torch.randn(32, generator=g)
    eps = facts.norm_eps or 1e-6
    correct = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * w
    faulty = latent * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + eps) * w
    name = f"{STEM}.kv_a_layernorm"
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    ref_trace = Trace(
        tensors={f"{STEM}.kv_a_proj_with_mqa[0:32]": latent, f"{STEM}.kv_a_proj_with_mqa[32:40]": full[..., 32:]},
        inputs={name: latent},
        weights={name: w},
    )
    e = _evidence(name, ours, ref, Trace(tensors={name: ours}, inputs={name: latent}), ref_trace, facts)
    hint = norm_statistic(e)
    assert hint is not None and hint.kind == "norm_kind", hint
    whole = f"the RMS over all of {STEM}.kv_a_proj_with_mqa's output (40 features"
    assert hint.evidence["ours" if side == "ours" else "reference"].startswith(whole), hint


def _attention(scale: float, seed: int = 2, b: int = 1, h: int = 4, d: int = 8):
    """The reference's traced scores (scaled, before the mask), probabilities and context of one causal
    attention block, and the context the same q, k, v give at ``scale`` times the reference's scale."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def context(c: float) -> torch.Tensor:
        probs = torch.softmax((c * scores).masked_fill(~causal, float("-inf")), -1)
        return (probs @ v).transpose(1, 2).reshape(b, T, h * d), probs

    ctx, probs = context(1.0)
    return scores, probs, ctx, context(scale)[0]


def _unread(ours_ctx: torch.Tensor, scores, probs, ref_ctx) -> Evidence:
    """The evidence at o_proj where parity read none of ours' attention internals (only its context,
    the projection's input, is held) and the reference's were all traced."""
    from transformers import LlamaConfig

    facts = derive_facts(
        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    name, w = f"{STEM}.o_proj", torch.randn(32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ours_out, ref_out = ours_ctx @ w.T, ref_ctx @ w.T
    ref_trace = Trace(
        tensors={f"{STEM}.scores": scores, f"{STEM}.probs": probs, f"{STEM}.context": ref_ctx, name: ref_out},
        inputs={name: ref_ctx},
    )
    ours_trace = Trace(tensors={name: ours_out}, inputs={name: ours_ctx})
    return _evidence(name, ours_out, ref_out, ours_trace, ref_trace, facts)


@pytest.mark.parametrize("side", SIDES)
def test_the_temperature_of_an_attention_parity_could_not_read(side):
    """DeepSeek's weight-absorbed MLA (q @ W_UK against the latent) leaves no q, k or scores to read; its
    scale from the latent's width (1/sqrt(40) for 1/sqrt(24)) shows at o_proj only. The factor is fitted
    from the reference's own scores and the values its probabilities and context imply; with the fault on
    the reference, ours' context is the reference's attention at the reciprocal factor."""
    scores, probs, ref_ctx, scaled = _attention(0.774597)
    if side == "ours":
        e, factor = _unread(scaled, scores, probs, ref_ctx), 0.774597
    else:  # the reference attends at the faulty scale; ours at the formula's
        faulty_scores = scores * 0.774597
        faulty_probs = torch.softmax(faulty_scores.masked_fill(probs == 0, float("-inf")), -1)
        e, factor = _unread(ref_ctx, faulty_scores, faulty_probs, scaled), 1 / 0.774597
    hint = unread_attention(e)
    assert hint is not None and hint.kind == "attention_scale", hint
    assert abs(hint.evidence["factor"] / factor - 1) < 1e-4, hint


def test_an_attention_parity_could_not_read_that_differs_otherwise_is_named_as_the_component():
    """Keys and values taken from the latent before its norm: no temperature explains ours' context, so
    the attention itself is named (every projection feeding it agrees), not a wrong cause."""
    scores, probs, ref_ctx, _ = _attention(1.0)
    other = _attention(1.0, seed=9)[2]
    hint = unread_attention(_unread(other, scores, probs, ref_ctx))
    assert hint is not None and hint.kind == "attention_internals", hint
    assert f"the context {STEM}.o_proj reads" in hint.text, hint


def test_values_zero_padded_per_head_are_named_with_the_end_they_sit_at():
    """v padded with zeros to q/k's head dim (24 for 16) for a kernel: ours' context is wider, each head's
    first 16 the reference's. (Only ours can hold it: the reference's context has its config's shape.)"""
    from transformers import LlamaConfig

    facts = derive_facts(
        LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    ref = torch.randn(1, T, 4, 16, generator=torch.Generator().manual_seed(4))
    ours = torch.cat([ref, torch.zeros(1, T, 4, 8)], -1).flatten(-2)
    ref = ref.flatten(-2)
    name = f"{STEM}.context"
    result = compare_node(NodeSpec(name, name, layer=0, kind="context"), 0, ours, ref, Tolerances())
    hint = diagnose(result, Trace(tensors={name: ours}), Trace(tensors={name: ref}), facts)
    assert hint is not None and hint.kind == "shape", hint
    assert "per head, ours' first 16 are the reference's and the other 8 are zeros" in hint.text, hint
    assert hint.evidence == {"padded_to": 24, "head_dim": 16, "values_at": "first"}
