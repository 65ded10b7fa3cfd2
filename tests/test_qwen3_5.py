"""Qwen3.5: bit-exact parity with transformers.Qwen3_5ForCausalLM (prompt, padded batch, checkpoints),
the Gated DeltaNet's recurrent decode path and carried state against the reference's cache, decode
checks with the DeltaNet cache compared node by node, what parity captures inside the reference's
kernels, config translation and refusals, loader errors."""

from __future__ import annotations

import json

import pytest
import torch

import parity
from parity.cli import main
from parity.util.errors import ConfigError, LoaderError
from reference_pairs.common.linear_attention import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from reference_pairs.qwen3_5 import CONFIGS, FAMILY, build_pair
from reference_pairs.qwen3_5.configs import FULL, LINEAR
from reference_pairs.qwen3_5.family import from_hf, node_map, per_head_gate


def node_count(pair) -> int:
    """Nodes the map gives this pair's layers (counted from the map, never by hand)."""
    nm = node_map(pair.facts.head_dim)
    per_type = {
        t: sum(1 for n in nm.per_layer if getattr(n, "layer_types", None) in (None, (t,))) for t in (LINEAR, FULL)
    }
    return len(nm.before) + sum(per_type[t] for t in pair.source.cfg["layer_types"]) + len(nm.after)


def assert_bit_exact(res, pair) -> None:
    assert res.passed, res.verdict()
    assert len(res.nodes) == len(pair.nodes) == node_count(pair)
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]


def without_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "dtype"}


# --- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_is_bit_exact_on_a_padded_batch_past_the_first_chunk(dtype):
    """Every node equal to the bit, over 80 tokens (two delta-rule chunks, the second padded) and a
    left-padded batch (padding zeroed before the linear layers read it)."""
    pair = build_pair("tiny", dtype=dtype)
    assert pair.exact and pair.default_seq_len > pair.facts.chunk_size == 64
    assert_bit_exact(parity.check(pair, batch_size=3, left_pad=5), pair)


@pytest.mark.parametrize(
    "dtype, sharded", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-sharded"]
)
def test_save_pretrained_checkpoints_load_into_both(dtype, sharded, checkpoint_of):
    directory = checkpoint_of(build_pair("tiny", dtype=dtype, seed=3), sharded=sharded)
    pair = build_pair(checkpoint=directory, dtype=dtype)
    res = parity.check(pair, seq_len=20)
    assert_bit_exact(res, pair)
    assert res.coverage.ok and "lm_head.weight" not in pair.loading.loaded_keys  # tied: saved once


def test_every_linear_layer_node_is_captured_on_the_reference():
    """What the reference computes inside its kernel functions is there, under the caller's path."""
    pair = build_pair("tiny", n_layers=2)
    res = parity.check(pair, seq_len=70)
    names = {n.name for n in res.nodes}
    for suffix in ("conv_out", "beta", "g", "q_l2norm", "k_l2norm", "delta_out", "recurrent_state"):
        assert f"model.layers.0.linear_attn.{suffix}" in names
    assert "model.layers.1.self_attn.gate" in names and res.passed


def test_the_short_sequence_note_and_the_default_length():
    pair = build_pair("tiny", n_layers=1)
    res = parity.check(pair, seq_len=64)
    assert any("does not exceed the linear-attention chunk (64 tokens)" in n for n in res.notes)
    assert not any("chunk" in n for n in parity.check(pair, seq_len=65).notes)


# --- the kernel capture --------------------------------------------------------------------------


def test_captured_l2norms_are_the_rules_own(monkeypatch):
    """q_l2norm and k_l2norm are the outputs of the rule's own l2norm calls, observed, not recomputed."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from parity.run.options import CheckOptions
    from parity.run.plan import plan
    from parity.run.stages import trace_reference

    pair = build_pair("tiny", n_layers=1)
    run = plan(pair, CheckOptions(seq_len=70))
    trace_reference(pair, run)  # installs the capture
    seen, inner = [], modeling.l2norm

    def spy(*args, **kwargs):
        seen.append(inner(*args, **kwargs))
        return seen[-1]

    spy.__parity_kernel__ = True  # not to be wrapped again
    monkeypatch.setattr(modeling, "l2norm", spy)
    trace = trace_reference(pair, run)
    node = "model.layers.0.linear_attn.{}"
    assert len(seen) == 2 and seen[0].shape[1] == pair.source.cfg["linear_num_value_heads"]  # after the GVA repeat
    assert torch.equal(trace.tensors[node.format("q_l2norm")], seen[0].transpose(1, 2))
    assert torch.equal(trace.tensors[node.format("k_l2norm")], seen[1].transpose(1, 2))
    state = trace.tensors[node.format("recurrent_state")]
    assert state.shape == (1, 4, 8, 8) and state.dtype == torch.float32


def test_reference_outputs_are_unchanged_by_the_capture():
    """Recording (the state asked for, l2norms observed) changes nothing the reference computes."""
    from parity.run.options import CheckOptions
    from parity.run.plan import plan
    from parity.run.stages import trace_reference

    pair = build_pair("tiny")
    run = plan(pair, CheckOptions(seq_len=80))
    recorded = trace_reference(pair, run).tensors["lm_head"]  # installs parity_eager and the kernel wrappers
    with torch.inference_mode():
        plain = pair.reference(input_ids=run.input_ids, position_ids=run.position_ids, use_cache=False).logits
    assert torch.equal(recorded, plain)


def test_gate_view_is_the_references_per_head_split():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    pair = build_pair("tiny")
    att: Qwen3_5Attention = pair.reference.model.layers[3].self_attn
    q = torch.randn(2, 5, att.q_proj.out_features)
    _, gate = torch.chunk(q.view(2, 5, -1, att.head_dim * 2), 2, dim=-1)
    assert torch.equal(per_head_gate(att.head_dim)(q), gate.reshape(2, 5, -1))


# --- the recurrent state -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_steps_and_continued_prompts_match_the_reference_cache_bit_for_bit(dtype):
    """Our layer with its state carried, against Qwen3_5GatedDeltaNet with Transformers' cache: a
    prompt, single-token steps (the recurrent rule), a continued prompt across the chunk boundary,
    and a prompt shorter than the conv kernel. Outputs, recurrent state and conv inputs."""
    from transformers import DynamicCache

    pair = build_pair("tiny", dtype=dtype)
    ref, ours = pair.reference.model.layers[0].linear_attn, pair.ours.blocks[0].att
    x = torch.randn(2, 90, pair.source.cfg["emb_dim"], generator=torch.Generator().manual_seed(0)).to(dtype)
    for pieces in ([(0, 60), (60, 61), (61, 62), (62, 72), (72, 73)], [(0, 2), (2, 3), (3, 90)]):
        cache, state = DynamicCache(config=pair.reference.config), None
        with torch.inference_mode():
            for a, b in pieces:
                step = x[:, a:b].contiguous()  # a strided input rounds differently in nn.Linear
                theirs = ref(step, cache=cache)
                mine, state = ours(step, state=state, return_state=True)
                assert torch.equal(mine, theirs), (a, b)
                assert torch.equal(state.recurrent, cache.get_recurrent_state(0)), (a, b)
                assert torch.equal(state.conv, cache.get_conv_state(0)), (a, b)


def test_chunk_padding_never_reaches_the_state():
    """The chunked rule (sequences padded to a multiple of the chunk) leaves the state the
    token-by-token recurrence leaves, at lengths on both sides of a boundary, from a carried state too."""
    gen = torch.Generator().manual_seed(1)
    b, h, d_k, d_v = 2, 3, 8, 4
    for s in (1, 5, 63, 64, 65, 130):
        q, k = l2norm(torch.randn(b, h, s, d_k, generator=gen)), l2norm(torch.randn(b, h, s, d_k, generator=gen))
        v = torch.randn(b, h, s, d_v, generator=gen)
        g, beta = -torch.rand(b, h, s, generator=gen), torch.rand(b, h, s, generator=gen)
        start = torch.randn(b, h, d_k, d_v, generator=gen)
        o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta, 64, start)
        o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, start)
        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        if s > 1:  # two calls with the state carried = one call
            cut = s // 2
            oa, sa = chunk_gated_delta_rule(
                q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], g[:, :, :cut], beta[:, :, :cut], 64, start
            )
            ob, sb = chunk_gated_delta_rule(
                q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], g[:, :, cut:], beta[:, :, cut:], 64, sa
            )
            torch.testing.assert_close(sb, s1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.cat([oa, ob], 2), o1, atol=1e-5, rtol=1e-5)


# --- decode checks: the DeltaNet cache ------------------------------------------------------------

DECODE_PLANS = {  # plan, check kwargs
    "prompt-shorter-than-the-conv-then-steps": ("3x6", {}),
    "chunked-prompt-then-steps": ("12:4x8", {}),
    "calls-longer-than-a-delta-rule-chunk": ("140:70x2", {}),
    "left-padded-batch-padding-in-the-second-call": ("80:40x2", {"batch_size": 2, "left_pad": 45}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("plan", DECODE_PLANS)
def test_decode_is_bit_exact_with_every_cache_part_compared(plan, dtype):
    """Every node of every call, and after every call every layer's cache: keys and values of the
    full-attention layer, conv inputs and recurrent state of each Gated DeltaNet layer, equal to the bit."""
    decode, kwargs = DECODE_PLANS[plan]
    pair = build_pair("tiny", dtype=dtype)
    res = parity.check(pair, decode=decode, **kwargs)
    assert res.passed, res.verdict()
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]
    calls = parity.run.decode.DecodePlan.parse(decode).schedule()
    batch = kwargs.get("batch_size", 1)
    d = pair.source.cfg
    channels = (
        2 * d["linear_num_key_heads"] * d["linear_key_head_dim"]
        + d["linear_num_value_heads"] * d["linear_value_head_dim"]
    )
    shapes = {
        "cache.conv_state": (batch, channels, d["linear_conv_kernel_dim"]),
        "cache.recurrent_state": (
            batch,
            d["linear_num_value_heads"],
            d["linear_key_head_dim"],
            d["linear_value_head_dim"],
        ),
    }
    for k, (_, end) in enumerate(calls):
        cache = {n.name: n for n in res.nodes if n.name.startswith(f"step{k}/") and n.kind.startswith("cache.")}
        want = {
            f"step{k}/model.layers.{i}.{'linear_attn.cache.' + p if t == LINEAR else 'self_attn.cache.' + p}"
            for i, t in enumerate(d["layer_types"])
            for p in (("conv_state", "recurrent_state") if t == LINEAR else ("keys", "values"))
        }
        assert set(cache) == want, k
        assert len([n for n in res.nodes if n.name.startswith(f"step{k}/")]) == len(pair.nodes) + len(want)
        for n in cache.values():
            expected = shapes.get(n.kind) or (batch, d["n_kv_heads"], end, d["head_dim"])
            assert tuple(n.shape_ref) == tuple(n.shape_ours) == expected, (n.name, n.shape_ref)
            assert n.status == "ok" and n.max_abs == 0.0


def test_a_decode_plan_that_never_crosses_a_chunk_says_so():
    """The chunk note speaks of the longest call: calls of 4 tokens never carry the state from one chunk
    to the next inside the rule (only through the cache); a call of 70 does, and gets no note."""
    short = parity.check(build_pair("tiny"), decode="12:4x2")
    assert any("no call of decode plan 12:4x2 exceeds the linear-attention chunk (64 tokens)" in n for n in short.notes)
    long = parity.check(build_pair("tiny"), decode="70:70x1")
    assert not any("chunk" in n for n in long.notes), long.notes


def test_a_conv_state_of_another_length_is_named_as_such(monkeypatch):
    """A conv that keeps K + 1 inputs after a call: the cache part's shape differs along its token axis."""
    from reference_pairs.common.linear_attention import CausalConv1d

    forward = CausalConv1d.forward

    def keeps_one_more(self, x, state=None):
        y, _ = forward(self, x, state if state is None else state[..., 1:])
        window = x if state is None else torch.cat([state.to(x.dtype), x], dim=-1)
        return y, torch.nn.functional.pad(window, (max(self.kernel_size + 1 - window.shape[-1], 0), 0))[
            ..., -self.kernel_size - 1 :
        ]

    monkeypatch.setattr(CausalConv1d, "forward", keeps_one_more)
    bad = parity.check(build_pair("tiny"), decode="6:3x1").first_mismatch
    assert bad.name == "step0/model.layers.0.linear_attn.cache.conv_state" and bad.status == "shape"
    assert bad.hint.kind == "cache_length" and bad.hint.evidence["ours"] == 5 and bad.hint.evidence["reference"] == 4
    assert "conv state's length" in bad.hint.text


def test_cli_decode_runs_and_reports_the_deltanet_cache(tmp_path, capsys):
    assert main(["check", "qwen3_5", "--decode", "8:2x4", "--report-dir", str(tmp_path), "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "cached vs full forward" in out and "greedy tokens" in out
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    nodes = {n["name"] for n in json.loads((folder / "result.json").read_text())["nodes"]}
    assert {
        "step5/model.layers.0.linear_attn.cache.conv_state",
        "step5/model.layers.2.linear_attn.cache.recurrent_state",
        "step5/model.layers.3.self_attn.cache.keys",
    } <= nodes


def test_the_catalogue_covers_the_deltanet_cache_in_decode():
    """The cache faults (run by `parity selftest`, tests/test_selftest.py) cover both cache parts,
    the three decode hints, and a padded continued call."""
    decode = [f for f in FAMILY.faults if "decode" in dict(f.check_kwargs)]
    assert {f.hint for f in decode} == {"state_not_carried", "conv_state", "padding"}
    assert any(f.expected.endswith(".cache.conv_state") for f in decode)
    assert any(f.expected.endswith(".cache.recurrent_state") for f in decode)
    assert any(f.expected.startswith("step1/") and not f.expected.split("/", 1)[1].count("cache") for f in decode)
    assert any(dict(f.check_kwargs).get("left_pad") for f in decode)


# --- configs -------------------------------------------------------------------------------------

RELEASED_0_8B = {  # Qwen/Qwen3.5-0.8B config.json, text_config
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "attn_output_gate": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "eos_token_id": 248044,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
}


def test_the_shape_config_is_the_released_config_json():
    from transformers import Qwen3_5TextConfig

    hc = Qwen3_5TextConfig.from_dict(dict(RELEASED_0_8B))
    cfg = from_hf(hc, torch.float32)
    assert without_dtype(cfg) == without_dtype(CONFIGS["0.8b-shape"](24))
    assert cfg["layer_types"][:4] == [LINEAR, LINEAR, LINEAR, FULL] and CONFIGS["0.8b-shape"]()["n_layers"] == 4


@pytest.mark.parametrize(
    "change, field",
    [
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e7,
                    "factor": 4.0,
                    "original_max_position_embeddings": 4096,
                }
            },
            "rope_parameters.rope_type",
        ),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"linear_num_key_heads": 3}, "linear_num_value_heads (4) is not a multiple of linear_num_key_heads (3)"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        (
            {"layer_types": ["linear_attention", "chunked_attention", "linear_attention", "full_attention"]},
            "layer_types",
        ),
    ],
    ids=["yarn", "ungated", "heads", "act", "layer-type"],
)
def test_a_config_json_the_pair_cannot_honour_is_refused_naming_the_field(change, field, checkpoint_of, capsys):
    directory = checkpoint_of(build_pair("tiny"))
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["check", "qwen3_5", "--checkpoint", str(directory)]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


def test_mrope_sections_of_a_text_config_are_accepted():
    """mrope_section places image and video tokens; text positions are equal on every axis."""
    from transformers import Qwen3_5TextConfig

    cfg = build_pair("tiny").source.cfg
    hc = FAMILY.to_hf(cfg)
    hc.rope_parameters = {**hc.rope_parameters, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    assert without_dtype(from_hf(Qwen3_5TextConfig.from_dict(hc.to_dict()), torch.float32)) == without_dtype(cfg)


# --- the loader ----------------------------------------------------------------------------------


def test_loader_errors_name_the_key(checkpoint_of):
    from safetensors.torch import load_file, save_file

    directory = checkpoint_of(build_pair("tiny"))
    weights = load_file(directory / "model.safetensors")
    weights.pop("model.layers.1.linear_attn.A_log")
    weights["model.layers.2.linear_attn.conv1d.weight"] = weights["model.layers.2.linear_attn.conv1d.weight"][
        ..., :3
    ].contiguous()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoaderError) as err:
        build_pair(checkpoint=directory)
    text = str(err.value)
    assert "model.layers.2.linear_attn.conv1d.weight" in text and "model.layers.1.linear_attn.A_log" in text


def test_the_unit_offset_norms_and_the_gated_norm_are_the_references():
    """(1 + w) in float32, cast last (Qwen3_5RMSNorm); the gated norm casts x_hat first, multiplies by
    w in the activation dtype, then by silu(z) in float32 (Qwen3_5RMSNormGated)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from reference_pairs.common.norms import GatedRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(2)
    x, z = (torch.randn(4, 7, 16, generator=gen).to(torch.bfloat16) * 3 for _ in range(2))
    w = (torch.randn(16, generator=gen) * 0.3).to(torch.bfloat16)
    theirs, mine = (
        Qwen3_5RMSNorm(16, eps=1e-6).to(torch.bfloat16),
        RMSNorm(16, eps=1e-6, unit_offset=True, dtype=torch.bfloat16),
    )
    theirs.weight.data.copy_(w), mine.weight.data.copy_(w)
    assert torch.equal(theirs(x), mine(x))
    theirs, mine = (
        Qwen3_5RMSNormGated(16, eps=1e-6).to(torch.bfloat16),
        GatedRMSNorm(16, eps=1e-6, dtype=torch.bfloat16),
    )
    theirs.weight.data.copy_(w + 1), mine.weight.data.copy_(w + 1)
    assert torch.equal(theirs(x.reshape(-1, 16), z.reshape(-1, 16)), mine(x.reshape(-1, 16), z.reshape(-1, 16)))


def test_config_errors_from_our_model_are_one_line():
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        build_pair("tiny", linear_num_value_heads=3)


# --- real widths -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_0_8b_shape_is_bit_exact(dtype):
    """Released widths (3 GiB peak in float32: run under the memory lock)."""
    pair = build_pair("0.8b-shape", dtype=dtype)
    assert pair.source.cfg["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL]
    res = parity.check(pair)
    assert_bit_exact(res, pair)
