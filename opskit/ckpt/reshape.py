"""Change a checkpoint's TP x PP x DP layout: DeepSpeed's universal checkpoint, written beside the step.

A step saved at one layout is resumed at another through DeepSpeed's own machinery: ``ds_to_universal`` merges the
ZeRO shards of every (PP, TP, DP) rank into one folder per parameter (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
TP slices merged by the ``universal_checkpoint_info`` the trainer saves with every step,
:func:`opskit.ckpt.layout.universal_checkpoint_info`), and the engine, configured with ``checkpoint.load_universal``,
cuts each rank's piece out of it: fp32 master weights, Adam moments, step, and the model weights from the fp32 ones.
The counters, LR schedule and RNG states come from the ``mp_rank`` files copied along.

The universal form of ``global_stepN`` is ``global_stepN_universal`` beside it (Megatron-DeepSpeed's name), written
once into a hidden folder and renamed into place, so it exists only complete; the step itself is only read. A
universal folder carries opskit's marker with its origin (:func:`universal_origin`).

Supported: optimizer states partitioned by ZeRO stage 1 (fp32, bf16, fp16). Not here: ZeRO-0 fp32/fp16, whose
optimizer state sits in the ``mp_rank`` files unpartitioned (a DP change needs no conversion; a TP or PP change is
refused), and bf16 with ZeRO-0, whose universal load DeepSpeed 0.19.8 skips (refused; see docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.info import StepInfo, describe_step, saved_files_digest
from opskit.ckpt.layout import load_args, scan_step_dir, universal_checkpoint_info
from opskit.errors import OpskitError
from opskit.fsutil import read_marker, write_marker

UNIVERSAL_SUFFIX = "_universal"
MARKER_COMMAND = "ckpt reshape"


class ReshapeError(OpskitError):
    """A step that cannot be moved to the asked layout; one line naming the step and why."""


@dataclass(frozen=True)
class Layout:
    """A parallel layout: world size = ``tp * pp * dp``."""

    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp}"


def saved_layout(step: StepInfo) -> Layout:
    """The layout that saved a complete step (its files' TP and PP, DeepSpeed's ``dp_world_size``)."""
    return Layout(step.tp, step.pp, step.dp)


def universal_dir(step_dir: Path) -> Path:
    """``<checkpoint dir>/global_stepN_universal``: where the universal form of ``global_stepN`` lives."""
    return Path(step_dir).with_name(Path(step_dir).name + UNIVERSAL_SUFFIX)


def universal_origin(folder: Path) -> dict | None:
    """What a universal folder was converted from (``{"step": "global_stepN", "layout": "TP=.. PP=.. DP=..",
    "iteration": N, "files": digest}``), from opskit's marker; None for a folder opskit's conversion did not finish."""
    marker = read_marker(folder)
    if marker is None or marker.get("command") != MARKER_COMMAND:
        return None
    return marker.get("source")


def needs_conversion(saved: Layout, target: Layout, zero_stage: int, precision: str) -> bool:
    """Whether resuming a step saved at ``saved`` on ``target`` goes through the universal form.

    Raises:
        ReshapeError: a change DeepSpeed cannot load (module docstring): TP/PP of a ZeRO-0 fp32/fp16 step, any change
            of a bf16 ZeRO-0 step.
    """
    if saved == target:
        return False
    if zero_stage >= 1:
        return True
    if precision == "bf16":
        raise ReshapeError(f"layout {saved} -> {target}: a bf16 step with ZeRO stage 0 can only be resumed on the "
                           "layout that saved it (DeepSpeed 0.19.8 does not load its optimizer from a universal "
                           "checkpoint)")
    if (saved.tp, saved.pp) == (target.tp, target.pp):
        return False  # the unpartitioned optimizer state in the mp_rank files fits any DP size
    raise ReshapeError(f"layout {saved} -> {target}: a ZeRO stage 0 step keeps its optimizer unpartitioned; it "
                       "resumes on another DP size, but a TP or PP change needs ZeRO stage 1")


def step_precision(args: Namespace) -> str:
    """``bf16``/``fp16``/``fp32`` from a step's saved args."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def convert_to_universal(step_dir: Path, out: Path | None = None, workers: int = 1, verify: bool = False) -> Path:
    """Write the universal form of the complete step ``step_dir`` to ``out`` (default :func:`universal_dir`) and
    return it; an existing complete one (opskit's marker) of this save of the step is reused as it is (the marker's
    source has :func:`opskit.ckpt.info.saved_files_digest`: a step saved again under its name is another save).

    Written into a hidden folder beside ``out`` and renamed into place; leftovers of a killed conversion (hidden
    folders of that name) are removed first. ``step_dir`` is only read: a step saved before the trainer recorded
    its ``universal_checkpoint_info`` gets opskit's, through a folder of links with patched ``mp_rank`` copies.
    DeepSpeed's ``ds_to_universal`` does the work (its tqdm bars are the progress; its prints go to stderr).

    Args:
        workers: processes for ds_to_universal's extraction and merge (its memory grows with them).
        verify: also check that the universal fp32 weights reproduce the step's model weights (:func:`verify`).

    Raises:
        ReshapeError: the step is incomplete, has no partitioned optimizer state, ``out`` exists and is not a
            finished conversion of this save of the step (another step's, or a stale one), or the weights do not
            verify.
    """
    step_dir = Path(step_dir)
    out = Path(out) if out is not None else universal_dir(step_dir)
    info = describe_step(step_dir)
    if not info.complete:
        raise ReshapeError(f"{step_dir}: not a complete step ({info.problems[0]})")
    source = {"step": step_dir.name, "layout": str(saved_layout(info)), "iteration": info.iteration,
              "files": saved_files_digest(step_dir)}
    origin = universal_origin(out)
    if origin == source:
        return out
    if origin is not None:
        raise ReshapeError(f"{out}: converted from another save ({origin.get('step')} at {origin.get('layout')}) than "
                           f"{step_dir} as saved now; remove it to convert again")
    if out.exists() or out.is_symlink():
        raise ReshapeError(f"{out}: exists and is not a universal checkpoint opskit finished; move it away")
    args = load_args(scan_step_dir(step_dir))
    if not any(step_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        raise ReshapeError(f"{step_dir}: has no ZeRO optimizer shards (ZeRO stage 0 fp32/fp16 keeps the optimizer "
                           "in the mp_rank files): nothing to convert")
    _remove_leftovers(out)
    # ds_to_universal also writes ``latest_universal`` beside its output: inside the hidden folder, that is ours
    hidden = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    staging = hidden / out.name
    try:
        hidden.mkdir()
        with _with_universal_info(step_dir, args, hidden) as readable:
            _ds_to_universal(readable, staging, workers)
        if verify:
            verify_universal(step_dir, staging)
        write_marker(staging, MARKER_COMMAND, source=source)
        os.replace(staging, out)
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    return out


def _remove_leftovers(out: Path) -> None:
    """Hidden staging folders of earlier conversions to ``out`` whose process is gone (ours by name)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _with_universal_info(step_dir: Path, args: Namespace, scratch: Path):
    """``step_dir`` itself when its ``mp_rank`` files carry ``universal_checkpoint_info``; else a folder in
    ``scratch`` of links to its files with ``mp_rank`` copies that carry opskit's (removed afterwards)."""
    import torch

    mp_files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
    first = torch.load(mp_files[0], map_location="cpu", weights_only=False)
    if "universal_checkpoint_info" in first:
        yield step_dir
        return
    from opskit.rules.model import has_embedding_layernorm

    ucp = universal_checkpoint_info(args.padded_vocab_size, args.position_embedding_type == "absolute",
                                    has_embedding_layernorm(args.embed_layernorm, getattr(args, "use_bnb_optimizer",
                                                                                          False)))
    links = scratch / "input"
    links.mkdir()
    try:
        for f in step_dir.iterdir():
            if f.name.startswith("mp_rank_"):
                state = torch.load(f, map_location="cpu", weights_only=False)
                state["universal_checkpoint_info"] = ucp
                torch.save(state, links / f.name)
            else:
                (links / f.name).symlink_to(f.resolve())
        yield links
    finally:
        shutil.rmtree(links, ignore_errors=True)


def _ds_to_universal(step_dir: Path, out: Path, workers: int) -> None:
    """DeepSpeed's converter on one step (prints to stderr, so that a trainer's log keeps Megatron's lines only)."""
    from deepspeed.checkpoint import ds_to_universal

    options = Namespace(input_folder=str(step_dir), output_folder=str(out), num_extract_workers=workers,
                        num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=False)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            ds_to_universal.main(options)
    except (AssertionError, KeyError, ValueError, RuntimeError) as e:
        raise ReshapeError(f"{step_dir}: DeepSpeed's ds_to_universal failed ({type(e).__name__}: {e})") from None


def verify_universal(step_dir: Path, universal: Path) -> int:
    """Check that every parameter's universal fp32 weight, cast to the step's dtype, equals the step's model weight
    merged over TP (:func:`opskit.ckpt.layout.merged_layers`); the weights a resume at any layout starts from.

    Returns:
        The number of tensors compared.

    Raises:
        ReshapeError: a parameter missing from the universal folder or different from the step's, named.
    """
    import torch

    from opskit.ckpt.layout import EMBEDDING_LAYER, merged_layers

    compared = 0
    for index, tensors in merged_layers(scan_step_dir(step_dir)).items():
        for key, weight in tensors.items():
            name = f"tied_modules.embed.{key}" if index == EMBEDDING_LAYER else f"{index}.{key}"
            path = universal / "zero" / name / "fp32.pt"
            if not path.is_file():
                raise ReshapeError(f"{universal}: no {path.relative_to(universal)} for {step_dir.name}'s {name}")
            fp32 = torch.load(path, map_location="cpu", weights_only=False)["param"]
            fp32 = fp32[: weight.shape[0]] if fp32.shape != weight.shape else fp32
            if fp32.shape != weight.shape or not torch.equal(fp32.to(weight.dtype), weight):
                raise ReshapeError(f"{universal}: {name} differs from {step_dir.name}'s weights")
            compared += 1
    return compared
