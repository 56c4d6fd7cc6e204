"""The spike rule, written once: when an lm loss or grad-norm value is a spike, and when a spike is over. ``opskit logs
spikes`` and ``logs plot``, the watchdog's log checks (:mod:`opskit.logs.spikes`, over a whole log, column-wise where
it is long) and, value by value as the iterations come, :class:`SpikeWatch` (issue 48: the trainer's divergence
check, and the reference the column-wise walk is tested against) all judge by :func:`is_spike`.

Plain Python (``bisect``, ``math``): no torch, numpy or polars.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SpikeConfig:
    """How spikes are told from noise.

    A value is a spike when its robust z-score ``(x - median) / scale`` over the ``window`` previous non-spike values
    exceeds ``threshold``; ``scale`` is the inter-quartile range / 1.349 (the standard deviation for normal noise,
    untouched by outliers), floored at ``min_relative[metric]`` x |median| so that neither a flat series nor the
    noise of a 100-value quartile estimate makes a wiggle a spike: lm loss spikes worth a rollback are +10% and more
    (2.21 -> 2.60 at tr11's 31216), grad-norm ones several-fold (0.24 -> 0.95 at 31215), while healthy grad norms
    wander by tens of percent. Nothing is flagged before ``min_history`` values have been seen. Spikes less than
    ``merge_gap`` records apart are one event. NaN/inf values are always spikes.
    """

    window: int = 100
    threshold: float = 6.0
    min_history: int = 20
    min_relative: tuple[tuple[str, float], ...] = (("lm_loss", 0.01), ("grad_norm", 0.25))
    merge_gap: int = 5
    metrics: tuple[str, ...] = ("lm_loss", "grad_norm")

    def relative_floor(self, metric: str) -> float:
        return dict(self.min_relative).get(metric, 0.01)


DEFAULT_CONFIG = SpikeConfig()


@dataclass(frozen=True)
class Spike:
    """One spike of one metric: first and last flagged iteration, the highest value and where, the median before it,
    and ``recovered_at``, the first iteration logged back within the threshold (None: not recovered yet)."""

    metric: str
    first: int
    last: int
    peak_iteration: int
    peak: float
    baseline: float
    recovered_at: int | None

    def as_json(self) -> dict:
        return asdict(self)


class Window:
    """The last ``size`` accepted values, kept sorted so median and quartiles cost O(1) to read."""

    def __init__(self, size: int, values: list[float] = ()):
        self.size, self.order, self.sorted = size, list(values), sorted(values)

    def add(self, value: float) -> None:
        self.order.append(value)
        bisect.insort(self.sorted, value)
        if len(self.order) > self.size:
            self.sorted.pop(bisect.bisect_left(self.sorted, self.order.pop(0)))

    def quantile(self, q: float) -> float:
        return self.sorted[min(len(self.sorted) - 1, int(q * len(self.sorted)))]


def is_spike(window: Window, value: float, config: SpikeConfig, floor: float) -> tuple[bool, float]:
    """(whether ``value`` is a spike against ``window``, the window's median: the spike's baseline). Non-finite values
    always are; nothing is before ``config.min_history`` values; ``floor``: :meth:`SpikeConfig.relative_floor`."""
    if not math.isfinite(value):
        return True, window.quantile(0.5) if window.sorted else math.nan
    if len(window.sorted) < config.min_history:
        return False, math.nan
    median = window.quantile(0.5)
    return robust_z(value, median, window.quantile(0.25), window.quantile(0.75), floor) > config.threshold, median


def robust_z(value, median, q25, q75, floor: float, maximum=max):
    """``(value - median) / scale``, scale = max(IQR / 1.349, ``floor`` x |median|, 1e-12) (:class:`SpikeConfig`);
    of floats, or of polars expressions (``maximum``: their element-wise max)."""
    return (value - median) / maximum((q75 - q25) / 1.349, floor * abs(median), 1e-12)


class SpikeWatch:
    """:func:`opskit.logs.spikes.find_spikes`, value by value as the iterations come (the trainer's divergence
    check): each metric of ``config.metrics`` is judged by :func:`is_spike` against its window of accepted values; a
    spike opens at the first flagged value, takes in flagged values less than ``config.merge_gap`` accepted ones
    apart, and closes after ``merge_gap`` accepted values in a row.
    """

    def __init__(self, config: SpikeConfig = DEFAULT_CONFIG):
        self.config = config
        self._windows = {metric: Window(config.window) for metric in config.metrics}
        # open spike per metric: [first, last, peak_iteration, peak, baseline, recovered_at, accepted since]
        self._open: dict[str, list] = {}
        self.closed: list[Spike] = []
        """The spikes that closed, in the order they closed."""

    def state(self) -> dict:
        """What a checkpoint saves (JSON-able: each metric's window in arrival order and its open spike), so that a
        resumed run judges its next values exactly as the run that saved it would have (:meth:`restore`)."""
        return {"windows": {metric: list(window.order) for metric, window in self._windows.items()},
                "open": {metric: list(current) for metric, current in self._open.items()}}

    def restore(self, state: dict) -> None:
        """Take back :meth:`state`'s windows and open spikes (a metric it lacks starts empty).

        Raises:
            ValueError: ``state`` is not what :meth:`state` returns.
        """
        try:
            windows, opened = state["windows"], state["open"]
            self._windows = {metric: Window(self.config.window, [float(v) for v in windows.get(metric, [])]
                                            [-self.config.window:]) for metric in self.config.metrics}
            self._open = {metric: list(opened[metric]) for metric in self.config.metrics if metric in opened}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a SpikeWatch state ({e})") from None

    def add(self, iteration: int, values: Mapping[str, float | None]) -> list[Spike]:
        """Judge one iteration's values (a metric missing or None is passed over, as a log line without it).

        Returns:
            the spikes this iteration closed.
        """
        closed = []
        for metric in self.config.metrics:
            value = values.get(metric)
            if value is None:
                continue
            window, current = self._windows[metric], self._open.get(metric)
            flagged, baseline = is_spike(window, value, self.config, self.config.relative_floor(metric))
            if flagged:
                if current is None:
                    self._open[metric] = [iteration, iteration, iteration, value, baseline, None, 0]
                else:
                    current[1], current[5], current[6] = iteration, None, 0
                    if not value <= current[3]:  # NaN counts as the highest
                        current[2], current[3] = iteration, value
                continue
            window.add(value)
            if current is not None:
                current[5] = current[5] or iteration
                current[6] += 1
                if current[6] >= self.config.merge_gap:
                    closed.append(Spike(metric, *current[:6]))
                    del self._open[metric]
        self.closed += closed
        return closed

    @property
    def open(self) -> list[Spike]:
        """The spikes not closed yet, by first iteration (``recovered_at`` None: the last value was still a spike)."""
        return sorted((Spike(metric, *current[:6]) for metric, current in self._open.items()),
                      key=lambda s: (s.first, s.metric))

    def unrecovered(self, iteration: int, patience: int) -> Spike | None:
        """The first open spike that has not come back at ``iteration`` although it began at least ``patience``
        iterations before, or holds a non-finite value (NaN/Inf: at once). None: nothing to act on (a spike like tr11's
        at 31216, back within the band some iterations later, is logged by ``logs spikes``, never acted on)."""
        for spike in self.open:
            if spike.recovered_at is None and (not math.isfinite(spike.peak) or iteration - spike.first >= patience):
                return spike
        return None
