"""Records out as JSON lines or CSV (``opskit logs parse``).

:func:`write_files` writes what :func:`write_jsonl` / :func:`write_csv` write for the rows ``{"file", "segment",
**record}`` of each file, byte for byte; the records a large read kept column-wise (``read_from(..., columnar=True)``)
are formatted by polars, a column at a time, never as one dict and one ``json.dumps`` each (issue 19: a 1M-line log
costs ~1 s instead of ~7 s; docs/benchmarks.md). tests/test_logs_export.py holds both ways equal.
"""

from __future__ import annotations

import csv
import io
import json
from typing import TextIO

from opskit.logs.parse import LogChunk, split_segments

# CSV columns in this order, then ``extra.KEY`` for every unknown field met.
COLUMNS = ("file", "segment", "kind", "iteration", "train_iters", "consumed_samples", "consumed_tokens",
           "elapsed_time_per_iteration_s", "learning_rate", "global_batch_size", "lm_loss", "loss_scale", "grad_norm",
           "num_zeros", "params_norm", "curriculum_seqlen", "skipped_iterations", "nan_iterations",
           "samples_per_second", "tflops", "dataset", "where", "validation_lm_loss", "validation_ppl")
_SLICE = 1 << 16  # lines per write of the columnar path


def write_jsonl(records: list[dict], out: TextIO) -> None:
    """One JSON object per line (NaN written as JSON's non-standard ``NaN``, as Python's json does)."""
    for record in records:
        out.write(json.dumps(record) + "\n")


def write_csv(records: list[dict], out: TextIO) -> None:
    """A header and one row per record; empty cells for fields a record lacks."""
    extras = _extras(records)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*COLUMNS, *(f"extra.{key}" for key in extras)])
    for r in records:
        writer.writerow(_row(r, extras))


def write_files(files: list[tuple[str, LogChunk]], output_format: str, out: TextIO) -> None:
    """The records of each (file name, chunk read from its start) as rows ``{"file": name, "segment": N, **record}``
    (N counts restarts: :func:`opskit.logs.parse.split_segments`), in ``output_format`` ``jsonl`` or ``csv``."""
    if not any(chunk.tables for _, chunk in files):
        rows = [{"file": name, "segment": segment, **r} for name, chunk in files
                for segment, records in enumerate(split_segments(chunk.records)) for r in records]
        (write_jsonl if output_format == "jsonl" else write_csv)(rows, out)
        return
    extras = _extras([r for _, chunk in files for r in chunk.records])  # column-wise records have no extra
    if output_format == "csv":
        out.write(_csv_text([*COLUMNS, *(f"extra.{key}" for key in extras)]) + "\n")
    for name, chunk in files:
        lines = _columnar_lines(name, chunk, output_format, extras)
        for start in range(0, len(lines), _SLICE):
            out.write(lines.slice(start, _SLICE).str.join("\n").item() + "\n")


def _columnar_lines(name: str, chunk: LogChunk, output_format: str, extras: list[str]):
    """The output lines of one file's records in file order (a polars Series). Each record's text after its segment
    is formatted first (``rest``: Python, as :func:`write_jsonl` / :func:`write_csv` do; ``tables``: polars), then
    segments are counted over all records in file order, as :func:`opskit.logs.parse.split_segments` counts them."""
    import polars as pl

    jsonl = output_format == "jsonl"
    rest = pl.DataFrame({"slot": chunk.slots if chunk.slots is not None else range(len(chunk.records)),
                         "iteration": [r["iteration"] if r["kind"] == "iteration" else None for r in chunk.records],
                         "body": [", " + json.dumps(r)[1:] if jsonl else "," + _csv_text(_row(r, extras)[2:])
                                  for r in chunk.records]},
                        schema={"slot": pl.Int64, "iteration": pl.Int64, "body": pl.String})
    parts = [rest]
    for table in chunk.tables:
        floats = {key: _needs_repr(table[key]) if dtype == pl.Float64 else None
                  for key, dtype in table.schema.items() if key != "slot"}
        body = _jsonl_body(floats) if jsonl else _csv_body(floats, len(extras))
        parts.append(table.select(pl.col("slot").cast(pl.Int64), "iteration", body.alias("body")))
    iteration = pl.col("iteration")
    previous = iteration.shift(1).forward_fill()  # the iteration of the last iteration record before
    segment = (iteration <= previous).fill_null(False).cum_sum().cast(pl.String)
    head = f'{{"file": {json.dumps(name)}, "segment": ' if jsonl else _csv_text([name]) + ","
    lines = pl.concat(parts).sort("slot").select(pl.concat_str([pl.lit(head), segment, pl.col("body")]).alias("line"))
    return lines["line"]


def _jsonl_body(floats: dict):
    """``json.dumps`` of an iteration record after its segment: ``, "kind": "iteration", "key": value, ...}``
    (``floats``: each key of the record's order -> None for an integer column, else :func:`_number_text`'s
    ``fix``)."""
    import polars as pl

    pieces = [pl.lit(', "kind": "iteration"')]
    for key, fix in floats.items():
        pieces += [pl.lit(f", {json.dumps(key)}: "), _number_text(key, fix, nan="NaN", inf="Infinity")]
    return pl.concat_str([*pieces, pl.lit("}")])


def _csv_body(floats: dict, extras: int):
    """:func:`write_csv`'s row of an iteration record after its file and segment cells: ``,iteration,...`` (every
    column of :data:`COLUMNS`, then ``extras`` empty cells)."""
    import polars as pl

    given = {"kind": pl.lit("iteration"), **{key: _number_text(key, fix, nan="nan", inf="inf")
                                             for key, fix in floats.items()}}
    return pl.concat_str([pl.lit("")] + [given.get(column, pl.lit("")) for column in COLUMNS[2:]]
                         + [pl.lit("")] * extras, separator=",")


def _needs_repr(values) -> bool:
    """Whether polars writes some of these floats otherwise than ``repr``: below 1e-4, or not finite."""
    return bool((((values.abs() < 1e-4) & (values != 0)) | ~values.is_finite()).any())


def _number_text(column: str, fix: bool | None, nan: str, inf: str):
    """Column ``column`` as ``str`` (integers: ``fix`` None) or Python's ``repr`` (floats) writes each value: polars
    writes the same shortest round-trip digits, but ``0.00005969`` for ``5.969e-05``, ``3e-7`` for ``3e-07``,
    ``NaN`` for ``nan`` (``fix``: the column has such values; :func:`_needs_repr`); ``nan`` and ``inf`` spell the
    non-finite values (json: ``NaN``, ``Infinity``; repr: ``nan``, ``inf``)."""
    import polars as pl

    value = pl.col(column)
    text = value.cast(pl.String)
    if not fix:
        return text
    small = (text.str.replace(r"^(-?)0\.0000([1-9])$", "${1}${2}e-05")  # repr's exponent form below 1e-4
             .str.replace(r"^(-?)0\.0000([1-9])([0-9]+)$", "${1}${2}.${3}e-05")
             .str.replace(r"e-([1-9])$", "e-0${1}"))
    return (pl.when(value.abs() < 1e-4).then(small).when(value.is_nan()).then(pl.lit(nan))
            .when(value == float("inf")).then(pl.lit(inf)).when(value == float("-inf")).then(pl.lit("-" + inf))
            .otherwise(text))


def _extras(records: list[dict]) -> list[str]:
    """The ``extra`` keys of ``records``, sorted: the CSV's ``extra.KEY`` columns."""
    return sorted({key for r in records for key in r.get("extra", {})})


def _row(record: dict, extras: list[str]) -> list[str]:
    """The CSV cells of a row."""
    extra = record.get("extra", {})
    return [*(_cell(record.get(c)) for c in COLUMNS), *(_cell(extra.get(k)) for k in extras)]


def _csv_text(cells: list[str]) -> str:
    """One CSV row as ``csv.writer`` writes it, without the line end."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(cells)
    return text.getvalue()[:-1]


def _cell(value) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)
