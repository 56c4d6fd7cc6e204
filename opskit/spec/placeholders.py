"""``$VAR`` / ``${VAR}`` placeholders in spec strings (BigScience's ``$six_ALL_CCFRSCRATCH``): the variables a spec
uses, those unset here, and a spec with given values written out."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

ENV_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def var_of(match: re.Match) -> str:
    """The variable name of an :data:`ENV_VAR` match (``$VAR`` or ``${VAR}``)."""
    return match.group(1) or match.group(2)


def variables_used(value: Any) -> list[str]:
    """The environment variables (``$VAR``, ``${VAR}``) of every string in a spec's mapping, in order of use."""
    if isinstance(value, str):
        return [var_of(m) for m in ENV_VAR.finditer(value)]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return list(dict.fromkeys(var for item in items for var in variables_used(item)))


def unset_variables(value: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables of :func:`variables_used` that ``environ`` (default: ``os.environ``) does not set, or sets to
    the empty string: those :meth:`Spec.expand` refuses."""
    env = os.environ if environ is None else environ
    return [var for var in variables_used(value) if not has_value(env, var)]


def has_value(env: Mapping[str, str], var: str) -> bool:
    """Whether ``$var`` expands to something: set and not empty (an empty one would turn
    ``$six_ALL_CCFRSCRATCH/checkpoints`` into ``/checkpoints``)."""
    return bool(env.get(var))


def written_out(value: Any, values: Mapping[str, str]) -> Any:
    """``value`` (a spec's mapping) with each ``$VAR`` / ``${VAR}`` of ``values`` replaced by its value."""
    if isinstance(value, str):
        return ENV_VAR.sub(lambda m: values.get(var_of(m), m.group(0)), value)
    if isinstance(value, dict):
        return {key: written_out(item, values) for key, item in value.items()}
    if isinstance(value, list):
        return [written_out(item, values) for item in value]
    return value
