"""KV-cache parity: prefill (whole or chunked), decode steps, sliding caches and padding, compared node
by node and cache by cache at every step; the cached faults located at the right step and node."""

from __future__ import annotations

import types

import pytest
import torch

import parity
from parity.cli import main
from parity.run.decode import DecodePlan
from reference_pairs.common import faults as common_faults
from reference_pairs.llama3 import build_pair as llama3_pair
from reference_pairs.olmo3 import build_pair as olmo3_pair
from reference_pairs.qwen3_5 import build_pair as qwen3_5_pair
from reference_pairs.tiny_aya import build_pair as tiny_aya_pair

PAIRS = {
    "olmo3:yarn": (olmo3_pair, "yarn"),
    "tiny_aya": (tiny_aya_pair, "tiny"),
    "llama3": (llama3_pair, "tiny"),
    "qwen3_5": (qwen3_5_pair, "tiny"),
}  # qwen3_5: Gated DeltaNet layers, their cache compared too (test_qwen3_5.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", PAIRS)
def test_clean_decode_is_bit_exact_with_chunks_steps_and_left_padding(name, dtype):
    build, config = PAIRS[name]
    res = parity.check(build(config, dtype=dtype), decode="10:4x3", batch_size=3, left_pad=3)
    assert res.passed, res.verdict()
    assert all(n.max_abs == 0 for n in res.nodes)  # exact: every node at every step, both caches
    steps = {n.name.split("/", 1)[0] for n in res.nodes}
    assert steps == {f"step{k}" for k in range(3 + 3)}
    assert any(n.kind == "cache.keys" for n in res.nodes) and res.decode["first_divergent_step"] is None


@pytest.mark.parametrize("chunk", [3, 6], ids=["chunks-smaller-than-the-window", "chunks-larger-than-the-window"])
def test_chunked_prefill_around_the_window(chunk):
    pair = olmo3_pair("tiny")  # window 4
    res = parity.check(pair, decode=f"12:{chunk}x3")
    assert res.passed, res.verdict()
    sliding = [n for n in res.nodes if n.name.startswith("step0/model.layers.0.self_attn.cache.keys")]
    assert sliding and sliding[0].shape_ref[-2] == min(chunk, 3)  # a sliding layer keeps window - 1 tokens


def test_plan_parsing_and_schedule():
    plan = DecodePlan.parse("12:4x8")
    assert (plan.prefill, plan.chunk, plan.steps) == (12, 4, 8)
    assert plan.schedule()[:4] == [(0, 4), (4, 8), (8, 12), (12, 13)] and len(plan.schedule()) == 11
    assert DecodePlan.parse("16x2").schedule() == [(0, 16), (16, 17), (17, 18)]
    with pytest.raises(parity.ParityError, match="PREFILL"):
        DecodePlan.parse("12x")


def test_f11_sliding_cache_not_trimmed_for_a_chunk():
    pair = olmo3_pair("tiny")
    common_faults.sliding_cache_trimmed_as_if_one_token(pair)
    bad = parity.check(pair, decode="12:4x4").first_mismatch
    assert bad.name == "step0/model.layers.0.self_attn.cache.keys" and bad.status == "shape"
    assert bad.hint.kind == "cache_length" and "window - 1 = 3" in bad.hint.text


def test_cache_position_off_by_one_in_upper_layers_is_found_at_step_1_layer_1():
    pair = olmo3_pair("tiny")
    common_faults.cached_positions_off_by_one(1)(pair)
    res = parity.check(pair, decode="12:4x4")
    assert res.first_mismatch.name == "step1/model.layers.1.self_attn.q_rot"
    assert res.first_mismatch.hint.kind == "position_offset"
    # the same bug seen without a reference: ours' cached logits stop matching ours' own full forward
    assert res.decode["consistency_max_abs"][0] < 1e-4 < max(res.decode["consistency_max_abs"][1:])


def test_decode_mask_seeing_a_future_slot():
    pair = llama3_pair("tiny")
    common_faults.cached_mask_sees_one_ahead(pair)
    bad = parity.check(pair, decode="12:4x2").first_mismatch
    assert bad.name == "step1/model.layers.0.self_attn.probs" and bad.hint.kind == "causal_mask"


def test_f16_left_padded_decode_with_positions_not_from_the_mask():
    pair = llama3_pair("tiny")
    forward = pair.ours.forward

    def ignore_positions(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        start = cache.seen if cache is not None else 0
        return forward(
            input_ids,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=torch.arange(start, start + input_ids.shape[1]),
        )

    pair.ours.forward = types.MethodType(ignore_positions, pair.ours)
    bad = parity.check(pair, decode="12:4x2", batch_size=3, left_pad=3).first_mismatch
    assert bad.name == "step0/model.layers.0.self_attn.q_rot" and bad.hint.kind == "position_offset"
    assert bad.hint.evidence["offsets"] == bad.hint.evidence["pad_counts"] == [3, 3, 0]


def test_greedy_divergence_reports_the_step_and_margin():
    from torch import nn

    pair = llama3_pair("tiny")
    head = pair.ours.out_head
    head.weight = nn.Parameter(head.weight.detach().flip(0), requires_grad=False)  # every token's logit moved
    res = parity.check(pair, decode="8x4")
    assert res.decode["first_divergent_step"] == 0 and res.decode["margin"] >= 0
    assert any(line.startswith("greedy tokens: ours first chooses another token at step 0") for line in res.notes)


def test_a_model_without_a_cache_is_told_what_the_protocol_is():
    pair = llama3_pair("tiny")
    pair.ours.new_cache = None
    with pytest.raises(parity.ParityError, match=r"has no new_cache\(\): a decode check needs"):
        parity.check(pair, decode="8x2")


def test_layers_whose_cache_decode_does_not_step_are_refused_in_one_line():
    """A layer type with a cache of neither kind (LFM2's short-conv layers, a Mamba layer) is refused
    naming the layers, rather than stepped with half its cache compared. No built-in family has one:
    the facts of a qwen3_5 pair are given such a layer type here."""
    from dataclasses import replace

    pair = qwen3_5_pair("tiny")
    layers = tuple(replace(layer, layer_type="conv") if layer.index in (0, 2) else layer for layer in pair.facts.layers)
    pair.facts = replace(pair.facts, layers=layers)
    with pytest.raises(parity.ParityError) as info:
        parity.check(pair, decode="8x2")
    message = str(info.value)
    assert "\n" not in message and "layers [0, 2] are conv" in message and "check without --decode" in message


def test_cli_decode_and_its_report(tmp_path, capsys):
    assert main(["check", "olmo3", "--decode", "12:4x8", "--report-dir", str(tmp_path), "--format", "html,json"]) == 0
    out = capsys.readouterr().out
    assert "cached vs full forward" in out and "greedy tokens" in out
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    html = (folder / "report.html").read_text()
    assert 'id="decode"' in html and "KV-cache run 12:4x8" in html  # a bit-exact pass plots nothing


def test_a_failing_decode_report_plots_steps_by_layers(tmp_path):
    pair = olmo3_pair("tiny")
    common_faults.cached_positions_off_by_one(1)(pair)
    html = parity.check(pair, decode="12:4x2").write_html(tmp_path / "r.html").read_text()
    assert 'id="plot-decode"' in html and "step1/model.layers.1.self_attn.q_rot" in html


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "12x"], "must be PREFILL[:CHUNK]xSTEPS"),
        (["--decode", "12x2", "--mode", "both"], "--decode runs chained"),
        (["--decode", "12x2", "--seq-len", "8"], "disagree"),
    ],
)
def test_cli_bad_decode_is_one_line(argv, message, tmp_path, capsys):
    assert main(["check", "olmo3", *argv, "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


# --- a user's own cached model (tests/user_models/kv_olmo3.py: a ring buffer, its own API) -------


def _kv_olmo3():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "user_models"))
    import kv_olmo3

    return kv_olmo3


@pytest.mark.parametrize("plan", ["12:4x4", "12:6x3", "4:1x6"])
def test_user_model_with_a_ring_buffer_cache_passes_through_its_protocol(plan):
    kv = _kv_olmo3()
    res = parity.check_model(
        kv.build, "olmo3:tiny", decode=plan, batch_size=3, left_pad=2, cache_protocol=kv.cache_protocol()
    )
    assert res.passed, res.verdict()
    assert any(n.kind == "cache.keys" and n.status == "ok" for n in res.nodes)


def test_user_ring_buffer_writing_a_long_chunk_into_the_wrong_slots_is_found_in_its_cache(monkeypatch):
    """A chunk longer than the window written from its first slot instead of its (n - window)-th: the
    step's outputs still agree (attention read old tail + chunk), but the cache holds the wrong keys."""
    kv = _kv_olmo3()
    update = kv.RingKV.update

    def wrong_slots(self, k, v, start):
        keys, vals = update(self, k, v, start)
        n, w = k.shape[2], self.window
        if n > w:  # rewrite the kept tail from the chunk's first slot on
            keep = min(n, w)
            dst = self._slots(start, start + keep)
            self.k.index_copy_(2, dst, k[:, :, n - keep :])
            self.v.index_copy_(2, dst, v[:, :, n - keep :])
        return keys, vals

    monkeypatch.setattr(kv.RingKV, "update", wrong_slots)
    res = parity.check_model(kv.build, "olmo3:tiny", decode="12:6x2", cache_protocol=kv.cache_protocol())
    bad = res.first_mismatch
    assert bad.name == "step0/model.layers.0.self_attn.cache.keys" and bad.status == "mismatch"
