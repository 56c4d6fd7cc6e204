"""What one run's page shows (issue 49), gathered once into a JSON-able :class:`RunPage` from the library calls the
terminal commands make: the watchdog's report (the one ``opskit status`` just made, else
:func:`opskit.monitor.watchdog.run_checks` with its state left as it was); the log read once
(:meth:`opskit.history.sources.LogSource.timeline`): its series thinned per screen column by
:func:`opskit.logs.plot.thin` with every spike kept, the validation loss, progress and the full-batch medians; the
goodput account (:func:`opskit.history.goodput.account`), whose tasks and in-job steps carry their nodes, the job's
own lines and a clock that puts each iteration on wall-clock time; the divergence incidents, the nodes kept out, the
checkpoints with their backups and copies, and the plan beside what was measured. What a source cannot give (a bare
log has no ledger) is listed in :attr:`RunPage.unknown`, and a part that cannot be read is said in one line there,
never raised.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from opskit.errors import OpskitError
from opskit.history.sources import LogSource, resolve
from opskit.logs.parse import LogFormatError
from opskit.logs.plot import thin
from opskit.logs.spikes import spikes_of
from opskit.rules.spike_rule import DEFAULT_CONFIG
from opskit.run import chain
from opskit.run.incidents import IncidentsError, read_incidents, skip_ranges
from opskit.run.paths import RunPaths

SERIES = ("lm_loss", "grad_norm", "learning_rate", "global_batch_size", "samples_per_second", "tflops",
          "elapsed_time_per_iteration_s")
"""The iteration line's fields the page charts (``opskit.logs.grammar.FIELDS``' names)."""
FIELDS = (*SERIES, "train_iters", "consumed_samples", "consumed_tokens")
"""What the page reads of each iteration line: the charted fields and progress's."""
STATES = (("scheduler.running", "running"), ("scheduler.pending", "queued"),
          ("scheduler.pending_too_long", "queued (long)"), ("scheduler.pending_forever", "queued (cannot start)"),
          ("scheduler.finished", "finished"),
          ("scheduler.stopped", "held"), (chain.RESTART_STORM, "held"), ("scheduler.absent", "failed (nothing queued)"),
          ("scheduler.unreachable", "unknown (SLURM unreachable)"))
"""The watchdog's scheduler finding -> the run's state on the page."""
RECENT = 20
"""The last iteration lines the ETA's seconds per iteration is the median of (``opskit status``'s)."""
SCREEN_COLUMNS = 1500
"""Points kept per series and per screen column: a 1M-iteration log is thinned to what a wide screen shows
(:func:`opskit.logs.plot.thin`: first, last, min and max of each column), every spike kept."""
_DATED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


@dataclass
class RunPage:
    """The run's state for its page (every field JSON-able). ``series``: field -> ``{"iteration": [...], "value":
    [...], "time": [POSIX ms or None, ...] (with a goodput account), "points_in_log"}`` (thinned); ``validation``: the
    same of the validation lm loss; ``tasks``: each task or in-job step of the chain (:meth:`TaskTime.as_json` with
    ``start_ms``/``end_ms`` and its ``goodput``); ``unknown``: what this source cannot tell, one line each."""

    title: str
    source: str
    log: str | None
    built: str
    run_dir: str | None = None
    state: dict = field(default_factory=dict)
    progress: dict | None = None
    alerts: list[dict] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    series: dict[str, dict] = field(default_factory=dict)
    validation: dict | None = None
    spikes: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    skipped: list[list[int]] = field(default_factory=list)
    tasks: list[dict] = field(default_factory=list)
    exclusions: list[dict] = field(default_factory=list)
    goodput: dict | None = None
    checkpoints: list[dict] = field(default_factory=list)
    plan: list[dict] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    """Medians over the log's iteration lines at its largest global batch size (the ramp-up over):
    ``seconds_per_iteration``, ``tflops``, and that ``global_batch_size``."""
    unknown: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return _finite(asdict(self))


def gather(name_or_path: str, now: datetime | None = None, watchdog_report=None) -> RunPage:
    """The page's facts for a spec name, a run folder (also one without a log yet) or a log file (any log the parser
    reads).

    Args:
        watchdog_report: the :class:`opskit.monitor.watchdog.Report` ``opskit status`` just made of this spec (not
            made again); default: :func:`opskit.monitor.watchdog.run_checks` with its state left as it was.

    Raises:
        SpecError, LogFormatError: as :func:`opskit.history.sources.resolve`: neither a spec, a folder nor a log.
    """
    path, spec = Path(name_or_path), _spec_of(name_or_path)
    try:
        source = resolve(name_or_path)
    except LogFormatError as e:
        if not path.is_dir():
            raise
        source, missing = None, str(e)
    run = RunPaths.of(spec) if spec is not None else RunPaths(path) if path.is_dir() else _run_of(source)
    page = RunPage(title=spec.name if spec is not None else source.name if source else path.name,
                   source=name_or_path, log=str(source.path) if source else None,
                   built=f"{now or datetime.now():%Y-%m-%d %H:%M:%S}", run_dir=str(run.root) if run else None)
    if source is None:
        page.unknown.append(missing)
    else:
        _series(page, source, spec)
    account = _goodput(page, run, spec, now) if run is not None else None
    if account is not None:
        _tasks(page, account)
        _clock(page, account)
    elif run is not None:
        _ledger_tasks(page, run)
    if spec is not None:
        _watchdog(page, spec, now, watchdog_report)
        _plan(page, spec, account)
    else:
        page.unknown.append("no spec: the queue, alerts and plan need `opskit report NAME`")
        page.state = {"state": _state_without_spec(run)}
    if run is None:
        page.unknown.append("a log outside a run folder: no ledger, in-job steps, incidents, checkpoints or goodput")
        return page
    _incidents(page, run)
    _exclusions(page, run)
    _checkpoints(page, run)
    return page


def _spec_of(name_or_path: str):
    """The spec when ``name_or_path`` names one (not a path that exists), else None."""
    from opskit.spec.files import SpecError
    from opskit.spec.load import load_spec

    if Path(name_or_path).exists() and Path(name_or_path).suffix not in (".yaml", ".yml"):
        return None
    try:
        return load_spec(name_or_path)
    except SpecError:
        return None


def _run_of(source: LogSource) -> RunPaths | None:
    """The run folder a ``logs/main_log.txt`` is in, else None."""
    path = source.path
    if not source.events and path.name == "main_log.txt" and path.parent.name == "logs":
        return RunPaths(path.parent.parent)
    return None


def _series(page: RunPage, source: LogSource, spec) -> None:
    """Each charted field over the iterations, thinned per screen column; the spikes of the lm loss and grad norm
    (:func:`opskit.logs.spikes.spikes_of`, on the whole series before thinning: every spike iteration is kept); the
    validation lm loss; progress and ETA. A large log's columns stay polars / numpy to the thinned points (a Python
    object per value costs seconds a million)."""
    import numpy as np

    try:
        chunk = source.read(FIELDS)
        columns = source.timeline(FIELDS, chunk)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"no iteration series: {e}")
        return
    spikes = spikes_of({"iteration": columns["iteration"], **{m: columns[m] for m in DEFAULT_CONFIG.metrics}})
    page.spikes = [s.as_json() for s in spikes]
    iterations = np.asarray(columns["iteration"], dtype=np.float64)
    in_spike = np.zeros(len(iterations), dtype=bool)
    for spike in spikes:
        in_spike |= (iterations >= spike.first) & (iterations <= spike.last)
    arrays = {key: _array(columns[key]) for key in SERIES}
    for key in SERIES:
        values, present = arrays[key]
        if not present.any():
            page.unknown.append(f"{key.replace('_', ' ')}: not in this log's iteration lines")
            continue
        if key == "samples_per_second" and spec is not None:  # the chart people read: tokens, at the spec's length
            key, values = "tokens_per_second", values * spec.model.seq_length
        xs, ys = iterations[present], values[present]
        kept_x, kept_y = thin(xs, ys, float(xs[0]), float(xs[-1]), SCREEN_COLUMNS)
        kept = set(kept_x)
        spiked = [(x, y) for x, y in zip(xs[in_spike[present]].tolist(), ys[in_spike[present]].tolist(), strict=True)
                  if x not in kept]
        merged = sorted([*zip(list(kept_x), list(kept_y), strict=True), *spiked])
        page.series[key] = {"iteration": [int(p[0]) for p in merged], "value": [p[1] for p in merged],
                            "points_in_log": int(present.sum())}
    _validation(page, chunk)
    _progress(page, columns, source.planned_tokens)
    _full_batch_medians(page, arrays)


def _array(column):
    """(float64 values, present mask) of a timeline column: a polars Series (null: absent) or a list (None)."""
    import numpy as np

    if hasattr(column, "is_not_null"):
        import polars as pl

        return column.cast(pl.Float64).fill_null(np.nan).to_numpy(), column.is_not_null().to_numpy()
    present = np.array([v is not None for v in column], dtype=bool)
    return np.array([np.nan if v is None else float(v) for v in column], dtype=np.float64), present


def _validation(page: RunPage, chunk) -> None:
    """The validation lm loss at each iteration it was evaluated (the latest line of an iteration, after a
    restart's repeat)."""
    found = {r["iteration"]: r["validation_lm_loss"] for r in chunk.records
             if r["kind"] == "validation" and r.get("iteration") is not None}
    if not found:
        page.unknown.append("validation loss: no validation lines in this log")
        return
    page.validation = {"iteration": sorted(found), "value": [found[i] for i in sorted(found)]}


def _progress(page: RunPage, columns, planned_tokens: int | None) -> None:
    """Progress and ETA (:func:`opskit.logs.eta.progress`) from the last iteration lines, with its basis."""
    from opskit.logs.eta import progress

    recent = min(RECENT, len(columns["iteration"]))
    tail = {key: (col[-recent:].to_list() if hasattr(col, "to_list") else list(col[-recent:]))
            for key, col in columns.items()}
    records = [{k: v for k, v in zip(tail, row, strict=True) if v is not None} for row in zip(*tail.values(),
                                                                                              strict=True)]
    if "train_iters" not in records[-1]:
        page.unknown.append("progress: the last iteration line has no train_iters")
        return
    done = progress(records, recent=RECENT, planned_tokens=planned_tokens)
    basis = f"iterations left x the median s/iteration of the last {recent} iteration lines"
    if done.planned_tokens_source is not None:
        basis += f"; planned tokens: {done.planned_tokens_source}"
    page.progress = {**done.as_json(), "basis": basis}


def _goodput(page: RunPage, run: RunPaths, spec, now: datetime | None):
    """The run's goodput account (:func:`opskit.history.goodput.account`), None when there is none to give."""
    from opskit.history.goodput import account

    try:
        found = account(run, spec.watchdog if spec is not None else None, now)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"goodput and the chain's timeline: {e}")
        return None
    page.goodput = {k: v for k, v in found.as_json().items() if k != "tasks"}
    return found


def _tasks(page: RunPage, account) -> None:
    """Each task and in-job step of the goodput account, with its times in POSIX ms (the timeline's axis) and its
    own goodput (training over its wall clock and queue wait)."""
    for task in account.tasks:
        total = sum(task.seconds.values())
        page.tasks.append({**task.as_json(), "label": task.label, "start_ms": task.start.timestamp() * 1000,
                           "end_ms": task.end.timestamp() * 1000,
                           "goodput": round(task.seconds["training"] / total, 4) if total else None})


def _ledger_tasks(page: RunPage, run: RunPaths) -> None:
    """Without a goodput account (no job lines in the log): the ledger's rows, what the chain says of each task."""
    ledger = chain.ledger_of(run)
    page.unknown += ledger.damaged
    page.tasks = [{**asdict(row), "label": row.task, "start": None, "end": row.time} for row in ledger.rows]


def _clock(page: RunPage, account) -> None:
    """Each charted point's wall-clock time (POSIX ms) from the goodput account's task clocks (a later task's time of
    an iteration trained again wins); None where no task logged that iteration."""
    import numpy as np

    pairs = [pair for task in account.tasks for pair in task.clock]
    if not pairs:
        page.unknown.append("wall-clock time: no task has logged an iteration after its training start")
        return
    iterations, seconds = np.array(pairs, dtype=np.float64).T
    last, first_of_reversed = np.unique(iterations[::-1], return_index=True)
    at_ms = seconds[::-1][first_of_reversed] * 1000
    for series in (*page.series.values(), *([page.validation] if page.validation else [])):
        wanted = np.asarray(series["iteration"], dtype=np.float64)
        where = np.clip(np.searchsorted(last, wanted), 0, len(last) - 1)
        series["time"] = [float(t) if hit else None for t, hit in zip(at_ms[where], last[where] == wanted,
                                                                       strict=True)]


def _state_without_spec(run: RunPaths | None) -> str:
    if run is None:
        return "unknown (a log alone)"
    if run.finished_flag.exists():
        return "finished"
    rows = chain.ledger_of(run).rows
    return f"last task {rows[-1].state}" if rows else "unknown (no task has ended)"


def _watchdog(page: RunPage, spec, now: datetime | None, report) -> None:
    """The watchdog's findings (its state is not moved: the hourly check still sees what is new) and the run's state:
    running / queued / finished / held / failed and the layout."""
    from opskit.monitor.watchdog import run_checks

    try:
        report = report or run_checks(spec, now, persist=False)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"the watchdog's checks: {e}")
        return
    findings = report.as_json()["findings"]
    page.findings = findings
    page.alerts = [f for f in findings if f["severity"] == "alert"]
    keys = {f["key"] for f in findings}
    state = next((name for key, name in STATES if key in keys), "unknown (the scheduler was not read)")
    page.state = {"state": state, "layout": _layout(spec), "pulse": report.pulse_lines}


def _layout(spec) -> str:
    p = spec.parallel
    dp = p.nodes * p.gpus_per_node // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    return (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x DP {dp} on {p.nodes} node(s) x "
            f"{p.gpus_per_node} GPU(s), {spec.slurm.spare_nodes} spare(s)")


def _plan(page: RunPage, spec, account) -> None:
    """The plan (:func:`opskit.spec.plan.make_plan`) beside what the run measured: peak memory per GPU (the memory
    lines' largest ``max allocated``), seconds per iteration and TFLOPs per GPU at the full batch
    (:attr:`RunPage.measured`), days to train (planned; measured: days so far + the ETA's days left)."""
    from opskit.spec.plan import make_plan

    try:
        plan = make_plan(spec)
    except (OpskitError, ValueError) as e:
        page.unknown.append(f"the plan: {e}")
        return
    peaks = [t.max_allocated_mib for t in account.tasks if t.max_allocated_mib] if account else []
    gbs = spec.batch.global_batch_size
    tflops = (f"planned at {plan.time.tflops:g} TFLOPs per GPU ({plan.time.tflops_source})" if plan.time.tflops
              else "no TFLOPs figure for parallel.gpu to plan with")
    if page.measured.get("global_batch_size") not in (None, gbs):
        page.unknown.append(f"the log's largest GBS is {page.measured['global_batch_size']}, the spec's {gbs}: the "
                            "measured times are not at the spec's full batch")
    elapsed_days = account.wall_seconds / 86400 if account else None
    left = (page.progress or {}).get("days_left")
    page.plan = [
        {"what": "memory per GPU (GiB)", "planned": plan.memory.total_gib_per_gpu,
         "measured": max(peaks) / 1024 if peaks else None, "note": "the memory lines' max allocated"},
        {"what": "seconds per iteration", "planned": plan.time.seconds_per_iteration,
         "measured": page.measured.get("seconds_per_iteration"), "note": f"at the full GBS ({gbs}); {tflops}"},
        {"what": "TFLOPs per GPU", "planned": plan.time.tflops, "measured": page.measured.get("tflops"),
         "note": f"the log's TFLOPs at the full GBS; planned: {plan.time.tflops_source}"},
        {"what": "days to train", "planned": plan.time.days_with_rampup_slowdown or plan.time.days,
         "measured": None if elapsed_days is None or left is None else elapsed_days + left,
         "note": "measured: the run's wall clock so far + the ETA's days left"}]
    if not peaks:
        page.unknown.append("measured memory: no '[Rank N] (after K iterations) memory (MB)' line (a GPU run's)")


def _full_batch_medians(page: RunPage, arrays: dict) -> None:
    """:attr:`RunPage.measured`: the median seconds per iteration and TFLOPs per GPU of the lines at the log's largest
    global batch size (all lines when none gives one); ``arrays``: :func:`_array` of each of :data:`SERIES`."""
    import numpy as np

    batch, has_batch = arrays["global_batch_size"]
    full = batch == batch[has_batch].max() if has_batch.any() else np.ones(len(batch), dtype=bool)
    if has_batch.any():
        page.measured["global_batch_size"] = int(batch[has_batch].max())
    for key, name in (("elapsed_time_per_iteration_s", "seconds_per_iteration"), ("tflops", "tflops")):
        values, present = arrays[key]
        if (present & full).any():
            page.measured[name] = float(np.median(values[present & full]))


def _incidents(page: RunPage, run: RunPaths) -> None:
    try:
        page.incidents = read_incidents(run)
    except IncidentsError as e:
        page.unknown.append(str(e))
        return
    page.skipped = [list(r) for r in skip_ranges(page.incidents)]


def _exclusions(page: RunPage, run: RunPaths) -> None:
    """Nodes kept out: the run's bad-node list (``opskit submit`` excludes them; the date its line starts with, when
    the job wrote it) and each job's in-job exclusions (pre-flight, blamed) not on it."""
    from opskit.allocation.in_job import read_job_states

    try:
        bad = chain.read_bad_nodes(run)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"bad nodes: {e}")
        bad = {}
    for node, why in bad.items():
        when = why[:19] if _DATED.match(why) else None
        page.exclusions.append({"node": node, "why": why[20:] if when else why, "when": when, "where": "run"})
    states, unreadable = read_job_states(run)
    page.unknown += unreadable
    for job, state in states.items():
        page.exclusions += [{"node": node, "why": why, "when": None, "where": f"job {job}"}
                            for node, why in state["excluded"].items() if node not in bad]


def _checkpoints(page: RunPage, run: RunPaths) -> None:
    """Each step (complete or not, bytes, ``latest``) with its backups (``.opskit-backups.json``: target, verified
    when), its universal copy and its converted (Hugging Face) copy in the run's ``hf/``."""
    from opskit.ckpt.backup import BackupError, read_record
    from opskit.ckpt.convert import CONVERT_COMMAND
    from opskit.ckpt.format.universal import origin_text
    from opskit.ckpt.listing import list_checkpoint
    from opskit.fsutil import has_marker

    try:
        listing = list_checkpoint(run.checkpoints)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"checkpoints: {e}")
        return
    try:
        backups = read_record(run.checkpoints)
    except BackupError as e:
        page.unknown.append(str(e))
        backups = {}
    for step in listing.steps:
        tag = step.path.name
        universal = listing.universal.get(step.iteration)
        converted = run.hf_dir / tag
        page.checkpoints.append({
            **step.as_json(), "tag": tag,
            "backups": [{"target": url, "verified_at": steps[tag].get("verified_at")}
                        for url, steps in backups.items() if tag in steps],
            "universal": origin_text(universal[1]) if universal else None,
            "converted": str(converted) if has_marker(converted, CONVERT_COMMAND) else None})


def _finite(value):
    """JSON without NaN/Inf (a browser's JSON.parse refuses them): as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

