"""The watchdog's checks: pure functions ``(snapshot, spec) -> findings`` over a :class:`RunSnapshot` (read once by
:func:`opskit.monitor.snapshot.read_snapshot`), listed in :data:`CHECKS`, whose order is the report's. A check reads
no file and asks SLURM nothing; what the watchdog does about a finding is an action's (:mod:`opskit.monitor.actions`).

Findings have stable keys (``scheduler.absent``, ``log.hang``, ...): :mod:`opskit.monitor.alerts` de-duplicates on them.
What each one means and what to do about it: docs/operations.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from opskit.ckpt.format.info import FALLBACK_LINE
from opskit.ckpt.format.layout import SAVE_FAILED_LINE, STEP_DIR, save_failed_message
from opskit.history.measures import advise
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
from opskit.logs.eta import Progress, progress_lines
from opskit.logs.spikes import find_spikes, remedies
from opskit.logs.stacks import rank_stacks, stuck_ranks
from opskit.monitor.findings import Finding
from opskit.monitor.snapshot import Checkpoints, Disk, LogRead, RunFlags, RunSnapshot, matches, slurm_time
from opskit.rules.divergence import spike_config
from opskit.rules.stragglers import parse_slowest_rank_line, straggler
from opskit.run import chain
from opskit.run.incidents import incident_line
from opskit.run.paths import RunPaths
from opskit.slurm.client import QueueEntry
from opskit.slurm.pending import never_starts
from opskit.spec.schema import Spec, WatchdogSpec, parse_slurm_time

HAND_OVER_S = 600  # an exclusive reservation still lets the next task of a chain wait this long
SAVE_INTERVAL_EXCESS = 0.01
"""The share of wall time a save interval may lose over the best one before the watchdog says so (1%)."""


# --------------------------------------------------------------------------- the scheduler and the chain


def check_scheduler(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """Findings from the spec's queue entries (running, pending and why, a pending reason that never clears, absent;
    the finished and stopped flags when there is none) and the queued depth against ``watchdog.queue_horizon_hours``;
    ``scheduler.unreachable`` when SLURM did not answer."""
    if snap.unreachable is not None:
        return [Finding("scheduler.unreachable", "warn", f"SLURM did not answer ({snap.unreachable}): job state "
                        "unknown")]
    entries, running = list(snap.entries), snap.running
    pending = [e for e in entries if e.state == "PENDING"]
    if not entries:
        return [_absent(spec, snap.flags)]
    findings = []
    for e in running:
        findings.append(Finding("scheduler.running", "ok", f"{e.job_id} running for {e.time_used} since "
                                f"{e.start_time} on {e.reason} ('{e.partition}' partition)", asdict(e)))
    for e in pending:
        reason = e.reason.strip("()")
        expected = f", expected to start {e.start_time}" if slurm_time(e.start_time) else ""
        findings.append(Finding("scheduler.pending", "ok", f"{e.job_id} pending ({reason}{expected})", asdict(e)))
    # No grace here, unlike a wait's HopelessWatch: hourly checks are far apart, and pending_too_long would take a day.
    stuck = [(e.job_id, line) for e in pending if (line := never_starts(e, spec.cli_name))]
    if stuck:
        findings.append(Finding("scheduler.pending_forever", "alert", stuck[0][1],
                                {"job_ids": [job_id for job_id, _ in stuck]}))
    if pending and not running:
        # The last task's end counts as "last seen running": a task may start and end between two hourly checks.
        ended = [t.timestamp() for t in (_ledger_time(r.time) for r in snap.ledger.rows[-1:]) if t]
        findings += _pending_too_long(spec.watchdog, pending, max([snap.state.last_running or 0, *ended]), snap.now)
    if snap.flags.finished is None:
        findings += _queue_depth(spec, running, entries, snap.progress.seconds_left if snap.progress else None)
    return findings


def check_chain(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """The kill switch, the tasks that failed in a row (the ledger) and the bad-node list: files of the run, known
    without SLURM."""
    findings = []
    if snap.flags.kill_switch is not None:
        findings.append(Finding("chain.kill_switch", "warn", f"the kill switch is on ({snap.flags.kill_switch}): "
                                "queued tasks exit at start"))
    failed = chain.consecutive_failures(snap.ledger.rows)
    if failed:
        lost = {r.task: _lost_since_save(snap.checkpoints, r) for r in failed[-3:]}
        findings.append(Finding("chain.failures", "warn", f"{len(failed)} consecutive failed task(s): " + ", ".join(
            f"{r.task} {r.state}" + (f" ({r.reason})" if r.reason else "") +
            (f" at {r.time[11:]}, losing {lost[r.task][1]:.0f} s of training since {lost[r.task][0]}"
             if lost[r.task] else "") for r in failed[-3:]),
            {"tasks": [asdict(r) for r in failed], "lost_s": {t: round(x[1]) for t, x in lost.items() if x}}))
    if snap.bad_nodes_error is not None:
        findings.append(Finding("chain.bad_nodes", "warn", snap.bad_nodes_error))
    if snap.bad_nodes:
        findings.append(Finding("chain.bad_nodes", "warn", f"{len(snap.bad_nodes)} node(s) excluded from the chain: "
                                + "; ".join(f"{node} ({why[:160]})" for node, why in snap.bad_nodes.items())
                                + "; `opskit nodes clear NAME NODE` once repaired", {"nodes": snap.bad_nodes}))
    return findings


def check_ledger(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """``chain.ledger``: the ledger's damaged lines (torn by a crash mid-write, edited), each named by file and line;
    the other lines were read and count (a damaged line never hides the failures the good ones record)."""
    ledger = snap.ledger
    if not ledger.damaged:
        return []
    more = f" and {len(ledger.damaged) - 1} more damaged line(s)" if len(ledger.damaged) > 1 else ""
    return [Finding("chain.ledger", "warn", f"{ledger.damaged[0]}{more}; the ledger's {len(ledger.rows)} other "
                    "record(s) are counted: fix or delete the line", {"damaged": ledger.damaged[:20],
                                                                       "records": len(ledger.rows)})]


def _lost_since_save(checkpoints: Checkpoints | None, row: chain.TaskOutcome) -> tuple[str, float] | None:
    """(step, seconds): the training a failed task lost, from the last checkpoint it saved (the newest step folder
    written before the failure, which the next task resumes from) to the failure; None without such a step. A step
    newer than the resume point is not one: ``latest`` moves only once a step is complete, so it is a save the
    failure cut short (or one under way now)."""
    failed_at = _ledger_time(row.time)
    if failed_at is None or checkpoints is None or checkpoints.point is None or checkpoints.point.step is None:
        return None
    resumable = checkpoints.point.step.iteration
    before = [(mtime, name) for name, mtime in checkpoints.steps.items()
              if mtime is not None and mtime <= failed_at.timestamp() + 1
              and int(STEP_DIR.match(name).group(1)) <= resumable]
    if not before:
        return None
    mtime, name = max(before)
    return name, max(0.0, failed_at.timestamp() - mtime)


def _ledger_time(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None


def _minutes(text: str) -> float | None:
    """squeue's elapsed / limit (``1-02:03:04``, ``12:34``) in minutes; None for UNLIMITED, N/A, ..."""
    try:
        return parse_slurm_time(text)
    except ValueError:
        return None


def _absent(spec: Spec, flags: RunFlags) -> Finding:
    if flags.finished is not None:
        return Finding("scheduler.finished", "ok", f"training finished ({flags.finished})")
    if flags.stopped is not None:
        # its own code: the fix differs from a failure's
        storm = chain.stopped_code(flags.stopped) == chain.RESTART_STORM
        return Finding(chain.RESTART_STORM if storm else "scheduler.stopped", "alert",
                       f"the chain stopped itself: {flags.stopped}")
    return Finding("scheduler.absent", "alert", f"{spec.job_name} is not RUNNING or SCHEDULED (nothing in squeue, "
                   f"no finished flag): `opskit submit {spec.cli_name}`")


def _pending_too_long(wd: WatchdogSpec, pending: list[QueueEntry], last_running: float,
                      now: datetime) -> list[Finding]:
    """Nothing runs: since when has the chain been waiting (submission, or the last time a task ran)?"""
    limit_s = HAND_OVER_S if wd.exclusive_reservation else (
        None if wd.max_pending_hours is None else wd.max_pending_hours * 3600)
    submitted = [t.timestamp() for e in pending if (t := slurm_time(e.submit_time))]
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
    """When will the last queued task end, if each one runs to its time limit? ``seconds_left``: the log's ETA, so a
    chain that covers the rest of the training is never "too short"."""
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


# --------------------------------------------------------------------------- progress and the log


def check_progress(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """``progress``: iteration, ETA and tokens, as ``opskit logs show`` computes them (:attr:`RunSnapshot.progress`)."""
    return progress_findings(snap.progress)


def progress_findings(state: Progress | None) -> list[Finding]:
    """The ``progress`` finding of a :class:`~opskit.logs.eta.Progress` (none without one)."""
    return [] if state is None else [Finding("progress", "ok", "; ".join(progress_lines(state, 20)), state.as_json())]


def check_log(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """The log's health (:func:`log_findings`, a hang with the stacks' stuck ranks), or why it cannot be checked: no
    run directory (never "no log yet, ok" about a run this machine cannot see), an unreadable log, no log, a log
    without iteration lines."""
    run = snap.run
    if snap.run_missing:
        return [_run_missing(spec, run, snap.run_missing)]
    if snap.log_error is not None:
        return [Finding("log.unreadable", "alert", f"{snap.log_error}: nothing of the log can be checked",
                        {"path": str(run.main_log)})]
    if snap.log is None:
        return [_no_log(snap)]
    findings = log_findings(snap.log, spec.watchdog, snap.now, snap.running_since, spec.checkpoint.save_interval)
    findings += _no_iterations(snap)
    return [with_stuck_ranks(f, snap.stack_text, snap.state.job_nodes) if f.key == "log.hang" else f
            for f in findings]


def log_findings(log: LogRead, wd: WatchdogSpec, now: datetime, running_since: datetime | None,
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


def line_interval(records: list[dict]) -> float | None:
    """Usual seconds between two iteration lines: median s/it x median iterations between lines."""
    times = [r["elapsed_time_per_iteration_s"] for r in records[-50:] if "elapsed_time_per_iteration_s" in r]
    steps = [b["iteration"] - a["iteration"] for a, b in zip(records[-50:], records[-49:], strict=False)
             if b["iteration"] > a["iteration"]]
    if not times:
        return None
    return statistics.median(times) * (statistics.median(steps) if steps else 1)


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


def with_stuck_ranks(hang: Finding, text: str, job_nodes: str = "") -> Finding:
    """The ``log.hang`` finding with the rank(s) the others wait for, from the stacks every rank printed after
    ``--stack-dump-after-mins`` (:mod:`opskit.logs.stacks`) in ``text`` (main_log's end); the finding as it was
    when no stacks are there. ``job_nodes``: the running job's node list when its header is not in ``text``.
    ``data["stuck"]``: one ``{"node", "local_rank", "frame"}`` per named rank."""
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


def check_stragglers(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """``log.straggler`` from main_log's end (:attr:`RunSnapshot.straggler_text`): :func:`stragglers_in`."""
    return stragglers_in(snap.straggler_text, spec.watchdog)


def stragglers_in(text: str, wd: WatchdogSpec) -> list[Finding]:
    """``log.straggler``: the latest job's last 3 forward-time lines (:mod:`opskit.rules.stragglers`) in ``text``
    (main_log's end) name one node and local rank at ``watchdog.straggler_ratio`` or more. The message ends with
    :func:`keep_out_hint` (an action may tell what it did instead)."""
    headers = list(JOB_HEADER.finditer(text))
    if headers:
        text = text[headers[-1].start():]
    reports = [r for line in text.splitlines() if (r := parse_slowest_rank_line(line_source(line)[2]))]
    slow = straggler(reports, wd.straggler_ratio)
    if slow is None:
        return []
    where = f"{slow.node} local rank {slow.local_rank} (rank {slow.rank}, stage {slow.stage})"
    return [Finding("log.straggler", "warn", f"straggler: {where} took {slow.ratio:.2f}x the forward time of its "
                    f"stage's other ranks in 3 log intervals in a row (last: iterations {slow.first}-{slow.last}, "
                    f"{slow.ms:.1f} vs {slow.others_ms:.1f} ms); {keep_out_hint(slow.node)}",
                    {"node": slow.node, "local_rank": slow.local_rank, "rank": slow.rank, "ratio": slow.ratio})]


def keep_out_hint(node: str) -> str:
    """How a straggler's node is kept out by hand: the end of its finding's message."""
    return f"`opskit nodes add NAME {node}` keeps it out of the next task"


def _spikes(log: LogRead, wd: WatchdogSpec, save_interval: int | None) -> list[Finding]:
    config = spike_config(wd.spike_window, wd.spike_threshold)
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
    for line in text.splitlines():
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


def _resume_fallbacks(text: str) -> list[Finding]:
    """The trainer's line when it resumed from an older step than ``latest`` named
    (opskit.ckpt.format.info.FALLBACK_LINE): iterations are redone, and the step it skipped is damaged."""
    found = matches(text, "the newest complete step", FALLBACK_LINE)
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
    failed = matches(text, "saving global_step", SAVE_FAILED_LINE)
    if not failed:
        return []
    tag, reason = failed[-1].groups()
    return [Finding("log.save_failed", "alert", f"{save_failed_message(tag, reason)}; latest still names the step "
                    "before: free space (or quota) under the checkpoint dir before the next task reaches its next save",
                    {"tag": tag, "reason": reason, "failures": len(failed)})]


def _started(snap: RunSnapshot) -> str | None:
    """Why the run must have a log by now (a ledger entry, the finished flag, iterations or a step the watchdog
    saw before), or None: it never started, so no log is no news."""
    state, ledger = snap.state, snap.ledger.rows
    if snap.flags.finished is not None:
        return f"{snap.run.finished_flag} is set"
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


def _no_iterations(snap: RunSnapshot) -> list[Finding]:
    """``log.unreadable``: a run that started (:func:`_started`) whose main_log.txt shows no iteration line at all,
    this time or before (garbage, another file, an encoding opskit cannot read): the log checks (hang, spikes, NaN,
    progress) see nothing."""
    log, main_log = snap.log, snap.run.main_log
    started = _started(snap)
    if log.records or not started:
        return []
    size = "unreadable" if snap.main_log_size is None else f"{snap.main_log_size:,} bytes"
    garbled = f", {log.skipped} cut or garbled record line(s)" if log.skipped else ""
    return [Finding("log.unreadable", "warn", f"{main_log} ({size}{garbled}) holds no iteration line opskit can "
                    f"read although {started}: another file, damaged, or a trainer whose lines opskit does not know? "
                    "The log's checks (hang, spikes, NaN, progress) see nothing", {"path": str(main_log),
                                                                                  "evidence": started})]


def _no_log(snap: RunSnapshot) -> Finding:
    run = snap.run
    if snap.logs_is_file:
        return Finding("log.missing", "alert", f"{run.logs} is a file, not a folder: no job can write its log",
                       {"path": str(run.logs)})
    if started := _started(snap):
        return Finding("log.missing", "alert", f"no {run.main_log} (nor TensorBoard events) although {started}: "
                       "deleted or moved? Nothing of the log can be checked", {"path": str(run.main_log),
                                                                               "evidence": started})
    return Finding("log.none", "ok", f"no {run.main_log} (nor TensorBoard events) yet")


def _run_missing(spec: Spec, run: RunPaths, what: str) -> Finding:
    return Finding("run.missing", "alert", f"run directory {run.root} {what} (paths.output {spec.paths.output!r} from "
                   f"{spec.base_dir}): nothing of the run can be checked here; not submitted yet (`opskit submit "
                   f"{spec.cli_name}`), or paths.output names another folder than the jobs write to",
                   {"run_dir": str(run.root)})


# --------------------------------------------------------------------------- checkpoints and disk


def check_checkpoint(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """The resume point and its age (:func:`checkpoint_findings`), knowing what the log and the ledger say was
    saved; nothing when the run is missing."""
    if snap.checkpoints is None:
        return []
    said_saved = _said_saved(snap)
    return checkpoint_findings(snap.checkpoints, spec.checkpoint.save_interval,
                               snap.progress.seconds_per_iteration if snap.progress else None, bool(snap.running),
                               spec.watchdog, snap.now, _save_due(snap, spec.checkpoint.save_interval, said_saved),
                               said_saved)


def checkpoint_findings(checkpoints: Checkpoints, save_interval: int, seconds_per_iteration: float | None,
                        running: bool, wd: WatchdogSpec, now: datetime, saved_by_now: str | None = None,
                        said_saved: tuple[int, str] | None = None) -> list[Finding]:
    """The step the next job resumes from (:attr:`Checkpoints.point`): an ALERT when ``latest`` is unusable or names
    a missing or incomplete step (the next job falls back to the newest complete step, or fails when there is none);
    then that step's age against ``save_interval`` iterations at the logged speed.

    Args:
        saved_by_now: why a complete step must exist by now (:func:`_save_due`); then none is an ALERT
            (``checkpoint.missing``), as is a checkpoint path that is a file. None: no complete step is still ok.
        said_saved: (iteration, evidence): the last step the log or the ledger says was saved
            (:func:`_said_saved`); when its folder is gone and no step as new is complete, an ALERT
            (``checkpoint.missing``): the next job would start from an older step, or from scratch.
    """
    path = checkpoints.path
    if checkpoints.is_file:
        return [Finding("checkpoint.missing", "alert", f"{path} is a file, not a folder: the next job "
                        "cannot save nor resume", {"path": str(path)})]
    point = checkpoints.point
    findings = []
    if point.problem:
        resume_from = point.step.path.name if point.step else None
        then = (f"the next job resumes from {resume_from}, the newest complete step" if resume_from else
                "no complete step is left: the next job will fail (restore one from a backup)")
        findings.append(Finding("checkpoint.incomplete", "alert", f"{point.problem}; {then}",
                                {"latest": point.latest, "problem": point.problem, "resume_from": resume_from}))
    if gone := _saved_step_gone(checkpoints, said_saved):
        return [*findings, gone]
    saved = checkpoints.saved_at
    if saved is None and saved_by_now:
        what = "no checkpoint folder" if not checkpoints.exists else "no complete checkpoint"
        return [*findings, Finding("checkpoint.missing", "alert", f"{what} at {path} although {saved_by_now}"
                                   ": deleted or moved? The next job starts from scratch (restore from a backup)",
                                   {"path": str(path), "evidence": saved_by_now})]
    if saved is None:
        return findings or [Finding("checkpoint.none", "ok", f"no complete checkpoint yet ({path / 'latest'})")]
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


def _saved_step_gone(checkpoints: Checkpoints, said_saved: tuple[int, str] | None) -> Finding | None:
    """``checkpoint.missing`` when the step ``said_saved`` names has no folder and the resume point (none, or an older
    step) is older: a folder deleted, or ``checkpoints`` replaced (a link to ``/``)."""
    if said_saved is None:
        return None
    iteration, evidence = said_saved
    tag = f"global_step{iteration}"
    resume_from = checkpoints.point.step
    newest = resume_from.iteration if resume_from else None
    if tag in checkpoints.steps or (newest is not None and newest >= iteration):
        return None
    then = f"the next job resumes from {resume_from.path.name}" if resume_from else \
        "the next job starts from scratch (random weights)"
    return Finding("checkpoint.missing", "alert", f"{checkpoints.path / tag} is gone although {evidence}: deleted or "
                   f"moved? {then[0].upper()}{then[1:]}; restore it from a backup (`opskit ckpt restore`)",
                   {"path": str(checkpoints.path), "tag": tag, "evidence": evidence,
                    "resume_from": resume_from.path.name if resume_from else None})


def _said_saved(snap: RunSnapshot) -> tuple[int, str] | None:
    """(iteration, evidence) of the last step the log said it saved, else the last one the ledger recorded as
    ``latest`` when a task ended; None when neither says any."""
    saved = snap.state.saved
    if saved is not None:
        return saved, f"the log says it was saved (successfully saved checkpoint at iteration {saved})"
    recorded = next((row for row in reversed(snap.ledger.rows) if row.checkpoint and STEP_DIR.match(row.checkpoint)),
                    None)
    if recorded is None:
        return None
    return (int(STEP_DIR.match(recorded.checkpoint).group(1)),
            f"the ledger records it as latest when task {recorded.task} ended")


def _save_due(snap: RunSnapshot, save_interval: int, said_saved: tuple[int, str] | None) -> str | None:
    """Why a complete step must exist by now, or None. A step the log or the ledger says was saved
    (``said_saved``: :func:`_said_saved`) does; else a visible log decides (its newest iteration reached
    ``save_interval``); without one, any sign that the run started (:func:`_started`) does."""
    if said_saved:
        return f"global_step{said_saved[0]} was saved ({said_saved[1]})"
    records = snap.log.records if snap.log else []
    if records:
        last = records[-1]["iteration"]
        return f"the log reached iteration {last} (one save every {save_interval})" if last >= save_interval else None
    return _started(snap)


def check_save_interval(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """``checkpoint.save_interval`` from the run's measured figures (:attr:`RunSnapshot.measured`):
    :func:`save_interval_findings`."""
    failures = sum(row.state in chain.FAILURES for row in snap.ledger.rows)
    return save_interval_findings(snap.measured, failures, spec.checkpoint.save_interval)


def save_interval_findings(measured: dict | None, failures: int, save_interval: int) -> list[Finding]:
    """``checkpoint.save_interval``: the run's measured MTBF, save cost and iteration time
    (:func:`opskit.monitor.snapshot.measure_save_interval`), Young/Daly's interval and what the spec's loses
    (:mod:`opskit.history.measures`); a warning when it loses more than :data:`SAVE_INTERVAL_EXCESS` of the wall time
    over the best one. Nothing without figures (before the first failure: no MTBF)."""
    if measured is None:
        return []
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


def check_disk(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """Bytes and inodes used on the run's file system: :func:`disk_findings`."""
    return disk_findings(snap.disk, spec.watchdog)


def disk_findings(disk: Disk, wd: WatchdogSpec) -> list[Finding]:
    """Bytes and inodes used on the file system holding the run directory (fs-watchdog's check), from one
    ``statvfs``; bytes as ``df`` and psutil count them: used / (used + available to users)."""
    vfs, path = disk.vfs, disk.path
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


# --------------------------------------------------------------------------- the list

Check = Callable[[RunSnapshot, Spec], list[Finding]]

def check_divergence(snap: RunSnapshot, spec: Spec) -> list[Finding]:
    """One finding per divergence incident (:mod:`opskit.run.incidents`), keyed by its id: an alert while it is
    younger than ``alerts.resend_hours`` (so the channels tell it once and never again), then a warning; one being
    replayed or held stays an alert (a held chain is also the scheduler's alert)."""
    if snap.incidents_error is not None:
        return [Finding("divergence.unreadable", "warn", snap.incidents_error)]
    findings = []
    for incident in snap.incidents:
        opened = incident.get("opened_s") or 0
        fresh = snap.now.timestamp() - opened < spec.watchdog.alerts.resend_hours * 3600
        open_one = incident.get("verdict") in ("replaying", "held")
        findings.append(Finding(f"divergence.incident_{incident['id']}", "alert" if fresh or open_one else "warn",
                                incident_line(incident), {"incident": incident}))
    return findings


CHECKS: tuple[Check, ...] = (check_scheduler, check_chain, check_ledger, check_progress, check_log, check_stragglers,
                             check_divergence, check_checkpoint, check_save_interval, check_disk)
"""Every check, in the report's order. A new check: a function ``(snapshot, spec) -> list[Finding]`` above, and its
name here."""
