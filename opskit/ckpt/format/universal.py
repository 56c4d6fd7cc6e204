"""DeepSpeed's universal checkpoint beside a step: how a step saved at one TP x PP x DP layout is resumed at another.

``ds_to_universal`` merges the ZeRO shards of every (PP, TP, DP) rank into one folder per parameter
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, TP slices merged by the ``universal_checkpoint_info`` the trainer
saves with every step, :func:`opskit.ckpt.format.layout.universal_checkpoint_info`), and the engine, configured with
``checkpoint.load_universal``, cuts each rank's piece out of it: fp32 master weights, Adam moments, step, and the model
weights from the fp32 ones. The counters, LR schedule and RNG states come from the ``mp_rank`` files copied along.

The universal form of ``global_stepN`` is ``global_stepN_universal`` beside it (Megatron-DeepSpeed's name), written
once into a hidden folder and renamed into place, so it exists only complete; the step itself is only read. A
universal folder carries opskit's marker with its origin (:func:`universal_origin`). The trainer converts at resume
(rank 0, once); ``opskit ckpt reshape`` (:mod:`opskit.ckpt.reshape`) does the same ahead of time.

Supported: optimizer states partitioned over DP: ZeRO stage 1 (fp32, bf16, fp16) and bf16 with ZeRO-0 (DeepSpeed's
BF16_Optimizer partitions at stage 0 too; the trainer loads it itself on DeepSpeed 0.18.5-0.19.8,
opskit.train.ds_compat). Not ZeRO-0 fp32/fp16, whose optimizer state sits in the ``mp_rank`` files unpartitioned: a
DP change needs no conversion, a TP or PP change is refused.

torch and deepspeed are imported only inside the conversion.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.info import StepInfo, describe_step, saved_files_digest
from opskit.ckpt.format.layout import (
    EMBEDDING_LAYER,
    MP_RANK_FILE,
    CheckpointFormatError,
    layer_file_name,
    load_args,
    load_state,
    merged_layers,
    scan_step_dir,
    universal_checkpoint_info,
)
from opskit.errors import OpskitError
from opskit.fsutil import damaged_entries, folder_entries, has_marker, process_alive, read_marker, write_marker

UNIVERSAL_SUFFIX = "_universal"
UNIVERSAL_DIR = re.compile(r"^global_step([0-9]+)" + UNIVERSAL_SUFFIX + r"\Z")
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
        ReshapeError: a change DeepSpeed cannot load: TP/PP of a ZeRO-0 fp32/fp16 step.
    """
    if saved == target:
        return False
    if zero_stage >= 1 or precision == "bf16":  # bf16 partitions its optimizer at ZeRO-0 too (BF16_Optimizer)
        return True
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
    source has :func:`opskit.ckpt.format.info.saved_files_digest`: a step saved again under its name is another save).

    Written into a hidden folder beside ``out`` and renamed into place; leftovers of a killed conversion (hidden
    folders of that name) are removed first. ``step_dir`` is only read: a step saved before the trainer recorded
    its ``universal_checkpoint_info`` gets opskit's, through a folder of links with patched ``mp_rank`` copies.
    DeepSpeed's ``ds_to_universal`` does the work (its tqdm bars are the progress; its prints go to stderr).

    Args:
        workers: processes for ds_to_universal's extraction and merge (its memory grows with them).
        verify: also check that the universal fp32 weights reproduce the step's model weights
            (:func:`verify_universal`); the marker's source then records ``verified_tensors``, their number.

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
    if origin is not None and {key: origin.get(key) for key in source} == source:  # (+ verified_tensors)
        if problem := universal_problem(out):
            raise ReshapeError(f"{out}: damaged ({problem}); remove it, and the next resume or `opskit ckpt "
                               f"reshape` converts {step_dir.name} again")
        return out
    if origin is not None:
        raise ReshapeError(f"{out}: converted from another save ({origin.get('step')} at {origin.get('layout')}) than "
                           f"{step_dir} as saved now; remove it to convert again")
    if out.is_symlink() or (out.exists() and not (out.is_dir() and not any(out.iterdir()))):  # empty: renamed over
        raise ReshapeError(f"{out}: exists and is not a universal checkpoint opskit finished; move it away")
    args = load_args(scan_step_dir(step_dir), light=True)
    if not any(step_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        raise ReshapeError(f"{step_dir}: has no ZeRO optimizer shards (ZeRO stage 0 fp32/fp16 keeps the optimizer "
                           "in the mp_rank files): nothing to convert")
    _remove_leftovers(out)
    # ds_to_universal also writes ``latest_universal`` beside its output: inside the hidden folder, that is ours
    hidden = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    staging = hidden / out.name
    try:
        hidden.mkdir()
        write_marker(hidden, MARKER_COMMAND)  # _remove_leftovers removes only hidden folders of ours
        try:
            with _readable_by_ds_to_universal(step_dir, args, hidden) as readable:
                _ds_to_universal(readable, staging, workers)
        except ModuleNotFoundError as e:  # torch.load of a pickle naming a class not installed here
            raise ReshapeError(f"{step_dir}: its pickles need the module {e.name} (Megatron-DeepSpeed's own "
                               "checkpoints pickle megatron.enums): convert it where that module is importable") \
                from None
        if verify:
            source["verified_tensors"] = verify_universal(step_dir, staging)
        # sizes, not digests: a universal folder is as large as the step; a deleted or truncated file is still told
        write_marker(staging, MARKER_COMMAND, folder_entries(staging), source=source, digests="size")
        os.replace(staging, out)
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    return out


def _remove_leftovers(out: Path) -> None:
    """Hidden staging folders of earlier conversions to ``out`` whose process is gone: ours by name and by the
    marker written into each as it was made (a folder of that name without it is left alone)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)) and has_marker(stale, MARKER_COMMAND):
            shutil.rmtree(stale, ignore_errors=True)


def universal_problem(folder: Path) -> str | None:
    """Why the universal folder ``folder`` cannot be resumed from (one line), or None. Checked as a step is
    (:func:`opskit.ckpt.format.info.describe_step`: every file there, each torch file's zip directory and pickle
    readable, no tensor data read): every file its marker lists is there with the size written (a deleted parameter
    folder, a truncated ``fp32.pt``), and every ``.pt`` below it loads lazily. A marker of an older opskit lists no
    files: only the files present are read then."""
    damaged = damaged_entries(folder, read_marker(folder) or {})
    if damaged:
        return f"{damaged[0]}{f' and {len(damaged) - 1} more' if len(damaged) > 1 else ''}"
    for path in sorted(Path(folder).rglob("*.pt")):
        try:
            load_state(path, light=True)
        except CheckpointFormatError as e:
            return str(e)
    return None


@contextlib.contextmanager
def _readable_by_ds_to_universal(step_dir: Path, args: Namespace, scratch: Path):
    """``step_dir`` itself when ds_to_universal can read it; else a folder in ``scratch`` of links to its files with
    patched ``mp_rank`` copies (removed afterwards). Two things it may lack: ``universal_checkpoint_info`` (steps
    saved before the trainer recorded it: opskit's is added), and ``param_shapes`` (DeepSpeed 0.19.8 saves None for
    bf16 with ZeRO-0: rebuilt from the optimizer shards' parameter names and the layer files' shapes)."""
    import torch

    mp_files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
    states = {f: torch.load(f, map_location="cpu", weights_only=False) for f in mp_files}
    if all("universal_checkpoint_info" in s and s.get("param_shapes") is not None for s in states.values()):
        yield step_dir
        return
    ucp = universal_checkpoint_info(args)
    links = scratch / "input"
    links.mkdir()
    try:
        for f in step_dir.iterdir():
            if f in states:
                state = states[f]
                state.setdefault("universal_checkpoint_info", ucp)
                if state.get("param_shapes") is None:
                    state["param_shapes"] = _param_shapes(step_dir, int(MP_RANK_FILE.match(f.name).group(1)),
                                                          args.tensor_model_parallel_size)
                torch.save(state, links / f.name)
            else:
                (links / f.name).symlink_to(f.resolve())
        yield links
    finally:
        shutil.rmtree(links, ignore_errors=True)


def _param_shapes(step_dir: Path, mp_rank: int, tp: int) -> list[dict]:
    """``[{engine parameter name: shape}]`` (DeepSpeed's list of groups, here one) of model-parallel rank
    ``mp_rank``: the names its optimizer shards map (``param_slice_mappings``, over every DP rank), the shapes of its
    TP rank's layer files (``tied_modules.embed.*`` is layer 1's)."""
    import torch

    names: set[str] = set()
    for shard in step_dir.glob(f"*zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"):
        optimizer = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        names.update(name for group in optimizer["param_slice_mappings"] for name in group)
    shapes = {}
    for name in sorted(names):
        layer, key = (EMBEDDING_LAYER, name.removeprefix("tied_modules.embed.")) \
            if name.startswith("tied_modules.embed.") else (int(name.split(".", 1)[0]), name.split(".", 1)[1])
        shapes[name] = torch.Size(load_state(step_dir / layer_file_name(layer, mp_rank % tp))[key].shape)
    return [shapes]


def _ds_to_universal(step_dir: Path, out: Path, workers: int) -> None:
    """DeepSpeed's converter on one step (prints to stderr, so that a trainer's log keeps Megatron's lines only, and
    ``ckpt reshape --json`` its JSON: imported inside the redirection, DeepSpeed's logger writes there too)."""
    options = Namespace(input_folder=str(step_dir), output_folder=str(out), num_extract_workers=workers,
                        num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=False)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.checkpoint import ds_to_universal

            ds_to_universal.main(options)
    except (AssertionError, KeyError, ValueError, RuntimeError) as e:
        raise ReshapeError(f"{step_dir}: DeepSpeed's ds_to_universal failed ({type(e).__name__}: {e})") from None


def verify_universal(step_dir: Path, universal: Path) -> int:
    """Check that every parameter's universal fp32 weight, cast to the step's dtype, equals the step's model weight
    merged over TP (:func:`opskit.ckpt.format.layout.merged_layers`); the weights a resume at any layout starts from.

    Returns:
        The number of tensors compared.

    Raises:
        ReshapeError: a parameter missing from the universal folder or different from the step's, named.
    """
    import torch

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


def universal_folders(directory: Path) -> dict[int, tuple[Path, dict | None]]:
    """Iteration -> (``global_stepN_universal`` folder of a checkpoint dir, its :func:`universal_origin`), ascending;
    a folder without opskit's marker has origin None (not a conversion opskit finished: the trainer refuses it)."""
    directory = Path(directory)
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := UNIVERSAL_DIR.match(p.name)) and p.is_dir()} \
        if directory.is_dir() else {}
    return {step: (found[step], universal_origin(found[step])) for step in sorted(found)}


def origin_text(origin: dict | None) -> str:
    """``universal, from global_step10 at TP=1 PP=1 DP=2`` (``ckpt list``), or what an unmarked folder is."""
    if origin is None:
        return "not a universal checkpoint opskit finished (no marker): the trainer refuses it; move it away"
    return f"universal, from {origin.get('step')} at {origin.get('layout')}"
