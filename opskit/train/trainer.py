"""The training loop: :class:`Trainer` builds one run on this rank in a fixed order, trains it as Megatron does and
releases it. :func:`opskit.train.main.train` creates it and closes it in a ``finally``.

The build order: 1. the flags checked against their files, the schedules, the DeepSpeed config -> 2. tokenizer and the
checkpointer's plan (the step to resume from, the padded vocabulary) -> 3. model on its pipeline stage -> 4. optimizer,
LR schedule and DeepSpeed engine -> 5. resume -> 6. data -> 7. logging -> 8. the in-job watchdog's heartbeat, from the
builders of :mod:`opskit.train.build`, :mod:`opskit.train.tokenizer`, :mod:`opskit.train.data` and the
:class:`~opskit.train.checkpointer.Checkpointer`. The loop asks :mod:`opskit.train.exit` after each iteration whether
to stop. Every rank runs the same loop; the last rank prints Megatron's log lines.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from opskit.fsutil import atomic_write_text
from opskit.rules.consistency import recomputes_fully
from opskit.rules.model_size import megatron_flops_per_iteration
from opskit.train.build import (
    World,
    build_deepspeed_config,
    build_engine,
    build_model,
    pop_curriculum,
    rank_device,
)
from opskit.train.config import TrainConfig
from opskit.train.divergence import DivergenceCheck
from opskit.train.exit import ExitPolicy
from opskit.train.fault import flip_bit_now, flip_one_bit, nan_loss, nan_loss_now, node_name, slowdown_factor
from opskit.train.log import (  # torch-free: torch is imported where it is used
    IntervalStats,
    TensorBoard,
    current_loss_scale,
    iteration_line,
    memory_line,
    print_datetime,
    timer_line,
    validation_lines,
)
from opskit.train.profile import StepProfiler
from opskit.train.replica_digest import ReplicaDigests
from opskit.train.stack_dump import arm_stack_dump
from opskit.train.state import TrainState
from opskit.train.tokenizer import vocab_sizes


@dataclass(frozen=True)
class StepResult:
    """What one training iteration reports: its global batch, mean loss, and the optimizer's numbers after it."""

    global_batch_size: int
    loss: float
    learning_rate: float
    grad_norm: float | None
    loss_scale: float | None
    """fp16 only (None otherwise)."""
    skipped: bool
    """DeepSpeed skipped the optimizer step (non-finite gradients; with fp16, the loss scaler's overflow)."""
    local_loss: float | None
    """This rank's loss before the data-parallel average (last pipeline stage only)."""

    @property
    def judged(self) -> tuple[float | None, float | None, float | None]:
        """(lm loss, grad norm, local loss) for the divergence check; nothing of a step the fp16 loss scaler skipped
        (an overflow is the scaler's business, not a divergence). In bf16 and fp32 DeepSpeed skips a step with
        non-finite gradients too, and that is one: a NaN or Inf, acted on at once."""
        if self.skipped and self.loss_scale is not None:
            return None, None, None
        return self.loss, self.grad_norm, self.local_loss


class Trainer:
    """One training run on this rank: built in a fixed order by ``__init__``, trained by :meth:`train`, released by
    :meth:`close`. Its progress is :attr:`state` (a :class:`TrainState`).

    ``args`` is the parsed Namespace, which checkpoints save (the checkpointer copies it; it is never changed);
    everything else is read from ``config``. ``exits`` decides when to stop early; ``after_iteration`` is called with
    each trained iteration's number (the test-only fault hook, :func:`opskit.train.fault.inject_test_fault`).
    """

    def __init__(self, args: argparse.Namespace, config: TrainConfig, world: World, exits: ExitPolicy,
                 after_iteration: Callable[[int], None]):
        from opskit.ckpt.format.universal import Layout
        from opskit.rules.schedule import BatchRampup
        from opskit.train.checkpointer import Checkpointer
        from opskit.train.data import check_data_files
        from opskit.train.emissions import Emissions

        self.config, self.world, self.exits = config, world, exits
        self.after_iteration = after_iteration
        self.heartbeat = None  # step 8; a save before it (a resume that saves at once) beats nothing
        self.state = TrainState(seqlen=config.seq_length)
        self.memory_reported = False  # Megatron reports GPU memory once, at the first log line

        # The flags checked against the files they name (before minutes of model building), and the schedules.
        check_data_files(config)
        self.profiler = StepProfiler(config, world.rank)
        self.rampup = BatchRampup(config.global_batch_size, config.rampup_batch_size)
        self.train_iters = self.rampup.train_iters(config.train_samples)
        ds_config = build_deepspeed_config(config, self.rampup.batch_size(0))
        self.curriculum = pop_curriculum(ds_config, config)
        # 2. tokenizer: the vocabulary size, padded; the step to resume from, re-cut if saved on another layout (its
        # padded vocabulary may be kept)
        self.checkpointer = Checkpointer(config, args, vocab_sizes(config, world.rank),
                                         Layout(world.tp, world.pp, world.dp), ds_config)
        self.padded_vocab_size = self.checkpointer.padded_vocab_size
        # 3. model: this rank's pipeline stage
        model = build_model(config, world, self.padded_vocab_size)
        # 4. DeepSpeed engine: optimizer and LR schedule first (the schedule reads the state's counters); the
        # checkpointer saves from it (--async-save: a writer thread per rank, the engine's loads unchanged)
        self.engine, self.optimizer = build_engine(config, model, ds_config, self.rampup, self.state)
        self.checkpointer.attach(self.engine, world.dp)
        # each rank's forward time, for the straggler line of each log interval
        from opskit.train.rank_times import ForwardTimes

        self.forward_times = None if os.environ.get(RANK_TIMES_ENV) == "off" else ForwardTimes(
            model, self.engine.stage_id, functools.partial(slowdown_factor, environ=dict(os.environ)))
        # the divergence check and the replica digests (before the resume: a save right after it records them)
        self.divergence = DivergenceCheck.from_environ(config, world.rank, node_name())
        self.digests = ReplicaDigests(model, self.engine.grid.get_data_parallel_group(), world.dp,
                                      config.replica_digest_interval, self.divergence)
        # 5. resume: weights, optimizer, LR schedule, RNG, the state's counters and the divergence check's windows
        self._resume(model)
        if world.rank == 0:
            print(f"setting training iterations to {self.train_iters}", flush=True)
        # 6. data: this DP rank's micro-batches from the consumed samples on, and the validation sets
        self._build_data()
        # 7. logging: TensorBoard on the last rank, CodeCarbon on each node's local rank 0
        self.tensorboard = TensorBoard(config.tensorboard_dir, config.tensorboard_queue_size,
                                       enabled=world.is_last_rank)
        self.tensorboard.restart_marker(self.state.iteration, world.size)
        self.emissions = Emissions.start(config.codecarbon_dir, world.rank)
        # 8. the in-job watchdog's heartbeat (the job script sets its folder; opskit.allocation.in_job watches it)
        self.heartbeat = _heartbeat(world.rank)
        self._beat("start")

    def _resume(self, model) -> None:
        """Load ``--load`` (if it has a checkpoint) into the engine, the state and the divergence check; heal the
        TP-duplicated parameters with ``--sync-tp-duplicated-parameters``.

        Raises:
            CheckpointError: no step can be resumed, or one contradicts the flags (one line).
        """
        from opskit.train.tp_sync import tp_duplicated_parameters

        config, world = self.config, self.world
        self.checkpointer.resume(self.state)
        self.divergence.restore(self.state.spike_watch)
        sync = config.sync_tp_duplicated_parameters and world.tp > 1
        self.tp_duplicated = tp_duplicated_parameters(model) if sync else []
        if self.tp_duplicated:  # also heals copies that drifted apart before this run (BLOOM-176B's checkpoints)
            self._sync_tp_duplicated()
            if world.rank == 0:
                print(f"> syncing {len(self.tp_duplicated)} TP-duplicated parameters over the {world.tp} TP ranks "
                      "after every step", flush=True)

    def _build_data(self) -> None:
        """This DP rank's training micro-batches from the data position on, and the validation sets."""
        from opskit.train.data import TrainBatches, micro_batches, split_samples

        config, state = self.config, self.state
        dp_rank = self.engine.grid.data_parallel_id
        self.batches = TrainBatches(config, state, self.world.dp, dp_rank, device=rank_device())
        self.do_valid = config.eval_interval is not None and config.eval_iters > 0
        valid_samples = split_samples(config, "valid") if self.do_valid else []
        # (name or None, micro-batches): the groups share consumed_valid_samples, each resumes at its share (Megatron)
        self.valid_sets = [(name, micro_batches(samples, state.consumed_valid_samples // len(valid_samples),
                                                config.micro_batch_size, self.world.dp, dp_rank,
                                                device=rank_device()))
                           for name, samples in valid_samples]

    def train(self) -> None:
        """Megatron's loop: train to ``train_iters``, logging, validating and saving at their intervals, until an exit
        request; then the end of training (final validation, last save, the finished flag)."""

        config, state = self.config, self.state
        state.interval = IntervalStats(started=time.time())
        if self.world.rank == 0:
            print_datetime("before the start of training step")
        exit_reason = None
        iterations_run = 0
        while state.iteration < self.train_iters:
            arm_stack_dump(config.stack_dump_after_mins)  # a hung iteration prints every rank's stacks
            self._beat("train")
            if self._skip_range_at_next_iteration():
                continue
            self.profiler.before_iteration(state.iteration + 1)
            if self.forward_times is not None:
                self.forward_times.iteration = state.iteration + 1
            step = self._train_step()
            iterations_run += 1
            self.profiler.after_iteration(state.iteration)
            self._log(step)
            if flip_bit_now(state.iteration):  # tests only (OPSKIT_TEST_FAULT)
                flip_one_bit(self.digests.parameters)
            self.divergence.after_iteration(state.iteration, *step.judged)  # a spike to act on stops before a save
            saving = bool(config.save) and state.iteration % config.save_interval == 0
            if self.digests.due(state.iteration) or (saving and self.digests.interval):
                self.digests.compare(state.iteration)  # a saved step is one whose replicas agreed
            self.after_iteration(state.iteration)  # after the line: a test crash "after iteration N" has logged it
            if self.do_valid and state.iteration % config.eval_interval == 0:
                self._evaluate_and_print(f"iteration {state.iteration}")
            self.checkpointer.poll()
            if saving:
                self._save()
                self.emissions.flush()
            exit_reason = self.exits.reason(state.iteration, iterations_run)
            if exit_reason:
                break
        if state.iteration >= self.train_iters:  # the last iteration: the run is finished whatever else asked it to
            exit_reason = None                   # stop there (--exit-interval 250 of 500): final validation, flag
        self._finish(exit_reason)

    def _skip_range_at_next_iteration(self) -> bool:
        """Apply the next ``--skip-train-iteration-range`` when it starts at the next iteration (the data position
        passes over its global batches; iteration, consumed samples and LR stay). True when one was applied."""
        state = self.state
        skipped = self.batches.skip_range_at(state.iteration + 1, self.rampup.batch_size(state.consumed_train_samples))
        if skipped and self.world.rank == 0:
            print(f"Skipped iterations {skipped[0]} to {skipped[1]} due to --skip-train-iteration-range flag.",
                  flush=True)
        return skipped is not None

    def _train_step(self) -> StepResult:
        """One iteration: the ramp-up's global batch at the curriculum's sequence length through the pipeline, the
        optimizer step, and the state advanced by it."""
        from opskit.rules.schedule import num_microbatches
        from opskit.train.pipe import set_dropout_position

        config, engine, state = self.config, self.engine, self.state
        global_batch_size = self.rampup.batch_size(state.consumed_train_samples)
        num_microbatches(global_batch_size, config.micro_batch_size, self.world.dp)  # Megatron's divisibility check
        engine.set_train_batch_size(global_batch_size)
        if self.curriculum is not None and (seqlen := self.curriculum.seqlen(state.iteration + 1)) != state.seqlen:
            state.seqlen = seqlen
            engine.reset_activation_shape()  # the pipeline stages then exchange the new shapes
        skipped_before = engine.skipped_steps
        set_dropout_position(engine.module, state.consumed_train_samples // (config.micro_batch_size * self.world.dp))
        with nan_loss(engine.module, nan_loss_now(state.iteration + 1, config.divergence_replay is not None)):
            loss = float(engine.train_batch(data_iter=self.batches.iterator))
        if self.tp_duplicated:
            self._sync_tp_duplicated()
        state.iteration += 1
        state.consumed_train_samples += global_batch_size
        state.consumed_train_tokens += global_batch_size * state.seqlen
        skipped = engine.skipped_steps > skipped_before
        state.interval.add(loss, skipped=skipped)
        grad_norm = engine.get_global_grad_norm()
        return StepResult(global_batch_size=global_batch_size, loss=loss,
                          learning_rate=self.optimizer.param_groups[0]["lr"],
                          grad_norm=float(grad_norm) if grad_norm is not None else None,
                          loss_scale=current_loss_scale(engine.optimizer) if config.fp16 else None, skipped=skipped,
                          local_loss=float(engine.dp_group_loss) if engine.is_last_stage() else None)

    def _sync_tp_duplicated(self) -> None:
        from megatron.core import parallel_state

        from opskit.train.tp_sync import sync_tp_duplicated_parameters

        sync_tp_duplicated_parameters(self.tp_duplicated, parallel_state.get_tensor_model_parallel_group(),
                                      self.world.tp)

    def _log(self, step: StepResult) -> None:
        """TensorBoard's per-iteration scalars; every ``--log-interval`` iterations Megatron's iteration line (last
        rank), the interval's scalars, and once the GPU memory line."""
        import torch

        config, world, state = self.config, self.world, self.state
        curriculum_seqlen = state.seqlen if self.curriculum is not None else None
        self.tensorboard.iteration(state.iteration, state.consumed_train_samples, state.consumed_train_tokens,
                                   step.learning_rate, step.global_batch_size, step.loss, step.grad_norm,
                                   step.loss_scale, curriculum_seqlen)
        if state.iteration % config.log_interval:
            return
        seconds = (time.time() - state.interval.started) / state.interval.iterations
        flops = megatron_flops_per_iteration(step.global_batch_size, state.seqlen, config.num_layers,
                                             config.hidden_size, self.padded_vocab_size,
                                             recomputes_fully(config.checkpoint_activations,
                                                              config.recompute_granularity))
        tflops = flops / (seconds * world.size * 1e12)
        if world.is_last_rank:
            print(iteration_line(
                iteration=state.iteration, train_iters=self.train_iters, consumed_samples=state.consumed_train_samples,
                consumed_tokens=state.consumed_train_tokens, seconds_per_iteration=seconds,
                learning_rate=step.learning_rate, global_batch_size=step.global_batch_size,
                lm_loss=state.interval.mean_loss, loss_scale=step.loss_scale, grad_norm=step.grad_norm,
                skipped_iterations=state.interval.skipped_iterations, nan_iterations=state.interval.nan_iterations,
                tflops=tflops, curriculum_seqlen=curriculum_seqlen), flush=True)
        self.tensorboard.interval(state.iteration, state.consumed_train_samples, state.consumed_train_tokens, seconds,
                                  step.global_batch_size, state.seqlen, world.dp, tflops)
        first = state.iteration - state.interval.iterations + 1
        if self.forward_times is not None and (line := self.forward_times.interval_line(first, state.iteration,
                                                                                         world.is_last_rank)):
            print(line, flush=True)
        if not self.memory_reported and torch.cuda.is_available():
            print(memory_line(world.rank, state.iteration), flush=True)
            self.memory_reported = True
        state.interval = IntervalStats(started=time.time())

    def _evaluate_and_print(self, prefix: str) -> None:
        """Megatron's evaluate_and_print_results: each validation set's loss, printed (last rank) and written to
        TensorBoard; at the full ``--seq-length`` (Megatron-DeepSpeed's evaluate), also under a curriculum."""

        config, state = self.config, self.state
        started = time.time()
        if self.curriculum is not None:
            self.engine.reset_activation_shape()
        for name, valid_data in self.valid_sets:
            loss = _evaluate(self.engine, valid_data, config.eval_iters)
            state.consumed_valid_samples += config.eval_iters * self.engine.train_batch_size()
            if self.world.is_last_rank:
                for line in validation_lines(prefix, loss, name):  # one print per line: see main()
                    print(line, flush=True)
            self.tensorboard.validation(state.iteration, state.consumed_train_samples, state.consumed_train_tokens,
                                        loss, config.log_validation_ppl_to_tensorboard, name)
        if self.curriculum is not None:
            self.engine.reset_activation_shape()
        if self.world.is_last_rank:  # what validation stopped training (the goodput account's evaluation)
            print(timer_line("evaluate", started), flush=True)

    def _beat(self, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(self.state.iteration, phase)

    def _save(self) -> None:
        self._beat("save")
        self.state.spike_watch = self.divergence.state()
        self.checkpointer.save(self.state)

    def _finish(self, exit_reason: str | None) -> None:
        """The end of the run: after training to the end, the final validation and the finished flag; in any case a
        checkpoint of the last iteration (unless just saved) and Megatron's line on why it stopped."""
        import torch.distributed as dist

        config, state, rank = self.config, self.state, self.world.rank
        if exit_reason is None:  # Megatron's exits leave from inside train(), before the end-of-training evaluation
            if rank == 0:
                print_datetime("after training is done")
            if self.do_valid:
                self._evaluate_and_print("the end of training for val data")
        if config.save and state.last_saved != state.iteration:
            if self.digests.interval:
                self.digests.compare(state.iteration)
            self._save()
        self.checkpointer.finish()  # the last save complete, `latest` on it, before the run ends
        if exit_reason and rank == 0:
            print_datetime(exit_reason)
        if exit_reason is None and rank == 0 and config.finished_flag_path:
            _write_finished_flag(Path(config.finished_flag_path), state)
        dist.barrier()  # every rank is done before the process groups go

    def close(self) -> None:
        """Stop a profiler still running (its trace written), close TensorBoard's writer (it flushes its queue),
        stop CodeCarbon (it writes its last row) and the background checkpoint writer (a save it has not finished is
        left incomplete: after an error, ``latest`` stays where it was)."""
        self.checkpointer.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.profiler.stop()
        self.tensorboard.close()
        self.emissions.stop()


RANK_TIMES_ENV = "OPSKIT_RANK_TIMES"
"""``off``: no per-rank forward timing and no straggler line (to measure their cost, bench/trainer_throughput.py)."""


def _heartbeat(rank: int):
    """This rank's :class:`opskit.train.heartbeat.Heartbeat`, None outside a job that watches one; a folder it cannot
    write is one warning line, not a failed run (the watchdog then sees no beat and never calls the step hung)."""
    from opskit.train.heartbeat import Heartbeat

    try:
        return Heartbeat.from_environ()
    except (OSError, ValueError) as e:
        print(f"WARNING: rank {rank}: no heartbeat for the in-job watchdog ({e})", flush=True)
        return None


def _write_finished_flag(path: Path, state: TrainState) -> None:
    """``--finished-flag-path``: the job script's later tasks exit at start while it exists (opskit.run.paths.RunPaths
    .finished_flag). Written atomically: a reader never sees half a line."""
    atomic_write_text(path, f"{datetime.now():%Y-%m-%d %H:%M:%S} training finished at iteration {state.iteration}, "
                            f"consumed samples {state.consumed_train_samples}\n")


def _evaluate(engine, valid_data, eval_iters: int) -> float:
    """Megatron's evaluate() under DeepSpeed's pipeline: ``eval_iters`` global batches of the valid split through
    ``engine.eval_batch`` (eval mode, no gradients; it returns the mean of the batch's micro-batch losses, averaged
    over DP), then the mean of those: the average over ``eval_iters * num_microbatches`` micro-batches, in nats per
    token. The global batch is the last iteration's (Megatron's get_num_microbatches() during a ramp-up); each eval
    iteration consumes one of them from the valid split."""
    total = 0.0
    for _ in range(eval_iters):
        total += float(engine.eval_batch(data_iter=valid_data))
    engine.module.train()  # train_batch does it too; done here so that nothing runs in eval mode by accident
    return total / eval_iters
