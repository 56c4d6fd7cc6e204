"""The trainer's command line, with Megatron-DeepSpeed's flag names and semantics (reference section 2.4).

The parsed ``argparse.Namespace`` is saved in every checkpoint as ``args``, as Megatron-DeepSpeed does, so the
attribute names are Megatron's too (``consumed_train_samples``, ``padded_vocab_size``, ...).
"""

from __future__ import annotations

import argparse
import sys

from opskit.rules import checks, flags
from opskit.rules.checks import flag_name
from opskit.rules.deepspeed import deepspeed_version_problem, installed_deepspeed_version


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
        *checks.attention_problems(args.hidden_size, args.num_attention_heads, args.seq_length,
                                   args.max_position_embeddings, flag_name),
        *checks.tensor_parallel_problems(args.num_attention_heads, args.ffn_hidden_size or 4 * args.hidden_size, tp,
                                         flag_name),
        *checks.pipeline_problems(args.num_layers, pp, args.pp_partition_method or checks.TRAINER_PARTITION_METHOD,
                                  flag_name),
        *checks.pad_vocab_problems(args.pad_vocab_size_to, args.make_vocab_size_divisible_by, tp, None, flag_name),
        *checks.rampup_problems(args.global_batch_size, args.rampup_batch_size, flag_name),
        *checks.train_length_problems(args.train_samples, args.train_iters, args.rampup_batch_size, flag_name),
    ]
    version = installed_deepspeed_version()
    problem = version and deepspeed_version_problem(args.params_dtype, args.zero_stage, pp, args.clip_grad, version,
                                                    flag_name)
    if problem and not problem.resume_only:  # a resume is checked when the trainer finds a checkpoint
        problems.append(problem.message)
    if problems:
        parser.error(problems[0])
    if args.save and not args.save_interval:
        parser.error("--save needs --save-interval")
    method = args.pp_partition_method
    if method is not None and method not in ("parameters", "uniform") and not method.startswith("type:"):
        parser.error(f"--pp-partition-method {method!r}: use parameters, uniform or type:REGEX "
                     "(e.g. type:transformer|embedding)")
    try:
        parse_split(args.split)
    except ValueError as e:
        parser.error(f"--split {e}")
    if (args.data_path is None) == (args.train_weighted_split_paths_path is None):
        parser.error("give either --data-path or --train-weighted-split-paths-path (with "
                     "--valid-weighted-split-paths-path)")
    if args.data_path is not None:
        try:
            parse_data_path(args.data_path)
        except ValueError as e:
            parser.error(f"--data-path {e}")
    elif args.valid_weighted_split_paths_path is None:
        parser.error("--train-weighted-split-paths-path needs --valid-weighted-split-paths-path")
    if args.tokenizer_type == "PretrainedFromHF" and not args.tokenizer_name_or_path:
        parser.error("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        parser.error("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.eval_interval is not None and args.eval_interval <= 0:
        parser.error(f"--eval-interval must be > 0, got {args.eval_interval}")
    if args.eval_iters < 0:
        parser.error(f"--eval-iters must be >= 0, got {args.eval_iters}")
    try:
        parse_skip_ranges(args.skip_train_iteration_range or [])
    except ValueError as e:
        parser.error(f"--skip-train-iteration-range: {e}")
    if args.override_lr_scheduler and args.use_checkpoint_lr_scheduler:
        parser.error("--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive")


def parse_split(split: str) -> list[float]:
    """``--split`` weights (``969,30,1`` or ``969/30/1``; missing ones are 0) normalised to sum 1.

    Raises:
        ValueError: when a weight is not a number, is negative, or all are 0.
    """
    bad = ValueError(f"{split!r} is not up to three non-negative weights with a positive sum, e.g. 969,30,1")
    try:
        weights = [float(part) for part in (split.split(",") if "," in split else split.split("/"))]
    except ValueError:
        raise bad from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise bad
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def parse_data_path(values: list[str]) -> list[tuple[float, str]]:
    """``--data-path`` as ``[(weight, prefix)]``: one prefix (weight 1), or Megatron's blend ``W1 P1 W2 P2 ...`` with
    the weights normalised to sum 1.

    Raises:
        ValueError: for an odd number of values, a weight that is not a non-negative number, or weights summing to 0.
    """
    if len(values) == 1:
        return [(1.0, values[0])]
    bad = ValueError(f"{' '.join(values)!r} is not one prefix or WEIGHT PREFIX pairs with non-negative weights "
                     "summing above 0, e.g. 0.3 prefixA 0.7 prefixB")
    if len(values) % 2:
        raise bad
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise bad from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise bad
    return [(w / sum(weights), prefix) for w, prefix in zip(weights, values[1::2], strict=True)]


def parse_weighted_split_paths(text: str) -> list[tuple[str, list[tuple[float, float, float, str]]]]:
    """The contents of a ``--{train,valid}-weighted-split-paths-path`` file (Megatron-DeepSpeed's ParseDataPaths):
    one line of double-quoted groups ``"NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX" "NAME2: ..."``.

    Returns:
        ``[(name, [(weight, start, end, prefix), ...]), ...]``; weights as written, START/END fractions in [0, 1].

    Raises:
        ValueError: for anything else, quoting the part that is wrong.
    """
    line = text.strip()
    if not (line.startswith('"') and line.endswith('"')) or "\n" in line:
        raise ValueError('expected one line of double-quoted groups, e.g. "train: 0.3 0:0.95 /data/a, 0.7 0:0.95 '
                         '/data/b"')
    groups = []
    for group in line[1:-1].split('" "'):
        name, sep, body = group.partition(":")
        if not sep or not name.strip() or " " in name.strip():
            raise ValueError(f"{group[:60]!r}: a group starts with 'NAME:'")
        entries = []
        for entry in body.split(","):
            parts = entry.split()
            bad = ValueError(f"{entry.strip()!r} in group {name.strip()!r} is not 'WEIGHT START:END PREFIX' with "
                             "WEIGHT >= 0 and 0 <= START < END <= 1")
            try:
                weight, (start, end), prefix = float(parts[0]), (float(x) for x in parts[1].split(":")), parts[2]
            except (IndexError, ValueError):
                raise bad from None
            if len(parts) != 3 or weight < 0 or not 0 <= start < end <= 1:
                raise bad
            entries.append((weight, start, end, prefix))
        if sum(w for w, *_ in entries) <= 0:
            raise ValueError(f"group {name.strip()!r}: the weights sum to 0")
        groups.append((name.strip(), entries))
    return groups


def parse_skip_ranges(ranges: list[str]) -> list[list[int]]:
    """``--skip-train-iteration-range`` values (``START-END``, 1-based iterations, both included) as Megatron parses
    them: sorted, overlapping ranges merged (``1-5 2-6`` -> ``[[1, 6]]``).

    Raises:
        ValueError: for a value that is not ``START-END`` with ``1 <= START <= END``.
    """
    parsed = []
    for value in ranges:
        parts = value.split("-")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"{value!r} is not START-END, e.g. 101-200")
        start, end = int(parts[0]), int(parts[1])
        if not 1 <= start <= end:
            raise ValueError(f"{value!r}: the end of a skip range cannot be smaller than its start (both >= 1)")
        parsed.append([start, end])
    merged: list[list[int]] = []
    for start, end in sorted(parsed):
        if merged and merged[-1][1] >= start:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
