"""Qwen3 (dense): bit-exact parity with transformers.Qwen3ForCausalLM from configs and checkpoints, the
released configs read back, use_sliding_window / max_window_layers as Transformers resolves them,
config fields we refuse, loader errors by key, and what per-head Q/K norm means."""

from __future__ import annotations

import json

import pytest
import torch

import parity
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.common.layer_types import FULL, SLIDING
from reference_pairs.qwen3 import CONFIGS, FAMILY, Qwen3Model, build_pair, load_weights_into_qwen3
from reference_pairs.qwen3.family import from_hf, to_hf


def n_nodes(pair) -> int:
    """Nodes the family's node map gives for this pair (never a hard-coded count)."""
    return len(FAMILY.node_specs(pair.facts))


def assert_bit_exact(pair, **kw):
    res = parity.check(pair, **kw)
    assert res.passed, res.verdict()
    assert len(res.nodes) == n_nodes(pair) == len(pair.nodes)
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


# --- the released configs (Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json, pre-5.0 form)

RELEASED_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
RELEASED_8B = {
    **RELEASED_0_6B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "released, name, n_layers", [(RELEASED_0_6B, "0.6b-shape", 28), (RELEASED_8B, "8b-shape", 36)], ids=["0.6b", "8b"]
)
def test_shape_configs_are_the_released_config_json(released, name, n_layers):
    from transformers import Qwen3Config

    assert without_dtype(from_hf(Qwen3Config.from_dict(dict(released)), torch.float32)) == without_dtype(
        CONFIGS[name](n_layers)
    )
    assert CONFIGS[name]()["n_layers"] == 2  # the --layers default


def test_family_is_registered():
    from parity.model.registry import get_family

    assert get_family("qwen3") is FAMILY
    assert FAMILY.ci_configs == ("tiny", "yarn") and FAMILY.real_configs == ("0.6b-shape", "8b-shape")
    assert FAMILY.exact_dtypes == (torch.float32, torch.bfloat16)


def test_tiny_has_head_dim_apart_from_width_over_heads():
    """What makes Qwen3's head_dim a trap: the tiny config keeps it apart from emb_dim / n_heads, as 0.6B does."""
    cfg = CONFIGS["tiny"]()
    assert cfg["head_dim"] != cfg["emb_dim"] // cfg["n_heads"] and cfg["n_heads"] * cfg["head_dim"] != cfg["emb_dim"]
    assert build_pair("tiny").reference.model.layers[0].self_attn.scaling == cfg["head_dim"] ** -0.5


# --- bit-exact parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", ["tiny", "yarn", "swa"])
def test_every_node_is_bit_identical(config, dtype):
    pair = build_pair(config, dtype=dtype)
    assert pair.exact
    res = assert_bit_exact(pair, batch_size=2, mode="both")
    assert all(n.max_abs == 0.0 for n in res.isolated)


def test_tied_and_untied_heads():
    tied, untied = build_pair("tiny"), build_pair("yarn")
    assert tied.ours.out_head.weight is tied.ours.tok_emb.weight
    assert untied.ours.out_head.weight is not untied.ours.tok_emb.weight


def test_left_padded_batch_is_bit_identical():
    assert_bit_exact(build_pair("swa"), batch_size=3, left_pad=5)


@pytest.mark.parametrize(
    "sharded, dtype", [(False, torch.float32), (True, torch.bfloat16)], ids=["single-fp32", "sharded-bf16"]
)
def test_parity_from_saved_checkpoint(sharded, dtype, checkpoint_of):
    """(The gate runs every CI config from single and sharded checkpoints in both dtypes.)"""
    original = build_pair("tiny", seed=3, dtype=dtype)
    directory = checkpoint_of(original, sharded=sharded)
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = build_pair(checkpoint=directory, dtype=dtype)
    assert without_dtype(pair.source.cfg) == without_dtype(original.source.cfg)
    assert "lm_head.weight" not in pair.loading.loaded_keys  # save_pretrained drops the tied head
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight
    assert_bit_exact(pair)


def test_parity_from_untied_yarn_checkpoint(checkpoint_of):
    pair = build_pair(checkpoint=checkpoint_of(build_pair("yarn")))
    assert pair.loading.loaded_keys["lm_head.weight"] == "out_head.weight"
    assert pair.source.cfg["rope_yarn"] == CONFIGS["yarn"]()["rope_yarn"]
    assert_bit_exact(pair)


def write_config(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_model_card_yarn_as_rope_scaling(tmp_path):
    """The model cards enable YaRN with a pre-5.0 ``rope_scaling`` block; Transformers 5 turns it into
    ``rope_parameters`` and we read the same values (beta_fast/beta_slow and the factor's attention
    scale from Transformers' defaults)."""
    config = {
        **RELEASED_0_6B,
        "num_hidden_layers": 1,
        "max_position_embeddings": 131072,
        "vocab_size": 257,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    pair = build_pair(config=write_config(tmp_path, config))
    assert pair.source.cfg["rope_yarn"] == dict(
        factor=4.0, original_context_length=32768, beta_fast=32.0, beta_slow=1.0, attention_factor=None
    )
    assert pair.reference.model.rotary_emb.attention_scaling == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1
    )


def test_use_sliding_window_and_max_window_layers_as_transformers_resolves_them(tmp_path):
    """``use_sliding_window`` with ``max_window_layers`` 1: layer 0 full, the layers from 1 on sliding
    (the name reads the other way round); without ``use_sliding_window`` the window is ignored."""
    base = {**to_hf(CONFIGS["tiny"]()).to_dict()}
    base.pop("layer_types")
    windowed = build_pair(
        config=write_config(tmp_path, {**base, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})
    )
    assert windowed.source.cfg["layer_types"] == [FULL, SLIDING, SLIDING] and windowed.source.cfg["sliding_window"] == 4
    assert windowed.facts.windows == (None, 4, 4)
    assert [b.att.sliding_window for b in windowed.ours.blocks] == [None, 4, 4]
    assert_bit_exact(windowed, seq_len=12)
    ignored = build_pair(
        config=write_config(
            tmp_path, {**base, "use_sliding_window": False, "sliding_window": 4, "max_window_layers": 1}
        )
    )
    assert ignored.source.cfg["sliding_window"] is None and ignored.source.cfg["layer_types"] == [FULL] * 3


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'dynamic'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e6,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
            "rope_type 'llama3'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                }
            },
            "mscale",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "truncate": False,
                }
            },
            "truncate",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ],
    ids=["linear", "dynamic", "llama3", "partial-rotary", "yarn-mscale", "yarn-truncate", "gelu", "chunked"],
)
def test_from_hf_refuses_what_it_cannot_honour(change, field, tmp_path):
    config = {**to_hf(CONFIGS["tiny"]()).to_dict(), **change}
    with pytest.raises(ConfigError, match=field):
        build_pair(config=write_config(tmp_path, config))


def test_sliding_layers_without_a_window_are_refused_by_name(tmp_path):
    config = {**to_hf(CONFIGS["tiny"]()).to_dict(), "layer_types": [FULL, SLIDING, SLIDING]}
    with pytest.raises(ConfigError, match="sliding_attention but sliding_window is null"):
        build_pair(config=write_config(tmp_path, config))


# --- what per-head Q/K norm means (the docstring's claim, held against Qwen3Attention)


def test_q_norm_is_per_head_and_differs_from_a_whole_projection_norm():
    pair = build_pair("tiny")
    att, ref = pair.ours.blocks[0].att, pair.reference.model.layers[0].self_attn
    assert att.qk_norm == "head" and tuple(att.q_norm.weight.shape) == (16,) and att.q_norm.weight is not None
    x = (
        torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(0))
        * torch.tensor([1e-2, 1.0, 10.0, 0.1])[:, None]
    )
    with torch.no_grad():
        assert torch.equal(att.q_norm(x), ref.q_norm(x))
        whole = x / x.pow(2).mean((-2, -1), keepdim=True).add(1e-6).sqrt() * att.q_norm.weight
        assert not torch.allclose(att.q_norm(x), whole, atol=1e-3)


def test_norms_round_like_qwen3_in_bfloat16():
    pair = build_pair("tiny", dtype=torch.bfloat16)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(pair.ours.final_norm(x), pair.reference.model.norm(x))


# --- loader errors name the key


@pytest.fixture
def loader_case():
    pair = build_pair("yarn")
    with torch.device("meta"):
        model = Qwen3Model(pair.source.cfg)
    return model, pair.source.cfg, dict(pair.reference.state_dict())


def test_dropped_q_norm_key_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    del sd["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(LoaderError, match=r"missing checkpoint keys: model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_weights_into_qwen3(model, cfg, sd)


def test_whole_projection_q_norm_weight_is_a_shape_error_naming_the_key(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)  # n_heads * head_dim: OLMo's layout
    with pytest.raises(
        LoaderError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight: checkpoint \(64,\), expected \(16,\)"
    ):
        load_weights_into_qwen3(model, cfg, sd)


def test_extra_layer_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.3.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(LoaderError, match=r"model\.layers\.3\.mlp\.up_proj\.weight -> blocks\.3\.ff\.fc2\.weight"):
        load_weights_into_qwen3(model, cfg, sd)


# --- real widths (slow: about 3 and 6 GB of float32 weights)


@pytest.mark.slow
@pytest.mark.parametrize("name, emb, tied", [("0.6b-shape", 1024, True), ("8b-shape", 4096, False)])
def test_parity_at_real_widths(name, emb, tied):
    pair = build_pair(name)
    assert (pair.source.cfg["emb_dim"], pair.source.cfg["head_dim"], pair.source.cfg["n_layers"]) == (emb, 128, 2)
    assert (pair.ours.out_head.weight is pair.ours.tok_emb.weight) == tied
    assert_bit_exact(pair)
