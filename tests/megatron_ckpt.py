"""Hand-built Megatron-DeepSpeed checkpoints, written file by file with torch.save and the key names, TP splits and
file names of reference section 2.1, as Megatron-DeepSpeed itself writes them (not by our trainer): the saved args
carry Megatron's ``bias_gelu_fusion``/``openai_gelu``/``glu_activation`` and a ``megatron.enums.PositionEmbeddingType``
enum, which this interpreter cannot import (so readers must cope), and a list-valued ``data_path``."""

from __future__ import annotations

import argparse
import enum
import random
import sys
import types
from pathlib import Path

import numpy as np
import torch

REPLICATED = ("input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
              "post_attention_layernorm.bias", "self_attention.dense.bias", "mlp.dense_4h_to_h.bias")
ROW_PARALLEL = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")


def _megatron_enum():
    """``megatron.enums.PositionEmbeddingType`` as Megatron-DeepSpeed defines it, registered only while pickling."""
    module = types.ModuleType("megatron.enums")

    class PositionEmbeddingType(enum.Enum):
        rotary = 1
        absolute = 2
        alibi = 3

    PositionEmbeddingType.__module__ = "megatron.enums"
    PositionEmbeddingType.__qualname__ = "PositionEmbeddingType"
    module.PositionEmbeddingType = PositionEmbeddingType
    return module


def full_weights(arch: str, layers: int, hidden: int, ffn: int, padded_vocab: int, max_pos: int,
                 seed: int, scale: float = 1.0) -> dict[int, dict[str, torch.Tensor]]:
    """Layer index -> unsplit state dict (Megatron keys), fp32, with non-trivial LayerNorms and biases; ``scale``
    multiplies the weights' std 0.02 (larger weights, larger activations)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02 * scale, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    embedding = {"word_embeddings.weight": rand(padded_vocab, hidden)}
    if arch == "gpt2":
        embedding["position_embeddings.weight"] = rand(max_pos, hidden)
    else:
        embedding["word_embeddings.norm.weight"] = rand(hidden, std=0.1, mean=1.0)
        embedding["word_embeddings.norm.bias"] = rand(hidden, std=0.1)
    result = {1: embedding}
    for i in range(layers):
        result[3 + i] = {
            "input_layernorm.weight": rand(hidden, std=0.1, mean=1.0), "input_layernorm.bias": rand(hidden, std=0.1),
            "self_attention.query_key_value.weight": rand(3 * hidden, hidden),
            "self_attention.query_key_value.bias": rand(3 * hidden),
            "self_attention.dense.weight": rand(hidden, hidden), "self_attention.dense.bias": rand(hidden),
            "post_attention_layernorm.weight": rand(hidden, std=0.1, mean=1.0),
            "post_attention_layernorm.bias": rand(hidden, std=0.1),
            "mlp.dense_h_to_4h.weight": rand(ffn, hidden), "mlp.dense_h_to_4h.bias": rand(ffn),
            "mlp.dense_4h_to_h.weight": rand(hidden, ffn), "mlp.dense_4h_to_h.bias": rand(hidden),
        }
    result[layers + 4] = {"weight": rand(hidden, std=0.1, mean=1.0), "bias": rand(hidden, std=0.1)}
    return result


def split_tp(key: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Megatron's TP split of one tensor (column-parallel and vocabulary on dim 0, row-parallel on dim 1)."""
    if key.endswith(REPLICATED) or key in ("weight", "bias", "position_embeddings.weight") or ".norm." in key:
        return [tensor.clone() for _ in range(tp)]
    return [t.clone() for t in torch.chunk(tensor, tp, dim=1 if key.endswith(ROW_PARALLEL) else 0)]


def build_checkpoint(root: Path, *, arch: str, tp: int = 2, pp: int = 1, layers: int = 2, hidden: int = 64,
                     heads: int = 4, vocab: int = 2000, dtype: torch.dtype = torch.float16, max_pos: int = 32,
                     tokenizer_dir: str | Path = "", data_prefix: str | Path = "", iteration: int = 100,
                     seed: int = 0, scale: float = 1.0, **extra_args) -> Path:
    """Write ``root/global_step{iteration}`` (+ ``root/latest``) for a GPT-2 (``arch="gpt2"``: absolute position
    embeddings) or BLOOM (``"bloom"``: ALiBi + embedding LayerNorm) of the given shape; vocabulary padded to a
    multiple of 128 * TP, as Megatron does; ``scale`` as :func:`full_weights`; ``extra_args`` set or override saved
    args. Returns the step folder."""
    padded = -(-vocab // (128 * tp)) * 128 * tp
    ffn = 4 * hidden
    step = root / f"global_step{iteration}"
    step.mkdir(parents=True)
    for index, state in full_weights(arch, layers, hidden, ffn, padded, max_pos, seed, scale).items():
        for rank in range(tp):
            shard = {k: split_tp(k, v, tp)[rank].to(dtype) for k, v in state.items()}
            torch.save(shard, step / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")

    enums = _megatron_enum()
    sys.modules["megatron.enums"] = enums
    try:
        args = argparse.Namespace(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads, seq_length=max_pos,
            max_position_embeddings=max_pos,
            position_embedding_type=enums.PositionEmbeddingType["absolute" if arch == "gpt2" else "alibi"],
            embed_layernorm=arch == "bloom", padded_vocab_size=padded, make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bias_gelu_fusion=True, openai_gelu=False,
            glu_activation=None, apply_residual_connection_post_layernorm=False, layernorm_epsilon=1e-5,
            init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0, fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16, consumed_train_samples=iteration * 16, consumed_valid_samples=0,
            tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=str(tokenizer_dir), data_path=[str(data_prefix)],
            iteration=iteration,
        )
        vars(args).update(extra_args)
        for stage in range(pp):
            rng = {"random_rng_state": random.Random(stage).getstate(),
                   "np_rng_state": np.random.RandomState(stage).get_state(),
                   "torch_rng_state": torch.Generator().manual_seed(stage).get_state()}
            for rank in range(tp):
                mp = stage * tp + rank
                torch.save({"module": None, "buffer_names": [], "optimizer": None, "global_steps": iteration,
                            "dp_world_size": 1, "mp_world_size": tp * pp, "args": args, "checkpoint_version": 3.0,
                            "iteration": iteration, "tokens": iteration * 16 * max_pos,
                            "checkpoint_info": {"padded_vocab_size": padded, "original_vocab_size": vocab}, **rng},
                           step / f"mp_rank_{mp:02d}_model_states.pt")
                torch.save({"optimizer_state_dict": {"fp32_flat": torch.zeros(64)}},
                           step / f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt")
    finally:
        del sys.modules["megatron.enums"]
    (root / "latest").write_text(step.name)
    return step
