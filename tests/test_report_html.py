"""report.html: complete, self-contained, escaped; and opened in a real browser (Debian's Chromium,
driven by Playwright) where it must render without console errors, name the right node, sort,
filter and open node details. Screenshots go to $PARITY_TEST_ARTIFACTS when it is set (for CI to
keep), else to pytest's temporary folder: the test run writes nothing into the clone.

The browser tests never install anything: they use $PARITY_CHROMIUM, else a chromium on PATH, and
otherwise skip, saying how to get one (Debian: ``apt-get install chromium``; CI's ``.ci/run`` does
that itself). They assert what the page shows and does, never how fast it was.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import shutil
from pathlib import Path

import pytest

from parity.compare.results import NodeResult
from parity.model.derive import derive_facts
from parity.model.pair import annotate
from parity.report import plots
from parity.report.html import render_html
from parity.report.result import CheckResult
from reference_pairs.olmo3 import CONFIGS, FAMILY

BAD_NODE = "model.layers.0.self_attn.probs"
#: any reference that would make the page fetch something: src/href/url() to a URL, or a protocol-relative one
EXTERNAL = re.compile(
    r"""(?:\b(?:src|href|xlink:href|action)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import)""",
    re.I,
)
EVIL = "<script>alert(1)</script>"


# --- results to render


def synthetic_7b(
    n_layers: int = 32, seq: int = 64, width: int = 4096, bad_name: str = "model.layers.17.mlp.down_proj"
) -> CheckResult:
    """A CheckResult shaped like an OLMo 3 7B run in bfloat16: the real node list (1 + per-layer nodes x 32 + the nodes after the layers),
    real widths in the error profile, chained and isolated results (no 7B model is built)."""
    rng = random.Random(0)
    facts = derive_facts(FAMILY.to_hf(CONFIGS["7b-shape"](n_layers)))
    specs = annotate(FAMILY.node_specs(facts), facts)
    bad_index = next(i for i, s in enumerate(specs) if s.name == bad_name)
    nodes, isolated = [], []
    for i, spec in enumerate(specs):
        failing = i >= bad_index
        max_abs = 10 ** rng.uniform(-0.5, 1) if failing else 10 ** rng.uniform(-4, -2)
        common = dict(
            name=spec.name,
            index=i,
            layer=spec.layer,
            kind=spec.kind,
            shape_ours=(1, seq, width),
            shape_ref=(1, seq, width),
            dtype="bfloat16",
            mean_abs=max_abs / 10,
            max_rel=max_abs * 3,
            cosine=1 - max_abs / 100,
            atol=5e-2,
            rtol=5e-2,
            rel_l2=max_abs / 20,
            tol_source="default:bfloat16",
            rtol_needed=0.0,
        )
        nodes.append(
            NodeResult(
                **common,
                status="mismatch" if failing else "ok",
                max_abs=max_abs,
                atol_needed=0.9 * max_abs if failing else 0.0,
            )
        )
        own = max_abs if i == bad_index else max_abs / 1000
        isolated.append(
            NodeResult(
                **common,
                status="mismatch" if i == bad_index else "ok",
                max_abs=own,
                atol_needed=0.9 * own if i == bad_index else 0.0,
            )
        )
    meta = {
        "family": "olmo3",
        "config": "7b-shape",
        "checkpoint": None,
        "checkpoint_sha256": None,
        "dtype": "bfloat16",
        "batch_size": 1,
        "seq_len": seq,
        "seed": 0,
        "mode": "both",
        "atol": None,
        "rtol": None,
        "tolerances": {},
        "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0"},
        "time": "2026-11-30T00:00:00+00:00",
        "seconds": 12.5,
        "cfg": {"n_layers": n_layers, "emb_dim": width},
    }
    profile = {
        "node": bad_name,
        "by_position": [rng.uniform(0, 5) for _ in range(seq)],
        "by_head": None,
        "by_channel": [rng.uniform(0, 5) for _ in range(width)],
    }
    top1 = [float(rng.random() < 0.7) for _ in range(seq)]
    logits = {
        "node": "lm_head",
        "k": 5,
        "top1_agree": top1,
        "topk_overlap": [rng.uniform(0.4, 1) for _ in range(seq)],
        "kl": [rng.uniform(0, 0.5) for _ in range(seq)],
        "top1_agreement": sum(top1) / seq,
        "mean_topk_overlap": 0.7,
        "mean_kl": 0.25,
    }
    return CheckResult(nodes=nodes, meta=meta, notes=[], profile=profile, logits=logits, isolated=isolated)


def evil(result: CheckResult) -> CheckResult:
    """Markup in every name a config or a module path can bring: family, config, checkpoint, node names."""
    nodes = [
        dataclasses.replace(
            n,
            name=n.name.replace("self_attn", 'self_attn<img src=x onerror="alert(2)">'),
            kind=n.kind if n.kind != "probs" else "probs<b>$x$",
        )
        for n in result.nodes
    ]
    meta = {
        **result.meta,
        "family": EVIL,
        "config": '"><svg onload=alert(3)>',
        "checkpoint": "/c/<i>ckpt</i> & co",
        "checkpoint_sha256": "ab" * 32,
        "cfg": {**result.meta["cfg"], "name": "</pre><script>alert(4)</script>"},
    }
    notes = [*result.notes, "note with <u>markup</u>"]
    profile = {**result.profile, "node": nodes[result.first_mismatch.index].name} if result.profile else None
    return dataclasses.replace(result, nodes=nodes, meta=meta, notes=notes, profile=profile)


def html_of(result, tmp_path: Path, name: str = "report.html") -> Path:
    return result.write_html(tmp_path / name)


# --- the file itself (no browser)


def test_fault_report_has_every_section(fault, tmp_path):
    html = html_of(fault, tmp_path).read_text()
    bad = fault.first_mismatch
    assert bad.name == BAD_NODE
    card = html[html.index('id="first-mismatch"') : html.index('id="depth"')]
    assert f'data-node="{BAD_NODE}"' in html and BAD_NODE in card
    assert "likely the sliding window" in card and bad.hint.text.split(":")[0] in card
    for metric in ("max_abs", "mean_abs", "max_rel", "cosine", "rel_l2", "atol needed", "x tolerance"):
        assert metric in card
    for plot in ("plot-position", "plot-head", "plot-heatmap", "plot-depth", "plot-channel", "plot-logits"):
        assert f'id="{plot}"' in html, plot
    assert html.count('<svg class="plot"') == 6
    meta = fault.meta
    header = html[: html.index("<main>")]
    for fact in (
        "family",
        "config",
        "checkpoint",
        "dtype",
        "seq len",
        "seed",
        "mode",
        "tolerance",
        "torch",
        "transformers",
        "time",
    ):
        assert f"<dt>{fact}</dt>" in header, fact
    for value in (
        meta["versions"]["torch"],
        meta["versions"]["transformers"],
        meta["time"],
        "float32",
        "16 tokens",
        "atol 0, rtol 0 (exact: the pair is bit-identical when correct)",
    ):
        assert value in header, value
    assert "top-1 agreement" in html and "KL(reference || ours)" in html
    assert html.count('<tr id="node-') == len(fault.nodes)


def test_report_is_self_contained(fault, passing, tmp_path):
    for result in (fault, passing, synthetic_7b()):
        html = render_html(result)
        assert not EXTERNAL.search(html), EXTERNAL.search(html).group(0)
        assert '<link rel="stylesheet"' not in html and "<script src" not in html
        assert "<metadata>" not in html and "<!DOCTYPE svg" not in html  # SVG made fit for inlining
    # the pattern does catch what it is meant to catch
    for bad in (
        '<img src="https://x/y.png">',
        "<a href='//cdn.x/z'>",
        "background: url(http://x)",
        '<use xlink:href="http://x#a"/>',
    ):
        assert EXTERNAL.search(bad)


def test_plot_ids_are_unique_and_heatmap_cells_link_to_rows(fault):
    html = render_html(fault)
    ids = re.findall(r'\bid="([^"]+)"', html)
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates
    heatmap = re.search(r'<svg class="plot"[^>]*data-plot="heatmap".*?</svg>', html, re.S).group(0)
    targets = re.findall(r'<a xlink:href="#(node-\d+)"', heatmap)
    assert len(targets) == 4 * len(FAMILY.nodes.per_layer) + 1 + len(FAMILY.nodes.after) and set(targets) <= set(ids)
    assert 'target="_blank"' not in heatmap


def _plot(html: str, name: str) -> str:
    return re.search(rf'<svg class="plot"[^>]*data-plot="{name}".*?</svg>', html, re.S).group(0)


def _cell_fills(svg: str) -> dict[int, str]:
    """Node index -> fill colour of its heatmap cell."""
    return {int(i): fill for i, fill in re.findall(r'<a xlink:href="#node-(\d+)">.*?fill: (#[0-9a-f]{6})', svg, re.S)}


def _tolerant(result, atol: float = 1e-3, rtol: float = 0.0):
    """``result`` as if judged with a nonzero tolerance (statuses and ratios follow it)."""
    nodes = [
        dataclasses.replace(
            n,
            atol=atol,
            rtol=rtol,
            atol_needed=n.max_abs,
            status=("mismatch" if n.max_abs > atol else "ok") if n.status in ("ok", "mismatch") else n.status,
        )
        for n in result.nodes
    ]
    return dataclasses.replace(result, nodes=nodes, isolated=[])


def test_heatmap_shows_every_node_and_the_size_of_each_error(fault):
    """The embedding, final norm and head have cells too; each cell says its numbers on hover (an SVG
    <title>, no script needed) and the colour bar is numbered in max_abs / tolerance."""
    result = _tolerant(fault)
    html = render_html(result)
    heatmap = _plot(html, "heatmap")
    titles = dict(re.findall(r'<a xlink:href="#node-(\d+)"><title>(.*?)</title>', heatmap, re.S))
    assert set(titles) == {str(n.index) for n in result.nodes}
    for n in (result.nodes[0], result.first_mismatch, result.nodes[-1]):  # embed_tokens, probs, lm_head
        title = titles[str(n.index)]
        assert title.startswith(n.name) and n.status in title
        assert f"max_abs {n.max_abs:.3g}" in title and "x tolerance" in title
    assert "max_abs / tolerance" in heatmap and "log10" not in heatmap
    assert all(f">{tick}<" in heatmap for tick in ("1e-6", "1"))  # tick labels are ratios
    assert "above the dashed line fails" in html and "The tolerance is 0" not in html


def test_exact_tolerance_plots_and_colours_the_error_itself(fault):
    """Under atol 0, rtol 0 every failing node is infinitely far past its tolerance: the heatmap and the
    depth plot show max_abs itself (log scale, numbered bar) instead of saturating every failing cell,
    the page says so, and nothing finite is drawn or named as non-finite."""
    assert {(n.atol, n.rtol) for n in fault.nodes} == {(0.0, 0.0)}
    failing = [n for n in fault.nodes if n.failed]
    assert all(n.status == "mismatch" and 0 < n.max_abs < math.inf for n in failing)
    html = render_html(fault)
    heatmap, depth = _plot(html, "heatmap"), _plot(html, "depth")
    assert "max_abs (tolerance 0)" in heatmap and "max_abs / tolerance" not in heatmap
    # the colour bar spans the decades of the errors, numbered
    low, high = (
        math.floor(math.log10(min(n.max_abs for n in failing))),
        math.ceil(math.log10(max(n.max_abs for n in failing))),
    )
    ticks = re.findall(r"<text[^>]*>([^<]+)</text>", heatmap)
    assert plots._pow10(10.0**high) in ticks and plots._pow10(10.0**low) in ticks
    fills = _cell_fills(heatmap)
    fail_fills = {fills[n.index] for n in failing if n.index in fills}
    saturated = "#" + "".join(f"{round(255 * c):02x}" for c in plots.ERROR_CMAP(1.0)[:3])
    assert len(fail_fills) >= 5 and fail_fills != {saturated}  # graded by the size of the error
    largest = max(failing, key=lambda n: n.max_abs)
    darkness = {f: -sum(int(f[i : i + 2], 16) for i in (1, 3, 5)) for f in fail_fills}
    assert darkness[fills[largest.index]] == max(darkness.values())  # the largest error is the darkest
    exact = [n for n in fault.nodes if n.max_abs == 0]
    assert exact and {fills[n.index] for n in exact} == {plots.EXACT}
    # the hover text says why there is no ratio
    assert "tolerance 0 (atol 0, rtol 0)" in heatmap and "inf x tolerance" not in html
    card = html[html.index('id="first-mismatch"') : html.index('id="depth"')]
    assert "<td>inf (tolerance 0: any nonzero error fails)</td>" in card
    # the depth plot: max_abs on its y axis, no "non-finite" / "not comparable" marks for finite errors
    assert "max_abs (tolerance 0)" in depth and "non-finite" not in depth and "not comparable" not in depth
    assert "every point above the floor fails" in depth
    caption = html[html.index('id="plot-heatmap"') : html.index("</figure>", html.index('id="plot-heatmap"'))]
    assert "The tolerance is 0" in caption and "pale blue: exact" in caption
    assert "the error itself is plotted" in html


def test_depth_plot_names_why_a_node_has_no_value(fault):
    """Marks at the top of the depth plot say non-finite only for non-finite values; a shape mismatch
    or a missing node is "not comparable"; a zero tolerance among nonzero ones "fails a zero tolerance"."""
    result = _tolerant(fault)
    nodes = list(result.nodes)
    empty = dict(
        max_abs=None, mean_abs=None, max_rel=None, cosine=None, rel_l2=None, atol_needed=None, rtol_needed=None
    )
    nodes[-3] = dataclasses.replace(nodes[-3], status="nonfinite", max_abs=float("nan"))
    nodes[-4] = dataclasses.replace(nodes[-4], status="shape", shape_ours=(1, 16, 8), **empty)
    nodes[-5] = dataclasses.replace(nodes[-5], status="mismatch", atol=0.0, rtol=0.0, max_abs=0.5, atol_needed=0.5)
    depth = plots.depth_line_svg(nodes, None, result.first_mismatch.index)
    for why in ("chained: non-finite", "chained: not comparable", "chained: fails a zero tolerance"):
        assert why in depth, why
    assert plots.error_scale(nodes) == "ratio"
    assert "non-finite" not in plots.depth_line_svg(result.nodes, None, result.first_mismatch.index)


def test_decode_heatmap_under_exact_tolerance_is_numbered_in_max_abs(fault):
    steps = [
        dataclasses.replace(n, name=f"step{s}/{n.name}", max_abs=n.max_abs * (s + 1))
        for s in range(3)
        for n in fault.nodes
    ]
    svg = plots.decode_heatmap_svg(steps, None)
    assert "max_abs (tolerance 0)" in svg and len(set(_cell_fills(svg).values())) >= 3


def test_names_from_configs_and_module_paths_are_escaped(fault, tmp_path):
    html = html_of(evil(fault), tmp_path).read_text()
    for raw in (EVIL, "<img src=x", "<svg onload", "<i>ckpt</i>", "<u>markup</u>", "<b>$x$", "</pre><script>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "/c/&lt;i&gt;ckpt&lt;/i&gt; &amp; co" in html
    assert "ab" * 32 in html
    assert html.count("<script>") == 1  # ours, at the end


def test_pass_report_says_in_a_sentence_what_a_plot_of_nothing_would_show(passing, tmp_path):
    html = html_of(passing, tmp_path).read_text()
    n = len(passing.nodes)
    assert 'id="first-mismatch"' not in html and f"PASS: all {n} nodes agree" in html
    assert f"Every node is bit-identical to the reference (max_abs 0 at all {n} compared nodes)" in html
    assert "at every one of the 16 positions" in html
    assert '<svg class="plot"' not in html  # no empty heatmap, no flat lines


def test_near_tolerance_pass_names_the_closest_node_and_keeps_the_plots_folded(passing):
    nodes = list(passing.nodes)
    nodes[30] = dataclasses.replace(nodes[30], max_abs=5e-5, mean_abs=1e-5, atol_needed=5e-5, atol=1e-4, rtol=1e-4)
    html = render_html(dataclasses.replace(passing, nodes=nodes))
    summary = html[html.index('id="depth-summary"') : html.index("</details>", html.index('id="depth-summary"'))]
    assert nodes[30].name in summary and "0.5 of its tolerance" in summary
    assert '<details class="plots-more">' in summary and 'id="plot-heatmap"' in summary


def test_missing_shape_and_nonfinite_nodes_render(passing):
    nodes = list(passing.nodes)
    empty = dict(
        max_abs=None, mean_abs=None, max_rel=None, cosine=None, rel_l2=None, atol_needed=None, rtol_needed=None
    )
    nodes[5] = dataclasses.replace(
        nodes[5], status="shape", shape_ours=(1, 16, 8), detail="ours (1, 16, 8) vs reference (1, 16, 16)", **empty
    )
    nodes[30] = dataclasses.replace(
        nodes[30], status="missing", shape_ours=None, detail="ours produced no tensor at x", **empty
    )
    nodes[40] = dataclasses.replace(
        nodes[40], status="nonfinite", max_abs=float("nan"), detail="first non-finite value at index (0, 1, 2)"
    )
    html = render_html(dataclasses.replace(passing, nodes=nodes))
    assert 'data-node="model.layers.0.self_attn.v_proj"' in html and "No error profile" in html
    assert "ours (1, 16, 8) vs reference (1, 16, 16)" in html


def test_7b_shape_report_is_complete_and_bounded(tmp_path):
    result = synthetic_7b()
    assert len(result.nodes) == 1 + len(FAMILY.nodes.per_layer) * 32 + len(FAMILY.nodes.after)
    path = html_of(result, tmp_path)
    html = path.read_text()
    n = len(result.nodes)
    assert html.count('<tr id="node-') == n and html.count('<tr class="detail"') == n
    assert set(re.findall(r'<a xlink:href="#(node-\d+)"', html)) == {f"node-{i}" for i in range(n)}
    assert path.stat().st_size < 4_000_000


# --- in a real browser


HOW_TO_GET_CHROMIUM = (
    "install Debian's chromium (apt-get install chromium) or point PARITY_CHROMIUM at a Chromium binary; "
    "CI's .ci/run installs it"
)


def _chromium() -> tuple[str | None, str]:
    """Path to a Chromium already on this machine, else (None, why not and how to get one)."""
    explicit = os.environ.get("PARITY_CHROMIUM")
    if explicit:
        return (explicit, "") if Path(explicit).exists() else (None, f"PARITY_CHROMIUM={explicit} does not exist")
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    return None, f"no chromium on PATH: {HOW_TO_GET_CHROMIUM}"


def test_no_browser_means_a_skip_that_says_how_to_get_one_and_nothing_installed(monkeypatch):
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test ran a program: {args}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.delenv("PARITY_CHROMIUM", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    path, why = _chromium()
    assert path is None
    assert "apt-get install chromium" in why and "PARITY_CHROMIUM" in why and ".ci/run" in why


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """Where screenshots go: $PARITY_TEST_ARTIFACTS, else a temporary folder of this test run."""
    explicit = os.environ.get("PARITY_TEST_ARTIFACTS")
    folder = Path(explicit) if explicit else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[test]')"
    )
    path, why = _chromium()
    if path is None:
        pytest.skip(why)
    with sync_api.sync_playwright() as pw:
        try:  # playwright gives every launch a fresh temporary profile (--user-data-dir)
            b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, timeout=60_000)
        except Exception as e:
            pytest.skip(f"chromium at {path} does not start: {str(e).splitlines()[0]}")
        yield b
        b.close()


class Page:
    """A page that records console errors, uncaught exceptions, dialogs and every request."""

    def __init__(self, browser, width: int = 1400):
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path) -> None:
        self.page.goto(path.as_uri(), wait_until="load")

    def visible_rows(self) -> list[dict]:
        return self.page.eval_on_selector_all(
            "#nodes tbody tr.node:not([hidden])",
            "rows => rows.map(r => ({index: +r.cells[0].dataset.v, status: r.dataset.status, layer: r.dataset.layer,"
            " kind: r.dataset.kind, max_abs: r.querySelector('td.max-abs').dataset.v === '' ? null : +r.querySelector('td.max-abs').dataset.v}))",
        )

    def assert_clean(self):
        assert not self.errors, self.errors
        assert not self.dialogs, self.dialogs
        outside = [u for u in self.requests if not u.startswith(("file:", "data:"))]
        assert not outside, outside


def _sorted_ok(values, descending):
    present = [v for v in values if v is not None]
    assert values[: len(present)] == present, "empty values sort last"
    assert present == sorted(present, reverse=descending)


def test_browser_fault_report(browser, fault, tmp_path, artifacts):
    path = html_of(fault, tmp_path)
    p = Page(browser)
    p.open(path)
    page = p.page
    # the card names the node, and every figure drew something
    assert page.inner_text("#first-mismatch .node-name") == BAD_NODE
    assert "likely the sliding window" in page.inner_text("#first-mismatch")
    sizes = page.eval_on_selector_all(
        "svg.plot",
        "svgs => svgs.map(s => [s.dataset.plot, s.getBoundingClientRect().width, s.getBoundingClientRect().height])",
    )
    assert len(sizes) == 6 and all(w > 100 and h > 50 for _, w, h in sizes), sizes
    page.screenshot(path=str(artifacts / "report-mismatch.png"), full_page=True)
    page.screenshot(path=str(artifacts / "report-mismatch-top.png"))

    rows = p.visible_rows()
    assert [r["index"] for r in rows] == list(range(len(fault.nodes)))
    assert page.inner_text("#nodes tr.first td:nth-child(2)") == BAD_NODE
    # sort by max_abs: descending first, then ascending; "#" restores execution order
    page.click("#nodes thead th:has-text('max_abs') button")
    rows = p.visible_rows()
    _sorted_ok([r["max_abs"] for r in rows], descending=True)
    assert page.get_attribute("#nodes thead th:has-text('max_abs')", "aria-sort") == "descending"
    page.click("#nodes thead th:has-text('max_abs') button")
    _sorted_ok([r["max_abs"] for r in p.visible_rows()], descending=False)
    page.click("#nodes thead th:nth-child(2) button")  # by name
    names = page.eval_on_selector_all("#nodes tbody tr.node", "rs => rs.map(r => r.dataset.name)")
    assert (
        names[0] == "lm_head"
        and names[-1] == "model.norm"
        and names.index("model.layers.0") < names.index("model.layers.1")
    )
    page.click("#nodes thead th:nth-child(1) button")
    assert [r["index"] for r in p.visible_rows()] == list(range(len(fault.nodes)))
    # each details row stays right after its node through the sorting
    pairs = page.eval_on_selector_all(
        "#nodes tbody tr.node", "rs => rs.every(r => r.nextElementSibling.id === 'details-' + r.id.slice(5))"
    )
    assert pairs

    # filter by status, layer, kind and name
    page.select_option("#f-status", "ok")
    rows = p.visible_rows()
    n_ok = sum(n.passed for n in fault.nodes)
    assert {r["status"] for r in rows} == {"ok"} and len(rows) == n_ok
    assert page.inner_text("#f-count") == f"{n_ok} of {len(fault.nodes)} nodes"
    page.select_option("#f-status", "failing")
    assert len(p.visible_rows()) == sum(not n.passed for n in fault.nodes)
    page.select_option("#f-status", "")
    page.select_option("#f-layer", "2")
    rows = p.visible_rows()
    assert len(rows) == len(FAMILY.nodes.per_layer) and {r["layer"] for r in rows} == {"2"}
    page.select_option("#f-kind", "probs")
    assert [r["index"] for r in p.visible_rows()] == [
        n.index for n in fault.nodes if n.name == "model.layers.2.self_attn.probs"
    ]
    page.select_option("#f-layer", "")
    assert len(p.visible_rows()) == 4
    page.select_option("#f-kind", "")
    page.fill("#f-name", "mlp.up_proj")
    assert len(p.visible_rows()) == 4
    page.select_option("#f-layer", "none")
    assert p.visible_rows() == []
    page.click("#f-reset")
    assert len(p.visible_rows()) == len(fault.nodes)

    # a node opens its details; a heatmap cell (a link to #node-N) opens that node's, even when filtered out
    bad = fault.first_mismatch.index
    other = next(n.index for n in fault.nodes if n.layer == 1 and n.kind == "q_proj")
    assert not page.is_visible(f"#details-{bad}")
    page.click(f"#node-{bad} a.node-link")
    assert page.is_visible(f"#details-{bad}") and "sliding window" in page.inner_text(f"#details-{bad}")
    page.click(f"#node-{bad} a.node-link")
    assert not page.is_visible(f"#details-{bad}")
    page.select_option("#f-layer", "3")
    page.click(f'#plot-heatmap a[*|href="#node-{other}"]')
    page.wait_for_function(f"document.getElementById('node-{other}').classList.contains('open')")
    assert page.is_visible(f"#node-{other}") and page.is_visible(f"#details-{other}")
    assert page.input_value("#f-layer") == ""
    title = page.eval_on_selector(f'#plot-heatmap a[*|href="#node-{bad}"] title', "t => t.textContent")
    assert title.startswith(BAD_NODE) and "mismatch" in title
    p.assert_clean()


def test_browser_7b_shape_report_sorts_and_filters(browser, tmp_path, artifacts):
    p = Page(browser)
    result = synthetic_7b()
    p.open(html_of(result, tmp_path))
    # every node shows: the embedding, 32 layers of per-layer nodes, then the final norm, the logits and after
    assert len(p.visible_rows()) == len(result.nodes) == 1 + len(FAMILY.nodes.per_layer) * 32 + len(FAMILY.nodes.after)
    p.page.click("#nodes thead th:has-text('x tol') button")  # x tolerance, every row
    p.page.select_option("#f-status", "failing")
    rows = p.visible_rows()
    assert rows and all(r["status"] == "mismatch" for r in rows) and rows[0]["index"] >= 304
    p.page.screenshot(path=str(artifacts / "report-7b-shape-top.png"))
    p.assert_clean()


def test_browser_runs_no_script_from_names(browser, fault, tmp_path):
    p = Page(browser)
    p.open(html_of(evil(fault), tmp_path))
    assert p.page.inner_text("h1").startswith("parity: " + EVIL)
    assert p.page.inner_text("#first-mismatch .node-name") == evil(fault).first_mismatch.name
    assert p.page.eval_on_selector_all("img", "imgs => imgs.length") == 0
    p.assert_clean()


def test_browser_page_fits_the_window_and_keeps_names_and_the_timestamp_on_one_line(
    browser, fault, passing, tmp_path, artifacts
):
    pages = {
        name: html_of(result, tmp_path, f"{name}.html")
        for name, result in (("7b-shape", synthetic_7b()), ("mismatch", fault), ("pass", passing))
    }
    for width, names in ((1400, pages), (1024, ["7b-shape"])):
        for name in names:
            p = Page(browser, width=width)
            p.open(pages[name])
            page_width, table_right, room, time_lines = p.page.evaluate(
                "[document.documentElement.scrollWidth, document.getElementById('nodes').getBoundingClientRect().right,"
                " document.getElementById('nodes-section').getBoundingClientRect().right,"
                " document.querySelector('dl.facts time').getClientRects().length]"
            )
            assert page_width <= width and table_right <= room, (name, width, page_width, table_right, room)
            assert time_lines == 1, (name, width)
            lines = p.page.eval_on_selector_all(
                "#nodes tr.node td:nth-child(2) code", "cs => cs.map(c => c.getClientRects().length)"
            )
            assert set(lines) == {1}, (name, width)  # every node name on one line
            p.page.screenshot(path=str(artifacts / f"report-{name}-{width}.png"))
            p.assert_clean()


def test_browser_plot_labels_are_whole(browser, fault, tmp_path):
    """Every text of every figure (the heatmap's rotated node kinds above all) lies inside its figure,
    so no label is clipped, and each node kind is there whole."""
    path = html_of(fault, tmp_path)
    kinds = {n.kind for n in fault.nodes if n.layer is not None}
    heatmap = _plot(path.read_text(), "heatmap")
    assert kinds <= set(re.findall(r"<text[^>]*>([^<]+)</text>", heatmap))  # non-browser check of the data
    for width in (1400, 1024):
        p = Page(browser, width=width)
        p.open(path)
        outside = p.page.evaluate("""() => [...document.querySelectorAll('svg.plot')].flatMap(svg => {
            const box = svg.getBoundingClientRect();
            return [...svg.querySelectorAll('text')].filter(t => t.textContent.trim()).map(t => [t.textContent, t.getBoundingClientRect()])
              .filter(([_, r]) => r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
              .map(([s, r]) => svg.dataset.plot + ': ' + s);
        })""")
        assert outside == [], (width, outside)
        shown = set(p.page.eval_on_selector_all('svg[data-plot="heatmap"] text', "ts => ts.map(t => t.textContent)"))
        assert kinds <= shown
        p.assert_clean()
