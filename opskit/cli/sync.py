"""``opskit sync {logs|tensorboard|codecarbon|all} NAME [--to URL]``: publish a run's logs incrementally."""

from __future__ import annotations

from typing import Annotated

import typer

from opskit.cli._common import JsonOutput, SpecName, console, err_console, friendly_errors, print_json


@friendly_errors
def sync(
    kind: Annotated[str, typer.Argument(help="logs, tensorboard, codecarbon or all.")],
    name: SpecName,
    to: str = typer.Option(None, "--to", help="Target (default: the spec's sync.targets): hf://[datasets/]org/repo"
                                              "[/path], gs://bucket/prefix or file:///path."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be published (and, with --delete, "
                                                          "deleted) without doing it."),
    delete: bool = typer.Option(False, "--delete", help="Also delete remote files no longer in the run: only files "
                                                        "this run published (--dry-run lists them)."),
    workers: int = typer.Option(None, "--workers", min=1, max=64, help="Parallel transfers (default: spec's, 8)."),
    json_output: JsonOutput = False,
) -> None:
    """Publish new and changed log / TensorBoard / CodeCarbon files of a run; unchanged files are never sent, a sync
    with nothing new makes no request. Exit 1 when an upload failed after its retries."""
    from opskit.spec.load import load_spec
    from opskit.upkeep.sync import kinds_of, sync_spec

    kinds = kinds_of(kind)
    results = []
    for result in sync_spec(load_spec(name), kinds, to, dry_run=dry_run, delete=delete, workers=workers,
                            on_busy=lambda busy: err_console.print(str(busy))):
        results.append(result)
        if not json_output:
            _render(result)
    if json_output:
        print_json([r.as_json() for r in results])
    if any(r.failed for r in results):
        raise typer.Exit(1)


def _render(result) -> None:
    verb = "would publish" if result.dry_run else "published"
    deferred = f", {len(result.deferred)} changing (next sync)" if result.deferred else ""
    console.print(f"{result.target}: {verb} {len(result.copied)} file(s), {result.unchanged} unchanged{deferred}")
    for key in result.copied:
        console.print(f"  {key}")
    if result.deleted:
        console.print(f"{'would delete' if result.dry_run else 'deleted'} {len(result.deleted)} remote file(s):")
        for key in result.deleted:
            console.print(f"  {key}")
    by_reason: dict[str, list[str]] = {}
    for key, reason in result.failed.items():  # an hf:// commit fails as a whole: one line, not one per file
        by_reason.setdefault(reason, []).append(key)
    for reason, keys in by_reason.items():
        err_console.print(f"FAILED {len(keys)} file(s) ({keys[0]}{', ...' if len(keys) > 1 else ''}): {reason}; "
                          "nothing lost, the next sync retries them")
