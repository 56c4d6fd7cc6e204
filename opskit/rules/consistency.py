"""Megatron's divisibility and consistency rules, written once for the spec (which names ``model.num_attention_heads``)
and the trainer (which names ``--num-attention-heads``).

Every rule returns the problems it finds as one-line messages (an empty list when the values pass) and takes a
:data:`Namer` saying how the caller's user wrote each setting. Keys are Megatron's flag names in snake_case, plus
``precision`` (``fp32``, ``fp16`` or ``bf16``). The trainer checks what it can know from its flags; the rules that
need the data-parallel size (the batch sizes) are the spec's, and the trainer meets them at run time through
:func:`opskit.rules.schedule.num_microbatches`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from opskit.rules.formats import parse_data_path, parse_skip_ranges, parse_split
from opskit.rules.model_size import splits_sequence

Namer = Callable[..., str]
"""``name(key)`` or ``name(key, value)``: the setting as its user wrote it, e.g. ``model.num_attention_heads 12`` in a
spec, ``--num-attention-heads 12`` on the trainer's command line."""


def flag_name(key: str, value: Any = None) -> str:
    """The trainer's :data:`Namer`: Megatron's flag spelling (``--num-attention-heads 12``; precision as ``--bf16``)."""
    if key == "precision":
        return {"fp16": "--fp16", "bf16": "--bf16"}.get(value, "fp32 (neither --fp16 nor --bf16)")
    flag = "--" + key.replace("_", "-")
    if value is None:
        return flag
    return f"{flag} {' '.join(str(v) for v in value) if isinstance(value, (list, tuple)) else value}"


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` > 0, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def listed(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def attention_problems(hidden_size: int, num_attention_heads: int, seq_length: int,
                       max_position_embeddings: int | None, name: Namer) -> list[str]:
    """Megatron's arguments.py asserts: the heads split the hidden size; the sequence fits the position table."""
    problems = []
    if hidden_size % num_attention_heads:
        problems.append(f"{name('hidden_size', hidden_size)} must be divisible by "
                        f"{name('num_attention_heads', num_attention_heads)}")
    if max_position_embeddings is not None and seq_length > max_position_embeddings:
        problems.append(f"{name('seq_length', seq_length)} exceeds "
                        f"{name('max_position_embeddings', max_position_embeddings)}")
    return problems


def tensor_parallel_problems(num_attention_heads: int, ffn_hidden_size: int, tp: int, name: Namer) -> list[str]:
    """Megatron splits the attention heads and the MLP's columns over TP (megatron/mpu ``divide`` asserts)."""
    tp_name = name("tensor_model_parallel_size", tp)
    if num_attention_heads % tp:
        return [f"{name('num_attention_heads', num_attention_heads)} is not divisible by {tp_name} (Megatron splits "
                f"heads over TP): use TP in {listed(divisors(num_attention_heads))}"]
    if ffn_hidden_size % tp:
        return [f"{name('ffn_hidden_size', ffn_hidden_size)} is not divisible by {tp_name}: use TP in "
                f"{listed(divisors(ffn_hidden_size))}"]
    return []


def recompute_problems(checkpoint_activations: bool, recompute_granularity: str | None, torch_compile: bool,
                       name: Namer) -> list[str]:
    """One recompute mode at a time (``--checkpoint-activations`` is full recompute); selective recompute is the
    eager model's (it hooks autograd's saved tensors, which a compiled graph does not expose; ``torch.compile``
    recomputes elementwise ops itself)."""
    if checkpoint_activations and recompute_granularity == "selective":
        return [f"{name('checkpoint_activations')} (full recompute) and {name('recompute_granularity', 'selective')} "
                "exclude each other: choose one"]
    if recompute_granularity == "selective" and torch_compile:
        return [f"{name('recompute_granularity', 'selective')} is for the eager model; with {name('torch_compile')} "
                "the compiler already recomputes the elementwise ops: leave it out"]
    return []


RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recompute, least first: none, selective (the LayerNorms' outputs and the MLP's activation), full (each
layer's forward again)."""


def recompute_mode(checkpoint_activations: bool, recompute_granularity: str | None) -> str:
    """The :data:`RECOMPUTE_MODES` entry of ``--checkpoint-activations`` / ``--recompute-granularity``."""
    return "full" if checkpoint_activations or recompute_granularity == "full" else recompute_granularity or "none"


def recomputes_fully(checkpoint_activations: bool, recompute_granularity: str | None) -> bool:
    """Whether each layer's forward runs again in the backward pass (Megatron's c = 4 in its FLOPs; selective
    recompute's elementwise ops are not counted, as Megatron-LM does not)."""
    return recompute_mode(checkpoint_activations, recompute_granularity) == "full"


def sequence_parallel_problems(sequence_parallel: bool, seq_length: int, tp: int, name: Namer) -> list[str]:
    """Sequence parallelism splits the sequence over TP (megatron-core's first-dimension scatter asserts)."""
    if splits_sequence(sequence_parallel, tp) and seq_length % tp:
        return [f"{name('sequence_parallel')} splits {name('seq_length', seq_length)} over "
                f"{name('tensor_model_parallel_size', tp)}: use a sequence length divisible by TP"]
    return []


TRAINER_PARTITION_METHOD = "type:transformer|embedding"
"""How opskit's trainer balances pipeline stages without ``--pp-partition-method``: transformer layers and the two
embeddings count alike (BLOOM-176B's choice), so any layer count splits."""


def pipeline_problems(num_layers: int, pp: int, pp_partition_method: str | None, name: Namer) -> list[str]:
    """Stages of DeepSpeed's PipelineModule: without a partition method the transformer layers split evenly over PP;
    with one (BLOOM-176B's ``type:transformer|embedding`` counts the two embeddings) no stage may be empty."""
    pp_name = name("pipeline_model_parallel_size", pp)
    if pp_partition_method is None and num_layers % pp:
        return [f"{name('num_layers', num_layers)} is not divisible by {pp_name}: use PP in "
                f"{listed(divisors(num_layers))}, or set {name('pp_partition_method')} (e.g. "
                "'type:transformer|embedding') to balance uneven stages"]
    if pp > num_layers + 2:
        return [f"{pp_name} exceeds the {num_layers} layers (+2 embeddings): some pipeline stages would be empty"]
    return []


def pad_vocab_problems(pad_vocab_size_to: int | None, make_vocab_size_divisible_by: int, tp: int,
                       vocab_size: int | None, name: Namer) -> list[str]:
    """``--pad-vocab-size-to``: Megatron-DeepSpeed's ``_vocab_size_with_padding`` (megatron/tokenizer/tokenizer.py)
    requires a multiple of ``make_vocab_size_divisible_by`` at least the tokenizer's vocabulary, and its
    VocabParallelEmbedding splits the rows over TP (``divide`` asserts), so a multiple of TP too. BLOOM-176B: 250880
    (128 * 1960, and 4 * 62720 rows per TP rank). ``vocab_size`` None: the vocabulary is not known yet (the trainer
    meets that rule when it reads its tokenizer, :func:`opskit.rules.model_size.padded_vocab_size`)."""
    if pad_vocab_size_to is None:
        return []
    multiple = math.lcm(make_vocab_size_divisible_by, tp)
    if pad_vocab_size_to % multiple:
        return [f"{name('pad_vocab_size_to', pad_vocab_size_to)} is not divisible by "
                f"{name('make_vocab_size_divisible_by', make_vocab_size_divisible_by)} and "
                f"{name('tensor_model_parallel_size', tp)} (Megatron-DeepSpeed's vocabulary padding rule): use "
                f"{math.ceil(pad_vocab_size_to / multiple) * multiple}"]
    if vocab_size is not None and pad_vocab_size_to < vocab_size:
        return [f"{name('pad_vocab_size_to', pad_vocab_size_to)} is below {name('vocab_size', vocab_size)}: it must "
                "hold every token"]
    return []


def world_size_problems(world_size: int, tp: int, pp: int, name: Namer, how: str = "") -> list[str]:
    """Megatron's ``initialize_model_parallel``: the world size (processes, one per GPU) must be a multiple of
    TP x PP, whose quotient is DP. ``how``: how the caller came to that many processes (`` (4 nodes x 8)``)."""
    if world_size % (tp * pp) == 0:
        return []
    return [f"{world_size} processes{how} are not divisible by TP*PP = {tp * pp} "
            f"({name('tensor_model_parallel_size', tp)}, {name('pipeline_model_parallel_size', pp)})"]


def rampup_problems(global_batch_size: int, rampup: tuple[int, int, int] | list[int] | None, name: Namer) -> list[str]:
    """``--rampup-batch-size start incr samples``: Megatron's RampupBatchsizeNumMicroBatches asserts that the start
    batch and the ramp-up samples are > 0 (it divides the samples by the increments; a start of 0 walks for ever)
    and that ``GBS - start`` is a positive multiple of the increment (megatron/microbatches.py)."""
    if rampup is None:
        return []
    start, incr, samples = rampup
    if start <= 0 or samples <= 0:
        return [f"{name('rampup_batch_size')} {' '.join(map(str, rampup))}: the start batch size and the ramp-up "
                "samples must be > 0 (Megatron divides the samples by the increments)"]
    if incr <= 0 or start > global_batch_size or (global_batch_size - start) % incr:
        return [f"{name('rampup_batch_size')}: global_batch_size - start = {global_batch_size - start} must be a "
                f"positive multiple of the increment {incr}"]
    return []


def train_length_problems(train_samples: int | None, train_iters: int | None, rampup: object | None,
                          name: Namer) -> list[str]:
    """Megatron's arguments.py: a run's length is ``--train-samples`` or ``--train-iters``, exactly one, and a batch
    ramp-up (counted in samples) needs ``--train-samples``."""
    if rampup is not None and train_iters is not None:
        return [f"{name('rampup_batch_size')} needs {name('train_samples')}: Megatron refuses --rampup-batch-size "
                f"with --train-iters (the ramp is counted in samples); replace {name('train_iters')} with "
                f"{name('train_samples')}"]
    if (train_samples is None) == (train_iters is None):
        return [f"set exactly one of {name('train_samples')} and {name('train_iters')} (Megatron's --train-samples "
                "/ --train-iters)"]
    return []


def valid_node_counts(gpus_per_node: int, tp: int, pp: int, micro_batch_size: int, batch_sizes: list[int]) -> list[int]:
    """Node counts whose data-parallel size lets every batch size in ``batch_sizes`` split into micro-batches.

    A layout is valid when ``nodes * gpus_per_node = TP * PP * DP`` and ``MBS * DP`` divides every batch size (for a
    ramp-up: the start, the increment and the final GBS, hence every GBS on the way). Source: Megatron's
    ``RampupBatchsizeNumMicroBatches`` divisibility assert; tr1-13B README ("we can do only DP_SIZE=16, which means
    that at most we can use 32 nodes").

    Returns:
        the valid node counts, ascending (empty when MBS divides no common batch size).
    """
    common = 0
    for size in batch_sizes:
        common = math.gcd(common, size)
    if common == 0 or common % micro_batch_size:
        return []
    nodes = set()
    for dp in divisors(common // micro_batch_size):
        world = dp * tp * pp
        if world % gpus_per_node == 0:
            nodes.add(world // gpus_per_node)
    return sorted(nodes)


def batch_sizes_of(global_batch_size: int, rampup: tuple[int, int, int] | list[int] | None) -> list[int]:
    """The batch sizes whose divisibility makes every GBS of the run divisible: the GBS, and a ramp-up's start and
    increment (every GBS of the ramp is ``start + k * increment``)."""
    return [global_batch_size, *(rampup[:2] if rampup is not None else ())]


def batch_problems(global_batch_size: int, rampup: tuple[int, int, int] | list[int] | None, micro_batch_size: int,
                   nodes: int, gpus_per_node: int, tp: int, pp: int, name: Namer) -> list[str]:
    """Every GBS of the run (a ramp-up's too) must split into micro-batches of ``MBS * DP`` samples (Megatron's
    ``current global batch size ... is not divisible`` assert, met hours into a ramp-up otherwise); the message lists
    the node counts that work (:func:`valid_node_counts`)."""
    dp = nodes * gpus_per_node // (tp * pp)
    mbs_dp = micro_batch_size * dp
    sizes = batch_sizes_of(global_batch_size, rampup)
    what = [name("global_batch_size"), f"{name('rampup_batch_size')} start", f"{name('rampup_batch_size')} increment"]
    bad = [(label, size) for label, size in zip(what[:len(sizes)], sizes, strict=True) if size % mbs_dp]
    if not bad:
        return []
    counts = valid_node_counts(gpus_per_node, tp, pp, micro_batch_size, sizes)
    if counts:
        fix = f"valid {name('nodes')} for this layout: {listed(counts)}"
    else:
        fix = (f"no node count works with micro_batch_size {micro_batch_size}: use a micro_batch_size that divides "
               f"{math.gcd(*sizes)}")
    return [f"{label} {size} is not divisible by micro_batch_size*DP = {mbs_dp} ({micro_batch_size}*{dp} at "
            f"{nodes} nodes); {fix}" for label, size in bad]


def curriculum_problems(min_difficulty: int, max_difficulty: int, difficulty_step: int | None, seq_length: int,
                        name: Namer) -> list[str]:
    """DeepSpeed's seqlen curriculum guide: difficulties in multiples of 8 (Tensor Core alignment), rising from
    ``min_difficulty`` to at most ``seq_length``; ``difficulty_step`` None for a schedule without one
    (``fixed_discrete``)."""
    problems = []
    if min_difficulty % 8:
        problems.append(f"{name('min_difficulty', min_difficulty)} is not a multiple of 8 (Tensor Core alignment, "
                        f"DeepSpeed's curriculum guide): use {min_difficulty // 8 * 8 or 8} or "
                        f"{(min_difficulty // 8 + 1) * 8}")
    if difficulty_step is not None and difficulty_step % 8:
        problems.append(f"{name('difficulty_step', difficulty_step)} is not a multiple of 8 (Tensor Core "
                        "alignment): use 8")
    if max_difficulty > seq_length:
        problems.append(f"{name('max_difficulty', max_difficulty)} exceeds {name('seq_length', seq_length)}: use "
                        f"{seq_length}")
    elif min_difficulty >= max_difficulty:
        problems.append(f"{name('min_difficulty', min_difficulty)} must be below {name('max_difficulty')} "
                        f"{max_difficulty}")
    return problems


def data_source_problems(data_path: str | list[str] | None, train_weighted_split_paths_path: str | None,
                         valid_weighted_split_paths_path: str | None, name: Namer) -> list[str]:
    """Megatron-DeepSpeed's data sources: exactly one of ``--data-path`` (a prefix, or a ``WEIGHT PREFIX ...`` blend)
    and ``--train-weighted-split-paths-path``, the latter with ``--valid-weighted-split-paths-path``."""
    if (data_path is None) == (train_weighted_split_paths_path is None):
        return [f"give either {name('data_path')} or {name('train_weighted_split_paths_path')} (with "
                f"{name('valid_weighted_split_paths_path')})"]
    if data_path is not None:
        try:
            parse_data_path([data_path] if isinstance(data_path, str) else list(data_path))
        except ValueError as e:
            return [f"{name('data_path')} {e}"]
    elif valid_weighted_split_paths_path is None:
        return [f"{name('train_weighted_split_paths_path')} needs {name('valid_weighted_split_paths_path')}"]
    return []


def tokenizer_problems(tokenizer_type: str, tokenizer_name_or_path: str | None, vocab_file: str | None,
                       merge_file: str | None, name: Namer) -> list[str]:
    """What each ``--tokenizer-type`` needs: PretrainedFromHF a folder or Hub name, GPT2BPETokenizer GPT-2's vocab and
    merges files."""
    if tokenizer_type == "PretrainedFromHF" and not tokenizer_name_or_path:
        return [f"{name('tokenizer_type', tokenizer_type)} needs {name('tokenizer_name_or_path')} (a folder or a Hub "
                "name)"]
    if tokenizer_type == "GPT2BPETokenizer" and not (vocab_file and merge_file):
        return [f"{name('tokenizer_type', tokenizer_type)} needs {name('vocab_file')} and {name('merge_file')} "
                "(gpt2-vocab.json, gpt2-merges.txt)"]
    return []


def partition_method_problems(pp_partition_method: str | None, name: Namer) -> list[str]:
    """DeepSpeed's ``PipelineModule(partition_method=...)``: ``parameters``, ``uniform`` or ``type:REGEX``."""
    method = pp_partition_method
    if method is None or method in ("parameters", "uniform") or method.startswith("type:"):
        return []
    return [f"{name('pp_partition_method', repr(method))}: use parameters, uniform or type:REGEX (e.g. "
            f"{TRAINER_PARTITION_METHOD})"]


def client_optimizer_problems(use_bnb_optimizer: bool, zero_stage: int, zero_allow_untested_optimizer: Any,
                              name: Namer) -> list[str]:
    """``--use-bnb-optimizer`` hands DeepSpeed a client optimizer (bitsandbytes' Adam8bit) that its ZeRO optimizer
    has not tested: with ZeRO > 0 DeepSpeed asserts unless the DeepSpeed JSON says
    ``"zero_allow_untested_optimizer": true``, as BigScience's tr8b-104B-bnb.slurm did (ZeRO-1; BNB Exp 3 ran
    ZeRO-0 with "no change, same trajectory"). Measured on DeepSpeed 0.19.8: with the key, ZeRO-1 trains and
    resumes."""
    if not use_bnb_optimizer or zero_stage == 0 or zero_allow_untested_optimizer is True:
        return []
    return [f"{name('use_bnb_optimizer')} with {name('zero_stage', zero_stage)} needs "
            "\"zero_allow_untested_optimizer\": true in the DeepSpeed config (DeepSpeed's ZeRO refuses optimizers it "
            f"has not tested; BigScience's tr8b-104B-bnb.slurm sets it), or {name('zero_stage', 0)}"]


def training_flag_problems(values: Mapping[str, Any], name: Namer) -> list[str]:
    """The rules on Megatron's free-standing training flags, read from ``values`` (flag names in snake_case; a missing
    key is the flag left out): ``--split`` weights, ``--skip-train-iteration-range`` ranges, and the two LR-scheduler
    switches, which exclude each other (Megatron's ``AnnealingLR``)."""
    problems = []
    if (split := values.get("split")) is not None:
        try:
            parse_split(split)
        except ValueError as e:
            problems.append(f"{name('split')} {e}")
    ranges = values.get("skip_train_iteration_range") or []
    try:  # a spec may give one range as a scalar, rendered as one value (flags.flag_problem); argparse gives strings
        parse_skip_ranges([str(r) for r in (ranges if isinstance(ranges, list) else [ranges])])
    except ValueError as e:
        problems.append(f"{name('skip_train_iteration_range')}: {e}")
    if values.get("override_lr_scheduler") and values.get("use_checkpoint_lr_scheduler"):
        problems.append(f"{name('override_lr_scheduler')} and {name('use_checkpoint_lr_scheduler')} are mutually "
                        "exclusive")
    return problems
