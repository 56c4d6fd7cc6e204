"""One error base: every error class the library defines is an OpskitError, so the CLI's table maps them all to one
line with (OpskitError, OSError) and a new error type cannot be forgotten there."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import opskit
from opskit.errors import OpskitError

# Exception classes defined in opskit that are not library errors, and why.
NOT_LIBRARY_ERRORS = {
    # Raised and caught inside GcsTarget's retries (a ConnectionError, so it is retried), never seen outside.
    "opskit.targets.gcs.ChecksumMismatch",
    # A YAMLError raised inside the spec's YAML loader and turned into a SpecError there.
    "opskit.spec.load._DuplicateKey",
    # The job's SIGTERM handler raises it on the main thread and Job.run catches it: control flow, never seen outside.
    "opskit.allocation.job.Terminated",
}
# The trainer (torch at import) runs as its own process and prints its own one-line errors (train/main.py).
SKIPPED_PACKAGES = ("opskit.train",)


def _torch_free_modules():
    for info in pkgutil.walk_packages(opskit.__path__, "opskit."):
        if not info.name.startswith(SKIPPED_PACKAGES):
            yield importlib.import_module(info.name)


def test_every_library_error_is_an_opskit_error():
    found, strays = set(), []
    for module in _torch_free_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                name = f"{cls.__module__}.{cls.__qualname__}"
                found.add(name)
                if not issubclass(cls, OpskitError) and name not in NOT_LIBRARY_ERRORS:
                    strays.append(name)
    assert not strays, f"not OpskitError subclasses: {strays}"
    assert {"opskit.spec.files.SpecError", "opskit.targets.base.TargetError", "opskit.logs.parse.LogFormatError",
            "opskit.slurm.client.SlurmError"} <= found  # the walk saw the library's modules
    assert NOT_LIBRARY_ERRORS <= found  # no stale exemption


def test_the_cli_prints_any_library_error_as_one_line(capsys):
    import pytest
    import typer

    from opskit.cli._common import friendly_errors
    from opskit.data.corpus import DataError

    @friendly_errors
    def command():
        raise DataError("corpus.txt: not UTF-8")

    with pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == 1
    assert capsys.readouterr().err.strip() == "error: corpus.txt: not UTF-8"


def test_library_errors_keep_their_second_base():
    # Callers catch some of them as ValueError / RuntimeError (e.g. `except (OSError, ValueError)`).
    from opskit.slurm.client import SlurmError
    from opskit.spec.files import SpecError
    from opskit.targets.base import TargetError

    assert issubclass(SpecError, ValueError) and issubclass(TargetError, ValueError)
    assert issubclass(SlurmError, RuntimeError)
