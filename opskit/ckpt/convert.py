"""Convert a Megatron-DeepSpeed checkpoint step into a Hugging Face ``BloomForCausalLM`` folder.

Key mapping (as transformers' ``convert_bloom_original_checkpoint_to_pytorch.py``): ``layer_01``
``word_embeddings.weight`` -> ``transformer.word_embeddings.weight``, ``word_embeddings.norm.*`` ->
``transformer.word_embeddings_layernorm.*``; block ``layer_{3+i}`` keys -> ``transformer.h.{i}.<same key>`` (BLOOM's
fused QKV uses Megatron's per-head ``[q|k|v]`` row order, so no reordering); final LayerNorm ``layer_{L+4}``
``weight/bias`` -> ``transformer.ln_f.*``; ``lm_head`` is tied to the word embeddings. The padded vocabulary is kept.

The output is written to a temporary folder and renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.layout import (
    EMBEDDING_LAYER,
    FIRST_BLOCK_LAYER,
    CheckpointFormatError,
    StepDir,
    final_norm_layer,
    load_args,
    merged_layers,
    resolve_step_dir,
    scan_step_dir,
)
from opskit.fsutil import replace_dir

DTYPES = ("fp32", "fp16", "bf16")


class ConvertError(ValueError):
    """A checkpoint this converter cannot turn into the asked format; one line saying why."""


@dataclass(frozen=True)
class Converted:
    out_dir: Path
    step_dir: Path
    iteration: int
    num_parameters: int


def bloom_state_dict(step: StepDir, num_layers: int) -> dict:
    """Merged HF ``BloomForCausalLM`` state dict (without the tied ``lm_head``).

    Raises:
        CheckpointFormatError: a layer file is missing (named) or unreadable. ConvertError: not a BLOOM.
    """
    final_norm = final_norm_layer(num_layers)
    expected = {EMBEDDING_LAYER, final_norm, *range(FIRST_BLOCK_LAYER, FIRST_BLOCK_LAYER + num_layers)}
    missing = sorted(expected - set(step.layers))
    if missing:  # an incomplete checkpoint (a save killed half-way, a partial copy): name the file, before loading
        raise CheckpointFormatError(f"{step.path / f'layer_{missing[0]:02d}-model_00-model_states.pt'}: no such "
                                    f"file; a {num_layers}-layer checkpoint has layer files {sorted(expected)}")
    if set(step.layers) != expected:
        raise ConvertError(f"{step.path}: layer files {sorted(step.layers)}, expected {sorted(expected)} for "
                           f"{num_layers} layers")
    layers = merged_layers(step)
    embedding = layers[EMBEDDING_LAYER]
    if "word_embeddings.norm.weight" not in embedding:
        raise ConvertError(f"{step.path}: no embedding LayerNorm; BLOOM needs a run with --embed-layernorm")
    if "position_embeddings.weight" in embedding:
        raise ConvertError(f"{step.path}: absolute position embeddings; BLOOM needs --position-embedding-type alibi")
    state = {
        "transformer.word_embeddings.weight": embedding["word_embeddings.weight"],
        "transformer.word_embeddings_layernorm.weight": embedding["word_embeddings.norm.weight"],
        "transformer.word_embeddings_layernorm.bias": embedding["word_embeddings.norm.bias"],
        "transformer.ln_f.weight": layers[final_norm]["weight"],
        "transformer.ln_f.bias": layers[final_norm]["bias"],
    }
    for i in range(num_layers):
        for key, tensor in layers[FIRST_BLOCK_LAYER + i].items():
            state[f"transformer.h.{i}.{key}"] = tensor
    return state


def bloom_config(args: argparse.Namespace, dtype: str):
    """``BloomConfig`` from the saved training args. BLOOM's MLP is fixed at 4h, so other FFN sizes are refused."""
    from transformers import BloomConfig

    if args.ffn_hidden_size != 4 * args.hidden_size:
        raise ConvertError(f"ffn_hidden_size {args.ffn_hidden_size} != 4 * hidden_size; BLOOM's MLP is fixed at 4h")
    return BloomConfig(
        vocab_size=args.padded_vocab_size,
        hidden_size=args.hidden_size,
        n_layer=args.num_layers,
        n_head=args.num_attention_heads,
        layer_norm_epsilon=1e-5,
        initializer_range=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        apply_residual_connection_post_layernorm=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
        pretraining_tp=1,
        slow_but_exact=False,
        architectures=["BloomForCausalLM"],
        dtype={"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype],
    )


def convert_to_bloom(path: str | Path, out_dir: str | Path, step: int | None = None, dtype: str = "fp32",
                     tokenizer_dir: str | Path | None = None) -> Converted:
    """Convert ``path`` (run checkpoint dir or ``global_stepN``) to an HF BLOOM folder at ``out_dir``.

    Args:
        path: checkpoint dir with ``latest``, or a step folder.
        out_dir: destination; replaced atomically if it exists.
        step: convert ``global_step{step}`` instead of ``latest``.
        dtype: ``fp32``, ``fp16`` or ``bf16`` weights.
        tokenizer_dir: tokenizer folder; default: the saved ``--tokenizer-name-or-path``.

    Raises:
        ConvertError, CheckpointFormatError: unusable input, with the file and the reason.
    """
    import torch
    from transformers import AutoTokenizer, BloomForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would garble the CLI's status line
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    step_dir = scan_step_dir(resolve_step_dir(path, step))
    args = load_args(step_dir)
    tokenizer_dir = tokenizer_dir or getattr(args, "tokenizer_name_or_path", None)
    if tokenizer_dir is None:  # trained from GPT-2's vocab/merges files (--tokenizer-type GPT2BPETokenizer)
        raise ConvertError(f"{step_dir.path}: trained with --tokenizer-type {args.tokenizer_type}, no tokenizer "
                           "folder saved (pass --tokenizer DIR)")
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ConvertError(f"{tokenizer_dir}: no tokenizer.json (pass --tokenizer DIR)")
    config = bloom_config(args, dtype)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    state = {k: v.to(torch_dtype) for k, v in bloom_state_dict(step_dir, args.num_layers).items()}
    model = BloomForCausalLM(config).to(torch_dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the word embeddings
    if missing or unexpected:
        raise ConvertError(f"{step_dir.path}: keys missing in the checkpoint {missing}, unexpected {unexpected}")
    model.tie_weights()

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(staging)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(staging)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Converted(out_dir, step_dir.path, step_dir.iteration, sum(t.numel() for t in state.values()))
