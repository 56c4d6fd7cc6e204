"""`opskit report` (issue 49): the run's page built from a trained tiny run's folder, opened in headless Chromium
(Debian's package, driven by Playwright, every request off the page refused): no console error, no request leaves the
page, every chart drawn with its points, the hover gives an iteration's values, the chain and the incident listed.
Bad input gives a page that says what is missing, or one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BLOOM_RUN, REPO, copy_run

from opskit.report.facts import gather
from opskit.report.page import CHARTS, MARKER, build_page
from opskit.run import chain
from opskit.run.paths import RunPaths

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FIXTURES = REPO / "tests" / "fixtures" / "logs"
INCIDENT = {"id": 1, "opened": "2026-11-29 07:09:00", "opened_s": 0, "kind": "spike", "metric": "lm_loss",
            "first": 15, "last": 18, "detected_at": 18, "verdict": "reproduced", "rollback_step": 10,
            "skip_range": [11, 18], "abandoned": [], "outcome": "reproduced (9.95): rolled back to global_step10, "
                                                                 "iterations 11-18 skipped"}


def run_folder(trained, tmp_path: Path) -> RunPaths:
    """A run folder as a one-task chain leaves it: the session's tiny run (conftest.BLOOM_RUN: 20 iterations, a line
    every 10, steps 10 and 20), its output as main_log.txt between the job's start and end lines, the ledger's line
    and one incident."""
    done = trained(**BLOOM_RUN)
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")
    copy_run(done, run.root)
    run.logs.mkdir()
    header = "[opskit] 2026-11-29 07:00:{:02d} job 5 (array task 5_1) nodes node1: {}"
    run.main_log.write_text("\n".join([header.format(0, "start"), header.format(1, "training step 0 on nodes node1"),
                                       *done.stdout.splitlines(), header.format(30, "end, exit code 0")]) + "\n")
    chain.record(run, chain.TaskOutcome("2026-11-29 07:00:30", "5", "5_1", "COMPLETED", 0, "node1", "",
                                        "global_step20"))
    run.incidents.write_text(json.dumps({"incidents": [INCIDENT]}))
    return run


TOOLTIPS = """() => { const out = [];
    const walk = root => { for (const el of root.querySelectorAll('*')) {
        if (el.shadowRoot) walk(el.shadowRoot);
        if (String(el.className).includes('bk-tooltip-content')) out.push(el.textContent.trim()); } };
    walk(document); return out; }"""
"""Bokeh's tooltips' texts (they live in the figures' shadow roots)."""


def browse(page_path: Path, screenshot: Path | None = None) -> dict:
    """Open the page in headless Chromium with every request but the page itself refused; what it found."""
    from playwright.sync_api import sync_playwright

    found = {"errors": [], "requests": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: found["errors"].append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: found["errors"].append(str(e)))

            def route(r):
                if r.request.url == page_path.as_uri():
                    return r.continue_()
                found["requests"].append(r.request.url)
                return r.abort()

            page.route("**/*", route)
            started = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_function("() => window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length > 0")
            found["load_s"] = time.perf_counter() - started
            found["points"] = page.evaluate("""() => Bokeh.documents[0].roots().map(r => [r.title.text,
                Math.max(...r.renderers.map(g => (g.data_source.data.iteration || []).length))])""")
            box = page.locator(".bk-Figure").first.bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5, steps=5)
            page.wait_for_timeout(300)
            found["tooltip"] = page.evaluate(TOOLTIPS)
            found["text"] = page.inner_text("body")
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return found


@pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (scripts/system-deps.sh; under CI: a failure)")
def test_the_run_page_opens_offline_in_chromium_with_every_chart_drawn_and_hover_values(trained, tmp_path):
    run = run_folder(trained, tmp_path)
    built = build_page(str(run.root))
    assert built.out == run.report and run.report.read_text().startswith(MARKER)
    found = browse(run.report, tmp_path / "report.png")
    assert found["errors"] == [] and found["requests"] == []
    titles = dict(found["points"])
    assert set(titles) == {label for _, label in CHARTS} and all(n == 2 for n in titles.values()), titles
    assert found["tooltip"] and found["tooltip"][0].startswith("iteration:"), found["tooltip"]
    text = found["text"]
    assert "5_1" in text and "COMPLETED" in text and "global_step20" in text  # the chain
    assert "Incident 1" in text and "iterations 11-18 skipped" in text and "Goodput" in text
    print(f"\npage {run.report.stat().st_size / 1e6:.2f} MB, loaded in {found['load_s']:.2f} s")
    # built again (the hourly refresh): the run's own page is replaced without --force
    assert build_page(str(run.root)).out == run.report


def test_a_bare_log_gives_a_page_that_says_what_it_cannot_know(tmp_path):
    page = gather(str(FIXTURES / "tr11-176B-spike.txt"))
    assert page.series["lm_loss"]["iteration"][0] > 31000 and any(s["first"] == 31216 for s in page.spikes)
    assert any("no spec" in u for u in page.unknown) and any("outside a run folder" in u for u in page.unknown)
    with pytest.raises(Exception, match="--out"):
        build_page(str(FIXTURES / "tr11-176B-spike.txt"))
    assert build_page(str(FIXTURES / "tr11-176B-spike.txt"), tmp_path / "tr11.html").out.is_file()


@pytest.mark.parametrize("damage", ["no log", "junk log", "torn ledger", "no checkpoints", "torn incidents"])
def test_a_damaged_run_gives_a_page_that_says_what_is_missing(trained, tmp_path, damage):
    run = run_folder(trained, tmp_path)
    if damage == "no log":
        run.main_log.unlink()
        run.logs.rmdir()
    elif damage == "junk log":
        run.main_log.write_bytes(os.urandom(4096))
    elif damage == "torn ledger":
        with open(run.ledger, "a") as f:
            f.write('{"time": "2026-11-29 07:0')
    elif damage == "no checkpoints":
        shutil.rmtree(run.checkpoints)
    else:
        run.incidents.write_bytes(b'{"incidents": [{"id"')
    page = build_page(str(run.root)).page
    expected = {"no log": "logs/main_log.txt", "junk log": "no iteration lines", "torn ledger": "ledger.jsonl",
                "no checkpoints": "checkpoints", "torn incidents": "incidents.json"}[damage]
    assert any(expected in u for u in page.unknown), page.unknown
    assert run.report.read_text().startswith(MARKER)


def test_an_existing_file_that_is_not_a_page_opskit_wrote_is_refused_in_one_line(trained, tmp_path):
    run = run_folder(trained, tmp_path)
    mine = tmp_path / "mine.html"
    mine.write_text("<html>my notes</html>")
    for out, force in ((mine, True), (run.report.parent, True)):
        done = subprocess.run([sys.executable, "-m", "opskit.cli.app", "report", str(run.root), "--out", str(out),
                               *(["--force"] if force else [])], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert mine.read_text() == "<html>my notes</html>"
    build_page(str(run.root), tmp_path / "page.html")
    refused = subprocess.run([sys.executable, "-m", "opskit.cli.app", "report", str(run.root), "--out",
                              str(tmp_path / "page.html")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--force" in refused.stderr
