"""report.html: complete, self-contained, escaped; and opened in a real browser (Debian's Chromium,
driven by Playwright) where it must render without console errors, name the right node, sort,
filter and open node details. Screenshots go to reports/test-artifacts/ (or $PARITY_TEST_ARTIFACTS).

The browser tests install Debian's chromium when it is missing and this is a root Debian system;
they skip, saying why, only when the browser cannot exist here (no apt-get, not root, the install
failed, or the playwright package is missing).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from parity.check import CheckResult
from parity.compare import NodeResult
from parity.report.html import render_html
from parity.facts import derive_facts
from parity.pair import annotate
from reference_pairs.olmo3 import CONFIGS, FAMILY

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("PARITY_TEST_ARTIFACTS") or ROOT / "reports" / "test-artifacts")
BAD_NODE = "model.layers.0.self_attn.probs"
#: any reference that would make the page fetch something: src/href/url() to a URL, or a protocol-relative one
EXTERNAL = re.compile(r"""(?:\b(?:src|href|xlink:href|action)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import)""", re.I)
EVIL = "<script>alert(1)</script>"


# --- results to render


def synthetic_7b(n_layers: int = 32, seq: int = 64, width: int = 4096,
                 bad_name: str = "model.layers.17.mlp.down_proj") -> CheckResult:
    """A CheckResult shaped like an OLMo 3 7B run in bfloat16: the real node list (1 + 17 x 32 + 2),
    real widths in the error profile, chained and isolated results (no 7B model is built)."""
    rng = random.Random(0)
    facts = derive_facts(FAMILY.to_hf(CONFIGS["7b-shape"](n_layers)))
    specs = annotate(FAMILY.node_specs(facts), facts)
    bad_index = next(i for i, s in enumerate(specs) if s.name == bad_name)
    nodes, isolated = [], []
    for i, spec in enumerate(specs):
        failing = i >= bad_index
        max_abs = 10 ** rng.uniform(-0.5, 1) if failing else 10 ** rng.uniform(-4, -2)
        common = dict(name=spec.name, index=i, layer=spec.layer, kind=spec.kind, shape_ours=(1, seq, width),
                      shape_ref=(1, seq, width), dtype="bfloat16", mean_abs=max_abs / 10, max_rel=max_abs * 3,
                      cosine=1 - max_abs / 100, atol=5e-2, rtol=5e-2, rel_l2=max_abs / 20,
                      tol_source="default:bfloat16", rtol_needed=0.0)
        nodes.append(NodeResult(**common, status="mismatch" if failing else "ok", max_abs=max_abs,
                                atol_needed=0.9 * max_abs if failing else 0.0))
        own = max_abs if i == bad_index else max_abs / 1000
        isolated.append(NodeResult(**common, status="mismatch" if i == bad_index else "ok", max_abs=own,
                                   atol_needed=0.9 * own if i == bad_index else 0.0))
    meta = {"family": "olmo3", "config": "7b-shape", "checkpoint": None, "checkpoint_sha256": None,
            "dtype": "bfloat16", "batch_size": 1, "seq_len": seq, "seed": 0, "mode": "both", "atol": None,
            "rtol": None, "tolerances": {}, "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0"},
            "time": "2026-11-30T00:00:00+00:00", "seconds": 12.5, "cfg": {"n_layers": n_layers, "emb_dim": width}}
    profile = {"node": bad_name, "by_position": [rng.uniform(0, 5) for _ in range(seq)], "by_head": None,
               "by_channel": [rng.uniform(0, 5) for _ in range(width)]}
    top1 = [float(rng.random() < 0.7) for _ in range(seq)]
    logits = {"node": "lm_head", "k": 5, "top1_agree": top1, "topk_overlap": [rng.uniform(0.4, 1) for _ in range(seq)],
              "kl": [rng.uniform(0, 0.5) for _ in range(seq)], "top1_agreement": sum(top1) / seq,
              "mean_topk_overlap": 0.7, "mean_kl": 0.25}
    return CheckResult(nodes=nodes, meta=meta, notes=[], profile=profile, logits=logits, isolated=isolated)


def evil(result: CheckResult) -> CheckResult:
    """Markup in every name a config or a module path can bring: family, config, checkpoint, node names."""
    nodes = [dataclasses.replace(n, name=n.name.replace("self_attn", 'self_attn<img src=x onerror="alert(2)">'),
                                 kind=n.kind if n.kind != "probs" else "probs<b>$x$"
                                 ) for n in result.nodes]
    meta = {**result.meta, "family": EVIL, "config": '"><svg onload=alert(3)>', "checkpoint": "/c/<i>ckpt</i> & co",
            "checkpoint_sha256": "ab" * 32, "cfg": {**result.meta["cfg"], "name": "</pre><script>alert(4)</script>"}}
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
    card = html[html.index('id="first-mismatch"'):html.index('id="depth"')]
    assert f'data-node="{BAD_NODE}"' in html and BAD_NODE in card
    assert "likely the sliding window" in card and bad.hint.text.split(":")[0] in card
    for metric in ("max_abs", "mean_abs", "max_rel", "cosine", "rel_l2", "atol needed", "x tolerance"):
        assert metric in card
    for plot in ("plot-position", "plot-head", "plot-heatmap", "plot-depth", "plot-channel", "plot-logits"):
        assert f'id="{plot}"' in html, plot
    assert html.count('<svg class="plot"') == 6
    meta = fault.meta
    header = html[: html.index("<main>")]
    for fact in ("family", "config", "checkpoint", "dtype", "seq len", "seed", "mode", "tolerance", "torch",
                 "transformers", "time"):
        assert f"<dt>{fact}</dt>" in header, fact
    for value in (meta["versions"]["torch"], meta["versions"]["transformers"], meta["time"], "float32", "16 tokens",
                  "atol 0, rtol 0 (exact: the pair is bit-identical when correct)"):
        assert value in header, value
    assert "top-1 agreement" in html and "KL(reference || ours)" in html
    assert html.count('<tr id="node-') == len(fault.nodes)


def test_report_is_self_contained(fault, passing, tmp_path):
    for result in (fault, passing, synthetic_7b()):
        html = render_html(result)
        assert not EXTERNAL.search(html), EXTERNAL.search(html).group(0)
        assert "<link rel=\"stylesheet\"" not in html and "<script src" not in html
        assert "<metadata>" not in html and "<!DOCTYPE svg" not in html  # SVG made fit for inlining
    # the pattern does catch what it is meant to catch
    for bad in ('<img src="https://x/y.png">', "<a href='//cdn.x/z'>", "background: url(http://x)", '<use xlink:href="http://x#a"/>'):
        assert EXTERNAL.search(bad)


def test_plot_ids_are_unique_and_heatmap_cells_link_to_rows(fault):
    html = render_html(fault)
    ids = re.findall(r'\bid="([^"]+)"', html)
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates
    heatmap = re.search(r'<svg class="plot"[^>]*data-plot="heatmap".*?</svg>', html, re.S).group(0)
    targets = re.findall(r'<a xlink:href="#(node-\d+)"', heatmap)
    assert len(targets) == 4 * len(FAMILY.nodes.per_layer) and set(targets) <= set(ids)
    assert 'target="_blank"' not in heatmap


def test_names_from_configs_and_module_paths_are_escaped(fault, tmp_path):
    html = html_of(evil(fault), tmp_path).read_text()
    for raw in (EVIL, "<img src=x", "<svg onload", "<i>ckpt</i>", "<u>markup</u>", "<b>$x$", "</pre><script>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "/c/&lt;i&gt;ckpt&lt;/i&gt; &amp; co" in html
    assert "ab" * 32 in html
    assert html.count("<script>") == 1  # ours, at the end


def test_pass_report(passing, tmp_path):
    html = html_of(passing, tmp_path).read_text()
    assert 'id="first-mismatch"' not in html and f"PASS: all {len(passing.nodes)} nodes agree" in html
    assert "Every node agrees within tolerance" in html and 'id="plot-logits"' in html
    assert 'id="plot-heatmap"' in html and 'id="plot-depth"' in html


def test_missing_shape_and_nonfinite_nodes_render(passing):
    nodes = list(passing.nodes)
    empty = dict(max_abs=None, mean_abs=None, max_rel=None, cosine=None, rel_l2=None, atol_needed=None, rtol_needed=None)
    nodes[5] = dataclasses.replace(nodes[5], status="shape", shape_ours=(1, 16, 8), detail="ours (1, 16, 8) vs reference (1, 16, 16)", **empty)
    nodes[30] = dataclasses.replace(nodes[30], status="missing", shape_ours=None, detail="ours produced no tensor at x", **empty)
    nodes[40] = dataclasses.replace(nodes[40], status="nonfinite", max_abs=float("nan"), detail="first non-finite value at index (0, 1, 2)")
    html = render_html(dataclasses.replace(passing, nodes=nodes))
    assert 'data-node="model.layers.0.self_attn.v_proj"' in html and "No error profile" in html
    assert "ours (1, 16, 8) vs reference (1, 16, 16)" in html


def test_7b_shape_report_renders_in_a_few_seconds(tmp_path):
    result = synthetic_7b()
    assert len(result.nodes) == 1 + len(FAMILY.nodes.per_layer) * 32 + 2
    render_html(result)  # matplotlib's first figure pays for font loading; time a warm render too
    start = time.perf_counter()
    path = html_of(result, tmp_path)
    elapsed = time.perf_counter() - start
    html = path.read_text()
    assert elapsed < 5, f"render took {elapsed:.2f} s"
    assert html.count('<tr id="node-') == len(result.nodes) and html.count('<tr class="detail"') == len(result.nodes)
    assert len(re.findall(r'<a xlink:href="#node-\d+"', html)) == 32 * len(FAMILY.nodes.per_layer)
    assert path.stat().st_size < 4_000_000


# --- in a real browser


def _chromium() -> tuple[str | None, str]:
    """Path to Debian's chromium, installing it when missing and possible; else (None, why not)."""
    explicit = os.environ.get("PARITY_CHROMIUM")
    if explicit:
        return (explicit, "") if Path(explicit).exists() else (None, f"PARITY_CHROMIUM={explicit} does not exist")
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    if not shutil.which("apt-get"):
        return None, "chromium is not installed and there is no apt-get here to install Debian's chromium"
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing Debian's chromium needs root (apt-get install chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, env=env,
                          capture_output=True, text=True, timeout=1200)
    found = shutil.which("chromium")
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"apt-get install chromium failed (exit {proc.returncode}): {tail[0]}"
    return found, ""


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[test]')")
    path, why = _chromium()
    if path is None:
        pytest.skip(why)
    with sync_api.sync_playwright() as pw:
        try:  # playwright gives every launch a fresh temporary profile (--user-data-dir)
            b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, timeout=60_000)
        except Exception as e:  # noqa: BLE001 - the reason is the message
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
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path) -> float:
        start = time.perf_counter()
        self.page.goto(path.as_uri(), wait_until="load")
        return time.perf_counter() - start

    def visible_rows(self) -> list[dict]:
        return self.page.eval_on_selector_all(
            "#nodes tbody tr.node:not([hidden])",
            "rows => rows.map(r => ({index: +r.cells[0].dataset.v, status: r.dataset.status, layer: r.dataset.layer,"
            " kind: r.dataset.kind, max_abs: r.cells[5].dataset.v === '' ? null : +r.cells[5].dataset.v}))",
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


def test_browser_fault_report(browser, fault, tmp_path):
    path = html_of(fault, tmp_path)
    p = Page(browser)
    p.open(path)
    page = p.page
    # the card names the node, and every figure drew something
    assert page.inner_text("#first-mismatch .node-name") == BAD_NODE
    assert "likely the sliding window" in page.inner_text("#first-mismatch")
    sizes = page.eval_on_selector_all("svg.plot", "svgs => svgs.map(s => [s.dataset.plot, s.getBoundingClientRect().width, s.getBoundingClientRect().height])")
    assert len(sizes) == 6 and all(w > 100 and h > 50 for _, w, h in sizes), sizes
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report-mismatch.png"), full_page=True)
    page.screenshot(path=str(ARTIFACTS / "report-mismatch-top.png"))

    rows = p.visible_rows()
    assert [r["index"] for r in rows] == list(range(len(fault.nodes)))
    assert page.inner_text("#nodes tr.first td:nth-child(2)") == BAD_NODE
    # sort by max_abs: descending first, then ascending; "#" restores execution order
    page.click("#nodes thead th:nth-child(6) button")
    rows = p.visible_rows()
    _sorted_ok([r["max_abs"] for r in rows], descending=True)
    assert page.get_attribute("#nodes thead th:nth-child(6)", "aria-sort") == "descending"
    page.click("#nodes thead th:nth-child(6) button")
    _sorted_ok([r["max_abs"] for r in p.visible_rows()], descending=False)
    page.click("#nodes thead th:nth-child(2) button")  # by name
    names = page.eval_on_selector_all("#nodes tbody tr.node", "rs => rs.map(r => r.dataset.name)")
    assert names[0] == "lm_head" and names[-1] == "model.norm" and names.index("model.layers.0") < names.index("model.layers.1")
    page.click("#nodes thead th:nth-child(1) button")
    assert [r["index"] for r in p.visible_rows()] == list(range(len(fault.nodes)))
    # each details row stays right after its node through the sorting
    pairs = page.eval_on_selector_all("#nodes tbody tr.node", "rs => rs.every(r => r.nextElementSibling.id === 'details-' + r.id.slice(5))")
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
    assert [r["index"] for r in p.visible_rows()] == [n.index for n in fault.nodes if n.name == "model.layers.2.self_attn.probs"]
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


def test_browser_7b_shape_report_opens_in_a_few_seconds(browser, tmp_path):
    result = synthetic_7b()
    render_html(result)  # warm matplotlib (fonts), as a second report in one process would be
    start = time.perf_counter()
    path = html_of(result, tmp_path)
    rendered = time.perf_counter() - start
    p = Page(browser)
    loaded = p.open(path)
    assert len(p.visible_rows()) == len(FAMILY.nodes.per_layer) * 32 + 3
    start = time.perf_counter()
    p.page.click("#nodes thead th:nth-child(11) button")  # x tolerance, every row
    p.page.select_option("#f-status", "failing")
    interactive = time.perf_counter() - start
    rows = p.visible_rows()
    assert rows and all(r["status"] == "mismatch" for r in rows) and rows[0]["index"] >= 304
    assert rendered + loaded < 8, f"render {rendered:.2f} s + load {loaded:.2f} s"
    assert interactive < 3, f"sorting and filtering every row took {interactive:.2f} s"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    p.page.screenshot(path=str(ARTIFACTS / "report-7b-shape-top.png"))
    p.assert_clean()
    print(f"7b-shape report: render {rendered:.2f} s, browser load {loaded:.2f} s, sort+filter {interactive:.2f} s")


def test_browser_runs_no_script_from_names(browser, fault, tmp_path):
    p = Page(browser)
    p.open(html_of(evil(fault), tmp_path))
    assert p.page.inner_text("h1").startswith("parity: " + EVIL)
    assert p.page.inner_text("#first-mismatch .node-name") == evil(fault).first_mismatch.name
    assert p.page.eval_on_selector_all("img", "imgs => imgs.length") == 0
    p.assert_clean()
