"""Llama 2 as data: the llama3 family's model, weight table, node map and config mapping with Llama 2's
configs (MHA, plain RoPE with theta 10000, untied head), bit-exact with transformers.LlamaForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

import parity
from parity.cli import main
from parity.util.errors import ConfigError
from reference_pairs.llama2 import CONFIGS, FAMILY, build_pair
from reference_pairs.llama3 import FAMILY as LLAMA3
from reference_pairs.llama3.family import from_hf, to_hf

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def n_nodes(family, n_layers: int) -> int:
    nodes = family.nodes
    return len(nodes.before) + len(nodes.per_layer) * n_layers + len(nodes.after)


def assert_exact(pair, **kw):
    res = parity.assert_bit_exact(pair, **kw)
    assert len(res.nodes) == n_nodes(FAMILY, pair.source.cfg["n_layers"])
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


# meta-llama/Llama-2-7b-hf config.json as shipped (legacy rope fields, no head_dim)
RELEASED_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


def test_llama2_is_data_on_the_llama3_family():
    from parity.model.registry import get_family

    assert get_family("llama2") is FAMILY
    assert (FAMILY.model_class, FAMILY.weights, FAMILY.nodes, FAMILY.from_hf) == (
        LLAMA3.model_class,
        LLAMA3.weights,
        LLAMA3.nodes,
        LLAMA3.from_hf,
    )
    assert set(FAMILY.configs) == {"tiny", "7b-shape"} and FAMILY.real_configs == ("7b-shape",)
    assert FAMILY.exact_dtypes == (torch.float32, torch.bfloat16)


def test_7b_shape_is_the_released_config_json():
    from transformers import LlamaConfig

    assert without_dtype(from_hf(LlamaConfig.from_dict(dict(RELEASED_7B)), torch.float32)) == without_dtype(
        CONFIGS["7b-shape"](32)
    )
    cfg = CONFIGS["7b-shape"]()
    assert cfg["n_layers"] == 2 and cfg["n_kv_heads"] == cfg["n_heads"] and cfg["rope_freq"] is None


@DTYPES
def test_parity_is_bit_exact_chained_isolated_and_left_padded(dtype):
    pair = build_pair("tiny", dtype=dtype)
    assert pair.reference.config.rope_parameters == {"rope_type": "default", "rope_theta": 10_000.0}
    assert pair.ours.out_head.weight is not pair.ours.tok_emb.weight
    res = assert_exact(pair, batch_size=2, mode="both")
    assert all(n.max_abs == 0.0 for n in res.isolated)
    assert_exact(pair, batch_size=3, left_pad=5)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_parity_from_saved_checkpoint(sharded, checkpoint_of):
    original = build_pair("tiny", seed=5)
    pair = build_pair(checkpoint=checkpoint_of(original, sharded=sharded))
    assert without_dtype(pair.source.cfg) == without_dtype(original.source.cfg)
    assert pair.loading.loaded_keys["lm_head.weight"] == "out_head.weight"
    assert_exact(pair)


def test_released_config_json_with_legacy_rope_fields(tmp_path):
    config = {
        **RELEASED_7B,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 257,
        "rope_theta": 10000.0,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    pair = build_pair(config=str(path))
    assert pair.source.cfg["head_dim"] == 12 and pair.source.cfg["rope_base"] == 10_000.0
    assert_exact(pair)


def test_linear_rope_scaling_is_refused_by_name(tmp_path, capsys):
    config = {
        **to_hf(CONFIGS["tiny"]()).to_dict(),
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type 'linear'"):
        build_pair(config=str(path))
    assert main(["check", "llama2", "--config", str(path)]) == 2
    assert "rope_type 'linear'" in capsys.readouterr().err


def test_cli_check_passes(tmp_path, capsys):
    assert main(["check", "llama2", "--report-dir", str(tmp_path), "--format", "json"]) == 0
    assert f"PASS: all {n_nodes(FAMILY, 2)} nodes agree" in capsys.readouterr().out


@pytest.mark.slow
def test_parity_at_7b_widths():
    """About 2.7 GB of float32 weights for 2 layers: run under the memory lock."""
    pair = build_pair("7b-shape")
    assert (
        pair.source.cfg["emb_dim"],
        pair.source.cfg["n_heads"],
        pair.source.cfg["n_kv_heads"],
        pair.source.cfg["hidden_dim"],
    ) == (4096, 32, 32, 11_008)
    assert_exact(pair)
