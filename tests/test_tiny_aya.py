"""Tiny Aya from scratch against transformers.Cohere2ForCausalLM: parity, faults, loader, configs, CLI."""

from __future__ import annotations

import json
import types

import pytest
import torch

import parity
from parity.cli import main
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.common.blocks import ParallelBlock
from reference_pairs.common.norms import LayerNorm, RMSNorm
from reference_pairs.tiny_aya import CONFIGS, FAMILY, TinyAyaModel, build_pair, load_weights_into_tiny_aya
from reference_pairs.tiny_aya.configs import FULL, SLIDING
from reference_pairs.tiny_aya.family import to_hf

NODES_PER_LAYER = len(FAMILY.nodes.per_layer)


def assert_holds(pair, **kw):
    res = parity.check(pair, **kw)
    assert res.first_mismatch is None, res.verdict()
    assert all(n.status == "ok" for n in res.nodes)
    return res


def first_bad(pair) -> parity.NodeResult:
    res = parity.check(pair)
    assert res.first_mismatch is not None, "the fault went unnoticed"
    return res.first_mismatch


def sequential_forward(self, x, cos, sin, padding_mask=None, cache=None):
    """The fault: a Llama-style sequential block, x' = x + A(N(x)), y = x' + F(N(x'))."""
    x = x + self.att(self.input_layernorm(x), cos, sin, padding_mask, cache)
    return x + self.ff(self.input_layernorm(x))


# --- parity -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": False},
        {"attention_bias": True},
        {"n_kv_heads": 4},
        {"n_kv_heads": 1, "head_dim": 16},
    ],
    ids=["tiny", "untied", "bias", "mha", "mqa-wide-heads"],
)
def test_parity_from_random_config(overrides):
    pair = build_pair("tiny", seed=len(overrides), **overrides)
    res = assert_holds(pair)
    assert pair.source.cfg["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL]
    assert len(res.nodes) == len(pair.nodes) == 1 + NODES_PER_LAYER * 4 + 3
    assert res.meta["seq_len"] > pair.source.cfg["sliding_window"]
    assert not res.notes


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_parity_from_saved_checkpoint(sharded, checkpoint_of):
    directory = checkpoint_of(build_pair("tiny", seed=3), sharded=sharded)
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = build_pair(checkpoint=directory)
    assert pair.source.cfg == CONFIGS["tiny"]()
    assert_holds(pair)
    assert pair.ours.out_head.weight is pair.ours.tok_emb.weight
    assert (
        pair.ours.blocks[1].ff.fc1.weight.data_ptr() == pair.reference.model.layers[1].mlp.gate_proj.weight.data_ptr()
    )


def test_untied_checkpoint_keeps_its_own_head(checkpoint_of):
    pair = build_pair(checkpoint=checkpoint_of(build_pair("tiny", tie_word_embeddings=False)))
    assert pair.ours.out_head.weight is not pair.ours.tok_emb.weight
    assert_holds(pair)


def test_parity_from_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(to_hf(CONFIGS["tiny"]()).to_json_string())
    assert_holds(build_pair(str(path)))


def test_parity_in_bfloat16_with_a_batch():
    assert_holds(build_pair("tiny", dtype=torch.bfloat16), batch_size=2)


# --- the architecture's claims, checked on the reference's own tensors --------------------------


def test_reference_semantics_parallel_block_nope_full_layers_and_window():
    """mlp@input is the normalized input; full layers' q_rot is the unrotated q_proj; sliding
    layers see a window of 4, the full layer is causal only."""
    from parity.run.stages import trace_pair

    pair = build_pair("tiny")
    ref, _ = trace_pair(pair, pair.make_inputs(16))
    t = ref.tensors
    for i in range(4):
        assert torch.equal(t[f"model.layers.{i}.mlp@input"], t[f"model.layers.{i}.input_layernorm"])
        q = t[f"model.layers.{i}.self_attn.q_proj"].view(1, 16, 4, 8).transpose(1, 2)
        assert torch.equal(t[f"model.layers.{i}.self_attn.q_rot"], q) == (i == 3)
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    sliding, full = t["model.layers.0.self_attn.probs"][0, 0], t["model.layers.3.self_attn.probs"][0, 0]
    assert torch.all(sliding[(j > i) | (i - j >= 4)] == 0) and torch.all(sliding[(j <= i) & (i - j < 4)] > 0)
    assert torch.all(full[j > i] == 0) and torch.all(full[j <= i] > 0)


def test_layer_norm_subtracts_the_mean_and_rmsnorm_does_not():
    x = torch.randn(2, 5, 16)
    norm, rms = LayerNorm(16), RMSNorm(16, eps=1e-5)
    assert torch.allclose(norm(x + 3.0), norm(x), atol=1e-5)
    assert not torch.allclose(rms(x + 3.0), rms(x), atol=1e-2)


# --- fault injection: first_mismatch names the node where the fault enters ---------------------


def test_sequential_residual_is_found_at_mlp_input():
    pair = build_pair("tiny")
    for block in pair.ours.blocks:
        block.forward = types.MethodType(sequential_forward, block)
    assert first_bad(pair).name == "model.layers.0.mlp@input"


def test_rmsnorm_instead_of_layernorm_is_found_at_input_layernorm():
    pair = build_pair("tiny")
    norm = pair.ours.blocks[0].input_layernorm
    rms = RMSNorm(pair.source.cfg["emb_dim"], eps=norm.eps)
    rms.weight = norm.weight
    pair.ours.blocks[0].input_layernorm = rms
    assert first_bad(pair).name == "model.layers.0.input_layernorm"


def test_half_split_rope_is_found_at_first_sliding_q_rot():
    pair = build_pair("tiny")
    for block in pair.ours.blocks:
        block.att.interleaved_rope = False  # Llama's rotate-half and concatenated tables
    first_sliding = pair.source.cfg["layer_types"].index(SLIDING)
    assert first_bad(pair).name == f"model.layers.{first_sliding}.self_attn.q_rot"


def test_rope_on_the_full_layer_is_found_at_its_q_rot():
    pair = build_pair("tiny")
    full = pair.source.cfg["layer_types"].index(FULL)
    params = pair.ours.rope_parameters()
    pair.ours.rope_parameters = lambda: {**params, FULL: params[SLIDING]}  # full layers rotate too
    assert first_bad(pair).name == f"model.layers.{full}.self_attn.q_rot"


def test_missing_logit_scale_is_found_at_logits_not_lm_head():
    pair = build_pair("tiny")
    pair.ours.logit_scale = 1.0
    res = parity.check(pair)
    bad = res.first_mismatch
    assert bad.name == "logits"
    assert next(n for n in res.nodes if n.name == "lm_head").passed
    assert bad.hint.kind == "logit_scale" and "16" in bad.hint.text


# --- loader -------------------------------------------------------------------------------------


def fresh(cfg):
    with torch.device("meta"):
        return TinyAyaModel(cfg)


def test_loader_keeps_tied_embeddings_one_parameter():
    pair = build_pair("tiny")
    cfg, sd = pair.source.cfg, dict(pair.reference.state_dict())
    model = fresh(cfg)
    loaded = load_weights_into_tiny_aya(model, cfg, sd)
    assert model.out_head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    assert loaded["model.embed_tokens.weight"] == "tok_emb.weight"


@pytest.mark.parametrize(
    "damage, key",
    [
        (lambda sd: sd.pop("model.layers.2.mlp.up_proj.weight"), "model.layers.2.mlp.up_proj.weight"),
        (
            lambda sd: sd.__setitem__("model.layers.1.post_attention_layernorm.weight", torch.ones(32)),
            "model.layers.1.post_attention_layernorm.weight",
        ),
        (
            lambda sd: sd.__setitem__("model.layers.3.self_attn.k_proj.weight", torch.zeros(32, 32)),
            "model.layers.3.self_attn.k_proj.weight",
        ),
    ],
    ids=["dropped", "extra", "shape"],
)
def test_loader_rejects_bad_state_dict_naming_the_key(damage, key):
    pair = build_pair("tiny")
    sd = dict(pair.reference.state_dict())
    damage(sd)
    with pytest.raises(LoaderError, match=key.replace(".", r"\.")):
        load_weights_into_tiny_aya(fresh(pair.source.cfg), pair.source.cfg, sd)


# --- configs ------------------------------------------------------------------------------------


def test_3b_shape_is_tiny_aya_3_35b():
    """The real widths give the model card's 3.35B parameters (the tied embedding counted once)."""
    cfg = CONFIGS["3b-shape"](36)
    assert cfg["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL] * 9
    model = fresh(cfg)
    assert sum(p.numel() for p in model.parameters()) == 3_349_227_520
    assert CONFIGS["3b-shape"]()["layer_types"] == [SLIDING, FULL]


def json_config(tmp_path, **changes):
    config = json.loads(to_hf(CONFIGS["tiny"]()).to_json_string())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}}, "rope_type 'linear'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_qk_norm": True}, "use_qk_norm=True"),
        ({"use_parallel_block": False}, "use_parallel_block=False"),
        ({"layer_types": [SLIDING, SLIDING, SLIDING, "chunked_attention"]}, "chunked_attention"),
    ],
    ids=["rope-type", "partial-rotary", "activation", "qk-norm", "sequential", "layer-type"],
)
def test_from_hf_refuses_what_it_cannot_honour(changes, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        build_pair(json_config(tmp_path, **changes))


def test_legacy_config_json_form_is_read_as_transformers_reads_it(tmp_path):
    """Pre-5.0 form: top-level rope_theta, sliding_window_pattern instead of layer_types, and the
    original Cohere switches at the only values Cohere2ForCausalLM implements."""
    config = json.loads(to_hf(CONFIGS["tiny"]()).to_json_string())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    del config["layer_types"]
    config.update(sliding_window_pattern=4, use_qk_norm=False, use_parallel_block=True, rotary_pct=1.0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    pair = build_pair(str(path))
    assert pair.source.cfg == CONFIGS["tiny"]()
    assert_holds(pair)


def test_rope_type_override_is_refused():
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        build_pair("tiny", rope_type="yarn")


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_pass_exit_0(tmp_path, capsys):
    assert main(["check", "tiny_aya", "--report-dir", str(tmp_path)]) == 0
    assert f"PASS: all {1 + NODES_PER_LAYER * 4 + 3} nodes agree" in capsys.readouterr().out


def test_cli_fault_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ParallelBlock, "forward", sequential_forward)
    assert main(["check", "tiny_aya", "--report-dir", str(tmp_path), "--format", "json"]) == 1
    assert "model.layers.0.mlp@input" in capsys.readouterr().out
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert json.loads((folder / "result.json").read_text())["first_mismatch"]["name"] == "model.layers.0.mlp@input"


# --- real widths --------------------------------------------------------------------------------


@pytest.mark.slow
def test_parity_3b_shape():
    pair = build_pair("3b-shape")
    assert (
        pair.source.cfg["emb_dim"],
        pair.source.cfg["n_heads"],
        pair.source.cfg["n_kv_heads"],
        pair.source.cfg["vocab_size"],
    ) == (2048, 16, 4, 262_144)
    res = assert_holds(pair)
    assert any("logit_scale is 1.0" in note for note in res.notes)
