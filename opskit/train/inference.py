"""The trainer's model as one plain module, loaded from a checkpoint step: the reference that conversions are
checked against (same layers, same code as training, TP shards merged)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from opskit.ckpt.format.layout import (
    EMBEDDING_LAYER,
    FIRST_BLOCK_LAYER,
    final_norm_layer,
    load_args,
    merged_layers,
    resolve_step_dir,
    scan_step_dir,
)
from opskit.train.model import EmbeddingPipe, FinalLayerNorm, GPTConfig, ParallelTransformerLayerPipe, lm_logits


class GPTModel(nn.Module):
    """Embedding -> blocks -> final LayerNorm -> tied LM head; ``forward(tokens [b, s]) -> logits [b, s, V_pad]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.embedding = EmbeddingPipe(cfg)
        self.blocks = nn.ModuleList(ParallelTransformerLayerPipe(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = FinalLayerNorm(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return lm_logits(self.embedding, self.final_layernorm(x)).float()

    @classmethod
    def from_checkpoint(cls, path: str | Path, step: int | None = None, num_layers: int | None = None) -> GPTModel:
        """Load a run's ``latest`` (or ``global_step{step}``) or a step folder, any TP/PP, in eval mode.
        ``num_layers``: only the first N blocks (embedding, N blocks, final LayerNorm), to check a model too large to
        load whole."""
        step_dir = scan_step_dir(resolve_step_dir(path, step))
        args = load_args(step_dir)
        blocks = args.num_layers if num_layers is None else min(num_layers, args.num_layers)
        cfg = GPTConfig(
            num_layers=blocks, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings, padded_vocab_size=args.padded_vocab_size,
            position_embedding_type=getattr(args, "position_embedding_type", "absolute"),
            embed_layernorm=getattr(args, "embed_layernorm", False),
            stable_embedding=getattr(args, "use_bnb_optimizer", False),
            init_method_std=args.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
            layernorm_epsilon=getattr(args, "layernorm_epsilon", 1e-5),
        )
        model = cls(cfg)
        final = final_norm_layer(args.num_layers)
        wanted = {EMBEDDING_LAYER, final, *range(FIRST_BLOCK_LAYER, FIRST_BLOCK_LAYER + blocks)}
        layers = merged_layers(step_dir, wanted)
        model.embedding.load_state_dict(layers[EMBEDDING_LAYER])
        for i, block in enumerate(model.blocks):
            block.load_state_dict(layers[FIRST_BLOCK_LAYER + i])
        model.final_layernorm.load_state_dict(layers[final])
        return model.eval()
