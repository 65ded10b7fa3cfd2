"""Checkpoint tensors a build computes into other values at load (parity.user.derived): a correct fold
passes, a wrong fold fails at a node, a tensor never read is still refused. Each verdict is checked
against the logits of the unfolded model (the litgpt-style Llama, itself checked against Transformers in
test_check_model), not against parity."""

import pytest
import torch
from torch import nn

import parity
from tests.user_models import litgpt_llama

IDS = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(3))


def _folding(seen: dict | None = None):
    """litgpt's Llama with each post-attention norm's weight folded into the MLP's gate and up columns
    (``W @ diag(w)``), the norm left without a weight: exact, and what runtimes that fuse norms do."""

    def build(state_dict, hf_config):
        model = litgpt_llama.build(state_dict, hf_config)
        for block in model.transformer.h:
            w = block.norm_2.weight.detach().clone()
            for fc in (block.mlp.fc_1, block.mlp.fc_2):
                fc.weight = nn.Parameter(fc.weight.detach() * w[None, :])
            block.norm_2.weight = nn.Parameter(torch.ones_like(w))
        if seen is not None:
            seen.update(state_dict=state_dict, config=hf_config)
        return model

    return build


def _wrong_fold(state_dict, hf_config):
    """The fold with the norm weight reversed on the up projection's columns (a loader that indexes
    the weight from the end): wrong, and a function of several tensors all the same."""
    model = litgpt_llama.build(state_dict, hf_config)
    for block in model.transformer.h:
        w = block.norm_2.weight.detach().clone()
        fc = block.mlp.fc_2
        fc.weight = nn.Parameter(fc.weight.detach() * w.flip(0)[None, :])
        block.mlp.fc_1.weight = nn.Parameter(block.mlp.fc_1.weight.detach() * w[None, :])
        block.norm_2.weight = nn.Parameter(torch.ones_like(w))
    return model


def _max_diff(build, seen: dict) -> float:
    """max |folded - unfolded| logits on the same state dict: the independent check."""
    folded = build(seen["state_dict"], seen["config"]).eval()
    plain = litgpt_llama.build(seen["state_dict"], seen["config"]).eval()
    with torch.no_grad():
        return float((folded(IDS) - plain(IDS)).abs().max())


def test_a_norm_folded_into_the_next_projections_passes():
    seen: dict = {}
    res = parity.check_model(_folding(seen=seen), "llama3")
    assert _max_diff(_folding(), seen) < 1e-5
    assert res.passed, res.verdict()
    note = res.coverage.derived_note()
    assert (
        note is not None and "model.layers.0.post_attention_layernorm.weight -> transformer.h.0.mlp.fc_1.weight" in note
    )
    assert not res.coverage.unused


def test_a_wrong_fold_fails_at_its_node():
    seen: dict = {}
    parity.check_model(_folding(seen=seen), "llama3")
    assert _max_diff(_wrong_fold, seen) > 1e-3
    res = parity.check_model(_wrong_fold, "llama3")
    bad = res.first_mismatch
    assert bad is not None and bad.name == "model.layers.0.mlp.down_proj", res.verdict()
    assert bad.hint is not None and bad.hint.kind == "derived_at_load", bad.hint
    assert "model.layers.0.post_attention_layernorm.weight" in str(bad.hint)
    assert "transformer.h.0.mlp.fc_2.weight" in str(bad.hint)


def test_a_tensor_never_read_is_still_refused():
    """The norm weight dropped, not folded: perturbing it changes nothing, so it stays a gap."""

    def build(state_dict, hf_config):
        model = litgpt_llama.build(state_dict, hf_config)
        model.transformer.h[1].norm_2.weight = nn.Parameter(torch.ones_like(model.transformer.h[1].norm_2.weight))
        return model

    with pytest.raises(
        parity.ParityError, match=r"model\.layers\.1\.post_attention_layernorm\.weight are in no parameter"
    ):
        parity.check_model(build, "llama3")


def test_a_build_drawing_random_values_is_not_probed():
    """Two builds from the same tensors give different logits: the probe has no evidence, the gap stays."""

    def build(state_dict, hf_config):
        model = litgpt_llama.build(state_dict, hf_config)
        fc = model.transformer.h[0].mlp.fc_1
        fc.weight = nn.Parameter(fc.weight.detach() + 1e-3 * torch.randn(fc.weight.shape))
        return model

    with pytest.raises(parity.ParityError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight are in no parameter"):
        parity.check_model(build, "llama3")
