"""SmolLM3: bit-exact parity with transformers.SmolLM3ForCausalLM from configs and checkpoints, the released
config read back, NoPE layers as SmolLM3Attention and SmolLM3Config decide them, config fields we refuse,
and loader errors by key. (Every CI config x source x dtype, the faults and the fields run in the contract
tests and the gate; this file holds what they cannot know.)"""

from __future__ import annotations

import json

import pytest
import torch

import parity
from parity.cli import main
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.common.layer_types import FULL, SLIDING
from reference_pairs.smollm3 import CONFIGS, FAMILY, SmolLM3Model, build_pair, load_weights_into_smollm3
from reference_pairs.smollm3.configs import SMOLLM3_YARN, nope_pattern
from reference_pairs.smollm3.family import from_hf, to_hf

NOPE_LAYER = 3  # tiny: layers 0-2 and 4 rotate


def assert_bit_exact(pair, **kw):
    res = parity.check(pair, **kw)
    assert res.passed, res.verdict()
    assert len(res.nodes) == len(FAMILY.node_specs(pair.facts)) == len(pair.nodes)
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def tiny_json(**changes) -> dict:
    return {**json.loads(to_hf(CONFIGS["tiny"]()).to_json_string()), **changes}


# --- the released config (HuggingFaceTB/SmolLM3-3B config.json, pre-5.0 form)

RELEASED_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "mlp_bias": False,
    "model_type": "smollm3",
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "pretraining_tp": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0.dev0",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 128256,
}


def test_3b_shape_is_the_released_config_json():
    from transformers import SmolLM3Config

    cfg = from_hf(SmolLM3Config.from_dict(dict(RELEASED_3B)), torch.float32)
    assert without_dtype(cfg) == without_dtype(CONFIGS["3b-shape"](36))
    assert cfg["head_dim"] == 128 and cfg["no_rope_layers"].count(0) == 9
    assert CONFIGS["3b-shape"]()["no_rope_layers"] == [1, 0]  # the --layers default keeps a NoPE layer


def test_3b_shape_has_the_released_parameter_count():
    """36 layers at the released widths: 3.08B parameters, the tied embedding counted once."""
    with torch.device("meta"):
        model = SmolLM3Model(CONFIGS["3b-shape"](36))
    assert sum(p.numel() for p in model.parameters()) == 3_075_098_624


def test_family_is_registered():
    from parity.model.registry import get_family

    assert get_family("smollm3") is FAMILY
    assert FAMILY.ci_configs == ("tiny", "yarn") and FAMILY.real_configs == ("3b-shape",)
    assert FAMILY.exact_dtypes == (torch.float32, torch.bfloat16)
    assert FAMILY.config_features("3b-shape") <= FAMILY.config_features("tiny") | FAMILY.config_features("yarn")


# --- NoPE layers: which ones, and what they compute


@pytest.mark.parametrize("n_layers, interval", [(5, 4), (36, 4), (7, 2), (3, 4), (6, 1)])
def test_nope_pattern_is_smollm3_configs_derivation(n_layers, interval):
    from transformers import SmolLM3Config

    config = SmolLM3Config(num_hidden_layers=n_layers, no_rope_layer_interval=interval)
    assert nope_pattern(n_layers, interval) == config.no_rope_layers


def test_config_without_a_list_reads_the_interval(tmp_path):
    config = tiny_json(no_rope_layer_interval=2)
    del config["no_rope_layers"]
    pair = build_pair(write_config(tmp_path, config))
    assert pair.source.cfg["no_rope_layers"] == [1, 0, 1, 0, 1]
    assert [b.att.use_rope for b in pair.ours.blocks] == [bool(f) for f in pair.source.cfg["no_rope_layers"]]
    assert_bit_exact(pair)


def test_the_reference_skips_rope_on_nope_layers_only_and_keeps_them_causal():
    """The docstring's claims held against SmolLM3Attention's own tensors: a NoPE layer's q_rot/k_rot are
    its q_proj/k_proj split into heads, a RoPE layer's are not; the NoPE layer still masks the future."""
    from parity.run.stages import trace_pair

    pair = build_pair("tiny")
    ref, _ = trace_pair(pair, pair.make_inputs(16))
    t = ref.tensors
    assert [layer.self_attn.use_rope for layer in pair.reference.model.layers] == [1, 1, 1, 0, 1]
    for i in range(5):
        q = t[f"model.layers.{i}.self_attn.q_proj"].view(1, 16, 4, 16).transpose(1, 2)
        k = t[f"model.layers.{i}.self_attn.k_proj"].view(1, 16, 2, 16).transpose(1, 2)
        assert torch.equal(t[f"model.layers.{i}.self_attn.q_rot"], q) == (i == NOPE_LAYER)
        assert torch.equal(t[f"model.layers.{i}.self_attn.k_rot"], k) == (i == NOPE_LAYER)
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    probs = t[f"model.layers.{NOPE_LAYER}.self_attn.probs"][0]
    assert torch.all(probs[:, j > i] == 0) and torch.all(probs[:, j <= i] > 0)


def test_rope_on_the_nope_layer_is_found_there():
    pair = build_pair("tiny")
    pair.ours.blocks[NOPE_LAYER].att.use_rope = True
    bad = parity.check(pair).first_mismatch
    assert bad.name == f"model.layers.{NOPE_LAYER}.self_attn.q_rot" and bad.hint.kind == "rope_unexpected"


# --- bit-exact parity beyond the CI configs


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"attention_bias": True, "mlp_bias": True},
        {"n_kv_heads": 4},
        {"n_kv_heads": 1, "head_dim": 32},
        {"no_rope_layers": [1] * 5},
        {"no_rope_layers": [0] * 5},
    ],
    ids=["untied", "biases", "mha", "mqa-wide-heads", "no-nope", "all-nope"],
)
def test_parity_from_varied_configs(overrides):
    pair = build_pair("tiny", seed=3, **overrides)
    assert (pair.ours.out_head.weight is pair.ours.tok_emb.weight) == pair.source.cfg["tie_word_embeddings"]
    res = assert_bit_exact(pair, batch_size=2)
    said = FAMILY.notes(pair.source.cfg)  # what the cfg cannot show, reported with the result
    assert bool(said) == ("no_rope_layers" in overrides) and all(note in res.notes for note in said)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_left_padded_batch_is_bit_identical(dtype):
    assert_bit_exact(build_pair("tiny", dtype=dtype), batch_size=3, left_pad=5)


def test_decode_with_a_cache_is_bit_identical():
    """Prefill in chunks, then token by token: the NoPE layer's cached keys are unrotated, the others' rotated."""
    res = parity.check(build_pair("tiny"), decode="6:3x2")
    assert res.passed, res.verdict()


def test_parity_from_saved_biased_checkpoint(checkpoint_of):
    directory = checkpoint_of(build_pair("tiny", seed=2, attention_bias=True, mlp_bias=True))
    pair = build_pair(checkpoint=directory)
    assert pair.source.cfg == {**CONFIGS["tiny"](), "attention_bias": True, "mlp_bias": True}
    assert pair.ours.blocks[1].ff.fc3.bias.data_ptr() == pair.reference.model.layers[1].mlp.down_proj.bias.data_ptr()
    assert_bit_exact(pair)


# --- the config mapping, both ways


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cfg_round_trips_through_smollm3config(name):
    cfg = CONFIGS[name](4)
    assert from_hf(to_hf(cfg), torch.float32) == cfg


def test_model_card_yarn_as_rope_scaling(tmp_path):
    """The model card's 128k recipe, written the pre-5.0 way (rope_theta and rope_scaling with "type")."""
    config = tiny_json(max_position_embeddings=131072)
    del config["rope_parameters"]
    config.update(
        rope_theta=5e6, rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536}
    )
    pair = build_pair(write_config(tmp_path, config))
    assert pair.source.cfg["rope_yarn"] == SMOLLM3_YARN and pair.source.cfg["rope_base"] == 5e6
    assert_bit_exact(pair)


def test_a_longer_no_rope_layers_list_is_read_as_transformers_reads_it(tmp_path):
    """The list may hold more entries than layers (Transformers reads the first num_hidden_layers)."""
    pair = build_pair(write_config(tmp_path, tiny_json(no_rope_layers=[1, 1, 0, 1, 1, 0, 0])))
    assert pair.source.cfg["no_rope_layers"] == [1, 1, 0, 1, 1]
    assert_bit_exact(pair)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": None}, "sliding_attention"),
        ({"layer_types": [FULL, FULL, FULL, SLIDING, FULL], "sliding_window": 4}, "sliding_attention"),
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers has 3 entries for num_hidden_layers=5"),
        ({"no_rope_layers": [1, 1, 1, "0", 1]}, "no_rope_layers"),  # SmolLM3Config itself refuses it
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e6}}, "rope_type 'linear'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    ],
    ids=["window", "sliding-layer", "short-list", "string-flag", "gelu", "linear", "partial-rotary"],
)
def test_from_hf_refuses_what_it_cannot_honour(change, field, tmp_path):
    config = tiny_json()
    for key, value in change.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    with pytest.raises(ConfigError, match=field):
        build_pair(write_config(tmp_path, config))


# --- loader errors name the key


@pytest.fixture
def loader_case():
    pair = build_pair("tiny")
    with torch.device("meta"):
        model = SmolLM3Model(pair.source.cfg)
    return model, pair.source.cfg, dict(pair.reference.state_dict())


def test_loader_keeps_the_tied_head_one_parameter(loader_case):
    model, cfg, sd = loader_case
    sd.pop("lm_head.weight", None)  # the released files may omit the tied head
    loaded = load_weights_into_smollm3(model, cfg, sd)
    assert model.out_head.weight is model.tok_emb.weight
    assert loaded["model.layers.3.self_attn.q_proj.weight"] == "blocks.3.att.W_query.weight"


def test_dropped_key_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    del sd["model.layers.3.post_attention_layernorm.weight"]
    with pytest.raises(LoaderError, match=r"model\.layers\.3\.post_attention_layernorm\.weight"):
        load_weights_into_smollm3(model, cfg, sd)


def test_mis_shaped_key_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # MHA's k_proj, not GQA's (32, 64)
    with pytest.raises(LoaderError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: checkpoint \(64, 64\)"):
        load_weights_into_smollm3(model, cfg, sd)


def test_extra_layer_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.5.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(LoaderError, match=r"model\.layers\.5\.mlp\.up_proj\.weight -> blocks\.5\.ff\.fc2\.weight"):
        load_weights_into_smollm3(model, cfg, sd)


def test_bias_keys_without_biases_in_the_config_are_refused(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(96)
    with pytest.raises(LoaderError, match=r"model\.layers\.0\.mlp\.gate_proj\.bias"):
        load_weights_into_smollm3(model, cfg, sd)


# --- CLI


def test_cli_check_passes(tmp_path, capsys):
    assert main(["check", "smollm3", "--report-dir", str(tmp_path)]) == 0
    assert "PASS: all 84 nodes agree" in capsys.readouterr().out


# --- real widths (slow: about 2.3 GB of float32 weights per side at the default 2 layers)


@pytest.mark.slow
def test_parity_at_3b_widths():
    pair = build_pair("3b-shape")
    cfg = pair.source.cfg
    assert (cfg["emb_dim"], cfg["head_dim"], cfg["n_kv_heads"], cfg["no_rope_layers"]) == (2048, 128, 4, [1, 0])
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight
    assert_bit_exact(pair)
