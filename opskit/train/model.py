"""GPT / BLOOM layers with Megatron-DeepSpeed's module and parameter names, read top to bottom.

Names matter: checkpoints must hold exactly Megatron-DeepSpeed's keys (``word_embeddings.weight``,
``word_embeddings.norm.weight``, ``self_attention.query_key_value.weight``, ...; reference section 2.1), so that
``opskit ckpt convert`` and Megatron-DeepSpeed's own tools read them. Activations flow as ``[batch, seq, hidden]``.

Sources: Megatron-LM / Megatron-DeepSpeed ``megatron/model/transformer.py`` and ``language_model.py`` (architecture and
initialisation), BLOOM (ALiBi slopes, embedding LayerNorm, tanh-approximate GELU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """The architecture, in Megatron's names. ``padded_vocab_size`` already includes Megatron's padding."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int
    position_embedding_type: str = "absolute"  # "absolute" (GPT-2) or "alibi" (BLOOM)
    embed_layernorm: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def init_normal(weight: torch.Tensor, std: float) -> None:
    """Megatron's init_method_normal: N(0, std)."""
    nn.init.normal_(weight, mean=0.0, std=std)


class WordEmbedding(nn.Module):
    """Token embedding ``weight [V_pad, h]``, with BLOOM's optional LayerNorm as ``.norm``
    (keys ``word_embeddings.norm.*``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.padded_vocab_size, cfg.hidden_size))
        init_normal(self.weight, cfg.init_method_std)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if cfg.embed_layernorm else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        x = F.embedding(tokens, self.weight)
        return self.norm(x) if self.norm is not None else x


class EmbeddingPipe(nn.Module):
    """Pipeline layer 1 (and, tied, the LM head): word (+ position) embeddings.

    Also serves as the output layer: :func:`lm_logits` multiplies by the same word-embedding matrix, as Megatron does.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = WordEmbedding(cfg)
        if cfg.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            init_normal(self.position_embeddings.weight, cfg.init_method_std)
        else:
            self.position_embeddings = None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] int -> [b, s, h]
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(positions)
        return self.embedding_dropout(x)


def lm_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output layer: ``[b, s, h] @ W_emb^T -> [b, s, V_pad]`` logits, in fp32 for the loss."""
    return F.linear(hidden, embedding.word_embeddings.weight).float()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes ``[num_heads]`` (Press et al. 2021): geometric from ``2^(-8/n)``; for a head count that is not
    a power of two, the closest power's slopes plus every other slope of the next power (as BLOOM does)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def attention_bias(cfg: GPTConfig, seq: int, device: torch.device) -> torch.Tensor:
    """Additive attention bias ``[heads or 1, s, s]``: causal mask (``-inf`` above the diagonal) plus, with ALiBi,
    ``slope_h * key_position`` (softmax is shift-invariant per row, so this equals ``-slope_h * (i - j)``)."""
    causal = torch.full((seq, seq), float("-inf"), device=device).triu(1)
    if cfg.position_embedding_type != "alibi":
        return causal.unsqueeze(0)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    return alibi_slopes(cfg.num_attention_heads).to(device)[:, None, None] * positions[None, None, :] + causal


class SelfAttention(nn.Module):
    """Fused QKV projection (rows ordered per head ``[head][q|k|v][head_dim]``, Megatron checkpoint_version >= 2.0)."""

    def __init__(self, cfg: GPTConfig, output_std: float):
        super().__init__()
        self.cfg = cfg
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        init_normal(self.query_key_value.weight, cfg.init_method_std)
        init_normal(self.dense.weight, output_std)
        nn.init.zeros_(self.query_key_value.bias)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        b, s, _ = x.shape
        heads, head_dim = self.cfg.num_attention_heads, self.cfg.head_dim
        qkv = self.query_key_value(x).view(b, s, heads, 3, head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # each [b, heads, s, head_dim]
        dropout = self.cfg.attention_dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout)
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """h -> ffn -> h with the tanh-approximate GELU of Megatron's fused bias-GELU (``gelu_fast`` / BLOOM's GELU)."""

    def __init__(self, cfg: GPTConfig, output_std: float):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        init_normal(self.dense_h_to_4h.weight, cfg.init_method_std)
        init_normal(self.dense_4h_to_h.weight, output_std)
        nn.init.zeros_(self.dense_h_to_4h.bias)
        nn.init.zeros_(self.dense_4h_to_h.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LayerNorm transformer block. The class name is the one DeepSpeed's ``type:transformer`` partitioning and
    activation checkpointing look for."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # Megatron's scaled_init_method_normal for the two output projections: std / sqrt(2 * num_layers).
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg, output_std)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, output_std)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        bias = attention_bias(self.cfg, x.shape[1], x.device)
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), bias))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class FinalLayerNorm(nn.LayerNorm):
    """Layer L+4: a bare LayerNorm, so its checkpoint keys are just ``weight`` and ``bias``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_epsilon)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits ``[b, s, V_pad]`` fp32, labels ``[b, s]`` -> scalar (nats per token)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
