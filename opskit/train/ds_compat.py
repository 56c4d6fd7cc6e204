"""Work-arounds for DeepSpeed defects the trainer meets: the optimizer-state load and save only on the versions that
have those defects; the two changes to the training step (same results, less time and memory) wherever the method they
replace exists.

bf16 + ZeRO-0 on DeepSpeed 0.18.5-0.19.8 (:func:`opskit.rules.deepspeed.bf16_zero0_optimizer_load_broken`): the
engine saves BF16_Optimizer's states in one ``bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt`` per rank, as it
should, but loads them by passing rank 0's copy in ``mp_rank_MM_model_states.pt`` where BF16_Optimizer expects a
list indexed by DP rank (``KeyError: 0``), and from a universal checkpoint not at all (it only loads optimizers for
ZeRO stage >= 1). The trainer then asks the engine for everything but the optimizer and loads BF16_Optimizer's own
states with :func:`load_bf16_zero0_optimizer`, through BF16_Optimizer's public ``load_state_dict``.
docs/deepspeed-bf16-zero0.md has a reproduction for an upstream report.

The same versions save BF16_Optimizer's states twice (:func:`save_bf16_zero0_optimizer_once`): in its shards and
again in each ``mp_rank_MM_model_states.pt``. The trainer has the engine save them once, in the shards, as
Megatron-DeepSpeed's BLOOM checkpoints have them; steps saved with the extra copy still load (the copy is never read).

ZeRO-1/2's inf/NaN check before each optimizer step (:func:`fuse_zero_overflow_check`): DeepSpeed 0.19.8 tests each
gradient on its own (amax, amin, two isfinite, and, not, add: ~7 kernel launches a parameter, ~2,000 for a 24-layer
GPT) while the GPU waits on the result; one multi-tensor norm gives the same answer in a few launches.

The pipeline engine's last stage keeps each micro-batch's output, the logits, in its buffer after that micro-batch's
backward, until the next forward replaces it (:func:`release_last_stage_outputs`): two micro-batches' logits are then
alive at the next forward's peak.

On CPUs DeepSpeed's communication backend JIT-loads its shared-memory all-reduce op at start-up
(:func:`skip_inference_shm_op`) under torch's lock file in ``TORCH_EXTENSIONS_DIR``: a process killed in that window
(a cancelled job, a killed test) leaves the lock, and every later start on that home folder waits on it for ever.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path


def _bf16_zero0_affected(engine, defect) -> bool:
    """Whether this engine runs BF16_Optimizer (bf16 + ZeRO-0) on a DeepSpeed version for which ``defect`` (a rule of
    :mod:`opskit.rules.deepspeed`, taking the version) holds."""
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from opskit.rules.deepspeed import installed_deepspeed_version

    version = installed_deepspeed_version() or deepspeed.__version__
    return isinstance(engine.optimizer, BF16_Optimizer) and defect(version)


def loads_optimizer_itself(engine) -> bool:
    """Whether this engine's optimizer states must be loaded by :func:`load_bf16_zero0_optimizer` (bf16 + ZeRO-0 on
    an affected DeepSpeed)."""
    from opskit.rules.deepspeed import bf16_zero0_optimizer_load_broken

    return _bf16_zero0_affected(engine, bf16_zero0_optimizer_load_broken)


def save_bf16_zero0_optimizer_once(engine) -> bool:
    """Make this engine leave BF16_Optimizer's states out of ``mp_rank_MM_model_states.pt``: they are in its
    ``bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt`` shards already (bf16 + ZeRO-0 on an affected DeepSpeed,
    :func:`opskit.rules.deepspeed.bf16_zero0_optimizer_saved_twice`).

    DeepSpeed 0.19.8's ``_save_checkpoint`` (engine.py:5381) passes ``zero_optimizer_state = zero_optimization()``,
    False at stage 0, to ``_common_checkpoint_state`` (engine.py:5017), which then stores ``optimizer.state_dict()``
    (engine.py:5020) beside the shards ``save_checkpoint`` writes for any optimizer with a ``dp_process_group``
    (engine.py:1916-1921, 4933). Here ``_common_checkpoint_state`` is called with it True, as up to 0.18.4
    (``zero_optimization() or bfloat16_enabled()``): ``optimizer`` None, and the ``param_shapes`` and
    ``shared_params`` that ``ds_to_universal`` reads, Megatron-DeepSpeed's layout (BLOOM's checkpoints). Nothing
    read that copy: its load is the one these versions break (:func:`loads_optimizer_itself`). Only this engine
    object changes.

    Returns:
        Whether the engine was changed (False for other optimizers and DeepSpeed versions).
    """
    from opskit.rules.deepspeed import bf16_zero0_optimizer_saved_twice

    if not _bf16_zero0_affected(engine, bf16_zero0_optimizer_saved_twice):
        return False
    common_state = engine._common_checkpoint_state

    def common_state_without_optimizer(module_state_dict, zero_optimizer_state, save_frozen_param):
        return common_state(module_state_dict, True, save_frozen_param)

    engine._common_checkpoint_state = common_state_without_optimizer
    return True


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


def skip_inference_shm_op() -> None:
    """Make DeepSpeed's ``TorchBackend`` start without its shared-memory all-reduce op. DeepSpeed 0.19.8 loads it on
    CPU accelerators for ``inference_all_reduce`` only (training's collectives are torch.distributed's), through torch's
    ``cpp_extension.load``, which takes the lock file ``deepspeed_shm_comm/lock`` of ``TORCH_EXTENSIONS_DIR``
    (``~/.cache/torch_extensions``) even when the op is built already and waits, without a limit, while that file
    exists: a process killed holding it hung every later trainer start on the machine. Call before
    ``deepspeed.init_distributed``; a no-op on versions without ``build_shm_op``."""
    import importlib

    # by name: the package deepspeed.comm exports the torch module itself under the same attribute
    backend_module = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend_module, "build_shm_op"):
        backend_module.build_shm_op = lambda: None


def fuse_zero_overflow_check(optimizer) -> bool:
    """Give this engine's ZeRO-1/2 optimizer (DeepSpeed's ``DeepSpeedZeroOptimizer``) a check for inf/NaN gradients
    that launches a few multi-tensor kernels instead of ~7 per parameter: ``torch.nn.utils.get_total_norm`` with the
    infinity norm over the partition's gradients is NaN or inf exactly when one of them holds a NaN or an infinity
    (the max of absolute values propagates both). Same result as DeepSpeed's ``has_overflow_partitioned_grads_serial``
    (a ``[1]``-shaped bool tensor on the device); only this optimizer object changes.

    Returns:
        Whether the check was replaced (False for other optimizers, and for DeepSpeed versions without that method).
    """
    import math
    import types

    import torch

    if not hasattr(optimizer, "has_overflow_partitioned_grads_serial") or not hasattr(optimizer, "averaged_gradients"):
        return False

    def has_overflow_partitioned_grads_serial(self):
        grads = [grad for i in range(len(self.bit16_groups)) for grad in self.averaged_gradients[i] or ()
                 if grad is not None and grad.numel()]  # the infinity norm of an empty tensor is undefined
        if not grads:
            return torch.zeros(1, dtype=torch.bool, device=self.device)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=math.inf, foreach=True)
        return norm.isfinite().logical_not().reshape(1)

    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(has_overflow_partitioned_grads_serial,
                                                                         optimizer)
    return True


def release_last_stage_outputs(engine) -> bool:
    """Make this pipeline engine drop the last stage's output (the logits, ``[b, s, V_pad / TP]``) from its buffer once
    the micro-batch's backward has run. DeepSpeed 0.19.8's ``_exec_backward_pass`` returns early on the last stage and
    leaves ``pipe_buffers['outputs']`` set, so the logits outlive their backward until the next forward's result
    replaces them, at that forward's memory peak: 3.07 GiB at MBS 16, seq 2048 and 50,304 bf16 logits, enough to put
    the 1.3B GPT-2 shape out of an 80 GB GPU at MBS 16 with several micro-batches. Nothing reads the entry again
    (the last stage sends no activations). Only this engine object changes.

    Returns:
        Whether the engine's instruction map was changed (False when it has no ``BackwardPass`` entry).
    """
    from deepspeed.runtime.pipe import schedule

    instructions = getattr(type(engine), "_INSTRUCTION_MAP", {})
    backward = instructions.get(schedule.BackwardPass)
    if backward is None:
        return False

    def backward_then_release(self, buffer_id):
        backward(self, buffer_id)
        if self.is_last_stage():
            self.pipe_buffers["outputs"][buffer_id] = None

    engine._INSTRUCTION_MAP = {**instructions, schedule.BackwardPass: backward_then_release}
    return True
