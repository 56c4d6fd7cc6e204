"""``opskit goodput NAME [--json] [--out goodput.png [--force]]``: where the run's wall clock went
(opskit.history.goodput)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from opskit.cli._common import JsonOutput, SpecName, console, emit, err_console, friendly_errors


@friendly_errors
def goodput(
    name: SpecName,
    json_output: JsonOutput = False,
    out: Path = typer.Option(None, "--out", help="Also an image, one bar per task coloured by category: .png, .jpg, "
                                                 ".svg or .pdf (the suffix picks the format)."),
    force: bool = typer.Option(False, "--force", help="Replace an image opskit drew earlier (never another file)."),
) -> None:
    """Split the run's wall clock (first submit to now) into training that counts, redone training, saving, loading,
    start-up, evaluation, hangs, queue wait and idle: the whole run and each chain task. Exit 0; 1 when the run has
    no task yet or a file is unreadable."""
    from opskit.history.goodput import account, write_plot
    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec

    spec = load_spec(name)
    result = account(RunPaths.of(spec), spec.watchdog)
    if out is not None:
        write_plot(result, out, force)
    emit(result, json_output, lambda accounted: _render(accounted, out))


def _render(result, out: Path | None) -> None:
    from opskit.history.goodput import CATEGORIES

    console.print(_totals_table(result, CATEGORIES))
    console.print("per task (queue: the wait before it)")
    for line in _task_lines(result, CATEGORIES):
        console.print(f"  {line}")
    if result.divergence:
        d = result.divergence
        console.print(f"divergence: {d['incidents']} incident(s), {d['rollbacks']} rollback(s), "
                      f"{d['iterations_redone']} iterations trained again, {d['iterations_skipped']} skipped")
    for note in result.notes:
        err_console.print(f"note: {note}")
    if out is not None:
        console.print(f"wrote {out}")


def _duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``17.5 min``, ``3.25 h``: the unit that keeps a short run's figures readable."""
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _totals_table(result, categories) -> Table:
    table = Table(title=f"{result.start:%Y-%m-%d %H:%M} to {result.end:%Y-%m-%d %H:%M}: "
                        f"{_duration(result.wall_seconds)}, goodput {result.goodput:.1%}", title_justify="left")
    for column in ("category", "time", "share"):
        table.add_column(column, justify="left" if column == "category" else "right")
    totals, wall = result.totals, result.wall_seconds or 1
    for category in categories:
        table.add_row(category, _duration(totals[category]), f"{totals[category] / wall:.1%}")
    return table


def _task_lines(result, categories) -> list[str]:
    """One line per task: its iterations (of which redone) and the time of each category it spent time in."""
    lines = []
    for task in result.tasks:
        spent = ", ".join(f"{c} {_duration(task.seconds[c])}" for c in categories if task.seconds[c] >= 0.5)
        lines.append(f"{task.label} {task.state or 'running'}: {task.iterations:,} iterations "
                     f"({task.redone_iterations:,} redone); {spent}")
    return lines
