"""Progress and ETA from the last iteration records: iterations left x recent seconds per iteration, and tokens
consumed / planned, as the tr11 chronicle computed "125 days more" by hand from one log line:
``(115311-12695)*105/(3600*24)=124.7``, "We consumed 20B/450B tokens"."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Progress:
    """Where a training stands.

    ``seconds_per_iteration`` is the median of the recent records' elapsed time per iteration; ``seconds_left`` =
    (train_iters - iteration) x that. ``planned_tokens`` comes from the spec (train_samples x seq_length) when given,
    else it is estimated as consumed + iterations left x global batch size x tokens per sample (exact once the batch
    size ramp-up is over, since ``train_iters`` is computed from the sample budget); ``planned_tokens_source`` says
    which. Token fields are None for 2021-format logs, which print no consumed tokens.
    """

    iteration: int
    train_iters: int
    seconds_per_iteration: float | None
    seconds_left: float | None
    consumed_samples: int | None
    consumed_tokens: int | None
    planned_tokens: int | None
    planned_tokens_source: str | None

    @property
    def iterations_left(self) -> int:
        return max(0, self.train_iters - self.iteration)

    @property
    def days_left(self) -> float | None:
        return None if self.seconds_left is None else self.seconds_left / (3600 * 24)

    def as_json(self) -> dict:
        return {**asdict(self), "iterations_left": self.iterations_left, "days_left": self.days_left}


def progress(iterations: list[dict], recent: int = 20, planned_tokens: int | None = None,
             seconds_per_iteration: float | None = None) -> Progress:
    """Progress at the last of ``iterations`` (iteration records, file order).

    Args:
        recent: how many of the last records' times the median is taken over.
        planned_tokens: the plan's token budget (spec: train_samples x seq_length), if known.
        seconds_per_iteration: use this instead of the log's (the chronicle rounded 105.22 s to 105).

    Raises:
        ValueError: ``iterations`` is empty.
    """
    if not iterations:
        raise ValueError("no iteration records")
    last = iterations[-1]
    if seconds_per_iteration is None:
        times = [t for r in iterations[-recent:] if (t := r.get("elapsed_time_per_iteration_s")) is not None
                 and math.isfinite(t) and t >= 0]  # a garbled "nan" or "-inf" time must not become the ETA
        seconds_per_iteration = statistics.median(times) if times else None
    left = max(0, last["train_iters"] - last["iteration"])
    tokens, samples = last.get("consumed_tokens"), last.get("consumed_samples")
    source = "spec" if planned_tokens is not None else None
    if planned_tokens is None and tokens and samples and "global_batch_size" in last:
        planned_tokens = tokens + left * last["global_batch_size"] * round(tokens / samples)
        source = "estimated from the log"
    return Progress(last["iteration"], last["train_iters"], seconds_per_iteration,
                    None if seconds_per_iteration is None else left * seconds_per_iteration, samples, tokens,
                    planned_tokens, source)


def format_duration(seconds: float) -> str:
    """``124.7 days`` from a day on (the chronicles' unit), else ``5 h 03 min``."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def format_count(n: int) -> str:
    """``97980874752`` -> ``98.0B`` (the chronicles write "20B/450B tokens"); ``819200`` -> ``819.2K``."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return str(n)


def progress_lines(state: Progress, recent: int) -> list[str]:
    """``progress: ...``, ``ETA: ...`` and ``tokens: ...`` lines, in the chronicles' units."""
    share = f"{state.iteration / state.train_iters:.1%}" if state.train_iters > 0 else "no total logged"
    lines = [f"progress: iteration {state.iteration:,} of {state.train_iters:,} ({share}), "
             f"{state.iterations_left:,} left"]
    if state.iterations_left == 0:
        lines.append("ETA: finished")
    elif state.seconds_per_iteration is not None:
        lines.append(f"ETA: {state.iterations_left:,} x {state.seconds_per_iteration:.2f} s (median of the last "
                     f"{recent}) = {format_duration(state.seconds_left)} at this speed without downtime")
    if state.consumed_tokens is not None:
        planned = "" if not state.planned_tokens else (
            f" / {format_count(state.planned_tokens)} planned ({state.planned_tokens_source}), "
            f"{state.consumed_tokens / state.planned_tokens:.1%}")
        lines.append(f"tokens: {format_count(state.consumed_tokens)} consumed{planned}")
    return lines
