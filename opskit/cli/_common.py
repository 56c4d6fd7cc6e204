"""What every command shares: one console, and one table from library errors to one-line messages."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps

import typer
from rich.console import Console

# soft_wrap: log-like lines (PULSE, iteration lines) stay one line each in pipes and files, so grep finds them.
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _known_errors() -> tuple[type[BaseException], ...]:
    # Imported here so that `opskit --help` stays light; each of these modules is torch-free at import.
    from opskit.ckpt.convert import ConvertError
    from opskit.ckpt.layout import CheckpointFormatError
    from opskit.ckpt.prune import PruneError
    from opskit.data import DataError
    from opskit.slurm.client import SlurmError
    from opskit.spec import SpecError
    from opskit.submit import SubmitError
    from opskit.sync import SyncError
    from opskit.targets import TargetError

    return (SpecError, DataError, SubmitError, SlurmError, CheckpointFormatError, ConvertError, PruneError, SyncError,
            TargetError, FileNotFoundError)


def friendly_errors(command: Callable) -> Callable:
    """Turn the library's typed errors into ``error: <one line>`` and exit 1; ``OPSKIT_DEBUG=1`` shows tracebacks."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except _known_errors() as e:
            if os.environ.get("OPSKIT_DEBUG") == "1":
                raise
            err_console.print(f"error: {e}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def print_json(data) -> None:
    """Machine-readable output for scripts (``--json``): plain JSON on stdout, nothing else."""
    import json

    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
