"""``opskit report NAME|RUN_DIR|LOG [--out PAGE.html] [--force] [--json]``: the run's whole state on one
self-contained HTML page (opskit.report)."""

from __future__ import annotations

from pathlib import Path

import typer

from opskit.cli._common import JsonOutput, console, emit, friendly_errors


@friendly_errors
def report(
    name_or_path: str = typer.Argument(..., help="Spec name, run folder or log file (any log `opskit logs` reads)."),
    out: Path = typer.Option(None, "--out", help="The page (default: the run's report.html; a log outside a run "
                                                 "folder needs --out)."),
    force: bool = typer.Option(False, "--force", help="Replace a page opskit report wrote earlier at --out (never "
                                                      "another file)."),
    json_output: JsonOutput = False,
) -> None:
    """One HTML page of the run, nothing fetched when viewed: what needs a person now, the state, charts of the lm
    loss, grad norm, LR, throughput and batch ramp-up with spikes, skips and incidents marked, the chain's tasks,
    goodput, checkpoints and the plan. Exit 0; 1 on bad input (one line)."""
    from opskit.report.page import build_page

    result = build_page(name_or_path, out, force)
    emit(result, json_output, lambda built: console.print(f"wrote {built.out}"))
