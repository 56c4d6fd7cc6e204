"""The hourly watchdog behind ``opskit status``: checks -> findings, each with a severity (ok / warn / alert).

One run asks SLURM once (``squeue``), reads only the bytes main_log.txt gained since the last run (offset and recent
records in ``<run>/watchdog/state.json``; TensorBoard events under ``<run>/tensorboard`` when there is no text log),
looks at the newest checkpoint and the run directory's file system, and returns a :class:`Report`. No typer, rich,
torch or numpy here (the tensorboard package only for a run without a text log): it runs from cron on login nodes.

Findings have stable keys (``scheduler.absent``, ``log.hang``, ...): :mod:`opskit.monitor.alerts` de-duplicates on them.
What each one means and what to do about it: docs/operations.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from opskit.ckpt.format.info import FALLBACK_LINE, StepInfo, resume_point
from opskit.ckpt.format.layout import SAVE_FAILED_LINE, SAVED_LINE, STEP_DIR, save_failed_message, step_dirs
from opskit.fsutil import OutputRefusedError, append_lines, atomic_write_text, open_regular, read_json
from opskit.logs.crash import (
    JOB_HEADER,
    SIGNATURES,
    SOFTWARE_ERRORS,
    STEP_HEADER,
    expand_nodelist,
    find_crashes,
    last_header,
    line_source,
    may_hold_crash,
)
from opskit.logs.eta import progress, progress_lines
from opskit.logs.parse import LogFormatError, read_tail, timeline
from opskit.logs.spikes import SpikeConfig, find_spikes, remedies
from opskit.logs.stacks import rank_stacks, stuck_ranks
from opskit.logs.tensorboard import is_event_dir, read_event_dir
from opskit.monitor.findings import Finding, Report
from opskit.monitor.pulse import pulse_lines, unreachable_line
from opskit.rules.stragglers import parse_slowest_rank_line, straggler
from opskit.run import chain
from opskit.run.history import advise, save_interval_advice
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.slurm.client import QueueEntry, SchedulerUnreachable
from opskit.slurm.pending import never_starts
from opskit.spec.schema import Spec, WatchdogSpec, parse_slurm_time

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
HAND_OVER_S = 600  # an exclusive reservation still lets the next task of a chain wait this long
_JOB_WORD = "[opskit] "  # what every JOB_HEADER line holds
SAVE_INTERVAL_EXCESS = 0.01
"""The share of wall time a save interval may lose over the best one before the watchdog says so (1%)."""


# --------------------------------------------------------------------------- state


@dataclass
class WatchdogState:
    """What one run of the watchdog leaves the next (``<run>/watchdog/state.json``); the readers of the log and the
    checkpoint check bring it up to date."""

    offset: int = 0
    """Byte of main_log.txt read up to."""
    inode: int | None = None
    """main_log.txt's inode at ``offset``: another file (replaced) is read from its start."""
    history: list[dict] = field(default_factory=list)
    """Recent iteration records: the spike window and the throughput baseline."""
    skipped: int = 0
    """Record lines skipped so far (cut, wrapped or garbled)."""
    last_iteration_at: float | None = None
    """main_log.txt's mtime when it last gained an iteration line (epoch s): an upper bound for the hang check."""
    job_nodes: str = ""
    """The node list of the last job header seen (which node a crash line's srun label names)."""
    events_iteration: int | None = None
    """The last iteration read from TensorBoard events (a run without a text log)."""
    checkpoint: str | None = None
    """The newest complete step seen (``global_stepN``)."""
    saved: int | None = None
    """The iteration of the last ``successfully saved checkpoint`` line the log showed: that step must exist."""
    last_running: float | None = None
    """When a task of the run was last seen running (epoch s)."""
    measured: dict | None = None
    """The run's measured save-interval figures (:func:`opskit.run.history.save_interval_advice`'s JSON), taken
    again only when the ledger's failure count changes: the log is read whole for them."""

    @classmethod
    def from_json(cls, data: object) -> WatchdogState:
        """The state a JSON object holds; a key of another type than its field's, or unknown, is dropped (the
        default: that part starts over)."""
        if not isinstance(data, dict):
            return cls()
        kinds = {"offset": int, "inode": int, "history": list, "skipped": int, "last_iteration_at": (int, float),
                 "job_nodes": str, "events_iteration": int, "checkpoint": str, "saved": int,
                 "last_running": (int, float), "measured": dict}
        return cls(**{key: value for key, value in data.items() if key in kinds and isinstance(value, kinds[key])
                      and not isinstance(value, bool)})


def load_state(run: RunPaths) -> WatchdogState:
    """The watchdog's memory of the last run (a fresh one the first time, or when the file is unreadable, not a
    regular file of at most :data:`opskit.fsutil.MAX_SMALL_FILE` bytes, or not a JSON object: start over)."""
    try:
        return WatchdogState.from_json(read_json(run.watchdog_state))
    except (OSError, ValueError):
        return WatchdogState()


def save_state(run: RunPaths, state: WatchdogState) -> str | None:
    """Write the state atomically; nothing when the run directory does not exist yet. Returns why it could not be
    written (``<file>: <strerror>``: a teammate without write access to the run; a ``paths.output`` that is no run
    directory: :func:`opskit.run.chain.claim_state_dir`), else None: the checks stand."""
    if not run.root.is_dir():
        return None
    try:
        chain.claim_state_dir(run, run.watchdog_dir, "status")
        atomic_write_text(run.watchdog_state, json.dumps(asdict(state), separators=(",", ":")))
    except OutputRefusedError as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or run.watchdog_dir}: {e.strerror or e}"
    return None


# --------------------------------------------------------------------------- the scheduler


def _slurm_time(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None


def _minutes(text: str) -> float | None:
    """squeue's elapsed / limit (``1-02:03:04``, ``12:34``) in minutes; None for UNLIMITED, N/A, ..."""
    try:
        return parse_slurm_time(text)
    except ValueError:
        return None


def check_scheduler(spec: Spec, run: RunPaths, entries: list[QueueEntry], last_running: float | None, now: datetime,
                    seconds_left: float | None, ledger: list[chain.TaskOutcome] = ()) -> list[Finding]:
    """Findings from the spec's queue entries (running, pending and why, a pending reason that never clears, absent;
    the finished and stopped flags when there is none) and the queued depth against ``watchdog.queue_horizon_hours``.

    Args:
        last_running: when a task of the run was last seen running (epoch s; :attr:`WatchdogState.last_running`).
        seconds_left: the log's ETA, so a chain that covers the rest of the training is never "too short".
        ledger: the chain's task outcomes: the last one's time counts as "last seen running" (a task may start and
            end between two hourly checks).
    """
    wd = spec.watchdog
    running = [e for e in entries if e.state == "RUNNING"]
    pending = [e for e in entries if e.state == "PENDING"]
    if not entries:
        return [_absent(spec, run)]
    findings = []
    for e in running:
        findings.append(Finding("scheduler.running", "ok", f"{e.job_id} running for {e.time_used} since "
                                f"{e.start_time} on {e.reason} ('{e.partition}' partition)", asdict(e)))
    for e in pending:
        reason = e.reason.strip("()")
        start = _slurm_time(e.start_time)
        expected = f", expected to start {e.start_time}" if start else ""
        findings.append(Finding("scheduler.pending", "ok", f"{e.job_id} pending ({reason}{expected})", asdict(e)))
    # No grace here, unlike a wait's HopelessWatch: hourly checks are far apart, and pending_too_long would take a day.
    stuck = [(e.job_id, line) for e in pending if (line := never_starts(e, spec.cli_name))]
    if stuck:
        findings.append(Finding("scheduler.pending_forever", "alert", stuck[0][1],
                                {"job_ids": [job_id for job_id, _ in stuck]}))
    if pending and not running:
        ended = [t.timestamp() for t in (_ledger_time(r.time) for r in ledger[-1:]) if t]
        findings += _pending_too_long(wd, pending, max([last_running or 0, *ended]), now)
    if not run.finished_flag.exists():
        findings += _queue_depth(spec, running, entries, seconds_left)
    return findings


def check_chain(run: RunPaths, ledger: list[chain.TaskOutcome]) -> list[Finding]:
    """The kill switch, and the tasks that failed in a row (``ledger``): files of the run, known without SLURM."""
    findings = []
    if run.kill_switch.exists():
        findings.append(Finding("chain.kill_switch", "warn", f"the kill switch is on "
                                f"({chain.flag_text(run.kill_switch)}): queued tasks exit at start"))
    failed = chain.consecutive_failures(ledger)
    if failed:
        lost = {r.task: _lost_since_save(run, r) for r in failed[-3:]}
        findings.append(Finding("chain.failures", "warn", f"{len(failed)} consecutive failed task(s): " + ", ".join(
            f"{r.task} {r.state}" + (f" ({r.reason})" if r.reason else "") +
            (f" at {r.time[11:]}, losing {lost[r.task][1]:.0f} s of training since {lost[r.task][0]}"
             if lost[r.task] else "") for r in failed[-3:]),
            {"tasks": [asdict(r) for r in failed], "lost_s": {t: round(x[1]) for t, x in lost.items() if x}}))
    try:
        bad = chain.read_bad_nodes(run)
    except chain.ChainError as e:
        bad, findings = {}, [*findings, Finding("chain.bad_nodes", "warn", str(e))]
    if bad:
        findings.append(Finding("chain.bad_nodes", "warn", f"{len(bad)} node(s) excluded from the chain: " + "; ".join(
            f"{node} ({why[:160]})" for node, why in bad.items()) + "; `opskit nodes clear NAME NODE` once repaired",
            {"nodes": bad}))
    return findings


def _lost_since_save(run: RunPaths, row: chain.TaskOutcome) -> tuple[str, float] | None:
    """(step, seconds): the training a failed task lost, from the last checkpoint it saved (the newest step folder
    written before the failure, which the next task resumes from) to the failure; None without such a step."""
    failed_at = _ledger_time(row.time)
    if failed_at is None:
        return None
    saved = []
    for path in step_dirs(run.checkpoints).values() if run.checkpoints.is_dir() else ():
        try:
            saved.append((path.stat().st_mtime, path.name))
        except OSError:
            continue
    before = [(mtime, name) for mtime, name in saved if mtime <= failed_at.timestamp() + 1]
    if not before:
        return None
    mtime, name = max(before)
    return name, max(0.0, failed_at.timestamp() - mtime)


def check_ledger(ledger: chain.Ledger) -> list[Finding]:
    """``chain.ledger``: the ledger's damaged lines (torn by a crash mid-write, edited), each named by file and line;
    the other lines were read and count (a damaged line never hides the failures the good ones record)."""
    if not ledger.damaged:
        return []
    more = f" and {len(ledger.damaged) - 1} more damaged line(s)" if len(ledger.damaged) > 1 else ""
    return [Finding("chain.ledger", "warn", f"{ledger.damaged[0]}{more}; the ledger's {len(ledger.rows)} other "
                    "record(s) are counted: fix or delete the line", {"damaged": ledger.damaged[:20],
                                                                       "records": len(ledger.rows)})]


def _ledger_time(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None


def _absent(spec: Spec, run: RunPaths) -> Finding:
    if run.finished_flag.exists():
        return Finding("scheduler.finished", "ok", f"training finished ({chain.flag_text(run.finished_flag)})")
    if run.stopped_flag.exists():
        text = chain.flag_text(run.stopped_flag)
        storm = chain.stopped_code(text) == chain.RESTART_STORM  # its own code: the fix differs from a failure's
        return Finding(chain.RESTART_STORM if storm else "scheduler.stopped", "alert",
                       f"the chain stopped itself: {text}")
    return Finding("scheduler.absent", "alert", f"{spec.job_name} is not RUNNING or SCHEDULED (nothing in squeue, "
                   f"no finished flag): `opskit submit {spec.cli_name}`")


def _pending_too_long(wd: WatchdogSpec, pending: list[QueueEntry], last_running: float,
                      now: datetime) -> list[Finding]:
    """Nothing runs: since when has the chain been waiting (submission, or the last time a task ran)?"""
    limit_s = HAND_OVER_S if wd.exclusive_reservation else (
        None if wd.max_pending_hours is None else wd.max_pending_hours * 3600)
    submitted = [t.timestamp() for e in pending if (t := _slurm_time(e.submit_time))]
    if limit_s is None or not submitted:
        return []
    since = max(min(submitted), last_running)
    waited = now.timestamp() - since
    if waited <= limit_s:
        return []
    why = "the nodes are reserved for this training" if wd.exclusive_reservation else (
        f"watchdog.max_pending_hours is {wd.max_pending_hours:g}")
    return [Finding("scheduler.pending_too_long", "alert", f"nothing has run for {waited / 3600:.1f} h while "
                    f"{len(pending)} job(s) wait ({pending[0].reason.strip('()')}); {why}",
                    {"waited_s": round(waited)})]


def _queue_depth(spec: Spec, running: list[QueueEntry], entries: list[QueueEntry],
                 seconds_left: float | None) -> list[Finding]:
    """When will the last queued task end, if each one runs to its time limit?"""
    queue = chain.queue_of(entries)
    limit = _minutes(entries[0].time_limit) or spec.slurm.time_minutes
    used = sum(_minutes(e.time_used) or 0 for e in running)
    covered_h = ((queue.tasks - len(running)) * limit + max(0.0, len(running) * limit - used)) / 60
    horizon = spec.watchdog.queue_horizon_hours
    if covered_h >= horizon or (seconds_left is not None and seconds_left / 3600 <= covered_h):
        return [Finding("scheduler.queue", "ok", f"{queue.tasks} task(s) queued, about {covered_h:.1f} h of "
                        "training", {"tasks": queue.tasks, "hours": round(covered_h, 2)})]
    return [Finding("scheduler.queue", "warn", f"only {queue.tasks} task(s) queued: the last one ends in about "
                    f"{covered_h:.1f} h, within the {horizon:g} h horizon; `opskit submit {spec.cli_name} --array N`",
                    {"tasks": queue.tasks, "hours": round(covered_h, 2)})]


# --------------------------------------------------------------------------- the log


@dataclass
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


def read_log(run: RunPaths, state: WatchdogState, keep: int = HISTORY) -> LogRead | None:
    """Records and text main_log.txt gained since ``state.offset`` (at most the last NEW_RECORDS iteration
    records and NEW_TEXT bytes of text: only the end of a large gain is read); updates ``state``. None without a log.

    A file that shrank or was replaced (another inode) is read again from its start. ``keep``: iteration records
    kept in the state for the next run (spike window and throughput baseline). The last ``successfully saved
    checkpoint`` line of the new text sets ``state.saved``.

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
    history = [] if start == 0 else state.history
    records = timeline(history + new)
    if new:
        # The line was written at or before the file's mtime: an upper bound, so a hang is never reported early.
        state.last_iteration_at = info.st_mtime
    job_nodes = state.job_nodes if start else ""
    if _JOB_WORD in text and (header := last_header(text)):  # a C substring search first, not a regex scan
        state.job_nodes = header["nodes"]  # (8 MiB on a first run)
    if saved := _matches(text, "successfully saved", SAVED_LINE):
        state.saved = int(saved[-1][1])
    state.offset, state.inode, state.history = chunk.offset, info.st_ino, records[-keep:]
    state.skipped += chunk.skipped
    return LogRead(records, new, text, chunk.skipped, state.last_iteration_at, job_nodes)


def read_events(run: RunPaths, state: WatchdogState, keep: int = HISTORY) -> LogRead | None:
    """For trainers that write only TensorBoard events (Megatron's tags) under ``<run>/tensorboard``: the iteration
    records after ``state.events_iteration``; updates ``state``. None without event files or Megatron's loss tag.

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
        state.events_iteration = new[-1]["iteration"]
        state.last_iteration_at = max(f.stat().st_mtime for f in run.tensorboard.rglob("*tfevents*"))
    return LogRead(records[-keep:], new, "", 0, state.last_iteration_at)


def line_interval(records: list[dict]) -> float | None:
    """Usual seconds between two iteration lines: median s/it x median iterations between lines."""
    times = [r["elapsed_time_per_iteration_s"] for r in records[-50:] if "elapsed_time_per_iteration_s" in r]
    steps = [b["iteration"] - a["iteration"] for a, b in zip(records[-50:], records[-49:], strict=False)
             if b["iteration"] > a["iteration"]]
    if not times:
        return None
    return statistics.median(times) * (statistics.median(steps) if steps else 1)


def check_log(log: LogRead, wd: WatchdogSpec, now: datetime, running_since: datetime | None,
              save_interval: int | None = None) -> list[Finding]:
    """Log health: hang (only while ``running_since`` is set), lm loss / grad norm spikes, NaN/inf losses and nan
    or skipped iterations, throughput drops, crash lines, failed checkpoint saves. Events (spikes, NaNs, crashes,
    failed saves) are reported for the new records and text only."""
    findings: list[Finding] = []
    if log.skipped:
        findings.append(Finding("log.skipped_lines", "ok", f"{log.skipped} cut or garbled iteration line(s) skipped",
                                {"skipped": log.skipped}))
    if running_since is not None:
        findings += _hang(log, wd, now, running_since)
    if log.new:
        findings += _spikes(log, wd, save_interval) + _nan(log.new) + _throughput(log.records, len(log.new), wd)
    findings += _crashes(log.text, log.job_nodes) + _resume_fallbacks(log.text) + _save_failures(log.text)
    return findings


def _hang(log: LogRead, wd: WatchdogSpec, now: datetime, running_since: datetime) -> list[Finding]:
    interval = line_interval(log.records)
    if interval is None:
        return []
    since = max(log.last_iteration_at or 0, running_since.timestamp())
    silent = now.timestamp() - since
    if silent <= wd.hang_limit_s(interval):
        return []
    last = log.records[-1]["iteration"] if log.records else None
    return [Finding("log.hang", "alert", f"no new iteration line for {silent / 60:.0f} min while running (usually "
                    f"one every {interval:.0f} s; last: iteration {last}): a hung collective or a dead rank? Look at "
                    "py-spy dump / the node logs, then scancel and resubmit",
                    {"silent_s": round(silent), "interval_s": interval, "last_iteration": last})]


def check_stragglers(run: RunPaths, wd: WatchdogSpec, tail: int = STRAGGLER_TEXT) -> list[Finding]:
    """``log.straggler``: the latest job's last 3 forward-time lines (:mod:`opskit.rules.stragglers`, in the last
    ``tail`` bytes of main_log) name one node and local rank at ``watchdog.straggler_ratio`` or more; with
    ``watchdog.exclude_stragglers`` its node goes on the bad-node list (the next submission excludes it)."""
    text = _log_tail(run.main_log, tail)
    headers = list(JOB_HEADER.finditer(text))
    if headers:
        text = text[headers[-1].start():]
    reports = [r for line in text.splitlines() if (r := parse_slowest_rank_line(line_source(line)[2]))]
    slow = straggler(reports, wd.straggler_ratio)
    if slow is None:
        return []
    where = f"{slow.node} local rank {slow.local_rank} (rank {slow.rank}, stage {slow.stage})"
    told = f"`opskit nodes add NAME {slow.node}` keeps it out of the next task"
    if wd.exclude_stragglers:
        why = f"{datetime.now():%Y-%m-%d %H:%M:%S} straggler: {slow.ratio:.2f}x its stage's other ranks"
        told = (f"{slow.node} put on the bad-node list: the next submission excludes it"
                if chain.add_bad_nodes(run, {slow.node: why}) else f"{slow.node} was on the bad-node list already")
    return [Finding("log.straggler", "warn", f"straggler: {where} took {slow.ratio:.2f}x the forward time of its "
                    f"stage's other ranks in 3 log intervals in a row (last: iterations {slow.first}-{slow.last}, "
                    f"{slow.ms:.1f} vs {slow.others_ms:.1f} ms); {told}",
                    {"node": slow.node, "local_rank": slow.local_rank, "rank": slow.rank, "ratio": slow.ratio})]


def _log_tail(main_log: Path, tail: int) -> str:
    """The last ``tail`` bytes of ``main_log`` as text ("" when unreadable)."""
    try:
        with open_regular(main_log) as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def with_stuck_ranks(hang: Finding, main_log: Path, job_nodes: str = "", tail: int = STACK_TEXT) -> Finding:
    """The ``log.hang`` finding with the rank(s) the others wait for, from the stacks every rank printed after
    ``--stack-dump-after-mins`` (:mod:`opskit.logs.stacks`) in the last ``tail`` bytes of ``main_log``; the finding as
    it was when no stacks are there. ``job_nodes``: the running job's node list when its header is not in that tail.
    ``data["stuck"]``: one ``{"node", "local_rank", "frame"}`` per named rank."""
    text = _log_tail(main_log, tail)
    if not text:
        return hang
    if header := last_header(text):  # the running step's stacks only: an earlier step's ranks are not this hang's
        text, job_nodes = text[header.start():], header["nodes"]
    stacks = rank_stacks(text.splitlines(), _task_nodes(job_nodes))
    if not stacks:
        return hang
    stuck = stuck_ranks(stacks)
    if not stuck:
        told = f"the stacks of {len(stacks)} rank(s) single out none (innermost: {stacks[0].innermost})"
    else:
        others = [s for s in stacks if s not in stuck]
        told = "; ".join(f"{s.where} is in {s.innermost}" for s in stuck) + (
            f" while {len(others)} other rank(s) wait in {others[0].innermost}" if others else "")
    return Finding(hang.key, hang.severity, f"{hang.message}; stacks: {told}", {**hang.data, "stuck": [
        {"node": s.node, "local_rank": s.local_rank, "frame": s.innermost} for s in stuck]})


def _act(findings: list[Finding], running: list[QueueEntry], wd: WatchdogSpec) -> list[Finding]:
    """The findings once acted on: a hang's with what ends the hung task, done when ``watchdog.cancel_hung``
    (:func:`act_on_hang`); the others as they are."""
    return [act_on_hang(f, running, wd.cancel_hung) if f.key == "log.hang" else f for f in findings]


def act_on_hang(hang: Finding, running: list[QueueEntry], cancel: bool) -> Finding:
    """The ``log.hang`` finding with what ends the hung task (``scancel`` of the running task: the chain's next
    task resumes from the last save); with ``cancel`` (``watchdog.cancel_hung``), done here.

    A failed scancel is told in the finding, never raised: the hang is the news."""
    ids = [e.job_id for e in running]
    if not ids:
        return hang
    if not cancel:
        return Finding(hang.key, hang.severity, f"{hang.message}; `scancel {' '.join(ids)}` moves the chain on "
                       "(watchdog.cancel_hung: true does it)", {**hang.data, "job_ids": ids})
    try:
        client.scancel(ids)
        done = f"cancelled {', '.join(ids)} (watchdog.cancel_hung): the chain moves on from the last save"
    except client.SlurmError as e:
        done = f"scancel {' '.join(ids)} failed ({e})"
    return Finding(hang.key, hang.severity, f"{hang.message}; {done}", {**hang.data, "job_ids": ids,
                                                                        "cancelled": done.startswith("cancelled")})


def _spikes(log: LogRead, wd: WatchdogSpec, save_interval: int | None) -> list[Finding]:
    config = SpikeConfig(window=wd.spike_window, threshold=wd.spike_threshold)
    first_new = log.new[0]["iteration"]
    analysed = log.records[-(2 * wd.spike_window + len(log.new)):]
    spikes = [s for s in find_spikes(analysed, config) if s.last >= first_new]
    findings = []
    for metric, label in (("lm_loss", "lm loss"), ("grad_norm", "grad norm")):
        mine = [s for s in spikes if s.metric == metric]
        if not mine:
            continue
        s = mine[-1]
        open_ = s.recovered_at is None
        fix = remedies(mine, save_interval)[-1]
        todo = (f"; roll back to {fix.checkpoint} and restart with --skip-train-iteration-range {fix.skip_range}"
                if fix.checkpoint else "")
        severity = "alert" if metric == "lm_loss" and open_ else "warn"
        findings.append(Finding(f"log.{metric}_spike", severity, f"{label} spike at iterations {s.first}-{s.last} "
                                f"(peak {s.peak:.4g} at {s.peak_iteration}, median before {s.baseline:.4g}), "
                                + ("not recovered" if open_ else f"back to normal at {s.recovered_at}") + todo,
                                {**s.as_json(), "remedy": fix.as_json()}))
    return findings


def _nan(new: list[dict]) -> list[Finding]:
    bad_loss = [r["iteration"] for r in new if "lm_loss" in r and not math.isfinite(r["lm_loss"])]
    nan_its = sum(r.get("nan_iterations", 0) for r in new)
    skipped = sum(r.get("skipped_iterations", 0) for r in new)
    findings = []
    if bad_loss or nan_its:
        where = f"lm loss NaN/inf at iteration(s) {', '.join(map(str, bad_loss[:5]))}" if bad_loss else ""
        count = f"{nan_its} nan iteration(s) since the last check" if nan_its else ""
        findings.append(Finding("log.nan", "alert", "; ".join(p for p in (where, count) if p) + " (last: iteration "
                                f"{new[-1]['iteration']}): roll back to the checkpoint before it",
                                {"iterations": bad_loss, "nan_iterations": nan_its}))
    if skipped:
        findings.append(Finding("log.skipped_iterations", "warn", f"{skipped} skipped iteration(s) since the last "
                                "check (loss-scale overflows in fp16; many in a row mean divergence)",
                                {"skipped_iterations": skipped}))
    return findings


def _throughput(records: list[dict], new: int, wd: WatchdogSpec) -> list[Finding]:
    """Median samples/s of the last few new records against the median of those before them."""
    rates = [r.get("samples_per_second") or (r["global_batch_size"] / r["elapsed_time_per_iteration_s"]
                                             if r.get("global_batch_size") and r.get("elapsed_time_per_iteration_s")
                                             else None) for r in records]
    rates = [x for x in rates if x]
    recent_n = min(3, new)
    before = rates[-wd.spike_window - recent_n:-recent_n]
    if recent_n == 0 or len(before) < 10:
        return []
    recent, baseline = statistics.median(rates[-recent_n:]), statistics.median(before)
    if recent >= wd.throughput_drop * baseline:
        return []
    return [Finding("log.throughput", "warn", f"throughput {recent:.3g} samples/s, {recent / baseline:.0%} of the "
                    f"median {baseline:.3g} before: a slow node or a throttled GPU?",
                    {"samples_per_second": recent, "baseline": baseline})]


def _task_nodes(nodelist: str) -> list[str]:
    """A job header's node list in srun's task order (what its ``N:`` labels index); [] for none or a garbled one."""
    try:
        return expand_nodelist(nodelist) if nodelist else []
    except ValueError:
        return []


def _crashes(text: str, job_nodes: str = "") -> list[Finding]:
    """``log.crash`` for the crash lines of ``text``, each with its node where the log says it: the job's only node,
    or for a multi-node job the node of the line's srun label. ``job_nodes``: the node list of the job running where
    ``text`` starts (its header came in an earlier read)."""
    if not may_hold_crash(text):  # the common case: no split of 8 MiB into lines
        return []
    crashes, nodes = [], _task_nodes(job_nodes)
    lines = text.splitlines()
    for line in lines:
        if header := JOB_HEADER.match(line) or STEP_HEADER.match(line):
            nodes = _task_nodes(header["nodes"])
        elif may_hold_crash(line):
            crashes += find_crashes([line], nodes=nodes, signatures=SIGNATURES + SOFTWARE_ERRORS)
    if not crashes:
        return []
    first = crashes[0]
    where = f" on {first.where}" if first.where else ""
    return [Finding("log.crash", "alert", f"{len(crashes)} crash line(s) since the last check, first: "
                    f"{first.signature}{where}: {first.line.strip()[:200]}",
                    {"crashes": [c._asdict() for c in crashes[:20]]})]


def _matches(text: str, word: str, pattern: re.Pattern) -> list[re.Match]:
    """``pattern``'s match in each line of ``text`` that has one; ``word`` is in every such line, so text without it
    (the common case) is never split into lines."""
    if word not in text:
        return []
    return [m for line in text.splitlines() if word in line and (m := pattern.search(line))]


def _resume_fallbacks(text: str) -> list[Finding]:
    """The trainer's line when it resumed from an older step than ``latest`` named
    (opskit.ckpt.format.info.FALLBACK_LINE): iterations are redone, and the step it skipped is damaged."""
    found = _matches(text, "the newest complete step", FALLBACK_LINE)
    if not found:
        return []
    last = found[-1]
    return [Finding("log.resume_fallback", "alert", f"the trainer resumed from {last['tag']}, not from "
                    f"{last['broken']} ({last['problem']}): the iterations since {last['tag']} are redone; find out "
                    "what damaged it (full disk, killed copy) before the next save",
                    {"resumed_from": last["tag"], "broken": last["broken"], "problem": last["problem"],
                     "count": len(found)})]


def _save_failures(text: str) -> list[Finding]:
    """The trainer's ``error: saving global_stepN failed: ...`` lines (disk full, quota): the chain's next tasks
    would train to the same step and fail again."""
    failed = _matches(text, "saving global_step", SAVE_FAILED_LINE)
    if not failed:
        return []
    tag, reason = failed[-1].groups()
    return [Finding("log.save_failed", "alert", f"{save_failed_message(tag, reason)}; latest still names the step "
                    "before: free space (or quota) under the checkpoint dir before the next task reaches its next save",
                    {"tag": tag, "reason": reason, "failures": len(failed)})]


# --------------------------------------------------------------------------- checkpoints, disk, progress


def check_checkpoint(run: RunPaths, save_interval: int, seconds_per_iteration: float | None, running: bool,
                     wd: WatchdogSpec, now: datetime, saved_by_now: str | None = None,
                     said_saved: tuple[int, str] | None = None) -> list[Finding]:
    """The step the next job resumes from (:func:`opskit.ckpt.format.info.resume_point`, headers only): an ALERT when
    ``latest`` is unusable or names a missing or incomplete step (the next job falls back to the newest complete
    step, or fails when there is none); then that step's age against ``save_interval`` iterations at the logged
    speed.

    Args:
        saved_by_now: why a complete step must exist by now (:func:`_save_due`); then none is an ALERT
            (``checkpoint.missing``), as is a checkpoint path that is a file. None: no complete step is still ok.
        said_saved: (iteration, evidence): the last step the log or the ledger says was saved
            (:func:`_said_saved`); when its folder is gone and no step as new is complete, an ALERT
            (``checkpoint.missing``): the next job would start from an older step, or from scratch.
    """
    if run.checkpoints.exists() and not run.checkpoints.is_dir():
        return [Finding("checkpoint.missing", "alert", f"{run.checkpoints} is a file, not a folder: the next job "
                        "cannot save nor resume", {"path": str(run.checkpoints)})]
    point = resume_point(run.checkpoints)
    findings = []
    if point.problem:
        resume_from = point.step.path.name if point.step else None
        then = (f"the next job resumes from {resume_from}, the newest complete step" if resume_from else
                "no complete step is left: the next job will fail (restore one from a backup)")
        findings.append(Finding("checkpoint.incomplete", "alert", f"{point.problem}; {then}",
                                {"latest": point.latest, "problem": point.problem, "resume_from": resume_from}))
    if gone := _saved_step_gone(run, point.step, said_saved):
        return [*findings, gone]
    try:
        saved = point.step.path.stat().st_mtime if point.step else None
    except OSError:
        saved = None
    if saved is None and saved_by_now:
        what = "no checkpoint folder" if not run.checkpoints.exists() else "no complete checkpoint"
        return [*findings, Finding("checkpoint.missing", "alert", f"{what} at {run.checkpoints} although {saved_by_now}"
                                   ": deleted or moved? The next job starts from scratch (restore from a backup)",
                                   {"path": str(run.checkpoints), "evidence": saved_by_now})]
    if saved is None:
        return findings or [Finding("checkpoint.none", "ok",
                                    f"no complete checkpoint yet ({run.checkpoints / 'latest'})")]
    tag = point.step.path.name
    age = now.timestamp() - saved
    data = {"tag": tag, "age_s": round(age)}
    if not running or seconds_per_iteration is None:
        return [*findings, Finding("checkpoint.age", "ok", f"{tag} saved {age / 3600:.1f} h ago", data)]
    expected = save_interval * seconds_per_iteration
    severity = "alert" if age > 2 * wd.checkpoint_age_factor * expected else (
        "warn" if age > wd.checkpoint_age_factor * expected else "ok")
    return [*findings, Finding("checkpoint.age", severity, f"{tag} saved {age / 3600:.1f} h ago; one every "
                               f"{save_interval} iterations is {expected / 3600:.1f} h at "
                               f"{seconds_per_iteration:.3g} s/it", {**data, "expected_s": round(expected)})]


def _saved_step_gone(run: RunPaths, resume_from: StepInfo | None, said_saved: tuple[int, str] | None
                     ) -> Finding | None:
    """``checkpoint.missing`` when the step ``said_saved`` names has no folder and the resume point (``resume_from``:
    none, or an older step) is older: a folder deleted, or ``checkpoints`` replaced (a link to ``/``)."""
    if said_saved is None:
        return None
    iteration, evidence = said_saved
    tag = f"global_step{iteration}"
    newest = int(STEP_DIR.match(resume_from.path.name).group(1)) if resume_from else None
    if (run.checkpoints / tag).is_dir() or (newest is not None and newest >= iteration):
        return None
    then = f"the next job resumes from {resume_from.path.name}" if resume_from else \
        "the next job starts from scratch (random weights)"
    return Finding("checkpoint.missing", "alert", f"{run.checkpoints / tag} is gone although {evidence}: deleted or "
                   f"moved? {then[0].upper()}{then[1:]}; restore it from a backup (`opskit ckpt restore`)",
                   {"path": str(run.checkpoints), "tag": tag, "evidence": evidence,
                    "resume_from": resume_from.path.name if resume_from else None})


def _said_saved(state: WatchdogState, ledger: list[chain.TaskOutcome]) -> tuple[int, str] | None:
    """(iteration, evidence) of the last step the log said it saved, else the last one the ledger recorded as
    ``latest`` when a task ended; None when neither says any."""
    if state.saved is not None:
        return state.saved, f"the log says it was saved (successfully saved checkpoint at iteration {state.saved})"
    recorded = next((row for row in reversed(ledger) if row.checkpoint and STEP_DIR.match(row.checkpoint)), None)
    if recorded is None:
        return None
    return (int(STEP_DIR.match(recorded.checkpoint).group(1)),
            f"the ledger records it as latest when task {recorded.task} ended")


def check_save_interval(run: RunPaths, save_interval: int, ledger: list[chain.TaskOutcome],
                        state: WatchdogState) -> list[Finding]:
    """``checkpoint.save_interval``: the run's measured MTBF, save cost and iteration time, Young/Daly's interval and
    what the spec's loses (:mod:`opskit.run.history`); a warning when it loses more than
    :data:`SAVE_INTERVAL_EXCESS` of the wall time over the best one. Nothing before the first failure (no MTBF)."""
    failures = sum(row.state in chain.FAILURES for row in ledger)
    if not failures:
        return []
    measured = state.measured
    if measured is None or measured.get("failures") != failures:
        try:
            measured = state.measured = save_interval_advice(run, save_interval, ledger).as_json()
        except OSError:
            return []  # an unreadable log: its own finding says so
    hours = measured.get("hours_run") or 0.0
    advice = advise(measured.get("tasks", 0), hours, failures, measured.get("save_seconds"),
                    measured.get("iteration_seconds"), save_interval)
    if advice.optimal_interval is None or advice.lost_at_spec is None:
        return []
    excess = advice.lost_at_spec - advice.lost_at_optimal
    fix = f": set checkpoint.save_interval {advice.optimal_interval} (next submit)" \
        if excess > SAVE_INTERVAL_EXCESS else ""
    return [Finding("checkpoint.save_interval", "warn" if fix else "ok",
                    f"measured MTBF {advice.mtbf_hours:g} h ({failures} failure(s) in {hours:g} h), save "
                    f"{advice.save_seconds:g} s, iteration {advice.iteration_seconds:g} s: a save every "
                    f"{save_interval} iterations loses {advice.lost_at_spec:.2%} of the wall time, every "
                    f"{advice.optimal_interval} {advice.lost_at_optimal:.2%}{fix}", advice.as_json())]


def check_disk(run: RunPaths, wd: WatchdogSpec) -> list[Finding]:
    """Bytes and inodes used on the file system holding the run directory (fs-watchdog's check), from one
    ``statvfs`` call; bytes as ``df`` and psutil count them: used / (used + available to users)."""
    path = next((p for p in (run.checkpoints, run.root, *run.root.parents) if p.is_dir()), Path("/"))
    vfs = os.statvfs(path)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    free = vfs.f_bavail * vfs.f_frsize
    percent = 100 * used / (used + free) if used + free else 0.0
    findings = [_usage("disk.bytes", "bytes", percent, f"{free / 2**30:.1f} GiB free", path, wd)]
    if vfs.f_files:  # some file systems report no inode limit
        percent = 100 * (vfs.f_files - vfs.f_ffree) / vfs.f_files
        findings.append(_usage("disk.inodes", "inodes", percent, f"{vfs.f_ffree:,} inodes free", path, wd))
    return findings


def _usage(key: str, what: str, percent: float, free: str, path: Path, wd: WatchdogSpec) -> Finding:
    severity = "alert" if percent >= wd.disk_alert_percent else "warn" if percent >= wd.disk_warn_percent else "ok"
    return Finding(key, severity, f"{path} is at {percent:.1f}% {what} usage ({free})",
                   {"path": str(path), "percent": round(percent, 2)})


def check_progress(spec: Spec, records: list[dict]) -> tuple[list[Finding], float | None, float | None]:
    """(progress finding, seconds left, seconds per iteration), as ``opskit logs show`` computes them."""
    if not records or records[-1]["train_iters"] is None:  # TensorBoard events carry no train_iters
        return [], None, None
    state = progress(records, planned_tokens=spec.batch.samples * spec.model.seq_length)
    return ([Finding("progress", "ok", "; ".join(progress_lines(state, 20)), state.as_json())],
            state.seconds_left, state.seconds_per_iteration)


# --------------------------------------------------------------------------- one run


def run_checks(spec: Spec, now: datetime | None = None, users: list[str] | None = None) -> Report:
    """Every check, once: one squeue call (the run's jobs: :func:`chain.run_jobs`), the new bytes of
    main_log.txt, ``latest``, the file system.

    Raises:
        ChainError: ``slurm.group`` names no usable Unix group. ``SlurmError``: squeue failed otherwise.
    """
    now = now or datetime.now()
    run = RunPaths.of(spec)
    state = load_state(run)
    try:
        entries = chain.run_jobs(run, spec.job_name, client.squeue(users or chain.queue_users(spec.slurm.group)))
        error = None
    except SchedulerUnreachable as e:
        entries, error = [], e
    running = [e for e in entries if e.state == "RUNNING"]
    read = chain.ledger_of(run)  # a damaged line is a finding of its own; the good lines still count
    ledger = read.rows
    keep = max(HISTORY, 2 * spec.watchdog.spike_window + 10)
    try:
        log, log_error = read_log(run, state, keep) or read_events(run, state, keep), None
    except LogFormatError as e:
        log, log_error = None, e
    records = log.records if log else []
    findings, seconds_left, per_it = check_progress(spec, records)
    if error is not None:
        pulse = [unreachable_line(spec.job_name, error, now)]
        scheduler = [Finding("scheduler.unreachable", "warn", f"SLURM did not answer ({error}): job state unknown")]
    else:
        finished = not entries and run.finished_flag.exists()  # a finished run is neither running nor an alert
        pulse = [] if finished else pulse_lines(spec.job_name, entries, now)
        if running:
            state.last_running = now.timestamp()
        scheduler = check_scheduler(spec, run, entries, state.last_running, now, seconds_left, ledger)
    scheduler += check_chain(run, ledger) + check_ledger(read)
    started = [t for e in running if (t := _slurm_time(e.start_time))]
    run_missing = not run.root.is_dir()
    if run_missing:  # never "no log yet, ok" about a run this machine cannot see
        findings.append(_run_missing(spec, run))
    elif log_error is not None:
        findings.append(Finding("log.unreadable", "alert", f"{log_error}: nothing of the log can be checked",
                                {"path": str(run.main_log)}))
    elif log is None:
        findings.append(_no_log(run, _started(run, ledger, state)))
    else:
        findings += check_log(log, spec.watchdog, now, max(started) if started else None,
                              spec.checkpoint.save_interval)
        findings += _no_iterations(run, log, _started(run, ledger, state))
        findings = [with_stuck_ranks(f, run.main_log, state.job_nodes) if f.key == "log.hang" else f
                    for f in findings]
        findings += check_stragglers(run, spec.watchdog)
    if not run_missing:
        said_saved = _said_saved(state, ledger)
        checkpoint = check_checkpoint(run, spec.checkpoint.save_interval, per_it, bool(running), spec.watchdog, now,
                                      _save_due(run, ledger, state, records, spec.checkpoint.save_interval,
                                                said_saved), said_saved)
        state.checkpoint = next((f.data["tag"] for f in checkpoint if f.key == "checkpoint.age"), state.checkpoint)
        findings += checkpoint + check_save_interval(run, spec.checkpoint.save_interval, ledger, state)
    findings += check_disk(run, spec.watchdog)
    # The checks only looked; what the watchdog does about their findings happens here, once all are in.
    findings = _act(findings, running, spec.watchdog)
    state_error = save_state(run, state)
    report = Report(spec.name, spec.job_name, now, pulse, scheduler + findings, unreachable=error is not None,
                    unknown=("scheduler", "log.hang", "checkpoint.age") if error is not None else (),
                    main_log=run.main_log, run_missing=run_missing, state_error=state_error)
    if spec.watchdog.append_to_main_log and run.main_log.parent.is_dir():
        append_lines(run.main_log, pulse)
    return report


def _started(run: RunPaths, ledger: list[chain.TaskOutcome], state: WatchdogState) -> str | None:
    """Why the run must have a log by now (a ledger entry, the finished flag, iterations or a step the watchdog
    saw before), or None: it never started, so no log is no news."""
    if run.finished_flag.exists():
        return f"{run.finished_flag} is set"
    if ledger:
        return f"the ledger records {len(ledger)} task(s)"
    seen = state.history
    if seen and isinstance(seen[-1], dict) and "iteration" in seen[-1]:
        return f"the watchdog saw iteration {seen[-1]['iteration']}"
    if state.events_iteration is not None:
        return f"the watchdog saw iteration {state.events_iteration}"
    if state.checkpoint:
        return f"the watchdog saw {state.checkpoint}"
    return None


def _save_due(run: RunPaths, ledger: list[chain.TaskOutcome], state: WatchdogState, records: list[dict],
              save_interval: int, said_saved: tuple[int, str] | None = None) -> str | None:
    """Why a complete step must exist by now, or None. A step the log or the ledger says was saved
    (``said_saved``: :func:`_said_saved`) does; else a visible log decides (its newest iteration reached
    ``save_interval``); without one, any sign that the run started (:func:`_started`) does."""
    if said_saved:
        return f"global_step{said_saved[0]} was saved ({said_saved[1]})"
    if records:
        last = records[-1]["iteration"]
        return f"the log reached iteration {last} (one save every {save_interval})" if last >= save_interval else None
    return _started(run, ledger, state)


def _no_iterations(run: RunPaths, log: LogRead, started: str | None) -> list[Finding]:
    """``log.unreadable``: a run that started (``started``: :func:`_started`) whose main_log.txt shows no iteration
    line at all, this time or before (garbage, another file, an encoding opskit cannot read): the log checks (hang,
    spikes, NaN, progress) see nothing."""
    if log.records or not started:
        return []
    try:
        size = f"{os.stat(run.main_log).st_size:,} bytes"
    except OSError:
        size = "unreadable"
    garbled = f", {log.skipped} cut or garbled record line(s)" if log.skipped else ""
    return [Finding("log.unreadable", "warn", f"{run.main_log} ({size}{garbled}) holds no iteration line opskit can "
                    f"read although {started}: another file, damaged, or a trainer whose lines opskit does not know? "
                    "The log's checks (hang, spikes, NaN, progress) see nothing", {"path": str(run.main_log),
                                                                                  "evidence": started})]


def _no_log(run: RunPaths, started: str | None) -> Finding:
    if run.logs.exists() and not run.logs.is_dir():
        return Finding("log.missing", "alert", f"{run.logs} is a file, not a folder: no job can write its log",
                       {"path": str(run.logs)})
    if started:
        return Finding("log.missing", "alert", f"no {run.main_log} (nor TensorBoard events) although {started}: "
                       "deleted or moved? Nothing of the log can be checked", {"path": str(run.main_log),
                                                                               "evidence": started})
    return Finding("log.none", "ok", f"no {run.main_log} (nor TensorBoard events) yet")


def _run_missing(spec: Spec, run: RunPaths) -> Finding:
    what = "is a file, not a folder" if run.root.exists() else "does not exist"
    return Finding("run.missing", "alert", f"run directory {run.root} {what} (paths.output {spec.paths.output!r} from "
                   f"{spec.base_dir}): nothing of the run can be checked here; not submitted yet (`opskit submit "
                   f"{spec.cli_name}`), or paths.output names another folder than the jobs write to",
                   {"run_dir": str(run.root)})


def watch(spec: Spec, interval_s: float, on_report: Callable[[Report], int], sleep=time.sleep) -> int:
    """Run the checks once, or with ``interval_s`` > 0 again every ``interval_s`` seconds until Ctrl-C
    (KeyboardInterrupt), handing each :class:`Report` to ``on_report``.

    Returns:
        what ``on_report`` returned last (``opskit status`` returns its exit code), 0 when interrupted before it.
    """
    code = 0
    try:
        while True:
            code = on_report(run_checks(spec))
            if not interval_s:
                return code
            sleep(interval_s)
    except KeyboardInterrupt:
        return code
