"""Gemma 4 (dense text, E2B/E4B) from scratch against transformers.Gemma4ForCausalLM: bit-exact parity
from configs and checkpoints in float32 and bfloat16, the released configs read back, what the facts
and nodes say about per-layer head_dim, KV sharing, K = V and per-layer inputs, loader errors by key,
config fields the pair refuses, and the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

import parity
from parity.cli import main
from parity.model.fields import draw_config
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.gemma4 import CONFIGS, FAMILY, Gemma4Model, build_pair, load_weights_into_gemma4
from reference_pairs.gemma4.configs import FULL, SLIDING
from reference_pairs.gemma4.family import from_hf, to_hf

DTYPES = [torch.float32, torch.bfloat16]


def node_count(pair) -> int:
    return len(FAMILY.node_specs(pair.facts))


def assert_exact(pair, **kw) -> parity.CheckResult:
    """Every node bit-identical (Gemma 4 claims float32 and bfloat16)."""
    res = parity.assert_bit_exact(pair, **kw)
    assert len(res.nodes) == len(pair.nodes) == node_count(pair)
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


# --- the released text configs (text_config of google/gemma-4-E2B and -E4B config.json)

ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}
RELEASED_E2B = {
    "model_type": "gemma4_text",
    "hidden_size": 1536,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "attention_k_eq_v": False,
    "sliding_window": 512,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "intermediate_size": 6144,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": 30.0,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "enable_moe_block": False,
    "rope_parameters": ROPE,
    "layer_types": ([SLIDING] * 4 + [FULL]) * 7,
}
RELEASED_E4B = {
    **RELEASED_E2B,
    "hidden_size": 2560,
    "num_hidden_layers": 42,
    "num_key_value_heads": 2,
    "intermediate_size": 10240,
    "num_kv_shared_layers": 18,
    "use_double_wide_mlp": False,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 7,
}


@pytest.mark.parametrize(
    "released, name, n_layers", [(RELEASED_E2B, "e2b-shape", 35), (RELEASED_E4B, "e4b-shape", 42)], ids=["e2b", "e4b"]
)
def test_shape_configs_are_the_released_config_json(released, name, n_layers):
    from transformers import Gemma4TextConfig

    assert without_dtype(from_hf(Gemma4TextConfig.from_dict(json.loads(json.dumps(released))), torch.float32)) == (
        without_dtype(CONFIGS[name](n_layers))
    )
    short = CONFIGS[name]()
    assert short["n_layers"] == 2 and short["layer_types"] == [SLIDING, FULL] and short["num_kv_shared_layers"] == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_built_in_config_reads_back_from_its_transformers_config(name):
    cfg = CONFIGS[name]()
    assert from_hf(to_hf(cfg), cfg["dtype"]) == cfg


def test_family_is_registered_with_its_configs():
    from parity.model.registry import get_family

    assert get_family("gemma4") is FAMILY
    assert set(FAMILY.configs) == {"tiny", "k-eq-v", "e2b-shape", "e4b-shape"}
    assert FAMILY.exact_dtypes == (torch.float32, torch.bfloat16)


# --- facts and nodes


def test_facts_give_each_layer_its_head_dim_kv_source_and_scale():
    pair = build_pair("k-eq-v")
    layers = pair.facts.layers
    assert [layer.head_dim for layer in layers] == [8, 8, 16, 8, 8, 16]
    assert [layer.kv_source for layer in layers] == [None, None, None, 1, 1, 2]
    assert [layer.k_eq_v for layer in layers] == [False, False, True, False, False, False]
    assert [layer.num_kv_heads for layer in layers] == [2, 2, 1, 2, 2, 1]
    assert {layer.attention_scale for layer in layers} == {1.0}
    full = pair.facts.rope_of_type(FULL)
    assert (full.rope_type, full.rotary_dim, full.inv_freq[2:]) == ("proportional", 16, (0.0,) * 6)
    assert pair.facts.features >= {"per-layer inputs", "KV sharing", "K = V", "double-wide MLP", "per-layer head_dim"}
    assert pair.facts.qk_norm == "head" and pair.facts.embed_scale == 32**0.5 and pair.facts.norm_weight_offset == 0.0


def test_node_map_follows_kv_sharing_and_per_layer_inputs():
    pair = build_pair("k-eq-v")
    names = {n.name for n in pair.nodes}
    att = "model.layers.{}.self_attn.{}"
    assert att.format(0, "v_proj") in names and att.format(2, "v_proj") not in names  # K = V on the full layer
    for shared in (3, 4, 5):  # no projections of their own; their k_rot is the keys they read
        assert not {att.format(shared, k) for k in ("k_proj", "v_proj", "k_norm", "v_norm")} & names
        assert att.format(shared, "k_rot") in names
    assert {"model.embed_tokens_per_layer", "model.layers.5@per_layer_input", "logits"} <= names
    assert any("3 <- 1, 4 <- 1, 5 <- 2" in note for note in pair.notes)


def test_random_weights_carry_the_persistent_layer_scalar():
    pair = build_pair("tiny")
    scalars = [pair.loading.state_dict[f"model.layers.{i}.layer_scalar"] for i in range(6)]
    assert all(s.shape == (1,) and s.item() != 1.0 for s in scalars)  # drawn near 1, not 1: a dropped one shows
    assert pair.ours.blocks[0].layer_scalar.data_ptr() == pair.reference.model.layers[0].layer_scalar.data_ptr()


# --- parity


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", FAMILY.ci_configs)
def test_every_node_is_bit_identical_chained_and_isolated(config, dtype):
    pair = build_pair(config, dtype=dtype)
    assert pair.exact
    res = assert_exact(pair, batch_size=2, mode="both")
    assert all(n.max_abs == 0.0 for n in res.isolated)
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight


def test_left_padded_batch_untied_with_bias():
    pair = build_pair("tiny", tie_word_embeddings=False, attention_bias=True, seed=2)
    assert_exact(pair, batch_size=3, left_pad=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_parity_from_saved_checkpoint(sharded, dtype, checkpoint_of):
    original = build_pair("tiny", dtype=dtype, seed=3)
    directory = checkpoint_of(original, sharded=sharded)
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = build_pair(checkpoint=directory, dtype=dtype)
    assert without_dtype(pair.source.cfg) == without_dtype(original.source.cfg)
    assert (
        "model.layers.0.layer_scalar" in pair.loading.loaded_keys
        and "model.layers.3.self_attn.k_proj.weight" not in pair.loading.state_dict
    )
    assert_exact(pair)


def test_config_json_path_with_k_eq_v(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(to_hf(CONFIGS["k-eq-v"]()).to_json_string())
    pair = build_pair(str(path))
    assert without_dtype(pair.source.cfg) == without_dtype(CONFIGS["k-eq-v"]())
    assert_exact(pair)


def test_without_per_layer_inputs_or_kv_sharing():
    """Gemma 4 31B's dense shape: no per-layer inputs, no KV sharing, every FFN single width."""
    pair = build_pair("tiny", hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
    assert not {"per-layer inputs", "KV sharing"} & pair.facts.features
    assert not any("per_layer" in n.name for n in pair.nodes)
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


# --- loader errors name the key


@pytest.fixture
def loader_case():
    pair = build_pair("tiny")
    with torch.device("meta"):
        model = Gemma4Model(pair.source.cfg)
    return model, pair.source.cfg, dict(pair.reference.state_dict())


def test_dropped_layer_scalar_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    del sd["model.layers.4.layer_scalar"]
    with pytest.raises(LoaderError, match=r"missing checkpoint keys: model\.layers\.4\.layer_scalar"):
        load_weights_into_gemma4(model, cfg, sd)


def test_projection_of_a_kv_shared_layer_raises_naming_it(loader_case):
    """A checkpoint whose shared layer still has a k_proj: ours has nowhere to put it."""
    model, cfg, sd = loader_case
    sd["model.layers.3.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(
        LoaderError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight -> blocks\.3\.att\.W_key\.weight"
    ):
        load_weights_into_gemma4(model, cfg, sd)


def test_single_wide_ffn_on_a_shared_layer_raises_naming_the_shapes(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.5.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(
        LoaderError, match=r"model\.layers\.5\.mlp\.up_proj\.weight: checkpoint \(64, 32\), expected \(128, 32\)"
    ):
        load_weights_into_gemma4(model, cfg, sd)


# --- config fields we cannot honour


def _config(**change) -> dict:
    return {**to_hf(CONFIGS["tiny"]()).to_dict(), **change}


@pytest.mark.parametrize(
    "change, field",
    [
        (
            {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
            "enable_moe_block",
        ),
        ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5 leaves a shared layer type"),
        ({"hidden_size_per_layer_input": 0}, "num_kv_shared_layers=3 with hidden_size_per_layer_input=0"),
        ({"vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input=100 is smaller than vocab_size=257"),
        (
            {
                "rope_parameters": {
                    **ROPE,
                    FULL: {
                        "rope_type": "yarn",
                        "rope_theta": 1e6,
                        "factor": 4.0,
                        "original_max_position_embeddings": 256,
                    },
                }
            },
            "rope_parameters.full_attention.rope_type 'yarn'",
        ),
        (
            {
                "rope_parameters": {
                    **ROPE,
                    SLIDING: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                }
            },
            "rope_parameters.sliding_attention has unsupported fields: partial_rotary_factor",
        ),
        ({"per_layer_config": {"0": {"intermediate_size": 32}}}, "per_layer_config overrides intermediate_size"),
    ],
    ids=[
        "moe",
        "bidirectional",
        "relu",
        "no-producer",
        "sharing-without-ple",
        "small-ple-vocab",
        "yarn",
        "partial-sliding",
        "per-layer-ffn",
    ],
)
def test_config_json_the_pair_cannot_honour_is_refused_naming_the_field(change, field, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(**change)))
    with pytest.raises(ConfigError, match=field):
        build_pair(config=str(path))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": [FULL, SLIDING, FULL, SLIDING, FULL, SLIDING]}, "layer_types must end with full_attention"),
        ({"num_global_kv_heads": 1}, "num_global_kv_heads is read only with attention_k_eq_v"),
    ],
    ids=["last-sliding", "global-kv-without-k-eq-v"],
)
def test_cfg_that_gemma4_would_change_silently_is_refused(change, field):
    with pytest.raises(ConfigError, match=field):
        build_pair("tiny", **change)


# --- CLI


def test_cli_check_passes(tmp_path, capsys):
    assert main(["check", "gemma4", "--report-dir", str(tmp_path), "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert f"PASS: all {node_count(build_pair('tiny'))} nodes agree" in out and "3 <- 1, 4 <- 1, 5 <- 2" in out


# --- real widths (slow; peak RSS in float32: E2B 4.2 GB, E4B 5.7 GB at 2 layers, E2B 10.6 GB at 16 layers, KV-shared)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, emb, n_layers",
    [("e2b-shape", 1536, 2), ("e4b-shape", 2560, 2), ("e2b-shape", 1536, 16)],
    ids=["e2b", "e4b", "e2b-kv-shared"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_parity_at_real_widths(name, emb, n_layers, dtype):
    pair = build_pair(name, n_layers=n_layers, dtype=dtype)
    assert (pair.source.cfg["emb_dim"], pair.source.cfg["global_head_dim"], pair.source.cfg["vocab_size"]) == (
        emb,
        512,
        262_144,
    )
    assert ("KV sharing" in pair.facts.features) == (n_layers > 15)
    assert_exact(pair)


# --- the general pieces Gemma 4 brought: named-argument nodes, a weightless norm, KV-shared attention


class _TakesSideInput(torch.nn.Module):
    def forward(self, x, side=None, scale=1.0):
        return x + side * scale


class _Caller(torch.nn.Module):
    def __init__(self, positional: bool):
        super().__init__()
        self.inner, self.positional = _TakesSideInput(), positional

    def forward(self, x):
        side = x * 2
        return self.inner(x, side) if self.positional else self.inner(x, side=side)


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
def test_argument_nodes_record_and_substitute_a_named_forward_argument(positional):
    from parity.record.hooks import recording
    from parity.record.trace import Trace

    x = torch.arange(6.0).reshape(1, 2, 3)
    model = _Caller(positional)
    with recording(model, [("side", "inner@side"), ("out", "inner")]) as trace:
        model(x)
    assert torch.equal(trace.tensors["side"], x * 2)
    substitute = Trace(tensors={"side": torch.zeros_like(x)})
    with recording(model, [("side", "inner@side")], substitute=substitute):
        assert torch.equal(model(x), x)  # the reference's side input (zeros) replaced ours
    with recording(model, [("none", "inner@scale")]) as trace:  # left at its default: nothing recorded
        model(x)
    assert "none" not in trace.tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norms_match_gemma4_with_and_without_weight(dtype):
    """Gemma4RMSNorm writes pow(ms + eps, -0.5) where ours writes rsqrt: the same bits."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from reference_pairs.common.norms import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 16, 64, generator=gen) * torch.logspace(-3, 1, 64)).to(dtype)
    for with_scale in (True, False):
        theirs = Gemma4RMSNorm(64, eps=1e-6, with_scale=with_scale).to(dtype)
        ours = RMSNorm(64, eps=1e-6, weight=with_scale, dtype=dtype)
        if with_scale:
            theirs.weight.data = 1 + 0.1 * torch.randn(64, generator=gen).to(dtype)
            ours.weight = theirs.weight
        with torch.no_grad():
            assert torch.equal(ours(x), theirs(x))
    with pytest.raises(ValueError, match="weight=False has none"):
        RMSNorm(8, weight=False, unit_offset=True)


def test_kv_shared_attention_needs_the_keys_it_shares():
    from reference_pairs.common.attention import GroupedQueryAttention

    att = GroupedQueryAttention(16, 2, 1, 8, kv_shared=True)
    assert not hasattr(att, "W_key") and not hasattr(att, "W_value")
    with pytest.raises(ValueError, match="shared_kv="):
        att(torch.zeros(1, 3, 16))
    with pytest.raises(ValueError, match="kv_shared layer computes no keys"):
        GroupedQueryAttention(16, 2, 1, 8, kv_shared=True, k_eq_v=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_with_kv_shared_layers_is_bit_exact(dtype):
    """Prompt in chunks, then decode steps, on a left-padded batch: the KV-shared layers (3..5) read
    their source layer's cache after its update and keep none of their own; every node and every
    cache that exists on the reference's side agrees bit for bit."""
    pair = build_pair("tiny", dtype=dtype)
    res = parity.check(pair, batch_size=2, left_pad=3, decode="12:4x4", exact=True)
    assert res.passed, res.verdict()
    caches = {n.name.split("/", 1)[1] for n in res.nodes if n.kind == "cache.keys"}
    assert caches == {f"model.layers.{i}.self_attn.cache.keys" for i in range(3)}


def test_a_kv_shared_layer_that_reads_only_this_steps_keys_is_found_at_its_first_decode_step(monkeypatch):
    """The source layer hands on only the keys of the current call (not its cache): a prompt in one call
    agrees, the first later step's shared layer sees too few keys."""
    from reference_pairs.common.attention import GroupedQueryAttention

    forward = GroupedQueryAttention.forward

    def hand_on_this_call_only(self, x, *args, **kwargs):
        out = forward(self, x, *args, **kwargs)
        if self.kv is not None:
            keys, values, start = self.kv
            s = x.shape[1]
            self.kv = (keys[..., -s:, :], values[..., -s:, :], start + keys.shape[-2] - s)
        return out

    monkeypatch.setattr(GroupedQueryAttention, "forward", hand_on_this_call_only)
    res = parity.check(build_pair("tiny"), decode="8:8x3")
    bad = res.first_mismatch
    assert bad.name == "step1/model.layers.3.self_attn.k_rot", res.verdict()
