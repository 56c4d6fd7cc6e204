"""End-to-end time of ``opskit report`` on a tr11-style main_log.txt of about a million iterations (bench/logs.py's
generator), next to ``opskit logs plot`` of the same log in the same run, each a new process as a user runs it; the
page's size and its load time in headless Chromium (issue 49: build <= 3 s on 2 cores and <= 2x logs plot, <= 5 MB,
loaded in <= 2 s).

    PYTHONPATH=. python bench/report_page.py [--lines 3000000] [--rounds 3] [--file /tmp/opskit-report-bench.txt]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.logs import generate


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def chromium_load_s(page: Path) -> float:
    """Seconds from navigation until BokehJS has drawn the page's figures, network cut."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            tab.route("**/*", lambda r: r.continue_() if r.request.url == page.as_uri() else r.abort())
            started = time.perf_counter()
            tab.goto(page.as_uri())
            tab.wait_for_function("() => window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length > 0")
            return time.perf_counter() - started
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=3_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file", type=Path, default=Path(tempfile.gettempdir()) / "opskit-report-bench.txt")
    opts = parser.parse_args()
    counts = generate(opts.file, opts.lines)
    print(f"log: {opts.file}, {opts.lines:,} lines, {counts['iterations']:,} iteration lines, "
          f"{opts.file.stat().st_size / 1e6:.0f} MB")
    opskit = [sys.executable, "-m", "opskit.cli.app"]
    with tempfile.TemporaryDirectory() as tmp:
        page, image = Path(tmp) / "page.html", Path(tmp) / "plot.png"
        report_s, plot_s = [], []
        for _ in range(opts.rounds):  # interleaved: both see the same machine state
            report_s.append(timed([*opskit, "report", str(opts.file), "--out", str(page), "--force"]))
            plot_s.append(timed([*opskit, "logs", "plot", str(opts.file), "--out", str(image), "--force"]))
        report, plot = statistics.median(report_s), statistics.median(plot_s)
        load = statistics.median(chromium_load_s(page) for _ in range(opts.rounds))
        print(f"opskit report: {report:.2f} s (median of {opts.rounds}); opskit logs plot: {plot:.2f} s; ratio "
              f"{report / plot:.2f}; page {page.stat().st_size / 1e6:.2f} MB; Chromium load {load:.2f} s")


if __name__ == "__main__":
    main()
