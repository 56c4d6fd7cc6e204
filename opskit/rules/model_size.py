"""Sizes and FLOPs of Megatron's GPT model that the spec, the planner and the trainer all compute."""

from __future__ import annotations

from opskit.errors import OpskitError


class VocabPaddingError(OpskitError, ValueError):
    """``--pad-vocab-size-to`` below the tokenizer's vocabulary: Megatron-DeepSpeed refuses it."""


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int,
                      pad_vocab_size_to: int | None = None) -> int:
    """Megatron-DeepSpeed's ``_vocab_size_with_padding`` (megatron/tokenizer/tokenizer.py): ``pad_vocab_size_to``
    when given, else the next multiple of ``make_vocab_size_divisible_by * TP`` (50257 -> 50432 at 128 * 2). The
    divisibility of ``pad_vocab_size_to`` is :func:`opskit.rules.consistency.pad_vocab_problems`'s.

    Raises:
        VocabPaddingError: ``pad_vocab_size_to`` below ``vocab_size`` (names both numbers).
    """
    if pad_vocab_size_to is not None:
        if pad_vocab_size_to < vocab_size:
            raise VocabPaddingError(f"{pad_vocab_size_to} is smaller than the tokenizer's vocabulary ({vocab_size})")
        return pad_vocab_size_to
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def has_embedding_layernorm(embed_layernorm: bool, use_bnb_optimizer: bool) -> bool:
    """Whether a LayerNorm follows the word embedding (checkpoint keys ``word_embeddings.norm.weight`` / ``.bias`` in
    the embedding's layer file): with ``--embed-layernorm`` (BLOOM), and with ``--use-bnb-optimizer``, under which
    Megatron-DeepSpeed's VocabParallelEmbedding is bitsandbytes' StableEmbedding (megatron/mpu/layers.py: a norm
    ``if args.use_bnb_optimizer or args.embed_layernorm``)."""
    return bool(embed_layernorm or use_bnb_optimizer)


def splits_sequence(sequence_parallel: bool, tp: int) -> bool:
    """Whether ``--sequence-parallel`` splits anything: only at TP > 1 (Megatron-LM turns it off at TP = 1, where
    there is no rank to split over)."""
    return sequence_parallel and tp > 1


def megatron_flops_per_iteration(batch_size: int, seq: int, layers: int, hidden: int, vocab: int,
                                 recompute: bool) -> float:
    """Model FLOPs of one iteration: ``24 c B s l h^2 (1 + s/(6h) + V/(16 l h))``, c = 4 with activation recompute
    else 3 (Narayanan et al. 2021, eq. 3; Megatron-DeepSpeed's TFLOPs estimate in its log line). ``vocab`` is the
    padded vocabulary."""
    c = 4 if recompute else 3
    return 24 * c * batch_size * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def resumed_padded_vocab_size(saved_padded_vocab_size: int, tensor_parallel_size: int) -> int:
    """The padded vocabulary of a resume on another TP degree: the checkpoint's when the new TP divides it (its
    trained padding rows are kept, so the resume continues exactly), else the next multiple of TP (the rows added
    start at zero: DeepSpeed's universal checkpoint loader pads the vocabulary tensor so). The vocab-parallel
    embedding needs only TP to divide it; ``make_vocab_size_divisible_by`` is a speed rule for a fresh start."""
    return -(-saved_padded_vocab_size // tensor_parallel_size) * tensor_parallel_size
