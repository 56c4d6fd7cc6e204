"""Records out as JSON lines or CSV (``opskit logs parse``).

:func:`write_files` writes what :func:`write_jsonl` / :func:`write_csv` write for the rows ``{"file", "segment",
**record}`` of each file, byte for byte; the records a large read kept column-wise (``read_from(..., columnar=True)``)
are formatted by polars, one ``concat_str`` per table and segment, and written as bytes, never as one dict and one
``json.dumps`` each (a 1M-line log costs ~0.6 CPU s instead of ~7 s; docs/benchmarks.md#log-commands-on-a-large-log).
tests/test_logs_export.py holds both ways equal. polars is imported inside the functions that format such columns:
a small log's records are written without it.
"""

from __future__ import annotations

import bisect
import codecs
import csv
import io
import json
import math
from typing import TextIO

from opskit.logs.parse import UNLABELLED, LogChunk, restart_indices, split_segments

# CSV columns in this order (``rank`` after ``kind`` where some record has one: :func:`columns`), then ``extra.KEY``
# for every unknown field met.
COLUMNS = ("file", "segment", "kind", "iteration", "train_iters", "consumed_samples", "consumed_tokens",
           "elapsed_time_per_iteration_s", "learning_rate", "global_batch_size", "lm_loss", "loss_scale", "grad_norm",
           "num_zeros", "params_norm", "curriculum_seqlen", "skipped_iterations", "nan_iterations",
           "samples_per_second", "tflops", "dataset", "where", "validation_lm_loss", "validation_ppl")
_SLICE = 1 << 16  # lines per write of the columnar path


def write_jsonl(records: list[dict], out: TextIO) -> None:
    """One JSON object per line (NaN written as JSON's non-standard ``NaN``, as Python's json does)."""
    for record in records:
        out.write(json.dumps(record) + "\n")


def columns(ranked: bool) -> tuple[str, ...]:
    """The CSV's columns before any ``extra.KEY``: :data:`COLUMNS`, with ``rank`` after ``kind`` when ``ranked`` (some
    record has srun's label: a multi-node job's log), so that an unlabelled log's CSV has no such column."""
    return (*COLUMNS[:3], "rank", *COLUMNS[3:]) if ranked else COLUMNS


def write_csv(records: list[dict], out: TextIO) -> None:
    """A header and one row per record; empty cells for fields a record lacks."""
    extras, names = _extras(records), columns(any("rank" in r for r in records))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*names, *(f"extra.{key}" for key in extras)])
    for r in records:
        writer.writerow(_row(r, extras, names))


def write_files(files: list[tuple[str, LogChunk]], output_format: str, out: TextIO) -> None:
    """The records of each (file name, chunk read from its start) as rows ``{"file": name, "segment": N, **record}``
    (N counts restarts: :func:`opskit.logs.parse.split_segments`), in ``output_format`` ``jsonl`` or ``csv``."""
    if not any(chunk.tables for _, chunk in files):
        rows = [{"file": name, "segment": segment, **r} for name, chunk in files
                for segment, records in enumerate(split_segments(chunk.records)) for r in records]
        (write_jsonl if output_format == "jsonl" else write_csv)(rows, out)
        return
    extras = _extras([r for _, chunk in files for r in chunk.records])  # column-wise records have no extra
    names = columns(any("rank" in r for _, chunk in files for r in chunk.records)
                    or any("rank" in table.columns for _, chunk in files for table in chunk.tables))
    if output_format == "csv":
        out.write(_csv_text([*names, *(f"extra.{key}" for key in extras)]) + "\n")
    for name, chunk in files:
        _write_lines(_columnar_lines(name, chunk, output_format, extras, names), out)


def _write_lines(lines, out: TextIO) -> None:
    """``lines`` (a polars Series of str), each followed by ``\\n``: straight from polars as UTF-8 bytes to a UTF-8
    stream's buffer (no Python str of the whole text, no encoding pass), else through ``out.write``."""
    import polars as pl

    buffer = getattr(out, "buffer", None)
    if buffer is not None and codecs.lookup(getattr(out, "encoding", None) or "ascii").name == "utf-8":
        out.flush()
        pl.DataFrame({"line": lines}).write_csv(buffer, include_header=False, quote_style="never")
        return
    for start in range(0, len(lines), _SLICE):
        out.write(lines.slice(start, _SLICE).str.join("\n").item() + "\n")


def _columnar_lines(name: str, chunk: LogChunk, output_format: str, extras: list[str], names: tuple[str, ...]):
    """The output lines of one file's records in file order (a polars Series). Segments are counted first, over the
    iteration numbers alone, as :func:`opskit.logs.parse.split_segments` counts them (``_restarts``); then each line
    is formatted whole: ``records`` in Python, as :func:`write_jsonl` / :func:`write_csv` do, each table by polars,
    one ``concat_str`` per part of it that lies in one segment (``names``: the CSV's columns, :func:`columns`)."""
    import polars as pl

    jsonl = output_format == "jsonl"
    slots = chunk.slots if chunk.slots is not None else range(len(chunk.records))
    restarts = _restarts(chunk, slots)
    head = f'{{"file": {json.dumps(name)}, "segment": ' if jsonl else _csv_text([name]) + ","
    rest = pl.DataFrame({"slot": slots,
                         "line": [f"{head}{bisect.bisect_right(restarts, slot)}"
                                  + (", " + json.dumps(r)[1:] if jsonl else "," + _csv_text(_row(r, extras, names)[2:]))
                                  for slot, r in zip(slots, chunk.records, strict=True)]},
                        schema={"slot": pl.Int64, "line": pl.String})
    parts = [rest.lazy()]
    for table in (table for table in chunk.tables if table.height):
        floats = {key: _odd_floats(table[key], jsonl) if dtype == pl.Float64 else None
                  for key, dtype in table.schema.items() if key != "slot"}
        slot = pl.col("slot").cast(pl.Int64)
        first, last = table["slot"].min(), table["slot"].max()
        for segment in range(bisect.bisect_right(restarts, first), bisect.bisect_right(restarts, last) + 1):
            start, stop = ([None, *restarts][segment], [*restarts, None][segment])
            inside = [slot >= start] if start is not None and start > first else []
            inside += [slot < stop] if stop is not None and stop <= last else []
            part = table.lazy().filter(*inside) if inside else table.lazy()
            line = (_jsonl_line if jsonl else _csv_line)(f"{head}{segment}", floats, len(extras), names)
            parts.append(part.select(slot, line.alias("line")))
    return pl.concat(parts).sort("slot").collect()["line"]  # one query: polars formats the tables side by side


def _restarts(chunk: LogChunk, slots) -> list[int]:
    """The slots, in order, of the iteration records that begin a new segment
    (:func:`opskit.logs.parse.split_segments`' rule, over the iteration numbers and ranks alone)."""
    import polars as pl

    schema = {"slot": pl.Int64, "rank": pl.Int64, "iteration": pl.Int64}
    rest = [(slot, r.get("rank"), r["iteration"]) for slot, r in zip(slots, chunk.records, strict=True)
            if r["kind"] == "iteration"]
    order = pl.concat([pl.DataFrame(rest, schema=schema, orient="row"),
                       *(table.select(key for key in schema if key in table.columns) for table in chunk.tables)],
                      how="diagonal_relaxed").sort("slot")  # a table of unlabelled lines: null ranks
    ranks = order["rank"].fill_null(UNLABELLED).to_numpy()
    return order["slot"].gather(restart_indices(order["iteration"].to_numpy(), ranks)).to_list()


def _jsonl_line(head: str, floats: dict, extras: int, names: tuple[str, ...]):
    """``json.dumps`` of the rows of an iteration table, ``head`` (``{"file": ..., "segment": N``) first
    (``floats``: each key of the record's order -> None for an integer column, else :func:`_odd_floats`; ``extras``
    and ``names`` unused: the signature of :func:`_csv_line`)."""
    pieces: list = [f'{head}, "kind": "iteration"']
    for key, odd in floats.items():
        pieces[-1] += f", {json.dumps(key)}: "
        pieces += [_number_text(key, odd), ""]
    pieces[-1] += "}"
    return _concat(pieces)


def _csv_line(head: str, floats: dict, extras: int, names: tuple[str, ...]):
    """:func:`write_csv`'s row of the rows of an iteration table, ``head`` (file and segment cells) first: every
    column of ``names``, then ``extras`` empty cells."""
    pieces: list = [head + ",iteration"]
    for column in names[3:]:
        pieces[-1] += ","
        if column in floats:
            pieces += [_number_text(column, floats[column]), ""]
    pieces[-1] += "," * extras
    return _concat(pieces)


def _concat(pieces: list):
    """One string expression of ``pieces``: texts (as literals; empty ones dropped) and string expressions."""
    import polars as pl

    return pl.concat_str([pl.lit(p) if isinstance(p, str) else p for p in pieces if not isinstance(p, str) or p])


def _odd_floats(values, jsonl: bool) -> dict[float, str] | None:
    """The values of a float column that polars writes otherwise than ``json.dumps`` (``jsonl``) / ``repr``, each with
    its text: below 1e-4 (polars: ``0.00005969`` for ``5.969e-05``, ``3e-7`` for ``3e-07``) and not finite (``NaN``,
    ``inf``); None when there are none. Every other float polars writes with the same shortest round-trip digits."""
    odd = values.filter(((values.abs() < 1e-4) & (values != 0)) | ~values.is_finite()).unique()
    if odd.is_empty():
        return None
    spell = json.dumps if jsonl else repr  # json.dumps writes a finite float as repr does: the cheaper call
    return {value: repr(value) if math.isfinite(value) else spell(value) for value in odd.to_list()}


def _number_text(column: str, odd: dict[float, str] | None):
    """Column ``column`` as ``str`` (integers: ``odd`` None) or ``json.dumps`` / ``repr`` (floats) writes each value
    (``odd``: :func:`_odd_floats`)."""
    import polars as pl

    value = pl.col(column)
    text = value.cast(pl.String)
    if not odd:
        return text
    nan = next((text for number, text in odd.items() if math.isnan(number)), None)
    small = {number: text for number, text in odd.items() if not math.isnan(number)}
    if small:
        text = value.replace_strict(list(small), list(small.values()), default=text, return_dtype=pl.String)
    return text if nan is None else pl.when(value.is_nan()).then(pl.lit(nan)).otherwise(text)


def _extras(records: list[dict]) -> list[str]:
    """The ``extra`` keys of ``records``, sorted: the CSV's ``extra.KEY`` columns."""
    return sorted({key for r in records for key in r.get("extra", {})})


def _row(record: dict, extras: list[str], names: tuple[str, ...]) -> list[str]:
    """The CSV cells of a row (``names``: the columns before the extras)."""
    extra = record.get("extra", {})
    return [*(_cell(record.get(c)) for c in names), *(_cell(extra.get(k)) for k in extras)]


def _csv_text(cells: list[str]) -> str:
    """One CSV row as ``csv.writer`` writes it, without the line end."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(cells)
    return text.getvalue()[:-1]


def _cell(value) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)
