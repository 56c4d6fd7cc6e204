"""Loss and grad-norm spikes: where they are, which checkpoint to roll back to, which iterations to skip.

The chronicles' recipe (tr8b-104B, train/lessons-learned.md): roll back to the last checkpoint before the spike and
restart with ``--skip-train-iteration-range A-B`` so that the batches that caused it are never seen again, A being the
first iteration after that checkpoint and B the last one before the training was back to normal.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import compress

from opskit.logs.parse import python_value, record_columns
from opskit.rules.spike_rule import DEFAULT_CONFIG, Spike, SpikeConfig, Window, is_spike, robust_z


@dataclass(frozen=True)
class Remedy:
    """What to do about spikes overlapping in [first, end]: resume from ``rollback_to`` (a ``global_stepN``, None when
    no checkpoint precedes the spike) with ``--skip-train-iteration-range skip_range``."""

    first: int
    end: int
    rollback_to: int | None
    skip_range: str | None

    @property
    def checkpoint(self) -> str | None:
        return None if self.rollback_to is None else f"global_step{self.rollback_to}"

    def as_json(self) -> dict:
        return {**asdict(self), "checkpoint": self.checkpoint}


_COLUMNAR_MIN = 20_000  # values of a metric from which polars takes the windows' statistics column-wise
_ROUGH_SHARE = 500  # the median's bound alone picks the candidates while it passes at most 1 value in this many


def find_spikes(records: Iterable[dict], config: SpikeConfig = DEFAULT_CONFIG) -> list[Spike]:
    """Upward spikes of each metric of ``config.metrics`` over iteration records in iteration order (a
    :func:`opskit.logs.parse.timeline`), sorted by first iteration. Records without the metric are passed over.

    Source: robust z-score with median and IQR, as in any robust-statistics text (e.g. Rousseeuw & Croux 1993).
    """
    return spikes_of(record_columns([r for r in records if r["kind"] == "iteration"], config.metrics), config)


def spikes_of(columns: dict[str, Sequence], config: SpikeConfig = DEFAULT_CONFIG) -> list[Spike]:
    """:func:`find_spikes` of iteration records given column-wise (``columns["iteration"]`` and one column per metric:
    lists with None, or polars Series with null, where a record lacks it; :func:`opskit.logs.parse.timeline_columns`).
    """
    spikes = [s for metric in config.metrics
              for s in _metric_spikes(columns["iteration"], columns[metric], metric, config)]
    return sorted(spikes, key=lambda s: (s.first, s.metric))


def _metric_spikes(iterations: Sequence[int], values: Sequence, metric: str, config: SpikeConfig) -> list[Spike]:
    iterations, values = _present(iterations, values)
    flagged = _flagged(values, config, config.relative_floor(metric))
    spikes: list[Spike] = []
    current = None  # open spike: [first, last, peak_iteration, peak, baseline, recovered_at, normal records since]
    for i in _replayed(flagged, config.merge_gap, len(values)):
        iteration, value = iterations[i], values[i]
        if i in flagged:
            if current is None:
                current = [iteration, iteration, iteration, value, flagged[i], None, 0]
            else:
                current[1], current[5], current[6] = iteration, None, 0
                if not value <= current[3]:  # NaN counts as the highest
                    current[2], current[3] = iteration, value
        elif current is not None:
            current[5] = current[5] or iteration
            current[6] += 1
            if current[6] >= config.merge_gap:
                spikes.append(_spike(metric, *current[:6]))
                current = None
    if current is not None:
        spikes.append(_spike(metric, *current[:6]))
    return spikes


def _present(iterations: Sequence[int], values: Sequence) -> tuple[Sequence[int], Sequence]:
    """(iterations, values) of the records that have the metric: lists (``compress``, not (iteration, value) pairs:
    3x less per value), or numpy arrays of polars columns (no Python object per value; the walk reads only a few)."""
    if isinstance(values, list):
        present = [value is not None for value in values]
        return list(compress(iterations, present)), list(compress(values, present))
    present = values.is_not_null()
    return iterations.filter(present).to_numpy(), values.filter(present).to_numpy()


def _spike(metric: str, *fields) -> Spike:
    """A :class:`Spike` of plain Python numbers (numpy's scalars, from :func:`_present`'s arrays, become them)."""
    return Spike(metric, *map(python_value, fields))


def _replayed(flagged: dict[int, float], merge_gap: int, n: int) -> list[int]:
    """The indices the spike bookkeeping must see, in order: each flagged one and the ``merge_gap`` after it (an
    open spike closes after ``merge_gap`` normal records; other normal records change nothing)."""
    return sorted({j for i in flagged for j in range(i, min(n, i + merge_gap + 1))})


def _flagged(values: Sequence[float], config: SpikeConfig, floor: float) -> dict[int, float]:
    """{index: baseline} of the spikes among ``values``, each value judged (:func:`is_spike`) against the window of
    the ``config.window`` accepted (non-spike) values before it.

    Walked value by value, except where the ``window`` values before are all accepted: the window is then those
    very values, and for a long series polars judges all such windows at once (:func:`_candidates`); the walk jumps
    to the next value polars flags (~2 us per value walked, 466 k values per metric in a 176B run's log).
    """
    size, n = config.window, len(values)
    candidates = _candidates(values, config, floor) if n >= _COLUMNAR_MIN else None
    window, flagged, accepted = Window(size), {}, 0  # accepted: values accepted in a row just before i
    i = 0
    while i < n:
        if candidates is not None and i >= size and accepted >= size:  # the window is values[i - size:i]
            at = bisect.bisect_left(candidates, i)
            if at == len(candidates):
                break
            if candidates[at] > i:
                i = candidates[at]
                window = Window(size, values[i - size:i])
        spike, baseline = is_spike(window, values[i], config, floor)
        if spike:
            flagged[i], accepted = baseline, 0
        else:
            window.add(values[i])
            accepted += 1
        i += 1
    return flagged


def _candidates(values: Sequence[float], config: SpikeConfig, floor: float) -> list[int]:
    """Indices (from ``config.window`` on) of the values :func:`is_spike` flags when the window is the ``window``
    values right before each, and of the non-finite ones: the only places where a walk that no spike has disturbed
    can find one. Quantiles as :meth:`Window.quantile` takes them: the element of rank ``int(q * window)``, which is
    polars' ``nearest`` rank for ``int(q * window) / (window - 1)``."""
    import polars as pl  # polars: only from _COLUMNAR_MIN values on

    size, value = config.window, pl.col("v")

    def quantile(q: float) -> pl.Expr:
        return value.rolling_quantile(int(q * size) / (size - 1), interpolation="nearest", window_size=size).shift(1)

    def maximum(*terms) -> pl.Expr:
        return pl.max_horizontal(*(pl.lit(t) if isinstance(t, float) else t for t in terms))

    frame = pl.DataFrame({"v": values}, schema={"v": pl.Float64}).with_row_index("i")
    later, median = pl.col("i") >= size, quantile(0.5)
    if config.threshold > 0 and size >= config.min_history:
        # z > threshold needs value - median > threshold x scale, and scale >= max(floor x |median|, 1e-12): the
        # (few) values past that bound hold every candidate, found with one rolling quantile instead of three;
        # extra ones only cost the walk a look. 1 - 1e-9: rounding never drops one.
        bound = config.threshold * maximum(floor * abs(median), 1e-12) * (1 - 1e-9)
        rough = frame.filter(later & (~value.is_finite() | ((value - median) > bound).fill_null(False)))["i"]
        if len(rough) <= len(values) // _ROUGH_SHARE:
            return rough.to_list()
    z = robust_z(value, median, quantile(0.25), quantile(0.75), floor, maximum)
    spike = ~value.is_finite() | ((z > config.threshold).fill_null(False) & (size >= config.min_history))
    return frame.filter(spike & later)["i"].to_list()


def remedies(spikes: list[Spike], save_interval: int | None = None,
             checkpoints: Iterable[int] | None = None) -> list[Remedy]:
    """One :class:`Remedy` per group of overlapping spikes (lm loss and grad norm usually move together).

    The group spans [first flagged, end], end = the iteration before the first one logged back to normal (the last
    flagged one while not recovered). The rollback checkpoint is the last one strictly before ``first``: the highest
    of ``checkpoints`` (existing ``global_stepN`` numbers) below it, else the last multiple of ``save_interval``; the
    skip range is ``rollback+1 .. end`` (the chronicles' ``13251-14000`` after rolling back to 13250).
    """
    existing = sorted(set(checkpoints)) if checkpoints is not None else None
    groups: list[list[int]] = []
    for spike in sorted(spikes, key=lambda s: s.first):
        end = spike.recovered_at - 1 if spike.recovered_at is not None else spike.last
        if groups and spike.first <= groups[-1][1] + 1:
            groups[-1][1] = max(groups[-1][1], end)
        else:
            groups.append([spike.first, end])
    out = []
    for first, end in groups:
        rollback = _rollback(first, save_interval, existing)
        out.append(Remedy(first, end, rollback, None if rollback is None else f"{rollback + 1}-{end}"))
    return out


def _rollback(first: int, save_interval: int | None, existing: list[int] | None) -> int | None:
    if existing is not None:
        below = [step for step in existing if step < first]
        return below[-1] if below else None
    if save_interval:
        step = (first - 1) // save_interval * save_interval
        return step if step > 0 else None
    return None
