"""The bare model of issue 19: a plain ~1.3B GPT (or BLOOM-style ALiBi) compiled whole with torch.compile, trained
under the same DeepSpeed ZeRO-1 bf16 config as opskit's trainer, one process, one GPU. Adapted from the reference
baseline ``shared/tools/gpu_baseline.py`` (its ``mini-compile`` run), so that bench/trainer_throughput.py runs it beside
the trainer in one call.

Environment: ``MBS`` (micro-batch), ``GAS`` (micro-batches per optimizer step), ``STEPS`` (timed optimizer steps after
4 warm-up steps), ``ALIBI=1`` (BLOOM's ALiBi through FlexAttention instead of GPT-2's learned positions),
``PEAK`` (FLOP/s, default H100 dense bf16), ``PROFILE=N`` (profile N steps after the timed ones with torch.profiler and
print the kernel table and GPU busy time, as bench/profile_step.py does for the trainer). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import HEADS as NH  # noqa: E402
from trainer_throughput import PADDED_VOCAB as V  # noqa: E402
from trainer_throughput import H, L, S, median_step_seconds, step_result  # noqa: E402

MBS = int(os.environ.get("MBS", "4"))
GAS = int(os.environ.get("GAS", "1"))
STEPS = int(os.environ.get("STEPS", "12"))
WARM = 4
ALIBI = os.environ.get("ALIBI") == "1"
PROFILE = int(os.environ.get("PROFILE", "0"))


def alibi_attention():
    """FlexAttention with the ALiBi bias ``slope_h * (k - q)`` and a causal block mask (BLOOM's attention)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    slopes = torch.tensor([2 ** (-8 * (i + 1) / NH) for i in range(NH)], device="cuda")
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, S, S, device="cuda")
    return lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_),
                                          block_mask=mask)


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.attention = attention
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, NH, H // NH).unbind(2)
        y = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, H))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class BareGPT(nn.Module):
    """Tied embeddings, learned positions unless ALiBi, pre-LN blocks, fp32 cross-entropy over shifted tokens."""

    def __init__(self) -> None:
        super().__init__()
        attention = alibi_attention() if ALIBI else causal_sdpa
        self.wte = nn.Embedding(V, H)
        self.wpe = None if ALIBI else nn.Embedding(S, H)
        self.emb_ln = nn.LayerNorm(H) if ALIBI else None  # BLOOM's embedding LayerNorm
        self.blocks = nn.ModuleList(Block(attention) for _ in range(L))
        self.ln = nn.LayerNorm(H)

    def forward(self, idx):
        x = self.wte(idx)
        x = self.emb_ln(x) if ALIBI else x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.wte.weight)
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), idx[:, 1:].reshape(-1))


def main() -> None:
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    model = BareGPT().cuda().to(torch.bfloat16)
    compiled = torch.compile(model)
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = [torch.randint(0, V, (MBS, S), device="cuda") for _ in range(4)]  # rotated: no single cached input

    def step() -> torch.Tensor:
        for i in range(GAS):  # DeepSpeed steps the optimizer at the accumulation boundary only
            loss = compiled(tokens[i % len(tokens)])
            engine.backward(loss)
            engine.step()
        return loss

    seconds, loss = median_step_seconds(step, WARM, STEPS)
    result = step_result("bare-bloom" if ALIBI else "bare-gpt", MBS, GAS, seconds, loss)
    if PROFILE:
        from profile_step import busy_fraction

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        busy, kernels = busy_fraction(prof, PROFILE)
        print(f"PROFILED: GPU busy {busy:.1f} ms/iteration, kernel time {kernels:.1f} ms/iteration")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
