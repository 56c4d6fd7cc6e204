"""The run's page (issue 49): one self-contained HTML file from a :class:`~opskit.report.facts.RunPage`. Charts are
Bokeh's (BokehJS inlined from the installed ``bokeh`` package, its BSD licence in the page; nothing is fetched when
the page is viewed): the series in two tabs, over the iterations and over wall-clock time, each on one shared,
zoomable x axis with a hover showing the iteration's values, spikes marked, skipped ranges shaded and incidents drawn
as lines; the chain's tasks and in-job steps on a time axis with the job's own lines as marks; each task's hours by
goodput category. Tables for what needs a person now, the tasks, the nodes kept out, the incidents, goodput,
checkpoints and the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

import jinja2

from opskit.errors import MissingExtraError, OpskitError
from opskit.fsutil import OutputRefusedError, atomic_write_text
from opskit.report.facts import RunPage, gather
from opskit.run.paths import RunPaths

CHARTS = (("lm_loss", "lm loss"), ("grad_norm", "grad norm"), ("learning_rate", "learning rate"),
          ("tokens_per_second", "tokens per second"), ("samples_per_second", "samples per second"),
          ("tflops", "TFLOPs per GPU"), ("global_batch_size", "global batch size (ramp-up)"))
"""The series charted (:data:`opskit.report.facts.SERIES`' keys; tokens per second where the spec gives the sequence
length, else samples per second), each over the iterations and, with the job's dated lines, over wall-clock time."""
STATE_COLOURS = {"COMPLETED": "seagreen", "TIMEOUT": "goldenrod", "RESTARTED": "darkorange", "CANCELLED": "grey",
                 "SKIPPED": "lightgrey", None: "steelblue"}
"""A task's bar colour by its ledger state (None: running, or not in the ledger yet); any other state (FAILED,
NODE_FAIL, ...) is a failure: crimson."""
MARKER = "<!-- written by opskit report -->"
"""The page's first line: what makes an existing file one opskit may replace."""


@dataclass(frozen=True)
class BuiltPage:
    """What ``opskit report`` wrote: the page's path and its facts."""

    out: Path
    page: RunPage

    def as_json(self) -> dict:
        return {"out": str(self.out), **self.page.as_json()}


def refresh_run_page(name: str, watchdog_report=None) -> str | None:
    """Rebuild the run's own page (``opskit status --alert`` / ``--page``, hourly under ``opskit cron``) from the
    report the watchdog just made; why it could not, in one line (None when it was written): a page is never worth
    a failed watchdog run."""
    try:
        build_page(name, watchdog_report=watchdog_report)
    except (OpskitError, OSError) as e:
        return f"the run's page was not refreshed: {e}"
    return None


def build_page(name_or_path: str, out: Path | None = None, force: bool = False,
               watchdog_report=None) -> BuiltPage:
    """Gather the run's facts (:func:`opskit.report.facts.gather`, with ``watchdog_report`` when ``opskit status``
    made one) and write its page: to ``out``, else the run's ``report.html`` (opskit's own file: refreshed without
    ``force``).

    Raises:
        SpecError, LogFormatError: not a spec, run or log. OutputRefusedError: see :func:`write`; no ``out`` for a
            log outside a run folder or a spec whose run folder does not exist. MissingExtraError: no bokeh.
    """
    page = gather(name_or_path, watchdog_report=watchdog_report)
    if out is None:
        if page.run_dir is None:
            raise OutputRefusedError(f"{name_or_path}: a log outside a run folder; say where the page goes (--out)")
        if not Path(page.run_dir).is_dir():  # never made here: a missing run folder is the watchdog's alert
            raise OutputRefusedError(f"{page.run_dir}: no run folder yet (nothing submitted?); say where the page "
                                     "goes (--out)")
        out, force = RunPaths(Path(page.run_dir)).report, True
    return BuiltPage(write(page, out, force), page)


def render(page: RunPage) -> str:
    """The page's HTML (one string, every script and style inline).

    Raises:
        MissingExtraError: ``bokeh`` is not installed (``pip install 'opskit[report]'``).
    """
    try:
        from bokeh.embed import components
        from bokeh.resources import Resources
    except ImportError:
        raise MissingExtraError("opskit report draws with bokeh: pip install 'opskit[report]'") from None
    figures = _figures(page)
    script, divs = components(figures) if figures else ("", {})
    template = jinja2.Environment(autoescape=True).from_string(
        (resources.files("opskit.report") / "page.html.j2").read_text())
    return template.render(marker=MARKER, page=page, bokeh_js=Resources(mode="inline", components=["bokeh"])
                           .render_js(), script=script, divs=divs, licence=_bokeh_licence(),
                           headline=_headline(page))


def write(page: RunPage, out: Path, force: bool = False) -> Path:
    """Render ``page`` into ``out`` atomically. An existing ``out`` is replaced only when it is a page opskit wrote
    (:data:`MARKER`) and ``force`` or it is the run's own page being refreshed.

    Raises:
        OutputRefusedError: ``out`` exists and is not a page opskit wrote, or ``force`` is missing.
    """
    if out.exists() or out.is_symlink():
        if not out.is_file() or not _ours(out):
            raise OutputRefusedError(f"{out}: exists and is not a page opskit report wrote; choose another --out")
        if not force:
            raise OutputRefusedError(f"{out}: exists (a page opskit report wrote); --force replaces it")
    text = render(page)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return out


def _ours(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MARKER) + 2).decode(errors="replace").startswith(MARKER)
    except OSError:
        return False


def _headline(page: RunPage) -> str:
    state = page.state.get("state", "unknown")
    return f"{page.title}: {state}" + (f", {len(page.alerts)} alert(s)" if page.alerts else "")


def _figures(page: RunPage) -> dict:
    """The page's Bokeh models by place: ``series`` (tabs: over iterations, over wall-clock time), ``timeline`` and
    ``goodput`` (the chain's tasks); a place without data is left out."""
    figures, sources = {}, _sources(page)
    by_iteration = _series_figures(page, "iteration", sources)
    if by_iteration:
        from bokeh.layouts import column
        from bokeh.models import TabPanel, Tabs

        tabs = [TabPanel(child=column(*by_iteration, sizing_mode="stretch_width"), title="over iterations")]
        by_time = _series_figures(page, "time", sources)
        if by_time:
            tabs.append(TabPanel(child=column(*by_time, sizing_mode="stretch_width"), title="over wall-clock time"))
        figures["series"] = Tabs(tabs=tabs, sizing_mode="stretch_width")
    timed = [t for t in page.tasks if t.get("start_ms") is not None]
    if timed:
        figures["timeline"] = _timeline(page, timed)
        figures["goodput"] = _goodput_bars(timed)
    return figures


def _sources(page: RunPage) -> dict:
    """One Bokeh data source per charted series and the validation loss, shared by both tabs (the page holds each
    series' points once)."""
    from bokeh.models import ColumnDataSource

    found = {key: ColumnDataSource(_columns(series)) for key, series in page.series.items()}
    if page.validation:
        found["validation"] = ColumnDataSource(_columns(page.validation))
    return found


def _series_figures(page: RunPage, x: str, sources: dict) -> list:
    """One figure per charted series over ``x`` (``iteration`` or ``time``: [] when no point has one), all on the
    first one's x range (zoom one, zoom all), drawn from ``sources`` (:func:`_sources`): hover gives the iteration's
    values, spikes are marked, skipped ranges shaded and incidents drawn as dashed lines (over the iterations)."""
    from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Span
    from bokeh.plotting import figure

    figures, shared = [], None
    for key, label in CHARTS:
        series = page.series.get(key)
        if not series or (x == "time" and not any(t is not None for t in series.get("time", ()))):
            continue
        fig = figure(height=220, sizing_mode="stretch_width", title=label,
                     x_axis_label="iteration" if x == "iteration" else "wall-clock time",
                     x_axis_type="datetime" if x == "time" else "linear",
                     tools="xwheel_zoom,xpan,box_zoom,reset,save", active_scroll="xwheel_zoom",
                     **({"x_range": shared} if shared is not None else {}))
        shared = shared or fig.x_range
        line = fig.line(x, "value", source=sources[key], line_width=1.5)
        tooltips = [("iteration", "@iteration"), (label, "@value{0.[0000]}")]
        if "time" in series:
            tooltips.append(("time", "@time{%F %T}"))
        fig.add_tools(HoverTool(renderers=[line], mode="vline", tooltips=tooltips, formatters={"@time": "datetime"}))
        if key == "lm_loss" and page.validation:
            fig.scatter(x, "value", source=sources["validation"], size=6, color="darkorange",
                        legend_label="validation")
        metric_spikes = [s for s in page.spikes if s["metric"] == key]
        if metric_spikes and x == "iteration":
            peaks = ColumnDataSource({"iteration": [s["peak_iteration"] for s in metric_spikes],
                                      "value": [s["peak"] for s in metric_spikes]})
            fig.scatter("iteration", "value", source=peaks, size=8, color="crimson", legend_label="spike")
        if x == "iteration":
            for first, last in page.skipped:
                fig.add_layout(BoxAnnotation(left=first, right=last, fill_alpha=0.15, fill_color="orange"))
            for incident in page.incidents:
                fig.add_layout(Span(location=incident["first"], dimension="height", line_color="crimson",
                                    line_dash="dashed"))
        figures.append(fig)
    return figures


def _columns(series: dict) -> dict:
    """A series' columns for a ColumnDataSource, as numpy arrays (Bokeh embeds them as base64 buffers, not JSON
    numbers); times NaN where unknown (Bokeh leaves a gap)."""
    import numpy as np

    data = {"iteration": np.asarray(series["iteration"], dtype=np.int64),
            "value": np.asarray([math.nan if v is None else v for v in series["value"]], dtype=np.float64)}
    if "time" in series:
        data["time"] = np.asarray([math.nan if t is None else t for t in series["time"]], dtype=np.float64)
    return data


def _timeline(page: RunPage, tasks: list[dict]):
    """The chain on one time axis: a bar per task or in-job step (colour: how it ended), its job's own lines (a hang
    and its rank, a blamed node, a pre-flight exclusion, a restart) as marks on its bar, incidents as marks on the
    first row; hover for the details."""
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    labels = [t["label"] for t in tasks]
    fig = figure(height=60 + 28 * len(labels), sizing_mode="stretch_width", title="tasks and in-job steps",
                 x_axis_type="datetime", y_range=list(reversed(dict.fromkeys(labels))),
                 tools="xwheel_zoom,xpan,reset,save", active_scroll="xwheel_zoom")
    bars = ColumnDataSource({
        "label": labels, "start": [t["start_ms"] for t in tasks], "end": [t["end_ms"] for t in tasks],
        "state": [t["state"] or "running" for t in tasks], "nodes": [t["nodes"] for t in tasks],
        "why": [t["reason"] for t in tasks], "iterations": [t["iterations"] for t in tasks],
        "colour": [STATE_COLOURS.get(t["state"], "crimson") for t in tasks]})
    drawn = fig.hbar(y="label", left="start", right="end", height=0.6, color="colour", source=bars)
    fig.add_tools(HoverTool(renderers=[drawn], tooltips=[
        ("task", "@label"), ("state", "@state"), ("nodes", "@nodes"), ("why", "@why"), ("iterations", "@iterations"),
        ("start", "@start{%F %T}"), ("end", "@end{%F %T}")], formatters={"@start": "datetime", "@end": "datetime"}))
    events = [(t["label"], _ms(at), message) for t in tasks for at, message in t.get("events", [])]
    events += [(labels[0], _ms(i["opened"]), f"incident {i['id']}: {i.get('outcome') or i.get('verdict')}")
               for i in page.incidents if _ms(i.get("opened")) is not None]
    if events:
        marks = ColumnDataSource({"label": [e[0] for e in events], "at": [e[1] for e in events],
                                  "message": [e[2] for e in events]})
        drawn = fig.scatter("at", "label", source=marks, marker="diamond", size=11, color="black")
        fig.add_tools(HoverTool(renderers=[drawn], tooltips=[("at", "@at{%F %T}"), ("", "@message")],
                                formatters={"@at": "datetime"}))
    return fig


def _goodput_bars(tasks: list[dict]):
    """Each task's wall clock split as ``opskit goodput`` splits it (hours, stacked)."""
    from bokeh.models import ColumnDataSource
    from bokeh.palettes import Category10_10
    from bokeh.plotting import figure

    from opskit.history.goodput import CATEGORIES

    labels = [t["label"] for t in tasks]
    data = {"label": labels, **{c: [t["hours"][c] for t in tasks] for c in CATEGORIES}}
    fig = figure(height=110 + 28 * len(labels), sizing_mode="stretch_width", title="where each task's hours went",
                 y_range=list(reversed(dict.fromkeys(labels))), x_axis_label="hours", tools="hover,save",
                 tooltips="$name: @$name{0.[000]} h")
    fig.hbar_stack(list(CATEGORIES), y="label", height=0.6, color=Category10_10, source=ColumnDataSource(data),
                   legend_label=list(CATEGORIES))
    fig.legend.orientation = "horizontal"
    fig.add_layout(fig.legend[0], "below")
    return fig


def _ms(date: str | None) -> float | None:
    """A ``%Y-%m-%d %H:%M:%S`` date (local time, as the log's) as POSIX ms; None for none or another text."""
    try:
        return datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() * 1000 if date else None
    except ValueError:
        return None


def _bokeh_licence() -> str:
    try:
        return (resources.files("bokeh") / "LICENSE.txt").read_text()
    except (OSError, ModuleNotFoundError):
        return "BokehJS: BSD-3-Clause, Copyright (c) Anaconda, Inc., and Bokeh Contributors"
