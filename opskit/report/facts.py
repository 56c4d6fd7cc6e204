"""What one run's page shows (issue 49), gathered once into a JSON-able :class:`RunPage` from the library calls the
terminal commands make: the watchdog's report (:func:`opskit.monitor.watchdog.run_checks`, its state left as it was),
the log's series (:meth:`opskit.history.sources.LogSource.timeline`, thinned per screen column by
:func:`opskit.logs.plot.thin`, spikes kept), the spikes and the divergence incidents, the ledger and each task's in-job
steps, the goodput account, the checkpoints, the plan. What a source cannot give (a bare log has no ledger) is listed
in :attr:`RunPage.unknown`, and a part that cannot be read is said in one line there, never raised.
"""

from __future__ import annotations

import json
import math
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
SCREEN_COLUMNS = 1500
"""Points kept per series and per screen column: a 1M-iteration log is thinned to what a wide screen shows
(:func:`opskit.logs.plot.thin`: first, last, min and max of each column), every spike kept."""


@dataclass
class RunPage:
    """The run's state for its page. ``series``: field -> ``{"iteration": [...], "value": [...]}`` (thinned);
    ``unknown``: what this source cannot tell, one line each."""

    title: str
    source: str
    log: str | None
    built: str
    run_dir: str | None = None
    state: dict = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    series: dict[str, dict] = field(default_factory=dict)
    spikes: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    skipped: list[list[int]] = field(default_factory=list)
    tasks: list[dict] = field(default_factory=list)
    goodput: dict | None = None
    checkpoints: list[dict] = field(default_factory=list)
    plan: dict | None = None
    unknown: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return _finite(asdict(self))


def gather(name_or_path: str, now: datetime | None = None) -> RunPage:
    """The page's facts for a spec name, a run folder (also one without a log yet) or a log file (any log the parser
    reads).

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
        _series(page, source)
    if spec is not None:
        _watchdog(page, spec, now)
        _plan(page, spec)
    else:
        page.unknown.append("no spec: the queue, alerts, ETA and plan need `opskit report NAME`")
    if run is None:
        page.unknown.append("a log outside a run folder: no ledger, in-job steps, incidents, checkpoints or goodput")
        return page
    _incidents(page, run)
    _tasks(page, run)
    _goodput(page, run, spec)
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


def _series(page: RunPage, source: LogSource) -> None:
    """Each charted field over the iterations, thinned per screen column, and the spikes of the lm loss and grad norm
    (:func:`opskit.logs.spikes.spikes_of`, on the whole series before thinning: every spike iteration is kept). A large
    log's columns stay polars / numpy to the thinned points (a Python object per value costs seconds a million)."""
    import numpy as np

    try:
        columns = source.timeline(SERIES)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"no iteration series: {e}")
        return
    spikes = spikes_of({"iteration": columns["iteration"], **{m: columns[m] for m in DEFAULT_CONFIG.metrics}})
    page.spikes = [s.as_json() for s in spikes]
    iterations = np.asarray(columns["iteration"], dtype=np.float64)
    in_spike = np.zeros(len(iterations), dtype=bool)
    for spike in spikes:
        in_spike |= (iterations >= spike.first) & (iterations <= spike.last)
    for key in SERIES:
        values, present = _array(columns[key])
        if not present.any():
            page.unknown.append(f"{key.replace('_', ' ')}: not in this log's iteration lines")
            continue
        xs, ys = iterations[present], values[present]
        kept_x, kept_y = thin(xs, ys, float(xs[0]), float(xs[-1]), SCREEN_COLUMNS)
        kept = set(kept_x)
        spiked = [(x, y) for x, y in zip(xs[in_spike[present]].tolist(), ys[in_spike[present]].tolist(), strict=True)
                  if x not in kept]
        merged = sorted([*zip(list(kept_x), list(kept_y), strict=True), *spiked])
        page.series[key] = {"iteration": [int(p[0]) for p in merged], "value": [p[1] for p in merged],
                            "points_in_log": int(present.sum())}


def _array(column):
    """(float64 values, present mask) of a timeline column: a polars Series (null: absent) or a list (None)."""
    import numpy as np

    if hasattr(column, "is_not_null"):
        import polars as pl

        return column.cast(pl.Float64).fill_null(np.nan).to_numpy(), column.is_not_null().to_numpy()
    present = np.array([v is not None for v in column], dtype=bool)
    return np.array([np.nan if v is None else float(v) for v in column], dtype=np.float64), present


def _watchdog(page: RunPage, spec, now: datetime | None) -> None:
    """The watchdog's findings (its state is not moved: the hourly check still sees what is new) and the run's state:
    running / queued / finished / held / failed, progress and ETA."""
    from opskit.monitor.watchdog import run_checks

    try:
        report = run_checks(spec, now, persist=False)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"the watchdog's checks: {e}")
        return
    findings = report.as_json()["findings"]
    page.findings = findings
    page.alerts = [f for f in findings if f["severity"] == "alert"]
    keys = {f["key"] for f in findings}
    state = ("running" if "scheduler.running" in keys else "queued" if "scheduler.pending" in keys else
             "finished" if "scheduler.finished" in keys else
             "held" if keys & {"scheduler.stopped", chain.RESTART_STORM} else "not queued")
    progress = next((f for f in findings if f["key"] == "progress"), None)
    page.state = {"state": state, "progress": progress["message"] if progress else None,
                  "layout": _layout(spec), "pulse": report.pulse_lines}


def _layout(spec) -> str:
    p = spec.parallel
    dp = p.nodes * p.gpus_per_node // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    return (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x DP {dp} on {p.nodes} node(s) x "
            f"{p.gpus_per_node} GPU(s), {spec.slurm.spare_nodes} spare(s)")


def _plan(page: RunPage, spec) -> None:
    """Planned memory per GPU and days beside what the log measured (s/iter, peak memory)."""
    from opskit.spec.plan import make_plan

    try:
        plan = make_plan(spec)
    except (OpskitError, ValueError) as e:
        page.unknown.append(f"the plan: {e}")
        return
    measured = page.series.get("elapsed_time_per_iteration_s", {}).get("value", [])
    page.plan = {"memory_gib_per_gpu": round(plan.memory.total_gib_per_gpu, 1),
                 "measured_s_per_iteration": sorted(measured)[len(measured) // 2] if measured else None}


def _incidents(page: RunPage, run: RunPaths) -> None:
    try:
        page.incidents = read_incidents(run)
    except IncidentsError as e:
        page.unknown.append(str(e))
        return
    page.skipped = [list(r) for r in skip_ranges(page.incidents)]


def _tasks(page: RunPage, run: RunPaths) -> None:
    """Each task of the ledger, with its in-job steps (nodes, start, hang) from ``in-job/<job>.json``."""
    ledger = chain.ledger_of(run)
    page.unknown += ledger.damaged
    steps = _in_job_steps(run)
    for row in ledger.rows:
        page.tasks.append({**asdict(row), "steps": steps.get(row.job_id, [])})
    if not ledger.rows:
        page.unknown.append(f"{run.ledger}: no task has ended yet")


def _in_job_steps(run: RunPaths) -> dict[str, list[dict]]:
    from opskit.fsutil import read_json

    found = {}
    for path in sorted((run.root / "in-job").glob("*.json")) if (run.root / "in-job").is_dir() else []:
        try:
            state = read_json(path)
            found[path.stem] = [{"nodes": s.get("nodes"), "started": s.get("started"), "hang": s.get("hang")}
                                for s in state.get("steps", [])]
        except (OSError, ValueError, AttributeError):
            continue
    return found


def _goodput(page: RunPage, run: RunPaths, spec) -> None:
    from opskit.history.goodput import account

    try:
        page.goodput = account(run, spec.watchdog if spec is not None else None).as_json()
    except (OpskitError, OSError) as e:
        page.unknown.append(f"goodput: {e}")


def _checkpoints(page: RunPage, run: RunPaths) -> None:
    from opskit.ckpt.format.info import list_steps

    try:
        _, steps = list_steps(run.checkpoints)
    except (OpskitError, OSError) as e:
        page.unknown.append(f"checkpoints: {e}")
        return
    page.checkpoints = [s.as_json() for s in steps]


def _finite(value):
    """JSON without NaN/Inf (a browser's JSON.parse refuses them): as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def page_json(page: RunPage) -> str:
    return json.dumps(page.as_json())
