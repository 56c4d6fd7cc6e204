"""Finding and reading specs: by path, exact name or unique prefix, the user's ``trainings/`` before the bundled
presets, ``NAME:VARIANT`` variants deep-merged, YAML read strictly (no base-60 integers, no key given twice), then
validated by :mod:`opskit.spec.schema`."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from opskit.spec.files import VARIANT_NAME, SpecError, find_spec, split_variant
from opskit.spec.schema import Spec


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1 without base-60 integers (``time: 20:00:00`` stays the string sbatch expects, not 72000), and a key
    given twice in one mapping is an error (plain YAML keeps the last value silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then keys that override it: YAML's own rule
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise _DuplicateKey(key, key_node.start_mark, seen[key])
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, mark: yaml.Mark, first: yaml.Mark):
        super().__init__(f"line {mark.line + 1}: key {key!r} given twice (first at line {first.line + 1}): keep one")


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)


def read_yaml(path: Path) -> Any:
    """The YAML document of a file opskit reads settings from (a spec, the user's alert settings).

    Raises:
        SpecError: one line naming the file: unreadable (a folder, no permission), not UTF-8 text, not YAML (with
            the line), a key given twice in one mapping (with both lines).
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); expected a "
                        "YAML text file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return yaml.load(text, Loader=_SpecLoader)
    except _DuplicateKey as e:
        raise SpecError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise SpecError(f"{path}:{where} not valid YAML ({problem})") from None


def read_mapping(path: Path) -> dict:
    """The top-level mapping of a spec file.

    Raises:
        SpecError: see :func:`read_yaml`; or the document is not a mapping.
    """
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of sections (model, batch, ...), got {type(raw).__name__}")
    return raw


def variants_of(path: Path, raw: dict) -> dict[str, dict]:
    """The file's ``variants`` mapping, checked: names, partial-spec mappings, no nested ``variants``/``name``."""
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict):
        raise SpecError(f"{path}: variants: expected a mapping of variant name -> partial spec")
    for name, overlay in variants.items():
        if not isinstance(name, str) or not VARIANT_NAME.fullmatch(name):
            raise SpecError(f"{path}: variants: {name!r} is not a valid variant name (letters, digits, _ . -)")
        if not isinstance(overlay, dict):
            raise SpecError(f"{path}: variants.{name}: expected a mapping of sections, got {type(overlay).__name__}")
        for key in ("variants", "name"):
            if key in overlay:
                raise SpecError(f"{path}: variants.{name}.{key}: not allowed in a variant (it is named "
                                f"NAME:{name} after its file)")
    return variants


def deep_merge(base: Mapping, overlay: Mapping) -> dict:
    """``overlay`` over ``base``: mappings merge key by key, anything else replaces, ``None`` deletes the key."""
    merged = dict(base)
    for key, value in overlay.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class ResolvedSpec:
    """A spec file's mapping with its variant applied, before validation."""

    path: Path
    raw: dict
    variant: str | None
    variants: list[str]
    """Variant names the file defines."""


def resolve_spec(name_or_path: str, overrides: Mapping | None = None) -> ResolvedSpec:
    """Find a spec file and apply ``:variant`` and then ``overrides`` (deep merges); no validation.

    Raises:
        SpecError: unknown spec or variant, unreadable YAML.
    """
    base, variant = split_variant(name_or_path)
    path = find_spec(base)
    return resolved_from(path, read_mapping(path), variant, overrides)


def resolved_from(path: Path, whole: dict, variant: str | None, overrides: Mapping | None = None) -> ResolvedSpec:
    """The mapping of spec file ``path`` (its top-level mapping ``whole``) with ``variant`` and then ``overrides``
    applied: the one rule :func:`resolve_spec` and :func:`list_specs` share.

    Raises:
        SpecError: a malformed ``variants`` mapping, or no variant ``variant``.
    """
    variants = variants_of(path, whole)
    raw = {k: v for k, v in whole.items() if k != "variants"}
    if variant is not None:
        if variant not in variants:
            known = ", ".join(variants) or "none"
            raise SpecError(f"{path}: no variant {variant!r} (known: {known})")
        raw = deep_merge(raw, variants[variant])
        raw["name"] = f"{raw.get('name', path.stem)}:{variant}"
    if overrides:
        raw = deep_merge(raw, overrides)
    raw.setdefault("name", path.stem)
    return ResolvedSpec(path, raw, variant, list(variants))


def load_spec(name_or_path: str, overrides: Mapping | None = None) -> Spec:
    """Find, read and validate a spec: ``NAME``, ``NAME:VARIANT``, a unique prefix or a YAML path.

    Args:
        overrides: a partial spec deep-merged last (``opskit plan --nodes 24`` passes ``{"parallel": {"nodes": 24}}``).

    Raises:
        SpecError: one line naming the file and every invalid field with what was expected.
    """
    resolved = resolve_spec(name_or_path, overrides)
    return validate_spec(resolved.raw, resolved.path, resolved.variant, overrides)


def validate_spec(raw: Mapping, path: Path, variant: str | None = None, overrides: Mapping | None = None) -> Spec:
    """Validate a resolved mapping as a :class:`Spec` read from ``path``.

    Raises:
        SpecError: ``<path>[: variant V]: field: reason; ...`` on one line.
    """
    try:
        spec = Spec.model_validate(dict(raw))
    except ValidationError as e:
        where = f"{path}: variant {variant}" if variant else f"{path}"
        given = f" (with {_flatten(overrides)} from the command line)" if overrides else ""
        raise SpecError(f"{where}: {_describe(e)}{given}") from None
    spec._file = path
    spec._variant = variant
    return spec


def _flatten(mapping: Mapping, prefix: str = "") -> str:
    parts = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            parts.append(_flatten(value, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key}={value}")
    return ", ".join(parts)


def _describe(error: ValidationError) -> str:
    """Every pydantic error as `field.path: message`, joined on one line (cross-section rules name their fields)."""
    parts = []
    for err in error.errors():
        field = ".".join(_key_text(p) for p in err["loc"])
        message = " ".join(err["msg"].removeprefix("Value error, ").split())
        if err["type"] == "extra_forbidden":
            message = f"unknown key (expected one of: {', '.join(_section_keys(err['loc'][:-1]))})"
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


def _key_text(key: Any) -> str:
    """A key of an error location as written in a message: plain when it is a plain word, else quoted (a key with a
    newline, a colon or a dot must not break the one line, nor pass for a path)."""
    return str(key) if isinstance(key, int) or re.fullmatch(r"[\w-]+", str(key)) else repr(key)


def _section_keys(loc: tuple) -> list[str]:
    """The valid keys of the section at `loc` (a pydantic error location), for 'unknown key' messages."""
    model: type[BaseModel] = Spec
    for part in loc:
        annotation = _model_of(model.model_fields[str(part)].annotation)
        if annotation is None:
            return []
        model = annotation
    keys = list(model.model_fields)
    return [*keys, "variants"] if model is Spec else keys


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in an annotation (``CurriculumSpec | None`` -> CurriculumSpec)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for member in typing.get_args(annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                return member
    return None
