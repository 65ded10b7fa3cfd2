"""Decode with a user's own KV cache: a cache that holds more than Transformers' (a sliding layer keeping
``window`` tokens, not ``window - 1``) is compared on the positions the reference's attention reads and
noted, not failed; a cache bug still fails with a hint naming it (a call that does not read the cache,
a cache cut too early, weight on a key outside the window, a KV-shared layer handed the cut cache);
a model given no CacheProtocol is driven through its forward's cache argument, or refused in one line.

The user model is tests/user_models/conv_cache_olmo3.py (``past_key_values=`` / ``use_cache=``, its own
``KVCache``; ``CACHE`` shows the cache as held, ``CACHE_AS_TRANSFORMERS`` cut to ``window - 1``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import parity
from parity.cli import main

USER_MODELS = Path(__file__).parent / "user_models"
sys.path.insert(0, str(USER_MODELS))

import conv_cache_olmo3 as conv  # noqa: E402
import kv_olmo3  # noqa: E402

PROTOCOLS = {"as-held": conv.CACHE, "as-transformers": conv.CACHE_AS_TRANSFORMERS, "inferred": None}
PLAN = "12:4x2"  # prefill in 3 chunks of 4 (window 4), then 2 decode steps


def _check(protocol, build=conv.build, plan=PLAN, **kwargs):
    return parity.check_model(build, "olmo3:tiny", decode=plan, cache_protocol=protocol, **kwargs)


def _length_notes(res) -> list[str]:
    return [n for n in res.notes if n.startswith("cache length (not a failure)")]


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_cache_keeping_window_tokens_passes_with_one_note(name):
    res = _check(PROTOCOLS[name], batch_size=2, left_pad=2)
    assert res.passed, res.verdict()
    (note,) = _length_notes(res)
    assert "on sliding_attention layers" in note and "probability 0" in note
    step = {n.name: n for n in res.nodes}
    decode_keys = step["step3/model.layers.0.self_attn.k_rot"]  # a single-token step: 4 held + 1 vs 3 + 1
    assert decode_keys.status == "ok" and (decode_keys.shape_ours[-2], decode_keys.shape_ref[-2]) == (5, 4)
    assert "not compared" in decode_keys.detail
    probs = step["step3/model.layers.0.self_attn.probs"]
    assert probs.status == "ok" and "probability 0" in probs.detail
    cache = step["step3/model.layers.0.self_attn.cache.keys"]
    if name == "as-held":
        assert "ours' cache keeps 4 tokens" in note and "Transformers' 3 (window - 1 = 3)" in note
        assert cache.status == "ok" and (cache.shape_ours[-2], cache.shape_ref[-2]) == (4, 3)
    elif name == "as-transformers":
        assert "ours' attention reads 5 keys" in note and cache.status == "ok" and cache.max_abs == 0
    else:  # KVCache's layers hold .k / .v: a form parity does not guess at
        assert cache.status == "untapped" and "CacheProtocol" in cache.detail
        assert any("driven as Olmo3ForGeneration.forward(past_key_values=, use_cache=True)" in n for n in res.notes)
        assert any("in no form parity reads" in n for n in res.notes)


def test_a_cache_keeping_every_token_masked_passes_with_one_note(monkeypatch):
    def keep_all(self, k, v):
        self.k, self.v = k, v

    monkeypatch.setattr(conv.LayerKV, "store", keep_all)
    res = _check(conv.CACHE)
    assert res.passed, res.verdict()
    (note,) = _length_notes(res)
    assert "ours' cache keeps every token so far on sliding_attention layers, Transformers' 3" in note


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_second_chunk_that_ignores_the_cache_is_cache_not_read(name, monkeypatch):
    monkeypatch.setattr(conv, "BUG", "second_call_ignores_cache")
    bad = _check(PROTOCOLS[name]).first_mismatch
    assert bad.name == "step1/model.layers.0.self_attn.k_rot" and bad.status == "shape"
    assert bad.hint.kind == "cache_not_read", bad.hint_text
    assert bad.hint.evidence["missing"] == [1, 2, 3] and bad.hint.evidence["call"] == [4, 8]
    assert "reads only the call's own 4 keys" in bad.hint.text and "agree" in bad.hint.text


@pytest.mark.parametrize("name", ["as-held", "inferred"])
def test_a_cache_cut_too_early_names_the_missing_position(name, monkeypatch):
    """window - 2 tokens kept: with the cache read, its node after the first chunk lacks position 1;
    with a cache parity does not read, the next chunk's keys lack it."""
    monkeypatch.setattr(conv, "BUG", "window_cache_cut_early")
    bad = _check(PROTOCOLS[name]).first_mismatch
    where = "step0/model.layers.0.self_attn.cache.keys" if name == "as-held" else "step1/model.layers.0.self_attn.k_rot"
    assert bad.name == where and bad.status == "shape"
    assert bad.hint.kind == "cache_length" and bad.hint.evidence["missing"] == [1], bad.hint_text
    assert "position 1" in bad.hint.text


def _wider_window(state_dict, hf_config):
    model = conv.build(state_dict, hf_config)
    for block in model.h:
        if block.attn.window:
            block.attn.window += 1  # a query sees one key more than the window
    return model


def test_weight_on_a_held_key_outside_the_window_fails_at_probs():
    """The extra key ours holds must get no weight: its probability is compared with 0."""
    bad = _check(conv.CACHE, build=_wider_window).first_mismatch
    assert bad.name == "step1/model.layers.0.self_attn.probs" and bad.status == "mismatch"
    assert bad.hint.kind == "sliding_window" and bad.hint.evidence["positions"] == [0], bad.hint_text


def test_the_reference_cache_cut_short_is_not_hidden(monkeypatch):
    """The same cut placed on the reference's side (its sliding layers keep window - 2): ours, correct and
    holding more, gives weight to a key the reference dropped; found at that step's probabilities."""
    from transformers import cache_utils

    layer = cache_utils.DynamicSlidingWindowLayer

    def update(self, keys, values, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.cumulative_length += keys.shape[-2]
        keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.keys, self.values = keys[:, :, -(self.sliding_window - 2) :], values[:, :, -(self.sliding_window - 2) :]
        return keys, values

    def get_mask_sizes(self, query_length, *args, **kwargs):
        held = min(self.cumulative_length, self.sliding_window - 2)
        return held + query_length, self.cumulative_length - held

    monkeypatch.setattr(layer, "update", update)
    monkeypatch.setattr(layer, "get_mask_sizes", get_mask_sizes)
    bad = _check(conv.CACHE).first_mismatch
    assert bad.name == "step1/model.layers.0.self_attn.probs"
    assert bad.hint.kind == "cache_length" and bad.hint.evidence["reference_held"] == 2, bad.hint_text
    assert "the reference's cache cut short" in bad.hint.text


# --- a KV-shared layer (Gemma 4's family model, its cache keeping window tokens) ---------------------


def _window_keeping_gemma4(monkeypatch):
    from parity.run.decode import DEFAULT_PROTOCOL
    from reference_pairs.common.cache import CacheLayer
    from reference_pairs.gemma4 import build_pair

    def keep(self, keys, values):
        n = keys.shape[-2] if self.window is None else min(keys.shape[-2], self.window)
        self.keys, self.values = keys[:, :, keys.shape[-2] - n :], values[:, :, values.shape[-2] - n :]

    monkeypatch.setattr(CacheLayer, "keep", keep)
    pair = build_pair("tiny")
    pair.cache_protocol = DEFAULT_PROTOCOL  # given: a user's cache, compared on what attention reads
    return pair


def test_a_kv_shared_layer_handed_its_source_cache_after_the_cut_fails(monkeypatch):
    from reference_pairs.common.attention import GroupedQueryAttention

    pair = _window_keeping_gemma4(monkeypatch)
    # not bit-exact: ours' softmax runs over the window's keys only, the reference's over every key with the
    # rest masked, and the sums' order then follows the CPU's vector width (equal with AVX-512, 1 ulp apart
    # with AVX2 only: an AMD EPYC 7xx3 without AVX-512, 2026-12-02)
    assert parity.check(pair, decode="12:4x2", exact=False).passed
    forward = GroupedQueryAttention.forward

    def hand_on_the_cut_cache(self, x, cos=None, sin=None, padding_mask=None, cache=None, shared_kv=None):
        out = forward(self, x, cos, sin, padding_mask, cache, shared_kv)
        if self.kv is not None and cache is not None:
            self.kv = (cache.keys, cache.values, cache.seen - cache.held)
        return out

    monkeypatch.setattr(GroupedQueryAttention, "forward", hand_on_the_cut_cache)
    bad = parity.check(_window_keeping_gemma4(monkeypatch), decode="12:6x2").first_mismatch
    assert bad.name == "step0/model.layers.3.self_attn.k_rot" and bad.status == "shape"
    assert bad.hint.kind == "cache_length" and bad.hint.evidence["missing"] == [0, 1], bad.hint_text
    assert bad.hint.evidence["kv_source"] == 1 and "handed on from layer 1" in bad.hint.text


def test_a_family_cache_of_another_length_still_fails():
    """A family's own cache is written with Transformers' semantics: any other length is its bug."""
    from reference_pairs.common import faults
    from reference_pairs.olmo3 import build_pair

    pair = build_pair("tiny")
    faults.sliding_cache_trimmed_as_if_one_token(pair)
    bad = parity.check(pair, decode="12:4x2").first_mismatch
    assert bad.name == "step0/model.layers.0.self_attn.cache.keys" and bad.hint.kind == "cache_length"


# --- no CacheProtocol: the forward's cache argument, or one line naming what to write -----------------


class _LegacyPast(nn.Module):
    """The same model behind Transformers' legacy form: ``past_key_values`` a tuple of per-layer
    ``(keys, values)``, returned as ``(logits, past)`` with ``use_cache=True``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        cache = self.inner.new_cache()
        if past_key_values is not None:
            for held, (keys, values) in zip(cache.layers, past_key_values):
                held.k, held.v = keys, values
            cache.seen = max(keys.shape[2] for keys, _ in past_key_values)  # full layers hold every token
        logits, cache = self.inner(input_ids, attention_mask, past_key_values=cache, use_cache=True)
        return (logits, tuple((held.k, held.v) for held in cache.layers)) if use_cache else logits


def test_legacy_tuple_past_key_values_are_driven_and_their_caches_compared():
    res = _check(None, build=lambda sd, cfg: _LegacyPast(conv.build(sd, cfg)))
    assert res.passed, res.verdict()
    caches = [n for n in res.nodes if n.kind == "cache.keys"]
    assert caches and all(n.status == "ok" for n in caches)
    assert "ours' cache keeps 4 tokens" in _length_notes(res)[0]


def test_a_ring_buffer_with_cache_argument_is_driven_without_a_protocol():
    """kv_olmo3: new_cache() and forward(cache=, position_ids=); its ring buffer is not read (untapped)."""
    res = parity.check_model(kv_olmo3.build, "olmo3:tiny", decode="12:6x2", batch_size=2, left_pad=2)
    assert res.passed, res.verdict()
    assert {n.status for n in res.nodes if n.kind.startswith("cache.")} == {"untapped"}


def test_cli_decode_of_a_user_model_without_a_protocol(tmp_path, capsys):
    spec = f"{USER_MODELS / 'conv_cache_olmo3.py'}:build"
    argv = ["check", "--ours", spec, "--reference", "olmo3:tiny", "--decode", PLAN, "--report-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cache length (not a failure)" in out and "past_key_values=" in out


MODELS = """
import sys
sys.path.insert(0, {folder!r})
import conv_cache_olmo3 as conv


class Inside(conv.Olmo3ForGeneration):
    def forward(self, input_ids, attention_mask=None, use_cache=False):  # the cache kept inside
        return super().forward(input_ids, attention_mask)


class NoCache(conv.Olmo3ForGeneration):
    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, attention_mask)


def _as(cls):
    def build(state_dict, hf_config):
        model = conv.build(state_dict, hf_config)
        model.__class__ = cls
        return model
    return build


inside = _as(Inside)
no_cache = _as(NoCache)
"""


@pytest.mark.parametrize(
    "function, message",
    [
        ("inside", "Inside.forward takes use_cache= but no cache argument"),
        ("no_cache", "NoCache.forward takes no cache argument"),
    ],
)
def test_cli_decode_of_a_cache_parity_cannot_drive_is_one_line(function, message, tmp_path, capsys):
    module = tmp_path / "own_cache_models.py"
    module.write_text(MODELS.format(folder=str(USER_MODELS)))
    argv = ["check", "--ours", f"{module}:{function}", "--reference", "olmo3:tiny", "--decode", PLAN]
    assert main([*argv, "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "parity.CacheProtocol(" in err, err
