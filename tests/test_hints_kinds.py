"""Hints for the kinds a second held-back set left unnamed, each with the fault on ours and on the
reference (a patched module or function of the family pair), in chained and isolated mode.

The user models that first showed each kind are in ``tests/test_heldout2_faults.py`` (``NAMED``);
here each detector is held to its kind on another model, from either side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_hints_either_side import SIDES, located, pair_of, patch


def side_name(side: str) -> str:
    return "ours" if side == "ours" else "the reference"


def softmax_patched(monkeypatch, side: str, fn) -> None:
    """``fn(x, dim)`` in place of the softmax on one side: ours calls ``torch.softmax``, Transformers'
    eager attention ``nn.functional.softmax``. The function capture's list of softmaxes is read when
    it is imported: imported first, with the real ones."""
    import parity.record.functional  # noqa: F401

    real = F.softmax

    def patched(x, dim=None, **k):
        dtype = k.pop("dtype", None)
        out = fn(x.to(dtype) if dtype is not None else x, dim, real)
        return out

    if side == "ours":
        monkeypatch.setattr(torch, "softmax", lambda x, dim=None, **k: patched(x, dim, **k))
    else:
        monkeypatch.setattr(F, "softmax", patched)


@pytest.mark.parametrize("side", SIDES)
def test_an_off_by_one_softmax_is_softmax_sink(side, monkeypatch):
    def plus_one(x, dim, real):
        if x.dim() != 4:
            return real(x, dim=dim)
        m = x.amax(dim, keepdim=True)
        e = torch.exp(x - m)
        return e / (e.sum(dim, keepdim=True) + torch.exp(-m))

    softmax_patched(monkeypatch, side, plus_one)
    hint = located(pair_of("llama3"), "model.layers.0.self_attn.probs", "softmax_sink")
    assert hint.evidence["side"] == side_name(side)
    assert hint.evidence["sink_logit"] == 0.0 and "off-by-one" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_a_window_mask_filled_with_zero_is_the_window_mask_with_its_fill_value(side, monkeypatch):
    """Keys before Mistral's window (5) get the score 0 instead of the dtype's lowest value."""

    def zero_filled(x, dim, real):
        if x.dim() == 4:
            q, k = torch.arange(x.shape[-2])[:, None], torch.arange(x.shape[-1])[None, :]
            x = torch.where((x < -1e30) & (k <= q), torch.zeros_like(x), x)
        return real(x, dim=dim)

    softmax_patched(monkeypatch, side, zero_filled)
    hint = located(pair_of("mistral"), "model.layers.0.self_attn.probs", "sliding_window")
    assert hint.evidence["side"] == side_name(side) and hint.evidence["fill_value"] == 0.0


@pytest.mark.parametrize("side", SIDES)
def test_a_softmax_in_float16_is_precision(side, monkeypatch):
    def half(x, dim, real):
        return real(x.to(torch.float16), dim=dim).to(x.dtype)

    softmax_patched(monkeypatch, side, half)
    pair = pair_of("mistral")
    import parity

    bad = parity.check(pair).first_mismatch
    assert bad is not None and bad.name == "model.layers.0.self_attn.probs"
    assert bad.hint is not None and bad.hint.kind == "precision", bad.hint
    assert bad.hint.evidence == {"side": side_name(side), "dtype": "float16"}


def rope_patched(monkeypatch, pair, side: str, change) -> None:
    """``change(q_or_k, cos, sin) -> (q_or_k, cos, sin)`` before the rotation on one side (ours'
    attention rotate method, Transformers' ``apply_rotary_pos_emb`` of the Llama module)."""
    if side == "ours":
        for block in pair.ours.blocks:
            att = block.att
            real = att.rotate

            def rotate(t, cos, sin, _real=real, **rope):
                return _real(*change(t, cos, sin), **rope)

            att.rotate = rotate
        return
    from transformers.models.llama import modeling_llama

    real = modeling_llama.apply_rotary_pos_emb

    def apply(q, k, cos, sin, *a, **kw):
        q, cq, sq = change(q, cos, sin)
        k, ck, sk = change(k, cos, sin)
        return real(q, k, cq, sq, *a, **kw)[0], real(k, k, ck, sk, *a, **kw)[0]

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply)


@pytest.mark.parametrize("side", SIDES)
def test_cos_and_sin_swapped_is_rope_rotation(side, monkeypatch):
    pair = pair_of("llama3")
    rope_patched(monkeypatch, pair, side, lambda t, cos, sin: (t, sin, cos))
    hint = located(pair, "model.layers.0.self_attn.q_rot", "rope_rotation")
    assert hint.evidence["side"] == side_name(side) and "cos and sin swapped" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_q_split_into_heads_without_the_transpose_is_head_layout(side, monkeypatch):
    """q viewed (batch, heads, seq, head_dim) straight from (batch, seq, heads * head_dim)."""
    pair = pair_of("llama3")

    def unmoved(t, cos, sin):
        b, h, s, d = t.shape
        return t.transpose(1, 2).reshape(b, s, h * d).reshape(b, h, s, d), cos, sin

    rope_patched(monkeypatch, pair, side, unmoved)
    hint = located(pair, "model.layers.0.self_attn.q_rot", "head_layout")
    assert hint.evidence == {"side": side_name(side), "node": "q_rot"}


@pytest.mark.parametrize("side", SIDES)
def test_token_ids_shifted_by_one_is_token_ids(side):
    pair = pair_of("llama3")
    emb = pair.ours.tok_emb if side == "ours" else pair.reference.model.embed_tokens
    real, vocab = emb.forward, emb.weight.shape[0]
    emb.forward = lambda ids: real((ids + 1) % vocab)
    hint = located(pair, "model.embed_tokens", "token_ids")
    assert hint.evidence["side"] == side_name(side)
    assert [(i + 1) % vocab for i in hint.evidence["ids"]] == hint.evidence["rows_read"]


class Reversed(nn.ModuleList):
    """A layer list that iterates (and slices) in reverse while its modules keep their names."""

    def __iter__(self):
        return iter(list(self._modules.values())[::-1])

    def __getitem__(self, idx):
        return list(self._modules.values())[idx][::-1] if isinstance(idx, slice) else super().__getitem__(idx)


@pytest.mark.parametrize("side", SIDES)
def test_layers_run_in_reverse_is_execution_order(side):
    pair = pair_of("llama3")
    owner = pair.ours if side == "ours" else pair.reference.model
    attr = "blocks" if side == "ours" else "layers"
    setattr(owner, attr, Reversed(list(getattr(owner, attr))))
    # the reference's execution order is the order nodes are judged in: reversed there, layer 1 comes first
    first = "model.layers.0.input_layernorm" if side == "ours" else "model.layers.1.input_layernorm"
    hint = located(pair, first, "execution_order")
    order = hint.evidence["ours"] if side == "ours" else hint.evidence["reference"]
    assert order == [1, 0]


def statistic(kind: str):
    """An RMSNorm forward computing another statistic (``kind``) with the module's own weight."""

    def forward(self, x):
        h = x.float()
        eps = getattr(self, "eps", None) or self.variance_epsilon
        if kind == "sequence":
            h = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + eps)
        else:  # sqrt(|mean|): the mean, not the mean of squares
            h = h / (h.mean(-1, keepdim=True).abs() + eps).sqrt()
        return (self.weight * h).to(x.dtype)

    return forward


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(("kind", "says"), [("sequence", "sequence axis"), ("mean", "sqrt(|mean(x)|)")])
def test_a_norm_computing_another_statistic_is_named(side, kind, says):
    pair = pair_of("llama3")
    norm = pair.ours.blocks[0].norm1 if side == "ours" else pair.reference.model.layers[0].input_layernorm
    patch(norm, statistic(kind))
    hint = located(pair, "model.layers.0.input_layernorm", "norm_kind")
    assert says in hint.evidence["ours" if side == "ours" else "reference"]


@pytest.mark.parametrize("side", SIDES)
def test_a_layernorm_adding_its_bias_before_the_weight_is_bias(side):
    pair = pair_of("gpt2")
    norm = pair.ours.blocks[0].norm1 if side == "ours" else pair.reference.transformer.h[0].ln_1

    def bias_first(self, x):
        h = F.layer_norm(x, x.shape[-1:], eps=getattr(self, "eps", 1e-5))
        return (h + self.bias) * self.weight

    patch(norm, bias_first)
    hint = located(pair, "transformer.h.0.ln_1", "bias")
    assert f"{side_name(side)} adds the bias before the weight" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_dropout_left_on_after_o_proj_is_dropout(side):
    pair = pair_of("llama3")
    proj = pair.ours.blocks[0].att.out_proj if side == "ours" else pair.reference.model.layers[0].self_attn.o_proj
    real = proj.forward
    generator = torch.Generator().manual_seed(0)

    def dropped(x):
        y = real(x)
        keep = torch.rand(y.shape, generator=generator) >= 0.1
        return y * keep / 0.9

    proj.forward = dropped
    hint = located(pair, "model.layers.0.self_attn.o_proj", "dropout")
    assert hint.evidence["side"] == side_name(side) and abs(hint.evidence["p"] - 0.1) < 1e-3


def test_a_padding_mask_not_applied_in_ours_is_padding():
    """Ours runs a left-padded batch without its attention_mask (positions still passed)."""
    import parity

    pair = pair_of("llama3")
    forward = pair.ours.forward

    def unmasked(*a, attention_mask=None, **k):
        return forward(*a, attention_mask=None, **k)

    pair.ours.forward = unmasked
    res = parity.check(pair, batch_size=2, left_pad=5, mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad is not None and bad.name == "model.layers.0.self_attn.probs", res.verdict()
        assert bad.hint is not None and bad.hint.kind == "padding", bad.hint
        assert bad.hint.evidence["side"] == "ours" and "not applied" in bad.hint.text


@pytest.mark.parametrize("side", SIDES)
def test_a_padding_mask_filled_with_zero_is_padding_with_its_fill_value(side, monkeypatch):
    """The padding keys (the first 5 of batch row 0, the padded one) get the score 0 instead of the lowest
    value."""
    import parity

    def zero_filled(x, dim, real):
        if x.dim() == 4 and x.shape[0] == 2:
            q, k = torch.arange(x.shape[-2])[:, None], torch.arange(x.shape[-1])[None, :]
            pad = torch.zeros_like(x, dtype=torch.bool)
            pad[0] = (k < 5) & (q >= 5) & (k <= q)
            x = torch.where(pad & (x < -1e30), torch.zeros_like(x), x)
        return real(x, dim=dim)

    softmax_patched(monkeypatch, side, zero_filled)
    res = parity.check(pair_of("llama3"), batch_size=2, left_pad=5, mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad is not None and bad.name == "model.layers.0.self_attn.probs", res.verdict()
        assert bad.hint is not None and bad.hint.kind == "padding", bad.hint
        assert bad.hint.evidence["side"] == side_name(side) and bad.hint.evidence["fill_value"] == 0.0
