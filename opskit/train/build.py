"""The trainer's builders, each from the :class:`~opskit.train.config.TrainConfig`: the distributed world (torchrun's
ranks, megatron-core's TP/PP groups, the seeds, the agreed start time: :class:`World`) and its teardown; the precision
checks; the DeepSpeed config (the JSON completed by the flags, its curriculum taken out) and the resume plan that
completes it; this rank's pipeline stage of the model; the optimizer over Megatron's weight-decay groups, the LR
schedule and DeepSpeed's pipeline engine.

torch, deepspeed and megatron-core are imported inside the functions: ``python -m opskit.train --help`` needs none.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

from opskit.rules.consistency import (
    TRAINER_PARTITION_METHOD,
    client_optimizer_problems,
    flag_name,
    recomputes_fully,
    world_size_problems,
)
from opskit.rules.deepspeed import (
    Contradiction,
    deepspeed_config,
    deepspeed_version_problem,
    installed_deepspeed_version,
    with_flags,
)
from opskit.rules.model_size import splits_sequence
from opskit.train.config import TrainConfig, TrainerError
from opskit.train.ds_compat import (
    fuse_zero_overflow_check,
    release_last_stage_outputs,
    save_bf16_zero0_optimizer_once,
    skip_inference_shm_op,
)
from opskit.train.schedules import AnnealingLR, SeqlenCurriculum
from opskit.train.state import TrainState


@dataclass(frozen=True)
class World:
    """This process's place in the job: world size = TP * PP * DP."""

    rank: int
    size: int
    tp: int
    pp: int
    dp: int
    start_time: float
    """The earliest trainer start over all ranks (seconds since the epoch): ``--exit-duration-in-mins`` counts from
    it."""

    @property
    def is_last_rank(self) -> bool:
        """The rank that prints Megatron's iteration and validation lines and writes TensorBoard (Megatron's)."""
        return self.rank == self.size - 1


def init_distributed(config: TrainConfig) -> None:
    """torchrun's environment, or a one-process world on a free port when started without a launcher."""
    import deepspeed
    import torch

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = config.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    skip_inference_shm_op()
    deepspeed.init_distributed(dist_backend=backend)


def init_model_parallel(config: TrainConfig) -> World:
    """megatron-core's TP and PP groups for its layers (its rank order, TP fastest, then DP, then PP, is DeepSpeed's
    topology's), the seeds, and the start time every rank agrees on.

    Raises:
        TrainerError: a world size that is not a multiple of TP * PP; a seed NumPy cannot take.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, size = dist.get_rank(), dist.get_world_size()
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    if problems := world_size_problems(size, tp, pp, flag_name):
        raise TrainerError(problems[0])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _set_random_seed(config.seed, parallel_state.get_pipeline_model_parallel_rank(), pp)
    return World(rank=rank, size=size, tp=tp, pp=pp, dp=size // (tp * pp),
                 start_time=_agreed_start_time(config.start_time))


def _set_random_seed(seed: int, pipeline_rank: int, pipeline_size: int) -> None:
    """Megatron's ``_set_random_seed``: Python's, NumPy's and torch's global generators from ``seed + 100 *
    pipeline_rank``, so the TP and DP ranks of a stage hold equal RNG states (``ckpt check`` compares the saved ones)
    and the stages differ. Called before the model is built; the layers then reseed torch per layer (pipe.py), so the
    weights and the losses do not depend on it.

    Raises:
        TrainerError: a seed NumPy cannot take on every stage (Megatron asks for a positive integer).
    """
    import numpy as np
    import torch

    bound = 2**32 - 100 * (pipeline_size - 1)  # NumPy takes seeds below 2**32
    if not 0 < seed < bound:
        raise TrainerError(f"--seed {seed}: expected a positive integer below {bound} (stage s is seeded with "
                           "seed + 100 * s)")
    stage_seed = seed + 100 * pipeline_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)


def _agreed_start_time(start_time: float) -> float:
    """Megatron takes the earliest start over all ranks, so every rank agrees on when to stop."""
    import torch
    import torch.distributed as dist

    start = torch.tensor([start_time], dtype=torch.float64, device=rank_device())
    dist.all_reduce(start, op=dist.ReduceOp.MIN)
    return float(start.item())


def rank_device():
    """This rank's GPU, else the CPU: where small all-reduce tensors live (NCCL only reduces GPU tensors, gloo CPU
    ones) and where micro-batches are copied ahead of the pipeline engine."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def destroy_distributed() -> None:
    """megatron-core's groups and the process groups, where they exist (DeepSpeed 0.19.8 may SIGABRT at exit
    without)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_precision(config: TrainConfig) -> None:
    """Refuse, in one line, the precisions DeepSpeed would fail on later with a traceback.

    Raises:
        TrainerError: ``--fp16`` on an accelerator without fp16 (DeepSpeed's CPU accelerator has it only where oneDNN
            does: CPUs with AVX512-FP16 / AMX-FP16); resuming a checkpoint that this DeepSpeed version cannot resume
            (:func:`opskit.rules.deepspeed.deepspeed_version_problem`: ``--bf16 --zero-stage 0`` on 0.18.0-0.19.8).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if config.fp16 and not accelerator.is_fp16_supported():
        raise TrainerError(f"--fp16: DeepSpeed {deepspeed.__version__} does not support fp16 on this "
                           f"{accelerator.device_name()} accelerator; use --bf16 (or a GPU)")
    version = installed_deepspeed_version() or deepspeed.__version__
    problem = deepspeed_version_problem(config.params_dtype, config.zero_stage, config.pipeline_model_parallel_size,
                                        config.clip_grad, version, flag_name)
    if problem and problem.resume_only and config.load and (Path(config.load) / "latest").exists():
        raise TrainerError(f"--load {config.load} has a checkpoint: {problem.message}")


def build_deepspeed_config(config: TrainConfig, global_batch_size: int) -> dict:
    """The DeepSpeed config: ``--deepspeed_config``'s JSON completed with what the flags imply
    (:func:`opskit.rules.deepspeed.with_flags`; the JSON the job script carries comes back unchanged), or only
    those without the flag. ``global_batch_size`` is the first iteration's (the ramp-up changes it every few
    iterations; DeepSpeed starts from it).

    Raises:
        TrainerError: when the JSON is unreadable or contradicts a flag (it names both); ``--use-bnb-optimizer``
            under ZeRO without ``zero_allow_untested_optimizer`` (rules.consistency.client_optimizer_problems).
    """
    loaded: dict = {}
    if path := config.deepspeed_config:
        try:
            loaded = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TrainerError(f"--deepspeed_config {path}: not a readable JSON file ({e})") from None
    implied = deepspeed_config(micro_batch_size=config.micro_batch_size, train_batch_size=global_batch_size,
                               clip_grad=config.clip_grad, zero_stage=config.zero_stage, precision=config.params_dtype)
    try:
        merged = with_flags(loaded, implied)
    except Contradiction as e:
        raise TrainerError(f"--deepspeed_config {config.deepspeed_config}: {e}") from None
    if problems := client_optimizer_problems(config.use_bnb_optimizer, config.zero_stage,
                                             merged.get("zero_allow_untested_optimizer"), flag_name):
        raise TrainerError(problems[0])
    return merged


def pop_curriculum(ds_config: dict, config: TrainConfig) -> SeqlenCurriculum | None:
    """The DeepSpeed JSON's top-level ``curriculum_learning`` block (BigScience's format), taken out of
    ``ds_config``: DeepSpeed 0.19 refuses that key, and under its pipeline engine Megatron-DeepSpeed ran the schedule
    itself anyway.

    Returns:
        A :class:`~opskit.train.schedules.SeqlenCurriculum`, or None when the block is absent or not enabled.

    Raises:
        TrainerError: a block DeepSpeed's scheduler cannot run (names the key).
    """
    block = ds_config.pop("curriculum_learning", None)
    if not block or not block.get("enabled", False):
        return None
    try:
        return SeqlenCurriculum(block, config.seq_length)
    except ValueError as e:
        raise TrainerError(f"--deepspeed_config {config.deepspeed_config}: {e}") from None


def build_model(config: TrainConfig, world: World, padded_vocab_size: int):
    """This rank's pipeline stage of the GPT/BLOOM model (a DeepSpeed ``PipelineModule``) with ``padded_vocab_size``
    rows in its word embedding, on the GPU if there is one."""
    import torch

    from opskit.train.model import GPTConfig
    from opskit.train.pipe import GPTModelPipe, compile_stage, make_topology

    cfg = GPTConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size, seq_length=config.seq_length,
        max_position_embeddings=config.max_position_embeddings, padded_vocab_size=padded_vocab_size,
        position_embedding_type=config.position_embedding_type, embed_layernorm=config.embed_layernorm,
        stable_embedding=config.use_bnb_optimizer,
        init_method_std=config.init_method_std, hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout, tensor_parallel=True,
        sequence_parallel=splits_sequence(config.sequence_parallel, world.tp),
        selective_recompute=config.recompute_granularity == "selective",
    )
    model = GPTModelPipe(cfg, make_topology(world.tp, world.pp, world.dp), seed=config.seed,
                         activation_checkpoint_interval=1 if recomputes_fully(config.checkpoint_activations,
                                                                             config.recompute_granularity) else 0,
                         partition_method=config.pp_partition_method or TRAINER_PARTITION_METHOD)
    if config.torch_compile:
        compile_stage(model)
    if torch.cuda.is_available():
        model.cuda()  # before the optimizer: fused AdamW wants its parameters on the GPU already
    return model


def param_groups(model) -> list[dict]:
    """Megatron's weight-decay rule: no decay for biases and LayerNorm parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name or param.ndim == 1 else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(config: TrainConfig, model):
    """Adam with decoupled weight decay (Megatron's ``--optimizer adam``: apex's FusedAdam in AdamW mode) over
    Megatron's weight-decay groups: torch's AdamW, or with ``--use-bnb-optimizer`` bitsandbytes' Adam8bit (its
    weight decay is decoupled too) with the same groups and hyperparameters. As in Megatron-DeepSpeed, the word
    embedding's states stay 32-bit under bitsandbytes (StableEmbedding); parameters below bitsandbytes'
    ``min_8bit_size`` (4096 elements: LayerNorms, biases) keep 32-bit states as well. That holds where DeepSpeed
    hands the optimizer the model's own parameters (fp32 with ZeRO-0); under ZeRO-1, or fp16 / bf16, it steps flat
    fp32 partitions instead, so every state is 8-bit there, as in Megatron-DeepSpeed's BigScience runs."""
    import torch

    hyper = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                 weight_decay=config.weight_decay)
    if not config.use_bnb_optimizer:
        return torch.optim.AdamW(param_groups(model), **hyper,
                                 fused=torch.cuda.is_available())  # one kernel per step on GPUs
    import bitsandbytes as bnb

    from opskit.train.pipe import word_embeddings

    manager = bnb.optim.GlobalOptimManager.get_instance()
    for embedding in word_embeddings(model):  # looked up by parameter identity at the first step
        manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    return bnb.optim.Adam8bit(param_groups(model), **hyper)


def build_engine(config: TrainConfig, model, ds_config: dict, rampup, state: TrainState):
    """The optimizer (:func:`build_optimizer`), Megatron's LR schedule in samples (its step is the ramp-up's batch
    at ``state``'s consumed samples; ``--lr-decay-tokens`` reads ``state``'s consumed tokens), and DeepSpeed's
    pipeline engine over them. The optimizer is a client optimizer: DeepSpeed builds none of its own (the config
    has no ``optimizer`` block).

    Returns:
        ``(engine, optimizer)``: the optimizer is the torch one, whose ``param_groups`` carry the current LR.
    """
    import deepspeed

    optimizer = build_optimizer(config, model)
    scheduler = AnnealingLR(
        optimizer, max_lr=config.lr, min_lr=config.min_lr, warmup_steps=config.lr_warmup_samples,
        decay_steps=config.lr_decay_samples, decay_style=config.lr_decay_style,
        step_size=lambda: rampup.batch_size(state.consumed_train_samples),
        override=config.override_lr_scheduler, use_checkpoint=config.use_checkpoint_lr_scheduler,
        decay_tokens=config.lr_decay_tokens, consumed_tokens=lambda: state.consumed_train_tokens,
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    fuse_zero_overflow_check(engine.optimizer)
    release_last_stage_outputs(engine)
    save_bf16_zero0_optimizer_once(engine)
    return engine, optimizer
