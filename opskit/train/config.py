"""The trainer's run configuration: :class:`TrainConfig`, a frozen, typed view of the parsed flags and of what the
process reads outside them (its start time, the rehearsal clock's variable), taken once after the flags are parsed
and checked; and :class:`TrainerError`, the trainer's one-line error for bad input found at run time. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from opskit.train import REHEARSAL_CLOCK_ENV


class TrainerError(RuntimeError):
    """Bad input found at run time (data, tokenizer, checkpoint, DeepSpeed config); printed as one line."""


@dataclass(frozen=True)
class TrainConfig:
    """What the builders and the training loop read: each flag under its argparse (Megatron) name, with the values
    :func:`opskit.train.args.parse_args` completed (``ffn_hidden_size``, ``max_position_embeddings``,
    ``train_samples``, ``lr_decay_samples``, ``params_dtype``); lists as tuples. Built by :meth:`from_args`.

    The parsed ``argparse.Namespace`` stays what checkpoints save as ``args`` (Megatron-DeepSpeed's format); this
    view is never saved.
    """

    # model
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str
    embed_layernorm: bool
    init_method_std: float
    hidden_dropout: float
    attention_dropout: float
    make_vocab_size_divisible_by: int
    pad_vocab_size_to: int | None
    fp16: bool
    params_dtype: str
    """``fp16``, ``bf16`` or ``fp32``."""
    # parallelism
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    sequence_parallel: bool
    sync_tp_duplicated_parameters: bool
    deepspeed_config: str | None
    zero_stage: int
    checkpoint_activations: bool
    recompute_granularity: str | None
    pp_partition_method: str | None
    torch_compile: bool
    distributed_backend: str | None
    # batch, schedule and optimizer
    micro_batch_size: int
    global_batch_size: int
    rampup_batch_size: tuple[int, int, int] | None
    train_samples: int
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_samples: int
    lr_decay_samples: int
    lr_decay_tokens: int | None
    override_lr_scheduler: bool
    use_checkpoint_lr_scheduler: bool
    use_bnb_optimizer: bool
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float
    seed: int
    # data and tokenizer
    data_path: tuple[str, ...] | None
    train_weighted_split_paths_path: str | None
    valid_weighted_split_paths_path: str | None
    tokenizer_type: str
    tokenizer_name_or_path: str | None
    vocab_file: str | None
    merge_file: str | None
    split: str
    # validation
    eval_interval: int | None
    eval_iters: int
    # checkpoints and exit
    save: str | None
    load: str | None
    save_interval: int | None
    async_save: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    kill_switch_path: str | None
    finished_flag_path: str | None
    stack_dump_after_mins: float | None
    skip_train_iteration_range: tuple[tuple[int, int], ...]
    """Sorted, overlapping ranges merged (``rules.formats.parse_skip_ranges``); () without the flag."""
    # divergence (opskit.train.divergence)
    divergence_action: str
    divergence_patience: int
    spike_window: int
    spike_threshold: float
    divergence_replay: str | None
    replica_digest_interval: int
    # logging
    log_interval: int
    tensorboard_dir: str | None
    tensorboard_queue_size: int
    log_validation_ppl_to_tensorboard: bool
    codecarbon_dir: str | None
    profile: bool
    profile_step_start: int
    profile_step_end: int
    profile_ranks: tuple[int, ...]
    use_pytorch_profiler: bool
    # the process
    start_time: float
    """When this process started (seconds since the epoch): ``--exit-duration-in-mins`` counts from the earliest
    start over all ranks (:class:`opskit.train.build.World`)."""
    rehearsal_minutes_per_iteration: float | None
    """:data:`~opskit.train.REHEARSAL_CLOCK_ENV`'s minutes per trained iteration (``opskit rehearse``), which replace
    wall time in the ``--exit-duration-in-mins`` test; None: wall time."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, start_time: float,
                  environ: Mapping[str, str] = os.environ) -> TrainConfig:
        """The config of parsed and checked flags (:func:`opskit.train.args.parse_args`), ``start_time`` and the
        rehearsal clock's variable in ``environ``.

        Raises:
            TrainerError: the rehearsal clock's variable is set to something other than a positive number.
        """
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in _NOT_FLAGS}
        values.update(
            data_path=tuple(args.data_path) if args.data_path is not None else None,
            rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
            skip_train_iteration_range=tuple(tuple(r) for r in args.skip_train_iteration_range or ()),
            profile_ranks=tuple(args.profile_ranks),
        )
        return cls(**values, start_time=start_time,
                   rehearsal_minutes_per_iteration=rehearsal_minutes_per_iteration(environ))


_NOT_FLAGS = frozenset({"start_time", "rehearsal_minutes_per_iteration"})


def rehearsal_minutes_per_iteration(environ: Mapping[str, str]) -> float | None:
    """The minutes each trained iteration counts on the rehearsal's simulated clock (:data:`REHEARSAL_CLOCK_ENV`),
    or None when the variable is unset or empty.

    Raises:
        TrainerError: the variable is set to something other than a positive number.
    """
    per_iteration = environ.get(REHEARSAL_CLOCK_ENV)
    if not per_iteration:
        return None
    try:
        minutes = float(per_iteration)
    except ValueError:
        minutes = 0.0
    if not minutes > 0:
        raise TrainerError(f"{REHEARSAL_CLOCK_ENV}={per_iteration!r}: expected a positive number of minutes")
    return minutes
