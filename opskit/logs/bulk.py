"""The bulk path of :func:`opskit.logs.parse.read_from`: a large block of a log parsed column-wise by polars.

The line grammar (:mod:`opskit.logs.grammar`) holds the rules; this path only builds the records that it can build
exactly as the grammar's per-line parser would, for the common iteration line: a header ``iteration N/ M`` (ASCII
digits and spaces, one ``iteration ``, no `` loss at ``) before the first ``|``, then `` name: value |`` fields of
known names laid out as in one of the block's first few lines, values that polars reads as numbers (a subset of what
``int``/``float`` accept), nothing but blanks after the last ``|``. Every other candidate line (validation lines, cut,
odd or unknown-field lines) goes through ``grammar.parse_record`` and the records are merged back in file order.
tests/test_logs_bulk.py checks that both paths give the same records, key order included.

Why: building every-field records line by line costs ~6.7 us per iteration line in CPython
(docs/benchmarks.md#log-commands-on-a-large-log); polars cuts the fields out and converts them in compiled code, Python
only builds the dicts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat

import polars as pl

from opskit.logs.grammar import (
    CUT,
    FIELDS,
    ITERATION_WORD,
    LABEL_DIGITS,
    VALIDATION_WORDS,
    keep_only,
    milliseconds,
    parse_record,
    scan_bytes,
    seconds,
)

_HEADER = ITERATION_WORD + r" *([0-9]+)/ *([0-9]+) *$"  # ASCII digits: read as int() reads them
_LABEL = rf"^ *([0-9]{{1,{LABEL_DIGITS}}}): "  # grammar.srun_label's rule
_END = "~"  # every line gets "|~" appended: a whole line then has an empty field before it, a cut one does not
_LAYOUTS = 4  # layouts tried per block; lines of further layouts go through parse_record
_WIDTH = 20  # columns read: 2022's iteration line has 14 fields; longer lines fail every layout and go to parse_record
# blocks polars reads at once while the caller uses one: one left cores idle
# (docs/benchmarks.md#log-commands-on-a-large-log)
_AHEAD = 2
_SPACES = " \t\r"  # what may follow the last "|" (a subset of str.isspace, which the per-line parser uses)


def scan_blocks(blocks: Iterable[bytes], records: list, keep: frozenset[str] | None) -> int:
    """Append the records of ``blocks`` (each complete lines, UTF-8 with any bad bytes) to ``records`` in file order,
    as ``grammar.scan_bytes`` would, and return how many record lines were cut; ``keep`` as in ``grammar.keep_only``.
    Polars works on the next block in a second thread (it releases the GIL) while this one builds the records of the
    current block."""
    return sum(_finish(data, block, records, keep) for data, block in _read_ahead(blocks))


@dataclass
class Columns:
    """:func:`scan_columns`' result: the records of some blocks in file order, ``tables`` column-wise and the others
    as dicts. ``tables``: iteration records (``kind`` is ``iteration``), a frame each: ``slot``, then one column per
    record key in the record's order (``rank`` first in a table of labelled lines, absent from one of unlabelled
    lines); ``rest``: (slot, record) built by the per-line parser, in file order; ``cut``:
    record lines cut. Slots order all records of the blocks (with gaps)."""

    tables: list[pl.DataFrame]
    rest: list[tuple[int, dict]]
    cut: int = 0


def scan_columns(blocks: Iterable[bytes], keep: frozenset[str] | None) -> Columns:
    """The records of ``blocks`` as :func:`scan_blocks` reads them (``keep`` likewise), kept column-wise where polars
    built them: what a writer that formats columns needs (``opskit logs parse``), without one dict per record."""
    columns, base = Columns([], []), 0
    for data, block in _read_ahead(blocks):
        if block is None:  # polars split the lines differently: the per-line parser reads the whole block
            records: list = []
            columns.cut += scan_bytes(data, records, keep)
            columns.rest += zip(range(base, base + len(records)), records, strict=True)
            base += len(records)
            continue
        for names, table in block.layouts:
            columns.tables.append(pl.concat([(table["slot"] + base).to_frame(), _values(table, names, keep)],
                                            how="horizontal"))
        for slot, line in zip(block.rest["slot"], _texts(block.rest, data), strict=True):
            record = parse_record(line)
            if record is CUT:
                columns.cut += 1
            elif record is not None:
                columns.rest.append((base + slot, keep_only(record, keep)))
        base += block.rest.height + sum(table.height for _, table in block.layouts)
    return columns


def _read_ahead(blocks: Iterable[bytes]) -> Iterator[tuple[bytes, _Block | None]]:
    """:func:`_columns` of each block, polars reading blocks k+1 .. k+_AHEAD in other threads while the caller uses
    block k (each holds a block and its frames: ~80 MB more peak memory per block ahead on the 1M-line log)."""
    with ThreadPoolExecutor(max_workers=_AHEAD) as pool:
        ahead: deque = deque()
        for data in blocks:
            ahead.append(pool.submit(_columns, data))
            if len(ahead) > _AHEAD:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


@dataclass
class _Block:
    """What polars found among a block's candidate lines (`` loss at `` or ``iteration `` before the first ``|``;
    ``slot`` = their order): ``layouts`` = [(names, table of ``slot``, ``rank`` (labelled lines only), ``iteration``,
    ``train_iters``, ``vJ`` values)] of the lines whose records are built from columns (a layout's labelled and
    unlabelled lines in separate tables: their records have different keys), ``rest`` = the others (``slot``,
    ``line`` = line number in the block, fields ``cJ``), for the per-line parser."""

    layouts: list[tuple[list[str], pl.DataFrame]]
    rest: pl.DataFrame


def _columns(data: bytes) -> tuple[bytes, _Block | None]:
    """(``data``, what polars read of it; None when polars splits its lines differently from ``bytes.split``)."""
    columns = [f"c{j}" for j in range(_WIDTH)]
    marked = data.replace(b"\n", b"|" + _END.encode() + b"\n")
    frame = pl.read_csv(marked, has_header=False, separator="|", quote_char=None,
                        schema=dict.fromkeys(columns, pl.String), encoding="utf8-lossy", truncate_ragged_lines=True,
                        missing_columns="insert", extra_columns="ignore")
    if frame.height != (len(marked) - len(data)) // (len(_END) + 1):  # the lines, counted by the replace
        return data, None
    head = pl.col("c0")  # the text before the first "|": all that decides whether a line is a record line
    lines = (frame.lazy().with_row_index("line")
             .filter(head.str.contains(ITERATION_WORD, literal=True)
                     | head.str.contains(VALIDATION_WORDS, literal=True))
             .with_row_index("slot").with_columns(*_header(), _rank()).collect())
    # pending: lines whose header is read; the first layout meets them among all candidate lines (no copy of their
    # strings), later layouts only the lines left over
    pending, eligible = lines, lines["iteration"].is_not_null() & lines["train_iters"].is_not_null()
    taken = pl.repeat(False, lines.height, eager=True)
    layouts = []
    for _ in range(_LAYOUTS):
        if not eligible.any():
            break
        first = eligible.arg_true()[0]
        names = _layout(pending.row(first, named=True))  # the first pending line defines the next layout
        if names:
            values = [f"v{j}" for j in range(1, len(names) + 1)]
            table = (pending.lazy().with_columns(_value(j, name).alias(f"v{j}") for j, name in enumerate(names, 1))
                     .select((_matching(names) & pl.lit(eligible)).fill_null(False).alias("ok"), "slot", "rank",
                             "iteration", "train_iters", *values).collect())
            matched = table.filter("ok").drop("ok")
            labelled = matched.filter(pl.col("rank").is_not_null())
            unlabelled = matched.filter(pl.col("rank").is_null()).drop("rank")
            layouts += [(names, part) for part in (labelled, unlabelled) if part.height]
            taken = taken.scatter(matched["slot"], True)
            eligible = eligible & ~table["ok"]
        pending = pending.filter(eligible.scatter(first, False))  # done with the line that defined the layout
        eligible = pl.repeat(True, pending.height, eager=True)
    return data, _Block(layouts, lines.filter(~taken))


def _finish(data: bytes, block: _Block | None, records: list, keep: frozenset[str] | None) -> int:
    """Append the records of a block that :func:`_columns` read, the odd lines through ``parse_record``; returns how
    many were cut."""
    if block is None:
        return scan_bytes(data, records, keep)
    slots: list = [None] * (block.rest.height + sum(table.height for _, table in block.layouts))
    for names, table in block.layouts:
        list(map(slots.__setitem__, *_records(table, names, keep)))
    for slot, line in zip(block.rest["slot"], _texts(block.rest, data), strict=True):
        slots[slot] = keep_only(parse_record(line), keep)
    records.extend(slot for slot in slots if slot is not None and slot is not CUT)
    return slots.count(CUT)


def _texts(frame: pl.DataFrame, data: bytes) -> list[str]:
    """The lines of ``frame``'s rows as the per-line parser reads them: joined back from their fields, or cut out of
    ``data`` when that could differ (a line with more fields than the columns, a bad byte that polars' decoding and
    Python's ``errors="replace"`` might spell differently)."""
    texts = []
    for row in frame.select(pl.col(f"c{j}") for j in range(_WIDTH)).rows():
        end = max(j for j, cell in enumerate(row) if cell is not None)
        if end == _WIDTH - 1 or row[end] != _END:
            break
        texts.append("|".join(cell or "" for cell in row[:end]))
    else:
        if not any("\ufffd" in text for text in texts):
            return texts
    lines = data.split(b"\n")
    return [lines[i].decode("utf-8", errors="replace") for i in frame["line"]]


def _header() -> tuple[pl.Expr, pl.Expr]:
    """``iteration`` and ``train_iters`` (Int64) of a header that the per-line parser reads the same way; null
    otherwise."""
    head = pl.col("c0")
    numbers = head.str.extract_groups(_HEADER)
    plain = ((head.str.count_matches(ITERATION_WORD, literal=True) == 1)
             & ~head.str.contains(VALIDATION_WORDS, literal=True))
    return tuple(pl.when(plain).then(numbers.struct.field(group).cast(pl.Int64, strict=False)).alias(key)
                 for group, key in (("1", "iteration"), ("2", "train_iters")))


def _rank() -> pl.Expr:
    """``rank``: srun's label as ``grammar.srun_label`` reads it (Int64; null on an unlabelled line)."""
    return pl.col("c0").str.extract(_LABEL, 1).cast(pl.Int64).alias("rank")


def _layout(row: dict) -> list[str] | None:
    """The field names (text before ``:``, leading space kept) of a row, when all are known and none repeats."""
    names = []
    for j in range(1, _WIDTH):
        cell = row[f"c{j}"]
        if cell is None:
            break
        name, sep, _ = cell.partition(":")
        if not sep or name not in FIELDS:
            return None
        names.append(name)
    keys = [FIELDS[name][0] for name in names]
    return names if names and len(set(keys)) == len(keys) else None


def _matching(names: list[str]) -> pl.Expr:
    """Rows that are ``names``' fields, an empty (or blank) field and the ``~`` marker, every value (column ``vJ``,
    :func:`_value`) a number."""
    end = len(names) + 1
    tail = [pl.col(f"c{j}").is_null() for j in range(end + 2, _WIDTH)]
    blank = pl.col(f"c{end}").is_null() | (pl.col(f"c{end}").str.strip_chars(_SPACES) == "")
    return pl.all_horizontal(
        *(pl.col(f"c{j}").str.starts_with(name + ":") for j, name in enumerate(names, 1)),
        *(pl.col(f"v{j}").is_not_null() for j in range(1, len(names) + 1)),
        blank, pl.col(f"c{end + 1}") == _END, *tail)


def _value(j: int, name: str) -> pl.Expr:
    """Column ``j``'s value as the per-line parser's converter gives it (null where polars cannot read it)."""
    convert = FIELDS[name][1]
    text = pl.col(f"c{j}").str.slice(len(name) + 1).str.strip_chars(" ")
    return text.cast(pl.Int64 if convert is int else pl.Float64, strict=False)


def _values(frame: pl.DataFrame, names: list[str], keep: frozenset[str] | None) -> pl.DataFrame:
    """``rank`` (in a table of labelled lines), ``iteration``, ``train_iters`` and the values of rows with the layout
    ``names`` (columns ``vJ``) that ``keep`` keeps, as the per-line parser's converters give them, in columns named by
    their record keys."""
    fields = [(j, name) for j, name in enumerate(names, 1) if keep is None or FIELDS[name][0] in keep]
    values = [pl.col(f"v{j}").map_elements(seconds, return_dtype=pl.Float64) if FIELDS[name][1] is milliseconds
              else pl.col(f"v{j}") for j, name in fields]
    rank = ["rank"] if "rank" in frame.columns else []
    return frame.select(*rank, "iteration", "train_iters", *(value.alias(FIELDS[name][0]) for value, (_, name) in
                                                             zip(values, fields, strict=True)))


def _records(frame: pl.DataFrame, names: list[str], keep: frozenset[str] | None) -> tuple[list[int], list[dict]]:
    """(slots, records) of rows that all have the layout ``names`` and its values in columns ``vJ``."""
    table = _values(frame, names, keep)
    keys = ("kind", *table.columns)
    rows = zip(repeat("iteration"), *(series.to_list() for series in table))  # per column: cheaper than rows()
    records = list(map(dict.copy, repeat(dict.fromkeys(keys), table.height)))  # presized: no resizing per record
    deque(map(dict.update, records, map(zip, repeat(keys), rows)), maxlen=0)
    return frame["slot"].to_list(), records
