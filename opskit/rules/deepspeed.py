"""The DeepSpeed config a training runs with, and the DeepSpeed versions that cannot run a layout: one builder for the
JSON the job script carries (``opskit.submission.render``) and the config the trainer hands to ``deepspeed.initialize``.

Values are BigScience's (the tr1-13B / tr11-176B-ml job scripts' heredoc): the fp16 block with dynamic loss scaling
from 2^12, ``steps_per_print`` 2000 (the trainer prints Megatron's own lines anyway), no wall-clock breakdown; plus
two speed settings measured on tr11's layout (:data:`BF16_BLOCK`, :data:`PIPELINE_BLOCK`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from opskit.errors import OpskitError
from opskit.rules.consistency import Namer

FP16_BLOCK = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
              "initial_scale_power": 12}
"""BigScience's fp16 block: dynamic loss scaling (loss_scale 0) from 2^12, halved on an overflow, doubled after 500
clean steps (tr1-13B, tr8-104B)."""

BF16_BLOCK = {"enabled": True, "immediate_grad_update": True}
"""bf16 with DeepSpeed's BF16_Optimizer (ZeRO-0) adding each parameter's 16-bit gradient into its fp32 buffer as soon
as backward produces it, and freeing it: off (DeepSpeed 0.19's default), every parameter's 16-bit gradient lives
until the step (2 bytes per parameter) and the pipeline engine adds them all after each micro-batch in a Python loop.
Measured at TP2 x PP2 on 4 H100s (docs/benchmarks.md#tr11s-layout-on-4-gpus): 3.3% faster per iteration, 3 GiB
less per GPU."""

PIPELINE_BLOCK = {"pipe_partitioned": False, "grad_partitioned": False}
"""Pipeline stages send whole activations and gradients at TP > 1. DeepSpeed's default sends each TP rank a
``1/TP`` slice and all-gathers it on arrival, and describes each slice with a tensor built on the host: a blocking
copy that drains the sender's GPU queue at every micro-batch (bench/sync_points.py: one per micro-batch on every
stage, the only per-micro-batch synchronization of the trainer). The whole tensor costs TP times the p2p bytes: at
tr11's MBS 2 x 2048 x 14336 in bf16, 117 MB per micro-batch, ~5 ms at 25 GB/s across nodes, against seconds of
compute per micro-batch on a stage."""

FLAG_KEYS = (("train_micro_batch_size_per_gpu",), ("gradient_clipping",), ("zero_optimization", "stage"),
             ("fp16", "enabled"), ("bf16", "enabled"))
"""Keys of the JSON that trainer flags own (``--micro-batch-size``, ``--clip-grad``, ``--zero-stage``, ``--fp16``,
``--bf16``): a JSON may repeat them, never contradict them."""


def deepspeed_config(*, micro_batch_size: int, train_batch_size: int, clip_grad: float, zero_stage: int,
                     precision: str, curriculum: dict | None = None) -> dict:
    """The DeepSpeed config of a training.

    Args:
        train_batch_size: the first iteration's global batch size: a ramp-up's start (DeepSpeed must start there;
            the trainer then sets the GBS of every iteration with ``engine.set_train_batch_size``), else the GBS.
        precision: ``fp32``, ``fp16`` or ``bf16``; only the active precision's block is written
            (:data:`FP16_BLOCK`, :data:`BF16_BLOCK`). A ``--deepspeed_config`` JSON with its own block keeps it
            (:func:`with_flags`): a bf16 block without ``immediate_grad_update`` keeps 16-bit gradients.
        curriculum: the top-level ``curriculum_learning`` block (BigScience's tr8b-104B-cl format), or None.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": train_batch_size,
        "gradient_clipping": clip_grad,
        "zero_optimization": {"stage": zero_stage},
    }
    if precision == "fp16":
        config["fp16"] = dict(FP16_BLOCK)
    elif precision == "bf16":
        config["bf16"] = dict(BF16_BLOCK)
    if curriculum is not None:
        config["curriculum_learning"] = curriculum
    config.update(pipeline=dict(PIPELINE_BLOCK), steps_per_print=2000, wall_clock_breakdown=False)
    return config


class Contradiction(OpskitError, ValueError):
    """A JSON key that contradicts a flag; the message is ``KEY is X but the flags say Y`` (KEY dotted)."""

    def __init__(self, key: str, in_json: Any, from_flags: Any):
        super().__init__(f"{key} is {in_json} but the flags say {from_flags}")


def with_flags(config: dict, implied: dict) -> dict:
    """A DeepSpeed JSON read from a file (``--deepspeed_config``) completed with what the flags imply
    (:func:`deepspeed_config`): the flag-owned keys (:data:`FLAG_KEYS`) are added where missing, the other top-level
    keys where absent, and ``train_batch_size`` is always the flags' (the ramp-up's start). A JSON written by
    :func:`deepspeed_config` from the same settings comes back unchanged.

    Raises:
        Contradiction: the first flag-owned key whose JSON value differs from the flags'.
    """
    for path in FLAG_KEYS:
        from_flags = _lookup(implied, path, False)  # an absent precision block means "not enabled"
        in_json = _lookup(config, path, _MISSING)
        if in_json is not _MISSING and in_json != from_flags:
            raise Contradiction(".".join(path), in_json, from_flags)
    merged = copy.deepcopy(config)
    for key, value in implied.items():
        if key == "train_batch_size" or key not in merged:
            merged[key] = value
        elif isinstance(value, dict) and isinstance(merged[key], dict):  # e.g. zero_optimization without its stage
            owned = {sub: v for sub, v in value.items() if (key, sub) in FLAG_KEYS}
            merged[key] = {**owned, **merged[key]}
    return merged


_MISSING = object()


def _lookup(config: Any, path: tuple[str, ...], default: Any) -> Any:
    for part in path:
        if not isinstance(config, dict) or part not in config:
            return default
        config = config[part]
    return config


# --------------------------------------------------------------------------- versions


def installed_deepspeed_version() -> str | None:
    """The DeepSpeed version installed here (package metadata, without importing it), or None."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """``0.19.8+cpu`` -> ``(0, 19, 8)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


@dataclass(frozen=True)
class VersionProblem:
    """Why a DeepSpeed version cannot run a layout: ``message`` names the settings; ``resume_only`` when only
    resuming a checkpoint fails (a fresh run trains and saves)."""

    message: str
    resume_only: bool


def bf16_zero0_optimizer_load_broken(version: str) -> bool:
    """DeepSpeed 0.18.5-0.19.8 hands BF16_Optimizer.load_state_dict (bf16 + ZeRO-0) the saved dict where it expects
    one state per DP rank, and fails every resume with ``KeyError: 0`` (deepspeedai/DeepSpeed#7786 restored the load
    in 0.18.5; measured on 0.19.8). opskit's trainer loads those states itself on these versions
    (opskit.train.ds_compat)."""
    return (0, 18, 5) <= version_tuple(version) <= (0, 19, 8)


def bf16_zero0_optimizer_saved_twice(version: str) -> bool:
    """DeepSpeed 0.18.5-0.19.8 saves BF16_Optimizer's states (bf16 + ZeRO-0) twice: in its own
    ``bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt`` shards and, DP rank 0's part again, as the ``optimizer`` of each
    ``mp_rank_MM_model_states.pt`` (fp32 master weights and Adam's moments, 12 / DP bytes per parameter once more:
    a step of 14 bytes per parameter weighs 26 at DP=1). deepspeedai/DeepSpeed#7786
    (0.18.5) changed ``_save_checkpoint``'s ``zero_optimizer_state = zero_optimization() or bfloat16_enabled()`` to
    ``zero_optimization()`` in the same commit as the load of :func:`bf16_zero0_optimizer_load_broken`, hence the same
    versions (read in engine.py at v0.18.4, v0.18.5 and v0.19.5, measured on 0.19.8). opskit's trainer saves them
    once, in the shards, as Megatron-DeepSpeed's BLOOM checkpoints have them (opskit.train.ds_compat)."""
    return bf16_zero0_optimizer_load_broken(version)  # one change made both


def deepspeed_version_problem(precision: str, zero_stage: int, pp: int, clip_grad: float, version: str,
                              name: Namer) -> VersionProblem | None:
    """Why this DeepSpeed version cannot resume (or clips wrongly) a run of this precision / ZeRO stage / PP, or None.
    opskit's trainer, like Megatron-DeepSpeed, always runs DeepSpeed's pipeline engine, so these hold at any PP unless
    said otherwise.

    - bf16 + ZeRO-0, DeepSpeed 0.18.0-0.18.4: 0.18.0 (PR #7586) stopped loading ZeRO checkpoint files when ZeRO is
      off, while bf16 still saved its optimizer states into them (BF16_Optimizer, which the pipeline engine uses for
      bf16 + ZeRO-0, as BLOOM-176B did), so every resume silently restarted Adam. Read from deepspeedai/DeepSpeed's
      engine.py at v0.17.6, v0.18.0, v0.18.4 and v0.18.5.
    - bf16 + ZeRO-0, DeepSpeed 0.18.5-0.19.8: not a problem for opskit's trainer, which loads those states itself
      there (:func:`bf16_zero0_optimizer_load_broken`).
    - fp32 / fp16 + ZeRO-0 + PP > 1 with gradient clipping, DeepSpeed 0.19.x: the clipping norm counts pipeline stage
      0's gradients only, so every other stage clips with the wrong factor (measured on 0.19.8 in fp32, tests of
      test_train.py; fp16 could not run on a CPU; bf16 clips right).
    """
    if zero_stage != 0:
        return None
    parsed = version_tuple(version)
    settings = f"{name('precision', precision)} with {name('zero_stage', 0)}"
    fix = f"use {name('zero_stage', 1)}, or DeepSpeed <= 0.17.x"
    if precision == "bf16" and (0, 18, 0) <= parsed < (0, 18, 5):
        return VersionProblem(f"{settings} on DeepSpeed {version} saves the optimizer states but never loads them "
                              "back (DeepSpeed 0.18.0-0.18.4; deepspeedai/DeepSpeed#7786), so every resume restarts "
                              f"Adam from zero: {fix}", resume_only=True)
    if precision != "bf16" and pp > 1 and clip_grad > 0 and (0, 19, 0) <= parsed < (0, 20, 0):
        return VersionProblem(f"{settings} and {name('pipeline_model_parallel_size', pp)} clips gradients with "
                              f"pipeline stage 0's norm only on DeepSpeed {version} (0.19.x): use "
                              f"{name('zero_stage', 1)}, or {name('clip_grad', 0)}", resume_only=False)
    return None
