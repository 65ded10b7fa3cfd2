"""Gemma 3 (text) from scratch against transformers.Gemma3ForCausalLM: bit-exact parity from configs
and checkpoints in float32 and bfloat16, the released configs read back, loader errors by key,
config fields the pair refuses, the rounding Gemma is known for, and the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

import parity
from parity.cli import main
from parity.model.fields import draw_config
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.gemma3 import CONFIGS, FAMILY, Gemma3Model, build_pair, load_weights_into_gemma3
from reference_pairs.gemma3.configs import FULL, SLIDING
from reference_pairs.gemma3.family import from_hf, to_hf

DTYPES = [torch.float32, torch.bfloat16]


def node_count(pair) -> int:
    """Nodes the node map declares for this pair (every node of ours and the reference's)."""
    return len(FAMILY.node_specs(pair.facts))


def assert_exact(pair, **kw) -> parity.CheckResult:
    """Every node bit-identical (Gemma 3 claims float32 and bfloat16)."""
    res = parity.assert_bit_exact(pair, **kw)
    assert len(res.nodes) == len(pair.nodes) == node_count(pair)
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


# --- the released configs (config.json of google/gemma-3-270m and google/gemma-3-1b-pt, Transformers 4.5x form)

RELEASED_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "torch_dtype": "bfloat16",
    "use_bidirectional_attention": False,
    "use_cache": True,
    "vocab_size": 262144,
    "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)],
}
RELEASED_1B = {
    **{k: v for k, v in RELEASED_270M.items() if k not in ("layer_types", "use_bidirectional_attention")},
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "sliding_window_pattern": 6,
    "cache_implementation": "hybrid",
}


@pytest.mark.parametrize(
    "released, name, n_layers", [(RELEASED_270M, "270m-shape", 18), (RELEASED_1B, "1b-shape", 26)], ids=["270m", "1b"]
)
def test_shape_configs_are_the_released_config_json(released, name, n_layers):
    from transformers import Gemma3TextConfig

    assert without_dtype(from_hf(Gemma3TextConfig.from_dict(dict(released)), torch.float32)) == without_dtype(
        CONFIGS[name](n_layers)
    )
    assert CONFIGS[name]()["n_layers"] == 2  # the --layers default: one sliding, one full layer
    assert CONFIGS[name]()["layer_types"] == [SLIDING, FULL]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_built_in_config_reads_back_from_its_transformers_config(name):
    cfg = CONFIGS[name]()
    assert from_hf(to_hf(cfg), cfg["dtype"]) == cfg


def test_family_is_registered_with_its_configs():
    from parity.model.registry import get_family

    assert get_family("gemma3") is FAMILY
    assert set(FAMILY.configs) == {"tiny", "linear", "270m-shape", "1b-shape"}
    assert FAMILY.exact_dtypes == (torch.float32, torch.bfloat16)
    assert {"F09", "F07", "F08", "F10"} <= {f.id for f in FAMILY.faults}


# --- parity


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", FAMILY.ci_configs)
def test_every_node_is_bit_identical_chained_and_isolated(config, dtype):
    pair = build_pair(config, dtype=dtype)
    assert pair.exact
    res = assert_exact(pair, batch_size=2, mode="both")
    assert all(n.max_abs == 0.0 for n in res.isolated)
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight
    assert res.meta["seq_len"] > pair.source.cfg["sliding_window"]


def test_tiny_exercises_what_the_released_models_use():
    cfg = CONFIGS["tiny"]()
    assert cfg["layer_types"] == [SLIDING] * 5 + [FULL]
    assert cfg["query_pre_attn_scalar"] ** -0.5 != cfg["head_dim"] ** -0.5  # a wrong scale cannot hide
    assert cfg["rope_local_base"] != cfg["rope_base"]
    assert cfg["n_heads"] // cfg["n_kv_heads"] > 1 and cfg["emb_dim"] != cfg["n_heads"] * cfg["head_dim"]
    assert CONFIGS["linear"]()["rope_scaling_factor"] == 8.0 and CONFIGS["linear"]()["final_logit_softcap"] == 30.0


def test_left_padded_batch_and_untied_head_with_bias():
    pair = build_pair("tiny", tie_word_embeddings=False, attention_bias=True, seed=2)
    assert pair.ours.out_head.weight is not pair.ours.tok_emb.weight
    assert_exact(pair, batch_size=3, left_pad=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_parity_from_saved_checkpoint(sharded, dtype, checkpoint_of):
    original = build_pair("linear", dtype=dtype, seed=3)
    directory = checkpoint_of(original, sharded=sharded)
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = build_pair(checkpoint=directory, dtype=dtype)
    assert without_dtype(pair.source.cfg) == without_dtype(original.source.cfg)
    assert "lm_head.weight" not in pair.loading.loaded_keys  # save_pretrained drops the tied head
    assert_exact(pair)
    ours, ref = pair.ours.blocks[5].att.q_norm.weight, pair.reference.model.layers[5].self_attn.q_norm.weight
    assert ours.data_ptr() == ref.data_ptr()


def test_legacy_rope_scaling_lands_on_full_layers_only(checkpoint_of):
    """A 4B+ config.json: rope_scaling linear x8 (Transformers 5 puts it on full_attention only),
    rope_theta and rope_local_base_freq at the top level."""
    directory = checkpoint_of(build_pair("linear"))
    config = json.loads((directory / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope[FULL]["rope_theta"],
        rope_local_base_freq=rope[SLIDING]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    (directory / "config.json").write_text(json.dumps(config))
    pair = build_pair(checkpoint=directory)
    assert pair.source.cfg["rope_scaling_factor"] == 8.0 and pair.source.cfg["rope_local_base"] == 10_000.0
    assert pair.facts.rope_of_type(SLIDING).rope_type == "default"
    assert pair.facts.rope_of_type(FULL).rope_type == "linear"
    assert_exact(pair)


def test_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(to_hf(CONFIGS["linear"]()).to_json_string())
    pair = build_pair(str(path))
    assert without_dtype(pair.source.cfg) == without_dtype(CONFIGS["linear"]())
    assert_exact(pair)


def test_generated_configs_agree_or_are_refused_in_one_line():
    for seed in range(3):
        cfg = draw_config(FAMILY.fields, CONFIGS["tiny"](), random.Random(seed))
        try:
            pair = build_pair(cfg, seed=seed)
        except ConfigError as e:
            assert "\n" not in str(e)
            continue
        assert_exact(pair, seq_len=12)


# --- what Gemma rounds, and where


def test_embedding_normaliser_is_rounded_to_bfloat16():
    """sqrt(1152) = 33.94 is 34.0 in bfloat16: Gemma multiplies by the rounded factor (its
    Gemma3TextScaledWordEmbedding), so ours must, or every bf16 embedding is off by 0.2%."""
    pair = build_pair("tiny", n_layers=1, emb_dim=1152, dtype=torch.bfloat16)  # Gemma 3 1B's width
    ids = torch.arange(pair.source.cfg["vocab_size"])[None]
    with torch.no_grad():
        ours, ref = pair.ours.tok_emb(ids), pair.reference.model.embed_tokens(ids)
        assert torch.equal(ours, ref)
        assert torch.equal(ours, pair.ours.tok_emb.weight[None] * torch.tensor(34.0, dtype=torch.bfloat16))


def test_attention_logit_softcapping_is_not_applied_by_the_reference():
    """The reason attn_logit_softcapping is refused: Gemma3Attention keeps it and never uses it."""
    pair = build_pair("tiny")
    pair.reference.config.attn_logit_softcapping = 0.01  # a cap that would flatten every score
    for layer in pair.reference.model.layers:
        layer.self_attn.attn_logit_softcapping = 0.01
    assert parity.check(pair).passed


# --- loader errors name the key


@pytest.fixture
def loader_case():
    pair = build_pair("tiny")
    with torch.device("meta"):
        model = Gemma3Model(pair.source.cfg)
    return model, pair.source.cfg, dict(pair.reference.state_dict())


def test_dropped_key_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    del sd["model.layers.2.pre_feedforward_layernorm.weight"]
    with pytest.raises(
        LoaderError, match=r"missing checkpoint keys: model\.layers\.2\.pre_feedforward_layernorm\.weight"
    ):
        load_weights_into_gemma3(model, cfg, sd)


def test_extra_key_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.self_attn.v_norm.weight"] = sd["model.layers.0.self_attn.k_norm.weight"]  # a Gemma 4 key
    with pytest.raises(LoaderError, match=r"unused checkpoint keys: model\.layers\.0\.self_attn\.v_norm\.weight"):
        load_weights_into_gemma3(model, cfg, sd)


def test_wrong_shape_raises_naming_the_key_and_both_shapes(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.1.self_attn.q_norm.weight"] = torch.zeros(32)  # a whole-projection norm
    with pytest.raises(
        LoaderError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight: checkpoint \(32,\), expected \(16,\)"
    ):
        load_weights_into_gemma3(model, cfg, sd)


# --- config fields we cannot honour


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        (
            {
                "rope_parameters": {
                    FULL: {
                        "rope_type": "yarn",
                        "rope_theta": 1e6,
                        "factor": 8.0,
                        "original_max_position_embeddings": 512,
                    },
                    SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope_parameters.full_attention.rope_type 'yarn'",
        ),
        (
            {
                "rope_parameters": {
                    FULL: {"rope_type": "default", "rope_theta": 1e6},
                    SLIDING: {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                }
            },
            "rope_parameters.sliding_attention.rope_type 'linear'",
        ),
        (
            {
                "rope_parameters": {
                    FULL: {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                    SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope_parameters.full_attention has unsupported fields: partial_rotary_factor",
        ),
    ],
    ids=["attn-softcap", "bidirectional", "relu", "yarn", "linear-sliding", "partial-rotary"],
)
def test_config_json_the_pair_cannot_honour_is_refused_naming_the_field(change, field, tmp_path):
    config = {**to_hf(CONFIGS["tiny"]()).to_dict(), **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=field):
        build_pair(config=str(path))


# --- CLI


def test_cli_check_passes(tmp_path, capsys):
    assert main(["check", "gemma3", "--report-dir", str(tmp_path), "--format", "json"]) == 0
    pair = build_pair("tiny")
    assert f"PASS: all {node_count(pair)} nodes agree" in capsys.readouterr().out


# --- real widths (slow; peak RSS in float32: 270M 2.4 GB, 1B 3.1 GB)


@pytest.mark.slow
@pytest.mark.parametrize("name, emb", [("270m-shape", 640), ("1b-shape", 1152)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_parity_at_real_widths(name, emb, dtype):
    pair = build_pair(name, dtype=dtype)
    assert (pair.source.cfg["emb_dim"], pair.source.cfg["head_dim"], pair.source.cfg["vocab_size"]) == (
        emb,
        256,
        262_144,
    )
    assert_exact(pair)
