"""The trainer's checkpoints as one component: :class:`Checkpointer` decides the step a start resumes from (before the
model is built: a step saved on another layout is read through its universal form and may keep its padded
vocabulary), loads it, saves every step (synchronously, or with ``--async-save`` through the writer threads of
:mod:`opskit.train.async_save`, in host memory it sizes by the rule book) and moves ``latest`` last.

The layout's pieces (a step's files, ``latest``, the client state, the resume plan, the load) are
:mod:`opskit.train.checkpointing`'s; this module only puts them in order. The parsed flags are never written to: the
``args`` a step saves are a copy completed with the vocabulary sizes and the counters.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from opskit.ckpt.format.universal import Layout
from opskit.rules.memory import bytes_per_parameter, checkpoint_bytes, sharded_over_dp
from opskit.train.async_save import BackgroundSaves
from opskit.train.checkpointing import (
    client_state,
    commit_step,
    load_checkpoint,
    plan_resume,
    step_tag,
    write_step,
)
from opskit.train.config import TrainConfig
from opskit.train.log import saved_line, timer_line
from opskit.train.state import TrainState


class Checkpointer:
    """This rank's saves and resume of one run, in Megatron-DeepSpeed's layout.

    Built in two steps, as the engine needs what the plan decides: :meth:`__init__` before the model (the step to
    resume from, the padded vocabulary, ``checkpoint.load_universal`` in the DeepSpeed config), :meth:`attach` once
    the engine exists (the background writer). Then :meth:`resume` once, :meth:`save` at each save, :meth:`poll` after
    each iteration, :meth:`finish` at the end of training and :meth:`close` in the trainer's ``finally``.

    Args:
        config: the run's flags (``--save``, ``--load``, ``--async-save``, the precision and ZeRO stage).
        args: the parsed Namespace, saved as each step's ``args`` (copied, never changed).
        vocab_sizes: ``(original, padded)`` of a fresh start (:func:`opskit.train.tokenizer.vocab_sizes`).
        layout: this run's TP x PP x DP.
        ds_config: the DeepSpeed config the engine will be built from (``checkpoint.load_universal`` set when the
            step is read through its universal form).

    Raises:
        CheckpointError: the step cannot be resumed on this layout, or its conversion failed (one line, every rank).
    """

    def __init__(self, config: TrainConfig, args: argparse.Namespace, vocab_sizes: tuple[int, int], layout: Layout,
                 ds_config: dict):
        original, padded = vocab_sizes
        self.config = config
        self.plan = plan_resume(config.load, padded, layout)
        if self.plan.universal:
            ds_config.setdefault("checkpoint", {})["load_universal"] = True
        self.run_args = argparse.Namespace(**vars(args), original_vocab_size=original,
                                           padded_vocab_size=self.plan.padded_vocab_size)
        """The flags a step saves as ``args`` (the counters are added at each save)."""
        self.engine = None
        self.background: BackgroundSaves | None = None

    @property
    def padded_vocab_size(self) -> int:
        """The model's padded vocabulary: a fresh start's, or the resumed step's (:class:`ResumePlan`)."""
        return self.plan.padded_vocab_size

    def attach(self, engine, dp: int) -> None:
        """The DeepSpeed engine the steps are saved from and loaded into; with ``--async-save`` (and ``--save``) its
        checkpoint engine becomes the background writer, whose host memory holds this rank's share of a step
        (:func:`rank_save_bytes`). Collective: every rank calls it."""
        self.engine = engine
        if self.config.save and self.config.async_save:
            self.background = BackgroundSaves.install(engine, self.config.save,
                                                      rank_save_bytes(engine.module, self.config, dp))

    def resume(self, state: TrainState) -> None:
        """Load the planned step (if any) into the engine and ``state`` (:func:`load_checkpoint`)."""
        load_checkpoint(self.engine, self.run_args, state, self.plan)
        state.last_saved = state.iteration or None

    def save(self, state: TrainState) -> None:
        """Save ``global_step{state.iteration}`` under ``--save`` from every rank, then move ``latest`` to it. With
        ``--async-save`` the previous background save is finished first, the files are handed to the writer threads
        and this returns; the writer's side moves ``latest`` once every rank has written them (:meth:`poll`). Either
        way ``time (ms) | save-checkpoint: X`` is the time training stood still.

        Raises:
            CheckpointError: a file could not be written (one line; ``latest`` still names the previous step).
        """
        started = time.time()
        if self.background is not None:
            self.background.wait()
        save_dir, tag = self.config.save, step_tag(state.iteration)
        if dist.get_rank() == 0:
            print(f"saving checkpoint at iteration {state.iteration:7d} to {save_dir}", flush=True)
        write_step(self.engine, save_dir, tag, client_state(self.run_args, state))
        if self.background is not None:
            self.background.started(tag, state.iteration, started)
        else:
            commit_step(save_dir, tag)
            if dist.get_rank() == 0:
                print(saved_line(state.iteration, save_dir), flush=True)
        if dist.get_rank() == 0:
            print(timer_line("save-checkpoint", started), flush=True)
        state.last_saved = state.iteration

    def poll(self) -> None:
        """After an iteration: move ``latest`` if a background save has been written on every rank (collective)."""
        if self.background is not None:
            self.background.poll()

    def finish(self) -> None:
        """At the end of training: the last background save written and ``latest`` on it (collective)."""
        if self.background is not None:
            self.background.wait()

    def close(self) -> None:
        """Stop the background writer; a save it has not finished stays incomplete and ``latest`` where it was."""
        if self.background is not None:
            self.background.close()


def rank_save_bytes(module, config: TrainConfig, dp: int) -> int:
    """Bytes this rank writes per save at most (:func:`opskit.rules.memory.checkpoint_bytes` of its stage's parameters
    and its data-parallel shards; the model weights of the last stage's tied embedding, which no layer file holds, are
    counted as well), plus 2% and 64 MiB for padding and the small tensors (RNG states, counters): the host memory the
    background writer reserves."""
    parameters = sum(p.numel() for p in module.parameters())
    shards = dp if sharded_over_dp(config.zero_stage, config.params_dtype) else 1
    breakdown = bytes_per_parameter(config.params_dtype, config.use_bnb_optimizer, config.zero_stage)
    return int(checkpoint_bytes(parameters, breakdown, shards) * 1.02) + (64 << 20)
