"""A run as the watchdog sees it once: :class:`RunSnapshot`, frozen, read by :func:`read_snapshot`, the watchdog's
only I/O before it acts: one ``squeue`` (the run's jobs: :func:`opskit.run.chain.run_jobs`), the ledger, the flags and
the bad-node list, the bytes main_log.txt gained since the last run (TensorBoard events under ``<run>/tensorboard``
when there is no text log), the log's end for stragglers and a hang's stacks, the checkpoint folder, the measured
save-interval figures and the file system's usage. The checks (:mod:`opskit.monitor.checks`) only compute on it.

No typer, rich, torch or numpy here (the tensorboard package only for a run without a text log): it runs from cron on
login nodes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from opskit.ckpt.format.info import ResumePoint, resume_point
from opskit.ckpt.format.layout import SAVED_LINE, step_dirs
from opskit.fsutil import open_regular
from opskit.history.measures import save_interval_advice
from opskit.logs.crash import last_header
from opskit.logs.eta import Progress, progress
from opskit.logs.parse import LogFormatError, read_tail, timeline
from opskit.logs.tensorboard import is_event_dir, read_event_dir
from opskit.monitor.watch_state import WatchdogState
from opskit.run import chain
from opskit.run.incidents import IncidentsError, read_incidents
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.slurm.client import QueueEntry, SchedulerUnreachable
from opskit.spec.schema import Spec, WatchdogSpec

# Iteration fields the watchdog keeps.
FIELDS = ("consumed_samples", "consumed_tokens", "elapsed_time_per_iteration_s", "global_batch_size", "lm_loss",
          "grad_norm", "skipped_iterations", "nan_iterations", "samples_per_second", "tflops")
HISTORY = 300  # iteration records kept in the state file (at least): the spike window and the throughput baseline
# A first run on a months-old log (or one after a long pause) judges only its end: older events are no news.
NEW_RECORDS = 5000
NEW_TEXT = 8 << 20
# Bytes of main_log.txt's end searched for the stacks of a hang: tr11's 384 ranks at ~10 KiB of stacks each.
STACK_TEXT = 16 << 20
# Bytes of its end searched for the forward-time lines of stragglers: one line per log interval, a few KiB of other
# lines between two of them.
STRAGGLER_TEXT = 1 << 20
_JOB_WORD = "[opskit] "  # what every JOB_HEADER line holds


# --------------------------------------------------------------------------- the log


@dataclass(frozen=True)
class LogRead:
    """What :func:`read_log` got: all records kept (old + new, restarts resolved), how many are new, the new text."""

    records: list[dict]
    new: list[dict]
    text: str
    skipped: int
    last_iteration_at: float | None
    job_nodes: str = ""
    """The node list (SLURM's form) of the job whose lines ``text`` starts with, from an earlier read's job header: it
    names the node of a crash line before the next header."""
    state: WatchdogState = field(default_factory=WatchdogState)
    """The watchdog state with this read counted (offset, inode, history, ...): the next read starts there."""


def read_log(run: RunPaths, state: WatchdogState, keep: int = HISTORY) -> LogRead | None:
    """Records and text main_log.txt gained since ``state.offset`` (at most the last NEW_RECORDS iteration
    records and NEW_TEXT bytes of text: only the end of a large gain is read), with the state that counts them
    (:attr:`LogRead.state`; ``state`` itself is not changed). None without a log.

    A file that shrank or was replaced (another inode) is read again from its start. ``keep``: iteration records
    kept in the state for the next run (spike window and throughput baseline). The last ``successfully saved
    checkpoint`` line of the new text sets the state's ``saved``.

    Raises:
        LogFormatError: main_log.txt is a folder, a device (``/dev/zero`` would never end) or another file that is not
            regular, or unreadable.
    """
    try:
        info = os.stat(run.main_log)
    except (FileNotFoundError, NotADirectoryError):
        return None
    offset = state.offset if state.inode == info.st_ino else 0
    start = offset if offset <= info.st_size else 0  # shorter than where the last run stopped: replaced or truncated
    # Only the last NEW_RECORDS records count: read backwards to them, not the whole gain (a months-old log).
    chunk = read_tail(run.main_log, NEW_RECORDS, start, fields=FIELDS)
    text_from = max(start, chunk.offset - NEW_TEXT)
    try:
        with open_regular(run.main_log) as f:  # the same new bytes once more, for crash lines: an hour's worth is small
            f.seek(text_from)
            text = f.read(chunk.offset - text_from).decode("utf-8", errors="replace")
    except OSError as e:  # replaced by something else since
        raise LogFormatError(f"{run.main_log}: cannot read: {e.strerror or e}") from None
    new = chunk.iterations[-NEW_RECORDS:]
    records = timeline(([] if start == 0 else state.history) + new)
    # The line was written at or before the file's mtime: an upper bound, so a hang is never reported early.
    last_iteration_at = info.st_mtime if new else state.last_iteration_at
    header = _JOB_WORD in text and last_header(text)  # a C substring search first, not a regex scan (8 MiB at first)
    saved = matches(text, "successfully saved", SAVED_LINE)
    after = replace(state, offset=chunk.offset, inode=info.st_ino, history=records[-keep:],
                    skipped=state.skipped + chunk.skipped, last_iteration_at=last_iteration_at,
                    job_nodes=header["nodes"] if header else state.job_nodes,
                    saved=int(saved[-1][1]) if saved else state.saved)
    return LogRead(records, new, text, chunk.skipped, last_iteration_at, state.job_nodes if start else "", after)


def read_events(run: RunPaths, state: WatchdogState, keep: int = HISTORY) -> LogRead | None:
    """For trainers that write only TensorBoard events (Megatron's tags) under ``<run>/tensorboard``: the iteration
    records after ``state.events_iteration``, with the state that counts them. None without event files or
    Megatron's loss tag.

    The event files are read whole each time (the tensorboard package cannot resume at an offset); no crash lines.
    """
    if not is_event_dir(run.tensorboard):
        return None
    try:
        records = [r for r in read_event_dir(run.tensorboard) if r["kind"] == "iteration"]
    except LogFormatError:
        return None
    seen = -1 if state.events_iteration is None else state.events_iteration
    new = [r for r in records if r["iteration"] > seen][-NEW_RECORDS:]
    if new:
        state = replace(state, events_iteration=new[-1]["iteration"],
                        last_iteration_at=max(f.stat().st_mtime for f in run.tensorboard.rglob("*tfevents*")))
    return LogRead(records[-keep:], new, "", 0, state.last_iteration_at, state=state)


def matches(text: str, word: str, pattern: re.Pattern) -> list[re.Match]:
    """``pattern``'s match in each line of ``text`` that has one; ``word`` is in every such line, so text without it
    (the common case) is never split into lines."""
    if word not in text:
        return []
    return [m for line in text.splitlines() if word in line and (m := pattern.search(line))]


def log_tail(main_log: Path, tail: int) -> str:
    """The last ``tail`` bytes of ``main_log`` as text ("" when unreadable)."""
    try:
        with open_regular(main_log) as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def progress_of(spec: Spec, records: list[dict]) -> Progress | None:
    """Progress and ETA at the last record, as ``opskit logs show`` computes them; None without records or without
    ``train_iters`` (TensorBoard events carry none)."""
    if not records or records[-1]["train_iters"] is None:
        return None
    return progress(records, planned_tokens=spec.batch.samples * spec.model.seq_length)


# --------------------------------------------------------------------------- files of the run


@dataclass(frozen=True)
class RunFlags:
    """The chain's flag files: each one's first line (:func:`opskit.run.chain.flag_text`), None when it is not set."""

    finished: str | None
    stopped: str | None
    kill_switch: str | None


def read_flags(run: RunPaths) -> RunFlags:
    """The run's finished, stopped and kill-switch flags."""
    def text(path: Path) -> str | None:
        return chain.flag_text(path) if path.exists() else None
    return RunFlags(text(run.finished_flag), text(run.stopped_flag), text(run.kill_switch))


@dataclass(frozen=True)
class Checkpoints:
    """The run's checkpoint folder as the checks need it (headers only, no tensor read).

    Attributes:
        path: ``<run>/checkpoints``. exists: anything is there; is_file: it is not a folder.
        point: the step a resume starts from (:func:`opskit.ckpt.format.info.resume_point`; None when ``is_file``).
        saved_at: that step's mtime (epoch s; None without one, or unreadable).
        steps: each ``global_stepN`` folder's name -> its mtime (None when it cannot be read).
    """

    path: Path
    exists: bool
    is_file: bool
    point: ResumePoint | None
    saved_at: float | None
    steps: dict[str, float | None]


def read_checkpoints(run: RunPaths) -> Checkpoints:
    """The checkpoint folder's resume point, its age and the step folders' times."""
    path = run.checkpoints
    if path.exists() and not path.is_dir():
        return Checkpoints(path, True, True, None, None, {})
    point = resume_point(path)
    return Checkpoints(path, path.exists(), False, point, _mtime(point.step.path) if point.step else None,
                       {step.name: _mtime(step) for step in step_dirs(path).values()})


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


@dataclass(frozen=True)
class Disk:
    """One ``statvfs`` of the file system holding the run (``path``: the first existing folder of the checkpoints,
    the run, its parents)."""

    path: Path
    vfs: os.statvfs_result


def read_disk(run: RunPaths) -> Disk:
    """The usage of the file system the run directory is on."""
    path = next((p for p in (run.checkpoints, run.root, *run.root.parents) if p.is_dir()), Path("/"))
    return Disk(path, os.statvfs(path))


def measure_save_interval(run: RunPaths, save_interval: int, ledger: list[chain.TaskOutcome],
                          cached: dict | None) -> dict | None:
    """The run's measured save-interval figures (:func:`opskit.history.measures.save_interval_advice`'s JSON):
    ``cached`` when it counted as many failures as the ledger does (the log is read whole for them), else measured
    again. None before the first failure (no MTBF), or when the log cannot be read (its own finding says so)."""
    failures = sum(row.state in chain.FAILURES for row in ledger)
    if not failures:
        return None
    if cached is not None and cached.get("failures") == failures:
        return cached
    try:
        return save_interval_advice(run, save_interval, ledger).as_json()
    except OSError:
        return None


# --------------------------------------------------------------------------- the snapshot


def slurm_time(text: str) -> datetime | None:
    """squeue's ``2026-11-21T09:14:27``; None for N/A, Unknown, ..."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None


@dataclass(frozen=True)
class RunSnapshot:
    """Everything one check of a run looks at, read once by :func:`read_snapshot`."""

    run: RunPaths
    now: datetime
    state: WatchdogState
    """The state this check started from, with this read's log cursor and measured figures."""
    entries: tuple[QueueEntry, ...]
    """The run's jobs in squeue (any state); empty when ``unreachable``."""
    unreachable: SchedulerUnreachable | None
    ledger: chain.Ledger
    flags: RunFlags
    bad_nodes: dict[str, str]
    bad_nodes_error: str | None
    """Why ``bad-nodes.txt`` could not be read (one line), else None."""
    run_missing: str | None
    """What the run directory is instead of a folder (``does not exist``, ``is a file, not a folder``): nothing of
    the run can be seen; None when it is one."""
    log: LogRead | None
    log_error: LogFormatError | None
    logs_is_file: bool
    main_log_size: int | None
    progress: Progress | None
    checkpoints: Checkpoints | None
    """None when the run is missing."""
    measured: dict | None
    """The save-interval figures for this check (:func:`measure_save_interval`)."""
    disk: Disk
    straggler_text: str = ""
    """main_log's last STRAGGLER_TEXT bytes (read only when there is a log)."""
    stack_text: str = ""
    """main_log's last STACK_TEXT bytes, read only when a task has run silent past ``watchdog.hang_min_minutes``."""
    incidents: tuple[dict, ...] = ()
    """The run's divergence incidents (:mod:`opskit.run.incidents`)."""
    incidents_error: str | None = None
    """Why ``incidents.json`` could not be read (one line), else None."""

    @property
    def running(self) -> list[QueueEntry]:
        """The run's RUNNING tasks."""
        return [e for e in self.entries if e.state == "RUNNING"]

    @property
    def running_since(self) -> datetime | None:
        """When the latest running task started; None when none runs."""
        started = [t for e in self.running if (t := slurm_time(e.start_time))]
        return max(started) if started else None


def read_snapshot(spec: Spec, state: WatchdogState, now: datetime, users: list[str] | None = None) -> RunSnapshot:
    """Read the run of ``spec`` once (the only I/O of a check): squeue (``users``' jobs, default the members of
    ``slurm.group``), the ledger, flags and bad-node list, the log from ``state``'s offset, the checkpoint folder,
    the measured save-interval figures and the disk.

    Raises:
        ChainError: ``slurm.group`` names no usable Unix group. ``SlurmError``: squeue failed otherwise.
    """
    run = RunPaths.of(spec)
    try:
        entries = chain.run_jobs(run, spec.job_name, client.squeue(users or chain.queue_users(spec.slurm.group)))
        unreachable = None
    except SchedulerUnreachable as e:
        entries, unreachable = [], e
    ledger = chain.ledger_of(run)  # a damaged line is a finding of its own; the good lines still count
    try:
        bad_nodes, bad_nodes_error = chain.read_bad_nodes(run), None
    except chain.ChainError as e:
        bad_nodes, bad_nodes_error = {}, str(e)
    keep = max(HISTORY, 2 * spec.watchdog.spike_window + 10)
    try:
        log, log_error = read_log(run, state, keep) or read_events(run, state, keep), None
    except LogFormatError as e:
        log, log_error = None, e
    state = log.state if log else state
    run_missing = None if run.root.is_dir() else "is a file, not a folder" if run.root.exists() else "does not exist"
    measured = None if run_missing else measure_save_interval(run, spec.checkpoint.save_interval, ledger.rows,
                                                              state.measured)
    snapshot = RunSnapshot(
        run, now, replace(state, measured=state.measured if measured is None else measured), tuple(entries),
        unreachable, ledger, read_flags(run), bad_nodes, bad_nodes_error, run_missing, log, log_error,
        run.logs.exists() and not run.logs.is_dir(), _size(run.main_log) if log else None,
        progress_of(spec, log.records if log else []), None if run_missing else read_checkpoints(run), measured,
        read_disk(run), **_incidents(run))
    if log is None or run_missing:
        return snapshot
    return replace(snapshot, straggler_text=log_tail(run.main_log, STRAGGLER_TEXT),
                   stack_text=log_tail(run.main_log, STACK_TEXT) if _silent_long(snapshot, spec.watchdog) else "")


def _incidents(run: RunPaths) -> dict:
    """The snapshot's ``incidents`` and ``incidents_error``."""
    try:
        return {"incidents": tuple(read_incidents(run))}
    except IncidentsError as e:
        return {"incidents_error": str(e)}


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _silent_long(snapshot: RunSnapshot, wd: WatchdogSpec) -> bool:
    """A task runs and no iteration line came for ``watchdog.hang_min_minutes``: short of which no hang is called
    (:meth:`WatchdogSpec.hang_limit_s`), so the stacks' 16 MiB are read only then."""
    since = snapshot.running_since
    if since is None:
        return False
    silent = snapshot.now.timestamp() - max(snapshot.log.last_iteration_at or 0, since.timestamp())
    return silent > wd.hang_min_minutes * 60
