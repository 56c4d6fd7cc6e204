"""Series for ``opskit logs plot``: one line per run, smoothing, a range, spike markers; drawn as an image file
(matplotlib, Agg backend: PNG, JPEG, SVG or PDF, as the file name's suffix says) or as text for a terminal (plotext).
Both libraries are imported inside the functions that draw.

An image opskit wrote carries :data:`SOFTWARE` in its format's own metadata (PNG: a ``Software`` text chunk; JPEG: a
comment segment; SVG: the Dublin Core creator; PDF: the info dictionary's ``/Creator``), read back by
:func:`written_by_opskit` without matplotlib or PIL; only such a file is replaced, and only with ``force``. Every
image opskit draws (``logs plot``, ``goodput --out``) is claimed and saved here (:func:`claim_image`,
:func:`save_image`).
"""

from __future__ import annotations

import importlib
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import TYPE_CHECKING

from opskit.errors import MissingExtraError
from opskit.fsutil import claim_file, staging_path
from opskit.logs.grammar import iteration_fields
from opskit.logs.parse import LogFormatError, as_list, python_value, record_columns
from opskit.logs.spikes import spikes_of
from opskit.rules.spike_rule import Spike, SpikeConfig

if TYPE_CHECKING:  # the run layer above hands its sources in
    from opskit.history.sources import LogSource

X_AXES = {"iteration": "iteration", "samples": "consumed_samples", "tokens": "consumed_tokens"}
Y_ALIASES = {"lr": "learning_rate", "loss": "lm_loss", "time": "elapsed_time_per_iteration_s",
             "val_loss": "validation_lm_loss", "ppl": "validation_ppl"}
# One colour per run, in legend order (matplotlib's tab10), so a test can find each run's line by its colour.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# File name suffix -> matplotlib's format name.
FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}
SOFTWARE = "opskit logs plot"
_SAVE_MARK = {"png": {"metadata": {"Software": SOFTWARE}}, "svg": {"metadata": {"Creator": SOFTWARE}},
              "pdf": {"metadata": {"Creator": SOFTWARE}}, "jpeg": {"pil_kwargs": {"comment": SOFTWARE.encode()}}}
_SVG_MARK = re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + re.escape(SOFTWARE.encode()) + rb"</dc:title>")
_PDF_MARK = b"/Creator (" + SOFTWARE.encode() + b")"


@dataclass
class Series:
    """One run's line: ``x``/``y`` values (lists, or numpy arrays from a large log's columns), and the spikes to mark
    as (x, y) points."""

    name: str
    x: Sequence[float]
    y: Sequence[float]
    markers: list[tuple[float, float]] = field(default_factory=list)

    def as_json(self) -> dict:
        """What ``logs plot --json`` says of the line (not its points): name, number of points, first and last x,
        last y (null without points), and the spike markers as [x, y] pairs."""
        n = len(self.x)
        return {"name": self.name, "points": n, "x_first": python_value(self.x[0]) if n else None,
                "x_last": python_value(self.x[-1]) if n else None, "y_last": python_value(self.y[-1]) if n else None,
                "spikes": [[python_value(x), python_value(y)] for x, y in self.markers]}


def y_key(name: str) -> str:
    """``lr`` -> ``learning_rate``; record keys pass through."""
    return Y_ALIASES.get(name, name)


def check_x(x: str) -> None:
    """Raises LogFormatError: ``x`` is not iteration, samples or tokens (one line listing them)."""
    if x not in X_AXES:
        raise LogFormatError(f"--x {x}: expected one of {', '.join(X_AXES)}")


def check_y(y: str, records: list[dict]) -> None:
    """Refuse a ``--y`` that is neither a record field, an alias, nor an unknown field some of ``records`` carry
    under ``extra`` (``moe_loss`` or ``extra.moe_loss``).

    Raises:
        LogFormatError: one line listing the valid names.
    """
    fields = sorted(iteration_fields() - {"train_iters"}) + ["validation_lm_loss", "validation_ppl"]
    extras = sorted({key for r in records for key in r.get("extra", {})})
    key = y_key(y)
    if key in fields or key.removeprefix("extra.") in extras:
        return
    aliases = ", ".join(f"{alias}={field}" for alias, field in Y_ALIASES.items())
    found = f"; this log's extra fields: {', '.join(extras)}" if extras else ""
    raise LogFormatError(f"--y {y}: no such field; expected one of {', '.join(fields)} (aliases {aliases}){found}")


def parse_range(text: str | None) -> tuple[float | None, float | None]:
    """``"A:B"``, ``"A:"``, ``":B"`` (numbers such as ``24e9``) -> (A, B), None where open.

    Raises:
        LogFormatError: not two numbers around a colon.
    """
    if not text:
        return None, None
    low, colon, high = text.partition(":")
    try:
        if not colon:
            raise ValueError(text)
        return (float(low) if low.strip() else None, float(high) if high.strip() else None)
    except ValueError:
        raise LogFormatError(f"--range {text}: expected A:B, A: or :B with numbers (e.g. 0:24e9)") from None


def make_series(name: str, columns: dict[str, Sequence], x: str, y: str, x_range=(None, None), smooth: int = 1,
                spikes: list[Spike] = ()) -> Series:
    """The (x, y) points of records given column-wise (``columns``: ``iteration``, the x axis' record key and ``y``,
    None where a record lacks one: :func:`opskit.logs.parse.record_columns` with :func:`metric_value`, or polars
    Series with null: :func:`opskit.logs.parse.timeline_columns`, whose points come as numpy arrays) inside
    ``x_range``, ``y`` smoothed by a trailing mean over ``smooth`` points; spikes of metric ``y`` marked at their peak
    (raw value).

    Raises:
        LogFormatError: ``x`` is not iteration/samples/tokens.
    """
    check_x(x)
    x_key, low, high = X_AXES[x], *x_range
    peaks = {s.peak_iteration for s in spikes if s.metric == y}
    if isinstance(columns[y], list):
        inside = [at is not None and value is not None and (low is None or at >= low) and (high is None or at <= high)
                  for at, value in zip(columns[x_key], columns[y], strict=True)]
        xs, ys = list(compress(columns[x_key], inside)), list(compress(columns[y], inside))  # no appends
        x_of = {iteration: at for iteration, at in zip(columns["iteration"], columns[x_key], strict=True)
                if iteration in peaks and at is not None} if peaks else {}
    else:  # a large log's columns: 466 k points to the axes as numpy arrays, never as Python floats
        at, values = columns[x_key], columns[y]
        inside = at.is_not_null() & values.is_not_null()
        inside = inside & (at >= low) if low is not None else inside
        inside = inside & (at <= high) if high is not None else inside
        xs, ys = at.filter(inside).to_numpy(), values.filter(inside).to_numpy()
        chosen = columns["iteration"].is_in(list(peaks)) & at.is_not_null()
        x_of = dict(zip(columns["iteration"].filter(chosen).to_list(), at.filter(chosen).to_list(), strict=True))
    markers = [(x_of[s.peak_iteration], s.peak) for s in spikes
               if s.metric == y and s.peak_iteration in x_of and (low is None or x_of[s.peak_iteration] >= low)
               and (high is None or x_of[s.peak_iteration] <= high)]
    return Series(name, xs, _trailing_mean(ys, smooth), markers)


def run_series(sources: Iterable[tuple[str, LogSource]], x: str, y: str, x_range=(None, None), smooth: int = 1,
               on_skipped: Callable[[str, int], None] = lambda item, skipped: None) -> list[Series]:
    """One :class:`Series` per (input, its source) pair (a spec name, run folder, log file or TensorBoard event folder
    and what :func:`opskit.history.sources.resolve` made of it; a generator resolves each as its turn comes), in order:
    metric ``y`` (a record key or alias, checked against what each log holds) over ``x``, restarts resolved (what a
    resume re-ran replaces the old records), validation metrics at the consumed samples/tokens of their iteration,
    lm-loss and grad-norm spikes marked; ``x_range`` and ``smooth`` as :func:`make_series`. ``on_skipped(input, n)``
    hears of an input's n cut or garbled lines. A large log's iteration records stay columns
    (:meth:`opskit.history.sources.LogSource.timeline`), never a dict each.

    Raises:
        LogFormatError: an unknown ``y``; an input without iteration lines, or without ``y`` values with an x in
            ``x_range``; a path that is neither a log, a run folder nor an event folder.
        SpecError: an input that is no path and no spec's name.
    """
    check_x(x)
    key, x_key, series = y_key(y), X_AXES[x], []
    validation, marked = key.startswith("validation_"), key in SpikeConfig().metrics
    for item, source in sources:
        chunk = source.read(_fields_for(key, x))
        check_y(y, chunk.records)  # column-wise records have no extra fields
        if chunk.skipped:
            on_skipped(item, chunk.skipped)
        keys = (x_key, *(() if validation else (key,)), *(SpikeConfig().metrics if marked else ()))
        line = source.timeline(keys, chunk, metric_value)
        spikes = spikes_of(line) if marked else []
        points = line if not validation else record_columns(_with_x(chunk.records, line, x_key), (x_key, key),
                                                            metric_value)
        one = make_series(source.name, points, x, key, x_range, smooth, spikes)
        if not len(one.x):
            raise LogFormatError(f"{item}: no '{key}' values with an x ({x}) in range")
        series.append(one)
    return series


def _fields_for(key: str, x: str) -> tuple[str, ...] | None:
    """The iteration fields a plot needs (its axes, and what spike markers need), or None (all) for other keys."""
    wanted = {X_AXES.get(x, "iteration"), "lm_loss", "grad_norm"}
    if not key.startswith("validation_"):  # validation records always come whole
        wanted.add(key)
    return tuple(sorted(wanted)) if wanted <= iteration_fields() else None


def _with_x(records: list[dict], line: dict[str, list], x_key: str) -> list[dict]:
    """The validation records (with an iteration) of ``records``, given the x (``x_key``: consumed samples/tokens)
    of the iteration record of the same iteration in ``line`` (the timeline's columns)."""
    x_at = dict(zip(as_list(line["iteration"]), as_list(line[x_key]), strict=True))
    return [{x_key: x_at.get(r["iteration"]), **r} for r in records
            if r["kind"] == "validation" and r["iteration"] is not None]


def metric_value(record: dict, y: str) -> float | None:
    """``y`` of a record: a field, or an unknown one kept under ``extra`` (``moe_loss`` or ``extra.moe_loss``); None
    when it has none, or not a number."""
    value = record.get(y)
    if value is None:
        value = record.get("extra", {}).get(y.removeprefix("extra."))
    return value if isinstance(value, (int, float)) else None


def _trailing_mean(values: Sequence[float], n: int) -> Sequence[float]:
    if n <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def _labels(x: str, y: str) -> tuple[str, str]:
    return ("consumed " + x if x != "iteration" else x), y.replace("_", " ")


class PlotUnavailable(MissingExtraError, LogFormatError):
    """matplotlib or plotext is not installed (they come with the ``plot`` extra: opskit.errors' one rule)."""


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise PlotUnavailable.of(module) from None


def image_format(out: Path) -> str:
    """matplotlib's format for the suffix of ``out`` (``loss.jpg`` -> ``jpeg``).

    Raises:
        LogFormatError: another suffix, or none.
    """
    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        raise LogFormatError(f"--out {out}: expected a file name ending in .png, .jpg, .svg or .pdf (the suffix "
                             "picks the format)")
    return FORMATS[suffix]


def claim_image(out: Path, force: bool) -> str:
    """Check that ``out`` may be written (:func:`opskit.fsutil.claim_file` with :func:`written_by_opskit`); its format.

    Raises:
        LogFormatError: an unknown suffix. OutputRefusedError: ``out`` exists and opskit did not write it, or
            ``force`` is not given.
    """
    fmt = image_format(out)
    claim_file(Path(out), force, written_by_opskit)
    return fmt


def written_by_opskit(path: Path) -> bool:
    """Whether the image at ``path`` carries :data:`SOFTWARE` in its format's metadata (the format from its suffix)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return {"png": _png_software, "jpeg": _jpeg_comment, "svg": _svg_creator, "pdf": _pdf_creator}[
                FORMATS.get(path.suffix.lower(), "")](f)
    except (OSError, KeyError, struct.error):
        return False


def _png_software(f) -> bool:
    """A ``tEXt`` chunk ``Software`` = :data:`SOFTWARE` before the image data (PNG: 8-byte signature, then chunks of
    length, type, data, CRC)."""
    if f.read(8) != b"\x89PNG\r\n\x1a\n":
        return False
    while True:
        length, kind = struct.unpack(">I4s", f.read(8))
        if kind in (b"IDAT", b"IEND"):
            return False
        data = f.read(length)
        f.seek(4, 1)
        if kind == b"tEXt" and data == b"Software\0" + SOFTWARE.encode():
            return True


def _jpeg_comment(f) -> bool:
    """A COM segment holding :data:`SOFTWARE` before the scan (JPEG: SOI, then marker + 2-byte length segments)."""
    if f.read(2) != b"\xff\xd8":
        return False
    while True:
        marker, length = struct.unpack(">2sH", f.read(4))
        if marker[0] != 0xFF or marker[1] == 0xDA:  # not a marker, or the start of the scan
            return False
        data = f.read(length - 2)
        if marker[1] == 0xFE and data.rstrip(b"\0") == SOFTWARE.encode():
            return True


def _svg_creator(f) -> bool:
    """matplotlib writes the metadata near the top of the SVG."""
    return bool(_SVG_MARK.search(f.read(16384)))


def _pdf_creator(f) -> bool:
    """matplotlib writes the info dictionary at the end of the PDF, before the cross-reference table."""
    f.seek(0, 2)
    f.seek(max(0, f.tell() - 65536))
    return _PDF_MARK in f.read()


def draw_image(series: list[Series], out: str | Path, x: str, y: str, log_y: bool = False, title: str | None = None,
               size: tuple[int, int] = (1200, 675), force: bool = False) -> Path:
    """Write an image of ``size`` pixels in the format ``out``'s suffix names (PNG, JPEG, SVG, PDF; marked as
    opskit's): one line per series (colours from :data:`COLORS`, legend = series names), black ``x`` at spike peaks.
    Written to a temporary name and renamed, so readers never see half a file.

    Raises:
        PlotUnavailable: matplotlib is not installed. LogFormatError, OutputRefusedError: see :func:`claim_image`.
    """
    out = Path(out)
    fmt = claim_image(out, force)
    _require("matplotlib")
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # not pyplot: no backend switching, no figure manager (~0.04 s of import)

    fig = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    low, high = min(python_value(np.min(s.x)) for s in series), max(python_value(np.max(s.x)) for s in series)
    if high > low:  # the limits autoscaling would pick, fixed first: thin() needs the axes' pixel columns
        pad = (high - low) * ax.margins()[0]
        low, high = low - pad, high + pad
        ax.set_xlim(low, high)
    columns = round(ax.get_position().width * size[0])
    for i, s in enumerate(series):
        ax.plot(*thin(s.x, s.y, low, high, columns), color=COLORS[i % len(COLORS)], linewidth=1.5, label=s.name)
    points = [p for s in series for p in s.markers]
    if points:
        ax.scatter([p[0] for p in points], [p[1] for p in points], marker="x", color="black", s=40, zorder=3,
                   label="spike")
    x_label, y_label = _labels(x, y)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title or f"{y_label} vs {x_label}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_image(fig, out, fmt)
    return out


def save_image(figure, out: Path, fmt: str) -> None:
    """Write the matplotlib ``figure`` to ``out`` (which :func:`claim_image` allowed, giving ``fmt``) with opskit's
    mark (:data:`SOFTWARE`), through a temporary name renamed into place: readers never see half a file.

    Raises:
        OSError: ``out`` cannot be written.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(out)
    try:
        figure.savefig(staging, format=fmt, **_SAVE_MARK[fmt])
        staging.replace(out)
    finally:
        staging.unlink(missing_ok=True)


def thin(x: Sequence[float], y: Sequence[float], low: float, high: float, columns: int
         ) -> tuple[Sequence[float], Sequence[float]]:
    """The points of the line (``x``, ``y``) that an image ``columns`` pixels wide for x in [``low``, ``high``] needs
    to show it as the whole line shows: in each run of consecutive points within one pixel column, the first, the
    last, the lowest and the highest (the M4 rule: Jugel et al., "M4: A Visualization-Oriented Time Series Data
    Aggregation", VLDB 2014), and every NaN (a gap in the line). Why these: a pixel column of a line shows exactly
    its range of y and where the line enters and leaves it, so a spike one iteration wide keeps its peak, where
    plain sampling (every k-th point) would drop it; 466 k points of a 176B run's log become ~4 per column and cost
    matplotlib milliseconds instead of ~1 s. Points in order, x and y unchanged; short lines come back as they are.
    """
    if len(x) <= 4 * columns or not high > low:
        return x, y
    import numpy as np

    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    column = np.clip(((xs - low) / (high - low) * columns).astype(np.int64), 0, columns - 1)
    new_run = np.r_[True, column[1:] != column[:-1]]
    starts, run = np.flatnonzero(new_run), np.cumsum(new_run) - 1
    nan = np.isnan(ys)
    keep = [starts, np.r_[starts[1:] - 1, len(ys) - 1], np.flatnonzero(nan)]
    for extreme, blank in ((np.minimum, np.inf), (np.maximum, -np.inf)):
        values = np.where(nan, blank, ys)
        at = np.flatnonzero(values == extreme.reduceat(values, starts)[run])
        keep.append(at[np.unique(run[at], return_index=True)[1]])  # the first of ties
    kept = np.unique(np.concatenate(keep))
    return xs[kept].tolist(), ys[kept].tolist()


def draw_text(series: list[Series], x: str, y: str, log_y: bool = False, width: int | None = None,
              height: int | None = None) -> str:
    """The same plot as text for a terminal (plotext), colours and legend included.

    Raises:
        PlotUnavailable: plotext is not installed.
    """
    plotext = _require("plotext")
    plotext.clear_figure()
    if width and height:
        plotext.plotsize(width, height)
    for s in series:
        plotext.plot(as_list(s.x), as_list(s.y), label=s.name)
    points = [p for s in series for p in s.markers]
    if points:
        plotext.scatter([p[0] for p in points], [p[1] for p in points], marker="x", label="spike")
    x_label, y_label = _labels(x, y)
    plotext.xlabel(x_label)
    plotext.ylabel(y_label)
    if log_y:
        plotext.yscale("log")
    plotext.title(f"{y_label} vs {x_label}")
    return plotext.build()
