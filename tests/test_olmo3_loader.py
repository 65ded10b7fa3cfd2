"""load_weights_into_olmo3: every key consumed once, every parameter written, errors name the key."""

from __future__ import annotations

import pytest
import torch

from parity.util.errors import LoaderError
from reference_pairs.olmo3 import Olmo3Model, build_pair, load_weights_into_olmo3


def fresh(pair):
    with torch.device("meta"):
        return Olmo3Model(pair.source.cfg)


def state_dict(pair):
    return {k: v for k, v in pair.reference.state_dict().items()}


def test_loader_writes_every_parameter_without_copying():
    pair = build_pair("tiny")
    model, sd = fresh(pair), state_dict(pair)
    consumed = load_weights_into_olmo3(model, pair.source.cfg, sd)
    assert set(consumed) == set(sd)
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    assert model.blocks[1].att.q_norm.weight.data_ptr() == sd["model.layers.1.self_attn.q_norm.weight"].data_ptr()


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda sd: sd.pop("model.layers.2.mlp.up_proj.weight"),
            "missing checkpoint keys: model.layers.2.mlp.up_proj.weight",
        ),
        (
            lambda sd: sd.__setitem__("model.layers.9.extra.weight", torch.zeros(1)),
            "unused checkpoint keys: model.layers.9.extra.weight",
        ),
        (
            lambda sd: sd.__setitem__("model.layers.0.self_attn.k_norm.weight", torch.ones(32)),
            "shape mismatch for model.layers.0.self_attn.k_norm.weight: checkpoint (32,), expected (16,)",
        ),
    ],
    ids=["missing", "unused", "shape"],
)
def test_loader_errors_name_the_key(edit, message):
    pair = build_pair("tiny")
    sd = state_dict(pair)
    edit(sd)
    with pytest.raises(LoaderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_weights_into_olmo3(fresh(pair), pair.source.cfg, sd)


def test_a_parameter_the_map_never_writes_is_an_error(monkeypatch, replace_table):
    import reference_pairs.olmo3.loader as loader

    pair = build_pair("tiny")
    template = {k: v for k, v in loader.WEIGHT_MAP.items() if "post_feedforward" not in k}
    replace_table(loader.WEIGHT_MAP, template)
    sd = {k: v for k, v in state_dict(pair).items() if "post_feedforward" not in k}
    with pytest.raises(LoaderError, match=r"never written: blocks\.0\.post_feedforward_layernorm\.weight"):
        load_weights_into_olmo3(fresh(pair), pair.source.cfg, sd)


def test_tied_head_stays_one_parameter_and_rejects_a_different_copy():
    pair = build_pair("tiny", tie_word_embeddings=True)
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight
    assert pair.reference.lm_head.weight is pair.reference.model.embed_tokens.weight
    sd = state_dict(pair)  # state_dict() keeps lm_head.weight, equal to the embedding: accepted
    model = fresh(pair)
    load_weights_into_olmo3(model, pair.source.cfg, sd)
    assert model.out_head.weight is model.tok_emb.weight
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(LoaderError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        load_weights_into_olmo3(fresh(pair), pair.source.cfg, sd)
