"""A second held-back set: Mistral and GPT-2 user models by a helper who never read ``parity/``.

``tests/user_models/heldout2/``: a Mistral with a fused ``wqkv``, a norm parameter ``g``, GQA and a
sliding window of 8; a GPT-2 whose Conv1D weights are stored transposed in ``nn.Linear``, ``c_attn``
split into q/k/v and a head written ``x @ wte.T``. Its first measure (2026-12-02, 46 bug kinds not in
the first set): hints named the cause in 17, the right component in 8 more, none in 17, a wrong cause
in 4. The four wrong ones are fixed by kind and kept here, with the clean models (plain and left-padded,
checked against Transformers' own logits without parity); the kinds still unnamed are listed in the
stop notes, not here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import parity

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


@pytest.fixture
def bug(request):
    for module in MODELS.values():
        module.BUG = request.param
    yield request.param
    for module in MODELS.values():
        module.BUG = ""


def independent_max_diff(model: str, checkpoints, padded: bool) -> float:
    """Our logits against Transformers' (eager), no parity involved; padded: real tokens only."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoints[model], attn_implementation="eager").eval()
    ours = MODELS[model].build({k: v.clone() for k, v in ref.state_dict().items()}, ref.config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if not padded:
            ids = torch.randint(0, 256, (1, 24), generator=g)
            return float((ref(ids).logits - ours(ids)).abs().max())
        ids = torch.randint(0, 256, (2, 24), generator=g)
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, :5] = 0
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        a = ref(ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
        b = ours(ids, attention_mask=mask, position_ids=positions)[mask.bool()]
        return float((a - b).abs().max())


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
    ("mistral", "softmax_fp16", "model.layers.0.self_attn.probs", None),
    ("mistral", "rope_on_v", "model.layers.0.self_attn.context", None),
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
