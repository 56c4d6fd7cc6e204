"""Where specs live: the user's ``trainings/`` folder before the bundled presets, a spec found by path, exact name or
unique name prefix, ``NAME:VARIANT`` split; :class:`SpecError`, the one error of every spec module."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from opskit.errors import OpskitError

USER_SPEC_DIR = Path("trainings")


VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


SPEC_NAME = VARIANT_NAME


class SpecError(OpskitError, ValueError):
    """A spec that cannot be found, read or validated; the message is one line naming the file and field."""


def preset_names() -> list[str]:
    """Names of the bundled presets."""
    files = resources.files("opskit.spec.presets").iterdir()
    return sorted(p.name[: -len(".yaml")] for p in files if p.name.endswith(".yaml"))


def preset_dir() -> Path:
    return Path(str(resources.files("opskit.spec.presets")))


def _preset_file(name: str) -> Path:
    return preset_dir() / f"{name}.yaml"


def spec_files() -> dict[str, Path]:
    """Spec name -> file; the user's ``trainings/`` folder shadows bundled presets of the same name."""
    found = {name: _preset_file(name) for name in preset_names()}
    if USER_SPEC_DIR.is_dir():
        found.update({p.stem: p for p in sorted(USER_SPEC_DIR.glob("*.yaml"))})
    return found


def split_variant(name_or_path: str) -> tuple[str, str | None]:
    """``tr8b:cl`` -> (``tr8b``, ``cl``); a name, path or existing file without a variant -> (it, None)."""
    if ":" not in name_or_path or Path(name_or_path).is_file():
        return name_or_path, None
    base, _, variant = name_or_path.rpartition(":")
    if base and VARIANT_NAME.fullmatch(variant):
        return base, variant
    return name_or_path, None


def find_spec(name_or_path: str) -> Path:
    """Resolve a spec argument (without its ``:variant``) to its YAML file.

    Raises:
        SpecError: when nothing or more than one spec matches.
    """
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.is_file():  # a folder named like a spec (logs, runs) is no spec
        if path.is_dir():
            raise SpecError(f"{name_or_path}: a folder, not a spec file")
        if not path.is_file():
            raise SpecError(f"{name_or_path}: no such spec file")
        return path
    candidates = spec_files()
    if name_or_path in candidates:
        return candidates[name_or_path]
    matches = [n for n in candidates if n.startswith(name_or_path)]
    if len(matches) == 1:
        return candidates[matches[0]]
    if matches:
        raise SpecError(f"spec {name_or_path!r} is ambiguous: {', '.join(sorted(matches))}")
    raise SpecError(f"no spec named {name_or_path!r}; known: {', '.join(sorted(candidates))}")
