"""The peer of issue 19 goal 3: the 1.3B GPT-2 shape of bench/bare_gpt.py trained the way megatron-core's own users
train it, one process, one GPU, TP = PP = 1, no Transformer Engine, no apex (as on the GPU machines).

Model: megatron-core's ``GPTModel`` built from ``get_gpt_layer_local_spec()`` (its non-TE layers: ColumnParallelLinear /
RowParallelLinear, torch LayerNorm, and its own unfused ``DotProductAttention``: baddbmm, masked softmax in torch,
bmm), learned absolute positions, tied embeddings, GeLU MLP 4h with Megatron-LM's default fused bias-GeLU (tanh GeLU,
torch.compile'd by megatron-core's jit_fuser) and bias-dropout-add fusion, no dropout, bf16 through ``Float16Module``
with Megatron-LM's causal attention mask from the data loader. Training: megatron-core's ``DistributedDataParallel``
(fp32 gradient buffer and reduction, overlapped reduction), its ``DistributedOptimizer`` from
``get_megatron_optimizer`` (Adam, lr 1e-4, clip 1.0; without TE/apex megatron-core falls back to torch's AdamW) and
its ``get_forward_backward_func`` schedule over ``GAS`` micro-batches of random tokens per optimizer step.

Environment (as bench/bare_gpt.py): ``MBS``, ``GAS``, ``STEPS`` (timed optimizer steps after 4 warm-up steps),
``PEAK`` (FLOP/s for MFU, default H100 dense bf16), ``ATTN=sdpa`` (swap the spec's core attention for
``F.scaled_dot_product_attention``: not megatron-core's own, it shows what the attention costs; name "mcore-gpt-sdpa").
megatron-core needs CUDA (its schedule, buffers, clipping and RNG tracker allocate on "cuda"). Prints one JSON line.

The peer of issue 33 (tr11's layout, bench/pipeline_layout.py's shape) runs under torchrun with ``TP``, ``PP`` and
the shape in ``LAYERS``, ``HIDDEN``, ``HEADS``, ``SEQ`` (default: the 1.3B GPT-2), ``RECOMPUTE=full`` (megatron-
core's full, uniform recompute of every layer, as ``--checkpoint-activations``) and ``SP=1`` (its sequence
parallelism, as ``--sequence-parallel``: its local layer spec refuses it, it needs Transformer Engine's or Apex's
LayerNorm, neither on the lent GPU machines, 2026-11-28); its pipeline schedule is megatron-
core's 1F1B with batched p2p. megatron-core has no ALiBi: the peer keeps learned positions (cheaper than ALiBi's bias).
The last pipeline stage prints the line, with MFU per GPU.

Usage (GPU machine)::

    MBS=4 GAS=16 STEPS=12 python bench/mcore_gpt.py
    python bench/trainer_throughput.py mcore bare --mbs 4 --gas 16
    TP=2 PP=2 LAYERS=30 HIDDEN=4096 HEADS=32 MBS=2 GAS=16 RECOMPUTE=full ATTN=sdpa \
        torchrun --nproc_per_node 4 bench/mcore_gpt.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_throughput  # noqa: E402
from trainer_throughput import PEAK_FLOPS, VOCAB, median_step_seconds, step_result  # noqa: E402

from opskit.rules.model_size import megatron_flops_per_iteration, padded_vocab_size  # noqa: E402

TP, PP = int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
L = int(os.environ.get("LAYERS", trainer_throughput.L))
H = int(os.environ.get("HIDDEN", trainer_throughput.H))
HEADS = int(os.environ.get("HEADS", trainer_throughput.HEADS))
S = int(os.environ.get("SEQ", trainer_throughput.S))
V = padded_vocab_size(VOCAB, 128, TP)
RECOMPUTE = os.environ.get("RECOMPUTE", "none")
SP = os.environ.get("SP") == "1"  # megatron-core's sequence_parallel (TP > 1), as opskit's --sequence-parallel
MBS = int(os.environ.get("MBS", "4"))
GAS = int(os.environ.get("GAS", "1"))
STEPS = int(os.environ.get("STEPS", "12"))
WARM = 4
SDPA = os.environ.get("ATTN") == "sdpa"


def sdpa_attention():
    """A core-attention module for the layer spec: q, k, v [s, b, heads, head_dim] -> [s, b, hidden], causal."""
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **_) -> None:
            super().__init__(config=config)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPAttention


def build():
    """Process groups, the DDP-wrapped bf16 model and its distributed optimizer, as Megatron-LM's get_model does."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module

    if "WORLD_SIZE" in os.environ:  # torchrun
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    else:
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if (
        RECOMPUTE == "full") else {}
    config = TransformerConfig(
        num_layers=L, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=4 * H, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, sequence_parallel=SP and TP > 1,
        attention_backend=AttnBackend.local, bias_activation_fusion=True, bias_dropout_fusion=True, **recompute)
    spec = get_gpt_layer_local_spec()
    if SDPA:
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention()
    gpt = GPTModel(config, spec, vocab_size=V, max_sequence_length=S, share_embeddings_and_output_weights=True,
                   position_embedding_type="learned_absolute", pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage()).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0,
        use_distributed_optimizer=True), [model])
    return model, optimizer


def batches():
    """Endless micro-batches of random tokens, rotated over four: input, labels, positions and the causal mask."""
    positions = torch.arange(S, device="cuda").expand(MBS, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]  # True: masked
    tokens = [torch.randint(0, V, (MBS, S + 1), device="cuda") for _ in range(4)]
    return itertools.cycle([(t[:, :-1].contiguous(), t[:, 1:].contiguous(), positions, mask) for t in tokens])


def forward_step(data, model):
    """The schedule's forward step: the model's per-token fp32 loss [b, s] and its mean as the micro-batch loss."""
    tokens, labels, positions, mask = next(data)
    per_token = model(tokens, positions, mask, labels=labels)
    return per_token, lambda out: (out.mean(), {"lm loss": out.detach().mean()})


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, optimizer = build()
    forward_backward, data = get_forward_backward_func(), batches()

    def step() -> torch.Tensor:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                  num_microbatches=GAS, seq_length=S, micro_batch_size=MBS)
        ok, _, _ = optimizer.step()
        assert ok, "megatron-core's optimizer skipped the step"
        return torch.stack([d["lm loss"] for d in losses]).mean() if losses else None

    seconds, loss = median_step_seconds(step, WARM, STEPS)
    name = "mcore-gpt-sdpa" if SDPA else "mcore-gpt"
    if TP * PP == 1:
        print(json.dumps(step_result(name, MBS, GAS, seconds, loss)), flush=True)
    elif parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        print(json.dumps(layout_result(name, seconds, loss)), flush=True)
    torch.distributed.destroy_process_group()


def layout_result(name: str, seconds: float, loss: torch.Tensor) -> dict:
    """bench/pipeline_layout.py's row for this run: seconds per iteration, tokens/s, MFU per GPU (Megatron's model
    FLOPs without recompute), this GPU's peak memory (GiB)."""
    gbs = MBS * GAS * torch.distributed.get_world_size() // (TP * PP)
    flops = megatron_flops_per_iteration(gbs, S, L, H, V, recompute=False)
    return {"name": name, "tp": TP, "pp": PP, "sp": SP, "recompute": RECOMPUTE, "micro_batches": GAS, "mbs": MBS,
            "s_per_iter": round(seconds, 4), "tokens_per_s": round(gbs * S / seconds),
            "mfu_per_gpu": round(flops / seconds / torch.distributed.get_world_size() / PEAK_FLOPS, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "loss": round(loss.item(), 3)}


if __name__ == "__main__":
    main()
