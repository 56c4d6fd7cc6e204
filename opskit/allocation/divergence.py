"""The job's divergence triage (issue 48): what a training step's divergence reports (:mod:`opskit.rules.divergence`,
written by :mod:`opskit.train.divergence`) make the job do, recorded as one incident each (:mod:`opskit.run.incidents`).

1. **Detected** (a spike that did not come back within the patience, or a NaN): ``latest`` goes back to the newest
   complete step before the spike (the newer steps set aside, :func:`opskit.ckpt.prune.roll_back`) and the next step
   *replays* from it with ``--divergence-replay``, nothing skipped. Past ``max_rollbacks`` incidents in
   ``rollback_hours``, or with no complete step before the spike, the chain is held and an alert asks a person.
2. **Reproduced** by the replay: the data or the optimisation, not the machine. ``latest`` goes back again, to the
   newest complete step before the spike (the replay may have saved a newer one), and the skip range
   ``rollback+1 .. last flagged iteration + skip_after`` (:func:`opskit.logs.spikes.remedies`' rule) is recorded; every
   later step and task passes it with the spec's ``--skip-train-iteration-range`` (:func:`step_trainer_args`).
3. **Not reproduced**: a transient fault of the machine. The replica whose own loss stood out (the odd one of three or
   more data-parallel replicas, both of two, a NaN one alone) gets a strike: its node goes on the run's bad-node list,
   which ``--exclude``, the in-job restarts and pre-flight read; without local losses, every node of the step. The data
   is kept and the replay trains on.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from opskit.allocation import in_job
from opskit.ckpt.format.info import describe_step
from opskit.ckpt.format.layout import step_dirs
from opskit.ckpt.prune import PruneError, roll_back
from opskit.logs.spikes import remedies
from opskit.rules.divergence import DETECTED, DIGEST, REPLAYED, Replay, Report
from opskit.rules.formats import parse_skip_ranges
from opskit.rules.spike_rule import Spike
from opskit.run import chain
from opskit.run.incidents import (
    CORRUPTED,
    HELD,
    REPLAYING,
    REPRODUCED,
    TRANSIENT,
    read_incidents,
    replaying,
    rollbacks_since,
    skip_ranges,
    stamp,
    write_incidents,
)
from opskit.run.paths import RunPaths

HELD_CODE = "divergence.held"
"""The stopped flag's finding code when the triage holds the chain."""
SKIP_FLAG, REPLAY_FLAG = "--skip-train-iteration-range", "--divergence-replay"


@dataclass(frozen=True)
class Bounds:
    """The spec's ``watchdog.divergence`` settings the job applies."""

    skip_after: int = 0
    max_rollbacks: int = 3
    rollback_hours: float = 24.0


@dataclass(frozen=True)
class Triage:
    """What the job does after a step's reports: ``restart`` another step in this allocation (a replay, or training
    on after the skip), or not (the chain is held); None: no say (a transient verdict: the replay trained on, and the
    step's own end decides); ``lines`` for main_log.txt."""

    restart: bool | None
    lines: list[str]


def step_trainer_args(run: RunPaths, trainer_args: list[str]) -> tuple[list[str], list[str]]:
    """The trainer's flags for the next step: the incidents' skip ranges merged into the spec's
    ``--skip-train-iteration-range``, and ``--divergence-replay`` while an incident replays.

    Returns:
        (flags, lines for main_log.txt).

    Raises:
        IncidentsError: ``incidents.json`` is damaged.
    """
    incidents = read_incidents(run)
    added = skip_ranges(incidents)
    args, lines = list(trainer_args), []
    if added:
        spec_ranges = _flag_values(args, SKIP_FLAG)
        merged = parse_skip_ranges([*spec_ranges, *(f"{a}-{b}" for a, b in added)])
        args = _without(args, SKIP_FLAG) + [SKIP_FLAG, *(f"{a}-{b}" for a, b in merged)]
    current = replaying(incidents)
    if current is not None:
        replay = Replay(current["first"], current["metric"], current["value"], current["baseline"])
        args = _without(args, REPLAY_FLAG) + [REPLAY_FLAG, replay.flag()]
        lines.append(f"incident {current['id']}: this step replays iteration {current['first']} from "
                     f"global_step{current['rollback_step']}")
    return args, lines


def triage(run: RunPaths, reports: list[Report], step_nodes: list[str], bounds: Bounds, job_id: str, task: str,
           spec_name: str, now: float | None = None) -> Triage | None:
    """Act on one step's ``reports`` (see the module docstring); None when it left none.

    Raises:
        IncidentsError: ``incidents.json`` is damaged. OSError: the checkpoint folder cannot be changed.
    """
    if not reports:
        return None
    now = time.time() if now is None else now
    incidents = read_incidents(run)
    lines: list[str] = []
    restart = None
    replayed = [r for r in reports if r.event == REPLAYED]
    if replayed:
        restart = _judge_replay(run, incidents, replayed, step_nodes, bounds, job_id, now, lines)
    detected = [r for r in reports if r.event == DETECTED]
    if detected:
        restart = _open_incident(run, incidents, detected, step_nodes, bounds, job_id, task, spec_name, now, lines)
    digests = [r for r in reports if r.event == DIGEST]
    if digests:
        restart = _corruption(run, incidents, digests, step_nodes, bounds, job_id, task, spec_name, now, lines)
    write_incidents(run, incidents)
    return Triage(restart, lines)


def _open_incident(run: RunPaths, incidents: list[dict], detected: list[Report], step_nodes: list[str], bounds: Bounds,
                   job_id: str, task: str, spec_name: str, now: float, lines: list[str]) -> bool:
    """A new incident for a detected spike: replay it (True), or hold the chain (False)."""
    report = detected[0]
    incident = _new_incident(incidents, now, job_id, report, step_nodes, _kind(report.peak), REPLAYING)
    incident["replicas"] = _replicas(detected)
    what = (f"incident {incident['id']}: {report.metric.replace('_', ' ')} {incident['kind']} from iteration "
            f"{report.first} ({report.value:.6g} against a median of {report.baseline:.6g}), acted on at "
            f"{report.detected_at}")
    if bound := _past_bound(incidents, bounds, now):
        return _hold(run, incident, f"{what}; {bound}: change the run (the LR, the data), not skip more", job_id,
                     task, step_nodes, spec_name, now, lines)
    step = _step_before(run, report.first)
    if step is None:
        return _hold(run, incident, f"{what}; no complete checkpoint before the spike to replay from", job_id, task,
                     step_nodes, spec_name, now, lines)
    try:
        incident["abandoned"] = roll_back(run.checkpoints, step, f"incident{incident['id']}")
    except (PruneError, OSError) as e:
        return _hold(run, incident, f"{what}; latest could not go back to global_step{step} ({e})", job_id, task,
                     step_nodes, spec_name, now, lines)
    incident["rollback_step"] = step
    lines.append(f"{what}: replaying from global_step{step}, nothing skipped"
                 + (f" (set aside: {', '.join(incident['abandoned'])})" if incident["abandoned"] else ""))
    return True


def _corruption(run: RunPaths, incidents: list[dict], digests: list[Report], step_nodes: list[str], bounds: Bounds,
                job_id: str, task: str, spec_name: str, now: float, lines: list[str]) -> bool:
    """Replicas that disagreed: their nodes kept out, ``latest`` back to the newest complete step at or before the
    last iteration they agreed at (every save is checked first, so the step the run resumed from agreed too); True:
    restart on a spare in this allocation."""
    odd = sorted({r.node for r in digests if r.odd})
    iteration = digests[0].first
    agreed = max((r.agreed_at for r in digests if r.agreed_at is not None), default=None)
    incident = _new_incident(incidents, now, job_id, digests[0], step_nodes, kind="digest", verdict=CORRUPTED)
    incident["struck"] = odd
    what = (f"incident {incident['id']}: the data-parallel replicas' parameters differ after iteration {iteration} "
            f"(odd replica(s) on {', '.join(odd) or 'no node named'}; last agreed at {agreed})")
    if bound := _past_bound(incidents, bounds, now):
        return _hold(run, incident, f"{what}; {bound}", job_id, task, step_nodes, spec_name, now, lines)
    step = _step_before(run, (agreed if agreed is not None else iteration - 1) + 1)
    if step is None:
        return _hold(run, incident, f"{what}; no complete checkpoint before it", job_id, task, step_nodes, spec_name,
                     now, lines)
    incident["abandoned"] = roll_back(run.checkpoints, step, f"incident{incident['id']}")
    why = f"replica digest differs after iteration {iteration} (incident {incident['id']})"
    restart, kept_out = in_job.keep_out(run, job_id, {node: why for node in odd})
    incident.update(rollback_step=step, closed=stamp(now),
                    outcome=f"silent data corruption: {', '.join(odd)} kept out, resumed from global_step{step}")
    lines += [f"{what}: rolled back to global_step{step}", *kept_out]
    return restart


def _judge_replay(run: RunPaths, incidents: list[dict], replayed: list[Report], step_nodes: list[str],
                  bounds: Bounds, job_id: str, now: float, lines: list[str]) -> bool | None:
    """The replay's verdict on the incident it replayed: reproduced -> roll back and skip (True: train on in a next
    step); not -> a strike, the data kept (None: the step trained on)."""
    incident = replaying(incidents)
    if incident is None:
        lines.append("a replay report without an incident that replays: passed over")
        return None
    report = replayed[0]
    incident["replay_value"] = report.value
    incident["closed"] = stamp(now)
    if any(r.reproduced for r in replayed):
        step = _step_before(run, incident["first"]) or incident["rollback_step"]
        (remedy,) = remedies([Spike(incident["metric"], incident["first"], incident["last"], incident["first"],
                                    incident["peak"], incident["baseline"], None)], checkpoints=[step])
        skip = [step + 1, remedy.end + bounds.skip_after]
        incident["abandoned"] += roll_back(run.checkpoints, step, f"incident{incident['id']}")
        incident.update(verdict=REPRODUCED, rollback_step=step, skip_range=skip,
                        outcome=f"reproduced ({report.value:.6g}): rolled back to global_step{step}, iterations "
                                f"{skip[0]}-{skip[1]} skipped")
        lines.append(f"incident {incident['id']}: the replay reproduced the spike at iteration {incident['first']} "
                     f"({report.value:.6g}, first seen {incident['value']:.6g}): the data or the optimisation; rolled "
                     f"back to global_step{step}, --skip-train-iteration-range {skip[0]}-{skip[1]} from now on")
        return True
    struck = _odd_replicas(incident["replicas"]) or incident["nodes"] or step_nodes
    why = (f"{stamp(now)} job {job_id}: strike: transient {incident['metric'].replace('_', ' ')} {incident['kind']} "
           f"at iteration {incident['first']} (incident {incident['id']}, not reproduced by its replay)")
    chain.add_bad_nodes(run, {node: why for node in struck})
    incident.update(verdict=TRANSIENT, struck=struck,
                    outcome=f"not reproduced ({report.value:.6g}): a transient fault; the data kept, a strike for "
                            f"{', '.join(struck)}")
    lines.append(f"incident {incident['id']}: the replay did not reproduce the spike at iteration {incident['first']}"
                 f" ({report.value:.6g} against {incident['value']:.6g}): a transient fault; strike for "
                 f"{', '.join(struck)} (on the run's bad-node list), the data kept")
    return None


def _past_bound(incidents: list[dict], bounds: Bounds, now: float) -> str | None:
    """Why one more rollback would pass ``max_rollbacks`` in ``rollback_hours`` (one clause), else None."""
    recent = rollbacks_since(incidents, now - bounds.rollback_hours * 3600)
    if len(recent) < bounds.max_rollbacks:
        return None
    return (f"{len(recent)} rollbacks in {bounds.rollback_hours:g} h already (watchdog.divergence.max_rollbacks "
            f"{bounds.max_rollbacks})")


def _hold(run: RunPaths, incident: dict, why: str, job_id: str, task: str, nodes: list[str], spec_name: str,
          now: float, lines: list[str]) -> bool:
    incident.update(verdict=HELD, closed=stamp(now), outcome=f"held: {why}")
    alert = (f"***ALERT: {spec_name}: divergence {why}; the chain is held, later tasks exit at start. Decide, then "
             f"`opskit submit {spec_name} --yes`***")
    lines += chain.hold_chain(run, job_id, task, ",".join(nodes), alert, HELD_CODE)
    return False


def _new_incident(incidents: list[dict], now: float, job_id: str, report: Report, step_nodes: list[str], kind: str,
                  verdict: str) -> dict:
    """A new record (:mod:`opskit.run.incidents`) of ``report``'s event, appended to ``incidents``."""
    incident = {
        "id": max((i["id"] for i in incidents), default=0) + 1, "opened": stamp(now), "opened_s": now, "job": job_id,
        "kind": kind, "metric": report.metric, "first": report.first, "last": report.last,
        "detected_at": report.detected_at, "value": report.value, "peak": report.peak, "baseline": report.baseline,
        "nodes": step_nodes, "replicas": {}, "verdict": verdict, "replay_value": None, "rollback_step": None,
        "skip_range": None, "abandoned": [], "struck": [], "outcome": "", "closed": None,
    }
    incidents.append(incident)
    return incident


def _kind(peak: float) -> str:
    return "nan" if math.isnan(peak) else "inf" if math.isinf(peak) else "spike"


def _step_before(run: RunPaths, first: int) -> int | None:
    """The newest complete step before iteration ``first`` (the one definition of complete: describe_step)."""
    return next((iteration for iteration, folder in sorted(step_dirs(run.checkpoints).items(), reverse=True)
                 if iteration < first and describe_step(folder).complete), None) if run.checkpoints.is_dir() else None


def _replicas(reports: list[Report]) -> dict[str, float]:
    """Node -> its replicas' own lm loss at the spike (the worst of a node's ranks)."""
    out: dict[str, float] = {}
    for r in reports:
        if r.local_loss is not None:
            worse = out.get(r.node)
            if worse is None or not math.isfinite(r.local_loss) or (math.isfinite(worse) and r.local_loss > worse):
                out[r.node] = r.local_loss
    return out


def _odd_replicas(replicas: dict[str, float]) -> list[str]:
    """The nodes whose own loss stands out: the non-finite ones (when not all are); else, of three or more, the
    farthest from the median; of two, both; none of one (nothing to compare with)."""
    if len(replicas) < 2:
        return []
    bad = [node for node, loss in replicas.items() if not math.isfinite(loss)]
    if bad:
        return bad if len(bad) < len(replicas) else []
    if len(replicas) == 2:
        return sorted(replicas)
    median = statistics.median(replicas.values())
    far = max(abs(loss - median) for loss in replicas.values())
    return sorted(node for node, loss in replicas.items() if abs(loss - median) == far)


def _flag_values(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return []
    rest = args[args.index(flag) + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def _without(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return args
    at = args.index(flag)
    return args[:at] + args[at + 1 + len(_flag_values(args, flag)):]
