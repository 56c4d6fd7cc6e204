"""``opskit specs list|show|new``: the bundled presets and the project's ``trainings/*.yaml``."""

from __future__ import annotations

import os
import sys

import typer
from rich.table import Table
from rich.text import Text

from opskit.cli._common import JsonOutput, console, emit, err_console, friendly_errors

app = typer.Typer(help="List, show and create training specs.", no_args_is_help=True)


@app.command("list")
@friendly_errors
def list_(json_output: JsonOutput = False) -> None:
    """Every spec a NAME finds: trainings/*.yaml first, then the bundled presets, with their variants, each validated
    as `opskit plan` validates it. A file that cannot be read, or a spec or variant that does not validate, gets one
    `error:` line on stderr (exit 1), the others are listed. JSON: a list of {name, description, source, origin,
    error}, the failing ones included."""
    from opskit.spec.new import list_specs

    entries = list_specs()
    emit(entries, json_output, _render_entries)
    errors = [entry.error for entry in entries if entry.error is not None]
    for error in errors:
        err_console.print(f"error: {error}")
    if errors:
        raise typer.Exit(1)


def _render_entries(entries) -> None:
    table = Table(title="specs (NAME or NAME:VARIANT)", title_justify="left")
    for column in ("name", "description", "source"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        if entry.error is None:
            source = f"preset {entry.source.name}" if entry.origin == "preset" else str(entry.source)
            table.add_row(Text(entry.name), Text(entry.description), Text(source))
    console.print(table)


@app.command("show")
@friendly_errors
def show(
    name: str = typer.Argument(..., help="Spec name (NAME or NAME:VARIANT), unique prefix or YAML path."),
    defaults: bool = typer.Option(False, "--defaults", help="Every field, with the defaults the file leaves out."),
    json_output: bool = typer.Option(False, "--json", help="{name, path, variant, variants, spec} as JSON instead "
                                                           "of YAML."),
) -> None:
    """The spec as opskit reads it: validated, its variant merged in (YAML on stdout)."""
    from opskit.spec.load import resolve_spec, validate_spec

    resolved = resolve_spec(name)
    spec = validate_spec(resolved.raw, resolved.path, resolved.variant)
    emit({"name": spec.cli_name, "path": str(resolved.path), "variant": resolved.variant,
          "variants": resolved.variants, "spec": spec.model_dump(mode="json") if defaults else resolved.raw},
         json_output, _render_spec)


def _render_spec(shown: dict) -> None:
    import yaml

    header = f"# {shown['name']} from {shown['path']}"
    if shown["variants"] and shown["variant"] is None:
        header += f"; variants: {', '.join(shown['variants'])} (NAME:VARIANT)"
    console.print(header + "\n" + yaml.safe_dump(shown["spec"], sort_keys=False, width=120), end="")


@app.command("new")
@friendly_errors
def new(
    name: str = typer.Argument(..., help="Name of the new spec: writes trainings/NAME.yaml."),
    source: str = typer.Option(..., "--from", help="Preset, NAME:VARIANT or YAML path to start from."),
    settings: list[str] = typer.Option([], "--set", metavar="VAR=VALUE",
                                       help="Write $VAR out as VALUE in the copy (repeat for each variable); "
                                            "without --set a terminal is asked for each."),
    force: bool = typer.Option(False, "--force", help="Replace trainings/NAME.yaml when `opskit specs new` created "
                                                      "it (never a file it did not write)."),
    json_output: JsonOutput = False,
) -> None:
    """Start a spec of your own from a preset (an existing file is kept, unless --force and opskit created it), with
    its environment variables ($six_ALL_CCFRWORK, ...) written out. JSON: path, source, renamed, still_named,
    written_out, still_unset (the warnings still go to stderr); no prompts."""
    from opskit.spec.new import create_user_spec, parse_settings

    # A bad --set is a SpecError like any other refusal: one `error:` line, exit 1 (docs/operations.md).
    created = create_user_spec(name, source, force, parse_settings(settings),
                               ask=None if settings or json_output or not _interactive() else _ask)
    emit(created, json_output, _render_created)
    if created.still_named:
        err_console.print(f"warning: still mentions {created.source.stem}: {', '.join(created.still_named)}; "
                          "check them")
    if created.still_unset:
        them = "them" if len(created.still_unset) > 1 else "it"
        err_console.print(f"warning: {created.path} uses {', '.join('$' + var for var in created.still_unset)}, not "
                          f"set here: export {them} before `opskit submit {name}`, or write {them} out with `opskit "
                          f"specs new {name} --from {source} --force --set VAR=VALUE`")


def _render_created(created) -> None:
    console.print(f"wrote {created.path} (from {created.source})")
    if created.renamed:
        console.print(f"  renamed for {created.path.stem}: {', '.join(created.renamed)}")
    if created.written_out:
        console.print(f"  written out: {', '.join('$' + var for var in created.written_out)}")


def _interactive() -> bool:
    """Whether a person can answer prompts (stdin is a terminal)."""
    return sys.stdin.isatty()


def _ask(var: str) -> str | None:
    """One prompt for ``$VAR``: its value here is the default; an empty answer (where it is unset) or ``$VAR`` keeps
    ``$VAR`` in the file (None)."""
    here = os.environ.get(var)
    keep = f"${var}"
    answer = typer.prompt(f"{keep} ({'enter ' + keep + ' to keep it' if here else 'empty: keep ' + keep})",
                          default=here or "", show_default=bool(here))
    return None if answer.strip() in ("", keep, f"${{{var}}}") else answer.strip()
