"""``opskit rehearse NAME``: the spec scaled down through the local SLURM, one table of stages (opskit.rehearse)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from opskit.cli._common import JsonOutput, SpecName, console, emit, friendly_errors

_STYLE = {"ok": "green", "failed": "red", "skipped": "yellow"}


@friendly_errors(exit_code=2)
def rehearse(
    name: SpecName,
    nodes: int = typer.Option(1, "--nodes", min=1, help="Nodes of the local cluster the rehearsal runs on."),
    iterations: int = typer.Option(40, "--iterations", min=8, help="The whole schedule compressed into K "
                                                                   "iterations."),
    ranks: int = typer.Option(4, "--ranks-per-node", min=1, help="CPU ranks per node (GPUs of the spec)."),
    out: Path = typer.Option(None, "--out", help="Folder of rehearsals (default: rehearsals/ beside the spec's "
                                                 "runs); this one goes to OUT/NAME."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier rehearsal of this spec."),
    json_output: JsonOutput = False,
) -> None:
    """Run the spec scaled down (same flags, precision where the CPU has it, TP/PP where the ranks allow) through the
    real local SLURM: two chained tasks (the first stopped by the spec's exit duration, the second resuming), their
    uninterrupted twin (the resumed losses must equal its losses as printed), then ckpt check, ckpt convert, status
    and logs show. Exit 0 all green, 1 any red, 2 bad input."""
    from opskit.rehearse import rehearse as run_rehearsal
    from opskit.spec.load import load_spec

    spec = load_spec(name)

    def progress(stage) -> None:
        if not json_output:
            console.print(Text.assemble((f"{stage.status:>7}", _STYLE[stage.status]), f" {stage.name}"))

    result = run_rehearsal(spec, nodes=nodes, iterations=iterations, root=out, force=force,
                           ranks_per_node=ranks, on_stage=progress)
    emit(result, json_output, _render)
    if not result.ok:
        raise typer.Exit(1)


def _render(result) -> None:
    table = Table(title=f"rehearsal of {result.spec} ({result.seconds:.0f} s, {result.folder})")
    table.add_column("stage")
    table.add_column("", justify="center")
    table.add_column("why", overflow="fold")
    for stage in result.stages:
        style = _STYLE[stage.status]
        table.add_row(stage.name, Text(stage.status, style=style), stage.reason, style=None)
    console.print(table)
    console.print("substitutions:")
    for line in result.substitutions:
        console.print(f"  {line}")
    console.print("planner, full size:")
    for key, value in result.plan.items():
        if key == "warnings":
            for warning in value:
                console.print(f"  warning: {warning}")
        elif value is not None:
            shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
            console.print(f"  {key}: {shown}")
