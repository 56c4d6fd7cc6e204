"""Series for ``opskit logs plot``: one line per run, smoothing, a range, spike markers; drawn as a PNG (matplotlib,
Agg backend) or as text for a terminal (plotext). Both libraries are imported inside the functions that draw."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opskit.logs.parse import LogFormatError
from opskit.logs.spikes import Spike

X_AXES = {"iteration": "iteration", "samples": "consumed_samples", "tokens": "consumed_tokens"}
Y_ALIASES = {"lr": "learning_rate", "loss": "lm_loss", "time": "elapsed_time_per_iteration_s",
             "val_loss": "validation_lm_loss", "ppl": "validation_ppl"}
# One colour per run, in legend order (matplotlib's tab10), so a test can find each run's line by its colour.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


@dataclass
class Series:
    """One run's line: ``x``/``y`` values, and the spikes to mark as (x, y) points."""

    name: str
    x: list[float]
    y: list[float]
    markers: list[tuple[float, float]] = field(default_factory=list)


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
    from opskit.logs.parse import iteration_fields

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


def make_series(name: str, records: list[dict], x: str, y: str, x_range=(None, None), smooth: int = 1,
                spikes: list[Spike] = ()) -> Series:
    """The (x, y) points of ``records`` (iteration or validation records, per ``y``) inside ``x_range``, ``y``
    smoothed by a trailing mean over ``smooth`` points; spikes of metric ``y`` marked at their peak (raw value).

    Raises:
        LogFormatError: ``x`` is not iteration/samples/tokens.
    """
    check_x(x)
    x_key, low, high = X_AXES[x], *x_range
    xs, ys, x_of = [], [], {}
    for record in records:
        if record.get(x_key) is None:
            continue
        x_of[record["iteration"]] = record[x_key]
        value = _value(record, y)
        if value is None or (low is not None and record[x_key] < low) or (high is not None and record[x_key] > high):
            continue
        xs.append(record[x_key])
        ys.append(value)
    markers = [(x_of[s.peak_iteration], s.peak) for s in spikes
               if s.metric == y and s.peak_iteration in x_of and (low is None or x_of[s.peak_iteration] >= low)
               and (high is None or x_of[s.peak_iteration] <= high)]
    return Series(name, xs, _trailing_mean(ys, smooth), markers)


def _value(record: dict, y: str) -> float | None:
    """``y`` of a record: a field, or an unknown one kept under ``extra`` (``moe_loss`` or ``extra.moe_loss``)."""
    value = record.get(y)
    if value is None:
        value = record.get("extra", {}).get(y.removeprefix("extra."))
    return value if isinstance(value, (int, float)) else None


def _trailing_mean(values: list[float], n: int) -> list[float]:
    if n <= 1:
        return list(values)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def _labels(x: str, y: str) -> tuple[str, str]:
    return ("consumed " + x if x != "iteration" else x), y.replace("_", " ")


class PlotUnavailable(LogFormatError):
    """matplotlib or plotext is not installed (they come with ``pip install 'opskit[plot]'``)."""


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PlotUnavailable(f"{module} is not installed: pip install 'opskit[plot]'") from None


def draw_png(series: list[Series], out: str | Path, x: str, y: str, log_y: bool = False, title: str | None = None,
             size: tuple[int, int] = (1200, 675)) -> Path:
    """Write a PNG of ``size`` pixels: one line per series (colours from :data:`COLORS`, legend = series names),
    black ``x`` at spike peaks. Written to a temporary name and renamed, so readers never see half a file.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    _require("matplotlib").use("Agg")
    from matplotlib import pyplot as plt

    from opskit.fsutil import staging_path

    out = Path(out)
    fig, ax = plt.subplots(figsize=(size[0] / 100, size[1] / 100), dpi=100)
    try:
        for i, s in enumerate(series):
            ax.plot(s.x, s.y, color=COLORS[i % len(COLORS)], linewidth=1.5, label=s.name)
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
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_path(out)
        fig.savefig(staging, format="png")
        staging.replace(out)
    finally:
        plt.close(fig)
    return out


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
        plotext.plot(s.x, s.y, label=s.name)
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
