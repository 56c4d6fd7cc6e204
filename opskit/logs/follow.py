"""``tail -f`` for training logs: the last lines of a file, then each complete line as it is appended. The file is
reopened by name at every poll, so a log replaced by ``opskit sync`` (copied beside, renamed over) is followed too.
A published copy (any :mod:`opskit.targets` target: file://, gs://, hf://) is followed the same way with range reads
from the last offset, so each poll transfers only the new bytes (BigScience's "delayed tail -f")."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from opskit.logs.parse import LogChunk, LogFormatError, from_end, line_blocks, open_log

if TYPE_CHECKING:
    from opskit.targets.base import Target

TAIL_WINDOW = 64 * 1024  # first range read of a remote tail; doubled until it holds the asked lines
TAIL_BLOCK = 8 << 20  # bytes per read of a local log's new part


def last_lines(path: str | Path, n: int) -> tuple[list[str], int]:
    """(the last ``n`` complete lines, byte offset after them), reading only the end of the file.

    Raises:
        FileNotFoundError: no such file.
    """

    lines: list[str] = []

    def take(text: str, at_start: bool) -> bool:
        nonlocal lines
        if n:
            lines = (text.split("\n")[:-1] + lines)[-n:]  # never more than n kept: a block's lines, then n
        return len(lines) >= n

    offset = from_end(path, take)
    return lines, offset


def new_lines(path: str | Path, offset: int) -> tuple[list[str], int]:
    """(complete lines after byte ``offset``, the offset after them); from 0 when the file became shorter. Read in
    blocks; a line longer than :data:`opskit.logs.parse.MAX_LINE` is skipped (a sparse hole is never held whole).

    Raises:
        FileNotFoundError: no such file. LogFormatError: a folder or an unreadable file.
    """
    with open_log(path) as f:
        if os.fstat(f.fileno()).st_size < offset:
            offset = 0
        f.seek(offset)
        chunk = LogChunk(offset=offset)
        lines = [line for block in line_blocks(f, TAIL_BLOCK, chunk)
                 for line in block.decode("utf-8", errors="replace").split("\n")[:-1]]
        return lines, chunk.offset


def follow(path: str | Path, n: int, interval: float, sleep: Callable[[float], None],
           polls: int | None = None) -> Iterator[str]:
    """The last ``n`` lines, then new complete lines every ``interval`` seconds (``polls`` times; None: forever).

    Raises:
        FileNotFoundError: the file does not exist at the start (later disappearances are waited out).
    """
    lines, offset = last_lines(path, n)
    yield from lines
    done = 0
    while polls is None or done < polls:
        sleep(interval)
        done += 1
        try:
            lines, offset = new_lines(path, offset)
        except FileNotFoundError:
            continue
        yield from lines


def complete_lines(data: bytes, offset: int) -> tuple[list[str], int]:
    """(complete lines of ``data``, read at byte ``offset``; the offset after the last newline)."""
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").split("\n")[:-1], offset + end


def remote_last_lines(target: Target, key: str, n: int) -> tuple[list[str], int]:
    """(the last ``n`` complete lines of a published object, offset after them), by range reads from its end.

    Raises:
        FileNotFoundError: nothing published under ``key`` yet.
    """
    size = target.size(key)
    if size is None:
        raise FileNotFoundError(f"{target.url}: no {key} published there (yet)")
    window = TAIL_WINDOW
    while True:
        start = max(0, size - window)
        data = target.read_from(key, start) or b""
        lines, offset = complete_lines(data, start)
        if start and lines:  # the first line may be cut: drop it
            lines = lines[1:]
        if len(lines) >= n or start == 0:
            return (lines[-n:] if n else []), offset
        window *= 4


def follow_published(target: Target, key: str, n: int, interval: float, sleep: Callable[[float], None],
                     polls: int | None = None) -> Iterator[str]:
    """:func:`follow` for an object at a target: the last ``n`` lines, then new complete lines every ``interval``
    seconds, each poll one range read from the last offset (from 0 again if the object became shorter).

    Raises:
        FileNotFoundError: nothing published under ``key`` at the start. TargetError: the target failed after retries.
    """
    lines, offset = remote_last_lines(target, key, n)
    yield from lines
    done = 0
    while polls is None or done < polls:
        sleep(interval)
        done += 1
        data = target.read_from(key, offset)
        if not data:
            if data is not None and (target.size(key) or 0) < offset:
                offset = 0
            continue
        lines, offset = complete_lines(data, offset)
        yield from lines


def published_key(local_log: Path) -> str:
    """The key under which ``opskit sync logs`` publishes ``local_log``: ``logs/FILE``.

    Raises:
        LogFormatError: ``local_log`` is not ``<run>/logs/FILE`` (a bare file has no published copy).
    """
    if local_log.parent.name != "logs":
        raise LogFormatError(f"--remote: {local_log} is not a run's logs/ file; give a spec name or run folder")
    return f"logs/{local_log.name}"
