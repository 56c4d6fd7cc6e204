"""Megatron's batch ramp-up, AnnealingLR and DeepSpeed's seqlen curriculum as pure functions of samples, tokens and
iterations: the trainer drives its optimizer with them, ``opskit plan`` replays them.

Sources: Megatron-LM ``megatron/microbatches.py`` (RampupBatchsizeNumMicroBatches), ``megatron/training.py``
(update_train_iters), ``megatron/learning_rates.py`` (AnnealingLR, with Megatron-DeepSpeed's ``--lr-decay-tokens``),
DeepSpeed ``runtime/data_pipeline/curriculum_scheduler.py``; reference section 2.4.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice


@dataclass(frozen=True)
class BatchRampup:
    """Global batch size as a function of consumed samples (``--rampup-batch-size start incr samples``).

    ``rampup`` is None for a constant GBS. Every count derived from the ramp-up (train_iters, consumed samples after N
    iterations, iterations to reach S samples, the plan's per-GBS rows) comes from one walk, :meth:`rampup_steps`.

    Raises:
        ValueError: (at construction) when ``GBS - start`` is not a multiple of the increment.
    """

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.rampup is not None:
            start, incr, _ = self.rampup
            if incr <= 0 or (self.global_batch_size - start) % incr:
                raise ValueError(
                    f"--rampup-batch-size: global batch size {self.global_batch_size} minus start {start} "
                    f"is not a multiple of the increment {incr}"
                )

    @property
    def samples_per_increment(self) -> float | None:
        """``rampup_samples / num_increments`` (79_365.08 for tr1-13B), None without a ramp (or a ramp of none)."""
        if self.rampup is None:
            return None
        start, incr, rampup_samples = self.rampup
        num_increments = (self.global_batch_size - start) // incr
        return rampup_samples / num_increments if num_increments else None

    def batch_size(self, consumed_samples: int) -> int:
        """GBS for the next iteration: ``start + int(consumed / samples_per_increment) * incr`` until the ramp ends."""
        per_increment = self.samples_per_increment
        if per_increment is None or consumed_samples > self.rampup[2]:
            return self.global_batch_size
        start, incr, _ = self.rampup
        return min(start + int(consumed_samples / per_increment) * incr, self.global_batch_size)

    def rampup_steps(self) -> Iterator[tuple[int, int]]:
        """``(GBS, consumed samples before it)`` of iterations 1, 2, ... of the ramp-up: Megatron's update_train_iters
        loop, which runs while the consumed samples are <= the ramp-up samples (nothing for a constant GBS). Every
        later iteration runs at the full GBS."""
        if self.rampup is None:
            return
        consumed = 0
        while consumed <= self.rampup[2]:
            size = self.batch_size(consumed)
            yield size, consumed
            consumed += size

    def steps(self) -> Iterator[tuple[int, int]]:
        """``(GBS, consumed samples before it)`` of every iteration 1, 2, ... (endless: the ramp-up, then the GBS)."""
        consumed = 0
        for size, consumed in self.rampup_steps():
            yield size, consumed
            consumed += size
        while True:
            yield self.global_batch_size, consumed
            consumed += self.global_batch_size

    def rampup_end(self) -> tuple[int, int]:
        """(iterations, consumed samples) at the end of the ramp-up loop ((0, 0) for a constant GBS)."""
        iterations = consumed = 0
        for size, before in self.rampup_steps():
            iterations, consumed = iterations + 1, before + size
        return iterations, consumed

    def train_iters(self, train_samples: int) -> int:
        """Iterations of the run (the log line's ``/ train_iters``): Megatron's update_train_iters walks the ramp,
        then adds ``(train_samples - consumed) // GBS``; training stops after that many iterations."""
        iterations, consumed = self.rampup_end()
        return iterations + (train_samples - consumed) // self.global_batch_size

    def consumed_samples(self, iterations: int) -> int:
        """Samples consumed after ``iterations`` iterations: the ``consumed samples`` of that iteration's log line
        (tr11-176B-ml: 9_841_584 at iteration 12695)."""
        done = consumed = 0
        for size, before in islice(self.rampup_steps(), iterations):
            done, consumed = done + 1, before + size
        return consumed + (iterations - done) * self.global_batch_size

    def iterations_to_samples(self, samples: int) -> int:
        """The first iteration after which at least ``samples`` samples are consumed (an LR warmup in samples ends
        there)."""
        iterations = consumed = 0
        for size, before in self.rampup_steps():
            if before >= samples:
                break
            iterations, consumed = iterations + 1, before + size
        return iterations + max(math.ceil((samples - consumed) / self.global_batch_size), 0)

    def rows(self, train_samples: int) -> list[tuple[int, int, int]]:
        """``(GBS, iterations, samples)`` per GBS value of the ramp-up, in order, then the rest of the run at the full
        GBS (``(train_samples - ramp-up samples) // GBS`` iterations, at least 0)."""
        counts: dict[int, list[int]] = {}
        consumed = 0
        for size, before in self.rampup_steps():
            row = counts.setdefault(size, [0, 0])
            row[0] += 1
            row[1] += size
            consumed = before + size
        rest = max(train_samples - consumed, 0) // self.global_batch_size
        return [(size, n, samples) for size, (n, samples) in counts.items()] + [
            (self.global_batch_size, rest, rest * self.global_batch_size)]


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Gradient-accumulation steps for a GBS (Megatron's ``get_num_microbatches``).

    Raises:
        ValueError: with Megatron's wording when GBS is not divisible by MBS * DP.
    """
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"current global batch size ({global_batch_size}) is not divisible by micro-batch-size "
            f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
        )
    return global_batch_size // per_step


def annealing_lr(*, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int, decay_style: str,
                 num_steps: int, decay_tokens: int | None = None, num_tokens: int = 0, warmup_tokens: int = 0) -> float:
    """Megatron's AnnealingLR.get_lr counted in samples: linear warmup to ``max_lr`` over ``warmup_steps`` samples,
    then ``constant``, ``linear`` or ``cosine`` decay to ``min_lr`` at ``decay_steps`` samples, ``min_lr`` after.
    With ``decay_tokens`` (Megatron-DeepSpeed's ``--lr-decay-tokens``) the decay runs over ``num_tokens`` from
    ``warmup_tokens`` (the tokens consumed when the warmup ended) to ``decay_tokens`` instead.

    Raises:
        ValueError: an unknown decay style.
    """
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * num_steps / warmup_steps
    if decay_style == "constant":
        return max_lr
    if decay_tokens is not None:
        if num_tokens > decay_tokens:
            return min_lr
        ratio = (num_tokens - warmup_tokens) / max(decay_tokens - warmup_tokens, 1)
    elif num_steps > decay_steps:
        return min_lr
    else:
        ratio = (num_steps - warmup_steps) / max(decay_steps - warmup_steps, 1)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"{decay_style} decay style is not supported")
    return min_lr + coeff * (max_lr - min_lr)


@dataclass(frozen=True)
class SeqlenSchedule:
    """DeepSpeed's sequence-length curriculum (Li et al. 2021, arXiv:2108.06084), ``fixed_linear`` or ``fixed_root``:
    ``d = floor((step/total)^(1/root) * (max - min) + min)``, ``d -= d % difficulty_step``, ``min(d, max)`` (root 1
    for fixed_linear); DeepSpeed ``CurriculumScheduler.__fixed_root_get_difficulty``. Megatron-DeepSpeed truncates
    iteration ``i``'s samples to ``seqlen(i)`` (its ``update_difficulty(iteration + 1)``, 1-based here)."""

    min_difficulty: int
    max_difficulty: int
    total_curriculum_step: int
    difficulty_step: int
    root_degree: int | None = None

    def seqlen(self, iteration: int) -> int:
        """Tokens per sample in (1-based) ``iteration``."""
        fraction = (iteration / self.total_curriculum_step) ** (1.0 / (self.root_degree or 1))
        difficulty = math.floor(fraction * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        difficulty -= difficulty % self.difficulty_step
        return min(difficulty, self.max_difficulty)


def tokens_per_iteration(rampup: BatchRampup, seq_length: int,
                         curriculum: SeqlenSchedule | None = None) -> Iterator[tuple[int, int]]:
    """``(GBS, tokens)`` of iterations 1, 2, ... while the ramp-up or the curriculum still changes them; every later
    iteration consumes ``GBS * seq_length`` tokens."""
    rampup_iterations, _ = rampup.rampup_end()
    for iteration, (size, _) in enumerate(rampup.steps(), start=1):
        if iteration > rampup_iterations and (curriculum is None or iteration > curriculum.total_curriculum_step):
            return
        yield size, size * (curriculum.seqlen(iteration) if curriculum is not None else seq_length)


def iterations_to_tokens(rampup: BatchRampup, seq_length: int, tokens: int,
                         curriculum: SeqlenSchedule | None = None) -> int:
    """The first iteration after which ``tokens`` tokens are consumed (ramp-up and curriculum replayed)."""
    consumed = iterations = 0
    for _, step_tokens in tokens_per_iteration(rampup, seq_length, curriculum):
        if consumed >= tokens:
            return iterations
        consumed += step_tokens
        iterations += 1
    return iterations + max(math.ceil((tokens - consumed) / (rampup.global_batch_size * seq_length)), 0)
