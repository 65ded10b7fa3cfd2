"""The RoPE functions :mod:`parity.diagnose.rope_pairs` puts in place of a reference's: the same rotation over the
other pairs, checked against Transformers' own functions of each convention."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.llama import modeling_llama

from parity.diagnose import rope_pairs


def _tables(seq: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' ``cat(freqs, freqs)`` tables ``(batch, seq, d)``."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(seq).float()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)[None]
    return emb.cos(), emb.sin()


def test_half_split_read_as_interleaved_is_deepseeks_rotation_of_the_interleaved_layout():
    """Llama's half-split function replaced: each pair (2i, 2i + 1) turned by frequency i, which is DeepSeek's
    interleaved rotation (its output de-interleaved, so compared after interleaving it back)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    cos, sin = _tables(5, 8)
    replacement, words = rope_pairs.other_pairs("apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    assert words == "RoPE's pairs read interleaved (2i, 2i + 1) in place of half-split (i, i + d/2)"
    got_q, got_k = replacement(q, k, cos, sin)
    want_q, want_k = modeling_deepseek_v32.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    interleave = lambda t: torch.stack([t[..., :4], t[..., 4:]], -1).flatten(-2)  # back to (2i, 2i + 1)
    assert torch.allclose(got_q, interleave(want_q), atol=1e-6) and torch.allclose(got_k, interleave(want_k), atol=1e-6)
    assert not torch.allclose(got_q, modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)[0], atol=1e-3)


def test_interleaved_read_as_half_split_is_llamas_rotation_and_dims_past_the_table_pass_through():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 6, 10, generator=g), torch.randn(1, 2, 6, 10, generator=g)
    cos, sin = _tables(6, 8)  # partial rotary: the last 2 dims pass through
    replacement, words = rope_pairs.other_pairs(
        "apply_rotary_pos_emb_interleave", modeling_deepseek_v32.apply_rotary_pos_emb_interleave
    )
    assert words.startswith("RoPE's pairs read half-split (i, i + d/2) in place of interleaved")
    got_q, _ = replacement(q, k, cos, sin)
    want_q, _ = modeling_llama.apply_rotary_pos_emb(q[..., :8], k[..., :8], cos, sin)
    assert torch.allclose(got_q[..., :8], want_q, atol=1e-6) and torch.equal(got_q[..., 8:], q[..., 8:])


def test_the_functions_a_blocks_modeling_code_calls_by_that_name_are_found():
    block = modeling_deepseek_v32.DeepseekV32Attention.__new__(modeling_deepseek_v32.DeepseekV32Attention)
    names = [name for _, name, _ in rope_pairs.rope_functions(block)]
    assert names == ["apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"]
