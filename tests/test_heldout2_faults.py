"""A second held-back set: Mistral and GPT-2 user models by a helper who never read ``parity/``.

``tests/user_models/heldout2/``: a Mistral with a fused ``wqkv``, a norm parameter ``g``, GQA and a
sliding window of 8; a GPT-2 whose Conv1D weights are stored transposed in ``nn.Linear``, ``c_attn``
split into q/k/v and a head written ``x @ wte.T``. Its first measure (2026-12-02, 46 bug kinds not in
the first set): hints named the cause in 17, the right component in 8 more, none in 17, a wrong cause
in 4. The four wrong ones are fixed by kind and kept here, with the clean models (plain and left-padded,
checked against Transformers' own logits without parity). The kinds it left unnamed or named only
by component got detectors of their own in the next session (``NAMED``: each detector works by kind,
not on this instance; the unit tests in ``tests/test_hints_kinds.py`` put each fault on either side).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import parity
from tests import heldout_support

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout2"))

import heldout2_gpt2
import heldout2_mistral

MODELS = {"mistral": heldout2_mistral, "gpt2": heldout2_gpt2}
PADDED = {"batch_size": 2, "left_pad": 5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints: norm weights 1 +- 0.5, biases ~0.1, embedding rows of varied scale."""
    import transformers as T

    torch.manual_seed(0)

    def vary(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                    p.copy_(1.0 + 0.5 * torch.randn_like(p))
                elif p.dim() == 1 and name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif "embed" in name or "wte" in name or "wpe" in name:
                    p.copy_(torch.randn_like(p) * 0.5 * torch.exp(torch.randn(p.shape[0], 1) * 0.5))

    root = tmp_path_factory.mktemp("heldout2")
    mistral = T.MistralForCausalLM(
        T.MistralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False,
        )
    )  # fmt: skip
    gpt2 = T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                     attn_pdrop=0)
    )  # fmt: skip
    out = {}
    for name, model in (("mistral", mistral), ("gpt2", gpt2)):
        vary(model)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


bug = heldout_support.bug_fixture(MODELS)


def independent_max_diff(model: str, checkpoints, padded: bool) -> float:
    """Our logits against Transformers' (eager), no parity involved (``tests/heldout_support.py``)."""
    return heldout_support.independent_max_diff(MODELS[model], checkpoints[model], padded, pad_row=1)


@pytest.mark.parametrize("bug", [""], indirect=True)
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_correct_model_passes(model, padded, bug, checkpoints):
    assert independent_max_diff(model, checkpoints, padded) < 1e-4
    res = parity.check_model(
        MODELS[model].build, reference=str(checkpoints[model]), seq_len=24, **(PADDED if padded else {})
    )
    assert res.passed, res.verdict()


#: (model, bug, node, the hint kind, or None: no hint rather than a wrong one); each named a wrong cause first
FIXED = [
    ("gpt2", "mlp_act_on_output", "transformer.h.0.mlp.c_proj@input", "activation"),
    ("mistral", "pad_mask_inverted", "model.layers.0.self_attn.probs", "padding"),
    ("mistral", "softmax_fp16", "model.layers.0.self_attn.probs", "precision"),
    ("mistral", "rope_on_v", "model.layers.0.self_attn.context", "rope_unexpected"),
]


@pytest.mark.parametrize(("model", "bug", "node", "kind"), FIXED, indirect=["bug"], ids=str)
def test_a_kind_once_misnamed_gets_its_hint_or_none(model, bug, node, kind, checkpoints):
    padded = PADDED if bug.startswith("pad_") else {}
    res = parity.check_model(MODELS[model].build, reference=str(checkpoints[model]), seq_len=24, mode="both", **padded)
    assert res.first_mismatch is not None, res.verdict()
    # a softmax rounded through float16 is within the reference's own noise node by node: isolated passes
    for bad in (b for b in (res.first_mismatch, res.first_isolated_mismatch) if b is not None):
        assert bad.name == node, res.verdict()
        assert (bad.hint.kind if bad.hint else None) == kind, bad.hint


@pytest.mark.parametrize("bug", ["probs_renorm_sqrt"], indirect=True)
def test_the_models_own_tap_wins_over_the_captured_softmax(bug, checkpoints):
    """Ours computes ``torch.softmax`` (captured as ``probs``), then changes the probabilities
    (sqrt, renormalised: the softmax of half the scores) before its own ``parity.tap(pr, "probs")``:
    the tapped value is judged, so the fault sits at ``probs``, not one node late at ``context``."""
    res = parity.check_model(MODELS["mistral"].build, reference=str(checkpoints["mistral"]), seq_len=24, mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad is not None and bad.name == "model.layers.0.self_attn.probs", res.verdict()
        assert bad.hint is not None and bad.hint.kind == "attention_scale", bad.hint
        assert "times 0.5" in str(bad.hint)


A0, M0 = "model.layers.0.self_attn", "transformer.h.0"
#: (model, bug, node, hint kind): kinds the first measure left unnamed or named only by component
NAMED = [
    ("mistral", "kv_unnormed", f"{A0}.k_rot", "projection_input"),
    ("mistral", "softmax_plus_one", f"{A0}.probs", "softmax_sink"),
    ("mistral", "rms_axis_seq", "model.layers.0.input_layernorm", "norm_kind"),
    ("mistral", "rms_mean_not_sq", "model.layers.0.input_layernorm", "norm_kind"),
    ("mistral", "head_tied_wrongly", "lm_head", "untied_head"),
    ("mistral", "rope_cos_sin_swapped", f"{A0}.q_rot", "rope_rotation"),
    ("mistral", "window_mask_value_zero", f"{A0}.probs", "sliding_window"),
    ("mistral", "scores_bf16", f"{A0}.scores", "precision"),
    ("mistral", "sigmoid_not_silu", "model.layers.0.mlp.down_proj", "activation"),
    ("mistral", "relu_sq", "model.layers.0.mlp.down_proj", "activation"),
    ("mistral", "norm_swap_ln", "model.layers.0.input_layernorm", "swapped_weights"),
    ("mistral", "ids_shift", "model.embed_tokens", "token_ids"),
    ("mistral", "layers_reversed", "model.layers.0.input_layernorm", "execution_order"),
    ("mistral", "final_norm_layer0_w", "model.norm", "wrong_module"),
    ("mistral", "resid_dropout", "model.layers.0.post_attention_layernorm@input", "dropout"),
    ("gpt2", "pos_ignores_position_ids", "transformer.wpe", "position_offset"),
    ("gpt2", "ln_unbiased_var", f"{M0}.ln_1", "norm_kind"),
    ("gpt2", "ln_bias_before_scale", f"{M0}.ln_1", "bias"),
    ("gpt2", "conv1d_bias_split", f"{M0}.attn.c_attn[0:64]", "bias"),
    ("gpt2", "head_split_wrong", f"{M0}.attn.q_rot", "head_layout"),
    ("gpt2", "mask_pad_through", f"{M0}.attn.probs", "padding"),
    ("gpt2", "down_bias_missing", f"{M0}.mlp.c_proj", "bias"),
    ("gpt2", "residual_from_normed", f"{M0}.ln_2@input", "residual"),
    ("gpt2", "wpe_reversed", "transformer.wpe", "position_offset"),
    ("gpt2", "ln_f_uses_ln1", "transformer.ln_f", "wrong_module"),
]
#: what a hint must say besides its kind (the cause, not only the component)
SAYS = {
    "softmax_plus_one": "off-by-one",
    "window_mask_value_zero": "fill value 0",
    "rms_axis_seq": "sequence axis",
    "ln_unbiased_var": "unbiased",
    "ln_bias_before_scale": "before the weight",
    "conv1d_bias_split": "split in another order",
    "down_bias_missing": "ours adds none",
    "mask_pad_through": "not applied",
    "pos_ignores_position_ids": "not derived from the attention mask",
    "wpe_reversed": "reverse",
    "head_tied_wrongly": "embedding matrix",
}


@pytest.mark.parametrize(("model", "bug", "node", "kind"), NAMED, indirect=["bug"], ids=str)
def test_a_kind_once_unnamed_gets_its_cause(model, bug, node, kind, checkpoints):
    padded = PADDED if bug in ("pos_ignores_position_ids", "mask_pad_through") else {}
    assert independent_max_diff(model, checkpoints, bool(padded)) > 1e-6  # the fault changes the logits
    res = parity.check_model(MODELS[model].build, reference=str(checkpoints[model]), seq_len=24, mode="both", **padded)
    bad = res.first_mismatch
    assert bad is not None and bad.name == node, res.verdict()
    assert bad.hint is not None and bad.hint.kind == kind, bad.hint
    assert SAYS.get(bug, "") in str(bad.hint), bad.hint
