"""What the watchdog does about its findings, once all are in: each action of :data:`ACTIONS` takes the findings (and
the snapshot they came from) and returns them with what it did, or would do, told in the finding it acted on. An
action that fails says so in its finding, never raises: the finding is the news.
"""

from __future__ import annotations

from collections.abc import Callable

from opskit.monitor.checks import keep_out_hint
from opskit.monitor.findings import Finding
from opskit.monitor.snapshot import RunSnapshot
from opskit.run import chain
from opskit.slurm import client
from opskit.spec.schema import Spec


def act_on_hang(findings: list[Finding], snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """A ``log.hang`` finding with what ends the hung task (``scancel`` of the running tasks: the chain's next task
    resumes from the last save); with ``watchdog.cancel_hung``, done here. A failed scancel is told, not raised."""
    ids = [e.job_id for e in snap.running]
    return [_cancel_hung(f, ids, spec.watchdog.cancel_hung) if f.key == "log.hang" and ids else f for f in findings]


def _cancel_hung(hang: Finding, ids: list[str], cancel: bool) -> Finding:
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


def exclude_straggler(findings: list[Finding], snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """With ``watchdog.exclude_stragglers``, a ``log.straggler``'s node goes on the bad-node list (the next submission
    excludes it), and its finding says so instead of how to do it by hand.

    Raises:
        ChainError: the bad-node list cannot be read or written (a damaged line, a host name it cannot hold).
    """
    if not spec.watchdog.exclude_stragglers:
        return findings
    return [_exclude(f, snap) if f.key == "log.straggler" else f for f in findings]


def _exclude(slow: Finding, snap: RunSnapshot) -> Finding:
    node = slow.data["node"]
    why = f"{snap.now:%Y-%m-%d %H:%M:%S} straggler: {slow.data['ratio']:.2f}x its stage's other ranks"
    done = (f"{node} put on the bad-node list: the next submission excludes it"
            if chain.add_bad_nodes(snap.run, {node: why}) else f"{node} was on the bad-node list already")
    return Finding(slow.key, slow.severity, slow.message.removesuffix(keep_out_hint(node)) + done, slow.data)


Action = Callable[[list[Finding], RunSnapshot, Spec], list[Finding]]

ACTIONS: tuple[Action, ...] = (act_on_hang, exclude_straggler)
"""Every action, in turn, on the checks' findings. A new one (the coming rollback): a function
``(findings, snapshot, spec) -> findings`` above, and its name here."""
