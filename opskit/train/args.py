"""The trainer's command line, with Megatron-DeepSpeed's flag names and semantics (reference section 2.4).

The parsed ``argparse.Namespace`` is saved in every checkpoint as ``args``, as Megatron-DeepSpeed does, so the
attribute names are Megatron's too (``consumed_train_samples``, ``padded_vocab_size``, ...).
"""

from __future__ import annotations

import argparse
import sys

from opskit.rules import consistency, flags
from opskit.rules.consistency import flag_name
from opskit.rules.deepspeed import deepspeed_version_problem, installed_deepspeed_version
from opskit.rules.divergence import Replay
from opskit.rules.formats import parse_skip_ranges


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and a hint: the usage of this trainer's ~70 flags is 60 lines, and the one
    line that matters would scroll away (or be lost in a job's output) above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} ({self.prog} --help lists the flags)\n")

    def parse_known_args(self, args=None, namespace=None):
        # A misspelt flag first: argparse would name the required flags it hides (`--num-layer 2` -> "required:
        # --num-layers", not the typo).
        argv = sys.argv[1:] if args is None else list(args)
        unknown = [a for a in argv if a.startswith("--") and a != "--"
                   and a.split("=", 1)[0] not in self._option_string_actions]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser, built from the flag table (:data:`opskit.rules.flags.GROUPS`), one argparse group per
    table group."""
    p = _OneLineParser(
        prog="python -m opskit.train",
        description="Megatron-DeepSpeed-style GPT/BLOOM pretraining (DeepSpeed pipeline engine).",
        allow_abbrev=False,
    )
    for title, group_flags in flags.GROUPS:
        group = p.add_argument_group(title)
        for flag in group_flags:
            group.add_argument(flag.option, **flag.argparse_kwargs())
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; a bad combination exits with argparse's one-line ``error:`` message.

    ``--train-iters`` N (Megatron's iteration-based length, which allows no ramp-up) becomes ``train_samples`` =
    N * GBS, so the sample-based schedules (LR decay by default over train_samples) run as with ``--train-samples``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.params_dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    _check(parser, args)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.train_iters is not None:
        args.train_samples = args.train_iters * args.global_batch_size
    args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    if args.skip_train_iteration_range is not None:
        args.skip_train_iteration_range = parse_skip_ranges(args.skip_train_iteration_range)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are mutually exclusive")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    problems = [
        *consistency.attention_problems(args.hidden_size, args.num_attention_heads, args.seq_length,
                                        args.max_position_embeddings, flag_name),
        *consistency.tensor_parallel_problems(args.num_attention_heads, args.ffn_hidden_size or 4 * args.hidden_size,
                                              tp, flag_name),
        *consistency.sequence_parallel_problems(args.sequence_parallel, args.seq_length, tp, flag_name),
        *consistency.recompute_problems(args.checkpoint_activations, args.recompute_granularity, args.torch_compile,
                                        flag_name),
        *consistency.pipeline_problems(args.num_layers, pp,
                                       args.pp_partition_method or consistency.TRAINER_PARTITION_METHOD, flag_name),
        *consistency.pad_vocab_problems(args.pad_vocab_size_to, args.make_vocab_size_divisible_by, tp, None, flag_name),
        *consistency.rampup_problems(args.global_batch_size, args.rampup_batch_size, flag_name),
        *consistency.train_length_problems(args.train_samples, args.train_iters, args.rampup_batch_size, flag_name),
    ]
    version = installed_deepspeed_version()
    problem = version and deepspeed_version_problem(args.params_dtype, args.zero_stage, pp, args.clip_grad, version,
                                                    flag_name)
    if problem and not problem.resume_only:  # a resume is checked when the trainer finds a checkpoint
        problems.append(problem.message)
    if args.save and not args.save_interval:
        problems.append("--save needs --save-interval")
    if args.divergence_replay is not None:
        try:
            Replay.parse(args.divergence_replay)
        except ValueError as e:
            problems.append(f"--divergence-replay: {e}")
    problems += [*consistency.partition_method_problems(args.pp_partition_method, flag_name),
                 *consistency.data_source_problems(args.data_path, args.train_weighted_split_paths_path,
                                                   args.valid_weighted_split_paths_path, flag_name),
                 *consistency.tokenizer_problems(args.tokenizer_type, args.tokenizer_name_or_path, args.vocab_file,
                                                 args.merge_file, flag_name),
                 *consistency.training_flag_problems(vars(args), flag_name)]
    if problems:  # the first, as argparse reports one error
        parser.error(problems[0])
