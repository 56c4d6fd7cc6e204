"""``tail -f`` for training logs: the last lines of a file, then each complete line as it is appended. The file is
reopened by name at every poll, so a log replaced by ``opskit sync`` (copied beside, renamed over) is followed too."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from opskit.logs.parse import LogFormatError, from_end


def last_lines(path: str | Path, n: int) -> tuple[list[str], int]:
    """(the last ``n`` complete lines, byte offset after them), reading only the end of the file.

    Raises:
        FileNotFoundError: no such file.
    """

    def enough(text: str, at_start: bool) -> list[str] | None:
        lines = text.split("\n")[:-1]
        return (lines[-n:] if n else []) if at_start or len(lines) >= n else None

    return from_end(path, enough)


def new_lines(path: str | Path, offset: int) -> tuple[list[str], int]:
    """(complete lines after byte ``offset``, the offset after them); from 0 when the file became shorter.

    Raises:
        FileNotFoundError: no such file.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < offset:
            offset = 0
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").split("\n")[:-1], offset + end


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


def published_copy(local_log: Path, url: str) -> Path:
    """Where ``opskit sync logs`` put ``local_log`` under a ``file://`` target: same path relative to the run folder.

    Raises:
        SyncError: a target other than ``file:///...``.
        LogFormatError: ``local_log`` is not ``<run>/logs/FILE`` (a bare file has no published copy).
    """
    from opskit.sync import file_target

    target = file_target(url)
    if local_log.parent.name != "logs":
        raise LogFormatError(f"--remote: {local_log} is not a run's logs/ file; give a spec name or run folder")
    return target.root / "logs" / local_log.name
