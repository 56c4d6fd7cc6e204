"""Read Megatron-family training logs into records: from a byte offset, from a file's end, or only some fields.

Records and the line grammar are those of :mod:`opskit.logs.grammar` (a plain dict per iteration or validation line;
cut, wrapped or garbled record lines are counted in ``LogChunk.skipped``, never guessed at).

Speed: a read under 16 MiB goes line by line through :func:`opskit.logs.grammar.scan_lines`; a larger one through
:mod:`opskit.logs.bulk`, which builds the common iteration lines' records column-wise with polars and sends every other
line to the same per-line parser (bench/log_parse.py, docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO, TypeVar

from opskit.errors import OpskitError
from opskit.logs.grammar import ITERATION_WORD, iteration_fields, scan_bytes, scan_lines

T = TypeVar("T")


class LogFormatError(OpskitError, ValueError):
    """A log input that cannot be used as asked (no iteration lines where some are needed, a bad range); one line."""


_BLOCK = 8 << 20  # bytes per read: per-read costs vanish, memory stays bounded
_BULK_BLOCK = 16 << 20  # bytes per read on the bulk path: polars reads one block while Python builds the last
_BULK_MIN = 16 << 20  # reads this large go through opskit.logs.bulk (smaller ones do not pay for importing polars)


@dataclass
class LogChunk:
    """What one read gave: records in file order, ``offset`` = byte just after the last complete line read (pass it
    to the next :func:`read_from`), ``skipped`` = iteration/validation lines cut, wrapped or garbled, ``rewound`` =
    the file was shorter than the offset asked for (replaced or truncated), so it was read from its start."""

    records: list[dict] = field(default_factory=list)
    offset: int = 0
    skipped: int = 0
    rewound: bool = False
    lines: int = 0
    """Complete lines read (by :func:`read_from`)."""
    tables: list = field(default_factory=list)
    """``read_from(..., columnar=True)`` of a large read: the common iteration lines' records column-wise, not in
    ``records`` (polars frames: ``slot``, then one column per record key, :class:`opskit.logs.bulk.Columns`)."""
    slots: list[int] | None = None
    """With ``tables``: the slot of each of ``records``; slots give the file order of both."""
    unread: int = 0
    """Bytes after the last complete line, left for the next read (by :func:`read_from`)."""

    @property
    def iterations(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "iteration"]

    def summary(self, name: str) -> str | None:
        """One line for stderr saying what a read of file ``name`` skipped, or None when it gave records and skipped
        nothing: a binary, compressed or unrelated file must not pass for a log with no iterations yet."""
        tail = f"; {self.unread:,} bytes after the last newline not read" if self.unread else ""
        if not self.records and not self.tables:
            if not self.lines and not self.unread:
                return f"{name}: empty, 0 records"
            return f"{name}: 0 records, {self.lines:,} lines skipped (not a training log?){tail}"
        if self.skipped:
            return f"{name}: {self.skipped} iteration/validation line(s) skipped (cut, wrapped or garbled)"
        return None


def _keep(fields: tuple[str, ...] | None) -> frozenset[str] | None:
    """``fields`` -> the keys an iteration record keeps (None: all of them).

    Raises:
        LogFormatError: a name that is not an iteration-line field.
    """
    if fields is None:
        return None
    known = iteration_fields()
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise LogFormatError(f"unknown iteration field(s) {', '.join(unknown)}: expected some of "
                             f"{', '.join(sorted(known))}")
    return frozenset(("kind", "iteration", "train_iters", *fields))


def parse_text(text: str, chunk: LogChunk | None = None, fields: tuple[str, ...] | None = None) -> LogChunk:
    """Records of every line in ``text`` appended to ``chunk`` (a new one when None); ``fields`` as in
    :func:`read_from`.

    Raises:
        LogFormatError: an unknown name in ``fields``.
    """
    chunk = chunk or LogChunk()
    chunk.skipped += scan_lines(text.split("\n"), chunk.records, _keep(fields))
    return chunk


def open_log(path: str | Path) -> BinaryIO:
    """``path`` opened for reading bytes.

    Raises:
        FileNotFoundError: no such file (followers wait for it). LogFormatError: a folder, or not readable.
    """
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LogFormatError(f"{path}: a folder, not a log file") from None
    except OSError as e:
        raise LogFormatError(f"{path}: cannot read: {e.strerror or e}") from None


def _blocks(f: BinaryIO, size: int, chunk: LogChunk | None = None) -> Iterator[bytes]:
    """Blocks of about ``size`` bytes of complete lines from ``f`` (a partial last line is left for the next read);
    ``chunk.offset``, ``lines`` and ``unread``, when given, move past each block as it is handed out. The partial
    line after a block's last newline is read again with the next block (a seek back, not a copy of the block)."""
    carry = b""  # a block without a newline: a line longer than size, joined with what follows
    while block := f.read(size):
        if carry:
            block = carry + block
        end = block.rfind(b"\n") + 1
        if chunk is not None:
            chunk.unread = len(block) - end
        carry = b"" if end else block
        if end:
            f.seek(end - len(block), os.SEEK_CUR)  # the newline lies in what was just read: so does what follows it
            if chunk is not None:
                chunk.offset += end
                chunk.lines += block.count(b"\n", 0, end)
            yield block[:end]


def read_from(path: str | Path, offset: int = 0, fields: tuple[str, ...] | None = None,
              columnar: bool = False) -> LogChunk:
    """Records of the complete lines after byte ``offset``; a partial last line is left for the next call.

    Args:
        offset: where the previous call stopped (``LogChunk.offset``), 0 for the whole file.
        fields: keep only these iteration fields (plus ``kind``, ``iteration``, ``train_iters``; no ``extra``): what
            plots and spike detection over a whole log use.
        columnar: a large read keeps the records that polars builds column-wise, in ``tables`` (no dict each):
            for writers that format columns (``opskit logs parse``).

    Returns:
        A :class:`LogChunk` whose ``offset`` is the byte just after the last complete line. When the file is shorter
        than ``offset`` (replaced by a sync, truncated) it is read from 0 and ``rewound`` is True.

    Raises:
        FileNotFoundError: no such file.
        LogFormatError: a folder or an unreadable file; an unknown name in ``fields``.
    """
    keep = _keep(fields)
    chunk = LogChunk(offset=offset)
    with open_log(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < offset:
            chunk.offset, chunk.rewound = 0, True
        f.seek(chunk.offset)
        if size - chunk.offset >= _BULK_MIN and columnar:
            from opskit.logs.bulk import scan_columns

            columns = scan_columns(_blocks(f, _BULK_BLOCK, chunk), keep)
            chunk.tables, chunk.skipped = columns.tables, chunk.skipped + columns.cut
            chunk.slots, chunk.records = [slot for slot, _ in columns.rest], [record for _, record in columns.rest]
        elif size - chunk.offset >= _BULK_MIN:
            from opskit.logs.bulk import scan_blocks

            chunk.skipped += scan_blocks(_blocks(f, _BULK_BLOCK, chunk), chunk.records, keep)
        else:
            for block in _blocks(f, _BLOCK, chunk):
                chunk.skipped += scan_bytes(block, chunk.records, keep)
    return chunk


def from_end(path: str | Path, attempt: Callable[[str, bool], T | None], start: int = 0) -> tuple[T, int]:
    """Read a file backwards in growing blocks (64 KiB, x4 each time), never before byte ``start`` (a line start),
    until ``attempt(text, at_start)`` returns something; ``text`` holds the complete lines of the block (the block's
    first, possibly partial, line dropped unless the block begins at ``start``). Returns (that result, byte offset
    after the last complete line), the offset being where a follower continues.

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    with open_log(path) as f:
        size = os.fstat(f.fileno()).st_size
        span = 1 << 16
        while True:
            begin = max(start, size - span)
            f.seek(begin)
            data = f.read(size - begin)
            head = data.find(b"\n") + 1 if begin > start else 0
            end = data.rfind(b"\n") + 1
            result = attempt(data[head:max(head, end)].decode("utf-8", errors="replace"), begin == start)
            if result is not None:
                return result, begin + end
            span *= 4


def read_tail(path: str | Path, iterations: int, start: int = 0, fields: tuple[str, ...] | None = None) -> LogChunk:
    """Records near the end of a file, after byte ``start`` (a line start), holding at least ``iterations``
    iteration records (or all there are): a multi-GB log costs a few reads (:func:`from_end`). ``offset`` is where a
    follower continues; ``fields`` as in :func:`read_from`; ``skipped`` counts the cut lines of the part read: all
    that is after ``start`` where that holds too few, else from the line of the ``iterations``-th last iteration
    record (or a little before it, where other lines name an iteration: saves, loads).

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file; an unknown name in ``fields``.
    """
    keep = _keep(fields)

    def parsed(text: str) -> LogChunk:
        chunk = LogChunk()
        chunk.skipped = scan_lines(text.split("\n"), chunk.records, keep)
        return chunk

    def enough(text: str, at_start: bool) -> LogChunk | None:
        if at_start:  # all that is after start
            return parsed(text)
        # Every iteration line holds the word: parse back from the end, each time from the line of the word that
        # could complete the count, each line once (the block grew 4x: most of it need not be parsed).
        pieces, end, missing = [], len(text), iterations
        while missing > 0:
            begin = _line_of_last(text, ITERATION_WORD, missing, end)
            if begin is None:
                return None  # too few iteration lines: a larger block
            pieces.append(parsed(text[begin:end]))
            missing, end = missing - len(pieces[-1].iterations), begin
        return LogChunk(records=[r for piece in reversed(pieces) for r in piece.records],
                        skipped=sum(piece.skipped for piece in pieces))

    chunk, offset = from_end(path, enough, start)
    chunk.offset = offset
    return chunk


def _line_of_last(text: str, word: str, n: int, end: int) -> int | None:
    """Where the line begins that holds the ``n``-th last ``word`` of ``text[:end]`` (``n`` >= 1); None when there
    are fewer."""
    at = end
    for _ in range(n):
        at = text.rfind(word, 0, at)
        if at < 0:
            return None
    return text.rfind("\n", 0, at) + 1


def first_iteration(path: str | Path) -> dict | None:
    """The first iteration record of a file, reading only as far as it (None when there is none).

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    with open_log(path) as f:
        for block in _blocks(f, 1 << 16):
            chunk = LogChunk()
            chunk.skipped += scan_bytes(block, chunk.records, None)
            if chunk.iterations:
                return chunk.iterations[0]
    return None


def split_segments(records: list[dict]) -> list[list[dict]]:
    """Split at restarts: a new segment begins where the iteration goes back (<= the previous one), as when a job
    chain resumes from an earlier checkpoint. Validation records stay in the segment they were printed in."""
    segments: list[list[dict]] = [[]]
    previous = None
    for record in records:
        if record["kind"] == "iteration":
            if previous is not None and record["iteration"] <= previous:
                segments.append([])
            previous = record["iteration"]
        segments[-1].append(record)
    return [s for s in segments if s]


def timeline(records: list[dict]) -> list[dict]:
    """The training as it stands: iteration records of the last segment that ran each iteration, in iteration
    order (what a restart re-ran replaces what it had run before)."""
    its = [r for r in records if r["kind"] == "iteration"]
    return [r for start, stop in latest_runs([r["iteration"] for r in its]) for r in its[start:stop]]


def latest_runs(iterations: Sequence[int]) -> list[tuple[int, int]]:
    """The index ranges [start, stop) of ``iterations`` (the iteration records' numbers, in file order) that
    :func:`timeline` keeps, in order: segments split as :func:`split_segments` splits them (a restart: the iteration
    goes back), each cut before the first iteration of any later segment (what the resume re-ran replaces)."""
    if not len(iterations):
        return []
    starts = [0, *restart_indices(iterations)]
    kept, first_later = [], None  # first_later: the lowest first iteration of the segments after the one looked at
    for start, end in reversed(list(zip(starts, [*starts[1:], len(iterations)], strict=True))):
        # iterations rise within a segment: the kept records are a prefix of it
        stop = end if first_later is None else bisect.bisect_left(iterations, first_later, start, end)
        kept.append((start, stop))
        first_later = iterations[start] if first_later is None else min(first_later, iterations[start])
    return [(start, stop) for start, stop in reversed(kept) if stop > start]


def restart_indices(iterations: Sequence[int]) -> list[int]:
    """The indices where the iteration goes back (<= the one before: :func:`split_segments`' restart rule), for the
    iteration records' numbers in file order: at once for a numpy array (a large log's), one pair at a time
    otherwise."""
    if hasattr(iterations, "dtype"):
        import numpy as np

        return (np.flatnonzero(np.diff(iterations) <= 0) + 1).tolist()
    return [i for i, (before, after) in enumerate(pairwise(iterations), 1) if after <= before]


def as_list(column: Sequence) -> list:
    """A column of :func:`timeline_columns` (a list, a polars Series) or a numpy array as a list of Python values."""
    if isinstance(column, list):
        return column
    return column.to_list() if hasattr(column, "to_list") else column.tolist()


def python_value(value):
    """A numpy scalar (an element of a column's array) as the Python number it holds; other values as they are."""
    return value.item() if hasattr(value, "item") else value


def record_columns(records: list[dict], keys: Sequence[str], value: Callable[[dict, str], object] = dict.get
                   ) -> dict[str, list]:
    """``records`` column-wise: {key: [value(record, key) for each record]} for ``iteration`` and each of ``keys``
    (``value`` returns None where a record lacks the key)."""
    return {key: [value(r, key) for r in records] for key in dict.fromkeys(("iteration", *keys))}


def timeline_columns(chunk: LogChunk, keys: Sequence[str], value: Callable[[dict, str], object] = dict.get
                     ) -> dict[str, Sequence]:
    """:func:`timeline` of all of ``chunk``'s records (``tables`` included), column-wise: as :func:`record_columns`
    gives it (lists) for a chunk of records only; for a read kept columnar (``read_from(..., columnar=True)``) the
    same values as polars Series (null for None), which never become one dict or one Python object per record
    (issue 19: plot and spikes on a 176B run's log). A key none of the tables holds is null in their rows; ``value``
    reads the records built one by one."""
    if not chunk.tables:
        return record_columns(timeline(chunk.records), keys, value)
    import polars as pl

    keys = list(dict.fromkeys(("iteration", *keys)))
    rest = [(slot, r) for slot, r in zip(chunk.slots, chunk.records, strict=True) if r["kind"] == "iteration"]
    parts = [pl.DataFrame({"slot": [slot for slot, _ in rest],
                           **{key: [value(r, key) for _, r in rest] for key in keys}}, strict=False)]
    parts += [table.select("slot", *(key for key in keys if key in table.columns)) for table in chunk.tables]
    frame = pl.concat(parts, how="diagonal_relaxed").sort("slot")
    frame = frame.with_columns(pl.lit(None).alias(key) for key in keys if key not in frame.columns)
    runs = latest_runs(frame["iteration"].to_numpy())
    frame = pl.concat([frame.slice(start, stop - start) for start, stop in runs]) if runs else frame.clear()
    return {key: frame[key] for key in keys}
