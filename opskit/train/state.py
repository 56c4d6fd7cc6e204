"""The training loop's state (:class:`TrainState`): what every iteration advances, a checkpoint saves and a resume
restores. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from opskit.train.log import IntervalStats


@dataclass
class TrainState:
    """Progress of one training run.

    The first eight fields are saved in every checkpoint, in Megatron-DeepSpeed's places where it has them (the
    client state's ``iteration``, ``tokens`` and ``reshaped_from``, and opskit's ``spike_watch``; the saved ``args``'
    ``consumed_train_samples``, ``consumed_valid_samples``, ``skipped_train_samples`` and
    ``applied_skip_train_iteration_ranges``: see opskit.train.checkpointing), and a resume restores them; the others
    belong to this process's run.
    """

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    """Read by the LR schedule's ``--lr-decay-tokens`` (before the current iteration's are added)."""
    consumed_valid_samples: int = 0
    """Advanced by every evaluation; each validation group resumes at its share (Megatron)."""
    skipped_train_samples: int = 0
    """Passed over by ``--skip-train-iteration-range`` (as newer Megatron-LM): the data position is consumed + these."""
    applied_skip_train_iteration_ranges: list[list[int]] = field(default_factory=list)
    """Ranges already skipped, so that a resume does not skip them again."""
    reshaped_from: str | None = None
    """``global_stepN at TP=.. PP=.. DP=..``: the step on another layout this run's weights were resumed from (saved
    with every later step as ``reshaped_from``, for ``opskit ckpt inspect``); kept from a step that carries one."""
    spike_watch: dict | None = None
    """The divergence check's windows (:meth:`opskit.train.divergence.DivergenceCheck.state`), saved as the client
    state's ``spike_watch`` and restored by a resume (None: none saved)."""
    seqlen: int = 0
    """The sequence length trained at now: the curriculum's (read by the data iterator before each micro-batch), or
    ``--seq-length`` without one."""
    interval: IntervalStats = field(default_factory=IntervalStats)
    """Sums over the iterations since the last log line."""
    last_saved: int | None = None
    """The iteration of the checkpoint this run saved or resumed from last (None: none yet)."""
