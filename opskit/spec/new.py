"""``opskit specs list`` and ``opskit specs new``: every spec and variant a name finds, and a user spec created from
a preset with ``--set VAR=value`` written out (never over a file ``specs new`` did not write)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from opskit.fsutil import OutputRefusedError, atomic_write_text, claim_file
from opskit.spec.files import SPEC_NAME, USER_SPEC_DIR, SpecError, spec_files
from opskit.spec.load import read_mapping, resolve_spec, resolved_from, validate_spec, variants_of
from opskit.spec.placeholders import unset_variables, variables_used, written_out


@dataclass(frozen=True)
class SpecEntry:
    """One row of ``opskit specs list``."""

    name: str
    """``NAME`` or ``NAME:VARIANT``, as other commands accept it."""
    description: str
    source: Path
    origin: Literal["preset", "trainings"]
    error: str | None = None
    """Why the file cannot be read or the spec does not validate (one line naming the file); such an entry has no
    description, and one for an unreadable file no variants."""


def list_specs() -> list[SpecEntry]:
    """Every spec and variant that a name finds: the user's ``trainings/*.yaml`` (first) and the bundled presets they
    do not shadow, each validated as :func:`load_spec` validates it (what ``opskit plan`` and ``submit`` would
    refuse is no good spec here either). A file that cannot be read, or a spec or variant that does not validate, is
    one entry carrying its one-line error: the others are listed as usual."""
    entries = []
    candidates = spec_files()
    user = {name for name, path in candidates.items() if path.parent == USER_SPEC_DIR}
    for name in sorted(candidates, key=lambda n: (n not in user, n)):
        path = candidates[name]
        origin: Literal["preset", "trainings"] = "trainings" if name in user else "preset"
        try:
            whole = read_mapping(path)
            variants = variants_of(path, whole)
        except SpecError as e:
            entries.append(SpecEntry(name, "", path, origin, error=str(e)))
            continue
        for variant in (None, *variants):
            entry_name = name if variant is None else f"{name}:{variant}"
            try:
                resolved = resolved_from(path, whole, variant)
                validate_spec(resolved.raw, resolved.path, resolved.variant)
            except SpecError as e:
                entries.append(SpecEntry(entry_name, "", path, origin, error=str(e)))
                if variant is None:  # the variants inherit the base's problem: the file is named once
                    break
                continue
            described = whole if variant is None else variants[variant]  # a variant's own description, or none
            entries.append(SpecEntry(entry_name, str(described.get("description", "")), path, origin))
    return entries


@dataclass(frozen=True)
class CreatedSpec:
    path: Path
    source: Path
    renamed: list[str]
    """Fields where the source's name was replaced by the new one (``paths.output``, ``slurm.job_name``, ...)."""
    still_named: list[str]
    """Other string fields that still mention the source's name: to check by hand."""
    written_out: list[str] = dataclasses.field(default_factory=list)
    """Environment variables whose ``$VAR`` the file now holds as their value (``--set``, the prompt)."""
    still_unset: list[str] = dataclasses.field(default_factory=list)
    """Variables the file still uses that are not set, or empty, in this environment (``opskit submit`` would
    warn)."""


class SettingError(SpecError):
    """A bad ``--set VAR=VALUE`` of ``opskit specs new`` (the command line's mistake, not a file's; refused like
    any spec error: one line, exit 1)."""


MAX_SPEC_NAME = 200  # trainings/NAME.yaml must fit a file name (255 bytes on Linux file systems)
_CREATED_MARK = "# Created by `opskit specs new "
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def created_by_specs_new(path: Path) -> bool:
    """Whether the spec file at ``path`` was written by :func:`create_user_spec` (its first line says so)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(_CREATED_MARK)
    except OSError:
        return False


def parse_settings(items: list[str]) -> dict[str, str]:
    """``["VAR=VALUE", ...]`` (``opskit specs new --set``) as a mapping.

    Raises:
        SettingError: an item without ``=``, a name that is no environment variable's, an empty value or one with a
            control character (it goes into YAML strings and job scripts), a variable given twice.
    """
    values: dict[str, str] = {}
    for item in items:
        var, equals, value = item.partition("=")
        if not equals:
            raise SettingError(f"--set {item}: expected VAR=VALUE, e.g. --set six_ALL_CCFRWORK=/path")
        if not _VAR_NAME.fullmatch(var):
            raise SettingError(f"--set {item}: {var!r} is not an environment variable name (letters, digits and _, "
                               "not starting with a digit)")
        if not value:
            raise SettingError(f"--set {item}: expected a value after '=' (the path ${var} stands for)")
        if re.search(r"[\x00-\x1f\x7f]", value):
            raise SettingError(f"--set {var}: the value {value!r} has a control character; give a plain path")
        if var in values:
            raise SettingError(f"--set {var} given twice ({var}={values[var]} and {item}): keep one")
        values[var] = value
    return values


def create_user_spec(name: str, source: str, force: bool = False, values: Mapping[str, str] | None = None,
                     ask: Callable[[str], str | None] | None = None) -> CreatedSpec:
    """Write ``trainings/NAME.yaml`` from ``source`` (a preset, ``NAME:VARIANT`` or a path), validated first.

    The copy is the source's mapping with its variant applied (a copy of a whole file keeps its variants); the
    source's name is replaced by ``name`` in ``paths.*`` and ``slurm.job_name`` (of the variants too), so the new
    training never writes into the source's run directory or shares its SLURM job name. Each ``$VAR`` / ``${VAR}``
    of ``values`` (``--set VAR=VALUE``) is written out as its value in every string; ``ask(VAR)`` (the prompt) is
    asked for each other variable the copy uses, once the file may be written, and a None or empty answer keeps
    ``$VAR``.

    The file's first line, a YAML comment, marks it as opskit's: with ``force`` such a file is replaced (atomically);
    any other existing file is never touched.

    Raises:
        SpecError: invalid name, or an invalid source spec. SettingError: a variable of ``values`` the source does
            not use. OutputRefusedError: the file exists and (without ``force``, or not written by ``opskit specs
            new``) is not replaced.
    """
    if not SPEC_NAME.fullmatch(name) or len(name) > MAX_SPEC_NAME:
        raise SpecError(f"spec name {name[:40]!r}{'...' if len(name) > 40 else ''}: use at most {MAX_SPEC_NAME} "
                        "letters, digits and _ . - (it becomes trainings/NAME.yaml)")
    resolved = resolve_spec(source)
    validate_spec(resolved.raw, resolved.path, resolved.variant)
    old = resolved.path.stem
    raw = dict(resolved.raw)
    raw.pop("name", None)
    if resolved.variant is None:
        whole = read_mapping(resolved.path)
        if "variants" in whole:
            raw["variants"] = whole["variants"]
    used = variables_used(raw)
    values = dict(values or {})
    if unused := [var for var in values if var not in used]:
        uses = f"it uses {', '.join('$' + v for v in used)}" if used else "it uses no environment variable"
        raise SettingError(f"--set {unused[0]}: {source} does not use ${unused[0]} ({uses})")
    renamed: list[str] = []
    raw = _renamed(raw, old, name, "", renamed)
    # a renamed field mentions the old name only inside the new one (tiny -> mytiny): not one to check by hand
    still = sorted(m for m in _mentions(raw, old, "") if not m.endswith("description")
                   and not any(m == r or m.startswith(f"{r}.") for r in renamed))
    target = USER_SPEC_DIR / f"{name}.yaml"
    claim_file(target, force, created_by_specs_new, flag="spec name")
    for var in used:
        if ask is not None and var not in values and (answer := ask(var)):
            values[var] = answer
    raw = written_out(raw, values)
    header = (f"{_CREATED_MARK}{name} --from {source}` from {resolved.path}; see that file for the source of each "
              "value.\n")
    text = header + yaml.safe_dump(raw, sort_keys=False, width=120)
    created = CreatedSpec(target, resolved.path, renamed, still, [v for v in used if v in values],
                          [v for v in unset_variables(raw) if v not in values])
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # claimed: opskit's own, and --force
        atomic_write_text(target, text)
        return created
    try:
        with open(target, "x") as out:  # exclusive create: never overwrite, even racing another `specs new`
            out.write(text)
    except FileExistsError:
        raise OutputRefusedError(f"{target}: was created by someone else just now; not replaced") from None
    return created


def _renamed(raw: dict, old: str, new: str, prefix: str, renamed: list[str]) -> dict:
    out = dict(raw)
    for section, keys in (("paths", None), ("slurm", ("job_name",))):
        values = out.get(section)
        if not isinstance(values, dict):
            continue
        values = dict(values)
        for key, value in values.items():
            if keys is not None and key not in keys:
                continue
            if isinstance(value, str) and old in value:
                values[key] = value.replace(old, new)
                renamed.append(f"{prefix}{section}.{key}")
            elif isinstance(value, dict):  # paths.hub_repos
                replaced = {k: v.replace(old, new) if isinstance(v, str) else v for k, v in value.items()}
                if replaced != value:
                    values[key] = replaced
                    renamed.append(f"{prefix}{section}.{key}")
        out[section] = values
    if isinstance(out.get("variants"), dict):
        out["variants"] = {v: _renamed(o, old, new, f"variants.{v}.", renamed) if isinstance(o, dict) else o
                           for v, o in out["variants"].items()}
    return out


def _mentions(value: Any, old: str, where: str) -> set[str]:
    if isinstance(value, str):
        return {where.rstrip(".")} if old in value else set()
    if isinstance(value, dict):
        return set().union(*(_mentions(v, old, f"{where}{k}.") for k, v in value.items()))
    if isinstance(value, list):
        return set().union(*(_mentions(v, old, where) for v in value))
    return set()
