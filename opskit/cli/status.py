"""``opskit status NAME``: BigScience's PULSE / ALERT lines from one squeue call. Exit 1 on ALERT."""

from __future__ import annotations

import typer

from opskit.cli._common import console, friendly_errors, print_json


@friendly_errors
def status(
    name: str = typer.Argument(..., help="Spec name, unique prefix or YAML path."),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Is the training running or scheduled? Exit 0 if so, 1 with an ALERT line if not, 3 if SLURM is unreachable."""
    from opskit.spec import load_spec
    from opskit.status import check

    spec = load_spec(name)
    pulse = check(spec.job_name)
    if json_output:
        print_json({"job_name": spec.job_name, "alert": pulse.alert, "unreachable": pulse.unreachable,
                    "lines": pulse.lines})
    else:
        for line in pulse.lines:
            console.print(line, markup=False, soft_wrap=True)
    if pulse.unreachable:
        raise typer.Exit(3)
    if pulse.alert:
        raise typer.Exit(1)
