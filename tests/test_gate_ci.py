"""The gate in real CI: the documented pre-commit setup refuses a broken loader; a project's own
`pytest` runs the gate with its families and baseline; the GitHub Actions workflows validate and
would run on a stock runner; SIGTERM and SIGKILL leave nothing behind; path limits are checked up
front."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from parity.cli import build_parser, main
from parity.gate.run import GateRun
from parity.gate.run import plan as gate_plan
from parity.model.registry import families, family_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

LOADER = '''\
"""My loader: checkpoint key -> parameter of MiniLlama."""
from reference_pairs.llama3.loader import WEIGHT_MAP

WEIGHTS = {
    **{k: v for k, v in WEIGHT_MAP.items() if ".mlp." not in k},
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.ff.fc1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.ff.fc2.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.ff.fc3.weight",
}
'''
FAMILY = '''\
"""My family: a from-scratch Llama under another name, against transformers.LlamaForCausalLM."""
import dataclasses

from reference_pairs.llama3 import FAMILY as LLAMA3
from reference_pairs.llama3.model import Llama3Model

from .loader import WEIGHTS


class MiniLlama(Llama3Model):
    """A user's own model class."""


FAMILY = dataclasses.replace(LLAMA3, name="mini_llama", model_class=MiniLlama, weights=WEIGHTS,
                             faults=(), real_configs=(), ci_configs=("tiny",))
'''


def break_loader(path: Path) -> None:
    """Swap the gate and up targets, the fault of issue 21."""
    text = path.read_text()
    swapped = (
        text.replace("ff.fc1.weight", "ff.FC_A")
        .replace("ff.fc2.weight", "ff.fc1.weight")
        .replace("ff.FC_A", "ff.fc2.weight")
    )
    assert swapped != text
    path.write_text(swapped)


def readme_block(marker: str, lang: str) -> str:
    """The first ```lang block after the README line holding ``marker``."""
    at = README.index(marker)
    match = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, at)
    assert match, f"no {lang} block after {marker!r} in README.md"
    return match.group(1)


def tool_env(tmp_path: Path) -> dict:
    """This venv's tools first on PATH (the hook is language: system), offline, a private pre-commit home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PRE_COMMIT"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        PRE_COMMIT_HOME=str(tmp_path / "pre-commit-home"),
        # torch._dynamo (imported with Transformers' modeling code) makes its cache folder in $TMPDIR unless
        # this is set, and sets it in os.environ: tests that read $TMPDIR would depend on what ran before
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torchinductor"),
        GIT_CONFIG_NOSYSTEM="1",
        HOME=str(tmp_path / "home"),
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def sh(args, cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"{args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def user_project(tmp_path):
    """A repository of someone who uses parity: one family of their own (mymodels), registered in
    their pyproject.toml, with the baseline where they want it, written by the real update path."""
    repo = tmp_path / "myproject"
    (repo / "mymodels").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "mymodels" / "__init__.py").write_text("")
    (repo / "mymodels" / "loader.py").write_text(LOADER)
    (repo / "mymodels" / "family.py").write_text(FAMILY)
    (repo / "README.md").write_text("my models\n")
    pyproject = readme_block("pyproject.toml of your project", "toml")
    assert 'baseline = "tests/parity-baseline.json"' in pyproject and "mymodels.family:FAMILY" in pyproject
    (repo / "pyproject.toml").write_text('[project]\nname = "mymodels"\nversion = "0.1.0"\n\n' + pyproject)
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        run = GateRun.prepare(repo, update=True)
        assert run.names == ["mini_llama"]  # its own family, not the installed built-ins
        for case in run.cases:
            run.evaluate(case)
        run.config_holes("mini_llama")
        assert run.finish()
        run.close()
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name.split(".")[0] == "mymodels":
                del sys.modules[name]
    assert (repo / "tests" / "parity-baseline.json").is_file()
    return repo


# --- pre-commit ----------------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_pre_commit_refuses_a_broken_loader_in_a_users_repository(tmp_path, user_project):
    """The documented setup: a repository of one's own, parity's hook by repo and rev. The first
    commit (no HEAD yet) runs the gate and passes; swapping gate/up in the loader is refused."""
    env = tool_env(tmp_path)
    hooks = tmp_path / "parity-hooks"  # parity's repository as pre-commit clones it: its hook manifest
    hooks.mkdir()
    shutil.copy(ROOT / ".pre-commit-hooks.yaml", hooks)
    sh(["git", "init", "-q"], hooks, env)
    sh(["git", "add", "-A"], hooks, env)
    sh(["git", "commit", "-qm", "hooks"], hooks, env)
    rev = sh(["git", "rev-parse", "HEAD"], hooks, env).stdout.strip()

    config = readme_block("`.pre-commit-config.yaml` of your project", "yaml")
    config = re.sub(r"repo: .*", f"repo: {hooks}", config)
    config = re.sub(r"rev: .*", f"rev: {rev}", config)
    (user_project / ".pre-commit-config.yaml").write_text(config)
    sh(["git", "init", "-q"], user_project, env)
    sh([sys.executable, "-m", "pre_commit", "install"], user_project, env)

    sh(["git", "add", "-A"], user_project, env)
    first = sh(["git", "commit", "-m", "first"], user_project, env, check=False)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "gate: 6 of 6 cases pass" in first.stdout + first.stderr  # checked, not skipped

    break_loader(user_project / "mymodels" / "loader.py")
    sh(["git", "add", "-A"], user_project, env)
    broken = sh(["git", "commit", "-m", "broken loader"], user_project, env, check=False)
    out = broken.stdout + broken.stderr
    assert broken.returncode != 0, out
    assert "mini_llama: mymodels/loader.py changed" in out
    assert "mini_llama/tiny/config/float32: model.layers.0.mlp.gate_proj: mismatch" in out
    assert "gate: 0 of 6 cases pass" in out
    assert sh(["git", "rev-list", "--count", "HEAD"], user_project, env).stdout.strip() == "1"  # refused


@pytest.mark.slow
def test_pre_commit_in_paritys_own_repository(tmp_path):
    """parity's own .pre-commit-config.yaml on a copy of this repository: swapping gate/up in
    reference_pairs/llama3/loader.py is refused (the installed parity is not what it tests), and
    `pre-commit run --all-files` runs every family."""
    env = tool_env(tmp_path)
    repo = tmp_path / "parity"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    sh(["git", "init", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-qm", "copy"], repo, env)
    sh([sys.executable, "-m", "pre_commit", "install"], repo, env)
    loader = repo / "reference_pairs" / "llama3" / "loader.py"
    loader.write_text(
        loader.read_text()
        + textwrap.dedent("""
        G, U = "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"
        WEIGHT_MAP[G], WEIGHT_MAP[U] = WEIGHT_MAP[U], WEIGHT_MAP[G]
    """)
    )
    sh(["git", "add", "-A"], repo, env)
    broken = sh(["git", "commit", "-m", "swap gate/up"], repo, env, check=False)
    out = broken.stdout + broken.stderr
    assert broken.returncode != 0 and "llama3/tiny/config/float32: model.layers.0.mlp.gate_proj: mismatch" in out, out
    sh(["git", "checkout", "--", "."], repo, env)
    sh(["git", "reset", "-q"], repo, env)
    sh(["git", "checkout", "--", "."], repo, env)
    every = sh([sys.executable, "-m", "pre_commit", "run", "--all-files"], repo, env, check=False)
    out = every.stdout + every.stderr
    n = len(gate_plan(family_names(), families()))  # every registered family's cases, however many ship
    assert (
        every.returncode == 0 and "all families: shared code changed" in out and f"gate: {n} of {n} cases pass" in out
    ), out


# --- a project's own pytest runs the gate -------------------------------------------------------------------


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_a_projects_pytest_runs_the_gate_with_junit_and_reports(user_project, tmp_path):
    """`pytest` in the user's repository (parity_gate = true, no paths): the gate's cases are its tests,
    JUnit is pytest's --junitxml, and a failing case names its report folder."""
    env = tool_env(tmp_path)
    ini = readme_block("project's own `pytest`:", "toml")
    assert "parity_gate = true" in ini
    with open(user_project / "pyproject.toml", "a") as fh:
        fh.write("\n" + ini)
    break_loader(user_project / "mymodels" / "loader.py")
    junit = tmp_path / "junit.xml"
    proc = sh(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={junit}",
            "-k",
            "float32 or coverage",
        ],
        user_project,
        env,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 failed, 1 passed, 3 deselected" in out, out  # the float32 cases, and the config-coverage test
    text = junit.read_text()
    assert text.count("<testcase") == 4 and 'name="test_gate[mini_llama/tiny/checkpoint-sharded/float32]"' in text
    folders = sorted((user_project / "reports").iterdir())
    assert len(folders) == 3 and all((f / "report.html").is_file() and (f / "gate.json").is_file() for f in folders)
    assert f"every problem (gate.json) and the report: {folders[0]}" in out
    problems = json.loads((folders[0] / "gate.json").read_text())
    assert problems["problems"][0].startswith("model.layers.0.mlp.gate_proj: mismatch")


def test_gate_in_a_project_without_families_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "empty"\n')
    saved = list(sys.path)
    try:
        code = pytest.main(
            [
                f"--rootdir={tmp_path}",
                "-c",
                str(tmp_path / "pyproject.toml"),
                "-p",
                "no:cacheprovider",
                "--parity-gate",
                str(tmp_path),
            ]
        )
    finally:
        sys.path[:] = saved
    assert code == pytest.ExitCode.USAGE_ERROR
    err = capsys.readouterr().err
    assert f"ERROR: parity gate: no parity family is defined in {tmp_path}: declare yours under" in err


# --- GitHub Actions -----------------------------------------------------------------------------------------

WORKFLOWS = {
    "own": ROOT / ".github" / "workflows" / "parity-gate.yml",
    "user": ROOT / "examples" / "github-actions-parity-gate.yml",
}


def load_workflow(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def workflow_schemas() -> list[dict]:
    """SchemaStore's GitHub workflow schema and the require-timeout one, as check-jsonschema ships them
    (actionlint has no wheel on the package index, so the workflows are validated against these)."""
    check_jsonschema = pytest.importorskip(
        "check_jsonschema", reason="pip install -e '.[test]' installs check-jsonschema"
    )
    base = Path(check_jsonschema.__file__).parent / "builtin_schemas"
    return [
        json.loads((base / "vendor" / "github-workflows.json").read_text()),
        json.loads((base / "custom" / "github-workflows-require-timeout.json").read_text()),
    ]


def run_lines(data: dict) -> list[str]:
    return [line for job in data["jobs"].values() for step in job["steps"] for line in step.get("run", "").splitlines()]


@pytest.mark.parametrize("which", sorted(WORKFLOWS))
def test_workflow_is_valid_and_would_run_on_a_stock_runner(which):
    import jsonschema

    path = WORKFLOWS[which]
    data = load_workflow(path)
    for schema in workflow_schemas():
        jsonschema.validate(data, schema)
    if shutil.which("actionlint"):
        proc = subprocess.run(["actionlint", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout
    (job,) = data["jobs"].values()
    assert data["permissions"]["checks"] == "write" and data["permissions"]["contents"] == "read"
    assert data["concurrency"]["cancel-in-progress"] is True and "github.ref" in data["concurrency"]["group"]
    assert 5 <= job["timeout-minutes"] <= 60
    rel = path.relative_to(ROOT).as_posix() if which == "own" else ".github/workflows/parity-gate.yml"
    assert rel in data["on"]["pull_request"]["paths"]  # the workflow's own edits run it
    setup = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip"
    # every pip install sees the CPU index first: no multi-GB CUDA torch on a runner without a GPU
    assert "download.pytorch.org/whl/cpu" in job["env"]["PIP_EXTRA_INDEX_URL"]
    installs = [line for line in run_lines(data) if "pip install" in line]
    assert installs and all("--index-url" not in line for line in installs)
    # the gate commands parse with parity's own parser, and write JUnit where the publisher looks
    gates = [shlex.split(line.strip())[1:] for line in run_lines(data) if line.strip().startswith("parity gate")]
    assert gates
    for argv in gates:
        args = build_parser().parse_args([a if "$" not in a else "main" for a in argv])
        assert args.command == "gate" and args.report_dir == "parity-reports" and not args.no_reports
    publish = next(s for s in job["steps"] if s.get("uses", "").startswith("mikepenz/action-junit-report"))
    assert publish["with"]["report_paths"] == "parity-reports/gate-*/junit.xml" and publish["if"] == "always()"


def test_users_workflow_fits_a_users_project():
    data = load_workflow(WORKFLOWS["user"])
    paths = data["on"]["pull_request"]["paths"]
    assert not any(p.startswith(("parity/", "reference_pairs/")) for p in paths)  # parity's own folders are not theirs
    assert "pyproject.toml" in paths and any("baseline" in p for p in paths)
    assert "a project that uses parity" in WORKFLOWS["user"].read_text().splitlines()[0]


# --- signals: nothing left behind ---------------------------------------------------------------------------


def _wait_for(predicate, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # a subprocess run of pytest/git (10-30 s): in .ci/run's `pytest -m slow`
def test_sigterm_leaves_no_staging_or_temporary_folder(tmp_path):
    """What CI sends on cancel: `parity gate` removes its report staging folder and its temporary
    checkpoints, then ends as SIGTERM ends a process."""
    env = tool_env(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env["TMPDIR"] = str(tmp)
    reports = tmp_path / "reports"
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity", "gate", "--family", "llama3", "--report-dir", str(reports)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert _wait_for(lambda: any(tmp.glob("parity-gate-*")) and any(reports.glob(".staging-*"))), proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(tmp.iterdir()) == [] and list(reports.iterdir()) == []


@pytest.mark.parametrize("kind", ["staging", "temporary"])
def test_a_live_folder_is_marked_before_it_exists(tmp_path, monkeypatch, kind):
    """No instant holds a made but unmarked folder: a SIGTERM there left the gate's temporary
    checkpoint folder behind (CI, stop 57: the folder made by mkdtemp, then marked)."""
    import tempfile

    from parity.util import files

    seen = []
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.startswith((".staging-", "parity-gate-")):
            seen.append(self in files._LIVE)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = files.staging_folder(tmp_path / "reports") if kind == "staging" else files.temporary_folder("parity-gate-")
    try:
        assert seen == [True] and folder.is_dir() and folder in files._LIVE
        assert folder.stat().st_mode & 0o777 == (0o700 if kind == "temporary" else 0o777 & ~files._umask())
    finally:
        files.discard(folder)
    assert not folder.exists() and folder not in files._LIVE


def test_folders_left_by_sigkill_are_swept_on_the_next_run(tmp_path):
    env = tool_env(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env["TMPDIR"] = str(tmp)
    reports = tmp_path / "reports"
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom parity.util.files import staging_folder, temporary_folder\n"
        "staging_folder(Path(sys.argv[1])); temporary_folder('parity-gate-')\nprint('ready', flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(reports)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (left_staging,), (left_tmp,) = list(reports.glob(".staging-*")), list(tmp.glob("parity-gate-*"))
    assert main(["check", "llama3", "--report-dir", str(reports), "--format", "json"]) == 0
    assert not left_staging.exists() and not any(reports.glob(".staging-*"))
    import tempfile

    from parity.util.files import discard, temporary_folder

    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)  # the next gate run's temporary folder
    try:
        discard(temporary_folder("parity-gate-"))
    finally:
        tempfile.tempdir = saved
    assert not left_tmp.exists() and list(tmp.iterdir()) == []


# --- path limits --------------------------------------------------------------------------------------------


def _long(base: Path, size: int) -> Path:
    """A path of exactly ``size`` bytes under ``base``, in parts of at most 200 bytes."""
    path = str(base)
    while len(path) < size:
        part = min(200, size - len(path) - 1)
        path += "/" + "d" * max(part, 1)
    return Path(path[:size])


@pytest.mark.parametrize("size", [4057, 4089, 4096, 5000])
@pytest.mark.parametrize("command", ["check", "gate"])
def test_report_dir_too_long_is_one_line_before_any_work(tmp_path, capsys, size, command):
    path = _long(tmp_path, size)
    argv = ["check", "llama3"] if command == "check" else ["gate", "--family", "llama3"]
    assert main([*argv, "--report-dir", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --report-dir: is " in err and "path limit" in err, err
    assert not tmp_path.joinpath("d" * 200).exists()  # refused before anything was created


def test_checkpoint_path_too_long_is_one_line(tmp_path, capsys):
    assert main(["check", "llama3", "--checkpoint", str(_long(tmp_path, 4096))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --checkpoint: is 4096 bytes" in err
    name = "c" * 300
    assert main(["check", "llama3", "--checkpoint", str(tmp_path / name)]) == 2
    assert "over the file system's 255-byte limit for a name" in capsys.readouterr().err


def test_long_checkpoint_folder_name_gives_a_short_report_folder(tmp_path, checkpoint_of, capsys):
    from reference_pairs.llama3 import build_pair

    ckpt = tmp_path / ("c" * 240)
    build_pair("tiny").reference.save_pretrained(ckpt)
    reports = tmp_path / "reports"
    assert main(["check", "llama3", "--checkpoint", str(ckpt), "--report-dir", str(reports), "--format", "json"]) == 0
    (folder,) = reports.iterdir()
    assert len(folder.name.encode()) <= 96 and folder.name.startswith("llama3-ccc")
    assert (folder / "result.json").is_file()


def test_tilde_is_expanded(tmp_path, monkeypatch, capsys):
    from reference_pairs.llama3 import build_pair

    monkeypatch.setenv("HOME", str(tmp_path))
    build_pair("tiny").reference.save_pretrained(tmp_path / "ckpt")
    assert main(["check", "llama3", "--checkpoint=~/ckpt", "--report-dir=~/x", "--format", "json"]) == 0
    (folder,) = (tmp_path / "x").iterdir()
    assert json.loads((folder / "result.json").read_text())["meta"]["checkpoint"] == str(tmp_path / "ckpt")
    assert not Path("~").exists()
