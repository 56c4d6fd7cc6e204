"""Entry point of ``python -m opskit.train``: parse, build, train, close.

:func:`train` builds the run in a fixed order: 1. distributed (torchrun's world, megatron-core's TP/PP groups, seeds)
-> 2. tokenizer (vocab size) -> 3. model on its pipeline stage -> 4. optimizer, LR schedule and DeepSpeed engine ->
5. resume -> 6. data -> 7. logging; then :class:`Trainer` trains over its :class:`~opskit.train.state.TrainState`, and
a ``finally`` closes TensorBoard and CodeCarbon and destroys the process groups, also when training raises. Every rank
runs the same loop; the last rank prints Megatron's log lines.

Run with ``torchrun --nproc_per_node N -m opskit.train ...``, or as one process without a launcher.

Environment: ``OPSKIT_REHEARSAL_MINUTES_PER_ITERATION=M`` (set by ``opskit rehearse`` in the job's ``slurm.env``)
replaces wall time in the ``--exit-duration-in-mins`` test by a simulated clock, M minutes per iteration this process
trained, so a rehearsal stops on a production exit duration at a known iteration; the rest of the exit path (the
all-reduce over ranks, the save, the exit line) is the real one.
"""

from __future__ import annotations

import time

# Megatron measures --exit-duration-in-mins from the import of its training module: start the clock before the slow
# imports, since they count against the SLURM time limit too.
_TRAIN_START_TIME = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime  # noqa: E402
from pathlib import Path  # noqa: E402

from opskit.fsutil import atomic_write_text  # noqa: E402
from opskit.rules.checks import (  # noqa: E402
    TRAINER_PARTITION_METHOD,
    client_optimizer_problems,
    flag_name,
    world_size_problems,
)
from opskit.rules.deepspeed import (  # noqa: E402
    Contradiction,
    deepspeed_config,
    deepspeed_version_problem,
    installed_deepspeed_version,
    with_flags,
)
from opskit.rules.formats import parse_data_path  # noqa: E402
from opskit.rules.model import VocabPaddingError, megatron_flops_per_iteration, padded_vocab_size  # noqa: E402
from opskit.train import REHEARSAL_CLOCK_ENV  # noqa: E402
from opskit.train.args import parse_args  # noqa: E402
from opskit.train.ds_compat import (  # noqa: E402
    fuse_zero_overflow_check,
    release_last_stage_outputs,
    skip_inference_shm_op,
)
from opskit.train.fault import inject_test_fault  # noqa: E402
from opskit.train.log import (  # noqa: E402  (torch-free: torch is imported where it is used)
    IntervalStats,
    TensorBoard,
    current_loss_scale,
    iteration_line,
    memory_line,
    print_datetime,
    validation_lines,
)
from opskit.train.schedules import AnnealingLR, SeqlenCurriculum  # noqa: E402
from opskit.train.stacks import arm_stack_dump, disarm_stack_dump  # noqa: E402
from opskit.train.state import TrainState  # noqa: E402


class TrainerError(RuntimeError):
    """Bad input found at run time (data, tokenizer, checkpoint, DeepSpeed config); printed as one line."""


class _ExitRequests:
    """SIGUSR1 (sent by SLURM ``--signal=B:USR1@N`` through the job script) asks for save-and-exit."""

    def __init__(self):
        self.usr1 = False
        signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_usr1(self, signum, frame):
        self.usr1 = True


def main(argv: list[str] | None = None) -> int:
    # One write per line: under PYTHONUNBUFFERED print() writes text and newline separately, and two ranks sharing
    # torchrun's stdout then splice lines (rank 0's "saving checkpoint ..." glued to the last rank's iteration line).
    if hasattr(sys.stdout, "reconfigure"):  # a real text stream (not a test's capture object)
        sys.stdout.reconfigure(write_through=False, line_buffering=True)
    args = parse_args(argv)
    if missing := _missing_extra(args):
        print(f"error: {missing}", file=sys.stderr, flush=True)
        return 2
    exit_requests = _ExitRequests()
    from opskit.train.checkpointing import CheckpointError

    try:
        return train(args, exit_requests)
    except (TrainerError, CheckpointError) as e:
        # one write per line: every rank of a job prints the same error, and two ranks' print() calls (text, then
        # newline) would splice their lines on torchrun's shared stderr
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 2


def _missing_extra(args: argparse.Namespace) -> str | None:
    """Why the trainer's own packages (the ``train`` extra), or those its flags ask for (``--use-bnb-optimizer``:
    bitsandbytes, the ``bnb`` extra), cannot be imported here, in one line; None when they can. Flags are parsed
    first, so ``--help`` and flag errors need none of them (a login node without torch)."""
    import importlib

    from opskit.train import REQUIRED_MODULES

    for module in REQUIRED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return (f"the trainer cannot import {module} ({' '.join(str(e).split())}): pip install 'opskit[train]' "
                    "(torch first: the README says which build)")
    if args.use_bnb_optimizer:
        # its CPU backend warns at import about a 4-bit matmul kernel package that 8-bit Adam does not use
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        try:
            importlib.import_module("bitsandbytes")
        except ImportError:
            return "--use-bnb-optimizer needs bitsandbytes: pip install bitsandbytes"
    return None


def _init_distributed(args: argparse.Namespace) -> None:
    """torchrun's environment, or a one-process world on a free port when started without a launcher."""
    import deepspeed
    import torch

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    skip_inference_shm_op()
    deepspeed.init_distributed(dist_backend=backend)


def _padded_vocab(args: argparse.Namespace, vocab_size: int) -> int:
    """Megatron's padding (:func:`opskit.rules.model.padded_vocab_size`): ``--pad-vocab-size-to`` or up to a
    multiple of make_vocab_size_divisible_by * TP.

    Raises:
        TrainerError: ``--pad-vocab-size-to`` below the tokenizer's vocabulary.
    """
    try:
        return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
                                 args.pad_vocab_size_to)
    except VocabPaddingError as e:
        raise TrainerError(f"--pad-vocab-size-to {e}") from None


def _check_data_files(args: argparse.Namespace) -> None:
    """megatron-core only asserts on a missing or empty dataset (and its ``__del__`` then prints a traceback): check
    first."""
    if args.data_path is None:  # (flag naming the file, prefix) of every weighted group entry
        sources = [(f"{flag} {path}", prefix) for flag, path in (
            ("--train-weighted-split-paths-path", args.train_weighted_split_paths_path),
            ("--valid-weighted-split-paths-path", args.valid_weighted_split_paths_path))
            for _, entries in _weighted_split_groups(flag, path) for *_, prefix in entries]
    else:
        sources = [(f"--data-path {prefix} (--split {args.split}, train)", prefix)
                   for _, prefix in parse_data_path(args.data_path)]
    for where, prefix in sources:
        for suffix in (".idx", ".bin"):
            file = Path(prefix + suffix)
            if not file.is_file():
                raise TrainerError(f"{where}: no {file}")
            if file.stat().st_size == 0:  # megatron-core's mmap fails, and its __del__ prints tracebacks
                raise TrainerError(f"{where}: {file} is empty (no documents)")


def _load_vocab_size(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary size (Megatron's ``tokenizer.vocab_size``, before padding): a PretrainedFromHF
    folder's ``tokenizer.json``, or GPT-2's BPE files (``--vocab-file`` + ``--merge-file``, 50257 for GPT-2's own)."""
    from tokenizers import Tokenizer

    if args.tokenizer_type == "GPT2BPETokenizer":
        from tokenizers.models import BPE

        for flag, file in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not Path(file).is_file():
                raise TrainerError(f"{flag} {file}: no such file")
        try:
            return Tokenizer(BPE.from_file(args.vocab_file, args.merge_file)).get_vocab_size()
        except Exception as e:  # the tokenizers library raises its own untyped errors for bad JSON or merges
            raise TrainerError(f"--vocab-file {args.vocab_file} / --merge-file {args.merge_file}: not GPT-2 BPE "
                               f"files ({e})") from None
    name = args.tokenizer_name_or_path
    path = Path(name) / "tokenizer.json"
    if not path.is_file() and not Path(name).is_dir():
        path = _hub_tokenizer_file(name)
    if not path.is_file():
        raise TrainerError(f"--tokenizer-name-or-path {name}: no tokenizer.json there")
    return Tokenizer.from_file(str(path)).get_vocab_size()


def _hub_tokenizer_file(name: str) -> Path:
    """``tokenizer.json`` of a Hugging Face Hub tokenizer (tr11's ``bigscience-catalogue-data-dev/...``), from the
    Hugging Face cache or downloaded into it (``HF_HUB_OFFLINE=1`` on nodes without internet; ``HF_TOKEN`` or
    ``huggingface-cli login`` for private ones).

    Raises:
        TrainerError: when it is neither a local folder nor a Hub tokenizer that can be had.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        return Path(hf_hub_download(repo_id=name, filename="tokenizer.json"))
    except (HFValidationError, EntryNotFoundError, OSError) as e:  # bad id; no such file, no network, not cached
        raise TrainerError(f"--tokenizer-name-or-path {name}: not a local folder, and no tokenizer.json from the "
                           f"Hugging Face Hub or its cache ({type(e).__name__})") from None


def _curriculum(config: dict, args: argparse.Namespace):
    """The DeepSpeed JSON's top-level ``curriculum_learning`` block (BigScience's format), taken out of ``config``:
    DeepSpeed 0.19 refuses that key, and under its pipeline engine Megatron-DeepSpeed ran the schedule itself anyway.

    Returns:
        A :class:`~opskit.train.schedules.SeqlenCurriculum`, or None when the block is absent or not enabled.

    Raises:
        TrainerError: a block DeepSpeed's scheduler cannot run (names the key).
    """

    block = config.pop("curriculum_learning", None)
    if not block or not block.get("enabled", False):
        return None
    try:
        return SeqlenCurriculum(block, args.seq_length)
    except ValueError as e:
        raise TrainerError(f"--deepspeed_config {args.deepspeed_config}: {e}") from None


def _deepspeed_config(args: argparse.Namespace, global_batch_size: int) -> dict:
    """The DeepSpeed config: ``--deepspeed_config``'s JSON completed with what the flags imply
    (:func:`opskit.rules.deepspeed.with_flags`; the JSON the job script carries comes back unchanged), or only
    those without the flag. ``global_batch_size`` is the first iteration's (the ramp-up changes it every few
    iterations; DeepSpeed starts from it).

    Raises:
        TrainerError: when the JSON is unreadable or contradicts a flag (it names both); ``--use-bnb-optimizer``
            under ZeRO without ``zero_allow_untested_optimizer`` (rules.checks.client_optimizer_problems).
    """
    config: dict = {}
    if args.deepspeed_config:
        try:
            config = json.loads(Path(args.deepspeed_config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TrainerError(f"--deepspeed_config {args.deepspeed_config}: not a readable JSON file ({e})") from None
    implied = deepspeed_config(micro_batch_size=args.micro_batch_size, train_batch_size=global_batch_size,
                               clip_grad=args.clip_grad, zero_stage=args.zero_stage, precision=args.params_dtype)
    try:
        merged = with_flags(config, implied)
    except Contradiction as e:
        raise TrainerError(f"--deepspeed_config {args.deepspeed_config}: {e}") from None
    if problems := client_optimizer_problems(args.use_bnb_optimizer, args.zero_stage,
                                             merged.get("zero_allow_untested_optimizer"), flag_name):
        raise TrainerError(problems[0])
    return merged


def _check_precision(args: argparse.Namespace) -> None:
    """Refuse, in one line, the precisions DeepSpeed would fail on later with a traceback.

    Raises:
        TrainerError: ``--fp16`` on an accelerator without fp16 (DeepSpeed's CPU accelerator has it only where oneDNN
            does: CPUs with AVX512-FP16 / AMX-FP16); resuming a checkpoint that this DeepSpeed version cannot resume
            (:func:`opskit.rules.deepspeed.deepspeed_version_problem`: ``--bf16 --zero-stage 0`` on 0.18.0-0.19.8).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if args.fp16 and not accelerator.is_fp16_supported():
        raise TrainerError(f"--fp16: DeepSpeed {deepspeed.__version__} does not support fp16 on this "
                           f"{accelerator.device_name()} accelerator; use --bf16 (or a GPU)")
    version = installed_deepspeed_version() or deepspeed.__version__
    problem = deepspeed_version_problem(args.params_dtype, args.zero_stage, args.pipeline_model_parallel_size,
                                        args.clip_grad, version, flag_name)
    if problem and problem.resume_only and args.load and (Path(args.load) / "latest").exists():
        raise TrainerError(f"--load {args.load} has a checkpoint: {problem.message}")


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


def _param_groups(model) -> list[dict]:
    """Megatron's weight-decay rule: no decay for biases and LayerNorm parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name or param.ndim == 1 else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(args: argparse.Namespace, exit_requests: _ExitRequests) -> int:
    """Build the run, train it, and close it in a ``finally``: TensorBoard's writer closed (its queue flushed),
    CodeCarbon stopped and the process groups destroyed, also when training raises.

    Returns:
        0: training finished, or saved and exited on request (kill switch, SIGUSR1, ``--exit-interval``,
        ``--exit-duration-in-mins``).

    Raises:
        TrainerError, CheckpointError: bad input found at run time (:func:`main` prints them in one line).
    """
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    trainer = None
    try:
        # 1. distributed: torchrun's world, megatron-core's TP/PP groups, the seeds, the agreed start time
        _init_distributed(args)
        _check_precision(args)
        world = _init_model_parallel(args)
        if _kill_switch_at_start(args):  # lets a drained job array's tasks end at once
            return 0
        # 2.-7. tokenizer and vocab, model, DeepSpeed engine, resume, data, logging
        trainer = Trainer(args, world, exit_requests)
        trainer.train()
        return 0
    finally:
        disarm_stack_dump()
        if trainer is not None:
            trainer.close()
        _destroy_distributed()


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


def _init_model_parallel(args: argparse.Namespace) -> World:
    """megatron-core's TP and PP groups for its layers (its rank order, TP fastest, then DP, then PP, is DeepSpeed's
    topology's), the seeds, and the start time every rank agrees on.

    Raises:
        TrainerError: a world size that is not a multiple of TP * PP; a seed NumPy cannot take.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, size = dist.get_rank(), dist.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if problems := world_size_problems(size, tp, pp, flag_name):
        raise TrainerError(problems[0])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _set_random_seed(args.seed, parallel_state.get_pipeline_model_parallel_rank(), pp)
    return World(rank=rank, size=size, tp=tp, pp=pp, dp=size // (tp * pp), start_time=_agreed_start_time())


def _agreed_start_time() -> float:
    """Megatron takes the earliest start over all ranks, so every rank agrees on when to stop."""
    import torch
    import torch.distributed as dist

    start = torch.tensor([_TRAIN_START_TIME], dtype=torch.float64, device=_rank_device())
    dist.all_reduce(start, op=dist.ReduceOp.MIN)
    return float(start.item())


def _kill_switch_at_start(args: argparse.Namespace) -> bool:
    """True, after Megatron's line, when the kill switch is on (on any rank) before anything is built."""

    if not _on_any_rank(_kill_switch_on(args))[0]:
        return False
    print_datetime(f"Detected kill switch at {args.kill_switch_path}. Exiting")
    return True


def _destroy_distributed() -> None:
    """megatron-core's groups and the process groups, where they exist (DeepSpeed 0.19.8 may SIGABRT at exit
    without)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _set_vocab_size(args: argparse.Namespace, rank: int) -> None:
    """Megatron's ``args.original_vocab_size`` (the tokenizer's) and ``args.padded_vocab_size`` (the model's, saved in
    every checkpoint), with Megatron's line about the padding."""
    args.original_vocab_size = _load_vocab_size(args)
    args.padded_vocab_size = _padded_vocab(args, args.original_vocab_size)
    if rank == 0:
        print(f" > padded vocab (size: {args.original_vocab_size}) with "
              f"{args.padded_vocab_size - args.original_vocab_size} dummy tokens (new size: {args.padded_vocab_size})",
              flush=True)


def _plan_resume(args: argparse.Namespace, world: World, ds_config: dict):
    """The step ``--load`` resumes from (:func:`opskit.train.checkpointing.plan_resume`); a step saved on another
    layout is loaded through its universal form, which the DeepSpeed engine must be configured for."""
    from opskit.ckpt.format.universal import Layout
    from opskit.train.checkpointing import plan_resume

    plan = plan_resume(args, Layout(world.tp, world.pp, world.dp))
    if plan.universal:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return plan


def _build_model(args: argparse.Namespace, world: World):
    """This rank's pipeline stage of the GPT/BLOOM model (a DeepSpeed ``PipelineModule``), on the GPU if there is
    one."""
    import torch

    from opskit.train.model import GPTConfig
    from opskit.train.pipe import GPTModelPipe, compile_stage, make_topology

    cfg = GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings, padded_vocab_size=args.padded_vocab_size,
        position_embedding_type=args.position_embedding_type, embed_layernorm=args.embed_layernorm,
        stable_embedding=args.use_bnb_optimizer,
        init_method_std=args.init_method_std, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, tensor_parallel=True,
    )
    model = GPTModelPipe(cfg, make_topology(world.tp, world.pp, world.dp), seed=args.seed,
                         activation_checkpoint_interval=1 if args.checkpoint_activations else 0,
                         partition_method=args.pp_partition_method or TRAINER_PARTITION_METHOD)
    if args.torch_compile:
        compile_stage(model)
    if torch.cuda.is_available():
        model.cuda()  # before the optimizer: fused AdamW wants its parameters on the GPU already
    return model


def _build_optimizer(args: argparse.Namespace, model):
    """Adam with decoupled weight decay (Megatron's ``--optimizer adam``: apex's FusedAdam in AdamW mode) over
    Megatron's weight-decay groups: torch's AdamW, or with ``--use-bnb-optimizer`` bitsandbytes' Adam8bit (its
    weight decay is decoupled too) with the same groups and hyperparameters. As in Megatron-DeepSpeed, the word
    embedding's states stay 32-bit under bitsandbytes (StableEmbedding); parameters below bitsandbytes'
    ``min_8bit_size`` (4096 elements: LayerNorms, biases) keep 32-bit states as well. That holds where DeepSpeed
    hands the optimizer the model's own parameters (fp32 with ZeRO-0); under ZeRO-1, or fp16 / bf16, it steps flat
    fp32 partitions instead, so every state is 8-bit there, as in Megatron-DeepSpeed's BigScience runs."""
    import torch

    hyper = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                 weight_decay=args.weight_decay)
    if not args.use_bnb_optimizer:
        return torch.optim.AdamW(_param_groups(model), **hyper,
                                 fused=torch.cuda.is_available())  # one kernel per step on GPUs
    import bitsandbytes as bnb

    from opskit.train.pipe import word_embeddings

    manager = bnb.optim.GlobalOptimManager.get_instance()
    for embedding in word_embeddings(model):  # looked up by parameter identity at the first step
        manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    return bnb.optim.Adam8bit(_param_groups(model), **hyper)


def _build_engine(args: argparse.Namespace, model, ds_config: dict, rampup, state: TrainState):
    """The optimizer (:func:`_build_optimizer`), Megatron's LR schedule in samples (its step is the ramp-up's batch
    at ``state``'s consumed samples; ``--lr-decay-tokens`` reads ``state``'s consumed tokens), and DeepSpeed's
    pipeline engine over them. The optimizer is a client optimizer: DeepSpeed builds none of its own (the config
    has no ``optimizer`` block).

    Returns:
        ``(engine, optimizer)``: the optimizer is the torch one, whose ``param_groups`` carry the current LR.
    """
    import deepspeed

    optimizer = _build_optimizer(args, model)
    scheduler = AnnealingLR(
        optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_samples,
        decay_steps=args.lr_decay_samples, decay_style=args.lr_decay_style,
        step_size=lambda: rampup.batch_size(state.consumed_train_samples),
        override=args.override_lr_scheduler, use_checkpoint=args.use_checkpoint_lr_scheduler,
        decay_tokens=args.lr_decay_tokens, consumed_tokens=lambda: state.consumed_train_tokens,
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    fuse_zero_overflow_check(engine.optimizer)
    release_last_stage_outputs(engine)
    return engine, optimizer


@dataclass(frozen=True)
class StepResult:
    """What one training iteration reports: its global batch, mean loss, and the optimizer's numbers after it."""

    global_batch_size: int
    loss: float
    learning_rate: float
    grad_norm: float | None
    loss_scale: float | None
    """fp16 only (None otherwise)."""


class Trainer:
    """One training run on this rank: built in a fixed order by ``__init__``, trained by :meth:`train`, released by
    :meth:`close`. Its progress is :attr:`state` (a :class:`TrainState`)."""

    def __init__(self, args: argparse.Namespace, world: World, exit_requests: _ExitRequests):
        from opskit.rules.schedule import BatchRampup
        from opskit.train.emissions import Emissions

        self.args, self.world, self.exit_requests = args, world, exit_requests
        self.state = TrainState(seqlen=args.seq_length)
        self.memory_reported = False  # Megatron reports GPU memory once, at the first log line

        # The flags checked against the files they name (before minutes of model building), and the schedules.
        _check_data_files(args)
        self.rampup = BatchRampup(args.global_batch_size,
                                  tuple(args.rampup_batch_size) if args.rampup_batch_size else None)
        self.train_iters = self.rampup.train_iters(args.train_samples)
        ds_config = _deepspeed_config(args, self.rampup.batch_size(0))
        self.curriculum = _curriculum(ds_config, args)
        # 2. tokenizer: the vocabulary size, padded; the step to resume from, re-cut if saved on another layout
        _set_vocab_size(args, world.rank)
        self.resume_plan = _plan_resume(args, world, ds_config)
        # 3. model: this rank's pipeline stage
        model = _build_model(args, world)
        # 4. DeepSpeed engine: optimizer and LR schedule first (the schedule reads the state's counters)
        self.engine, self.optimizer = _build_engine(args, model, ds_config, self.rampup, self.state)
        # 5. resume: weights, optimizer, LR schedule, RNG and the state's counters
        self._resume(model)
        if world.rank == 0:
            print(f"setting training iterations to {self.train_iters}", flush=True)
        # 6. data: this DP rank's micro-batches from the consumed samples on, and the validation sets
        self._build_data()
        # 7. logging: TensorBoard on the last rank, CodeCarbon on each node's local rank 0
        self.tensorboard = TensorBoard(args.tensorboard_dir, args.tensorboard_queue_size, enabled=world.is_last_rank)
        self.tensorboard.restart_marker(self.state.iteration, world.size)
        self.emissions = Emissions.start(args.codecarbon_dir, world.rank)

    def _resume(self, model) -> None:
        """Load ``--load`` (if it has a checkpoint) into the engine and the state; heal the TP-duplicated parameters
        with ``--sync-tp-duplicated-parameters``.

        Raises:
            TrainerError: the LR schedule in the checkpoint contradicts the flags (AnnealingLR's check).
        """
        from opskit.train.checkpointing import load_checkpoint
        from opskit.train.tp_sync import tp_duplicated_parameters

        args, world, state = self.args, self.world, self.state
        try:
            load_checkpoint(self.engine, args, state, self.resume_plan)
        except ValueError as e:  # AnnealingLR's schedule mismatch, raised inside DeepSpeed's loader
            raise TrainerError(f"{args.load}: {e}") from None
        state.last_saved = state.iteration or None
        sync = args.sync_tp_duplicated_parameters and world.tp > 1
        self.tp_duplicated = tp_duplicated_parameters(model) if sync else []
        if self.tp_duplicated:  # also heals copies that drifted apart before this run (BLOOM-176B's checkpoints)
            self._sync_tp_duplicated()
            if world.rank == 0:
                print(f"> syncing {len(self.tp_duplicated)} TP-duplicated parameters over the {world.tp} TP ranks "
                      "after every step", flush=True)

    def _build_data(self) -> None:
        """The train split's micro-batch iterator, the skip ranges still to apply, and the validation sets."""
        from opskit.train.data import micro_batches

        args, state = self.args, self.state
        self.dp_rank = self.engine.grid.data_parallel_id
        ((_, self.train_samples),) = _split_samples(args, "train")
        self.data = self._train_batches()
        self.skip_ranges = _pending_skip_ranges(args, state)
        self.do_valid = args.eval_interval is not None and args.eval_iters > 0
        valid_samples = _split_samples(args, "valid") if self.do_valid else []
        # (name or None, micro-batches): the groups share consumed_valid_samples, each resumes at its share (Megatron)
        self.valid_sets = [(name, micro_batches(samples, state.consumed_valid_samples // len(valid_samples),
                                                args.micro_batch_size, self.world.dp, self.dp_rank,
                                                device=_rank_device()))
                           for name, samples in valid_samples]

    def _train_batches(self):
        """This DP rank's micro-batches from the data position on (consumed plus skipped samples), cut to the
        curriculum's sequence length at each one."""
        from opskit.train.data import micro_batches

        state = self.state
        return micro_batches(self.train_samples, state.consumed_train_samples + state.skipped_train_samples,
                             self.args.micro_batch_size, self.world.dp, self.dp_rank, seqlen=lambda: state.seqlen,
                             device=_rank_device())

    def train(self) -> None:
        """Megatron's loop: train to ``train_iters``, logging, validating and saving at their intervals, until an exit
        request; then the end of training (final validation, last save, the finished flag)."""

        args, state = self.args, self.state
        state.interval = IntervalStats(started=time.time())
        if self.world.rank == 0:
            print_datetime("before the start of training step")
        exit_reason = None
        iterations_run = 0
        while state.iteration < self.train_iters:
            arm_stack_dump(args.stack_dump_after_mins)  # a hung iteration prints every rank's stacks
            if self._skip_range_at_next_iteration():
                continue
            step = self._train_step()
            iterations_run += 1
            inject_test_fault(state.iteration)  # tests only (OPSKIT_TEST_FAULT): a crash or hang on one node
            self._log(step)
            if self.do_valid and state.iteration % args.eval_interval == 0:
                self._evaluate_and_print(f"iteration {state.iteration}")
            if args.save and state.iteration % args.save_interval == 0:
                self._save()
                self.emissions.flush()
            exit_reason = _exit_reason(args, state.iteration, self.world.start_time, self.exit_requests,
                                       iterations_run)
            if exit_reason:
                break
        if state.iteration >= self.train_iters:  # the last iteration: the run is finished whatever else asked it to
            exit_reason = None                   # stop there (--exit-interval 250 of 500): final validation, flag
        self._finish(exit_reason)

    def _skip_range_at_next_iteration(self) -> bool:
        """Apply the next ``--skip-train-iteration-range`` when it starts at the next iteration: the data position
        passes over its global batches; iteration, consumed samples and LR stay. True when one was applied."""
        ranges, state = self.skip_ranges, self.state
        if not (ranges and ranges[0][0] <= state.iteration + 1 <= ranges[0][1]):
            return False
        first, last = ranges.popleft()
        if self.world.rank == 0:
            print(f"Skipped iterations {first} to {last} due to --skip-train-iteration-range flag.", flush=True)
        state.skipped_train_samples += self.rampup.batch_size(state.consumed_train_samples) * (last - state.iteration)
        state.applied_skip_train_iteration_ranges.append([first, last])
        self.data = self._train_batches()
        return True

    def _train_step(self) -> StepResult:
        """One iteration: the ramp-up's global batch at the curriculum's sequence length through the pipeline, the
        optimizer step, and the state advanced by it."""
        from opskit.rules.schedule import num_microbatches

        args, engine, state = self.args, self.engine, self.state
        global_batch_size = self.rampup.batch_size(state.consumed_train_samples)
        num_microbatches(global_batch_size, args.micro_batch_size, self.world.dp)  # Megatron's divisibility check
        engine.set_train_batch_size(global_batch_size)
        if self.curriculum is not None and (seqlen := self.curriculum.seqlen(state.iteration + 1)) != state.seqlen:
            state.seqlen = seqlen
            engine.reset_activation_shape()  # the pipeline stages then exchange the new shapes
        skipped_before = engine.skipped_steps
        loss = float(engine.train_batch(data_iter=self.data))
        if self.tp_duplicated:
            self._sync_tp_duplicated()
        state.iteration += 1
        state.consumed_train_samples += global_batch_size
        state.consumed_train_tokens += global_batch_size * state.seqlen
        state.interval.add(loss, skipped=engine.skipped_steps > skipped_before)
        grad_norm = engine.get_global_grad_norm()
        return StepResult(global_batch_size=global_batch_size, loss=loss,
                          learning_rate=self.optimizer.param_groups[0]["lr"],
                          grad_norm=float(grad_norm) if grad_norm is not None else None,
                          loss_scale=current_loss_scale(engine.optimizer) if args.fp16 else None)

    def _sync_tp_duplicated(self) -> None:
        from megatron.core import parallel_state

        from opskit.train.tp_sync import sync_tp_duplicated_parameters

        sync_tp_duplicated_parameters(self.tp_duplicated, parallel_state.get_tensor_model_parallel_group(),
                                      self.world.tp)

    def _log(self, step: StepResult) -> None:
        """TensorBoard's per-iteration scalars; every ``--log-interval`` iterations Megatron's iteration line (last
        rank), the interval's scalars, and once the GPU memory line."""
        import torch

        args, world, state = self.args, self.world, self.state
        curriculum_seqlen = state.seqlen if self.curriculum is not None else None
        self.tensorboard.iteration(state.iteration, state.consumed_train_samples, state.consumed_train_tokens,
                                   step.learning_rate, step.global_batch_size, step.loss, step.grad_norm,
                                   step.loss_scale, curriculum_seqlen)
        if state.iteration % args.log_interval:
            return
        seconds = (time.time() - state.interval.started) / state.interval.iterations
        flops = megatron_flops_per_iteration(step.global_batch_size, state.seqlen, args.num_layers, args.hidden_size,
                                             args.padded_vocab_size, args.checkpoint_activations)
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
        if not self.memory_reported and torch.cuda.is_available():
            print(memory_line(world.rank, state.iteration), flush=True)
            self.memory_reported = True
        state.interval = IntervalStats(started=time.time())

    def _evaluate_and_print(self, prefix: str) -> None:
        """Megatron's evaluate_and_print_results: each validation set's loss, printed (last rank) and written to
        TensorBoard; at the full ``--seq-length`` (Megatron-DeepSpeed's evaluate), also under a curriculum."""

        args, state = self.args, self.state
        if self.curriculum is not None:
            self.engine.reset_activation_shape()
        for name, valid_data in self.valid_sets:
            loss = _evaluate(self.engine, valid_data, args.eval_iters)
            state.consumed_valid_samples += args.eval_iters * self.engine.train_batch_size()
            if self.world.is_last_rank:
                for line in validation_lines(prefix, loss, name):  # one print per line: see main()
                    print(line, flush=True)
            self.tensorboard.validation(state.iteration, state.consumed_train_samples, state.consumed_train_tokens,
                                        loss, args.log_validation_ppl_to_tensorboard, name)
        if self.curriculum is not None:
            self.engine.reset_activation_shape()

    def _save(self) -> None:
        from opskit.train.checkpointing import save_checkpoint

        save_checkpoint(self.engine, self.args, self.state)
        self.state.last_saved = self.state.iteration

    def _finish(self, exit_reason: str | None) -> None:
        """The end of the run: after training to the end, the final validation and the finished flag; in any case a
        checkpoint of the last iteration (unless just saved) and Megatron's line on why it stopped."""
        import torch.distributed as dist

        args, state, rank = self.args, self.state, self.world.rank
        if exit_reason is None:  # Megatron's exits leave from inside train(), before the end-of-training evaluation
            if rank == 0:
                print_datetime("after training is done")
            if self.do_valid:
                self._evaluate_and_print("the end of training for val data")
        if args.save and state.last_saved != state.iteration:
            self._save()
        if exit_reason and rank == 0:
            print_datetime(exit_reason)
        if exit_reason is None and rank == 0 and args.finished_flag_path:
            _write_finished_flag(Path(args.finished_flag_path), state)
        dist.barrier()  # every rank is done before the process groups go

    def close(self) -> None:
        """Close TensorBoard's writer (it flushes its queue) and stop CodeCarbon (it writes its last row)."""
        self.tensorboard.close()
        self.emissions.stop()


def _write_finished_flag(path: Path, state: TrainState) -> None:
    """``--finished-flag-path``: the job script's later tasks exit at start while it exists (opskit.run.paths.RunPaths
    .finished_flag). Written atomically: a reader never sees half a line."""
    atomic_write_text(path, f"{datetime.now():%Y-%m-%d %H:%M:%S} training finished at iteration {state.iteration}, "
                            f"consumed samples {state.consumed_train_samples}\n")


def _weighted_split_groups(flag: str, path: str) -> list:
    """The groups of a ``--*-weighted-split-paths-path`` file (see rules.formats.parse_weighted_split_paths)."""
    from opskit.rules.formats import parse_weighted_split_paths

    try:
        return parse_weighted_split_paths(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TrainerError(f"{flag} {path}: {e}") from None


def _split_samples(args: argparse.Namespace, split: str) -> list:
    """``[(name, samples)]`` of the ``train`` or ``valid`` split: ``[(None, ...)]`` from ``--data-path`` (cut by
    ``--split``), or one per group of ``--{split}-weighted-split-paths-path`` (a train file holds exactly one)."""
    from opskit.train.data import blend_samples, weighted_split_samples

    flag = f"--{split}-weighted-split-paths-path"
    path = getattr(args, f"{split}_weighted_split_paths_path")
    if args.data_path is not None:
        where = f"--data-path {' '.join(args.data_path)} (--split {args.split}, {split})"
    else:
        where = f"{flag} {path}"
    try:
        if args.data_path is not None:
            which = ("train", "valid").index(split)
            return [(None, blend_samples(parse_data_path(args.data_path), args.split, which, args.seq_length,
                                         args.seed))]
        groups = _weighted_split_groups(flag, path)
        if split == "train" and len(groups) != 1:
            raise ValueError(f"{len(groups)} groups; the train file holds exactly one")
        return [(name, weighted_split_samples(entries, args.seq_length, args.seed)) for name, entries in groups]
    except (FileNotFoundError, ValueError) as e:
        raise TrainerError(f"{where}: {e}") from None


def _pending_skip_ranges(args: argparse.Namespace, state: TrainState):
    """The ``--skip-train-iteration-range`` ranges still to apply after ``state.iteration``: Megatron drops those that
    end before it; we also drop those the checkpoint says were applied already (their iteration numbers were trained
    again, on later data, right after the skip)."""
    from collections import deque

    applied = state.applied_skip_train_iteration_ranges
    return deque(r for r in args.skip_train_iteration_range or [] if r[1] > state.iteration and r not in applied)


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


def _rank_device():
    """This rank's GPU, else the CPU: where small all-reduce tensors live (NCCL only reduces GPU tensors, gloo CPU
    ones) and where micro-batches are copied ahead of the pipeline engine."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _kill_switch_on(args: argparse.Namespace) -> bool:
    return bool(args.kill_switch_path) and os.path.exists(args.kill_switch_path)


def _on_any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks (one MAX all-reduce), so every rank takes the same decision."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(f) for f in flags], device=_rank_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


# `opskit rehearse` runs a production spec's exit duration (BLOOM-176B: 5990 min) on a CPU model in seconds: with this
# variable set, the minutes since the start are (iterations trained by this process) * its value, not wall time.


def _minutes_since_start(train_start_time: float, iterations_run: int) -> float:
    """Minutes counted against ``--exit-duration-in-mins``: wall time since ``train_start_time``, or the rehearsal's
    simulated clock (:data:`REHEARSAL_CLOCK_ENV`: ``iterations_run`` times its value in minutes), which makes the
    exit iteration deterministic however loaded the machine is.

    Raises:
        TrainerError: the variable is set to something other than a positive number.
    """
    per_iteration = os.environ.get(REHEARSAL_CLOCK_ENV)
    if not per_iteration:
        return (time.time() - train_start_time) / 60
    try:
        minutes = float(per_iteration)
    except ValueError:
        minutes = 0.0
    if not minutes > 0:
        raise TrainerError(f"{REHEARSAL_CLOCK_ENV}={per_iteration!r}: expected a positive number of minutes")
    return iterations_run * minutes


def _exit_reason(args: argparse.Namespace, iteration: int, train_start_time: float,
                 exit_requests: _ExitRequests, iterations_run: int = 0) -> str | None:
    """Why to save and stop after this iteration, or None. Megatron's order: duration, then interval; the kill switch
    is checked here, before the next iteration starts. ``iterations_run``: iterations this process trained (the
    rehearsal's simulated clock, :func:`_minutes_since_start`)."""
    minutes = _minutes_since_start(train_start_time, iterations_run)
    kill, timed_out, usr1 = _on_any_rank(
        _kill_switch_on(args),
        args.exit_duration_in_mins is not None and minutes > args.exit_duration_in_mins,
        exit_requests.usr1,
    )
    if kill:
        return f"Detected kill switch at {args.kill_switch_path}. Exiting"
    if timed_out:
        return f"exiting program after {minutes:.4f} minutes"
    if usr1:
        return f"exiting program on SIGUSR1 at iteration {iteration}"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"exiting program at iteration {iteration}"
    return None
