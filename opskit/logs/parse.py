"""Read Megatron-family training logs into records: from a byte offset, from a file's end, or only some fields.

Records and the line grammar are those of :mod:`opskit.logs.grammar` (a plain dict per iteration or validation line;
cut, wrapped or garbled record lines are counted in ``LogChunk.skipped``, never guessed at).

Speed: a read under 16 MiB goes line by line through :func:`opskit.logs.grammar.scan_lines`; a larger one through
:mod:`opskit.logs.bulk`, which builds the common iteration lines' records column-wise with polars and sends every other
line to the same per-line parser (bench/log_parse.py, docs/benchmarks.md#log-commands-on-a-large-log). That module,
polars and numpy are imported inside the functions that need them (a large read, its columns, records of several
printing ranks): a small log's read imports none of them.

Bounds, on any input: files are read in blocks (8 MiB, 16 MiB on the bulk path, backwards from 64 KiB growing to
8 MiB), never whole, and a line longer than :data:`MAX_LINE` (1 MiB) is garbage (no Megatron line is near it: a sparse
hole, binary data): it is dropped, unread past the cap, and counted in ``LogChunk.long_lines``; the lines after it are
read as usual. So every reader here holds at most a few blocks plus the records asked for (the bulk path: a few
blocks ahead, ~80 MB each), and its time is linear in the bytes it reads. A ``.gz`` file is read through a
decompressed temporary copy (:func:`open_log`).
"""

from __future__ import annotations

import bisect
import gzip
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO, TypeVar

from opskit.errors import OpskitError
from opskit.fsutil import MAX_LINE, UnreadableFileError, open_regular
from opskit.logs.grammar import ITERATION_WORD, iteration_fields, scan_bytes, scan_lines

T = TypeVar("T")


class LogFormatError(OpskitError, ValueError):
    """A log input that cannot be used as asked (no iteration lines where some are needed, a bad range); one line."""


_BLOCK = 8 << 20  # bytes per read: per-read costs vanish, memory stays bounded
_BULK_BLOCK = 16 << 20  # bytes per read on the bulk path: polars reads one block while Python builds the last
_BULK_MIN = 16 << 20  # reads this large go through opskit.logs.bulk (smaller ones do not pay for importing polars)
_FIRST_BACK = 64 << 10  # the first block read from a file's end: what `logs show` and `status` usually need
_GZIP_MAGIC = b"\x1f\x8b"
UNLABELLED = -1
"""The rank of an unlabelled record in a numpy array of ranks (srun's labels are >= 0)."""


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
    long_lines: int = 0
    """Lines longer than :data:`MAX_LINE`, dropped unparsed (counted in ``lines`` too)."""

    @property
    def iterations(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "iteration"]

    def summary(self, name: str) -> str | None:
        """One line for stderr saying what a read of file ``name`` skipped, or None when it gave records and skipped
        nothing: a binary, compressed or unrelated file must not pass for a log with no iterations yet."""
        tail = f"; {self.unread:,} bytes after the last newline not read" if self.unread else ""
        long = (f"{self.long_lines:,} line(s) longer than {MAX_LINE >> 20} MiB skipped (no newline for that long: a "
                "sparse hole or binary data?)" if self.long_lines else "")
        if not self.records and not self.tables:
            if not self.lines and not self.unread:
                return f"{name}: empty, 0 records"
            return f"{name}: 0 records, {self.lines:,} lines skipped (not a training log?){tail}" + \
                (f"; {long}" if long else "")
        said = [f"{self.skipped} iteration/validation line(s) skipped (cut, wrapped or garbled)"] * bool(self.skipped)
        said += [long] * bool(long)
        return f"{name}: {'; '.join(said)}" if said else None


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
    return frozenset(("kind", "rank", "iteration", "train_iters", *fields))


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
    """``path`` opened for reading bytes; a gzip file (a ``.gz`` name and gzip's magic bytes: ``main_log.txt.gz``)
    as its decompressed bytes, in an unnamed temporary file (disk: the decompressed size; time: linear), so that
    offsets, sizes and reads from the end mean the same as for a plain log.

    Raises:
        FileNotFoundError: no such file (followers wait for it). LogFormatError: a folder or another file that is not
            regular (a device such as ``/dev/zero`` would never end: :func:`opskit.fsutil.open_regular`), not
            readable, or a corrupt or truncated gzip file.
    """
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except UnreadableFileError as e:
        raise LogFormatError(f"{path}: {e.strerror.replace('a folder, not a regular file', 'a folder, not a log file')}"
                             ) from None
    except OSError as e:
        raise LogFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    # Only a .gz name: a log still being written (main_log.txt, read from offsets) is never decompressed.
    if not str(path).endswith(".gz") or f.read(len(_GZIP_MAGIC)) != _GZIP_MAGIC:
        f.seek(0)
        return f
    with f:
        return _decompressed(f, path)


def _decompressed(f: BinaryIO, path: str | Path) -> BinaryIO:
    """The gzip stream ``f`` decompressed into an unnamed temporary file, at its start.

    Raises:
        LogFormatError: corrupt or truncated gzip data; no room for the copy.
    """
    copy = tempfile.TemporaryFile()
    try:
        f.seek(0)
        with gzip.GzipFile(fileobj=f, mode="rb") as stream:
            shutil.copyfileobj(stream, copy, _BLOCK)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        copy.close()
        why = "truncated" if isinstance(e, EOFError) else (getattr(e, "strerror", None) or str(e))
        raise LogFormatError(f"{path}: gzip: cannot decompress ({why})") from None
    copy.seek(0)
    return copy


def line_blocks(f: BinaryIO, size: int, chunk: LogChunk | None = None) -> Iterator[bytes]:
    """Blocks of about ``size`` bytes of complete lines from ``f``'s position on (a partial last line is left for the
    next read); a line longer than :data:`MAX_LINE` is dropped from them (read only up to the cap, then searched for
    its end). ``chunk.offset`` (``f``'s starting position), ``lines``, ``long_lines`` and ``unread``, when given,
    move past each block as it is handed out. The partial line after a block's last newline is read again with the
    next block (a seek back, not a copy of the block). Memory: one block (a read grows to MAX_LINE + 1 bytes at most
    to tell a long line); time: linear."""
    chunk = chunk if chunk is not None else LogChunk(offset=f.tell())
    want = size
    while True:
        at = f.tell()
        block = f.read(want)
        if not block:
            return
        end = block.rfind(b"\n") + 1
        if not end:  # no line ends in this block
            if len(block) > MAX_LINE:  # garbage: skipped up to its newline, never held whole
                after = _newline_after(f)
                if after is None:  # it runs to the end of the file: the partial last line
                    chunk.unread = f.tell() - chunk.offset
                    return
                chunk.offset, chunk.unread = after, 0
                chunk.lines += 1
                chunk.long_lines += 1
                f.seek(after)
                want = size
            elif len(block) < want:  # the file's partial last line
                chunk.unread = len(block)
                return
            else:  # a line longer than this read: read again, larger, until it ends or passes the cap
                f.seek(at)
                want = min(want * 4, max(size, MAX_LINE + 1))
            continue
        f.seek(at + end)  # the newline lies in what was just read: so does what follows it
        data, long = _without_long_lines(block[:end])
        chunk.offset, chunk.unread = at + end, len(block) - end
        chunk.lines += block.count(b"\n", 0, end)
        chunk.long_lines += long
        want = size
        yield data


def _newline_after(f: BinaryIO) -> int | None:
    """The position just after the first newline at or after ``f``'s position (read in blocks), None at the end of
    the file (``f`` is left there)."""
    while block := f.read(_BLOCK):
        if (found := block.find(b"\n")) >= 0:
            return f.tell() - len(block) + found + 1
    return None


def _line_start_before(f: BinaryIO, pos: int, start: int) -> int:
    """Just after the last newline in ``[start, pos)``, else ``start``: where the (partial) line that ends at ``pos``
    begins (read backwards in blocks from 64 KiB growing to 8 MiB)."""
    span = _FIRST_BACK
    while pos > start:
        begin = max(start, pos - span)
        f.seek(begin)
        found = f.read(pos - begin).rfind(b"\n")
        if found >= 0:
            return begin + found + 1
        pos, span = begin, min(span * 4, _BLOCK)
    return start


def _without_long_lines(data: bytes) -> tuple[bytes, int]:
    """``data`` (complete lines) without its lines longer than :data:`MAX_LINE`, and how many there were. Such a line
    holds a whole window of MAX_LINE // 2 bytes without a newline, so only windows are searched (one ``find`` each,
    that stops at the first newline): a few C calls per block of a normal log, a copy only when a line is dropped."""
    if len(data) <= MAX_LINE:
        return data, 0
    window, at, kept, begin, count = MAX_LINE // 2, 0, [], 0, 0
    while at + window <= len(data):
        if data.find(b"\n", at, at + window) >= 0:
            at += window
            continue
        line = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at + window)
        end = len(data) if end < 0 else end
        if end - line > MAX_LINE:
            kept.append(data[begin:line])
            begin, count = end + 1, count + 1
        at = end + 1
    if not count:
        return data, 0
    kept.append(data[begin:])
    return b"".join(kept), count


def read_from(path: str | Path, offset: int = 0, fields: tuple[str, ...] | None = None,
              columnar: bool = False) -> LogChunk:
    """Records of the complete lines after byte ``offset``; a partial last line is left for the next call.

    Args:
        offset: where the previous call stopped (``LogChunk.offset``), 0 for the whole file.
        fields: keep only these iteration fields (plus ``kind``, ``rank``, ``iteration``, ``train_iters``; no
            ``extra``): what plots and spike detection over a whole log use.
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

            columns = scan_columns(line_blocks(f, _BULK_BLOCK, chunk), keep)
            chunk.tables, chunk.skipped = columns.tables, chunk.skipped + columns.cut
            chunk.slots, chunk.records = [slot for slot, _ in columns.rest], [record for _, record in columns.rest]
        elif size - chunk.offset >= _BULK_MIN:
            from opskit.logs.bulk import scan_blocks

            chunk.skipped += scan_blocks(line_blocks(f, _BULK_BLOCK, chunk), chunk.records, keep)
        else:
            for block in line_blocks(f, _BLOCK, chunk):
                chunk.skipped += scan_bytes(block, chunk.records, keep)
    return chunk


def from_end(path: str | Path, take: Callable[[str, bool], bool], start: int = 0,
             chunk: LogChunk | None = None) -> int:
    """Read a file backwards, never before byte ``start`` (a line start), in blocks of complete lines (64 KiB, x4
    each time up to 8 MiB): ``take(text, at_start)`` gets each block's text, the latest first, until it returns
    True or the block that begins at ``start`` (``at_start``; an empty text when nothing is left) was given. A line
    longer than :data:`MAX_LINE` is never in a block: it is skipped and counted in ``chunk.long_lines`` (when given).
    Returns the byte offset after the last complete line, where a follower continues. Memory: one block (what
    ``take`` keeps aside); time: linear in the bytes read.

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    chunk = chunk if chunk is not None else LogChunk()
    with open_log(path) as f:
        offset = hi = _line_start_before(f, os.fstat(f.fileno()).st_size, start)
        span = _FIRST_BACK
        while hi > start:
            lo = max(start, hi - span)
            f.seek(lo)
            data = f.read(hi - lo)
            cut = data.find(b"\n") + 1 if lo > start else 0  # the first line may begin before lo
            if cut == len(data):  # the block is the end of one line that begins before it
                if len(data) <= MAX_LINE:
                    span = min(span * 4, _BLOCK)  # a long line, not yet too long: a larger block
                    continue
                hi = _line_start_before(f, lo, start)  # garbage: skipped, unread
                chunk.long_lines += 1
                continue
            data, long = _without_long_lines(data[cut:])
            chunk.long_lines += long
            if take(data.decode("utf-8", errors="replace"), lo == start) or lo == start:
                return offset
            hi, span = lo + cut, min(span * 4, _BLOCK)
        take("", True)
        return offset


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
    pieces: list[LogChunk] = []  # parsed parts, the latest first
    missing = iterations

    def parse(text: str) -> int:
        piece = LogChunk()
        piece.skipped = scan_lines(text.split("\n"), piece.records, keep)
        pieces.append(piece)
        return len(piece.iterations)

    def take(text: str, at_start: bool) -> bool:
        nonlocal missing
        if at_start:  # all that is after start
            parse(text)
            return True
        # Every iteration line holds the word: parse back from the block's end, each time from the line of the word
        # that could complete the count, each line once; a block with too few words is parsed whole.
        end = len(text)
        while missing > 0:
            begin = _line_of_last(text, ITERATION_WORD, missing, end)
            if begin is None:
                missing -= parse(text[:end])
                return False
            missing -= parse(text[begin:end])
            end = begin
        return True

    chunk = LogChunk()
    chunk.offset = from_end(path, take, start, chunk)
    chunk.records = [r for piece in reversed(pieces) for r in piece.records]
    chunk.skipped = sum(piece.skipped for piece in pieces)
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
        for block in line_blocks(f, _FIRST_BACK):
            chunk = LogChunk()
            chunk.skipped += scan_bytes(block, chunk.records, None)
            if chunk.iterations:
                return chunk.iterations[0]
    return None


def split_segments(records: list[dict]) -> list[list[dict]]:
    """Split at restarts: a new segment begins where the iteration goes back (:func:`restart_indices`' rule), as when
    a job chain resumes from an earlier checkpoint. Validation records stay in the segment they were printed in."""
    at = [i for i, r in enumerate(records) if r["kind"] == "iteration"]
    cuts = [at[i] for i in restart_indices([records[i]["iteration"] for i in at], [records[i].get("rank") for i in at])]
    return [records[start:stop] for start, stop in pairwise([0, *cuts, len(records)]) if stop > start]


def timeline(records: list[dict]) -> list[dict]:
    """The training as it stands: iteration records of the last segment that ran each iteration, in iteration
    order (what a restart re-ran replaces what it had run before); where several ranks printed them, one rank's
    (:func:`one_rank`)."""
    its = [r for r in records if r["kind"] == "iteration"]
    chosen = one_rank([r["iteration"] for r in its], [r.get("rank") for r in its])
    its = its if chosen is None else [its[i] for i in chosen.tolist()]
    return [r for start, stop in latest_runs([r["iteration"] for r in its]) for r in its[start:stop]]


def one_rank(iterations: Sequence[int], ranks: Sequence[int | None]):
    """The indices (a numpy array) of the records a timeline reads where several ranks printed iteration lines (a
    trainer that logs on every node): in each segment (:func:`restart_indices`), those of the rank that printed its
    first labelled record, and any unlabelled ones; None where one printer printed them all (all are read).
    ``iterations`` and ``ranks`` as :func:`restart_indices` takes them."""
    codes = _rank_codes(ranks)
    if codes is None:
        return None
    import numpy as np

    keep = codes == UNLABELLED
    for start, stop in pairwise([0, *_ranked_restarts(np.asarray(iterations), codes), len(codes)]):
        segment = codes[start:stop]
        labelled = np.flatnonzero(segment != UNLABELLED)
        if len(labelled):
            keep[start:stop] |= segment == segment[labelled[0]]
    return np.flatnonzero(keep)


def latest_runs(iterations: Sequence[int]) -> list[tuple[int, int]]:
    """The index ranges [start, stop) of ``iterations`` (the iteration records' numbers, in file order, of one
    printer: :func:`one_rank`) that :func:`timeline` keeps, in order: segments split where the iteration goes back,
    each cut before the first iteration of any later segment (what the resume re-ran replaces)."""
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


def restart_indices(iterations: Sequence[int], ranks: Sequence[int | None] | None = None) -> list[int]:
    """The indices where a new segment begins (:func:`split_segments`' restart rule), for the iteration records'
    numbers in file order and their ranks (srun's labels: None, or :data:`UNLABELLED` in a numpy array, for an
    unlabelled record; ``ranks`` None: all unlabelled): where the iteration is <= that of the last record since the
    last restart of the same rank, an unlabelled record counting as every rank's (it is compared with the record
    before it, a labelled one with the last of its rank or unlabelled). So one printer's lines (Megatron's
    last rank) restart where the iteration goes back, and ranks that all print (a trainer that logs on every node)
    restart once where they all go back, however their lines interleave. At once for numpy arrays (a large log's),
    one pair at a time otherwise."""
    codes = _rank_codes(ranks)
    if codes is not None:
        import numpy as np

        return _ranked_restarts(np.asarray(iterations), codes)
    # one printer: the last record of the same rank is the record before
    if hasattr(iterations, "dtype"):
        import numpy as np

        return (np.flatnonzero(np.diff(iterations) <= 0) + 1).tolist()
    return [i for i, (before, after) in enumerate(pairwise(iterations), 1) if after <= before]


def _rank_codes(ranks: Sequence[int | None] | None):
    """``ranks`` as a numpy array (:data:`UNLABELLED` for None); None when all are the same (one printer) or none
    are given."""
    if ranks is None or not len(ranks):
        return None
    if hasattr(ranks, "dtype"):
        return None if (ranks == ranks[0]).all() else ranks
    first = ranks[0]
    if all(rank == first for rank in ranks):
        return None
    import numpy as np

    return np.array([UNLABELLED if rank is None else rank for rank in ranks], dtype=np.int64)


def _ranked_restarts(iterations, ranks) -> list[int]:
    """:func:`restart_indices` of numpy arrays of iterations and ranks (:data:`UNLABELLED` for none)."""
    import numpy as np

    index = np.arange(len(ranks))
    unlabelled = ranks == UNLABELLED
    # before: each record's last record of the same rank or unlabelled (unlabelled: any record), -1 for none
    last_unlabelled = np.maximum.accumulate(np.where(unlabelled, index, -1))
    order = np.argsort(ranks, kind="stable")  # each rank's records in file order, one rank after another
    same = np.flatnonzero(ranks[order[1:]] == ranks[order[:-1]])
    same_rank = np.full(len(ranks), -1)
    same_rank[order[same + 1]] = order[same]
    before = np.where(unlabelled, index - 1, np.maximum(same_rank, np.concatenate(([-1], last_unlabelled[:-1]))))
    went_back = (before >= 0) & (iterations <= iterations[np.maximum(before, 0)])
    restarts, since = [], 0
    for i in np.flatnonzero(went_back).tolist():
        if before[i] >= since:  # else the first of its rank since the last restart: nothing before to go back from
            restarts.append(i)
            since = i
    return restarts


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
    (plot and spikes on a 176B run's log). A key none of the tables holds is null in their rows; ``value``
    reads the records built one by one."""
    if not chunk.tables:
        return record_columns(timeline(chunk.records), keys, value)
    import polars as pl

    keys = list(dict.fromkeys(("iteration", *keys)))
    rest = [(slot, r) for slot, r in zip(chunk.slots, chunk.records, strict=True) if r["kind"] == "iteration"]
    columns = list(dict.fromkeys(("rank", *keys)))  # rank: who printed each record, for one_rank
    parts = [pl.DataFrame({"slot": [slot for slot, _ in rest],
                           **{key: [r.get(key) if key == "rank" else value(r, key) for _, r in rest]
                              for key in columns}}, strict=False)]
    parts += [table.select("slot", *(key for key in columns if key in table.columns)) for table in chunk.tables]
    frame = pl.concat(parts, how="diagonal_relaxed").sort("slot")
    frame = frame.with_columns(pl.lit(None).alias(key) for key in columns if key not in frame.columns)
    chosen = one_rank(frame["iteration"].to_numpy(), frame["rank"].fill_null(UNLABELLED).to_numpy())
    frame = frame if chosen is None else frame[chosen]
    runs = latest_runs(frame["iteration"].to_numpy())
    frame = pl.concat([frame.slice(start, stop - start) for start, stop in runs]) if runs else frame.clear()
    return {key: frame[key] for key in keys}
