"""Parse Megatron-family log lines (reference section 2.3) into records: from a byte offset, or from a file's end.

A record is a plain dict. An iteration line gives ``{"kind": "iteration", "iteration", "train_iters",
"consumed_samples", "consumed_tokens", "elapsed_time_per_iteration_s", "learning_rate", "global_batch_size",
"lm_loss", "loss_scale", "grad_norm", "num_zeros", "skipped_iterations", "nan_iterations", "samples_per_second",
"tflops"}`` with the fields the line has (snake_case of the log's own names; times always in seconds), unknown
``key: value |`` fields under ``"extra"``. A validation line gives ``{"kind": "validation", "iteration" (None at the
end of training), "dataset", "where", "validation_lm_loss", "validation_ppl"}``.

Accepted: the 2021 ``(ms)`` format, the 2022 ``(s)`` format, ``[defaultN]:`` prefixes of ``torchrun --tee``,
timestamps and logger prefixes (anything before ``iteration``). An iteration or validation line that was wrapped, cut
mid-way or garbled by another rank's output is skipped and counted, never guessed at.

Speed: per line, str methods only, no regex; a large read (>= 16 MiB) goes through :mod:`opskit.logs.bulk`, which
builds the common iteration lines' records column-wise with polars and sends every other line here
(bench/log_parse.py, docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")


class LogFormatError(ValueError):
    """A log input that cannot be used as asked (no iteration lines where some are needed, a bad range); one line."""


def _seconds(milliseconds: float) -> float:
    return round(milliseconds / 1000, 9)  # rounded so that "31074.1" gives 31.0741, not 31.074099999999998


def _milliseconds(text: str) -> float:
    return _seconds(float(text))


# The log's own names, as split out of `` name: value |`` (leading space kept: no strip on the fast path) -> (record
# key, converter). Integer fields printed with a decimal point fall back to int(float(text)) (_other, _read).
_KNOWN = {
    " consumed samples": ("consumed_samples", int),
    " consumed tokens": ("consumed_tokens", int),
    " elapsed time per iteration (s)": ("elapsed_time_per_iteration_s", float),
    " elapsed time per iteration (ms)": ("elapsed_time_per_iteration_s", _milliseconds),
    " learning rate": ("learning_rate", float),
    " global batch size": ("global_batch_size", int),
    " lm loss": ("lm_loss", float),
    " loss scale": ("loss_scale", float),
    " grad norm": ("grad_norm", float),
    " num zeros": ("num_zeros", float),
    " params norm": ("params_norm", float),
    " curriculum seqlen": ("curriculum_seqlen", int),
    " number of skipped iterations": ("skipped_iterations", int),
    " number of nan iterations": ("nan_iterations", int),
    " samples per second": ("samples_per_second", float),
    " TFLOPs": ("tflops", float),
    " lm loss value": ("validation_lm_loss", float),
    " lm loss PPL": ("validation_ppl", float),
}
_BLOCK = 8 << 20  # bytes per read: per-read costs vanish, memory stays bounded
_BULK_BLOCK = 16 << 20  # bytes per read on the bulk path: polars reads one block while Python builds the last
_BULK_MIN = 16 << 20  # reads this large go through opskit.logs.bulk (smaller ones do not pay for importing polars)
_CUT = object()  # parse result of a record line that is not whole


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
    unread: int = 0
    """Bytes after the last complete line, left for the next read (by :func:`read_from`)."""

    @property
    def iterations(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "iteration"]

    def summary(self, name: str) -> str | None:
        """One line for stderr saying what a read of file ``name`` skipped, or None when it gave records and skipped
        nothing: a binary, compressed or unrelated file must not pass for a log with no iterations yet."""
        tail = f"; {self.unread:,} bytes after the last newline not read" if self.unread else ""
        if not self.records:
            if not self.lines and not self.unread:
                return f"{name}: empty, 0 records"
            return f"{name}: 0 records, {self.lines:,} lines skipped (not a training log?){tail}"
        if self.skipped:
            return f"{name}: {self.skipped} iteration/validation line(s) skipped (cut, wrapped or garbled)"
        return None


def snake_case(name: str) -> str:
    """``"elapsed time per iteration (s)"`` -> ``"elapsed_time_per_iteration_s"``."""
    out = "".join(c if c.isalnum() else "_" for c in name.lower())
    return "_".join(part for part in out.split("_") if part)


def _fields(record: dict, rest: str):
    """Fill ``record`` from `` key: value | key: value |`` and return it; ``_CUT`` when the text is not whole."""
    parts = rest.split("|")
    if parts[-1] and not parts[-1].isspace():  # a whole line ends with "|": text after it means it was cut
        return _CUT
    del parts[-1]
    known = _KNOWN
    for part in parts:
        name, sep, value = part.partition(":")
        spec = known.get(name)
        if spec is not None:
            try:
                record[spec[0]] = spec[1](value)
                continue
            except ValueError:
                pass  # "0.0" for an integer field, or garbage: _other tells which
        if not sep:
            return _CUT
        try:
            _other(record, name, value)
        except ValueError:
            return _CUT
    return record


def _count(text: str) -> int:
    """An integer field printed with a decimal point (``2048.0``).

    Raises:
        ValueError: not a finite number (``inf`` as well as ``nan`` or garbage).
    """
    try:
        return int(float(text))
    except OverflowError as e:
        raise ValueError(f"{text!r} is not a count") from e


def _other(record: dict, name: str, value: str) -> None:
    """A field off the fast path: odd spacing, an integer printed as ``0.0``, or an unknown name (kept under
    ``extra``: a number when it reads as one, else its text).

    Raises:
        ValueError: a known field whose value is not a number, or a name with no letters (garbage).
    """
    spec = _KNOWN.get(" " + name.strip())
    if spec is not None:
        key, convert = spec
        record[key] = _count(value) if convert is int else convert(value)
        return
    key = snake_case(name)
    if not key:
        raise ValueError(name)
    try:
        number = float(value)
    except ValueError:
        number = value.strip()
    record.setdefault("extra", {})[key] = number


def _iteration(line: str, at: int, bar: int):
    """Record of the line whose ``iteration `` word starts at ``at`` (``bar``: its first ``|``); None when it is not an
    iteration line at all (``saving checkpoint at iteration 100 to ...``), ``_CUT`` when it is one but not whole."""
    done, slash, total = line[at + 10:bar if bar >= 0 else len(line)].partition("/")
    if bar < 0:  # cut inside the header ("iteration    127") or another line ("saving checkpoint at iteration 100 to",
        # "successfully loaded checkpoint from /ckpt at iteration 346": a header is never preceded by "at")
        cut = (done + total).strip().replace(" ", "").isdigit() and not line[:at].endswith("at ")
        return _CUT if cut else None
    try:
        record = {"kind": "iteration", "iteration": int(done), "train_iters": int(total)}
    except ValueError:
        return None
    return _fields(record, line[bar + 1:])


def iteration_fields() -> set[str]:
    """Record keys an iteration line can have outside ``extra`` (what ``fields=`` accepts)."""
    return {"iteration", "train_iters", *(key for key, _ in _KNOWN.values() if not key.startswith("validation_"))}


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


def keep_only(record, keep: frozenset[str] | None):
    """An iteration record cut down to the ``keep`` keys (order kept; None keeps all); anything else unchanged."""
    if keep is None or not isinstance(record, dict) or record["kind"] != "iteration":
        return record
    return {key: value for key, value in record.items() if key in keep}


def _validation(line: str, head: str, at: int):
    """`` {name} loss at {where} | lm loss value: X | lm loss PPL: Y | ``; ``at`` indexes `` loss at `` in ``head``."""
    words = head[:at].rsplit("]:", 1)[-1].split()
    where = head[at + 9:].strip()
    iteration = None
    if where.startswith("iteration "):
        try:
            iteration = int(where[10:])
        except ValueError:
            return _CUT
    record = _fields({"kind": "validation", "iteration": iteration, "dataset": words[-1] if words else "",
                      "where": where}, line[len(head) + 1:])
    if record is _CUT or "validation_lm_loss" not in record:
        return _CUT
    record.setdefault("validation_ppl", None)
    return record


def _parse(line: str):
    """One line -> record, None (not a record line) or ``_CUT``."""
    bar = line.find("|")
    head = line if bar < 0 else line[:bar]
    loss_at = head.find(" loss at ")
    if loss_at >= 0:
        return _CUT if bar < 0 else _validation(line, head, loss_at)
    at = head.find("iteration ")
    if at < 0:
        return None
    return _iteration(line, at, bar)


def parse_line(line: str) -> dict | None:
    """One log line -> its iteration or validation record; None for any other line and for cut or garbled ones."""
    record = _parse(line)
    return None if record is _CUT else record


def parse_iteration_line(line: str) -> dict | None:
    """One iteration line -> ``{"kind": "iteration", "iteration": int, "train_iters": int, "lm_loss": float, ...}``;
    None for any other line (validation lines included) and for cut or garbled ones."""
    record = parse_line(line)
    return record if record is not None and record["kind"] == "iteration" else None


def parse_text(text: str, chunk: LogChunk | None = None, fields: tuple[str, ...] | None = None) -> LogChunk:
    """Records of every line in ``text`` appended to ``chunk`` (a new one when None); ``fields`` as in
    :func:`read_from`.

    Raises:
        LogFormatError: an unknown name in ``fields``.
    """
    chunk = chunk or LogChunk()
    _scan(text.split("\n"), chunk, _keep(fields))
    return chunk


def _scan(lines: list[str], chunk: LogChunk, keep: frozenset[str] | None) -> None:
    records, cut = chunk.records, 0
    append = records.append
    for line in lines:
        # Prefilter with two substring tests: most lines of a real log are neither kind.
        if "iteration " not in line and " loss at " not in line:
            continue
        record = _parse(line)
        if record is None:
            continue
        if record is _CUT:
            cut += 1
        else:
            append(record if keep is None else keep_only(record, keep))
    chunk.skipped += cut


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
    ``chunk.offset``, ``lines`` and ``unread``, when given, move past each block as it is handed out."""
    carry = b""
    while block := f.read(size):
        block = carry + block
        end = block.rfind(b"\n") + 1
        carry = block[end:]
        if chunk is not None:
            chunk.unread = len(carry)
        if end:
            if chunk is not None:
                chunk.offset += end
                chunk.lines += block.count(b"\n", 0, end)
            yield block[:end]


def _scan_bytes(data: bytes, chunk: LogChunk, keep: frozenset[str] | None) -> None:
    """:func:`_scan` of complete lines as read from a file (bad UTF-8 bytes replaced)."""
    _scan(data.decode("utf-8", errors="replace").split("\n"), chunk, keep)


def read_from(path: str | Path, offset: int = 0, fields: tuple[str, ...] | None = None) -> LogChunk:
    """Records of the complete lines after byte ``offset``; a partial last line is left for the next call.

    Args:
        offset: where the previous call stopped (``LogChunk.offset``), 0 for the whole file.
        fields: keep only these iteration fields (plus ``kind``, ``iteration``, ``train_iters``; no ``extra``): what
            plots and spike detection over a whole log use.

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
        if size - chunk.offset >= _BULK_MIN:
            from opskit.logs.bulk import scan_blocks

            scan_blocks(_blocks(f, _BULK_BLOCK, chunk), chunk, keep)
        else:
            for block in _blocks(f, _BLOCK, chunk):
                _scan_bytes(block, chunk, keep)
    return chunk


def from_end(path: str | Path, attempt: Callable[[str, bool], T | None]) -> tuple[T, int]:
    """Read a file backwards in growing blocks (64 KiB, x4 each time) until ``attempt(text, at_start)`` returns
    something; ``text`` holds the complete lines of the block (the block's first, possibly partial, line dropped
    unless the block starts the file). Returns (that result, byte offset after the last complete line), the offset
    being where a follower continues.

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    with open_log(path) as f:
        size = os.fstat(f.fileno()).st_size
        span = 1 << 16
        while True:
            start = max(0, size - span)
            f.seek(start)
            data = f.read(size - start)
            head = data.find(b"\n") + 1 if start else 0
            end = data.rfind(b"\n") + 1
            result = attempt(data[head:max(head, end)].decode("utf-8", errors="replace"), start == 0)
            if result is not None:
                return result, start + end
            span *= 4


def read_tail(path: str | Path, iterations: int) -> LogChunk:
    """Records near the end of a file holding at least ``iterations`` iteration records (or all there are): a
    multi-GB log costs a few reads (:func:`from_end`). ``offset`` is where a follower continues.

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """

    def enough(text: str, at_start: bool) -> LogChunk | None:
        chunk = parse_text(text)
        return chunk if at_start or len(chunk.iterations) >= iterations else None

    chunk, offset = from_end(path, enough)
    chunk.offset = offset
    return chunk


def first_iteration(path: str | Path) -> dict | None:
    """The first iteration record of a file, reading only as far as it (None when there is none).

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    with open_log(path) as f:
        for block in _blocks(f, 1 << 16):
            chunk = LogChunk()
            _scan_bytes(block, chunk, None)
            if chunk.iterations:
                return chunk.iterations[0]
    return None


def read_iterations(path: str | Path) -> Iterator[dict]:
    """Every iteration record of a log file, in file order."""
    yield from read_from(path).iterations


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
    kept: list[list[dict]] = []
    first_later = None  # first iteration of the segments after the one being looked at
    for segment in reversed(split_segments(records)):
        its = [r for r in segment if r["kind"] == "iteration"]
        if not its:
            continue
        kept.append([r for r in its if first_later is None or r["iteration"] < first_later])
        first_later = its[0]["iteration"] if first_later is None else min(first_later, its[0]["iteration"])
    return [r for segment in reversed(kept) for r in segment]
