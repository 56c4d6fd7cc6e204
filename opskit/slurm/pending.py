"""Pending reasons that never clear by themselves: the job asks what its partition cannot give, or names a partition,
account, QOS, feature or node that is unusable. Such a job waits until it is cancelled; ``opskit rehearse``'s wait,
``opskit submit --wait`` and the watchdog (``scheduler.pending_forever``) say so, with the fix, instead of waiting.

Reason names are SLURM's (https://slurm.schedmd.com/job_reason_codes.html) as squeue's ``%R`` prints them:
``(PartitionConfig)``, ``(ReqNodeNotAvail, UnavailableNodes:node9)``. Limits that other jobs' ending lifts
(``Resources``, ``Priority``, ``AssocMaxJobsLimit``, ``QOSGrp*``...) are not hopeless; a per-job maximum
(``QOSMax*PerJob*``, ``AssocMax*PerJob*``) is.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable

from opskit.errors import OpskitError
from opskit.slurm.client import QueueEntry

GRACE_S = 30.0
"""How long a hopeless reason must last before a wait gives up on the job: SLURM may show one for a single scheduling
pass (a node still registering, a slow backfill cycle listing every node as unavailable)."""

_LIMITS = "`scontrol show partition PARTITION`, `sinfo -p PARTITION -o '%c %m %G %D %l'`"
# reason -> what the job asks that can never be given; what to change before the job is cancelled and submitted again.
_HOPELESS = {
    "PartitionConfig": ("the job asks more than its partition allows or its nodes have (CPUs per task, memory, GPUs, "
                        "nodes)", f"lower slurm.cpus_per_task, slurm.gres or parallel.nodes ({_LIMITS}) or pick "
                                  "another slurm.partition"),
    "PartitionNodeLimit": ("the job's node count is outside its partition's MinNodes-MaxNodes",
                           f"change parallel.nodes or slurm.partition ({_LIMITS})"),
    "PartitionTimeLimit": ("the job's time limit is above its partition's MaxTime", f"lower slurm.time ({_LIMITS})"),
    "PartitionDown": ("its partition is DOWN", "ask the admins to bring it up, or pick another slurm.partition"),
    "PartitionInactive": ("its partition is INACTIVE", "ask the admins, or pick another slurm.partition"),
    "BadConstraints": ("no node has the features slurm.constraint asks for",
                       "fix slurm.constraint (`sinfo -o '%N %f'` lists the features)"),
    "InvalidAccount": ("slurm.account is not a valid account for the job's user",
                       "fix slurm.account (`sacctmgr show assoc user=$USER`)"),
    "AccountNotAllowed": ("slurm.account may not use the job's partition",
                          f"fix slurm.account or slurm.partition ({_LIMITS})"),
    "InvalidQOS": ("slurm.qos is not a valid QOS for the job's account",
                   "fix slurm.qos (`sacctmgr show assoc user=$USER format=account,qos`)"),
}
# A per-job maximum of the QOS or association (not a count of jobs, which other jobs' ending lowers).
_PER_JOB = ("the job asks more than its QOS or account allows one job (CPUs, nodes, GPUs, memory, time)",
            "lower slurm.time, parallel.nodes or slurm.gres, or pick another slurm.qos "
            "(`sacctmgr show qos format=name,maxtresperjob,maxwall`)")


class PendingForever(OpskitError, RuntimeError):
    """A waited-for job is pending on a reason that never clears by itself; one line with the fix."""


def hopeless_reason(reason: str, name: str = "NAME", then: str | None = None) -> str | None:
    """Why a pending job with squeue's ``reason`` can never start, and the fix, in one line (``PartitionConfig: the
    job asks ...; lower ..., then ...``); None for a reason that clears by itself (``(Resources)``, ``(Priority)``,
    ``(Dependency)``, ``(JobArrayTaskLimit)``, ``(BeginTime)``, ``(AssocMaxJobsLimit)``, a running job's node list).

    ``ReqNodeNotAvail`` is hopeless only with nodes listed after ``UnavailableNodes:`` (DOWN, DRAINED or not
    responding: an admin must return them); without (a node busy, reserved, a maintenance reservation) it clears.

    Args:
        name: the spec's name in the commands the fix names.
        then: the fix's last step; default: cancel the stuck chain and submit again (``opskit submit`` would
            otherwise make the new chain wait for the stuck one, ``--dependency=afterany``).
    """
    code, _, detail = reason.strip().removeprefix("(").removesuffix(")").partition(",")
    code = code.strip()
    then = then or f"then `opskit cancel {name}` and `opskit submit {name}`"
    if code == "ReqNodeNotAvail":
        nodes = detail.partition("UnavailableNodes:")[2].strip()
        if not nodes:
            return None
        return (f"ReqNodeNotAvail: nodes it needs are DOWN, DRAINED or not responding ({nodes}; `sinfo -R -n "
                f"{nodes}` says why); ask the admins to return them, or `opskit nodes add {name} {nodes}`, {then}")
    if re.fullmatch(r"(QOS|Assoc)Max\w+PerJob(Limit)?", code):  # QOSMaxWallDurationPerJobLimit, AssocMaxGRESPerJob
        why, fix = _PER_JOB
    elif code in _HOPELESS:
        why, fix = _HOPELESS[code]
    else:
        return None
    return f"{code}: {why}; {fix}, {then}"


def never_starts(entry: QueueEntry, name: str = "NAME", then: str | None = None) -> str | None:
    """``job ID never starts: REASON: why; fix`` for a pending ``entry`` whose reason never clears, else None;
    ``name``, ``then``: as :func:`hopeless_reason`'s."""
    why = hopeless_reason(entry.reason, name, then) if entry.state == "PENDING" else None
    return None if why is None else f"job {entry.job_id} never starts: {why}"


class HopelessWatch:
    """For a wait loop: the line for a job whose hopeless reason has lasted ``grace_s`` (:data:`GRACE_S`)."""

    def __init__(self, name: str = "NAME", then: str | None = None, grace_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``name``, ``then``: as :func:`hopeless_reason`'s."""
        self.name, self.then = name, then
        self.grace_s = GRACE_S if grace_s is None else grace_s
        self.clock = clock
        self._since: dict[str, tuple[str, float]] = {}  # job id -> (its line, first seen)

    def check(self, entries: Iterable[QueueEntry]) -> str | None:
        """:func:`never_starts`'s line for the first entry that has had it unchanged for ``grace_s`` seconds, else
        None. Call on every poll: a job seen without it starts over."""
        now, seen = self.clock(), {}
        for e in entries:
            if line := never_starts(e, self.name, self.then):
                prior = self._since.get(e.job_id)
                seen[e.job_id] = prior if prior and prior[0] == line else (line, now)
        self._since = seen
        return next((line for line, since in seen.values() if now - since >= self.grace_s), None)
