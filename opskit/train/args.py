"""The trainer's command line, with Megatron-DeepSpeed's flag names and semantics (reference section 2.4).

The parsed ``argparse.Namespace`` is saved in every checkpoint as ``args``, as Megatron-DeepSpeed does, so the
attribute names are Megatron's too (``consumed_train_samples``, ``padded_vocab_size``, ...).
"""

from __future__ import annotations

import argparse
import sys


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
    p = _OneLineParser(
        prog="python -m opskit.train",
        description="Megatron-DeepSpeed-style GPT/BLOOM pretraining (DeepSpeed pipeline engine).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["absolute", "alibi"], default="absolute")
    g.add_argument("--embed-layernorm", action="store_true", help="LayerNorm after the word embedding (BLOOM)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--pad-vocab-size-to", type=int, default=None)
    g.add_argument("--fp16", action="store_true", help="fp16 with DeepSpeed's loss scaling (the DeepSpeed config's "
                   "fp16 block; default dynamic, initial scale 2^12)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="accepted, no effect: as in Megatron-DeepSpeed, the DeepSpeed config's fp16.loss_scale "
                        "governs (0 = dynamic)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sync-tp-duplicated-parameters", action="store_true",
                   help="average the parameters every TP rank holds a copy of (LayerNorms, row-parallel biases, "
                        "position embeddings) over the TP group after every step, so they stay bitwise equal")
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility; DeepSpeed is always used")
    g.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON; missing keys are filled from the flags")
    g.add_argument("--zero-stage", type=int, choices=[0, 1], default=1)
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="accepted, no effect: --checkpoint-activations always uses DeepSpeed's (pipeline) activation "
                        "checkpointing")
    g.add_argument("--pp-partition-method", default=None,
                   help="DeepSpeed PipelineModule partition_method: parameters, uniform or type:REGEX "
                        "(default: type:transformer|embedding, BLOOM-176B's)")
    g.add_argument("--abort-on-unmet-fused-kernel-constraints", action="store_true",
                   help="accepted, no effect: this trainer has no fused softmax kernels whose constraints could fail")
    g.add_argument("--torch-compile", action="store_true",
                   help="opskit extension: torch.compile each transformer layer (GPUs)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo on CPU")

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--train-samples", type=int, required=True)
    g.add_argument("--train-tokens", type=int, default=None,
                   help="accepted, no effect, as in Megatron-DeepSpeed since its PR #177: --train-samples ends "
                        "training")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="decay the LR over this many consumed tokens instead of samples (curriculum learning: "
                        "shorter sequences early); warmup stays in samples")
    g.add_argument("--override-lr-scheduler", action="store_true")
    g.add_argument("--use-checkpoint-lr-scheduler", action="store_true")
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None, nargs="+",
                   help="indexed dataset prefix (without .bin/.idx), or a blend: WEIGHT PREFIX WEIGHT PREFIX ... "
                        "(weights are normalised; each prefix is split by --split on its own)")
    g.add_argument("--train-weighted-split-paths-path", default=None,
                   help="instead of --data-path: a file holding one group \"NAME: WEIGHT START:END PREFIX, ...\" "
                        "(BigScience's catalogue blend; START:END are fractions of each dataset's documents)")
    g.add_argument("--valid-weighted-split-paths-path", default=None,
                   help="the validation groups, same format, one or more \"NAME: ...\" groups on one line; each is "
                        "evaluated and printed under its NAME")
    g.add_argument("--data-impl", choices=["mmap"], default="mmap")
    g.add_argument("--tokenizer-type", choices=["PretrainedFromHF", "GPT2BPETokenizer"], default="PretrainedFromHF")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="PretrainedFromHF: a folder with tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--num-workers", type=int, default=2,
                   help="accepted, no effect: samples are read from the mmap in the training process (no DataLoader)")
    g.add_argument("--valid-num-workers", type=int, default=2,
                   help="accepted, no effect: validation samples are read in the training process too")
    g.add_argument("--split", default="969, 30, 1",
                   help="train,valid,test weights: the documents, in index order, are cut proportionally "
                        "(Megatron's rule; default 969, 30, 1)")

    g = p.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validate every N iterations and at the end of training (default: never)")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches of the valid split per validation (default 100)")

    g = p.add_argument_group("checkpoints and exit")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--kill-switch-path", default=None, help="if this file exists: save and exit")
    g.add_argument("--finished-flag-path", default=None,
                   help="opskit extension: written (atomically, by rank 0) once --train-samples are consumed; a job "
                        "chain's later tasks exit at start while it exists")
    g.add_argument("--skip-train-iteration-range", nargs="+", default=None, metavar="START-END",
                   help="skip the global batches of data these iterations would have trained on (e.g. 101-200 "
                        "251-300); iteration, LR and consumed samples do not advance")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="accepted; batch-size/batch-size (+ vs samples) is always written")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="accepted, no effect: the trainer keeps no Megatron timers to write")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write 'lm-loss-validation/lm loss validation ppl'")
    g.add_argument("--codecarbon-dir", default=None,
                   help="CodeCarbon's offline emissions CSVs (emissions-RANK.csv) go here, when the codecarbon "
                        "package is installed (pip install codecarbon); otherwise a warning and training goes on")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; a bad combination exits with argparse's one-line ``error:`` message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    args.params_dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    if args.skip_train_iteration_range is not None:
        args.skip_train_iteration_range = parse_skip_ranges(args.skip_train_iteration_range)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are mutually exclusive")
    if args.hidden_size % args.num_attention_heads:
        parser.error(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                     f"{args.num_attention_heads}")
    if args.max_position_embeddings and args.seq_length > args.max_position_embeddings:
        parser.error(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                     f"{args.max_position_embeddings}")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        parser.error(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size and args.ffn_hidden_size % tp:
        parser.error(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.pad_vocab_size_to and args.pad_vocab_size_to % tp:
        parser.error(f"--pad-vocab-size-to {args.pad_vocab_size_to} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if args.zero_stage == 0 and args.pipeline_model_parallel_size > 1 and args.clip_grad > 0 and not args.bf16:
        # Measured (tests/test_train.py): the clipping norm then counts stage 0's gradients only, so PP>1 drifts.
        parser.error("--zero-stage 0 with --pipeline-model-parallel-size > 1 clips gradients with stage 0's norm "
                     "only (DeepSpeed 0.19.8); use --zero-stage 1, or --clip-grad 0")
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
