"""`parity check` end to end: exit codes 0/1/2, one-line errors, report files with the same verdict."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from parity.cli import main
from reference_pairs.olmo3 import build_pair

#: nodes of the tiny OLMo 3 pair, from its node map (1 + per-layer nodes x 4 layers + 2)
N_TINY = len(build_pair("tiny").nodes)


def run(args, tmp_path):
    return main(["check", "olmo3", *args, "--report-dir", str(tmp_path / "reports")])


def only_report(tmp_path):
    (folder,) = [p for p in (tmp_path / "reports").iterdir() if not p.name.startswith(".")]
    return folder


def test_pass_exit_0_and_reports_agree(tmp_path, capsys):
    assert run([], tmp_path) == 0
    out = capsys.readouterr().out
    assert f"PASS: all {N_TINY} nodes agree" in out
    folder = only_report(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["nodes.csv", "report.html", "result.json"]
    result = json.loads((folder / "result.json").read_text())
    assert result["passed"] is True and result["first_mismatch"] is None
    assert result["meta"]["versions"]["transformers"].startswith("5.")
    frame = pd.read_csv(folder / "nodes.csv")
    assert len(frame) == N_TINY and set(frame["status"]) == {"ok"}
    assert f"PASS: all {N_TINY} nodes agree" in (folder / "report.html").read_text()


def test_fault_exit_1_and_reports_name_the_node(tmp_path, monkeypatch, capsys, replace_table):
    """A broken loader (gate and up swapped in layer 2) makes the command fail at that gate_proj."""
    import reference_pairs.olmo3.loader as loader

    template = dict(loader.WEIGHT_MAP)
    template["model.layers.{i}.mlp.gate_proj.weight"], template["model.layers.{i}.mlp.up_proj.weight"] = (
        template["model.layers.{i}.mlp.up_proj.weight"],
        template["model.layers.{i}.mlp.gate_proj.weight"],
    )
    replace_table(loader.WEIGHT_MAP, template)
    assert run(["--config", "mha"], tmp_path) == 1
    out = capsys.readouterr().out
    assert "FAIL: first mismatch at node" in out and "model.layers.0.mlp.gate_proj: mismatch" in out
    folder = only_report(tmp_path)
    result = json.loads((folder / "result.json").read_text())
    assert result["passed"] is False
    assert result["first_mismatch"]["name"] == "model.layers.0.mlp.gate_proj"
    frame = pd.read_csv(folder / "nodes.csv")
    assert frame.loc[frame["status"] != "ok", "name"].iloc[0] == "model.layers.0.mlp.gate_proj"
    html = (folder / "report.html").read_text()
    assert 'id="first-mismatch"' in html and "model.layers.0.mlp.gate_proj" in html


def test_reports_never_overwrite(tmp_path, monkeypatch):
    """Every run gets a new folder even when two runs name theirs alike (the same second, the same
    stem): a fixed stem makes every run collide, so the path that picks the next free name runs."""
    monkeypatch.setattr("parity.util.files.run_stem", lambda family, config: "olmo3-tiny-fixed")
    reports = tmp_path / "reports"
    (reports / "olmo3-tiny-fixed").mkdir(parents=True)  # an empty folder of that name: os.rename would replace it
    assert run(["--format", "json"], tmp_path) == 0
    first = (reports / "olmo3-tiny-fixed-2" / "result.json").read_bytes()
    assert run(["--format", "json,junit"], tmp_path) == 0
    assert sorted(p.name for p in reports.iterdir()) == ["olmo3-tiny-fixed", "olmo3-tiny-fixed-2", "olmo3-tiny-fixed-3"]
    assert not any((reports / "olmo3-tiny-fixed").iterdir())  # still empty: never replaced
    assert (reports / "olmo3-tiny-fixed-2" / "result.json").read_bytes() == first  # the first report untouched
    assert sorted(p.name for p in (reports / "olmo3-tiny-fixed-3").iterdir()) == ["junit.xml", "result.json"]
    assert not [p for p in reports.iterdir() if p.name.startswith(".staging")]


def test_layers_and_dtype_options(tmp_path):
    assert (
        run(["--config", "yarn", "--layers", "2", "--dtype", "bfloat16", "--seq-len", "9", "--batch", "2"], tmp_path)
        == 0
    )
    meta = json.loads((only_report(tmp_path) / "result.json").read_text())["meta"]
    assert (meta["dtype"], meta["seq_len"], meta["batch_size"], meta["cfg"]["n_layers"]) == ("bfloat16", 9, 2, 2)


def corrupt(directory):
    f = directory / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return directory


def other_model_type(directory):
    text = (directory / "config.json").read_text().replace('"olmo3"', '"llama"')
    (directory / "config.json").write_text(text)
    return directory


def wrong_width(directory):
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 48
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "make, message",
    [
        (corrupt, "model.safetensors is corrupt or truncated"),
        (other_model_type, "has model_type 'llama', expected 'olmo3'"),
        (wrong_width, "model.layers.0.mlp.gate_proj.weight: checkpoint (64, 32), expected (48, 32)"),
    ],
    ids=["truncated", "model_type", "shape"],
)
def test_bad_checkpoint_exit_2_one_line(make, message, tmp_path, capsys, checkpoint_of):
    directory = make(checkpoint_of(build_pair("tiny")))
    assert run(["--checkpoint", str(directory)], tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "reports").exists() or not list((tmp_path / "reports").iterdir())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "gpt5"], "unknown family 'gpt5'"),
        (
            ["check", "olmo3", "--checkpoint", "/nonexistent/ckpt"],
            "checkpoint directory /nonexistent/ckpt does not exist",
        ),
        (["check", "olmo3", "--config", "huge"], "unknown olmo3 config 'huge'"),
        (["check", "olmo3", "--seq-len", "0"], "must be a positive integer"),
        (["check", "olmo3", "--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_bad_usage_exit_2_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_pickle_checkpoint_is_refused_not_opened(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "olmo3"}')
    (directory / "pytorch_model.bin").write_bytes(b"not even a pickle")
    assert main(["check", "olmo3", "--checkpoint", str(directory)]) == 2
    assert "pickle files are never loaded" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "parity.cli", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert "olmo3" in out and "7b-shape" in out


def test_list_describes_every_config_in_whole_sentences(capsys):
    """`parity list` shows each config's whole first paragraph, lines joined: no description of any
    registered family stops mid-sentence (a docstring's first physical line often does)."""
    import inspect

    from parity.model.registry import family_names, get_family

    assert main(["list"]) == 0
    # the table as one line, borders dropped: a wrapped description reads as one text again
    shown = " ".join(re.sub("[\u2500-\u257f]", " ", capsys.readouterr().out).split())
    checked = 0
    for family_name in family_names():
        family = get_family(family_name)
        for name, text in family.config_descriptions.items():
            assert text and text.rstrip(")").endswith((".", "!", "?")), (family_name, name, text)
            paragraph = inspect.cleandoc(family.configs[name].__doc__).split("\n\n")[0].split()
            assert len(text.split()) == len(paragraph), (family_name, name, text)  # every word of the paragraph
            assert "\n" not in text and "  " not in text
            checked += 1
    assert checked >= 30
    for words in ("as in 270M and 1B), head_dim 16", "full layers use their key projection as values"):
        assert words in shown, words


def test_summary_joins_the_first_paragraph_and_drops_markup():
    from parity.model.family import summary

    doc = """``tiny`` with GQA (4 query / 2 KV heads) and
        :func:`linear` RoPE, as in
        *27B*.

        Details that are not the description.
        """
    assert summary(doc) == "tiny with GQA (4 query / 2 KV heads) and linear RoPE, as in 27B."
    assert summary(None) == "" and summary("\n\n  one line.  \n") == "one line."


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (d / "config.json").write_text("[1, 2]") and d, "config.json is not a JSON object"),
        (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{") and d, "config.json is not UTF-8 text"),
        (lambda d: edit_config(d, vocab_size="257"), "config.json rejected by Olmo3Config"),
        (lambda d: edit_config(d, layer_types=["full_attention"]), "config.json rejected by Olmo3Config"),
        (
            lambda d: edit_config(d, num_key_value_heads=3),
            "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
        ),
        (lambda d: d / "config.json", "is a file; pass the directory that holds config.json"),
    ],
    ids=["json-list", "not-utf8", "typed-field", "layer-types", "kv-heads", "file"],
)
def test_malformed_checkpoint_configs_exit_2(make, message, capsys, checkpoint_of):
    target = make(checkpoint_of(build_pair("tiny")))
    assert main(["check", "olmo3", "--checkpoint", str(target), "--report-dir", str(target.parent / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_checkpoint_layout_edge_cases(checkpoint_of, capsys, tmp_path):
    import shutil

    sharded = checkpoint_of(build_pair("tiny"), sharded=True)
    single = checkpoint_of(build_pair("tiny"))
    # a stale index next to a complete single file: the single file wins, as in Transformers
    shutil.copy(sharded / "model.safetensors.index.json", single)
    assert main(["check", "olmo3", "--checkpoint", str(single), "--report-dir", str(tmp_path)]) == 0
    # an index naming a shard outside the checkpoint
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere/model.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["check", "olmo3", "--checkpoint", str(sharded), "--report-dir", str(tmp_path)]) == 2
    assert "lies outside" in capsys.readouterr().err


#: the Python API's words, which a CLI message must never use
API_WORDS = ("attention_mask", "tolerances=", "left_pad", "batch_size", "seq_len", "n_layers", "calibrate=", "atol=")


def test_bad_options_exit_2_in_cli_words_before_any_model_is_built(tmp_path, capsys, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the options were checked")

    monkeypatch.setattr("parity.build.build_pair", no_build)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for argv, message in [
        (["--report-dir", str(blocker)], "is a file, not a folder"),
        (["--seed", "99999999999999999999"], "must be an integer in [0, 2^63)"),
        (["--atol", "inf"], "must be a finite number >= 0"),
        (["--seq-len", "abc"], "must be a positive integer, got 'abc'"),
        (["--calibrate", "--atol", "1e-3"], "--calibrate sets each node's atol itself (rtol 0); drop --atol/--rtol"),
        (["--exact", "--rtol", "0"], "--exact sets atol = rtol = 0 on every node; drop --atol/--rtol/--calibrate"),
        (["--left-pad", "3"], "--left-pad 3 pads every batch row but the last, so it needs --batch 2 or more"),
        (["--left-pad", "9", "--batch", "2", "--seq-len", "9"], "--left-pad 9 must be shorter than --seq-len 9"),
        (
            ["--config", "7b-shape", "--left-pad", "64", "--batch", "2"],  # past the config's default length
            "--left-pad 64 must be shorter than the sequence (64 tokens by default",
        ),
        (["--checkpoint", str(tmp_path), "--layers", "2"], "do not combine it with --config or --layers"),
        (["--config", str(tmp_path)], f"--config {tmp_path} is a folder: pass a checkpoint folder with --checkpoint"),
        (["--decode", "12:0x8"], "decode plan 12:0x8 (PREFILL[:CHUNK]xSTEPS): chunk is 0; it must be at least 1"),
        (["--report-dir", str(loop)], f"--report-dir {loop} is a symbolic link loop"),
    ]:
        assert main(["check", "olmo3", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
        assert not any(word in err for word in API_WORDS), (argv, err)


def test_left_pad_past_the_default_sequence_is_an_error_in_cli_words(tmp_path, capsys):
    # tiny's default sequence is 16 tokens, known from its config before anything is built
    assert run(["--left-pad", "16", "--batch", "2"], tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert "--left-pad 16 must be shorter than the sequence (16 tokens by default" in err, err
    assert len(err.splitlines()) == 1 and not any(word in err for word in API_WORDS), err


def test_a_model_that_cannot_fit_is_refused_with_numbers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("parity.util.resources.available_bytes", lambda: 8 * 1024**3)  # any machine: 8 GiB free
    (tmp_path / "config.json").write_text('{"model_type": "olmo3"}')  # Transformers' default: 32 layers of 7B
    assert main(["check", "olmo3", "--config", str(tmp_path / "config.json"), "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "(6.89B parameters in float32) needs about 25.7 GiB but 8.0 GiB are available" in err and "--layers" in err
