"""pytest plugin (entry point ``pytest11``): the ``parity_pair`` and ``parity_model`` fixtures, reports
of failing parity tests, and the parity gate as tests.

``parity_pair(family, config=None, **kwargs)`` builds a registered family's pair with
``parity.build.build_pair(family, config=..., **kwargs)`` (``checkpoint=``, ``dtype=``, ``seed=``, cfg
overrides). Use it with :func:`parity.testing.assert_parity`.

Reports: when a test that called ``assert_parity`` fails, its results are written (report.html,
result.json) to a new folder under ``--parity-report-dir`` (ini ``parity_report_dir``, default
``reports`` under the rootdir) and the failure message names it. ``--parity-keep-reports`` writes
them for passing tests too; ``--parity-no-reports`` writes none.

The gate: ``--parity-gate`` (or ``parity_gate = true`` in the ini, for runs given no paths) adds
the tests of :mod:`parity.gate.pytest_gate` to the session: one per case of :mod:`parity.gate` and one
config-coverage test per family, judged against the project's baseline. ``--parity-gate-family``,
``--parity-gate-baseline``, ``--parity-gate-changed-since`` and ``--parity-gate-update-baseline``
are ``parity gate``'s options; JUnit is pytest's own ``--junitxml``.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

import parity.build

_GATE = pytest.StashKey["object"]()
_GATE_OWNED = pytest.StashKey[bool]()
_REPORTS = pytest.StashKey["Reports"]()
_RESULTS = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("parity", "parity: reports of failing parity tests, and the parity gate")
    group.addoption(
        "--parity-report-dir",
        metavar="DIR",
        default=None,
        help="folder for the reports of failing parity tests (default: ini parity_report_dir, else reports)",
    )
    group.addoption("--parity-keep-reports", action="store_true", help="write reports for passing parity tests too")
    group.addoption("--parity-no-reports", action="store_true", help="write no parity reports")
    group.addoption("--parity-gate", action="store_true", help="also run the parity gate's cases in this session")
    group.addoption(
        "--parity-gate-family",
        metavar="NAME",
        action="append",
        default=None,
        help="gate only this family (repeatable; default: the project's families)",
    )
    group.addoption(
        "--parity-gate-baseline",
        metavar="PATH",
        default=None,
        help="gate baseline (default: [tool.parity] baseline, else parity-baseline.json)",
    )
    group.addoption(
        "--parity-gate-changed-since",
        metavar="REF",
        default=None,
        help="gate only the families whose files changed since this git commit",
    )
    group.addoption(
        "--parity-gate-update-baseline",
        action="store_true",
        help="rewrite the gate baseline from this session (only if every gate test passes)",
    )
    parser.addini(
        "parity_gate",
        type="bool",
        default=False,
        help="run the parity gate's cases whenever pytest runs without paths (default false)",
    )
    parser.addini("parity_report_dir", default="reports", help="folder for the reports of failing parity tests")


# --- reports --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reports:
    """Where the reports of parity tests go (``parent`` None: nowhere) and whether passing ones too."""

    parent: Path | None
    keep: bool = False

    def write(self, nodeid: str, results, extra: dict[str, str] | None = None) -> Path:
        """A new folder ``<parent>/<test>-<time>/`` with report.html and result.json per result
        (``report-2.html``... when a test made several) and the ``extra`` files; written atomically."""
        from parity.util.files import MAX_NAME, atomic_write, short_name, write_folder

        assert self.parent is not None  # called only when reports have a parent folder

        def fill(folder: Path) -> None:
            for i, result in enumerate(results, 1):
                suffix = "" if len(results) == 1 else f"-{i}"
                result.write_html(folder / f"report{suffix}.html")
                result.write_json(folder / f"result{suffix}.json")
            for name, text in (extra or {}).items():
                atomic_write(folder / name, text)

        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        module, _, test = nodeid.rpartition("::")
        name = short_name(f"{Path(module.split('::')[0]).stem}-{test}", MAX_NAME - len(stamp) - 1)
        return write_folder(self.parent, f"{name}-{stamp}", fill, f"the parity report of {nodeid}")


def _reports(config) -> Reports:
    from parity.util.files import RESERVED, path_problem

    if config.getoption("parity_no_reports"):
        return Reports(None)
    option = config.getoption("parity_report_dir")
    if option is not None:
        parent = Path(os.path.expanduser(option))
        parent = parent if parent.is_absolute() else config.invocation_params.dir / parent
    else:
        parent = config.rootpath / os.path.expanduser(config.getini("parity_report_dir"))
    problem = path_problem(parent, RESERVED)
    if problem is not None:
        raise pytest.UsageError(f"--parity-report-dir {problem}")
    if parent.exists() and not parent.is_dir():
        raise pytest.UsageError(f"--parity-report-dir {parent} is a file, not a folder")
    return Reports(parent, config.getoption("parity_keep_reports"))


def reports_of(config) -> Reports:
    return config.stash[_REPORTS]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    from parity.testing import collecting

    with collecting() as results:
        item.stash[_RESULTS] = results
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    from parity.testing import ParityAssertionError

    results = item.stash.get(_RESULTS, None)
    reports = item.config.stash.get(_REPORTS, None)
    folder = note = None
    if call.when == "call" and results and reports is not None and reports.parent is not None:
        failed = call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception)
        if failed or (call.excinfo is None and reports.keep):
            try:
                folder = reports.write(item.nodeid, results)
                note = f"parity report: {folder}"
            except OSError as e:
                note = f"parity report could not be written: {e.strerror or e}"
            if failed and isinstance(call.excinfo.value, ParityAssertionError):
                error = call.excinfo.value
                error.args = (f"{error.args[0]}{note}",)  # the table ends with a newline
                note = None
    report = yield
    if note is not None:
        report.sections.append(("parity report", note))
    return report


# --- the parity_pair fixture ----------------------------------------------------------------------------


@pytest.fixture
def parity_pair():
    """Factory: ``parity_pair("olmo3", "tiny", n_layers=2) -> parity.Pair``."""
    from parity.model.registry import get_family

    def make(family: str, config=None, **kwargs):
        fam = get_family(family)
        if config is None and kwargs.get("checkpoint") is None:
            config = fam.default_config
        return parity.build.build_pair(fam, config=config, **kwargs)

    return make


@pytest.fixture
def parity_model():
    """Factory: ``parity_model(build, "olmo3:yarn", mode="both") -> parity.CheckResult`` for your own
    model (see :func:`parity.check_model`); use with ``assert_parity``."""
    from parity.user.check_model import check_model

    return check_model


# --- the gate -------------------------------------------------------------------------------------------


def gate_run(config):
    """The session's :class:`parity.gate.run.GateRun`: the one ``parity gate`` handed in, else one
    prepared from the ``--parity-gate-*`` options (bad input is a usage error, one line)."""
    from parity.gate.project import changed_since
    from parity.gate.run import GateRun
    from parity.util.errors import ParityError

    run = config.stash.get(_GATE, None)
    if run is not None:
        return run
    handed = [p for p in config.pluginmanager.get_plugins() if isinstance(p, GateRun)]
    if handed:
        run, owned = handed[0], False
    else:
        try:
            ref = config.getoption("parity_gate_changed_since")
            run = GateRun.prepare(
                root=config.rootpath,
                baseline=config.getoption("parity_gate_baseline"),
                families=config.getoption("parity_gate_family"),
                changed=changed_since(ref, config.rootpath) if ref else None,
                update=config.getoption("parity_gate_update_baseline"),
            )
        except ParityError as e:
            raise pytest.UsageError(f"parity gate: {e}") from None
        config.add_cleanup(run.close)
        owned = True
    config.stash[_GATE] = run
    config.stash[_GATE_OWNED] = owned
    return run


def pytest_configure(config):
    config.stash[_REPORTS] = _reports(config)
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS
    if config.getoption("parity_gate") or (config.getini("parity_gate") and not explicit):
        from parity.gate.run import gate_module_path

        gate_run(config)  # bad gate options fail before anything runs
        path = str(gate_module_path())
        if path not in config.args:
            config.args.append(path)


def pytest_sessionfinish(session, exitstatus):
    """With ``--parity-gate-update-baseline``: write the baseline, or fail the session saying why not."""
    from parity.util.errors import ParityError

    config = session.config
    run = config.stash.get(_GATE, None)
    if run is None or not config.stash.get(_GATE_OWNED, False) or not run.update:
        return
    try:
        written = run.finish()
        run.finish_note = f"baseline written: {run.baseline_path}" if written else None
    except ParityError as e:
        run.finish_note = str(e)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    run = config.stash.get(_GATE, None)
    if run is None or not config.stash.get(_GATE_OWNED, False):
        return
    for line in run.selection:
        terminalreporter.write_line(f"parity gate selected: {line}")
    for note in run.version_notes:
        terminalreporter.write_line(f"parity gate note: {note}", yellow=True)
    if getattr(run, "finish_note", None):
        terminalreporter.write_line(f"parity gate: {run.finish_note}", bold=True)
