"""A user's model that runs each row of a padded batch alone, on its real tokens (a varlen loop): every
node is assembled from the per-row calls into the padded batch (parity.record.trace.Trace._by_rows), so a
correct model passes with its nodes judged and a bug is found at its node. Verdicts are checked against
Transformers' own logits on the same weights, not against parity."""

import torch
from torch import nn

import parity
from parity.record.trace import Trace
from tests.user_models import litgpt_llama


class PerRow(nn.Module):
    """Runs ``inner`` once per row, on the row's real tokens alone (positions from 0), and scatters the
    logits back into the padded batch."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            return self.inner(input_ids)
        keep = attention_mask.bool()
        out = None
        for r in range(input_ids.shape[0]):
            logits = self.inner(input_ids[r][keep[r]][None])[0]
            if out is None:
                out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
            out[r, keep[r]] = logits
        return out


def _build(eps_layer: int | None = None, seen: dict | None = None):
    def build(state_dict, hf_config):
        inner = litgpt_llama.build(state_dict, hf_config)
        if eps_layer is not None:
            inner.transformer.h[eps_layer].norm_2.eps = 1e-2
        if seen is not None:
            seen.update(state_dict=state_dict, config=hf_config)
        return PerRow(inner)

    return build


def _transformers_gap(build, seen: dict) -> float:
    """max |ours - Transformers| over the real tokens of a left-padded batch, relative to max |logits|."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM(seen["config"]).eval()
    ref.load_state_dict(seen["state_dict"], strict=False)
    ids = torch.randint(0, seen["config"].vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours = build(seen["state_dict"], seen["config"]).eval()(ids, mask)
    real = mask.bool()
    return float((ours - theirs)[real].abs().max() / theirs[real].abs().max())


def test_a_model_running_each_row_alone_passes_with_its_nodes_judged():
    seen: dict = {}
    res = parity.check_model(_build(seen=seen), "llama3", batch_size=2, left_pad=5)
    assert _transformers_gap(_build(), seen) < 1e-5
    assert res.passed, res.verdict()
    judged = [r for r in res.nodes if r.status == "ok"]
    assert any(r.name == "model.layers.0.self_attn.probs" for r in judged), res.verdict()
    assert len(judged) >= len(res.nodes) - 4, res.verdict()


def test_a_bug_in_a_model_running_each_row_alone_is_found_at_its_node():
    seen: dict = {}
    parity.check_model(_build(seen=seen), "llama3", batch_size=2, left_pad=5)
    assert _transformers_gap(_build(eps_layer=1), seen) > 1e-3
    res = parity.check_model(_build(eps_layer=1), "llama3", batch_size=2, left_pad=5)
    bad = res.first_mismatch
    assert bad is not None and bad.name == "model.layers.1.post_attention_layernorm", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "norm_eps", bad.hint


def test_per_row_calls_are_assembled_into_the_padded_batch():
    """Queries and keys (a scores tensor) widened to the sequence, pad positions zero; a broadcast
    ``(1, seq, ...)`` table is no row's and is kept as the first call's."""
    rows = torch.tensor([[False, False, True, True], [True, True, True, True]])
    trace = Trace(rows=rows)
    a, b = torch.arange(4.0).reshape(1, 1, 2, 2), torch.arange(16.0).reshape(1, 1, 4, 4)
    trace.add("scores", a)
    assert "scores" not in trace.tensors and not trace.recorded("scores")
    trace.add("scores", b)
    whole = trace.tensors["scores"]
    assert whole.shape == (2, 1, 4, 4) and trace.calls["scores"] == 1
    assert torch.equal(whole[0, 0, 2:, 2:], a[0, 0]) and not whole[0, 0, :2].any() and not whole[0, 0, :, :2].any()
    assert torch.equal(whole[1], b[0])
    table = torch.ones(1, 4, 8)
    trace.add("rotary", table)
    assert torch.equal(trace.tensors["rotary"], table)
