"""``opskit ckpt reshape``: a step's universal form written ahead of the resume that needs it, checked against the
target layout (:mod:`opskit.ckpt.format.universal` holds the form and the conversion), and the universal folders of a
checkpoint directory listed with their origin."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.info import StepInfo, describe_step, resume_point
from opskit.ckpt.format.layout import latest_state, load_args, scan_step_dir
from opskit.ckpt.format.universal import (
    Layout,
    ReshapeError,
    convert_to_universal,
    needs_conversion,
    saved_layout,
    step_precision,
    universal_dir,
    universal_origin,
    verify_universal,
)
from opskit.fsutil import claim_dir
from opskit.rules import consistency


def layout_name(key: str, value=None) -> str:
    """The :data:`~opskit.rules.consistency.Namer` of a checkpoint resumed on a target layout: ``TP=3`` for the target's
    degrees, ``the checkpoint's num_attention_heads 4`` for the saved model's settings."""
    short = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP"}.get(key)
    if short:
        return short if value is None else f"{short}={value}"
    return f"the checkpoint's {key}" + ("" if value is None else f" {value}")


def target_problems(args: Namespace, target: Layout) -> list[str]:
    """Why the model saved with ``args`` cannot run on ``target``: the trainer's own TP and PP rules
    (:func:`opskit.rules.consistency.tensor_parallel_problems`, :func:`~opskit.rules.consistency.pipeline_problems`,
    with the trainer's partition method). The padded vocabulary needs no rule: a resume pads it to a multiple of the new
    TP (:func:`opskit.rules.model_size.resumed_padded_vocab_size`)."""
    if small := [f"{what.upper()}={value} must be at least 1" for what, value in vars(target).items() if value < 1]:
        return small
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size
    method = getattr(args, "pp_partition_method", None) or consistency.TRAINER_PARTITION_METHOD
    return [*consistency.tensor_parallel_problems(args.num_attention_heads, ffn, target.tp, layout_name),
            *consistency.pipeline_problems(args.num_layers, target.pp, method, layout_name)]


@dataclass(frozen=True)
class ReshapeResult:
    """What :func:`reshape_step` did.

    Attributes:
        step: the step (complete). saved: its layout; target: the one asked for.
        universal: the universal folder written or reused; None when the target needs none (``why_not`` says why).
        verified: tensors whose universal fp32 weights equal the step's (:func:`verify_universal`).
        reused: the folder was there already (a finished conversion of this step, by the trainer or an earlier
            reshape). latest: the tag ``latest`` names in the step's checkpoint dir (None: none, or unusable).
    """

    step: StepInfo
    saved: Layout
    target: Layout
    universal: Path | None = None
    verified: int = 0
    reused: bool = False
    why_not: str | None = None
    latest: str | None = None

    @property
    def beside_step(self) -> bool:
        """The folder is the one the trainer reads (``<ckpt>/global_stepN_universal``)."""
        return self.universal == universal_dir(self.step.path)

    def as_json(self) -> dict:
        return {"step": str(self.step.path), "saved": str(self.saved), "target": str(self.target),
                "universal": str(self.universal) if self.universal else None, "verified_tensors": self.verified,
                "reused": self.reused, "converted": self.universal is not None, "why_not": self.why_not,
                "read_by_trainer": self.beside_step, "latest": self.latest}


def reshape_step(step_dir: Path, target: Layout, out: Path | None = None) -> ReshapeResult:
    """Prepare the complete step ``step_dir`` for a resume on ``target`` offline (``opskit ckpt reshape``): check that
    the saved model can run there (:func:`target_problems`) and that DeepSpeed can load the change
    (:func:`needs_conversion`), then write (or reuse) its universal form, verified, at ``out`` (default
    :func:`universal_dir`, the one the trainer reads). Nothing is written when the target needs no conversion (same
    layout, or a DP change of a ZeRO-0 fp32/fp16 step): ``why_not`` says why.

    Raises:
        ReshapeError: an incomplete step, an unreachable target, a change DeepSpeed cannot load, an ``out`` holding
            another step's universal form, a failed conversion or verification.
        OutputRefusedError: ``out`` is a file or a folder opskit did not write (:func:`opskit.fsutil.claim_dir`).
    """
    step_dir = Path(step_dir)
    info = describe_step(step_dir)
    if not info.complete:
        raise ReshapeError(f"{step_dir}: not a complete step ({info.problems[0]})")
    args = load_args(scan_step_dir(step_dir), light=True)
    saved = saved_layout(info)
    if problems := target_problems(args, target):
        raise ReshapeError(f"{step_dir}: cannot run on {target}: {'; '.join(problems)}")
    latest, _ = latest_state(step_dir.parent)
    try:
        convert = needs_conversion(saved, target, args.zero_stage, step_precision(args))
    except ReshapeError as e:
        raise ReshapeError(f"{step_dir}: {e}") from None
    if not convert:
        why = "it was saved on that layout" if saved == target else \
            "ZeRO stage 0 keeps the optimizer unpartitioned in the mp_rank files, which fit any DP size"
        return ReshapeResult(info, saved, target, why_not=f"{why}: the trainer resumes it as it is", latest=latest)
    out = Path(out) if out is not None else universal_dir(step_dir)
    origin = universal_origin(out)
    if origin is not None and origin.get("step") != step_dir.name:
        raise ReshapeError(f"{out}: holds the universal form of {origin.get('step')}, not of {step_dir.name}; "
                           "choose another --out")
    if origin is None:
        claim_dir(out, force=False, flag="--out")
        out.parent.mkdir(parents=True, exist_ok=True)
    universal = convert_to_universal(step_dir, out, verify=True)
    verified = (universal_origin(universal) or {}).get("verified_tensors")
    if verified is None:  # converted by the trainer, which does not verify
        verified = verify_universal(step_dir, universal)
    return ReshapeResult(info, saved, target, universal, verified, reused=origin is not None, latest=latest)


def resume_layout_note(checkpoint_dir: Path, target: Layout) -> str | None:
    """What a job on ``target`` does with the step it resumes from (:func:`opskit.ckpt.format.info.resume_point`) when
    that step was saved on another layout (``opskit submit``); None without a step or without a change.

    Raises:
        ReshapeError: a change the trainer would refuse at start (:func:`needs_conversion`), before anything is
            queued.
    """
    step = resume_point(checkpoint_dir).step
    if step is None or saved_layout(step) == target:
        return None
    args = load_args(scan_step_dir(step.path), light=True)
    head = f"latest checkpoint {step.path.name} was saved at {saved_layout(step)}; this job runs {target}"
    try:
        convert = needs_conversion(saved_layout(step), target, args.zero_stage, step_precision(args))
    except ReshapeError as e:
        raise ReshapeError(f"{step.path}: {e}") from None
    if not convert:
        return f"{head}: it resumes as it is (ZeRO stage 0 keeps the optimizer unpartitioned)"
    universal = universal_dir(step.path)
    if universal_origin(universal) is not None:
        return f"{head}: the trainer reads {universal.name}, already converted"
    return (f"{head}: the trainer converts it to {universal.name} at start (or run `opskit ckpt reshape "
            f"{step.path} --tp {target.tp} --pp {target.pp} --dp {target.dp}` before)")
