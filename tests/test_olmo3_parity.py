"""OLMo 3 from scratch agrees with transformers.Olmo3ForCausalLM, from configs and from checkpoints."""

from __future__ import annotations

import pytest
import torch

import parity
from reference_pairs.olmo3 import FAMILY, build_pair
from reference_pairs.olmo3.configs import FULL, SLIDING


def assert_holds(pair, **kw):
    res = parity.check(pair, **kw)
    assert res.first_mismatch is None, res.verdict()
    assert all(n.status == "ok" for n in res.nodes)
    return res


@pytest.mark.parametrize("config", ["tiny", "yarn", "mha"])
def test_parity_from_random_config(config):
    pair = build_pair(config)
    res = assert_holds(pair)
    # Every declared node was compared, none silently skipped, and the window was exercised.
    assert (
        len(res.nodes)
        == len(pair.nodes)
        == 1 + len(FAMILY.nodes.per_layer) * pair.source.cfg["n_layers"] + len(FAMILY.nodes.after)
    )
    assert res.meta["seq_len"] > pair.source.cfg["sliding_window"]
    assert not res.notes


@pytest.mark.parametrize("config", ["tiny", "yarn", "mha"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_parity_from_saved_checkpoint(config, sharded, checkpoint_of):
    directory = checkpoint_of(build_pair(config, seed=3), sharded=sharded)
    shards = list(directory.glob("*.safetensors"))
    assert (len(shards) > 1) == sharded
    pair = build_pair(checkpoint=directory)
    assert pair.source.cfg["rope_type"] == ("yarn" if config == "yarn" else "default")
    assert_holds(pair)


def test_checkpoint_models_share_one_storage(checkpoint_of):
    pair = build_pair(checkpoint=checkpoint_of(build_pair("tiny")))
    ours = pair.ours.blocks[2].ff.fc1.weight
    ref = pair.reference.model.layers[2].mlp.gate_proj.weight
    assert ours.data_ptr() == ref.data_ptr()


def test_yarn_applies_to_full_layers_only_as_transformers_decides():
    pair = build_pair("yarn")
    assert pair.source.cfg["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL]
    rope = pair.reference.config.rope_parameters
    assert rope[FULL]["rope_type"] == "yarn" and rope[SLIDING]["rope_type"] == "default"
    assert pair.reference.model.rotary_emb.full_attention_attention_scaling == pytest.approx(1.2079441541679836)


def test_legacy_rope_scaling_in_config_json_lands_on_full_layers(tmp_path, checkpoint_of):
    """A config.json in the pre-5.0 form (rope_scaling + rope_theta) is read the way Transformers 5 reads it."""
    import json

    directory = checkpoint_of(build_pair("yarn"))
    config = json.loads((directory / "config.json").read_text())
    full = config.pop("rope_parameters")[FULL]
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_scaling"] = full
    (directory / "config.json").write_text(json.dumps(config))
    pair = build_pair(checkpoint=directory)
    assert pair.source.cfg["rope_type"] == "yarn" and pair.source.cfg["rope_scaled_layer_types"] == [FULL]
    assert_holds(pair)


@pytest.mark.parametrize("overrides", [{"tie_word_embeddings": True}, {"attention_bias": True}], ids=["tied", "bias"])
def test_parity_with_tied_head_and_attention_bias(overrides, checkpoint_of):
    pair = build_pair("tiny", **overrides)
    assert_holds(pair)
    reloaded = build_pair(checkpoint=checkpoint_of(pair))
    assert_holds(reloaded)
    if overrides.get("tie_word_embeddings"):
        assert reloaded.ours.out_head.weight is reloaded.ours.tok_emb.weight


def test_parity_in_bfloat16_and_with_a_batch():
    assert_holds(build_pair("yarn", dtype=torch.bfloat16), batch_size=2)


def test_sliding_window_mask_reaches_the_reference():
    """If Transformers dropped the mask (custom attention without a mask function), the reference
    would attend outside the window; its recorded probabilities must be zero there."""
    pair = build_pair("tiny")
    res = parity.check(pair)
    assert res.passed
    from parity.run.stages import trace_pair

    ref_trace, _ = trace_pair(pair, pair.make_inputs(16))
    probs = ref_trace.tensors["model.layers.0.self_attn.probs"][0, 0]
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    assert torch.all(probs[(j > i) | (i - j >= 4)] == 0)
    assert torch.all(probs[(j <= i) & (i - j < 4)] > 0)
    full = ref_trace.tensors["model.layers.3.self_attn.probs"][0, 0]
    assert torch.all(full[j <= i] > 0) and torch.all(full[j > i] == 0)


@pytest.mark.slow
def test_parity_7b_shape_one_layer():
    pair = build_pair("7b-shape", n_layers=1)
    assert pair.source.cfg["emb_dim"] == 4096 and pair.source.cfg["n_heads"] == pair.source.cfg["n_kv_heads"] == 32
    assert_holds(pair)


def test_config_json_path_with_fewer_layers(tmp_path):
    """--config path/config.json --layers N keeps the first N layers of that config."""
    build_pair("yarn").reference.config.save_pretrained(tmp_path)
    pair = build_pair(str(tmp_path / "config.json"), n_layers=2)
    assert pair.source.cfg["n_layers"] == 2 and pair.source.cfg["layer_types"] == [SLIDING, SLIDING]
    assert_holds(pair)
    with pytest.raises(parity.ConfigError, match=r"9 layers asked for, but the config.s layer_types lists 4"):
        build_pair(str(tmp_path / "config.json"), n_layers=9)
