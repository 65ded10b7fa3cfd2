"""Bad input, whichever way it arrives (cfg dict, config.json, checkpoint, Python API, CLI): one clear
line naming the problem and exit 2, or a check that runs and says what it saw. Never a traceback,
never a wrong verdict."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import parity
from parity.cli import main
from parity.model.pair import fingerprints
from parity.util.errors import CheckpointError, ConfigError, LoaderError
from reference_pairs.olmo3 import CONFIGS, build_pair


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """tiny OLMo 3 written by save_pretrained, once; tests copy it before editing."""
    directory = tmp_path_factory.mktemp("base") / "ckpt"
    build_pair("tiny").reference.save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoint(base_checkpoint, tmp_path):
    """A fresh copy of the tiny checkpoint, with helpers to edit its config and tensors."""
    directory = tmp_path / "ckpt"
    shutil.copytree(base_checkpoint, directory)
    return directory


def edit_config(directory, drop=(), **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    path.write_text(json.dumps(config))
    return path


def edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parity: error: "), err
    assert "Traceback" not in err
    return err


# --- NaN weights: the check runs; a NaN that reaches a node is nonfinite there, an unused one a note


def test_a_nan_weight_that_a_node_reads_is_reported_as_nonfinite_there(checkpoint):
    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][2, 3] = float("nan")

    pair = build_pair(checkpoint=edit_tensors(checkpoint, poison))
    res = parity.check(pair)  # not refused as "changed in place": NaN bits equal themselves
    bad = res.first_mismatch
    assert (bad.name, bad.status) == ("model.layers.1.mlp.up_proj", "nonfinite")
    assert any(
        "model.layers.1.mlp.up_proj.weight holds 1 non-finite value (first at index (2, 3))" in n for n in res.notes
    )


def test_a_nan_weight_no_token_reads_is_a_visible_note_not_a_refusal(checkpoint, capsys, tmp_path):
    pair = build_pair("tiny")
    unused = next(t for t in range(pair.vocab_size) if t not in set(pair.make_inputs().flatten().tolist()))

    def poison(t):
        t["model.embed_tokens.weight"][unused, 5] = float("nan")

    edit_tensors(checkpoint, poison)
    res = parity.check(build_pair(checkpoint=checkpoint))
    assert res.passed and res.counts == {"ok": len(res.nodes)}
    note = f"model.embed_tokens.weight holds 1 non-finite value (first at index ({unused}, 5))"
    assert any(note in n for n in res.notes), res.notes
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path)]) == 0
    assert note in " ".join(capsys.readouterr().out.split())


def test_fingerprint_samples_in_range_for_tensors_past_float_precision():
    # 257e6 elements: a float32 linspace of indices rounded past the end (IndexError, exit 3)
    huge = torch.zeros(1).expand(257_000_000)
    assert fingerprints({"w": huge})["w"][0] == huge._version
    nan = torch.tensor([float("nan"), 1.0])
    assert fingerprints({"w": nan}) == fingerprints({"w": nan.clone()})


# --- config fields: the same check and the same words from a cfg dict, a config.json, a checkpoint

#: (cfg key, Transformers field, bad value, what the one-line error says)
FIELDS = [
    ("n_heads", "num_attention_heads", 0, "num_attention_heads is 0; it must be at least 1"),
    ("n_layers", "num_hidden_layers", 0, "`num_hidden_layers` (0) must be equal to the number of `layer_types` (4)"),
    ("vocab_size", "vocab_size", 1, "vocab_size is 1; it must be at least 2"),
    ("sliding_window", "sliding_window", 0, "sliding_attention but sliding_window is 0; it must be >= 1"),
    ("sliding_window", "sliding_window", None, "sliding_attention but sliding_window is null; it must be >= 1"),
    ("n_kv_heads", "num_key_value_heads", 3, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ("emb_dim", "hidden_size", 0, "hidden_size is 0; it must be at least 1"),
    (
        "layer_types",
        "layer_types",
        ["full_attention"] * 3,
        "`num_hidden_layers` (4) must be equal to the number of `layer_types` (3)",
    ),
]


@pytest.mark.parametrize("key, field, value, message", FIELDS, ids=[f"{f}={v!r}"[:40] for _, f, v, _ in FIELDS])
def test_every_config_field_is_validated_alike_on_every_path(key, field, value, message, checkpoint, tmp_path):
    cfg = CONFIGS["tiny"]()
    cfg[key] = value
    config_json = tmp_path / "config.json"
    shutil.copy(edit_config(checkpoint, **{field: value}), config_json)
    for source in ({"config": cfg}, {"config": str(config_json)}, {"checkpoint": checkpoint}):
        with pytest.raises(ConfigError) as info:
            build_pair(**source)
        text = str(info.value)
        assert message in text and "\n" not in text and "validator" not in text, (source, text)


@pytest.mark.parametrize("source", ["config", "checkpoint"])
def test_zero_heads_in_a_config_json_is_exit_2_not_a_traceback(source, checkpoint, capsys, tmp_path):
    path = edit_config(checkpoint, num_attention_heads=0)
    target = path if source == "config" else checkpoint
    assert main(["check", "olmo3", f"--{source}", str(target), "--report-dir", str(tmp_path / "r")]) == 2
    assert "num_attention_heads is 0; it must be at least 1" in one_line_error(capsys)


def test_a_config_naming_no_attention_heads_is_attention_free_not_zero_heads():
    """Mamba's config has no attention heads at all (absent, or null): an attention-free model, checked; the same
    config with an explicit num_attention_heads of 0 is still refused by name."""
    from transformers import AutoConfig

    from parity.model.derive import derive_facts, validate_facts
    from parity.model.facts_rules import ATTENTION_FREE

    sizes = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4, time_step_rank=2)
    for extra in ({}, {"num_attention_heads": None}):
        facts = derive_facts(AutoConfig.for_model("mamba", **sizes, **extra))
        assert ATTENTION_FREE in facts.features and validate_facts(facts) == []
    zero = derive_facts(AutoConfig.for_model("mamba", **sizes, num_attention_heads=0))
    assert ATTENTION_FREE not in zero.features
    assert "num_attention_heads is 0; it must be at least 1" in validate_facts(zero)


def test_zero_layers_without_layer_types_is_refused_by_name(checkpoint):
    edit_config(checkpoint, drop=["layer_types"], num_hidden_layers=0)
    with pytest.raises(ConfigError, match="num_hidden_layers is 0; it must be at least 1"):
        build_pair(checkpoint=checkpoint)


def test_a_layer_types_mismatch_keeps_its_reason_whole(checkpoint, capsys, tmp_path):
    edit_config(checkpoint, layer_types=["full_attention"])
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path / "r")]) == 2
    err = one_line_error(capsys)
    assert err.endswith("`num_hidden_layers` (4) must be equal to the number of `layer_types` (1)"), err
    assert "validator" not in err and "validate_layer_type" not in err


def test_a_sequence_past_max_position_embeddings_is_noted(capsys, tmp_path):
    pair = build_pair("tiny", context_length=24)  # the same as --seq-len 600 with 512 positions, smaller
    res = parity.check(pair, seq_len=30)
    assert any("seq_len 30 exceeds max_position_embeddings (24)" in n for n in res.notes), res.notes
    assert not any("max_position_embeddings" in n for n in parity.check(pair, seq_len=24).notes)
    config = tmp_path / "config.json"
    pair.reference.config.to_json_file(config)
    assert main(["check", "olmo3", "--config", str(config), "--seq-len", "30", "--report-dir", str(tmp_path)]) == 0
    assert "seq_len 30 exceeds max_position_embeddings (24)" in " ".join(capsys.readouterr().out.split())


# --- the Python API validates like the CLI


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(config="tiny", n_layers=0), ConfigError, "n_layers must be a positive integer, got 0"),
        (dict(config="tiny", n_layers=True), ConfigError, "n_layers must be a positive integer, got True"),
        (dict(dtype=torch.int8), ConfigError, "dtype must be a floating-point torch dtype"),
        (dict(dtype="float32"), ConfigError, "dtype must be a floating-point torch dtype"),
        (dict(seed=-1), ConfigError, "seed must be an integer in [0, 2^63)"),
        (dict(config="tiny", no_such_key=1), ConfigError, "unknown cfg key 'no_such_key'"),
    ],
)
def test_build_pair_validates_its_arguments(kwargs, error, message):
    with pytest.raises(error) as info:
        build_pair(**kwargs)
    assert message in str(info.value)


# --- checkpoint files: the message names what is actually wrong


def test_a_symlink_loop_is_named_as_one(tmp_path, capsys):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(CheckpointError, match="is a symbolic link loop"):
        build_pair(checkpoint=loop)
    assert main(["check", "olmo3", "--checkpoint", str(loop), "--report-dir", str(tmp_path / "r")]) == 2
    assert "does not exist" not in one_line_error(capsys)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(CheckpointError, match=r"is a symbolic link to .*nowhere, which does not exist"):
        build_pair(checkpoint=dangling)


def test_an_integer_tensor_is_named_with_its_dtype(checkpoint):
    edit_tensors(checkpoint, lambda t: t.__setitem__("model.norm.weight", torch.ones(32, dtype=torch.int8)))
    with pytest.raises(LoaderError, match=r"not floating point: model.norm.weight \(int8\)"):
        build_pair(checkpoint=checkpoint)


def test_a_wrong_width_is_summarised_not_listed_tensor_by_tensor(checkpoint, capsys, tmp_path):
    edit_config(checkpoint, hidden_size=1_000_000)
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path / "r")]) == 2
    err = one_line_error(capsys)
    assert "shape mismatch for model.embed_tokens.weight: checkpoint (257, 32), expected (257, 1000000)" in err
    assert "(39 keys in all)" in err and len(err) < 600, err
    assert "never written" not in err  # the same parameters, not named twice


# --- a Parameter replaced by hand (the README's way to inject a fault) is not a loader gap


def test_a_replaced_parameter_is_said_once_below_the_verdict(tmp_path, capsys, monkeypatch):
    pair = build_pair("tiny")
    fc1 = pair.ours.blocks[0].ff.fc1
    fc1.weight = nn.Parameter(fc1.weight.detach() * 2, requires_grad=False)
    res = parity.check(pair)
    assert res.first_mismatch.name == "model.layers.0.mlp.gate_proj"
    assert res.coverage.ok and not res.coverage.gaps
    assert res.coverage.replaced == [
        "blocks.0.ff.fc1.weight (held model.layers.0.mlp.gate_proj.weight; now a tensor of its own)"
    ]

    from parity import build as build_stage

    build = build_stage.build_pair

    def build_and_inject(*args, **kwargs):
        built = build(*args, **kwargs)
        w = built.ours.blocks[0].ff.fc1
        w.weight = nn.Parameter(w.weight.detach() * 2, requires_grad=False)
        return built

    monkeypatch.setattr(build_stage, "build_pair", build_and_inject)
    assert main(["check", "olmo3", "--report-dir", str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "gap" not in out
    assert out.count("no longer holds the checkpoint tensor") == 1
    assert out.index("FAIL: first mismatch") < out.index("no longer holds the checkpoint tensor")


def test_a_replaced_tied_head_is_not_a_tie_gap():
    from reference_pairs.llama3 import build_pair as llama3_pair

    pair = llama3_pair("tiny")
    pair.ours.out_head.weight = nn.Parameter(torch.randn_like(pair.ours.out_head.weight), requires_grad=False)
    res = parity.check(pair)
    assert res.first_mismatch.name == "lm_head" and res.coverage.ok
    assert len(res.coverage.replaced) == 1 and res.coverage.replaced[0].startswith("out_head.weight")


def test_the_report_says_the_replacement_once_and_lists_no_gap(tmp_path):
    pair = build_pair("tiny")
    fc1 = pair.ours.blocks[0].ff.fc1
    fc1.weight = nn.Parameter(fc1.weight.detach() * 2, requires_grad=False)
    html = parity.check(pair).write_html(tmp_path / "report.html").read_text()
    assert html.count("no longer holds the checkpoint tensor") == 1 and "loader coverage gap" not in html
    data = json.loads(parity.check(pair).write_json(tmp_path / "result.json").read_text())
    assert data["coverage"]["gaps"] == [] and len(data["coverage"]["replaced"]) == 1
