"""The run's divergence incidents (issue 48): ``<run>/incidents.json``, one record per incident, written by the job's
triage (:mod:`opskit.allocation.divergence`) and read by every task at start (the skip ranges to add, a replay to
finish), ``opskit status`` (one alert per incident), ``opskit goodput`` and ``opskit logs spikes``.

A record (a JSON object): ``id``, ``opened`` / ``closed`` (``%Y-%m-%d %H:%M:%S``), ``job``, ``kind`` (``spike``,
``nan`` or ``inf``), ``metric``, ``first`` (the spike's first iteration), ``detected_at``, ``value`` (at ``first``),
``peak``, ``baseline`` (the median before it), ``nodes`` (the step's), ``replicas`` (node -> its own lm loss at
``first``), ``verdict`` (:data:`VERDICTS`), ``replay_value``, ``rollback_step``, ``skip_range`` (``[A, B]``),
``abandoned`` (the newer steps set aside), ``struck`` (nodes given a strike), ``outcome`` (one line).
"""

from __future__ import annotations

import json
import time
from datetime import datetime

from opskit.errors import OpskitError
from opskit.fsutil import atomic_write_text, read_json
from opskit.run.paths import RunPaths

REPLAYING, REPRODUCED, TRANSIENT, CORRUPTED, HELD = "replaying", "reproduced", "transient", "corrupted", "held"
VERDICTS = (REPLAYING, REPRODUCED, TRANSIENT, CORRUPTED, HELD)
"""``replaying``: training replays from the step before the spike; ``reproduced``: the spike came back, rolled back and
skipped; ``transient``: it did not, the data kept and the node struck; ``corrupted``: the replicas' digests differed,
the odd node kept out and the run rolled back to the last step they agreed at; ``held``: past the rollback bound, or
nothing to roll back to: the chain is held for a person."""


class IncidentsError(OpskitError, ValueError):
    """``incidents.json`` is damaged (one line naming it)."""


def read_incidents(run: RunPaths) -> list[dict]:
    """The run's incidents, oldest first ([] without the file).

    Raises:
        IncidentsError: the file is not what :func:`write_incidents` writes (a torn or foreign file).
    """
    try:
        data = read_json(run.incidents)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise IncidentsError(f"{run.incidents}: unreadable ({e}); expected opskit's incident records") from None
    incidents = data.get("incidents") if isinstance(data, dict) else None
    if not isinstance(incidents, list) or not all(isinstance(i, dict) and "id" in i for i in incidents):
        raise IncidentsError(f"{run.incidents}: not opskit's incident records (a JSON object with a list "
                             "\"incidents\")")
    return incidents


def write_incidents(run: RunPaths, incidents: list[dict]) -> None:
    """Replace the records atomically (NaN and Inf as JSON's ``NaN`` / ``Infinity``)."""
    atomic_write_text(run.incidents, json.dumps({"incidents": incidents}, indent=1) + "\n")


def stamp(now: float | None = None) -> str:
    return f"{datetime.fromtimestamp(time.time() if now is None else now):%Y-%m-%d %H:%M:%S}"


def skip_ranges(incidents: list[dict]) -> list[tuple[int, int]]:
    """The skip ranges the triage added (each rolled-back incident's ``skip_range``), in incident order."""
    return [tuple(i["skip_range"]) for i in incidents if i.get("skip_range")]


def replaying(incidents: list[dict]) -> dict | None:
    """The incident whose replay has not reported yet (a task that ended mid-replay leaves it to the next)."""
    return next((i for i in incidents if i.get("verdict") == REPLAYING), None)


def rollbacks_since(incidents: list[dict], since: float) -> list[dict]:
    """The incidents opened at or after ``since`` (seconds since the epoch) that rolled ``latest`` back."""
    return [i for i in incidents if i.get("rollback_step") is not None and i.get("opened_s", 0) >= since]


def divergence_account(incidents: list[dict]) -> dict:
    """What divergence cost, for ``opskit goodput``: incidents by verdict, rollbacks, the iterations trained again
    because of them (from the rollback step to where the check acted, and the replay's from the rollback step to the
    spike) and the iterations skipped (their samples and tokens: a skipped range's global batches, Megatron's)."""
    by_verdict = {verdict: sum(i.get("verdict") == verdict for i in incidents) for verdict in VERDICTS}
    rolled = [i for i in incidents if i.get("rollback_step") is not None]
    redone = sum(i["detected_at"] - i["rollback_step"] for i in rolled)
    redone += sum(i["first"] - i["rollback_step"] for i in rolled if i.get("replay_value") is not None)
    skipped = sum(b - a + 1 for a, b in skip_ranges(incidents))
    return {"incidents": len(incidents), **by_verdict, "rollbacks": len(rolled), "iterations_redone": redone,
            "iterations_skipped": skipped}


def incident_line(incident: dict) -> str:
    """One line of an incident: what, where, the verdict and what was done (``opskit status``, ``logs spikes``)."""
    metric = str(incident.get("metric", "?")).replace("_", " ")
    what = f"{metric} {incident.get('kind', 'spike')} at iteration {incident.get('first')}"
    return (f"divergence incident {incident.get('id')} ({incident.get('opened')}): {what}, "
            f"{incident.get('outcome') or incident.get('verdict')}")
