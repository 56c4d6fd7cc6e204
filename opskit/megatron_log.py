"""Parse Megatron-style iteration lines (reference section 2.3), shared by ``opskit logs`` and ``opskit status``.

Accepts the 2022 ``(s)`` format and the 2021 ``(ms)`` one, ``[defaultN]:`` prefixes from ``torchrun --tee`` and any
prefix before `` iteration``; field names are the snake_case of the log's own names, times always in seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
_FIELD = re.compile(r"\s*([^:|]+?):\s*([-+0-9.eEinfINFnaN]+)\s*\|")


_RENAMED = {"number_of_skipped_iterations": "skipped_iterations", "number_of_nan_iterations": "nan_iterations"}
_INTEGERS = {"consumed_samples", "consumed_tokens", "global_batch_size", "skipped_iterations", "nan_iterations",
             "curriculum_seqlen"}


def _snake(name: str) -> str:
    key = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    return _RENAMED.get(key, key)


def parse_iteration_line(line: str) -> dict | None:
    """One iteration line -> ``{"iteration": int, "train_iters": int, "lm_loss": float, ...}``, or None."""
    match = _ITERATION.search(line)
    if not match:
        return None
    record: dict = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
    for name, value in _FIELD.findall(match.group(3)):
        key = _snake(name)
        if key == "elapsed_time_per_iteration_ms":
            key, value = "elapsed_time_per_iteration_s", float(value) / 1000
        number = float(value)
        record[key] = int(number) if key in _INTEGERS else number
    return record


def read_iterations(path: str | Path) -> Iterator[dict]:
    """Every iteration record of a log file, in file order."""
    with open(path, errors="replace") as f:
        for line in f:
            record = parse_iteration_line(line)
            if record is not None:
                yield record
