"""What every command shares: one console, one output sink (:func:`emit`: a person's rendering or ``--json``), and
one table from library errors to one-line messages."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Annotated, TypeVar

import typer
from rich.console import Console

from opskit.errors import MissingExtraError, OpskitError, extra_for

# soft_wrap: log-like lines (PULSE, iteration lines) stay one line each in pipes and files, so grep finds them.
# emoji=False: rich would print ":b:" of "--range a:b:" or a "NAME:VARIANT:..." path as an emoji, even without markup.
# markup=False: paths, log lines and messages are printed as they are ("[default0]:", "[1, 2]"); a style is a Text's.
console = Console(highlight=False, soft_wrap=True, emoji=False, markup=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False, markup=False)

# The parameters most commands take, declared once: ``name: SpecName`` and ``json_output: JsonOutput = False``.
SpecName = Annotated[str, typer.Argument(help="Spec name, unique prefix or YAML path.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Machine-readable output: JSON on stdout, nothing else "
                                                          "(notes and warnings on stderr).")]

Result = TypeVar("Result")


def friendly_errors(command: Callable | None = None, *, exit_code: int = 1, extra: str | None = None) -> Callable:
    """Turn the library's errors (:class:`~opskit.errors.OpskitError`), and any OSError (an unwritable or immutable
    folder, a full disk), into ``error: <one line>`` and exit 1 (or ``exit_code``: ``opskit status`` keeps 1 for its
    ALERT); ``OPSKIT_DEBUG=1`` shows tracebacks. Use as ``@friendly_errors`` or ``@friendly_errors(exit_code=2)``.

    A module of an optional extra that is not installed (:class:`~opskit.errors.MissingExtraError`, or a
    ModuleNotFoundError for a module an extra lists) is one line naming the extra, exit 2 as the trainer's
    (docs/operations.md): every command that imports torch, transformers, tokenizers... inside says the same.
    ``extra``: the command's own extra, named for a module several extras list (:func:`opskit.errors.extra_for`)."""
    if command is None:
        return lambda function: friendly_errors(function, exit_code=exit_code, extra=extra)

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise  # an exit code, not an error
        except (MissingExtraError, ModuleNotFoundError) as e:
            if os.environ.get("OPSKIT_DEBUG") == "1":
                raise
            if isinstance(e, ModuleNotFoundError) and (not e.name or extra_for(e.name) is None):
                raise  # no extra's module (a broken installation, or a bug): the traceback says where
            message = e if isinstance(e, MissingExtraError) else MissingExtraError.of(e.name, prefer=extra)
            err_console.print(f"error: {message}", soft_wrap=True)
            raise typer.Exit(2) from None
        except (OpskitError, OSError) as e:
            if os.environ.get("OPSKIT_DEBUG") == "1":
                raise
            err_console.print(f"error: {_one_line(e)}", soft_wrap=True)
            raise typer.Exit(exit_code) from None

    return wrapper


def _one_line(error: BaseException) -> str:
    """``<file>: <strerror>`` for an OSError that names its file (``[Errno 13] ...`` otherwise), the message of
    any other error."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def emit(result: Result, json_output: bool, render: Callable[[Result], object]) -> None:
    """The one output sink of a command: ``result`` (a library result with ``.as_json()``, a dataclass, or a dict or
    list of those) as JSON on stdout with ``--json`` (:func:`print_json`), else ``render(result)`` for a person
    (rich, on :data:`console`). Exit codes are the command's: it raises ``typer.Exit`` after this returns."""
    if json_output:
        print_json(_plain(result))
    else:
        render(result)


def _plain(result):
    """``result`` as JSON-able data: its ``.as_json()``, a dataclass's fields, a list's items and a dict's values each
    so."""
    if hasattr(result, "as_json"):
        return result.as_json()
    if isinstance(result, list):
        return [_plain(item) for item in result]
    if isinstance(result, dict):
        return {key: _plain(value) for key, value in result.items()}
    if dataclasses.is_dataclass(result):
        return dataclasses.asdict(result)
    return result


def print_lines(lines: Iterable[str]) -> None:
    """Each line on :data:`console` (a renderer of :func:`emit` for a result that is lines)."""
    for line in lines:
        console.print(line)


def progress_console(json_output: bool) -> Console:
    """Where a command's progress and status lines go: stdout for a person, stderr under ``--json`` (stdout holds
    the JSON alone)."""
    return err_console if json_output else console


def print_json(data) -> None:
    """Machine-readable output for scripts (``--json``): plain JSON on stdout, nothing else (paths as strings)."""
    import json

    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_json_line(data) -> None:
    """One JSON object on one line of stdout, flushed: JSON Lines for a command that streams (``logs tail --json``)."""
    import json

    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()
