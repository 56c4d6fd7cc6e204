"""Goodput: where a run's wall clock went, from its first submission to now (or to the end of its last task once
training finished), task by task, from what the run already writes.

The sources, read in one pass over ``main_log.txt`` and once from the ledger:

- ``[opskit] DATE submitted job J ...`` (``opskit submit``) and the job script's ``[opskit] DATE job J (array task T)
  nodes N: start`` / ``end, exit code X`` / ``SIGTERM: the job ends (STATE)`` lines: when each task ran;
- the trainer's ``[before the start of training step] datetime: DATE`` (Megatron's), its iteration lines (each one's
  window: the iterations since the previous line times their mean seconds, ``global batch size / samples per
  second``), and its ``time (ms) | save-checkpoint / load-checkpoint / evaluate: X`` lines;
- ``successfully saved checkpoint at iteration N`` and ``successfully loaded checkpoint ... at iteration N``: what a
  failure loses (the iterations after the task's last save, or after its resume point when it saved nothing);
  ``saving checkpoint at iteration N`` after the last iteration line: the iterations an exit trained unlogged
  (``--log-interval`` > 1), at the logged windows' median time per iteration;
- the ledger's state of each task (``FAILED``, ``NODE_FAIL``, ``TIMEOUT`` and ``CANCELLED`` lose that work).

The categories (:data:`CATEGORIES`) of each task: ``startup`` (task start to the first iteration, less loading),
``loading``, ``training`` (iteration windows less the saves and evaluations in them), ``redone`` (the training a
failure threw away: the next task trains those iterations again), ``saving`` (what saves stopped training),
``evaluation``, ``hang`` (a failed task's silence after its last iteration line, when longer than the watchdog's hang
limit), and ``idle`` (the rest: shutdown, a task that exited at once); ``queue`` is the wait before each task (from
its own job's submission, or the end of the task before it when that came later) and after the last one;
``stopped`` the time nothing of the run was queued: from the end of a task to a later submission of the next task's
job by hand. The parts sum to the wall clock: idle is what the others leave, and a task whose parts overrun its wall
(the log's whole-second dates) is noted.

Bounds, on any input: the log is streamed (:func:`opskit.fsutil.bounded_lines`: a line longer than 1 MiB is skipped
unheld; time linear in its size, memory one line plus a tuple per iteration line) and must be a regular file. A
date before :data:`EARLIEST` (an unset clock), more than a day after now, or more than :data:`CLOCK_SKEW_S` before
the latest date before it is garbage: its line counts at the latest good date before it (skipped before any) and a
note counts them; a timer or iteration time that is not a finite positive number is skipped as a garbled line.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import accumulate
from pathlib import Path

from opskit.allocation.in_job import HANG_LINE
from opskit.ckpt.format.layout import SAVED_LINE
from opskit.errors import OpskitError
from opskit.fsutil import bounded_lines, open_regular
from opskit.logs.crash import STEP_HEADER, line_source
from opskit.logs.grammar import parse_iteration_line, parse_memory_line
from opskit.logs.plot import claim_image, save_image
from opskit.run import chain
from opskit.run.incidents import IncidentsError, divergence_account, read_incidents
from opskit.run.paths import RunPaths
from opskit.spec.schema import WatchdogSpec

CATEGORIES = ("training", "redone", "saving", "loading", "startup", "evaluation", "hang", "queue", "stopped", "idle")
RESTARTED = "RESTARTED"
"""The state of a training step that the job restarted inside its allocation (opskit.allocation.in_job): its work since
its last save is lost like a failed task's, and the task goes on in its next step."""
LOSES_WORK = (*chain.FAILURES, "CANCELLED", RESTARTED)
"""Ledger states whose task's work since its last save is lost: the next task (or step) trains it again."""

_DATE = "%Y-%m-%d %H:%M:%S"
_OPSKIT = re.compile(r"^\[opskit\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:job \S+ \(array task (?P<task>\S+)\) "
                     r"nodes (?P<nodes>\S*): (?P<message>.*)"
                     r"|submitted job (?P<submitted>\S+))")
_TIMER = re.compile(r"^time \(ms\) \| (save-checkpoint|load-checkpoint|evaluate): (\d+(?:\.\d+)?)\s*$")
_TRAINING_START = re.compile(r"^\[before the start of training step\] datetime: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_SAVING = re.compile(r"^saving checkpoint at iteration +(\d+) ")
_LOADED = re.compile(r"^  successfully loaded checkpoint from .* at iteration (\d+)\s*$")
_SIGTERM_STATE = re.compile(r"^SIGTERM: the job ends \((\w+)\)")
EARLIEST = datetime(2000, 1, 1)
"""No log line of a run is dated before this: an earlier date is a node's unset clock (1970)."""
CLOCK_SKEW_S = 3600
"""How far a date may lie before the latest date above it (another node's clock, a change of summer time) before it
is taken for garbage."""
FUTURE_S = 86400
"""How far past now a date may lie (the log's local time read from another time zone) before it is garbage."""


class GoodputError(OpskitError, ValueError):
    """A run with nothing to account for yet (no task started); one line naming the log."""


@dataclass
class TaskTime:
    """One chain task's (or one training step's, after an in-job restart) wall clock split into :data:`CATEGORIES`
    (seconds; ``queue`` is the wait before it)."""

    task: str
    state: str | None
    """The ledger's (``COMPLETED``, ``FAILED``, ...); None while it runs or when the ledger has no line for it."""
    start: datetime
    end: datetime
    seconds: dict[str, float]
    iterations: int
    """Iterations it trained (logged)."""
    redone_iterations: int
    """Of those, the ones its failure lost (trained again by the next task)."""
    step: int = 0
    """The training step in its job (0 unless the job restarted training inside its allocation)."""
    max_allocated_mib: float | None = None
    """The largest ``max allocated`` of its memory lines (any rank; MiB), None without one."""
    resumed_from: int = 0
    """The iteration it loaded a checkpoint of (0: it started afresh, or loaded nothing)."""
    nodes: str = ""
    """Its nodes (its training step's, else its allocation's)."""
    reason: str = ""
    """The ledger's why (a crash's node and signature), "" without one."""
    events: list[tuple[datetime, str]] = field(default_factory=list)
    """What the job logged of it (:attr:`TaskLog.events`)."""
    clock: list[tuple[int, float]] = field(default_factory=list, repr=False)
    """(iteration, POSIX seconds) at the end of each logged window: its training start plus the windows' wall
    seconds before and with it (the log's iteration lines carry no date); what ``opskit report`` charts over time."""

    @property
    def label(self) -> str:
        """``7_1``, or ``7_1 step 1`` for a step after an in-job restart."""
        return f"{self.task} step {self.step}" if self.step else self.task

    def as_json(self) -> dict:
        return {"task": self.task, "step": self.step, "state": self.state, "nodes": self.nodes, "reason": self.reason,
                "resumed_from": self.resumed_from, "start": f"{self.start:{_DATE}}",
                "end": f"{self.end:{_DATE}}",
                "iterations": self.iterations, "redone_iterations": self.redone_iterations,
                "max_allocated_gib": (None if self.max_allocated_mib is None else
                                      round(self.max_allocated_mib / 1024, 2)),
                "hours": {name: round(s / 3600, 4) for name, s in self.seconds.items()},
                "events": [[f"{at:{_DATE}}", message] for at, message in self.events]}


@dataclass
class Goodput:
    """A run's wall clock from ``start`` (first submission, else first task start) to ``end``, by category."""

    start: datetime
    end: datetime
    tasks: list[TaskTime]
    queue_after_s: float
    """The wait after the last task (0 once training finished)."""
    notes: list[str] = field(default_factory=list)
    divergence: dict = field(default_factory=dict)
    """What divergence incidents cost (:func:`opskit.run.incidents.divergence_account`); {} without any."""

    @property
    def wall_seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def totals(self) -> dict[str, float]:
        """Category -> seconds over the whole run."""
        totals = {name: sum(t.seconds[name] for t in self.tasks) for name in CATEGORIES}
        totals["queue"] += self.queue_after_s
        return totals

    @property
    def goodput(self) -> float:
        """Training that counts over the wall clock (0.85 is 85%)."""
        return self.totals["training"] / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_json(self) -> dict:
        wall = self.wall_seconds
        # seconds next to hours: a short run's parts rounded to 0.0001 h (0.36 s) would not add up to its wall time
        return {"start": f"{self.start:{_DATE}}", "end": f"{self.end:{_DATE}}", "wall_hours": round(wall / 3600, 4),
                "wall_seconds": round(wall, 3), "goodput": round(self.goodput, 4),
                "categories": {name: {"hours": round(s / 3600, 4), "seconds": round(s, 3),
                                      "percent": round(100 * s / wall, 2) if wall else 0}
                               for name, s in self.totals.items()},
                "tasks": [t.as_json() for t in self.tasks], "notes": self.notes,
                **({"divergence": self.divergence} if self.divergence else {})}


@dataclass
class TaskLog:
    """What main_log.txt says of one task start, gathered line by line (times: the log's dates, seconds: its
    timers and iteration lines)."""

    task: str
    start: datetime
    step: int = 0
    """Its training step in the job (opskit.allocation.in_job: each in-job restart starts a new one, logged as a new
    :class:`TaskLog` of the same task)."""
    hung: bool = False
    """The in-job watchdog stopped this step for a hang: its silence after the last iteration line is one."""
    last_seen: datetime | None = None
    """Its last ``[opskit]`` line's time (its start until another comes)."""
    end: datetime | None = None
    end_state: str | None = None
    training_start: datetime | None = None
    loading_s: float = 0.0
    saving_s: float = 0.0
    evaluation_s: float = 0.0
    pending_s: float = 0.0
    """Saves and evaluations since the last iteration line (inside the next line's window, or after the last)."""
    windows: list[tuple[int, int, float, float]] = field(default_factory=list)
    """(first iteration, last iteration, wall seconds, training seconds) of each iteration line's window."""
    resumed_from: int = 0
    last_saved: int | None = None
    saves: list[float] = field(default_factory=list)
    """Each save's ``save-checkpoint`` seconds, in order."""
    reached: int = 0
    """The last iteration a ``saving checkpoint at iteration N`` line says was trained (an exit's save comes after
    iterations no line logged when ``--log-interval`` > 1)."""
    max_allocated_mib: float | None = None
    nodes: str = ""
    """Its nodes: the allocation's node list of its start line, then its training step's (the step header's)."""
    events: list[tuple[datetime, str]] = field(default_factory=list)
    """The job's own ``[opskit]`` lines about it, other than its start, step headers and end (a hang, a blamed node,
    a pre-flight exclusion, a restart, a divergence): (date, message)."""

    def __post_init__(self):
        self.last_seen = self.last_seen or self.start

    def add_iteration(self, record: dict) -> None:
        first = (self.windows[-1][1] if self.windows else self.resumed_from) + 1
        count = record["iteration"] - first + 1
        per_iteration = (record["global_batch_size"] / record["samples_per_second"]
                         if record.get("samples_per_second") else record["elapsed_time_per_iteration_s"])
        if count <= 0 or not positive_seconds(per_iteration):
            return  # a repeated or garbled line (a negative, infinite or missing time)
        wall = count * per_iteration
        self.windows.append((first, record["iteration"], wall, max(wall - self.pending_s, 0.0)))
        self.pending_s = 0.0

    def resumed(self, iteration: int) -> None:
        """The ``loaded checkpoint ... at iteration N`` line. Rank 0 prints it and the last rank the iteration lines:
        on several nodes the first iteration line can reach main_log.txt before it, its window then counted from the
        previous resume point; that window is cut to start after ``iteration`` (its time scaled to the count)."""
        if self.windows and self.windows[0][0] == self.resumed_from + 1 <= iteration < self.windows[0][1]:
            first, last, wall, trained = self.windows[0]
            keep = (last - iteration) / (last - first + 1)
            self.windows[0] = (iteration + 1, last, wall * keep, trained * keep)
        self.resumed_from = iteration

    def add_timer(self, name: str, seconds: float) -> None:
        if not math.isfinite(seconds):
            return  # a garbled timer (400 nines read as inf)
        if name == "load-checkpoint":
            self.loading_s += seconds
            return
        if name == "save-checkpoint":
            self.saving_s += seconds
            self.saves.append(seconds)
        else:
            self.evaluation_s += seconds
        if self.training_start is not None:
            self.pending_s += seconds


def positive_seconds(seconds: float | None) -> bool:
    """Whether a measured time can be one: a finite number above 0 (not None, NaN, inf or negative: a garbled line's,
    or one kept from an older opskit's reading)."""
    return seconds is not None and 0 < seconds < math.inf


@dataclass
class LogDates:
    """The log's dates as they are read, each checked against those before it (module docstring): the garbage ones
    are counted and the first kept for a note."""

    now: datetime
    latest: datetime | None = None
    bad: int = 0
    first_bad: str | None = None

    def read(self, text: str) -> datetime | None:
        """``text`` (``%Y-%m-%d %H:%M:%S``) as a date; None when it is none. A garbage date (counted) reads as the
        latest good date before it (None before any): the line's event happened, only its date is wrong."""
        try:
            at = datetime.strptime(text, _DATE)
        except ValueError:
            return None
        if (at < EARLIEST or at > self.now + timedelta(seconds=FUTURE_S)
                or (self.latest is not None and at < self.latest - timedelta(seconds=CLOCK_SKEW_S))):
            self.bad += 1
            self.first_bad = self.first_bad or text
            return self.latest
        self.latest = max(self.latest or at, at)
        return at

    def note(self, log: Path) -> list[str]:
        """The note on the garbage dates, [] when there were none."""
        if not self.bad:
            return []
        return [f"{log}: {self.bad} line(s) with an impossible date (first: {self.first_bad}; before {EARLIEST:%Y}, "
                f"a day after now, or over {CLOCK_SKEW_S // 60} min before an earlier line's) taken at the date of "
                "the line before"]


@dataclass
class TaskLogs:
    """What :func:`read_task_logs` found in main_log.txt."""

    first_submit: datetime | None
    tasks: list[TaskLog]
    submitted: dict[str, datetime]
    """Job id -> when ``opskit submit`` submitted it (its ``submitted job J`` line)."""
    dates: LogDates


def read_task_logs(log: Path, now: datetime | None = None) -> TaskLogs:
    """The ``submitted`` lines' times and every task start's :class:`TaskLog`, in one pass over ``log`` (also
    :mod:`opskit.history.measures`'s reading). Lines cut or garbled (a crash mid-write, bad bytes) are skipped; a line
    with a garbage date (:class:`LogDates`, against ``now``: default the current time) counts at the date before it.

    Raises:
        FileNotFoundError: no log. UnreadableFileError: not a regular file (a folder, ``/dev/zero``). OSError: the
            log cannot be read.
    """
    found = TaskLogs(None, [], {}, LogDates(now or datetime.now()))
    current: TaskLog | None = None
    with open_regular(log) as f:
        for raw in bounded_lines(f):
            if raw.startswith("[opskit] "):
                current = _opskit_line(raw, found, current)
                continue
            if current is None:
                continue
            _trainer_line(line_source(raw.rstrip("\n"))[2], current, found.dates)
    return found


def _opskit_line(raw: str, found: TaskLogs, current: TaskLog | None) -> TaskLog | None:
    m = _OPSKIT.match(raw)
    if m is None or (at := found.dates.read(m[1])) is None:
        return current
    tasks = found.tasks
    if m["task"] is None:  # a submission
        found.first_submit = found.first_submit or at
        found.submitted.setdefault(m["submitted"], at)
        return current
    message, task = m["message"].rstrip(), m["task"]
    if message == "start":
        tasks.append(TaskLog(task, at, nodes=m["nodes"]))
        return tasks[-1]
    if current is not None and current.task == task:
        current.last_seen = at
        if step := STEP_HEADER.match(raw):
            if step["step"] == "0":
                current.nodes = step["nodes"]
                return current
            current.end, current.end_state = at, RESTARTED  # an in-job restart: the step before ends here
            tasks.append(TaskLog(task, at, step=int(step["step"]), nodes=step["nodes"]))
            return tasks[-1]
        if message.startswith(HANG_LINE):
            current.hung = True
        if message.startswith("end, exit code"):
            current.end = at
        elif state := _SIGTERM_STATE.match(message):
            current.end, current.end_state = at, state[1]
        else:
            current.events.append((at, message))
    return current


def _trainer_line(text: str, task: TaskLog, dates: LogDates) -> None:
    if text.startswith(" iteration"):
        if (record := parse_iteration_line(text)) is not None:
            task.add_iteration(record)
    elif text.startswith("time (ms)"):
        if m := _TIMER.match(text):
            task.add_timer(m[1], float(m[2]) / 1000)
    elif text.startswith("[before the start of training step]"):
        if (m := _TRAINING_START.match(text)) and (at := dates.read(m[1])):
            task.training_start = at
    elif text.startswith("saving checkpoint"):
        if m := _SAVING.match(text):
            task.reached = max(task.reached, int(m[1]))
    elif text.startswith("[Rank "):
        if (memory := parse_memory_line(text)) is not None:
            task.max_allocated_mib = max(task.max_allocated_mib or 0.0, memory["max_allocated_mib"])
    elif text.startswith("  successfully"):
        if m := SAVED_LINE.match(text):
            task.last_saved = int(m[1])
        elif m := _LOADED.match(text):
            task.resumed(int(m[1]))


def account(run: RunPaths, watchdog: WatchdogSpec | None = None, now: datetime | None = None) -> Goodput:
    """The run's :class:`Goodput`.

    Args:
        watchdog: the spec's watchdog section: its hang limit tells a hang from a failed task's shutdown (default:
            the section's defaults).
        now: the end of the account while training has not finished (default: the current time).

    Raises:
        GoodputError: no task of the run has started (no log, or no ``[opskit] ... start`` line in it).
        ChainError: a ledger line that is not a record (naming the file and line).
        UnreadableFileError: the log is a folder, a device or a FIFO. OSError: the log cannot be read.
    """
    watchdog = watchdog or WatchdogSpec()
    now = now or datetime.now()
    if not run.main_log.exists() and not run.main_log.is_symlink():
        raise GoodputError(f"{run.main_log}: no such file: no task of this run has started")
    found = read_task_logs(run.main_log, now)
    logs = found.tasks
    if not logs:
        raise GoodputError(f"{run.main_log}: no '[opskit] ... start' line: no task of this run has started")
    states = _ledger_states(chain.read_ledger(run), logs)
    finished = run.finished_flag.exists()
    first_submit = found.first_submit
    notes = [] if first_submit else [f"{run.main_log}: no 'submitted' line (a run submitted before opskit wrote it): "
                                     "the account starts at the first task's start"]
    notes += found.dates.note(run.main_log)
    tasks, previous_end = [], first_submit or logs[0].start
    for i, log in enumerate(logs):
        is_last = i == len(logs) - 1
        end = log.end or states[i][1] or (now if is_last else logs[i + 1].start)
        task = _split(log, states[i][0] or log.end_state, end, watchdog)
        task.reason = states[i][2]
        task.seconds["stopped"], waiting_since = _stopped(previous_end, found.submitted.get(_job_of(log.task)))
        task.seconds["queue"] = max((log.start - waiting_since).total_seconds(), 0.0)
        notes += _overrun_note(task)
        tasks.append(task)
        previous_end = max(previous_end, end)
    end = previous_end if finished else max(now, previous_end)
    try:
        incidents = read_incidents(run)
    except IncidentsError as e:
        incidents, notes = [], [*notes, str(e)]
    return Goodput(first_submit or logs[0].start, end, tasks, (end - previous_end).total_seconds(), notes,
                   divergence_account(incidents) if incidents else {})


def _job_of(task: str) -> str:
    """The job a task belongs to: ``7`` of ``7_1`` (the job script's ``ARRAYJOB_TASK``)."""
    return task.rsplit("_", 1)[0]


def _stopped(previous_end: datetime, submitted: datetime | None) -> tuple[float, datetime]:
    """(seconds nothing of the run was queued, when the task's queue wait began): a job submitted after the task
    before it ended (by hand) waited only from its submission; the time between is the chain's stop, not queue."""
    if submitted is None or submitted <= previous_end:
        return 0.0, previous_end
    return (submitted - previous_end).total_seconds(), submitted


def summary(run: RunPaths, watchdog: WatchdogSpec | None = None) -> dict:
    """The run's goodput for ``opskit status --json``: :meth:`Goodput.as_json` without the per-task list, or
    ``{"error": "<one line>"}`` when there is none to give (no task yet, an unreadable ledger or log)."""
    try:
        account_json = account(run, watchdog).as_json()
    except (OpskitError, OSError) as e:
        return {"error": str(e)}
    account_json.pop("tasks")
    return account_json


def _ledger_states(rows: list[chain.TaskOutcome], logs: list[TaskLog]
                   ) -> list[tuple[str | None, datetime | None, str]]:
    """(ledger state, ledger time, ledger reason) of each task start, matched in order by task id (a requeued task
    starts twice and has a line per run)."""
    by_task: dict[str, list[chain.TaskOutcome]] = {}
    for row in rows:
        by_task.setdefault(row.task, []).append(row)
    matched = []
    for log in logs:
        if log.end_state == RESTARTED:  # a step the job restarted: the task's ledger row is its last step's
            matched.append((RESTARTED, log.end, ""))
            continue
        row = by_task.get(log.task, []).pop(0) if by_task.get(log.task) else None
        at = None
        if row is not None:
            try:
                at = datetime.strptime(row.time, _DATE)
            except ValueError:
                at = None
        matched.append((row.state if row else None, at, row.reason if row else ""))
    return matched


def _split(log: TaskLog, state: str | None, end: datetime, watchdog: WatchdogSpec) -> TaskTime:
    """One task's seconds by category (queue and stopped left at 0)."""
    wall = max((end - log.start).total_seconds(), 0.0)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds.update(saving=log.saving_s, loading=log.loading_s, evaluation=log.evaluation_s)
    if log.training_start is None:  # it never trained: a start-up failure, or a task that exited at once
        seconds["idle" if state == "SKIPPED" else "startup"] = max(wall - log.loading_s, 0.0)
        return _task_time(log, state, end, seconds)
    seconds["startup"] = max((log.training_start - log.start).total_seconds() - log.loading_s, 0.0)
    tail = _unlogged_tail(log, end)
    windows = log.windows + [tail] if tail else log.windows
    iterations = sum(last - first + 1 for first, last, _, _ in windows)
    training = sum(w[3] for w in windows)
    redone_iterations = 0
    if state in LOSES_WORK:
        cut = log.last_saved if log.last_saved is not None else log.resumed_from
        lost = [(max(first, cut + 1), last, trained * (last - max(first, cut + 1) + 1) / (last - first + 1))
                for first, last, _, trained in windows if last > cut]
        redone_iterations = sum(last - first + 1 for first, last, _ in lost)
        seconds["redone"] = sum(s for _, _, s in lost)
        seconds["hang"] = _hang_seconds(log, end, watchdog, tail[2] if tail else 0.0)
    seconds["training"] = training - seconds["redone"]
    seconds["idle"] = max(wall - sum(seconds.values()), 0.0)
    ends = accumulate((w[2] for w in log.windows), initial=log.training_start.timestamp())
    next(ends)  # the training start: each window's end is the sum up to and with it
    clock = [(w[1], at) for w, at in zip(log.windows, ends, strict=True)]
    return _task_time(log, state, end, seconds, iterations, redone_iterations, clock)


def _task_time(log: TaskLog, state: str | None, end: datetime, seconds: dict[str, float], iterations: int = 0,
               redone_iterations: int = 0, clock: list[tuple[int, float]] | None = None) -> TaskTime:
    """The :class:`TaskTime` of ``log`` with what its lines told of it (step, memory, resume point, nodes, events)."""
    return TaskTime(log.task, state, log.start, end, seconds, iterations, redone_iterations, log.step,
                    log.max_allocated_mib, log.resumed_from, log.nodes, events=log.events, clock=clock or [])


def _silence_after_last_line(log: TaskLog, end: datetime) -> float:
    """Seconds from the task's last iteration line to its end, less the saves and evaluations after that line."""
    last_line = log.training_start.timestamp() + sum(w[2] for w in log.windows)
    return end.timestamp() - last_line - log.pending_s


def _unlogged_tail(log: TaskLog, end: datetime) -> tuple[int, int, float, float] | None:
    """The iterations trained after the last iteration line that a later ``saving checkpoint`` line names (an exit's
    save at ``--log-interval`` > 1), as one more window: their count at the median training seconds per iteration
    of the logged windows, at most the silence after the last line; None when there are none."""
    if not log.windows or log.reached <= log.windows[-1][1]:
        return None
    first = log.windows[-1][1] + 1
    per_iteration = statistics.median(trained / (last - start + 1) for start, last, _, trained in log.windows)
    seconds = max(min((log.reached - first + 1) * per_iteration, _silence_after_last_line(log, end)), 0.0)
    return first, log.reached, seconds, seconds


def _hang_seconds(log: TaskLog, end: datetime, watchdog: WatchdogSpec, tail_s: float) -> float:
    """A failed task's silence after its last iteration line (less the training of ``tail_s``, iterations trained
    after it), when longer than the watchdog's hang limit for its iteration lines' interval; else 0 (its shutdown
    is idle)."""
    if not log.windows:
        return 0.0
    silence = _silence_after_last_line(log, end) - tail_s
    interval = statistics.median(w[2] for w in log.windows)
    return silence if log.hung or silence > watchdog.hang_limit_s(interval) else 0.0


def _overrun_note(task: TaskTime) -> list[str]:
    """A task whose parts overrun its wall by more than 1% (the log's dates have whole seconds)."""
    wall = (task.end - task.start).total_seconds()
    parts = sum(s for name, s in task.seconds.items() if name not in ("queue", "stopped"))
    if parts > wall * 1.01 + 2:
        return [f"task {task.task}: its parts add up to {parts:.0f} s of its {wall:.0f} s"]
    return []


def write_plot(goodput: Goodput, path: Path, force: bool = False) -> None:
    """An image (the suffix picks PNG, JPEG, SVG or PDF): one horizontal bar per task (hours, queue wait first),
    coloured by category. ``path`` is claimed as ``opskit logs plot`` claims its images (checked before anything is
    drawn): a new file, or with ``force`` one opskit drew.

    Raises:
        LogFormatError: a suffix that names no image format. OutputRefusedError: ``path`` exists and opskit did not
            write it, or ``force`` is not given; a folder, ``/``. OSError: the file cannot be written.
    """
    fmt = claim_image(path, force)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("queue", "startup", "loading", "training", "redone", "saving", "evaluation", "hang", "stopped", "idle")
    colours = {"queue": "#bbbbbb", "startup": "#f0c05a", "loading": "#e89f3c", "training": "#3a9d4f",
               "redone": "#d64541", "saving": "#4a78c2", "evaluation": "#8e6cc0", "hang": "#7a1f1f",
               "stopped": "#f4f4f4", "idle": "#e6e6e6"}
    tasks = goodput.tasks
    figure, axes = plt.subplots(figsize=(10, 1.8 + 0.45 * len(tasks)))
    for category in order:
        left = [sum(t.seconds[c] for c in order[:order.index(category)]) / 3600 for t in tasks]
        axes.barh([t.label for t in tasks], [t.seconds[category] / 3600 for t in tasks], left=left,
                  color=colours[category], label=category)
    axes.invert_yaxis()
    axes.set_xlabel("hours")
    axes.set_title(f"goodput {goodput.goodput:.1%} of {goodput.wall_seconds / 3600:.2f} h")
    figure.legend(ncol=len(order), fontsize="small", loc="lower center", frameon=False)
    figure.tight_layout(rect=(0, 0.12 / (1 + 0.25 * len(tasks)), 1, 1))
    try:
        save_image(figure, Path(path), fmt)
    finally:
        plt.close(figure)
