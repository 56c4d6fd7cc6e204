"""Correctness of the GPU ALiBi path: FlexAttention (opskit.train.model.flex_alibi_attention) against SDPA with the
materialised bias (the CPU path), on random inputs, in fp32 and bf16. Prints the relative L2 error per case."""

import torch
import torch.nn.functional as F

from opskit.train.model import GPTConfig, attention_bias, flex_alibi_attention

for heads, seq, dtype in [(16, 2048, torch.float32), (16, 2048, torch.bfloat16), (12, 1024, torch.bfloat16)]:
    cfg = GPTConfig(num_layers=1, hidden_size=heads * 128, num_attention_heads=heads, ffn_hidden_size=4,
                    seq_length=seq, max_position_embeddings=seq, padded_vocab_size=128,
                    position_embedding_type="alibi")
    q, k, v = (torch.randn(2, heads, seq, 128, device="cuda", dtype=dtype) for _ in range(3))
    got = flex_alibi_attention(q, k, v, cfg).double()
    bias = attention_bias(cfg, seq, q.device)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    error = ((got - ref).norm() / ref.norm()).item()
    print(f"flex alibi heads={heads} seq={seq} {dtype}: relative error {error:.2e}")
    assert error < (1e-3 if dtype == torch.float32 else 1e-2), error
