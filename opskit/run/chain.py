"""The job chain: which queued jobs are a run's, and the state its tasks share in the run directory.

- identity: a job is a run's by its comment, ``opskit-run:<run directory>`` (``opskit-cron:`` for the cron job),
  which the rendered script's ``#SBATCH --comment`` gives every task and resubmission; jobs without an opskit comment
  (submitted by opskit before comments, or at a site that rewrites comments) are the run's when their name is the
  spec's job name and their batch script lies inside the run directory. Never by name alone: two runs of one spec
  name (two directories, two members of a ``slurm.group``) never touch each other's jobs;
- the run directory's ownership: opskit writes only into a run directory it created (``.opskit`` marker) or one an
  earlier opskit rendered a job script into;
- flags: the kill switch (running task saves and exits, queued ones exit at start), the finished flag (the trainer
  wrote it: every later task exits 0 at start) and the stopped flag (``slurm.max_failures`` consecutive failures);
- the failure ledger ``ledger.jsonl``: one line per task (COMPLETED, TIMEOUT, FAILED with exit code, NODE_FAIL: a
  node of the task went down, CANCELLED, SKIPPED) and ALERT lines, written by each task (:mod:`opskit.allocation.job`,
  no torch);
- the bad-node list ``bad-nodes.txt``: nodes whose log showed a GPU/NCCL crash (:mod:`opskit.logs.crash`), excluded by
  the next submission.

Accounting (``sacct``) is often off (the local SLURM prints "Slurm accounting storage is disabled"), and BigScience's
tools never used it: each task records its own outcome instead.
"""

from __future__ import annotations

import grp
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from opskit.ckpt.format.layout import latest_state
from opskit.errors import OpskitError
from opskit.fsutil import (
    OutputRefusedError,
    append_lines,
    atomic_write_text,
    bounded_lines,
    has_marker,
    open_regular,
    parse_json,
    read_bounded,
    write_marker,
)
from opskit.logs.crash import Crash, find_crashes
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.slurm.client import QueueEntry

STATES = ("COMPLETED", "TIMEOUT", "FAILED", "NODE_FAIL", "CANCELLED", "SKIPPED", "ALERT")
FAILURES = ("FAILED", "NODE_FAIL", "TIMEOUT")
_QUEUED = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ChainError(OpskitError, ValueError):
    """Unreadable chain state (ledger line, bad-node list) or a bad node name; one line naming the file."""


# --------------------------------------------------------------------------- the queue


def group_users(group: str) -> list[str]:
    """Members of a Unix group (``getent group six``): the users whose jobs may belong to a shared training.

    Raises:
        ChainError: no such group, or a group without listed members.
    """
    try:
        members = grp.getgrnam(group).gr_mem
    except KeyError:
        raise ChainError(f"slurm.group {group!r}: no such Unix group here (getent group {group})") from None
    if not members:
        raise ChainError(f"slurm.group {group!r} lists no members (getent group {group}): add them, or drop the "
                         "field to look at your own jobs only")
    return list(members)


def array_tasks(job_id: str) -> int:
    """Tasks a squeue row stands for: 1 for ``711114_4`` or ``711114``, 4 for ``682842_[2-5%1]``."""
    match = re.fullmatch(r"\d+_\[([^\]]*)\]", job_id)
    if not match:
        return 1
    total = 0
    for part in match.group(1).split("%", 1)[0].split(","):
        first, _, last = part.partition("-")
        step = 1
        if ":" in last:
            last, step_text = last.split(":", 1)
            step = int(step_text)
        total += (int(last) - int(first)) // step + 1 if last else 1
    return total


@dataclass(frozen=True)
class Queue:
    """The spec's jobs in one ``squeue`` answer."""

    entries: list[QueueEntry]

    @property
    def tasks(self) -> int:
        """Tasks running or pending (a pending ``[2-5%1]`` row counts 4)."""
        return sum(array_tasks(e.job_id) for e in self.entries)

    @property
    def last_job(self) -> str | None:
        """The newest job (array) id: a new submission goes after it."""
        ids = sorted({int(e.array_id) for e in self.entries if e.array_id.isdigit()})
        return str(ids[-1]) if ids else None


_COMMENT_PREFIXES = {"train": "opskit-run:", "cron": "opskit-cron:"}


def job_comment(run: RunPaths, kind: str = "train") -> str:
    """The ``--comment`` of a run's jobs (``squeue -o %k`` shows it): ``opskit-run:<run directory>`` for the training
    chain, ``opskit-cron:<run directory>`` for the cron job.

    Raises:
        ChainError: a run directory with a control character (a squeue row could not carry it).
    """
    if re.search(r"[\x00-\x1f\x7f]", str(run.root)):
        raise ChainError(f"paths.output {str(run.root)!r}: a control character in the run directory; SLURM's queue "
                         "listing could not name the run's jobs: choose a plain path")
    return _COMMENT_PREFIXES[kind] + str(run.root)


def run_jobs(run: RunPaths, job_name: str, entries: list[QueueEntry], kind: str = "train") -> list[QueueEntry]:
    """The rows of ``entries`` (any state) that are the run's jobs of ``kind`` (``train`` or ``cron``): their comment
    is :func:`job_comment`; or, with no opskit comment (a job submitted by opskit before comments, or at a site whose
    submit plugin rewrites comments), their name is ``job_name`` and their batch script lies inside the run directory.

    Raises:
        ChainError: a run directory no job comment can carry (:func:`job_comment`).
    """
    comment, inside = job_comment(run, kind), f"{run.root}/"
    opskit = tuple(_COMMENT_PREFIXES.values())
    return [e for e in entries if (e.comment == comment if e.comment.startswith(opskit) else
                                   e.name == job_name and e.command.startswith(inside))]


def queue_of(entries: list[QueueEntry]) -> Queue:
    """The rows that are not over yet (a COMPLETING job may still hold its nodes)."""
    return Queue([e for e in entries if e.state in _QUEUED])


def queue_users(group: str | None) -> list[str] | None:
    """Whose jobs to list: the members of ``slurm.group`` (SLURM may hide other users' jobs, and one member may have
    to chain after another's), or None for squeue's default.

    Raises:
        ChainError: unknown group.
    """
    return group_users(group) if group else None


def run_queue(run: RunPaths, job_name: str, group: str | None = None) -> Queue:
    """The run's running and pending training jobs from one ``squeue`` call (of the members of ``group`` when
    given).

    Raises:
        ChainError: unknown group. ``SchedulerUnreachable`` / ``SlurmError`` from squeue.
    """
    return queue_of(run_jobs(run, job_name, client.squeue(queue_users(group))))


def control(run: RunPaths, job_name: str, group: str | None, action: str) -> list[str]:
    """``cancel``, ``hold`` or ``release`` every job (array) of the run's chain; returns the job ids acted on.

    Hold and release touch pending jobs only (``scontrol hold`` keeps the job's queue age, unlike a resubmission).

    Raises:
        ValueError: an unknown action. ``SlurmError`` from scancel / scontrol.
    """
    if action not in ("cancel", "hold", "release"):
        raise ValueError(f"{action}: expected cancel, hold or release")
    entries = run_queue(run, job_name, group).entries
    if action != "cancel":
        entries = [e for e in entries if e.state == "PENDING"]
    ids = sorted({e.array_id for e in entries}, key=int)
    if ids and action == "cancel":
        client.scancel(ids)
    elif ids:
        client.scontrol(action, ids)
    return ids


# --------------------------------------------------------------------------- the run directory

# The line every job script opskit renders carries (opskit/slurm/templates/*.slurm): how a run directory from before
# the marker is recognised as opskit's.
RENDERED_BY = "# Rendered by `opskit "


def rendered_by_opskit(script: Path) -> bool:
    """Whether ``script`` is a job script opskit rendered (a line of its header starts with :data:`RENDERED_BY`)."""
    try:
        with open_regular(script) as f:
            head = f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return False
    return any(line.startswith(RENDERED_BY) for line in head.splitlines())


def claim_run_dir(run: RunPaths, what: str, write: bool = True) -> str | None:
    """Check that opskit may write into the run directory and, with ``write``, create it and put opskit's marker
    (``.opskit``, naming the command ``what``) in it.

    Allowed: a missing or empty folder, a folder with opskit's marker, or a folder from before the marker that holds
    a job script an earlier opskit rendered (``slurm/train.slurm`` or ``cron/cron.slurm``): it gets the marker. A
    folder with anything else is the user's: refused, since submitting writes slurm/, logs/ and checkpoints/ there.

    Returns:
        a note when an earlier opskit's run directory is taken (unmarked, with a job script opskit rendered).

    Raises:
        OutputRefusedError: ``paths.output`` is a file, or a non-empty folder opskit did not write.
    """
    root = run.root
    if has_marker(root):
        return None
    if root.exists() and not root.is_dir():
        raise OutputRefusedError(f"{root}: paths.output exists and is not a folder; choose another paths.output")
    earlier = any(rendered_by_opskit(script) for script in (run.script, run.cron_script))
    if root.is_dir() and not earlier and any(root.iterdir()):
        raise OutputRefusedError(f"{root}: paths.output exists and holds files opskit did not write (no .opskit "
                                 "marker, no job script rendered by opskit); choose another paths.output (opskit "
                                 "writes runs only into folders it created)")
    if write:
        root.mkdir(parents=True, exist_ok=True)
        write_marker(root, what)
    if earlier:
        return (f"{root} holds a job script of an earlier opskit: taken as opskit's run directory (it gets the "
                ".opskit marker)")
    return None


def claim_state_dir(run: RunPaths, folder: Path, what: str) -> None:
    """Create ``folder`` (opskit's own state inside the run directory: ``watchdog/``) when it is missing, in a run
    directory opskit may write to (:func:`claim_run_dir`, which creates and marks a missing one) or one that holds a
    run's logs (a run of an older opskit or of another tool that is watched); never in any other folder (a
    ``paths.output`` that links to ``/`` or names a folder of the user's).

    Raises:
        OutputRefusedError: the run directory is none of those (naming it and ``paths.output``).
    """
    if folder.is_dir():
        return
    if not run.logs.is_dir():
        try:
            claim_run_dir(run, what)
        except OutputRefusedError:
            raise OutputRefusedError(f"{run.root}: holds files opskit did not write and no logs/ of a run; "
                                     f"{folder.name}/ not created there (does paths.output name the run?)") from None
    folder.mkdir(exist_ok=True)


# --------------------------------------------------------------------------- flags


def set_kill_switch(run: RunPaths, on: bool) -> bool:
    """Turn the kill switch on (create the file) or off (remove it); returns whether anything changed.

    Raises:
        OutputRefusedError: ``paths.output`` is not opskit's run directory (:func:`claim_run_dir`).
    """
    claim_run_dir(run, "kill-switch", write=on)
    if on == run.kill_switch.exists():
        return False
    if on:
        atomic_write_text(run.kill_switch, f"{datetime.now():%Y-%m-%d %H:%M:%S} opskit kill-switch on\n")
    else:
        run.kill_switch.unlink(missing_ok=True)
    return True


def flag_text(path: Path) -> str:
    """First line of a flag file (of its first 4 KiB), for messages; the path when it has none or is unreadable (a
    folder, a device: the flag is on all the same, it exists)."""
    try:
        with open_regular(path) as f:
            text = f.read(4096).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else str(path)


# --------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class TaskOutcome:
    """One ledger line. ``task`` is ``ARRAYID_TASKID``; ``nodes`` SLURM's node list (``r7i5n[2-3]``)."""

    time: str
    job_id: str
    task: str
    state: str
    exit_code: int | None = None
    nodes: str = ""
    reason: str = ""
    checkpoint: str | None = None
    """``latest``'s tag when the task ended (``""``: none yet); None in lines written before it was recorded."""

    @classmethod
    def from_json(cls, data: object) -> TaskOutcome:
        """The record a parsed ledger line holds.

        Raises:
            ValueError: not an object of the record's fields with their types (``"time": 5``, an unknown key).
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        kinds = {"time": str, "job_id": str, "task": str, "state": str, "exit_code": (int, type(None)), "nodes": str,
                 "reason": str, "checkpoint": (str, type(None))}
        for key, value in data.items():
            if key not in kinds:
                raise ValueError(f"unknown field {key!r}")
            if not isinstance(value, kinds[key]) or isinstance(value, bool):
                raise ValueError(f"{key} is {json.dumps(value)[:40]}, expected {_kind_name(kinds[key])}")
        missing = [key for key in ("time", "job_id", "task", "state") if key not in data]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        return cls(**data)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", int: "an integer", type(None): "null"}[k] for k in kinds)


MAX_LEDGER = 64 << 20
"""Bytes a ledger may have: a line per task (~200 bytes) gives room for 300,000 tasks, far past any chain; a larger
file is not opskit's ledger and is not read."""


@dataclass(frozen=True)
class Ledger:
    """The ledger as read: its records, oldest first, and one ``<file>:<line>: why`` per line that is not one (torn
    by a crash mid-write, edited by hand)."""

    rows: list[TaskOutcome]
    damaged: list[str]


def record(run: RunPaths, outcome: TaskOutcome) -> None:
    """Append one line to the ledger: a single O_APPEND write, so concurrent writers never interleave a line."""
    if outcome.state not in STATES:
        raise ChainError(f"ledger state {outcome.state!r}: expected one of {', '.join(STATES)}")
    run.root.mkdir(parents=True, exist_ok=True)
    append_lines(run.ledger, [json.dumps(asdict(outcome), separators=(",", ":"))])


def ledger_of(run: RunPaths) -> Ledger:
    """Every ledger record, and each damaged line named (:class:`Ledger`): a damaged line never hides the others.
    The file must be a regular one of at most :data:`MAX_LEDGER` bytes, else no record is read and ``damaged`` says
    why. Memory: the file and its records; time: linear in its size."""
    try:
        data = read_bounded(run.ledger, MAX_LEDGER)
    except FileNotFoundError:
        return Ledger([], [])
    except OSError as e:
        return Ledger([], [f"{run.ledger}: unreadable ({e.strerror or e})"])
    rows, damaged = [], []
    for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):  # bad bytes: that line only
        if not line.strip():
            continue
        try:
            rows.append(TaskOutcome.from_json(parse_json(line)))
        except ValueError as e:
            damaged.append(f"{run.ledger}:{number}: not a ledger record ({str(e)[:120]})")
    return Ledger(rows, damaged)


def read_ledger(run: RunPaths) -> list[TaskOutcome]:
    """Every ledger line, oldest first ([] without a ledger): for accounts that must not leave a task out.

    Raises:
        ChainError: a line that is not a ledger record (naming the file and line), or a ledger that is not a regular
            file of at most :data:`MAX_LEDGER` bytes.
    """
    ledger = ledger_of(run)
    if ledger.damaged:
        raise ChainError(ledger.damaged[0])
    return ledger.rows


def consecutive_failures(rows: list[TaskOutcome]) -> list[TaskOutcome]:
    """The failed tasks (FAILED, NODE_FAIL, TIMEOUT) since the last COMPLETED one; SKIPPED, CANCELLED and ALERT lines
    neither count nor break the run of failures."""
    failed: list[TaskOutcome] = []
    for row in rows:
        if row.state == "COMPLETED":
            failed = []
        elif row.state in FAILURES:
            failed.append(row)
    return failed


STARTS = ("COMPLETED", *FAILURES)
"""Ledger states of a task that started training (SKIPPED tasks exited at start, CANCELLED ones were the user's)."""


def stalled_starts(rows: list[TaskOutcome]) -> list[TaskOutcome]:
    """The latest task starts in a row that each left ``latest`` where the start before them left it (a restart
    storm); a start whose checkpoint is unknown (a ledger line from before it was recorded) ends the run of them."""
    stalled: list[TaskOutcome] = []
    before = ""
    for row in (r for r in rows if r.state in STARTS):
        if row.checkpoint is not None and row.checkpoint == before:
            stalled.append(row)
        else:
            stalled = []
        before = row.checkpoint if row.checkpoint is not None else before
    return stalled


def _latest_tag(run: RunPaths) -> str:
    """``latest``'s tag in the run's checkpoint folder, ``""`` without one or when unusable."""
    return latest_state(run.checkpoints)[0] or ""


# --------------------------------------------------------------------------- bad nodes


def check_node_name(node: str) -> str:
    """``node`` if it is a plausible host name (it reaches an ``#SBATCH --exclude`` line).

    Raises:
        ChainError: anything else.
    """
    if not _NODE_NAME.fullmatch(node):
        raise ChainError(f"node {node!r}: expected a host name (letters, digits, . _ -)")
    return node


def read_bad_nodes(run: RunPaths) -> dict[str, str]:
    """Bad node -> why, from ``bad-nodes.txt`` (``node<TAB>why`` lines; ``#`` comments; {} without one).

    Raises:
        ChainError: a line without a host name (naming the file and line); a list that is not a regular file of at
            most :data:`opskit.fsutil.MAX_SMALL_FILE` bytes.
    """
    try:
        text = read_bounded(run.bad_nodes).decode(errors="replace")
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ChainError(f"{run.bad_nodes}: unreadable ({e.strerror or e}); expected `node<TAB>why` lines") from None
    nodes = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        node, _, why = line.partition("\t")
        try:
            nodes[check_node_name(node.strip())] = why.strip()
        except ChainError as e:
            raise ChainError(f"{run.bad_nodes}:{number}: {e}") from None
    return nodes


def write_bad_nodes(run: RunPaths, nodes: dict[str, str]) -> None:
    """Replace the bad-node list (atomically, its mode kept); an empty mapping removes the file.

    Raises:
        OutputRefusedError: ``paths.output`` is not opskit's run directory (:func:`claim_run_dir`).
    """
    claim_run_dir(run, "nodes add", write=bool(nodes))
    if not nodes:
        run.bad_nodes.unlink(missing_ok=True)
        return
    lines = ["# Nodes `opskit submit` excludes (--exclude); edit with `opskit nodes add|clear`."]
    lines += [f"{node}\t{why}" for node, why in sorted(nodes.items())]
    atomic_write_text(run.bad_nodes, "\n".join(lines) + "\n")


def add_bad_nodes(run: RunPaths, nodes: dict[str, str]) -> list[str]:
    """Add nodes (node -> why) to the list; returns those that were not on it yet."""
    known = read_bad_nodes(run)
    new = [check_node_name(n) for n in nodes if n not in known]
    if new:
        write_bad_nodes(run, {**known, **{n: nodes[n] for n in new}})
    return new


def clear_bad_nodes(run: RunPaths, nodes: list[str] | None = None) -> list[str]:
    """Take ``nodes`` (None or empty: all) off the list; returns those that were on it.

    Raises:
        OutputRefusedError: ``paths.output`` is not opskit's run directory (:func:`claim_run_dir`).
    """
    known = read_bad_nodes(run)
    gone = [n for n in known if not nodes or n in nodes]
    write_bad_nodes(run, {n: why for n, why in known.items() if n not in gone})
    return gone


# --------------------------------------------------------------------------- the task's hooks (opskit.allocation.job)


def node_crashes(run: RunPaths, job_id: str) -> list[Crash]:
    """Crash lines in the per-node logs of one job (``logs/nodes/<job_id>-<node>.log``), each with its node."""
    crashes: list[Crash] = []
    for log in sorted(run.node_logs.glob(f"{job_id}-*.log")):
        node = log.name[len(job_id) + 1: -len(".log")]
        try:
            with open_regular(log) as f:
                crashes += find_crashes(bounded_lines(f), node=node)
        except OSError:
            continue  # a node log that is not a file (or gone): no crash line of its own
    return crashes


def exclude_in_queue(run: RunPaths, job_nodes: int, partition: str | None) -> str:
    """Carry the bad-node list over to the run's pending tasks (``scontrol update JobId=... ExcNodeList=...``), so
    the next array task starts on healthy nodes with no new submission. Left alone when the partition would keep
    fewer than ``job_nodes`` nodes: those tasks would pend for ever, while running they fail and stop the chain at
    ``slurm.max_failures``, which alerts.

    Returns:
        the main_log.txt line saying what was done.

    Raises:
        SlurmError: sinfo, squeue or scontrol failed.
    """
    bad = sorted(read_bad_nodes(run))
    left = [n for n in client.partition_nodes(partition) if n not in bad]
    if len(left) < job_nodes:
        return (f"queued tasks keep their nodes: excluding {','.join(bad)} would leave {len(left)} node(s) of "
                f"partition {partition or '(all)'} for {job_nodes}-node tasks")
    ids = [re.sub(r"%\d+\]$", "]", e.job_id) for e in run_jobs(run, "", client.squeue()) if e.state == "PENDING"]
    if not ids:
        return f"no queued task to exclude {','.join(bad)} from"
    client.exclude_nodes(ids, bad)
    return f"queued task(s) {', '.join(ids)} now exclude {','.join(bad)} (ExcNodeList)"


def exclude_in_queue_line(run: RunPaths, job_nodes: int, partition: str | None, nodes: list[str]) -> str:
    """:func:`exclude_in_queue`'s line, or, when SLURM did not answer, that the queued tasks may start on ``nodes``."""
    try:
        return exclude_in_queue(run, job_nodes, partition)
    except client.SlurmError as e:
        return f"queued tasks not updated, they may start on {','.join(nodes)} ({e})"


def _down_nodes(nodelist: str, lines: list[str]) -> dict[str, str]:
    """The job's nodes SLURM holds down (:func:`client.down_nodes`); {} with a line in ``lines`` when sinfo fails."""
    try:
        return client.down_nodes(nodelist)
    except client.SlurmError as e:
        lines.append(f"node states unknown ({e})")
        return {}


def task_ended(run: RunPaths, spec_name: str, job_id: str, task: str, state: str, exit_code: int | None,
               nodes: str, max_failures: int, now: datetime | None = None, job_nodes: int | None = None,
               partition: str | None = None, max_stalled_starts: int | None = None) -> list[str]:
    """A task's epilogue (:mod:`opskit.allocation.job`): record the task's outcome (under SLURM, a FAILED or CANCELLED
    task with a node SLURM holds down is NODE_FAIL, the reason naming the node); on a failure, put crashed nodes on the
    bad-node list (and, under SLURM, ``job_nodes`` given, on the run's pending tasks: :func:`exclude_in_queue`) and, at
    ``max_failures`` consecutive failures, stop the chain and raise the alert. At ``max_stalled_starts`` starts in a
    row that moved no ``latest`` (:func:`stalled_starts`), stop it with the ``chain.restart_storm`` alert instead and
    cancel the run's pending tasks (under SLURM).

    Returns:
        lines for main_log.txt (the job prefixes them with its ``[opskit] ... job ...:`` header).
    """
    stamp = f"{now or datetime.now():%Y-%m-%d %H:%M:%S}"
    lines = []
    reason = ""
    if state in ("FAILED", "CANCELLED") and job_nodes and (down := _down_nodes(nodes, lines)):
        # SLURM ended the task because a node died (it cancels the job, then requeues it): not the user's scancel.
        state, reason = "NODE_FAIL", "; ".join(f"{node} {why}" for node, why in down.items())
    if state in FAILURES:
        crashes = [c for c in node_crashes(run, job_id) if c.node]
        if crashes:
            first = {c.node: c for c in reversed(crashes)}
            crashed = "; ".join(f"{c.signature} on {c.node}" for c in first.values())
            reason = f"{reason}; {crashed}" if reason else crashed
            new = add_bad_nodes(run, {n: f"{stamp} job {job_id}: {c.signature}: {c.line.strip()[:200]}"
                                      for n, c in first.items()})
            if new:
                lines.append(f"bad node(s) {','.join(new)} ({crashed}): the next `opskit submit` excludes them")
            if new and job_nodes:
                lines.append(exclude_in_queue_line(run, job_nodes, partition, new))
    record(run, TaskOutcome(stamp, job_id, task, state, exit_code, nodes, reason, _latest_tag(run)))
    if run.stopped_flag.exists():
        return lines
    ledger = ledger_of(run)  # a damaged line is said once, and the others still count
    lines += ledger.damaged[:1]
    stalled, failed = stalled_starts(ledger.rows), consecutive_failures(ledger.rows)
    if max_stalled_starts is not None and len(stalled) >= max_stalled_starts:
        alert = (f"***ALERT: {spec_name}: {len(stalled)} starts in a row saved nothing ({_summary(stalled)}; "
                 f"latest still {stalled[-1].checkpoint or 'absent'}); the chain is stopped, its queued tasks "
                 f"cancelled. Fix the cause, then `opskit submit {spec_name} --yes`***")
        lines += _stop_chain(run, TaskOutcome(stamp, job_id, task, "ALERT", None, nodes, alert), RESTART_STORM)
        if job_nodes:
            lines.append(_cancel_pending(run))
    elif state in FAILURES and len(failed) >= max_failures:
        alert = (f"***ALERT: {spec_name}: {len(failed)} consecutive failed tasks ({_summary(failed[-max_failures:])})"
                 f"; the chain is stopped, later tasks exit at start. Fix the cause, then `opskit submit {spec_name} "
                 f"--yes`***")
        lines += _stop_chain(run, TaskOutcome(stamp, job_id, task, "ALERT", None, nodes, alert), "chain.failures")
    return lines


RESTART_STORM = "chain.restart_storm"


def stop_reason(run: RunPaths) -> str | None:
    """Why a task of the chain must not start (the chain stops itself): training finished, the kill switch is on, or
    the chain was stopped after ``slurm.max_failures`` consecutive failures or ``slurm.max_stalled_starts`` starts that
    saved nothing; None: train."""
    if run.finished_flag.exists():
        return "the finished flag exists: training is done"
    if run.kill_switch.exists():
        return "the kill switch is on (opskit kill-switch NAME off)"
    if run.stopped_flag.exists():
        return "the chain was stopped (after failures or starts that saved nothing: chain-stopped says which)"
    return None


def task_skipped(run: RunPaths, job_id: str, task: str, nodes: str, reason: str) -> None:
    """Record a task that exited at start for :func:`stop_reason`'s ``reason`` (SKIPPED, exit 0).

    Raises:
        ChainError, OSError: the ledger cannot be written (:func:`record`).
    """
    record(run, TaskOutcome(f"{datetime.now():%Y-%m-%d %H:%M:%S}", job_id, task, "SKIPPED", 0, nodes, reason))


def _summary(rows: list[TaskOutcome]) -> str:
    return ", ".join(f"{r.task} {r.state}" + (f" exit {r.exit_code}" if r.state == "FAILED" else "") +
                     f" on {r.nodes}" for r in rows)


def _stop_chain(run: RunPaths, alert: TaskOutcome, code: str) -> list[str]:
    """Write the stopped flag (``TIME [code] ALERT``: :func:`stopped_code` reads the code back) and the ALERT line."""
    atomic_write_text(run.stopped_flag, f"{alert.time} [{code}] {alert.reason}\n")
    record(run, alert)
    return [alert.reason]


def hold_chain(run: RunPaths, job_id: str, task: str, nodes: str, alert: str, code: str) -> list[str]:
    """Stop the chain for a person (the stopped flag naming ``code``, the ALERT line in the ledger), as after
    ``slurm.max_failures`` failures: later tasks exit at start until ``opskit submit --yes`` clears it. Returns the
    lines for main_log.txt."""
    return _stop_chain(run, TaskOutcome(f"{datetime.now():%Y-%m-%d %H:%M:%S}", job_id, task, "ALERT", None, nodes,
                                        alert), code)


def stopped_code(flag_text: str) -> str | None:
    """The finding code a stopped flag names (``chain.restart_storm``, ``chain.failures``), None in flags written
    before codes were."""
    found = re.match(r"\S+ \S+ \[([a-z_.]+)\] ", flag_text)
    return found.group(1) if found else None


def _cancel_pending(run: RunPaths) -> str:
    """Cancel the run's pending tasks (under SLURM): a storm would start each of them only to skip it."""
    try:
        pending = [e for e in run_jobs(run, "", client.squeue()) if e.state == "PENDING"]
        ids = sorted({e.array_id for e in pending}, key=int)
        if ids:
            client.scancel_pending(ids)
    except (client.SlurmError, ChainError) as e:
        return f"queued tasks not cancelled ({e}): they will exit at start"
    return f"cancelled the pending tasks of job(s) {', '.join(ids)}" if ids else "no task was queued"


def main(argv: list[str] | None = None) -> int:
    """``python -m opskit.run.chain ended RUN_DIR SPEC JOB_ID TASK STATE EXIT_CODE NODES MAX_FAILURES`` or
    ``... skipped RUN_DIR JOB_ID TASK NODES REASON``: what job scripts rendered before :mod:`opskit.allocation.job` call
    (one may still be queued when opskit is upgraded); prints main_log lines."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["ended"] and len(args) in (9, 10):  # 9: scripts rendered before max_stalled_starts
            _, root, spec_name, job_id, task, state, code, nodes, max_failures, *stalled = args
            job_nodes = os.environ.get("SLURM_JOB_NUM_NODES", "")  # SLURM's (the local executor sets none)
            for line in task_ended(RunPaths(Path(root)), spec_name, job_id, task, state,
                                   int(code) if code.lstrip("-").isdigit() else None, nodes, int(max_failures),
                                   job_nodes=int(job_nodes) if job_nodes.isdigit() else None,
                                   partition=os.environ.get("SLURM_JOB_PARTITION"),
                                   max_stalled_starts=int(stalled[0]) if stalled else None):
                print(line)
            return 0
        if args[:1] == ["skipped"] and len(args) == 6:
            _, root, job_id, task, nodes, reason = args
            task_skipped(RunPaths(Path(root)), job_id, task, nodes, reason)
            return 0
    except (ChainError, OSError) as e:
        print(f"ledger not updated: {e}")
        return 1
    print(f"usage: python -m opskit.run.chain ended|skipped ... (got {args!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
