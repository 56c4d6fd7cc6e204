"""Megatron-DeepSpeed's checkpoint layout from the trainer's side (reference section 2.1): a step's files, ``latest``,
the client state, the resume plan and the load. :class:`opskit.train.checkpointer.Checkpointer` puts them together
(with the background writer of :mod:`opskit.train.async_save`); this module knows neither.

DeepSpeed writes the layer files, ``mp_rank_XX_model_states.pt`` (with our client state: ``args``, ``iteration``,
``tokens``, ``checkpoint_version``, RNG states) and the ZeRO optimizer shards. We write ``latest`` ourselves, last and
atomically (temp file + rename), after every rank has finished its files: a save killed half-way leaves ``latest`` at
the previous complete step.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from opskit.ckpt.format.info import ResumePoint, resume_point
from opskit.ckpt.format.layout import (
    load_args,
    save_failed_message,
    scan_step_dir,
    universal_checkpoint_info,
    write_latest,
)
from opskit.ckpt.format.universal import (
    Layout,
    ReshapeError,
    convert_to_universal,
    needs_conversion,
    saved_layout,
    step_precision,
    universal_dir,
    universal_origin,
)
from opskit.rules.model_size import resumed_padded_vocab_size
from opskit.train.ds_compat import load_bf16_zero0_optimizer, loads_optimizer_itself
from opskit.train.log import timer_line
from opskit.train.state import TrainState

CHECKPOINT_VERSION = 3.0

# Saved args that must match the command line on resume (Megatron's check_checkpoint_args).
_MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "position_embedding_type", "padded_vocab_size",
               "tensor_model_parallel_size", "pipeline_model_parallel_size")
_MUST_MATCH_ON_ANY_LAYOUT = ("num_layers", "hidden_size", "num_attention_heads", "position_embedding_type")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; one line naming the folder and what differs."""


def step_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def _rng_state() -> dict:
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])


def write_through_python_file(zipfile_serialization: bool, state_dict, path: str, fsync: bool = False) -> None:
    """DeepSpeed's ``TorchCheckpointEngine.save``, but torch.save into a Python file, so that a failed write (disk
    full, quota) surfaces as the OSError with its errno, and the path is added. Given a path name, torch.save writes
    from C++ and raises a RuntimeError that names neither ("unexpected pos 576 vs 534"). The zip's records are then
    named ``archive/...`` rather than ``<file stem>/...``; torch.load and opskit's reader take either. ``fsync``:
    also flush the file to the device before returning (a background save, where it costs the training nothing)."""
    try:
        with open(path, "wb") as f:
            torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile_serialization)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        # torch's zip writer replaces the file's OSError with that RuntimeError while closing the archive
        error = e if isinstance(e, OSError) else e.__context__
        if not isinstance(error, OSError):
            raise
        raise OSError(error.errno, error.strerror, path) from None


def _name_failed_writes(engine) -> None:
    """Route the DeepSpeed engine's torch.save calls through :func:`write_through_python_file` (idempotent; another
    checkpoint engine, such as DeepSpeed's fast writer or opskit's background one, is left as it is)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    writer = engine.checkpoint_engine
    if type(writer) is TorchCheckpointEngine:
        writer.save = partial(write_through_python_file, writer.zipfile_serialization)


def failure_reason(error: OSError, where: Path) -> str:
    """``[Errno 28] No space left on device (<file>)``: the file the error names, else ``where``."""
    if error.errno is None:
        return f"{error} ({where})"
    return f"[Errno {error.errno}] {error.strerror} ({error.filename or where})"


def write_step(engine, save_dir: str, tag: str, client_state: dict) -> None:
    """Hand the step ``tag`` to the engine's checkpoint engine (every rank): the layer files, the ``mp_rank`` files with
    ``client_state`` and the optimizer shards, written now (or queued, by a background engine). ``latest`` is not
    touched (:func:`commit_step` moves it).

    Raises:
        CheckpointError: a file could not be written (disk full, quota, permissions): one line naming the step, the
            OS error and the file. The files of this step written so far stay (an incomplete step).
    """
    _name_failed_writes(engine)
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    except OSError as e:
        raise CheckpointError(save_failed_message(tag, failure_reason(e, Path(save_dir) / tag))) from None


def commit_step(save_dir: str, tag: str) -> None:
    """After every rank has written the step ``tag`` (a barrier), rank 0 points ``latest`` at it.

    Raises:
        CheckpointError: ``latest`` could not be written (one line; it still names the previous step).
    """
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            write_latest(save_dir, tag)
        except OSError as e:
            raise CheckpointError(save_failed_message(tag, failure_reason(e, Path(save_dir) / "latest"))) from None


def client_state(args: argparse.Namespace, state: TrainState) -> dict:
    """What Megatron-DeepSpeed adds to ``mp_rank_XX_model_states.pt``: the run's ``args`` (the parsed flags with the
    vocabulary sizes) with the state's counters under Megatron's names, the iteration, the consumed tokens, the
    vocabulary sizes, the RNG states."""
    saved_args = argparse.Namespace(**vars(args))
    saved_args.consumed_valid_samples = state.consumed_valid_samples
    saved_args.skipped_train_samples = state.skipped_train_samples
    saved_args.applied_skip_train_iteration_ranges = list(state.applied_skip_train_iteration_ranges)
    saved_args.consumed_train_samples = state.consumed_train_samples
    saved_args.iteration = state.iteration
    return {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        "tokens": state.consumed_train_tokens,
        "checkpoint_info": {"padded_vocab_size": args.padded_vocab_size,
                            "original_vocab_size": args.original_vocab_size},
        "universal_checkpoint_info": universal_checkpoint_info(args),
        **({"reshaped_from": state.reshaped_from} if state.reshaped_from else {}),
        **({"spike_watch": state.spike_watch} if state.spike_watch is not None else {}),
        **_rng_state(),
    }


@dataclass(frozen=True)
class ResumePlan:
    """What a resume from ``--load`` reads, decided before the engine is built (:func:`plan_resume`).

    Attributes:
        point: the step :func:`opskit.ckpt.format.info.resume_point` chose, None without ``--load``.
        saved_args: that step's saved ``args`` (read once, without its tensors), None without a step.
        saved: the layout that saved it; current: this run's.
        universal: the step's universal form when the layouts differ and the optimizer state must be re-cut
            (the engine then needs ``checkpoint.load_universal``); None otherwise.
        padded_vocab_size: the model's padded vocabulary: a fresh start's, or on a layout change the saved step's
            where the new TP divides it (:func:`opskit.rules.model_size.resumed_padded_vocab_size`).
    """

    point: ResumePoint | None
    padded_vocab_size: int
    saved_args: argparse.Namespace | None = None
    saved: Layout | None = None
    current: Layout | None = None
    universal: Path | None = None

    @property
    def reshaped(self) -> bool:
        return self.saved is not None and self.saved != self.current


def plan_resume(load: str | None, padded_vocab_size: int, current: Layout) -> ResumePlan:
    """Find the step ``load`` resumes from and, when it was saved on another TP x PP x DP layout, make sure its
    universal form exists (rank 0 converts it beside the step, once:
    :func:`opskit.ckpt.format.universal.convert_to_universal`; the other ranks wait for its answer).
    ``padded_vocab_size`` is a fresh start's; on a layout change the plan keeps the saved one where it can
    (:func:`opskit.rules.model_size.resumed_padded_vocab_size`).

    Raises:
        CheckpointError: a layout change DeepSpeed cannot load, or a failed conversion (one line, on every rank).
    """
    point = _agreed_resume_point(load) if load else None
    if point is None or point.step is None:
        return ResumePlan(point, padded_vocab_size)
    step = point.step
    saved_args = load_args(scan_step_dir(step.path), light=True)
    saved = saved_layout(step)
    if saved == current:
        return ResumePlan(point, padded_vocab_size, saved_args, saved, current)
    decided = [_convert_on_rank_0(step.path, saved_args, saved, current) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(decided, src=0)
    universal, error = decided[0]
    if error:
        raise CheckpointError(error)
    resumed = resumed_padded_vocab_size(saved_args.padded_vocab_size, current.tp)
    if resumed != padded_vocab_size and dist.get_rank() == 0:  # the line above it named a fresh start's size
        print(f" > padded vocab of {step.path.name} kept (new size: {resumed}; {padded_vocab_size} on a fresh "
              "start)", flush=True)
    return ResumePlan(point, resumed, saved_args, saved, current, Path(universal) if universal else None)


def _convert_on_rank_0(step_dir: Path, saved_args: argparse.Namespace, saved: Layout,
                       current: Layout) -> tuple[str | None, str | None]:
    """(universal folder or None when none is needed, error line or None)."""
    try:
        if not needs_conversion(saved, current, saved_args.zero_stage, step_precision(saved_args)):
            return None, None
        if universal_origin(universal_dir(step_dir)) is None:  # else an earlier resume's conversion is reused
            print(f" converting {step_dir} to a universal checkpoint for {current}", flush=True)
        return str(convert_to_universal(step_dir)), None
    except ReshapeError as e:
        return None, f"{step_dir}: {e}"


def load_checkpoint(engine, args: argparse.Namespace, state: TrainState, plan: ResumePlan) -> None:
    """Resume from ``plan``'s step: weights, optimizer, LR scheduler, RNG, and the counters of ``state`` (set in place
    from the checkpoint's ``iteration``, ``tokens`` and saved args, as Megatron does for its counters); ``state`` is
    left as it is when there is nothing to load. ``args`` are the run's (the parsed flags with the vocabulary sizes):
    the saved architecture must match them.

    The step is ``latest``'s when it is complete (:func:`opskit.ckpt.format.info.resume_point`); when ``latest`` names a
    missing or incomplete step, or is unusable, the newest complete step before it, with one WARNING line (a chain
    that crashed on the same broken step job after job would make no progress). ``latest`` itself is left as it is:
    the next save moves it. Saved on another layout, the step is read through its universal form, with one line
    saying what changed (``checkpoint layout TP=1 PP=1 DP=2 -> TP=1 PP=1 DP=1``).

    Raises:
        CheckpointError: ``latest`` is there but no step is complete, the saved architecture differs from the flags,
            or the saved LR schedule contradicts them (AnnealingLR's check, raised inside DeepSpeed's loader).
    """
    point = plan.point
    if point is None or (point.problem is None and point.step is None):
        if dist.get_rank() == 0 and args.load:
            print(f"WARNING: could not find the metadata file {args.load}/latest", flush=True)
            print("    will not load any checkpoints and will start from random", flush=True)
        return
    if point.error:
        raise CheckpointError(point.error)
    if point.fallback and dist.get_rank() == 0:
        print(point.warning, flush=True)
    started = time.time()
    tag, step_dir = point.step.path.name, point.step.path
    # Check the architecture before DeepSpeed loads the weights: a mismatch would fail there with a shape traceback.
    _check_args(plan.saved_args, args, str(step_dir), same_layout=not plan.reshaped)
    if dist.get_rank() == 0:
        print(f" loading checkpoint from {args.load} at {tag}", flush=True)
        if plan.reshaped:
            how = f" (universal checkpoint {plan.universal.name})" if plan.universal else ""
            print(f" checkpoint layout {plan.saved} -> {plan.current}{how}", flush=True)
    by_hand = loads_optimizer_itself(engine)
    try:
        path, saved = engine.load_checkpoint(args.load, tag=plan.universal.name if plan.universal else tag,
                                             load_optimizer_states=not by_hand, load_lr_scheduler_states=True)
    except ValueError as e:  # AnnealingLR's schedule mismatch
        raise CheckpointError(f"{args.load}: {e}") from None
    if path is None:
        raise CheckpointError(f"{step_dir}: DeepSpeed could not load it")
    if by_hand:
        load_bf16_zero0_optimizer(engine, step_dir, plan.universal)
    place_optimizer_states(base_optimizer(engine))
    _set_rng_state(saved)
    saved_args = saved["args"]
    state.iteration = saved["iteration"]
    state.consumed_train_samples = saved_args.consumed_train_samples
    state.consumed_train_tokens = saved["tokens"]
    state.consumed_valid_samples = getattr(saved_args, "consumed_valid_samples", 0)
    state.skipped_train_samples = getattr(saved_args, "skipped_train_samples", 0)
    state.applied_skip_train_iteration_ranges = getattr(saved_args, "applied_skip_train_iteration_ranges", [])
    state.reshaped_from = f"{tag} at {plan.saved}" if plan.reshaped else saved.get("reshaped_from")
    state.spike_watch = saved.get("spike_watch")
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {state.iteration}", flush=True)
        print(timer_line("load-checkpoint", started), flush=True)


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch (or bitsandbytes) optimizer that holds the states: the one DeepSpeed's BF16_Optimizer,
    FP16_Optimizer or ZeRO optimizer wraps, or the engine's own optimizer where it wraps none (fp32 ZeRO-0)."""
    wrapper = engine.optimizer
    return getattr(wrapper, "optimizer", wrapper)


def place_optimizer_states(optimizer: torch.optim.Optimizer) -> int:
    """Put every state tensor where the optimizer's own ``load_state_dict`` would: ``step`` as float32 on its
    parameter's device for fused or capturable groups (left as it is otherwise), floating-point states in the
    parameter's dtype on its device, other tensors on its device. The rule is torch's
    (``Optimizer._process_value_according_to_param_policy``, torch 2.x); DeepSpeed's universal checkpoint load
    bypasses it, writing ``step`` and the fragments as ``torch.load`` gave them (on the CPU), and torch's fused AdamW
    then refuses the first step on a GPU ("state_steps is on cpu, different from other tensors on cuda:0").

    Returns:
        The number of tensors moved or cast (0 when all were in place already).
    """
    moved = 0
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                placed = _placed_state(key, value, param, step_on_device)
                if placed is not value:
                    state[key] = placed
                    moved += 1
    return moved


def _placed_state(key, value: torch.Tensor, param: torch.Tensor, step_on_device: bool) -> torch.Tensor:
    if key == "step":
        return value.to(dtype=torch.float32, device=param.device) if step_on_device else value
    if value.is_floating_point() and param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _agreed_resume_point(directory: str) -> ResumePoint:
    """Rank 0's :func:`resume_point`, sent to every rank: ranks that looked at the files at different moments (a
    file system's attribute caches) would otherwise load different steps."""
    decided = [resume_point(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(decided, src=0)
    return decided[0]


def _check_args(saved: argparse.Namespace, current: argparse.Namespace, where: str, same_layout: bool) -> None:
    """The saved architecture against the flags (Megatron's ``check_checkpoint_args``); TP, PP and the padded
    vocabulary may differ when the step is resumed on another layout (:func:`plan_resume` chose the vocabulary)."""
    for name in _MUST_MATCH if same_layout else _MUST_MATCH_ON_ANY_LAYOUT:
        if getattr(saved, name, None) != getattr(current, name):
            raise CheckpointError(
                f"{where}: {name} is {getattr(saved, name, None)} in the checkpoint but "
                f"{getattr(current, name)} on the command line"
            )
    if current.position_embedding_type != "alibi" and saved.max_position_embeddings != current.max_position_embeddings:
        raise CheckpointError(
            f"{where}: max_position_embeddings is {saved.max_position_embeddings} in the checkpoint but "
            f"{current.max_position_embeddings} on the command line"
        )
