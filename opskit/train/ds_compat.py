"""Work-arounds for DeepSpeed defects the trainer meets, each switched on only on the versions that have it.

bf16 + ZeRO-0 on DeepSpeed 0.18.5-0.19.8 (:func:`opskit.rules.deepspeed.bf16_zero0_optimizer_load_broken`): the
engine saves BF16_Optimizer's states in one ``bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt`` per rank, as it
should, but loads them by passing rank 0's copy in ``mp_rank_MM_model_states.pt`` where BF16_Optimizer expects a
list indexed by DP rank (``KeyError: 0``), and from a universal checkpoint not at all (it only loads optimizers for
ZeRO stage >= 1). The trainer then asks the engine for everything but the optimizer and loads BF16_Optimizer's own
states with :func:`load_bf16_zero0_optimizer`, through BF16_Optimizer's public ``load_state_dict``.
docs/deepspeed-bf16-zero0.md has a reproduction for an upstream report.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path


def loads_optimizer_itself(engine) -> bool:
    """Whether this engine's optimizer states must be loaded by :func:`load_bf16_zero0_optimizer` (bf16 + ZeRO-0 on
    an affected DeepSpeed)."""
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from opskit.rules.deepspeed import bf16_zero0_optimizer_load_broken, installed_deepspeed_version

    version = installed_deepspeed_version() or deepspeed.__version__
    return isinstance(engine.optimizer, BF16_Optimizer) and bf16_zero0_optimizer_load_broken(version)


def load_bf16_zero0_optimizer(engine, step_dir: Path, universal: Path | None) -> None:
    """Load this rank's BF16_Optimizer state (fp32 master weights, Adam moments, step) after ``engine.load_checkpoint``
    ran with ``load_optimizer_states=False``: from the step's own shard for this (DP, model-parallel) rank, or cut out
    of the ``universal`` folder for a step saved on another layout; the bf16 weights are then refreshed from the fp32
    master weights (what a universal load takes them from)."""
    import torch

    optimizer = engine.optimizer
    with contextlib.redirect_stdout(sys.stderr):  # BF16_Optimizer prints a line while loading
        if universal is not None:
            optimizer.load_state_dict(None, checkpoint_folder=str(universal))
        else:
            shard = Path(engine._get_zero_ckpt_name(str(step_dir.parent), step_dir.name))
            saved = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            dp_rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
            optimizer.load_state_dict({dp_rank: saved}, load_optimizer_states=True, load_from_fp32_weights=True)
    optimizer.update_lp_params()
