"""The trainer's side of the schedules: AnnealingLR driving an optimizer and DeepSpeed's curriculum scheduler. The
rules themselves (ramp-up, learning rate as a function of samples and tokens) are ``opskit.rules.schedule``'s, shared
with ``opskit plan``.
"""

from __future__ import annotations

from collections.abc import Callable

from opskit.rules import consistency
from opskit.rules.schedule import annealing_lr

# Checkpointed AnnealingLR fields that must agree with the command line unless told otherwise.
_CHECKED_FIELDS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")


class AnnealingLR:
    """Megatron's AnnealingLR counted in samples: linear warmup to ``max_lr`` over ``warmup_steps`` samples, then
    linear or cosine decay to ``min_lr`` at ``decay_steps`` samples, ``min_lr`` after. With ``decay_tokens``
    (``--lr-decay-tokens``, for curriculum learning) the decay runs over consumed tokens instead, from the tokens
    consumed when the warmup ended (Megatron-DeepSpeed's rule: recorded when ``num_steps`` equals ``warmup_steps``).

    It drives a torch optimizer's ``param_groups[*]['lr']``. DeepSpeed calls ``step()`` without arguments after each
    optimizer step; ``step_size`` then says how many samples that step consumed (the current GBS).

    Args:
        optimizer: anything with ``param_groups``.
        max_lr, min_lr: learning rates.
        warmup_steps, decay_steps: in samples (``--lr-warmup-samples``, ``--lr-decay-samples``).
        decay_style: ``constant``, ``linear`` or ``cosine``.
        step_size: callable returning the samples consumed by one ``step()`` with no increment.
        override / use_checkpoint: Megatron's ``--override-lr-scheduler`` / ``--use-checkpoint-lr-scheduler``.
        decay_tokens: tokens of the decay, or None to decay by samples.
        consumed_tokens: callable returning the run's consumed tokens so far (read at every ``step()``, before the
            current iteration's are added, as Megatron-DeepSpeed reads ``args.consumed_train_tokens``).
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, step_size: Callable[[], int], override: bool = False,
                 use_checkpoint: bool = False, decay_tokens: int | None = None,
                 consumed_tokens: Callable[[], int] = lambda: 0):
        if override and use_checkpoint:
            raise ValueError("--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive")
        if decay_steps <= 0:
            raise ValueError(f"lr decay samples must be > 0, got {decay_steps}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.step_size, self.override, self.use_checkpoint = step_size, override, use_checkpoint
        self.decay_tokens, self.consumed_tokens = decay_tokens, consumed_tokens
        self.num_steps = self.num_tokens = self.warmup_tokens = 0
        self.step(0)

    def get_lr(self) -> float:
        """The learning rate after ``num_steps`` samples (:func:`opskit.rules.schedule.annealing_lr`); records the
        tokens consumed when the warmup ends, as Megatron-DeepSpeed does (when ``num_steps`` equals
        ``warmup_steps``)."""
        if self.decay_tokens is not None and self.warmup_steps > 0 and self.num_steps == self.warmup_steps:
            self.warmup_tokens = self.num_tokens
        return annealing_lr(max_lr=self.max_lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                            decay_steps=self.decay_steps, decay_style=self.decay_style, num_steps=self.num_steps,
                            decay_tokens=self.decay_tokens, num_tokens=self.num_tokens,
                            warmup_tokens=self.warmup_tokens)

    def step(self, increment: int | None = None) -> None:
        """Advance by ``increment`` samples (default: one global batch) and set the optimizer's lr."""
        if increment is None:  # DeepSpeed's call after an optimizer step
            self.num_steps += self.step_size()
            self.num_tokens = self.consumed_tokens()
        else:
            self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        """Megatron's keys, so Megatron-DeepSpeed's tools read our checkpoints."""
        return {
            "max_lr": self.max_lr,
            "warmup_steps": self.warmup_steps,
            "num_steps": self.num_steps,
            "warmup_tokens": self.warmup_tokens,
            "num_tokens": self.num_tokens,
            "decay_tokens": self.decay_tokens,
            "decay_style": self.decay_style,
            "decay_steps": self.decay_steps,
            "min_lr": self.min_lr,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the schedule itself comes from the command line unless ``use_checkpoint``.

        Raises:
            ValueError: Megatron's mismatch message when a schedule field differs and neither flag allows it.
        """
        for name in _CHECKED_FIELDS + (("decay_tokens",) if "decay_tokens" in state else ()):
            mine, theirs = getattr(self, name), state[name]
            if self.override or mine == theirs:
                continue
            if not self.use_checkpoint:
                raise ValueError(
                    f"AnnealingLR: class input value {mine} and checkpoint value {theirs} for {name} do not match; "
                    "pass --override-lr-scheduler to use the command line's or --use-checkpoint-lr-scheduler"
                )
            setattr(self, name, theirs)
        self.num_steps = state["num_steps"]
        self.warmup_tokens = state.get("warmup_tokens", 0)
        self.num_tokens = state.get("num_tokens", 0)
        self.step(0)


def _json_key(key: str, value=None) -> str:
    """The :data:`opskit.rules.consistency.Namer` of the DeepSpeed JSON's curriculum block (``--seq-length`` is a
    flag)."""
    if key == "seq_length":
        return consistency.flag_name(key, value)
    where = "curriculum_learning" if key in ("min_difficulty", "max_difficulty") else \
        "curriculum_learning.schedule_config"
    return f"{where}.{key}" if value is None else f"{where}.{key} {value}"


class SeqlenCurriculum:
    """Megatron-DeepSpeed's sequence-length curriculum (Li et al. 2021, arXiv:2108.06084) from the DeepSpeed JSON's
    top-level ``curriculum_learning`` block, as BigScience's tr8b-104B-cl wrote it::

        {"enabled": true, "curriculum_type": "seqlen", "min_difficulty": 64, "max_difficulty": 2048,
         "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 36000, "difficulty_step": 8}}

    The schedule is DeepSpeed's own ``CurriculumScheduler`` (``fixed_linear``, ``fixed_root``, ``fixed_discrete``);
    Megatron-DeepSpeed asks it for ``update_difficulty(iteration + 1)`` before every iteration and truncates that
    iteration's tokens and labels to the answer. The difficulty is a pure, non-decreasing function of the iteration, so
    a resumed run continues the schedule without saving anything.

    Raises:
        ValueError: (at construction) a block that is not a seqlen curriculum DeepSpeed can schedule, or that breaks
            the spec's rule (:func:`opskit.rules.consistency.curriculum_problems`: multiples of 8, rising to at most
            ``seq_length``); the message names the key.
    """

    def __init__(self, block: dict, seq_length: int):
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        if block.get("curriculum_type", "seqlen") != "seqlen":
            raise ValueError(f"curriculum_learning.curriculum_type {block['curriculum_type']!r}: only 'seqlen' "
                             "is supported")
        config = {key: value for key, value in block.items() if key not in ("enabled", "curriculum_type")}
        for key in ("min_difficulty", "max_difficulty"):
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"curriculum_learning.{key} is {value!r}; expected a positive integer")
        step = (config.get("schedule_config") or {}).get("difficulty_step")
        if problems := consistency.curriculum_problems(config["min_difficulty"], config["max_difficulty"],
                                                       step if isinstance(step, int) else None, seq_length, _json_key):
            raise ValueError(problems[0])
        try:
            self.scheduler = CurriculumScheduler(config)
        except (AssertionError, RuntimeError, KeyError) as e:
            reason = str(e) or "bad schedule_config"
            raise ValueError(f"curriculum_learning: DeepSpeed's CurriculumScheduler refuses it ({reason}); e.g. "
                             "schedule_type fixed_linear with schedule_config {total_curriculum_step, "
                             "difficulty_step}") from None

    def seqlen(self, iteration: int) -> int:
        """Tokens per sample in (1-based) ``iteration``."""
        return int(self.scheduler.update_difficulty(iteration))
