"""Bad input, round three (issue 30, and issue 25's smaller defects): each kind that still broke, as a
test that failed before its fix. The rule: one line naming the problem and exit 2; exit 1 only for a
node that fails; exit 3 only for a bug of parity's own, saying so; nothing written is left half
visible, and a full disk says how much space was needed.

The full-disk tests mount a small tmpfs (CI runs as root); where mounting is not allowed they skip
and say why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import parity
from parity.cli import main
from parity.compare.results import NodeResult
from parity.diagnose.origin import find_origin
from parity.util.errors import CheckpointError, ConfigError, ParityError
from reference_pairs.olmo3 import build_pair

ROOT = Path(__file__).resolve().parents[1]
USER_MODELS = Path(__file__).parent / "user_models"
sys.path.insert(0, str(USER_MODELS))

import book_olmo3  # noqa: E402
import litgpt_llama  # noqa: E402


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parity: error: "), err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """tiny OLMo 3 written by save_pretrained, once; tests copy it before editing."""
    directory = tmp_path_factory.mktemp("base") / "ckpt"
    build_pair("tiny").reference.save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoint(base_checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(base_checkpoint, directory)
    return directory


def edit_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size) -> Path``: a fresh tmpfs of ``size`` (``"100k"``) mounted under tmp_path,
    unmounted afterwards. Skips where mounting is not allowed (not root, or no mount in a container)."""
    mounted = []

    def mount(size: str, name: str = "disk") -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("needs root to mount a small tmpfs (a full disk); CI runs as root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def visible(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- 1. tracebacks where the input is at fault ------------------------------------------------------


def test_a_weights_file_that_is_a_symlink_loop_is_named_as_one(checkpoint, capsys, tmp_path):
    (checkpoint / "model.safetensors").rename(checkpoint / "real.safetensors")
    os.symlink("model.safetensors", checkpoint / "model.safetensors")  # loops on itself
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path / "r")]) == 2
    assert "model.safetensors is a symbolic link loop" in one_line_error(capsys)
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors.index.json").mkdir()  # an index that is a folder: named, not "no weights"
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is not a file"):
        build_pair(checkpoint=checkpoint)


RAISING_MODEL = """
import sys
sys.path.insert(0, {user_models!r})
import litgpt_llama
from torch import nn


def deep_helper_that_fails():
    raise RuntimeError("my block is broken")


class RaisingBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return deep_helper_that_fails()


def build(state_dict, hf_config):
    model = litgpt_llama.build(state_dict, hf_config)
    model.transformer.h[1] = RaisingBlock(model.transformer.h[1])
    return model
"""


def test_a_forward_that_raises_is_named_down_to_the_users_function(capsys, tmp_path):
    ours = tmp_path / "raising_model.py"
    ours.write_text(RAISING_MODEL.format(user_models=str(USER_MODELS)))
    argv = ["check", "--ours", f"{ours}:build", "--reference", "llama3", "--no-semantic", "--report-dir", str(tmp_path)]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert "raised RuntimeError: my block is broken" in err
    assert "(in deep_helper_that_fails, raising_model.py:" in err, err


def test_an_internal_error_says_it_is_parity_s_bug_and_where_to_report_it(capsys, monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug of parity's own")

    monkeypatch.setattr("parity.run.check.check", broken)
    assert main(["check", "olmo3", "--report-dir", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug of parity's own" in err
    last = err.strip().splitlines()[-1]
    assert "this is a bug in parity, not a problem with your input" in last and "report it" in last
    assert f"parity {parity.__version__}" in last and "torch " in last


def test_parity_s_recording_failing_inside_a_user_forward_is_parity_s_bug_not_the_model_s(
    capsys, monkeypatch, tmp_path
):
    """A user's model that runs on its own, where parity's tap handling raises: not "your model's forward raised"
    (exit 2, bad input) but parity's bug (exit 3, the traceback kept), read by running the same forward without
    parity's hooks, function capture and taps."""

    def broken(*args, **kwargs):
        raise RuntimeError("a tap parity cannot place")

    monkeypatch.setattr("parity.record.hooks._tap_node", broken)
    ours = USER_MODELS / "book_olmo3.py"
    argv = ["check", "--ours", f"{ours}:build", "--reference", "olmo3", "--no-semantic", "--report-dir", str(tmp_path)]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "RuntimeError: a tap parity cannot place" in err and "your model's forward" not in err, err
    assert "runs without parity's hooks and function capture on the same input, so this is a bug of parity's" in err
    assert "this is a bug in parity, not a problem with your input" in err.strip().splitlines()[-1]


# --- 2. a full disk: nothing visible, the space needed said, exit 2 ------------------------------------


def test_a_report_on_a_full_disk_leaves_nothing_and_says_the_space_needed(tmpfs, capsys):
    disk = tmpfs("100k")
    argv = ["check", "olmo3", "--format", "html,csv,json,junit", "--report-dir", str(disk / "reports")]
    assert main(argv) == 2  # was: a traceback, and exit 0 in one case
    err = one_line_error(capsys)
    assert "the report (html, csv, json, junit) could not be written: no space left" in err
    assert "it needs about" in err and "KiB free" in err and "nothing was written" in err
    assert visible(disk) == ["reports"]  # the parent it made up front; no report folder, no staging folder


def test_a_golden_trace_on_a_full_disk_leaves_nothing(tmpfs, capsys):
    disk = tmpfs("100k")
    assert main(["record", "olmo3", "--save-weights", "--out", str(disk / "trace")]) == 2
    err = one_line_error(capsys)
    assert f"the trace {disk / 'trace'} could not be written: no space left" in err and "it needs about" in err
    assert visible(disk) == []


def test_a_spill_that_runs_out_of_disk_mid_run_is_one_line_and_removed(tmpfs, capsys, monkeypatch, tmp_path):
    disk = tmpfs("40k")
    monkeypatch.setattr(tempfile, "tempdir", str(disk))  # $TMPDIR: where traces spill
    monkeypatch.setattr("parity.run.plan.require_disk", lambda *a, **k: None)  # the disk filled after planning
    argv = ["check", "olmo3", "--trace-memory", "0", "--report-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert "the trace spilled past the memory budget" in err and "no space left" in err and "needs about" in err
    assert not [p for p in disk.iterdir() if p.name.startswith("parity-trace-")]


def test_an_unwritable_report_folder_is_one_line(monkeypatch, capsys, tmp_path):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "r"))

    monkeypatch.setattr("parity.util.files.atomic_write", read_only)
    monkeypatch.setattr("parity.report.tables.atomic_write", read_only)
    assert main(["check", "olmo3", "--format", "json", "--report-dir", str(tmp_path / "r")]) == 2
    assert "could not be written to" in one_line_error(capsys)
    assert not [p for p in (tmp_path / "r").iterdir()]


def test_the_baseline_on_a_full_disk_stays_as_it_was(tmpfs):
    from parity.gate.baseline import write_baseline
    from parity.util.errors import OutputError

    disk = tmpfs("8k")
    path = disk / "baseline.json"
    path.write_text('{"version": 2, "cases": {}}')
    (disk / "fill").write_bytes(b"\0" * 4096)
    nodes = {f"node{j}": {"max_abs": 1.0} for j in range(60)}
    cases = {f"olmo3/case{i}/config/float32": {"nodes": nodes} for i in range(9)}
    with pytest.raises(OutputError, match=r"the baseline .*baseline.json could not be written: no space left"):
        write_baseline(path, {"cases": cases}, [], [])  # was: an OSError traceback (exit 3)
    assert path.read_text() == '{"version": 2, "cases": {}}'
    assert sorted(p.name for p in disk.iterdir()) == ["baseline.json", "fill"]


CHDIR_MODEL = """
import os
import sys
sys.path.insert(0, {user_models!r})
import litgpt_llama


def build(state_dict, hf_config):
    model = litgpt_llama.build(state_dict, hf_config)
    forward = model.forward

    def moving(input_ids, attention_mask=None):
        os.chdir({elsewhere!r})
        return forward(input_ids)

    model.forward = moving
    return model
"""


def test_a_forward_that_changes_the_working_folder_moves_no_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    ours = tmp_path / "chdir_model.py"
    ours.write_text(CHDIR_MODEL.format(user_models=str(USER_MODELS), elsewhere=str(tmp_path / "elsewhere")))
    argv = ["check", "--ours", f"{ours}:build", "--reference", "llama3", "--no-semantic", "--format", "json"]
    assert main([*argv, "--report-dir", "reports"]) == 0
    assert len(list((tmp_path / "reports").iterdir())) == 1  # was: written to elsewhere/reports
    assert not (tmp_path / "elsewhere" / "reports").exists()
    assert "reports: reports/llama3-tiny-" in capsys.readouterr().out


# --- 3. no refusal, no answer: the model sized from its config -----------------------------------------


def test_a_sequence_too_long_to_allocate_is_refused_before_its_ids_exist(capsys, tmp_path):
    assert main(["check", "olmo3", "--seq-len", "9000000000000", "--report-dir", str(tmp_path)]) == 2
    assert "tracing 1 x 9000000000000 tokens needs about" in one_line_error(capsys)  # was: a 72 TB torch.randint
    assert main(["check", "olmo3", "--seq-len", "99999999999999999999", "--report-dir", str(tmp_path)]) == 2
    assert "--seq-len: must be below 2^63" in one_line_error(capsys)  # was: an overflow traceback


def test_a_million_layers_is_refused_with_numbers_before_anything_is_built(capsys, tmp_path, monkeypatch):
    import parity.build.builder as builder

    built = []
    monkeypatch.setattr(builder, "random_weights", lambda *a, **k: built.append(a) or {})
    assert main(["check", "olmo3", "--layers", "1000000", "--report-dir", str(tmp_path)]) == 2  # was: hours
    err = one_line_error(capsys)
    assert "olmo3 tiny (9.33B parameters in float32) needs about" in err and "1000000 layers" in err
    assert not built


def test_fifty_thousand_layers_counts_the_modules_too(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("parity.util.resources.available_bytes", lambda: 16 * 1024**3)
    assert main(["check", "olmo3", "--layers", "50000", "--report-dir", str(tmp_path)]) == 2  # was: 10 GB and on
    err = one_line_error(capsys)
    assert "(0.47B parameters in float32) needs about 20.0 GiB but 16.0 GiB are available" in err
    assert "its 50000 layers hold about 18.3 GiB of modules" in err


def test_a_deep_config_json_is_refused_on_every_path(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("parity.util.resources.available_bytes", lambda: 8 * 1024**3)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(num_hidden_layers=200_000, layer_types=["full_attention"] * 200_000)
    (tmp_path / "deep.json").write_text(json.dumps(config))
    with pytest.raises(ParityError, match=r"olmo3 reference \(1\.87B parameters in float32\) needs about"):
        parity.check_model(book_olmo3.build, str(tmp_path / "deep.json"))
    edit_config(checkpoint, num_hidden_layers=200_000, layer_types=["full_attention"] * 200_000)
    with pytest.raises(ParityError, match=r"checkpoint .*ckpt needs about 73\.2 GiB but 8\.0 GiB are available"):
        build_pair(checkpoint=checkpoint)


# --- 4. remote code named in a config: said, never run -------------------------------------------------


def test_remote_code_in_auto_map_is_said_and_never_run(checkpoint, capsys, tmp_path):
    edit_config(checkpoint, auto_map={"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"})
    marker = tmp_path / "ran"
    (checkpoint / "modeling_mine.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "config.json names remote code (auto_map: AutoModelForCausalLM -> modeling_mine.MineForCausalLM)" in out
    assert "parity never runs it" in out and not marker.exists()
    res = parity.check_model(book_olmo3.build, str(checkpoint), semantic=False)
    assert any("names remote code" in n for n in res.notes)


def test_a_model_type_only_remote_code_implements_is_refused_by_name(checkpoint, capsys, tmp_path):
    edit_config(checkpoint, model_type="mine", auto_map={"AutoModelForCausalLM": "modeling_mine.Mine"})
    argv = ["check", "--ours", f"{USER_MODELS / 'book_olmo3.py'}:build", "--reference", str(checkpoint)]
    assert main([*argv, "--report-dir", str(tmp_path)]) == 2
    err = one_line_error(capsys)
    assert "has model_type 'mine', which Transformers" in err and "its auto_map names remote code" in err
    assert "Should contain one of" not in err  # no list of every model_type Transformers knows


def test_a_text_model_config_with_a_text_config_is_named(checkpoint, capsys, tmp_path):
    edit_config(checkpoint, text_config={"model_type": "olmo3"})
    assert main(["check", "olmo3", "--checkpoint", str(checkpoint), "--report-dir", str(tmp_path)]) == 2
    err = one_line_error(capsys)  # was: "num_hidden_layers is 0 (and 5 more)", read from the nested config
    assert "has model_type 'olmo3', a text model, but also a text_config" in err


def test_a_weights_file_that_is_a_fifo_is_named_not_read(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    os.mkfifo(checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a file"):  # was: "no model.safetensors"
        build_pair(checkpoint=checkpoint)


# --- 5. decode plans that say nothing ------------------------------------------------------------------


def test_a_decode_plan_of_zero_steps_is_refused(capsys, tmp_path):
    assert main(["check", "olmo3", "--decode", "12x0", "--report-dir", str(tmp_path)]) == 2
    assert "steps is 0; it must be at least 1" in one_line_error(capsys)


# --- 6. small things -------------------------------------------------------------------------------------


def test_a_config_json_names_the_report_folder_by_its_folder(tmp_path, capsys):
    folder = tmp_path / "olmo3-mini"
    folder.mkdir()
    build_pair("tiny").reference.config.to_json_file(folder / "config.json")
    reports = tmp_path / "reports"
    assert (
        main(
            [
                "check",
                "olmo3",
                "--config",
                str(folder / "config.json"),
                "--format",
                "json",
                "--report-dir",
                str(reports),
            ]
        )
        == 0
    )
    (report,) = reports.iterdir()
    assert report.name.startswith("olmo3-olmo3-mini-"), report.name  # was: olmo3-config.json-...


def test_a_cast_checkpoint_lists_one_conversion_line_per_kind(checkpoint, tmp_path):
    res = parity.check(build_pair(checkpoint=checkpoint, dtype=torch.bfloat16))
    html = res.write_html(tmp_path / "report.html").read_text()
    n = len(res.coverage.conversions)
    assert n > 10 and html.count("float32 -&gt; bfloat16") == 1, html.count("float32 -&gt; bfloat16")
    assert f"{n} tensors: float32 -&gt; bfloat16 (" in html


def _dead_spill(parent: Path, size: int) -> Path:
    from parity.util.files import _HOST, SPILL_PREFIX

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process holds any more: its run was killed
    folder = parent / f"{SPILL_PREFIX}{_HOST}-{dead.pid}-abcd"
    folder.mkdir()
    (folder / "000001.safetensors").write_bytes(b"\0" * size)
    return folder


def test_a_killed_runs_spill_folder_is_removed_by_the_next_run_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = _dead_spill(tmp_path, 3 << 20)
    assert (
        main(["check", "olmo3", "--format", "json", "--report-dir", str(tmp_path / "r")]) == 0
    )  # spills nothing itself
    assert not folder.exists()
    out = " ".join(capsys.readouterr().out.split())
    assert f"removed 1 trace spill folder (3 MiB) that killed parity runs left in {tmp_path}" in out


# --- 7. more from the same round -------------------------------------------------------------------------


def test_a_build_that_edits_the_reference_weights_in_place_is_judged_on_copies(monkeypatch):
    """The reference holds the state dict's very tensors: a build editing them in place would change both sides
    alike (was: PASS). They are put back and the build runs again on copies of its own, so its edit is judged
    (a doubled up_proj read at down_proj's input); where a copy does not fit in memory it is refused by name."""

    def scales_in_place(state_dict, hf_config):
        state_dict["model.layers.0.mlp.up_proj.weight"].mul_(2)
        return litgpt_llama.build(state_dict, hf_config)

    def edits_through_data(state_dict, hf_config):
        state_dict["model.layers.1.self_attn.q_proj.weight"].data[:] = 0
        return litgpt_llama.build(state_dict, hf_config)

    res = parity.check_model(scales_in_place, "llama3", semantic=False)
    assert not res.passed and res.first_mismatch.name == "model.layers.0.mlp.down_proj", res.verdict()
    assert "times 2 at every position" in res.first_mismatch.hint.text
    assert any("edits 1 tensor(s) of the state dict in place (model.layers.0.mlp.up_proj.weight)" in c
               for c in res.coverage.conversions)  # fmt: skip
    with pytest.raises(ParityError, match=r"model.layers.1.self_attn.q_proj.weight.* are in no parameter"):
        parity.check_model(edits_through_data, "llama3", semantic=False)  # ours' zeroed copy holds no q_proj
    monkeypatch.setattr("parity.user.check_model.available_bytes", lambda: 1)  # no room for a copy
    for build in (scales_in_place, edits_through_data):
        with pytest.raises(ParityError, match=r"changed 1 reference tensor\(s\) in place \(model.layers"):
            parity.check_model(build, "llama3", semantic=False)

    def consumes_its_keys(state_dict, hf_config):  # a loader that pops what it placed: its own dict, no harm
        model = litgpt_llama.build(state_dict, hf_config)
        state_dict.clear()
        return model

    assert parity.check_model(consumes_its_keys, "llama3", semantic=False).passed  # was: nothing aligned, exit 2


def test_update_baseline_on_a_read_only_baseline_is_refused_before_the_gate_runs(monkeypatch, capsys, tmp_path):
    baseline = tmp_path / "ro" / "baseline.json"
    baseline.parent.mkdir()
    real_access = os.access
    monkeypatch.setattr("os.access", lambda p, mode: False if Path(p) == baseline.parent else real_access(p, mode))

    def ran(*args, **kwargs):
        raise AssertionError("the gate ran before the baseline was found unwritable")

    monkeypatch.setattr("parity.cli._gate_pytest", ran)
    monkeypatch.chdir(ROOT)
    argv = ["gate", "--family", "olmo3", "--update-baseline", "--baseline", str(baseline), "--no-reports"]
    assert main(argv) == 2
    assert "--update-baseline: the baseline" in one_line_error(capsys)


class _PaddingAtZero(book_olmo3.Olmo3Model):
    """Correct, but positions counted over each row's real tokens with padding at 0 (generation gives
    it 1), and no position_ids argument."""

    def forward(self, in_idx, attention_mask=None):
        b, n = in_idx.shape
        x = self.tok_emb(in_idx)
        masks = self.build_masks(n, attention_mask, in_idx.device)
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0) if attention_mask is not None else None
        pos = torch.arange(n).expand(b, n) if pos is None else pos
        rope = {}
        for kind in set(self.cfg["layer_types"]):
            inv_freq, scale = book_olmo3.compute_rope_params(self.cfg, kind)
            angles = pos[..., None].float() * inv_freq[None, None, :]
            angles = torch.cat([angles, angles], -1)[:, None]
            rope[kind] = (angles.cos() * scale, angles.sin() * scale)
        for block in self.trf_blocks:
            x = block(x, masks[block.layer_type], *rope[block.layer_type])
        return self.out_head(self.final_norm(x))


def test_padding_at_position_zero_in_a_user_model_is_not_judged():
    def build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        model.__class__ = _PaddingAtZero
        return model

    res = parity.check_model(build, "olmo3", left_pad=3, batch_size=2, semantic=False)
    # what a user's model computes at padding positions is its own: not judged, and said so
    assert res.passed, res.verdict()
    assert any(
        n.startswith("padding: 3 of 32 token positions are padding (row 0: 3) and were not judged") for n in res.notes
    )


@pytest.mark.parametrize("family", ["llama3", "tiny_aya"])
def test_zero_heads_names_the_field_not_a_division_by_zero(family, tmp_path):
    from parity.build.builder import make_reference
    from parity.model.registry import get_family

    fam = get_family(family)
    raw = json.loads(make_reference(fam).hf_config.to_json_string())
    raw["num_attention_heads"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    for call in (
        lambda: parity.build.build_pair(fam, config=str(path)),
        lambda: parity.check_model(never_built, str(path)),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        assert "num_attention_heads is 0; it must be at least 1" in str(info.value)  # was: integer modulo by zero
    cfg = fam.configs["tiny"]()
    cfg["n_heads"] = 0
    with pytest.raises(ConfigError, match=r"n_heads is 0; it must be"):
        parity.build.build_pair(fam, config=cfg)


def never_built(state_dict, hf_config):  # the reference is refused before build is called
    raise AssertionError("build called")


@pytest.mark.parametrize("value", [2.5, "8", True, float("nan")])
def test_a_count_field_of_the_wrong_type_is_named(value, tmp_path):
    raw = json.loads(build_pair("tiny").reference.config.to_json_string())
    raw["head_dim"] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(
        ConfigError, match=rf"head_dim is {value!r}; it must be an integer" if value == value else "head_dim"
    ):
        build_pair(config=str(path))  # was: 2.5 rounded to 2 on one side, then a TypeError (exit 3)


def test_a_null_field_the_model_needs_is_one_line_naming_it():
    cfg = dict(build_pair("tiny").source.cfg, head_dim=None)
    message = r"Olmo3ForCausalLM cannot be built from this config: .*\(null in the config: head_dim\)"
    with pytest.raises(ConfigError, match=message):  # was: a TypeError from Transformers' RoPE (exit 3)
        build_pair(config=cfg)


def test_a_node_map_naming_what_your_model_lacks_is_bad_input(capsys, tmp_path):
    ours = f"{USER_MODELS / 'litgpt_llama.py'}:build"
    cases = {
        "missing module": (
            {"model.layers.0.self_attn.context": "transformer.h.0.attn.nope"},
            "has no module 'transformer.h.0.attn.nope' (did you mean transformer.h.0.attn?)",
        ),
        "unknown node": (
            {"model.layers.0.self_attn.nope": "transformer.h.0.attn"},
            "'model.layers.0.self_attn.nope' matches no reference node",
        ),
        "unknown argument": (
            {"model.layers.0.self_attn.context": "transformer.h.0.attn.proj@inputs"},
            "forward has no argument 'inputs'",
        ),
    }
    for name, (node_map, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(json.dumps(node_map))
        argv = [
            "check",
            "--ours",
            ours,
            "--reference",
            "llama3",
            "--node-map",
            str(path),
            "--report-dir",
            str(tmp_path),
        ]
        assert main([*argv, "--no-semantic"]) == 2, name  # was: exit 1 (a missing node), or silently ignored
        assert message in one_line_error(capsys), name


def test_a_node_map_glob_names_every_layer_with_i():
    node_map = {"model.layers.*.self_attn.context": "transformer.h.{i}.attn.proj@input"}
    res = parity.check_model(litgpt_llama.build, "llama3", node_map=node_map, semantic=False)
    assert res.passed
    rows = {r.node: r for r in res.alignment}
    assert rows["model.layers.1.self_attn.context"].ours == "transformer.h.1.attn.proj@input"


def test_an_interrupted_run_says_so(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("parity.run.check.check", interrupted)
    assert main(["check", "olmo3", "--report-dir", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "parity: interrupted"  # was: nothing at all
    assert not list(tmp_path.iterdir())


def test_an_empty_option_is_refused_not_taken_for_the_default(capsys, tmp_path):
    assert main(["check", "olmo3", "--config", "", "--report-dir", str(tmp_path)]) == 2  # was: the default config
    assert one_line_error(capsys).endswith("--config is empty")


def test_bad_calls_of_the_python_api_are_one_line(tmp_path):
    pair = build_pair("tiny")
    with pytest.raises(ParityError, match="unknown option 'seqlen'"):
        parity.check_model(litgpt_llama.build, "llama3", seqlen=8)
    with pytest.raises(ParityError, match="input_ids must be an integer tensor"):
        parity.check(pair, torch.rand(1, 8))
    with pytest.raises(ParityError, match=r"input_ids hold no token: shape \(1, 0\)"):
        parity.check(pair, torch.ones(1, 0, dtype=torch.long))  # was: a RuntimeError from min()
    with pytest.raises(ParityError, match="layout must be one of"):
        parity.tap(torch.ones(2), "q_rot", layout="sbhd")  # outside a trace too
    with pytest.raises(ParityError, match="the name must be a non-empty string, got 5"):
        parity.tap(torch.ones(2), 5)  # was: returned silently
    with pytest.raises(ParityError, match=r"the first argument must be a torch\.Tensor, got list"):
        parity.tap([1, 2], "q_rot")


def test_usage_errors_are_answered_before_torch_is_imported():
    code = (
        "import sys\n"
        "from parity.cli import main\n"
        "for argv in (['check', 'olmo3', '--seq-len', '-1'], ['check', 'no_such_family'], "
        "['check', 'olmo3', '--decode', '12x0'], ['check', 'olmo3', '--left-pad', '3'], "
        "['record', 'olmo3'], ['compare', 'x'], ['gate', '--no-reports', '--report-dir', 'x']):\n"
        "    assert main(argv) == 2, argv\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("parity: error:") == 7


# --- 8. what a user reads --------------------------------------------------------------------------------


CONTRACT = "forward(input_ids, attention_mask=None, position_ids=None) -> logits"


def test_the_model_contract_is_in_the_readme_and_in_help():
    readme = " ".join((ROOT / "README.md").read_text().split())
    section = readme[readme.index("## Check your own model") :]
    assert CONTRACT in section[:4000]
    assert CONTRACT in " ".join((parity.check_model.__doc__ or "").split())


def test_the_readme_sample_run_shows_the_nodes_a_run_shows():
    import re

    readme = (ROOT / "README.md").read_text()
    sample = readme[readme.index("$ parity check olmo3") :]
    sample = sample[: sample.index("```")]
    n = len(build_pair("tiny").nodes)
    assert f"PASS: all {n} nodes agree" in sample  # was: 71 where the run shows more
    last = re.findall(r"│ (\d+) │ (\S+)", sample)[-1]
    assert last == (str(n - 1), "logits"), last


def test_parity_list_marks_each_familys_default_config(capsys):
    from parity.model.registry import families

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for family in families().values():
        assert f"{family.default_config} (default)" in out, family.name
    assert out.count("(default)") == len(families())


def _cell_width(svg: str, index: int) -> float:
    import re

    block = svg[svg.index(f'xlink:href="#node-{index}"') :]
    xs = [float(x) for x in re.findall(r"[ML] ([\d.]+) [\d.]+", block[: block.index("</a>")])]
    return max(xs) - min(xs)


def test_the_depth_heatmap_paints_an_outside_node_as_one_cell(fault):
    from parity.report import plots

    svg = plots.depth_heatmap_svg(fault.nodes, fault.first_mismatch.index)
    embed = next(n for n in fault.nodes if n.name == "model.embed_tokens")
    q_proj = next(n for n in fault.nodes if n.name == "model.layers.0.self_attn.q_proj")
    assert abs(_cell_width(svg, embed.index) - _cell_width(svg, q_proj.index)) < 0.01  # was: the whole row


def test_a_both_mode_report_has_an_isolated_column(tmp_path):
    pair = build_pair("tiny")
    pair.ours.blocks[0].ff.fc1.weight = nn.Parameter(
        pair.ours.blocks[0].ff.fc1.weight.detach() * 2, requires_grad=False
    )
    html = parity.check(pair, mode="both").write_html(tmp_path / "report.html").read_text()
    table = html[html.index('<table id="nodes">') :]
    assert '<button type="button">isolated</button>' in table[: table.index("</thead>")]
    gate = table[table.index('data-name="model.layers.0.mlp.gate_proj"') :]
    assert '<td class="iso iso-bad"' in gate[: gate.index("</tr>")]


# --- issue 25, item 7: smaller defects -------------------------------------------------------------------


def test_ours_from_a_file_imports_its_neighbours(tmp_path, capsys):
    (tmp_path / "helpers_of_mine.py").write_text(
        f"import sys\nsys.path.insert(0, {str(USER_MODELS)!r})\nfrom litgpt_llama import build\n"
    )
    (tmp_path / "my_model.py").write_text("from helpers_of_mine import build\n")
    assert main(["align", "--ours", f"{tmp_path / 'my_model.py'}:build", "--reference", "llama3"]) == 0  # was: exit 2
    capsys.readouterr()


def test_a_missing_checkpoint_folder_is_missing_not_an_unknown_family(capsys, tmp_path):
    ours = f"{USER_MODELS / 'litgpt_llama.py'}:build"
    for reference in (str(tmp_path / "no_such_checkpoint"), "./no_such_checkpoint"):
        assert main(["check", "--ours", ours, "--reference", reference, "--report-dir", str(tmp_path)]) == 2
        err = one_line_error(capsys)
        assert "does not exist" in err and "unknown family" not in err, err


def test_left_pad_with_a_forward_that_takes_no_mask_is_refused_before_it_runs(tmp_path):
    def build(state_dict, hf_config):
        model = litgpt_llama.build(state_dict, hf_config)
        model.__class__ = type(
            "NoMask", (type(model),), {"forward": lambda self, input_ids: type(model).forward(self, input_ids)}
        )
        return model

    with pytest.raises(
        ParityError, match=r"takes no attention_mask: accept one, forward\(input_ids, attention_mask=None"
    ):
        parity.check_model(build, "llama3", left_pad=2, batch_size=2, semantic=False)


def _node(name, index, status="ok", max_abs=0.0):
    return NodeResult(
        name, index, status, 0, name.rsplit(".", 1)[-1], (1,), (1,), "float32", max_abs, max_abs, 0.0, 1.0, 1e-4, 1e-4
    )


def test_the_origin_never_lies_downstream_or_blames_rounding_for_a_shape():
    chained = [_node("a", 0), _node("b", 1, "mismatch", 1.0), _node("c", 2, "mismatch", 1.0)]
    isolated = [_node("a", 0, max_abs=1e-9), _node("b", 1, max_abs=1e-9), _node("c", 2, "mismatch", 1.0)]
    noise = {"a": 1e-6, "b": 1e-6, "c": 1e-6}
    origin, reason = find_origin(chained, isolated, noise)
    assert origin is None and "c is where the error starts" not in reason  # c comes after the first mismatch, b
    shape = [_node("a", 0), _node("b", 1, "shape", None)]
    assert find_origin(shape, [_node("a", 0, max_abs=1e-9), _node("b", 1, max_abs=1e-9)], noise) == (None, "")


def test_a_transformers_release_outside_the_tested_range_is_refused_by_name(monkeypatch, capsys, tmp_path):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "5.3.0" if name == "transformers" else real(name))
    assert main(["check", "olmo3", "--report-dir", str(tmp_path)]) == 2
    err = one_line_error(capsys)
    assert "Transformers 5.3.0 is installed; parity is tested with Transformers >=5.24,<5.25" in err
    with pytest.raises(ParityError, match=r"Transformers 5\.3\.0"):
        build_pair("tiny")


def test_pyproject_pins_the_tested_transformers_range():
    from parity.util.version import TRANSFORMERS_TESTED

    low, high = TRANSFORMERS_TESTED
    assert f'"transformers>={low},<{high}"' in (ROOT / "pyproject.toml").read_text()
