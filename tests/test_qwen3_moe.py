"""Qwen3-MoE: bit-exact parity with transformers.Qwen3MoeForCausalLM, the router and every expert as
nodes, the fused expert tensors split into one SwiGLU per expert (every slice loaded exactly once),
which layers are sparse, and a different expert choice as its own status."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from torch import nn

import parity
import parity.build
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.common.mlp import GatedMLP
from reference_pairs.common.moe import SparseMoE
from reference_pairs.qwen3_moe import CONFIGS, FAMILY, Qwen3MoeModel, build_pair, load_weights_into_qwen3_moe
from reference_pairs.qwen3_moe.family import from_hf, to_hf


def assert_bit_exact(pair, **kw):
    res = parity.check(pair, **kw)
    assert res.passed, res.verdict()
    assert len(res.nodes) == len(FAMILY.node_specs(pair.facts)) == len(pair.nodes)
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]
    return res


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


RELEASED_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_shape_config_is_the_released_config_json():
    from transformers import Qwen3MoeConfig

    cfg = from_hf(Qwen3MoeConfig.from_dict(dict(RELEASED_30B_A3B)), torch.float32)
    assert without_dtype(cfg) == without_dtype(CONFIGS["30b-a3b-shape"](48))
    assert CONFIGS["30b-a3b-shape"]()["n_layers"] == 2


def test_family_is_registered():
    from parity.model.registry import get_family

    assert get_family("qwen3_moe") is FAMILY
    assert FAMILY.ci_configs == ("tiny-moe",) and FAMILY.default_config == "tiny-moe"


def test_tiny_moe_has_sparse_and_dense_layers_and_every_expert_as_a_node():
    pair = build_pair("tiny-moe")
    assert [layer.num_experts for layer in pair.facts.layers] == [8, 0, 8]
    assert [type(b.ff) for b in pair.ours.blocks] == [SparseMoE, GatedMLP, SparseMoE]
    names = {n.name for n in pair.nodes}
    assert {f"model.layers.0.mlp.experts.{e}" for e in range(8)} <= names
    assert "model.layers.1.mlp.gate_proj" in names and "model.layers.1.mlp.experts" not in names
    assert "model.layers.0.mlp.gate_proj" not in names


# --- bit-exact parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_node_is_bit_identical(dtype):
    pair = build_pair("tiny-moe", dtype=dtype)
    res = assert_bit_exact(pair, batch_size=2, mode="both")
    assert all(n.max_abs == 0.0 for n in res.isolated)
    experts = [n for n in res.nodes if n.kind == "expert"]
    assert len(experts) == 16 and all(n.shape_ref == (32, 32) for n in experts)
    choice = next(n for n in res.nodes if n.name == "model.layers.0.mlp.router.experts")
    assert choice.dtype == "int64" and choice.status == "ok"


def test_parity_with_top_k_weights_as_probabilities_and_a_sparse_step():
    pair = build_pair("tiny-moe", norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[], n_layers=4)
    assert [layer.sparse for layer in pair.facts.layers] == [False, True, False, True]
    assert_bit_exact(pair, batch_size=2, left_pad=3)


def test_every_expert_chosen_top_8_of_16_in_bfloat16():
    """Eight experts per token, as the 30B model: bf16 sums their contributions in expert order."""
    assert_bit_exact(
        build_pair("tiny-moe", num_experts=16, num_experts_per_tok=8, n_layers=1, dtype=torch.bfloat16), batch_size=2
    )


@pytest.mark.parametrize(
    "sharded, dtype", [(False, torch.float32), (True, torch.bfloat16)], ids=["single-fp32", "sharded-bf16"]
)
def test_parity_from_saved_checkpoint(sharded, dtype, checkpoint_of):
    """(The gate runs every CI config from single and sharded checkpoints in both dtypes.)"""
    original = build_pair("tiny-moe", seed=5, dtype=dtype)
    directory = checkpoint_of(original, sharded=sharded)
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = build_pair(checkpoint=directory, dtype=dtype)
    assert without_dtype(pair.source.cfg) == without_dtype(original.source.cfg)
    res = assert_bit_exact(pair)
    assert res.coverage.ok and not res.coverage.unused and not res.coverage.unwritten
    conversions = " ".join(res.coverage.conversions)
    # save_pretrained writes one module per expert (the released format); Transformers fuses them on load
    assert (
        "model.layers.0.mlp.experts.0.gate_proj.weight .. model.layers.0.mlp.experts.7.up_proj.weight (16 tensors): "
        "merged into model.layers.0.mlp.experts.gate_up_proj" in conversions
    )
    assert "model.layers.0.mlp.experts.gate_up_proj: split into 16 views" in conversions


def test_parity_from_a_checkpoint_in_the_fused_layout(checkpoint_of):
    """A checkpoint holding the model's own fused tensors (a state dict saved as it is) loads too."""
    from safetensors.torch import save_file

    directory = checkpoint_of(build_pair("tiny-moe", seed=2))
    for f in directory.glob("*.safetensors"):
        f.unlink()
    original = build_pair("tiny-moe", seed=2)
    save_file(
        {k: v.contiguous() for k, v in original.loading.state_dict.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    pair = build_pair(checkpoint=directory)
    assert not [c for c in pair.loading.conversions if "merged" in c]
    assert_bit_exact(pair)


# --- the fused experts, split


def test_loader_splits_gate_before_up_as_views_of_the_checkpoint():
    pair = build_pair("tiny-moe")
    fused = pair.loading.state_dict["model.layers.2.mlp.experts.gate_up_proj"]  # (E, 2I, H)
    down = pair.loading.state_dict["model.layers.2.mlp.experts.down_proj"]  # (E, H, I)
    expert = pair.ours.blocks[2].ff.experts[5]
    assert torch.equal(expert.fc1.weight, fused[5, :16]) and torch.equal(expert.fc2.weight, fused[5, 16:])
    assert torch.equal(expert.fc3.weight, down[5])
    assert expert.fc1.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # a view, no copy
    sources = parity.check(pair).coverage.sources
    assert [(s.key, s.how, s.region) for s in sources["blocks.2.ff.experts.5.fc2.weight"]] == [
        ("model.layers.2.mlp.experts.gate_up_proj", "slice", "[5, 16:32, :]")
    ]


def copying_loader(model, cfg, state_dict):
    """A deliberately wrong loader: expert 3 of layer 0 gets a copy of its weights, not a view."""
    loaded = load_weights_into_qwen3_moe(model, cfg, state_dict)
    fc1 = model.blocks[0].ff.experts[3].fc1
    fc1.weight = nn.Parameter(fc1.weight.detach().clone(), requires_grad=False)
    return loaded


def overlapping_loader(model, cfg, state_dict):
    """A deliberately wrong loader: expert 3's up projection is its gate rows again (one slice twice, one never)."""
    loaded = load_weights_into_qwen3_moe(model, cfg, state_dict)
    expert = model.blocks[0].ff.experts[3]
    expert.fc2.weight = nn.Parameter(state_dict["model.layers.0.mlp.experts.gate_up_proj"][3, :16], requires_grad=False)
    return loaded


def test_coverage_accounts_for_every_slice_exactly_once():
    copied = parity.check(parity.build.build_pair(dataclasses.replace(FAMILY, load=copying_loader), "tiny-moe"))
    assert copied.first_mismatch is None and not copied.passed  # equal values, but a copy is not a view
    assert (
        "model.layers.0.mlp.experts.gate_up_proj: 512 of 8192 elements land in no parameter of ours" in copied.verdict()
    )
    overlapping = parity.check(
        parity.build.build_pair(dataclasses.replace(FAMILY, load=overlapping_loader), "tiny-moe")
    )
    gaps = " ".join(overlapping.coverage.gaps)
    assert "model.layers.0.mlp.experts.gate_up_proj: elements 3072..3583 land in two parameters" in gaps
    assert "512 of 8192 elements land in no parameter" in gaps
    assert overlapping.first_mismatch.name == "model.layers.0.mlp.experts.3"  # and the nodes see it


@pytest.fixture
def loader_case():
    pair = build_pair("tiny-moe")
    with torch.device("meta"):
        model = Qwen3MoeModel(pair.source.cfg)
    return model, pair.source.cfg, dict(pair.reference.state_dict())


def test_fewer_experts_in_the_checkpoint_names_ours_left_unwritten(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.mlp.experts.gate_up_proj"] = sd["model.layers.0.mlp.experts.gate_up_proj"][:6]
    with pytest.raises(LoaderError, match=r"parameters of ours never written: blocks\.0\.ff\.experts\.6\.fc1\.weight"):
        load_weights_into_qwen3_moe(model, cfg, sd)


def test_more_experts_in_the_checkpoint_names_the_slice(loader_case):
    model, cfg, sd = loader_case
    down = sd["model.layers.2.mlp.experts.down_proj"]
    sd["model.layers.2.mlp.experts.down_proj"] = torch.cat([down, down[:1]])
    with pytest.raises(
        LoaderError, match=r"model\.layers\.2\.mlp\.experts\.down_proj\[8\] -> blocks\.2\.ff\.experts\.8\.fc3\.weight"
    ):
        load_weights_into_qwen3_moe(model, cfg, sd)


def test_a_fused_tensor_that_does_not_split_names_the_key(loader_case):
    model, cfg, sd = loader_case
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 33, 32)
    with pytest.raises(
        LoaderError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: checkpoint \(8, 33, 32\): cannot cut"
    ):
        load_weights_into_qwen3_moe(model, cfg, sd)


def test_dropped_router_raises_naming_it(loader_case):
    model, cfg, sd = loader_case
    del sd["model.layers.2.mlp.gate.weight"]
    with pytest.raises(LoaderError, match=r"missing checkpoint keys: model\.layers\.2\.mlp\.gate\.weight"):
        load_weights_into_qwen3_moe(model, cfg, sd)


# --- configs


def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_sparse_layers_from_a_config_json(tmp_path):
    config = {**to_hf(CONFIGS["tiny-moe"](4)).to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    pair = build_pair(config=write_config(tmp_path, config))
    assert [layer.sparse for layer in pair.facts.layers] == [False, True, False, False]
    assert [isinstance(b.ff, SparseMoE) for b in pair.ours.blocks] == [False, True, False, False]
    assert_bit_exact(pair)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}, "rope_type 'linear'"),
    ],
    ids=["sliding-window", "gelu", "linear-rope"],
)
def test_from_hf_refuses_what_it_cannot_honour(change, field, tmp_path):
    config = {**to_hf(CONFIGS["tiny-moe"]()).to_dict(), **change}
    with pytest.raises(ConfigError, match=field):
        build_pair(config=write_config(tmp_path, config))


# --- a different expert choice: its own status, with the positions and the reference's margin


def test_a_different_expert_choice_is_its_own_status_with_the_margin():
    pair = build_pair("tiny-moe")
    router = pair.ours.blocks[2].ff.router

    def least_probable(logits):
        weights, chosen = torch.topk(
            torch.softmax(logits, -1, dtype=torch.float32), router.top_k, dim=-1, largest=False
        )
        return router.weights((weights / weights.sum(-1, keepdim=True)).to(logits.dtype)), router.experts(chosen)

    router.forward = least_probable
    res = parity.check(pair)
    bad = res.first_mismatch
    assert bad.name == "model.layers.2.mlp.router.experts" and bad.status == "choice"
    assert bad.max_abs is None and "16 of 16 rows choose differently" in bad.detail
    assert "margin between its last chosen and first unchosen score" in bad.detail
    assert bad.hint.kind == "routing" and "(row 0, position 0)" in bad.hint.text and "not a near-tie" in bad.hint.text
    assert len(bad.hint.evidence["margins"]) == 16 and min(bad.hint.evidence["margins"]) > 0
    assert bad.hint.evidence["chosen_by"] == "the k lowest scores (topk with largest=False)", bad.hint
    assert f"{bad.name}: choice (16 of 16 rows" in bad.line()
    assert res.counts["choice"] == 1


def test_the_k_lowest_chosen_in_the_reference_names_the_reference():
    """The same fault in Transformers' router (``Qwen3MoeTopKRouter``): the side that departs from the top-k
    of the logits is the reference."""
    pair = build_pair("tiny-moe")
    gate = pair.reference.model.layers[2].mlp.gate

    def least_probable(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, chosen = torch.topk(torch.softmax(logits, -1, dtype=torch.float), self.top_k, dim=-1, largest=False)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), chosen

    gate.forward = types.MethodType(least_probable, gate)
    bad = parity.check(pair).first_mismatch
    assert bad.name == "model.layers.2.mlp.router.experts" and bad.hint.kind == "routing", bad
    assert bad.hint.evidence["side"] == "the reference", bad.hint
    assert "; the reference chooses the k lowest scores (topk with largest=False)" in bad.hint.text


# --- real widths (slow: about 7 GB of float32 weights)


@pytest.mark.slow
def test_parity_at_real_widths():
    pair = build_pair("30b-a3b-shape")
    assert (
        pair.source.cfg["emb_dim"],
        pair.source.cfg["num_experts"],
        pair.source.cfg["num_experts_per_tok"],
        pair.source.cfg["n_layers"],
    ) == (2048, 128, 8, 2)
    assert_bit_exact(pair)
