"""The only code that runs SLURM's commands: timeouts on every call, parsed output, typed errors.

A call that times out or cannot reach slurmctld raises :class:`SchedulerUnreachable`, never "no jobs": the watchdog
must not report a job as gone because the controller was slow.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from opskit.errors import OpskitError

TIMEOUT_S = 20
# squeue fields: job id (with array task), partition, name, state, time used, nodes, start time, reason (pending) or
# node list (running), as BigScience's slurm-status.py; then the submit time, the time limit, the comment (which run
# the job is: opskit.run.chain.job_comment) and the command (the batch script's path). Separated by the ASCII unit
# separator, which no job name (opskit's spec refuses control characters) nor run directory holds, so a name, a
# comment or a path with '|' or spaces splits right.
SEPARATOR = "\x1f"
SQUEUE_FORMAT = SEPARATOR.join(("%i", "%P", "%j", "%T", "%M", "%D", "%S", "%R", "%V", "%l", "%k", "%o"))


# What SLURM's commands print when slurmctld is down, unreachable or too slow (MessageTimeout), or when this machine
# has no slurm.conf and no configless controller to fetch one from (a laptop, a fresh machine).
_UNREACHABLE = ("Unable to contact slurm controller", "Connection refused", "Socket timed out",
                "Zero Bytes were transmitted or received", "Could not establish a configuration source",
                "Unable to process configuration file")


class SlurmError(OpskitError, RuntimeError):
    """A SLURM command failed; the message holds the command and its stderr in one line."""


class SchedulerUnreachable(SlurmError):
    """SLURM's commands are missing, time out, or cannot reach the controller."""


@dataclass(frozen=True)
class QueueEntry:
    """One ``squeue`` row. ``job_id`` is e.g. ``682842_[1-5%1]`` (pending array) or ``711114_4`` (array task)."""

    job_id: str
    partition: str
    name: str
    state: str
    time_used: str
    nodes: str
    start_time: str
    reason: str  # "(JobArrayTaskLimit)", "(Dependency)", ... while pending; the node list while running
    submit_time: str = ""  # 2026-11-21T09:14:27
    time_limit: str = ""  # sbatch's format (20:00:00, 1-00:00:00) or UNLIMITED
    comment: str = ""  # sbatch's --comment ("" for none); opskit's jobs carry their run's (chain.job_comment)
    command: str = ""  # the batch script's path as submitted ("" for --wrap jobs)

    @property
    def array_id(self) -> str:
        """The job id without the array part (``682842``)."""
        return self.job_id.split("_", 1)[0]


def _run(cmd: list[str], timeout: float = TIMEOUT_S) -> str:
    if shutil.which(cmd[0]) is None:
        raise SchedulerUnreachable(f"{cmd[0]}: command not found (is SLURM installed? scripts/local-slurm.sh start)")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SchedulerUnreachable(f"{' '.join(cmd)}: no answer within {timeout:.0f} s") from None
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        unreachable = any(sign in message for sign in _UNREACHABLE)
        raise (SchedulerUnreachable if unreachable else SlurmError)(f"{' '.join(cmd)}: {message}")
    return done.stdout


def parse_squeue(text: str) -> list[QueueEntry]:
    """Rows of ``squeue -h -o SQUEUE_FORMAT`` output; squeue's ``(null)`` (no comment, a ``--wrap`` job's command)
    becomes ""."""
    fields = SQUEUE_FORMAT.count(SEPARATOR) + 1
    entries = []
    for line in text.split("\n"):
        values = line.split(SEPARATOR)
        if len(values) != fields:
            continue
        entries.append(QueueEntry(*values[:-2], *("" if v == "(null)" else v for v in values[-2:])))
    return entries


def squeue(users: list[str] | None = None) -> list[QueueEntry]:
    """All queued and running jobs (one call), optionally only those of ``users``."""
    cmd = ["squeue", "-h", "-o", SQUEUE_FORMAT]
    if users:
        cmd.append(f"--user={','.join(users)}")
    return parse_squeue(_run(cmd))


def sbatch(script: Path, array: int | None = None, dependency: str | None = None,
           begin: str | None = None) -> str:
    """Submit ``script``; returns the job id (``--parsable``).

    Args:
        array: N for a chained array ``--array=1-N%1`` (one task at a time, each resuming the last).
        dependency: e.g. ``afterany:1234``.
        begin: sbatch's ``--begin`` value, e.g. ``now+2hours``.
    """
    return _run(sbatch_command(script, array, dependency, begin)).strip().split(";", 1)[0]


def sbatch_command(script: Path, array: int | None = None, dependency: str | None = None,
                   begin: str | None = None) -> list[str]:
    """The exact sbatch command line :func:`sbatch` runs (shown by ``--dry-run``)."""
    cmd = ["sbatch", "--parsable"]
    if array is not None and array > 1:
        cmd.append(f"--array=1-{array}%1")
    if dependency:
        cmd.append(f"--dependency={dependency}")
    if begin:
        cmd.append(f"--begin={begin}")
    cmd.append(str(script))
    return cmd


def scancel(job_ids: list[str]) -> None:
    """Cancel jobs (whole arrays for array ids)."""
    _run(["scancel", *job_ids])


def scancel_pending(job_ids: list[str]) -> None:
    """Cancel the pending tasks of jobs (arrays): a running task of them is left alone."""
    _run(["scancel", "--state=PENDING", *job_ids])


def scontrol(action: str, job_ids: list[str]) -> None:
    """``scontrol hold|release ID,...``: a held job stays pending and keeps its queue age until released."""
    if action not in ("hold", "release"):
        raise ValueError(f"scontrol {action}: expected hold or release")
    _run(["scontrol", action, ",".join(job_ids)])


def partition_nodes(partition: str | None = None) -> list[str]:
    """The node names of ``partition`` (default: every partition), from ``sinfo``."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N"] + ([f"--partition={partition}"] if partition else [])
    return sorted(set(_run(cmd).split()))


def exclude_nodes(job_ids: list[str], nodes: list[str]) -> None:
    """``scontrol update JobId=ID ExcNodeList=NODES`` for pending jobs (``682842_[2-5]`` updates those array
    tasks): the nodes they may start on from now on."""
    for job_id in job_ids:
        _run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"])


def down_nodes(nodelist: str) -> dict[str, str]:
    """Nodes of ``nodelist`` (SLURM's ``node[1-2]`` form) that SLURM holds down, drained, failed or not responding:
    node -> ``STATE (reason)`` as ``sinfo`` prints them (``node2 -> down* (Not responding)``)."""
    out = _run(["sinfo", "-h", "-N", "-n", nodelist, "-o", f"%N{SEPARATOR}%T{SEPARATOR}%E"])
    down = {}
    for line in out.splitlines():
        node, state, reason = (line.split(SEPARATOR) + ["", ""])[:3]
        if state.endswith("*") or state.startswith(("down", "drain", "fail")):
            down[node] = f"{state} ({reason})" if reason and reason != "none" else state
    return down
