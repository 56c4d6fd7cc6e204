"""``opskit sync {logs|tensorboard|all} NAME --to URL``: publish a run's logs incrementally."""

from __future__ import annotations

import typer

from opskit.cli._common import console, friendly_errors, print_json


@friendly_errors
def sync(
    kind: str = typer.Argument(..., help="logs, tensorboard or all."),
    name: str = typer.Argument(..., help="Spec name, unique prefix or YAML path."),
    to: str = typer.Option(..., "--to", help="Target: file:///path (a mounted share)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be copied."),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Copy new and changed log / TensorBoard files of a run to a target; unchanged files are never copied."""
    from opskit.runs import RunPaths
    from opskit.spec import load_spec
    from opskit.sync import KINDS
    from opskit.sync import sync as sync_run

    kinds = list(KINDS) if kind == "all" else [kind]
    result = sync_run(RunPaths.of(load_spec(name)), kinds, to, dry_run=dry_run)
    if json_output:
        print_json({"target": str(result.target), "copied": result.copied, "unchanged": result.unchanged,
                    "dry_run": dry_run})
        return
    verb = "would copy" if dry_run else "copied"
    console.print(f"{verb} {len(result.copied)} file(s) to {result.target}, {result.unchanged} unchanged")
    for relative in result.copied:
        console.print(f"  {relative}", markup=False)
