"""The one base of opskit's own errors: the CLI turns any of them into ``error: <one line>`` (no traceback); and the one
rule that names the optional extra (pyproject.toml's ``optional-dependencies``) a missing module comes with."""

from __future__ import annotations

import re
from pathlib import Path

# Extras that no feature needs: the test suite's ("all" names opskit itself, which is skipped).
_NOT_FEATURES = ("test",)


class OpskitError(Exception):
    """A failure opskit can explain in one line naming the file, field or flag and what was expected."""


class MissingExtraError(OpskitError):
    """A module of one of opskit's optional extras is not installed here (``torch is not installed: pip install
    'opskit[train]'``); the CLI exits 2 on it, as on any missing module it can name an extra for."""

    @classmethod
    def of(cls, module: str, needed_by: str | None = None, prefer: str | None = None) -> MissingExtraError:
        """The error for ``module`` (a dotted import name); ``needed_by`` says what needs it (``"gs:// targets"``),
        ``prefer`` as :func:`extra_for`."""
        return cls(missing_module_message(module, needed_by, prefer))


def _normalized(name: str) -> str:
    """A distribution or module name as PEP 503 compares them: ``google_crc32c`` and ``google.crc32c`` are
    ``google-crc32c``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras() -> dict[str, set[str]]:
    """Extra -> normalized distribution names, from the installed package's metadata (pyproject.toml's
    ``optional-dependencies`` as installed; read beside the package for a source checkout that is not installed);
    empty when neither is readable."""
    from importlib import metadata  # ~10 ms: only once a module is missing, never on every command's path

    try:
        requirements = metadata.requires("opskit") or []
    except metadata.PackageNotFoundError:
        requirements = _source_requirements()
    extras: dict[str, set[str]] = {}
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if name and extra and extra.group(1) not in _NOT_FEATURES and _normalized(name.group(0)) != "opskit":
            extras.setdefault(extra.group(1), set()).add(_normalized(name.group(0)))
    return extras


def _source_requirements() -> list[str]:
    """``optional-dependencies`` of the pyproject.toml above this package, in the metadata's form
    (``'torch>=2.4; extra == "train"'``); empty without one (or without tomllib, Python 3.10)."""
    try:
        import tomllib  # Python 3.11+: on 3.10 the ImportError below means no source requirements

        project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    except (ImportError, OSError, ValueError, KeyError):
        return []
    return [f'{req}; extra == "{extra}"' for extra, reqs in project.get("optional-dependencies", {}).items()
            for req in reqs]


def extra_for(module: str, prefer: str | None = None) -> str | None:
    """The extra that installs ``module`` (a dotted import name, e.g. ``google.cloud.storage``, ``megatron``), None
    when no extra lists it. An import name matches a distribution of the same normalized name, or one that name
    starts (``megatron`` -> ``megatron-core``); the longest prefix of the dotted name that matches wins. A module
    several extras list (tokenizers: train and convert) gets ``prefer`` (the command's own extra: ``data prepare``
    needs all of train's) when that is one of them, else the extra with the fewest packages: the least to install."""
    extras = _extras()
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = _normalized(".".join(parts[:n]))
        exact = [e for e, names in extras.items() if name in names]
        holders = exact or [e for e, names in extras.items() if any(d.startswith(name + "-") for d in names)]
        if holders:
            return prefer if prefer in holders else min(holders, key=lambda e: (len(extras[e]), e))
    return None


def missing_module_message(module: str, needed_by: str | None = None, prefer: str | None = None) -> str:
    """``"<module> is not installed (needed for <needed_by>): pip install 'opskit[<extra>]'"``, one line (``prefer``
    as :func:`extra_for`); without an extra that lists the module, it says so."""
    extra = extra_for(module, prefer)
    how = f"pip install 'opskit[{extra}]'" if extra else "no extra of opskit lists it; install it with pip"
    return f"{module} is not installed{f' (needed for {needed_by})' if needed_by else ''}: {how}"
