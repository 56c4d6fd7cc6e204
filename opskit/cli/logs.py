"""``opskit logs show NAME|FILE``: the training's iteration lines as a table, first and last lm loss."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from opskit.cli._common import console, friendly_errors, print_json

app = typer.Typer(help="Training logs (Megatron-style iteration lines).", no_args_is_help=True)

# (record field, column header): short headers keep the table readable in an 80-column pipe.
COLUMNS = (("iteration", "iteration"), ("consumed_tokens", "tokens"), ("lm_loss", "lm loss"),
           ("learning_rate", "lr"), ("grad_norm", "grad norm"), ("elapsed_time_per_iteration_s", "s/it"))


def _log_file(name_or_file: str) -> Path:
    path = Path(name_or_file)
    if path.is_file():
        return path
    from opskit.runs import RunPaths
    from opskit.spec import load_spec

    return RunPaths.of(load_spec(name_or_file)).main_log


@app.command("show")
@friendly_errors
def show(
    name_or_file: str = typer.Argument(..., help="Spec name (its main_log.txt) or a log file."),
    last: int = typer.Option(10, "--last", min=1, help="How many iteration lines to show."),
    json_output: bool = typer.Option(False, "--json", help="All records as JSON."),
) -> None:
    """The last iteration lines, and the first and last lm loss."""
    from opskit.megatron_log import read_iterations

    path = _log_file(name_or_file)
    records = list(read_iterations(path))
    if json_output:
        print_json(records)
        return
    if not records:
        console.print(f"{path}: no iteration lines yet")
        return
    table = Table(title=str(path))
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    for r in records[-last:]:
        table.add_row(*(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c, _ in COLUMNS))
    console.print(table)
    first, final = records[0], records[-1]
    console.print(f"lm loss: first {first['lm_loss']:.4f} (iteration {first['iteration']}), "
                  f"last {final['lm_loss']:.4f} (iteration {final['iteration']} of {final['train_iters']})")
