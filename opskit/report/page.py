"""The run's page (issue 49): one self-contained HTML file from a :class:`~opskit.report.facts.RunPage`. Charts are
Bokeh's (BokehJS inlined from the installed ``bokeh`` package, its BSD licence in the page; nothing is fetched when
the page is viewed): the series over the iterations on one shared, zoomable x axis, with a hover showing the
iteration's value, spikes marked, skipped ranges shaded and incidents drawn as lines. Tables for what needs a
person now, the chain's tasks and their in-job steps, the incidents, goodput, checkpoints and the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from opskit.errors import MissingExtraError
from opskit.fsutil import OutputRefusedError, atomic_write_text
from opskit.report.facts import RunPage, gather
from opskit.run.paths import RunPaths

CHARTS = (("lm_loss", "lm loss"), ("grad_norm", "grad norm"), ("learning_rate", "learning rate"),
          ("samples_per_second", "samples per second"), ("tflops", "TFLOPs per GPU"),
          ("global_batch_size", "global batch size (ramp-up)"))
MARKER = "<!-- written by opskit report -->"
"""The page's first line: what makes an existing file one opskit may replace."""


@dataclass(frozen=True)
class BuiltPage:
    """What ``opskit report`` wrote: the page's path and its facts."""

    out: Path
    page: RunPage

    def as_json(self) -> dict:
        return {"out": str(self.out), **self.page.as_json()}


def build_page(name_or_path: str, out: Path | None = None, force: bool = False) -> BuiltPage:
    """Gather the run's facts (:func:`opskit.report.facts.gather`) and write its page: to ``out``, else the run's
    ``report.html`` (opskit's own file: refreshed without ``force``).

    Raises:
        SpecError, LogFormatError: not a spec, run or log. OutputRefusedError: see :func:`write`; a log outside a run
            folder and no ``out``. MissingExtraError: no bokeh.
    """
    page = gather(name_or_path)
    if out is None:
        if page.run_dir is None:
            raise OutputRefusedError(f"{name_or_path}: a log outside a run folder; say where the page goes (--out)")
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
    script, divs = components(figures) if figures else ("", [])
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


def _figures(page: RunPage) -> list:
    """One Bokeh figure per charted series, all on the first one's x range (zoom one, zoom all)."""
    from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Span
    from bokeh.plotting import figure

    figures, shared = [], None
    for key, label in CHARTS:
        series = page.series.get(key)
        if not series:
            continue
        fig = figure(height=220, sizing_mode="stretch_width", title=label, x_axis_label="iteration",
                     tools="xwheel_zoom,xpan,box_zoom,reset,save", active_scroll="xwheel_zoom",
                     **({"x_range": shared} if shared is not None else {}))
        shared = shared or fig.x_range
        source = ColumnDataSource({"iteration": series["iteration"], "value": series["value"]})
        line = fig.line("iteration", "value", source=source, line_width=1.5)
        fig.add_tools(HoverTool(renderers=[line], mode="vline",
                                tooltips=[("iteration", "@iteration"), (label, "@value{0.[0000]}")]))
        metric_spikes = [s for s in page.spikes if s["metric"] == key]
        if metric_spikes:
            peaks = ColumnDataSource({"iteration": [s["peak_iteration"] for s in metric_spikes],
                                      "value": [s["peak"] for s in metric_spikes]})
            fig.scatter("iteration", "value", source=peaks, size=8, color="crimson", legend_label="spike")
        for first, last in page.skipped:
            fig.add_layout(BoxAnnotation(left=first, right=last, fill_alpha=0.15, fill_color="orange"))
        for incident in page.incidents:
            fig.add_layout(Span(location=incident["first"], dimension="height", line_color="crimson",
                                line_dash="dashed"))
        figures.append(fig)
    return figures


def _bokeh_licence() -> str:
    try:
        return (resources.files("bokeh") / "LICENSE.txt").read_text()
    except (OSError, ModuleNotFoundError):
        return "BokehJS: BSD-3-Clause, Copyright (c) Anaconda, Inc., and Bokeh Contributors"
