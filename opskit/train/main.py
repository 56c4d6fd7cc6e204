"""Entry point of ``python -m opskit.train``: parse, build, resume, train, save, exit.

Build order (fixed): distributed -> tokenizer (vocab size) -> model on its pipeline stage -> optimizer -> LR schedule
-> DeepSpeed engine -> resume -> data. Every rank runs the same loop; the last rank prints Megatron's log lines.

Run with ``torchrun --nproc_per_node N -m opskit.train ...``, or as one process without a launcher.
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
from pathlib import Path  # noqa: E402

from opskit.rules.checks import flag_name  # noqa: E402
from opskit.rules.deepspeed import (  # noqa: E402
    Contradiction,
    deepspeed_config,
    deepspeed_version_problem,
    installed_deepspeed_version,
    with_flags,
)
from opskit.rules.formats import parse_data_path  # noqa: E402
from opskit.rules.model import VocabPaddingError, megatron_flops_per_iteration, padded_vocab_size  # noqa: E402
from opskit.runs import mark_run_finished  # noqa: E402
from opskit.train.args import parse_args  # noqa: E402


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
    if missing := _missing_extra():
        print(f"error: {missing}", file=sys.stderr, flush=True)
        return 2
    exit_requests = _ExitRequests()
    from opskit.train.checkpointing import CheckpointError

    try:
        return train(args, exit_requests)
    except (TrainerError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def _missing_extra() -> str | None:
    """Why the trainer's own packages (the ``train`` extra) cannot be imported here, in one line; None when they can.
    Flags are parsed first, so ``--help`` and flag errors need none of them (a login node without torch)."""
    import importlib

    for module in ("torch", "deepspeed", "megatron.core", "tokenizers", "numpy"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            return (f"the trainer cannot import {module} ({' '.join(str(e).split())}): pip install 'opskit[train]' "
                    "(torch first: the README says which build)")
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
    """megatron-core only asserts on a missing dataset (and its ``__del__`` then prints a traceback): check first."""
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
            if not Path(prefix + suffix).is_file():
                raise TrainerError(f"{where}: no {prefix}{suffix}")


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
    from opskit.train.schedules import SeqlenCurriculum

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
        TrainerError: when the JSON is unreadable or contradicts a flag (it names both).
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
        return with_flags(config, implied)
    except Contradiction as e:
        raise TrainerError(f"--deepspeed_config {args.deepspeed_config}: {e}") from None


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
    import deepspeed
    import torch
    import torch.distributed as dist

    from opskit.train.checkpointing import load_checkpoint, save_checkpoint
    from opskit.train.data import micro_batches
    from opskit.train.emissions import Emissions
    from opskit.train.log import (
        IntervalStats,
        TensorBoard,
        current_loss_scale,
        iteration_line,
        memory_line,
        print_datetime,
        validation_lines,
    )
    from opskit.train.model import GPTConfig
    from opskit.train.pipe import GPTModelPipe, compile_transformer_layers, make_topology
    from opskit.train.schedules import AnnealingLR, BatchRampup, num_microbatches
    from opskit.train.tp_sync import sync_tp_duplicated_parameters, tp_duplicated_parameters

    deepspeed.utils.logger.setLevel(logging.WARNING)
    _init_distributed(args)
    _check_precision(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_last_rank = rank == world_size - 1
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise TrainerError(f"{world_size} processes are not divisible by TP*PP = {tp * pp}")
    dp = world_size // (tp * pp)
    # megatron-core's TP groups for its layers; its rank order (TP fastest, then DP, then PP) is DeepSpeed's topology's.
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _set_random_seed(args.seed, parallel_state.get_pipeline_model_parallel_rank(), pp)

    # Megatron takes the earliest start over all ranks, so every rank agrees on when to stop.
    start = torch.tensor([_TRAIN_START_TIME], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(start, op=dist.ReduceOp.MIN)
    train_start_time = float(start.item())

    if _on_any_rank(_kill_switch_on(args))[0]:  # lets a drained job array's tasks end at once
        print_datetime(f"Detected kill switch at {args.kill_switch_path}. Exiting")
        dist.destroy_process_group()
        return 0

    _check_data_files(args)  # from the flags alone: fail before minutes of model building, not after
    rampup = BatchRampup(args.global_batch_size, tuple(args.rampup_batch_size) if args.rampup_batch_size else None)
    train_iters = rampup.train_iters(args.train_samples)
    ds_config = _deepspeed_config(args, rampup.batch_size(0))
    curriculum = _curriculum(ds_config, args)
    args.original_vocab_size = _load_vocab_size(args)
    args.padded_vocab_size = _padded_vocab(args, args.original_vocab_size)
    if rank == 0:
        print(f" > padded vocab (size: {args.original_vocab_size}) with "
              f"{args.padded_vocab_size - args.original_vocab_size} dummy tokens (new size: {args.padded_vocab_size})",
              flush=True)
    cfg = GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings, padded_vocab_size=args.padded_vocab_size,
        position_embedding_type=args.position_embedding_type, embed_layernorm=args.embed_layernorm,
        init_method_std=args.init_method_std, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, tensor_parallel=True,
    )
    model = GPTModelPipe(cfg, make_topology(tp, pp, dp), seed=args.seed,
                         activation_checkpoint_interval=1 if args.checkpoint_activations else 0,
                         partition_method=args.pp_partition_method or "type:transformer|embedding")

    if args.torch_compile:
        compile_transformer_layers(model)
    if torch.cuda.is_available():
        model.cuda()  # before the optimizer: fused AdamW wants its parameters on the GPU already
    optimizer = torch.optim.AdamW(_param_groups(model), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_eps, weight_decay=args.weight_decay,
                                  fused=torch.cuda.is_available())  # one kernel per step on GPUs
    consumed = {"samples": 0}
    consumed_tokens = 0  # read by the LR schedule's --lr-decay-tokens
    scheduler = AnnealingLR(
        optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_samples,
        decay_steps=args.lr_decay_samples, decay_style=args.lr_decay_style,
        step_size=lambda: rampup.batch_size(consumed["samples"]),
        override=args.override_lr_scheduler, use_checkpoint=args.use_checkpoint_lr_scheduler,
        decay_tokens=args.lr_decay_tokens, consumed_tokens=lambda: consumed_tokens,
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=ds_config,
    )

    args.consumed_valid_samples = 0  # Megatron's counter, saved in the checkpoint's args
    args.skipped_train_samples = 0  # samples passed over by --skip-train-iteration-range (as newer Megatron-LM)
    args.applied_skip_train_iteration_ranges = []  # ranges already skipped, so a resume does not skip them again
    try:
        iteration, consumed["samples"], consumed_tokens = load_checkpoint(engine, args)
    except ValueError as e:  # AnnealingLR's schedule mismatch, raised inside DeepSpeed's loader
        raise TrainerError(f"{args.load}: {e}") from None
    tp_duplicated = tp_duplicated_parameters(model) if args.sync_tp_duplicated_parameters and tp > 1 else []
    if tp_duplicated:  # also heals copies that drifted apart before this run (BLOOM-176B's checkpoints)
        sync_tp_duplicated_parameters(tp_duplicated, parallel_state.get_tensor_model_parallel_group(), tp)
        if rank == 0:
            print(f"> syncing {len(tp_duplicated)} TP-duplicated parameters over the {tp} TP ranks after every step",
                  flush=True)
    if rank == 0:
        print(f"setting training iterations to {train_iters}", flush=True)
    tensorboard = TensorBoard(args.tensorboard_dir, args.tensorboard_queue_size, enabled=is_last_rank)
    tensorboard.restart_marker(iteration, world_size)

    dp_rank = engine.grid.data_parallel_id
    ((_, samples),) = _split_samples(args, "train")
    seqlen = {"now": args.seq_length}  # the curriculum's, read by the data iterator before each micro-batch
    data = micro_batches(samples, consumed["samples"] + args.skipped_train_samples, args.micro_batch_size, dp,
                         dp_rank, seqlen=lambda: seqlen["now"])
    skip_ranges = _pending_skip_ranges(args, iteration)
    do_valid = args.eval_interval is not None and args.eval_iters > 0
    valid_samples = _split_samples(args, "valid") if do_valid else []
    # (name or None, micro-batches): the groups share consumed_valid_samples, each resumes at its share (Megatron)
    valid_sets = [(name, micro_batches(samples_of_set, args.consumed_valid_samples // len(valid_samples),
                                       args.micro_batch_size, dp, dp_rank)) for name, samples_of_set in valid_samples]

    def evaluate_and_print_results(prefix: str) -> None:
        if curriculum is not None:  # validation runs at the full --seq-length (Megatron-DeepSpeed's evaluate)
            engine.reset_activation_shape()
        for name, valid_data in valid_sets:
            loss = _evaluate(engine, valid_data, args)
            if is_last_rank:
                for line in validation_lines(prefix, loss, name):  # one print per line: see main()
                    print(line, flush=True)
            tensorboard.validation(iteration, consumed["samples"], consumed_tokens, loss,
                                   args.log_validation_ppl_to_tensorboard, name)
        if curriculum is not None:
            engine.reset_activation_shape()

    flops_recompute = args.checkpoint_activations
    emissions = Emissions.start(args.codecarbon_dir, rank)
    stats = IntervalStats(started=time.time())
    last_saved = iteration if args.load and iteration else None
    exit_reason = None
    memory_reported = False
    if rank == 0:
        print_datetime("before the start of training step")
    while iteration < train_iters:
        if skip_ranges and skip_ranges[0][0] <= iteration + 1 <= skip_ranges[0][1]:
            first, last = skip_ranges.popleft()
            if rank == 0:
                print(f"Skipped iterations {first} to {last} due to --skip-train-iteration-range flag.", flush=True)
            args.skipped_train_samples += rampup.batch_size(consumed["samples"]) * (last - iteration)
            args.applied_skip_train_iteration_ranges.append([first, last])
            data = micro_batches(samples, consumed["samples"] + args.skipped_train_samples, args.micro_batch_size,
                                 dp, dp_rank, seqlen=lambda: seqlen["now"])
            continue
        global_batch_size = rampup.batch_size(consumed["samples"])
        num_microbatches(global_batch_size, args.micro_batch_size, dp)  # Megatron's divisibility check
        engine.set_train_batch_size(global_batch_size)
        if curriculum is not None and (difficulty := curriculum.seqlen(iteration + 1)) != seqlen["now"]:
            seqlen["now"] = difficulty
            engine.reset_activation_shape()  # the pipeline stages then exchange the new shapes
        skipped_before = engine.skipped_steps
        loss = float(engine.train_batch(data_iter=data))
        if tp_duplicated:
            sync_tp_duplicated_parameters(tp_duplicated, parallel_state.get_tensor_model_parallel_group(), tp)
        iteration += 1
        consumed["samples"] += global_batch_size
        consumed_tokens += global_batch_size * seqlen["now"]
        stats.add(loss, skipped=engine.skipped_steps > skipped_before)
        lr = optimizer.param_groups[0]["lr"]
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        loss_scale = current_loss_scale(engine.optimizer) if args.fp16 else None
        curriculum_seqlen = seqlen["now"] if curriculum is not None else None
        tensorboard.iteration(iteration, consumed["samples"], consumed_tokens, lr, global_batch_size, loss,
                              grad_norm, loss_scale, curriculum_seqlen)

        if iteration % args.log_interval == 0:
            seconds = (time.time() - stats.started) / stats.iterations
            flops = megatron_flops_per_iteration(global_batch_size, seqlen["now"], args.num_layers,
                                                 args.hidden_size, args.padded_vocab_size, flops_recompute)
            tflops = flops / (seconds * world_size * 1e12)
            if is_last_rank:
                print(iteration_line(
                    iteration=iteration, train_iters=train_iters, consumed_samples=consumed["samples"],
                    consumed_tokens=consumed_tokens, seconds_per_iteration=seconds, learning_rate=lr,
                    global_batch_size=global_batch_size, lm_loss=stats.mean_loss, loss_scale=loss_scale,
                    grad_norm=grad_norm, skipped_iterations=stats.skipped_iterations,
                    nan_iterations=stats.nan_iterations, tflops=tflops, curriculum_seqlen=curriculum_seqlen),
                    flush=True)
            tensorboard.interval(iteration, consumed["samples"], consumed_tokens, seconds, global_batch_size,
                                 seqlen["now"], dp, tflops)
            if not memory_reported and torch.cuda.is_available():
                print(memory_line(rank, iteration), flush=True)
                memory_reported = True
            stats = IntervalStats(started=time.time())

        if do_valid and iteration % args.eval_interval == 0:
            evaluate_and_print_results(f"iteration {iteration}")
        if args.save and iteration % args.save_interval == 0:
            save_checkpoint(engine, args, iteration, consumed["samples"], consumed_tokens)
            emissions.flush()
            last_saved = iteration
        exit_reason = _exit_reason(args, iteration, train_start_time, exit_requests)
        if exit_reason:
            break

    if exit_reason is None:  # Megatron's exits leave from inside train(), before the end-of-training evaluation
        if rank == 0:
            print_datetime("after training is done")
        if do_valid:
            evaluate_and_print_results("the end of training for val data")
    if args.save and last_saved != iteration:
        save_checkpoint(engine, args, iteration, consumed["samples"], consumed_tokens)
    if exit_reason and rank == 0:
        print_datetime(exit_reason)
    if exit_reason is None and rank == 0:  # the chain's later tasks exit at start (opskit.runs.RunPaths.finished_flag)
        mark_run_finished(f"training finished at iteration {iteration}, consumed samples {consumed['samples']}")
    tensorboard.close()
    emissions.stop()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()  # DeepSpeed 0.19.8 may SIGABRT at exit without it
    return 0


def _weighted_split_groups(flag: str, path: str) -> list:
    """The groups of a ``--*-weighted-split-paths-path`` file (see args.parse_weighted_split_paths)."""
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


def _pending_skip_ranges(args: argparse.Namespace, iteration: int):
    """The ``--skip-train-iteration-range`` ranges still to apply after ``iteration``: Megatron drops those that end
    before it; we also drop those the checkpoint says were applied already (their iteration numbers were trained
    again, on later data, right after the skip)."""
    from collections import deque

    applied = args.applied_skip_train_iteration_ranges
    return deque(r for r in args.skip_train_iteration_range or [] if r[1] > iteration and r not in applied)


def _evaluate(engine, valid_data, args: argparse.Namespace) -> float:
    """Megatron's evaluate() under DeepSpeed's pipeline: ``--eval-iters`` global batches of the valid split through
    ``engine.eval_batch`` (eval mode, no gradients; it returns the mean of the batch's micro-batch losses, averaged
    over DP), then the mean of those: the average over ``eval_iters * num_microbatches`` micro-batches, in nats per
    token. The global batch is the last iteration's (Megatron's get_num_microbatches() during a ramp-up); each eval
    iteration advances ``args.consumed_valid_samples`` by it."""
    global_batch_size = engine.train_batch_size()
    total = 0.0
    for _ in range(args.eval_iters):
        total += float(engine.eval_batch(data_iter=valid_data))
        args.consumed_valid_samples += global_batch_size
    engine.module.train()  # train_batch does it too; done here so that nothing runs in eval mode by accident
    return total / args.eval_iters


def _collective_device():
    """Where small all-reduce tensors live: NCCL only reduces GPU tensors, gloo CPU ones."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _kill_switch_on(args: argparse.Namespace) -> bool:
    return bool(args.kill_switch_path) and os.path.exists(args.kill_switch_path)


def _on_any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks (one MAX all-reduce), so every rank takes the same decision."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(f) for f in flags], device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def _exit_reason(args: argparse.Namespace, iteration: int, train_start_time: float,
                 exit_requests: _ExitRequests) -> str | None:
    """Why to save and stop after this iteration, or None. Megatron's order: duration, then interval; the kill switch
    is checked here, before the next iteration starts."""
    minutes = (time.time() - train_start_time) / 60
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
