"""What ``opskit logs`` commands take as input: a log file, a TensorBoard event folder, a run folder, or a spec name
(its ``<run>/logs/main_log.txt``, save interval, existing checkpoints and token budget)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.layout import step_dirs
from opskit.logs.eta import Progress, progress
from opskit.logs.parse import (
    LogChunk,
    LogFormatError,
    first_iteration,
    read_from,
    read_tail,
    timeline,
    timeline_columns,
)
from opskit.logs.tensorboard import is_event_dir, read_event_dir
from opskit.run.incidents import IncidentsError, read_incidents
from opskit.run.paths import RunPaths
from opskit.spec.files import SpecError, split_variant


@dataclass(frozen=True)
class LogSource:
    """One input. ``name`` names the run in legends and titles; the spec-only fields are None for bare files."""

    name: str
    path: Path
    events: bool = False
    save_interval: int | None = None
    checkpoints: tuple[int, ...] | None = None
    planned_tokens: int | None = None

    def read(self, fields: tuple[str, ...] | None = None) -> LogChunk:
        """All records of this source (``fields`` as in ``read_from``): a large text log's common iteration lines
        kept column-wise (``read_from(..., columnar=True)``), an event folder's records as dicts.

        Raises:
            LogFormatError: an unreadable file; an unknown name in ``fields``.
        """
        if self.events:
            return LogChunk(records=read_event_dir(self.path))
        return read_from(self.path, fields=fields, columnar=True)

    def incidents(self) -> list[dict]:
        """The divergence incidents of the run this log is the ``logs/main_log.txt`` of ([] for another file, or
        when ``incidents.json`` cannot be read)."""
        if self.events or self.path.name != "main_log.txt" or self.path.parent.name != "logs":
            return []
        try:
            return read_incidents(RunPaths(self.path.parent.parent))
        except IncidentsError:
            return []

    def text_log(self, command: str) -> Path:
        """The text log of this source, for commands that read text only.

        Raises:
            LogFormatError: the source is a TensorBoard event folder.
        """
        if self.events:
            raise LogFormatError(f"{self.path}: a TensorBoard event folder; `opskit logs {command}` reads text logs "
                                 "(plot and spikes read event folders)")
        return self.path

    def timeline(self, keys: tuple[str, ...], chunk: LogChunk | None = None,
                 value: Callable[[dict, str], object] = dict.get) -> dict[str, Sequence]:
        """Iteration records as the training stands (restarts resolved), column-wise: ``iteration`` and ``keys``
        (:func:`opskit.logs.parse.timeline_columns`) of ``chunk`` (default: :meth:`read` with ``fields=keys``).

        Raises:
            LogFormatError: no iteration records; an unknown name in ``keys`` (when ``chunk`` is None).
        """
        columns = timeline_columns(self.read(keys) if chunk is None else chunk, keys, value)
        if not len(columns["iteration"]):
            raise LogFormatError(f"{self.path}: no iteration lines")
        return columns


_LOG_SUFFIXES = (".txt", ".log", ".out", ".err", ".gz", ".jsonl")
_EXPECTED = "expected a log file, a run folder, a TensorBoard event folder or a spec name"


def resolve(name_or_path: str) -> LogSource:
    """A file, an event folder, a run folder (with ``logs/main_log.txt``), else a spec name.

    Raises:
        SpecError: not a path, and no spec of that name.
        LogFormatError: a folder that is neither a run nor an event folder and no spec's name; a name that can only
            be a path (a ``/`` or a log suffix) and does not exist; a FIFO, socket or device.
    """
    path = Path(name_or_path)
    if path.is_file() and path.suffix not in (".yaml", ".yml"):
        return LogSource(_file_name(path), path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise LogFormatError(f"{path}: not a regular file (a FIFO, socket or device); {_EXPECTED}")
    if path.is_dir():
        main_log = RunPaths(path).main_log
        if main_log.exists() or main_log.is_symlink():  # even a device or folder: its reader says what it is
            return LogSource(path.name, main_log)
        if is_event_dir(path):
            return LogSource(path.name, path, events=True)
        try:
            return from_spec(name_or_path)  # BigScience keeps a folder named like each training
        except SpecError:
            raise LogFormatError(f"{path}: a folder with neither logs/main_log.txt nor TensorBoard event files, and "
                                 f"no spec of that name; {_EXPECTED}") from None
    base = Path(split_variant(name_or_path)[0])
    if not base.exists() and base.suffix not in (".yaml", ".yml") and ("/" in str(base) or base.suffix in
                                                                        _LOG_SUFFIXES):
        raise LogFormatError(f"{name_or_path}: no such file or folder; {_EXPECTED}")
    return from_spec(name_or_path)


def resolved(inputs: Iterable[str]) -> Iterator[tuple[str, LogSource]]:
    """Each input with its :func:`resolve`'d source, resolved as its turn comes (an error names the first bad input
    only after the inputs before it were used)."""
    return ((item, resolve(item)) for item in inputs)


@dataclass(frozen=True)
class LogTail:
    """What ``opskit logs show`` shows of a log: its last iteration records (file order), the first one, and the
    progress and ETA from the last ``recent`` (None, like ``first``, before the first iteration line)."""

    file: Path
    records: list[dict]
    first: dict | None
    progress: Progress | None
    skipped_in_tail: int

    def as_json(self) -> dict:
        return {"file": str(self.file), "records": self.records, "first": self.first,
                "progress": self.progress.as_json() if self.progress else None,
                "skipped_in_tail": self.skipped_in_tail}


def log_tail(name_or_path: str, last: int = 10, recent: int = 20) -> LogTail:
    """The :class:`LogTail` of a spec's, run folder's or file's text log (:func:`resolve`), read from the end: the
    last ``last`` iteration records, progress over the last ``recent``.

    Raises:
        LogFormatError, SpecError: as :func:`resolve`; an event folder (no text log).
    """
    source = resolve(name_or_path)
    path = source.text_log("show")
    chunk = read_tail(path, last + recent)
    records = timeline(chunk.records)
    if not records:
        return LogTail(path, [], None, None, chunk.skipped)
    state = progress(records, recent=recent, planned_tokens=source.planned_tokens)
    return LogTail(path, records[-last:], first_iteration(path), state, chunk.skipped)


def from_spec(name: str) -> LogSource:
    """The run of spec ``name``: its main log, save interval, ``global_stepN`` folders and planned tokens
    (samples of the run x seq_length).

    Raises:
        SpecError: no such spec.
    """
    from opskit.spec.load import load_spec  # pydantic, yaml: only for a spec, not a log file or run folder

    spec = load_spec(name)
    run = RunPaths.of(spec)
    steps = tuple(step_dirs(run.checkpoints))
    return LogSource(spec.name, run.main_log, save_interval=spec.checkpoint.save_interval,
                     checkpoints=steps or None, planned_tokens=spec.batch.samples * spec.model.seq_length)


def _file_name(path: Path) -> str:
    """``runs/tr11/logs/main_log.txt`` -> ``tr11`` (the main log of a run names it); other files by their stem."""
    run = RunPaths(path.parent.parent)
    return run.root.name if path == run.main_log else path.stem
