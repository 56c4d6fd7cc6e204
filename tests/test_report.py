"""`opskit report` (issue 49): the run's page built from a trained tiny run's folder, opened in headless Chromium
(Debian's package, driven by Playwright, every request off the page refused): no console error, no request leaves the
page, every chart drawn with its points, the hover gives an iteration's values, the chain and the incident listed.
Bad input gives a page that says what is missing, or one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from conftest import BLOOM_RUN, REPO, copy_run, write_spec

from opskit.ckpt.backup import backup
from opskit.ckpt.convert import convert_checkpoint
from opskit.report.facts import gather
from opskit.report.page import CHARTS, MARKER, build_page
from opskit.run import chain
from opskit.run.paths import RunPaths

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FIXTURES = REPO / "tests" / "fixtures" / "logs"
DATE = "%Y-%m-%d %H:%M:%S"
INCIDENT = {"id": 1, "opened": None, "opened_s": 0, "kind": "spike", "metric": "lm_loss",
            "first": 15, "last": 18, "detected_at": 18, "verdict": "reproduced", "rollback_step": 10,
            "skip_range": [11, 18], "abandoned": [], "outcome": "reproduced (9.95): rolled back to global_step10, "
                                                                 "iterations 11-18 skipped"}


VALIDATION = " validation loss at iteration 20 | lm loss value: 7.250000E+00 | lm loss PPL: 1.408E+03 | "
MEMORY = ("[Rank 0] (after 10 iterations) memory (MB) | allocated: 512.0 | max allocated: 1536.0 | reserved: 2048.0 | "
          "max reserved: 2048.0")
"""Megatron's validation and memory lines (reference section 2.3; the CPU trainer prints neither)."""


def artifact(name: str) -> Path:
    """Where a test keeps a file for people to look at (a page's screenshot): ``$OPSKIT_TEST_ARTIFACTS``, else the
    checkout's ``build/test-artifacts/`` (ignored by git)."""
    folder = Path(os.environ.get("OPSKIT_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def run_folder(trained, tmp_path: Path) -> RunPaths:
    """A run folder as a one-task chain leaves it: the session's tiny run (conftest.BLOOM_RUN: 20 iterations, a line
    every 10, steps 10 and 20), its output as main_log.txt between the job's start and end lines with a memory and a
    validation line, the ledger's line and one incident."""
    done = trained(**BLOOM_RUN)
    run = RunPaths(tmp_path / "run")
    chain.claim_run_dir(run, "the test")
    copy_run(done, run.root)
    run.logs.mkdir()
    # the job's lines dated around the trainer's own (its "[before the start of training step] datetime:")
    trained_at = datetime.strptime(re.search(r"training step\] datetime: (\S+ \S+)", done.stdout)[1], DATE)
    at = [f"{trained_at + timedelta(seconds=s):{DATE}}" for s in (-20, -10, -9, 30)]
    header = "[opskit] {} job 5 (array task 5_1) nodes node1: {}"
    run.main_log.write_text("\n".join([
        f"[opskit] {at[0]} submitted job 5 (1 tasks)", header.format(at[1], "start"),
        header.format(at[2], "training step 0 on nodes node1"), MEMORY, *done.stdout.splitlines(), VALIDATION,
        header.format(at[3], "end, exit code 0")]) + "\n")
    chain.record(run, chain.TaskOutcome(at[3], "5", "5_1", "COMPLETED", 0, "node1", "",
                                        "global_step20"))
    run.incidents.write_text(json.dumps({"incidents": [{**INCIDENT, "opened": f"{trained_at:{DATE}}"}]}))
    return run


FIGURES = """() => Array.from(Bokeh.documents[0]._all_models.values()).filter(m => m.type == 'Figure')
    .map(f => [f.title.text, f.below[0].axis_label,
               f.renderers.map(g => Object.values(g.data_source.data)[0].length)])"""
"""Each figure's title, x axis label and its renderers' point counts."""
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
            found["points"] = page.evaluate(FIGURES)
            chart = page.locator("#charts .bk-Figure").first  # the lm loss over the iterations
            chart.scroll_into_view_if_needed()
            box = chart.bounding_box()
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
def test_the_run_page_opens_offline_in_chromium_with_every_chart_drawn_and_hover_values(trained, kjv_data, tmp_path):
    run = run_folder(trained, tmp_path)
    backup(run.checkpoints, (tmp_path / "backup").as_uri(), steps=[20])
    convert_checkpoint(run.checkpoints, run.hf_dir, step=10)
    spec = write_spec(tmp_path / "watched.yaml", kjv_data, run.root, slurm={"job_name": "opskit-report-test"})
    built = build_page(str(spec))
    assert built.out == run.report and run.report.read_text().startswith(MARKER)
    found = browse(run.report, artifact("report-tiny.png"))
    assert found["errors"] == [] and found["requests"] == []
    figures = {(title, scale): points for title, scale, points in found["points"]}
    charted = {label for key, label in CHARTS if key != "samples_per_second"}  # the spec gives tokens per second
    for axis in ("iteration", "wall-clock time"):
        assert {t for t, a in figures if a == axis} >= charted, figures
    assert all(points[0] == 2 for (title, _), points in figures.items() if title in charted), figures
    assert figures[("lm loss", "iteration")][1] == figures[("lm loss", "wall-clock time")][1] == 1  # validation
    assert figures[("tasks and in-job steps", None)] == [1, 1]  # the task's bar, the incident's mark
    assert found["tooltip"] and found["tooltip"][0].startswith("iteration:"), found["tooltip"]
    text = found["text"]
    assert "5_1" in text and "COMPLETED" in text and "node1" in text  # the chain
    assert "Incident 1" in text and "iterations 11-18 skipped" in text and "Goodput" in text
    page = built.page
    assert [p["iteration"][-1] for p in (page.series["lm_loss"], page.validation)] == [20, 20]
    times = page.series["lm_loss"]["time"]
    assert None not in times and times == sorted(times) and page.validation["time"][-1] == times[-1]
    memory = next(row for row in page.plan if row["what"].startswith("memory"))
    assert memory["measured"] == 1.5 and memory["planned"] > 0  # 1536 MiB
    steps = {c["tag"]: c for c in page.checkpoints}
    assert [b["target"] for b in steps["global_step20"]["backups"]] == [(tmp_path / "backup").as_uri()]
    assert steps["global_step10"]["converted"] == str(run.hf_dir / "global_step10") and not steps["global_step20"][
        "converted"] and not steps["global_step10"]["backups"]
    assert "1.5" in text and "global_step10" in text
    print(f"\npage {run.report.stat().st_size / 1e6:.2f} MB, loaded in {found['load_s']:.2f} s")
    # built again from the folder (the hourly refresh): the run's own page is replaced without --force; without the
    # spec the page charts samples per second (the spec's sequence length makes them tokens)
    again = build_page(str(run.root))
    assert again.out == run.report and "tokens_per_second" not in again.page.series
    seq_length = yaml.safe_load(spec.read_text())["model"]["seq_length"]
    assert page.series["tokens_per_second"]["value"] == pytest.approx(
        [v * seq_length for v in again.page.series["samples_per_second"]["value"]])


def test_a_bare_log_gives_a_page_that_says_what_it_cannot_know(tmp_path):
    page = gather(str(FIXTURES / "tr11-176B-spike.txt"))
    assert page.series["lm_loss"]["iteration"][0] > 31000 and any(s["first"] == 31216 for s in page.spikes)
    assert any("no spec" in u for u in page.unknown) and any("outside a run folder" in u for u in page.unknown)
    with pytest.raises(Exception, match="--out"):
        build_page(str(FIXTURES / "tr11-176B-spike.txt"))
    assert build_page(str(FIXTURES / "tr11-176B-spike.txt"), tmp_path / "tr11.html").out.is_file()


@pytest.mark.parametrize("damage", ["no log", "junk log", "torn ledger", "no checkpoints", "torn incidents",
                                    "torn in-job state", "junk backup record"])
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
    elif damage == "torn incidents":
        run.incidents.write_bytes(b'{"incidents": [{"id"')
    elif damage == "torn in-job state":
        (run.root / "in-job").mkdir()
        (run.root / "in-job" / "5.json").write_bytes(b'{"steps": [{"nodes"')
    else:
        (run.checkpoints / ".opskit-backups.json").write_bytes(os.urandom(64))
    page = build_page(str(run.root)).page
    expected = {"no log": "logs/main_log.txt", "junk log": "no iteration lines", "torn ledger": "ledger.jsonl",
                "no checkpoints": "checkpoints", "torn incidents": "incidents.json",
                "torn in-job state": "in-job/5.json", "junk backup record": ".opskit-backups.json"}[damage]
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
