"""A second peer for issue 19 goal 3: torchtitan 0.2.2's Llama 3 at the Llama 3.2 1B shape, trained with
torchtitan's own parallelisation and training step, one process, one GPU, outside its ``Trainer`` (whose data
loader needs datasets and pyarrow: more than a GPU-machine call can carry;
docs/benchmarks.md#against-megatron-core-and-torchtitan). 0.2.2, not 0.3.0: 0.3.0 needs a newer PyTorch than the GPU
image's 2.11 (``torch.distributed.fsdp.DataParallelMeshDims``).

What is torchtitan's: the model (``Transformer``: RMSNorm, RoPE theta 500,000, grouped-query SDPA attention, SwiGLU;
here dim 2048, 16 layers, 32 heads with 8 KV heads, FFN multiplier 1.5, vocabulary 128,256: Llama 3.2 1B, whose
output layer torchtitan does not tie to the embedding: 1.50B parameters, 8.22 GFLOP per token), ``parallelize_llama``
under its default ``JobConfig`` except ``compile.enable`` (each transformer block and the loss compiled) and
``activation_checkpoint.mode = "none"`` (its default recomputes; opskit's runs here do not), its weight init, its
``maybe_enable_amp`` (one GPU: no FSDP, so fp32 parameters under bf16 autocast, as its trainer does), its summed
cross-entropy over the step's valid tokens, its ``build_optimizers`` (AdamW, lr 8e-4, weight decay 0.1, fused) and
its gradient clipping (``clip_grad_norm_``, max norm 1.0), in its ``train_step``'s order.

MFU: Megatron's formula written for this model's matrices, 6 x tokens x (matmul parameters) + 12 x tokens x layers x
dim x seq (attention), the count that gives bench/trainer_throughput.py's ``model_flops`` for the GPT-2 shape.

Environment: ``MBS``, ``GAS``, ``STEPS`` (timed optimizer steps after 4 warm-up steps), ``PEAK`` (FLOP/s for MFU).
Prints one JSON line.

Usage (GPU machine; torchtitan 0.2.2, torchdata, tyro, docstring_parser, fsspec and tokenizers installed)::

    MBS=4 GAS=16 STEPS=8 python bench/titan_llama.py
    python bench/trainer_throughput.py titan gpt-compile --mbs 4 --gas 16
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import S, median_step_seconds  # noqa: E402

MBS = int(os.environ.get("MBS", "4"))
GAS = int(os.environ.get("GAS", "1"))
STEPS = int(os.environ.get("STEPS", "12"))
WARM = 4
PEAK = float(os.environ.get("PEAK", "989e12"))
SHAPE = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim_multiplier": 1.5, "multiple_of": 256,
         "rope_theta": 500000, "vocab_size": 128256}  # Llama 3.2 1B


def stub_unsent_modules() -> None:
    """Stand-ins for the two modules torchtitan's model package imports but this step never calls: its HF dataset
    loaders (datasets, pyarrow) and TensorBoard's writer, when those packages are absent."""
    loaders = types.ModuleType("torchtitan.hf_datasets.text_datasets")
    loaders.build_text_dataloader = loaders.build_text_validation_dataloader = None
    sys.modules.setdefault(loaders.__name__, loaders)
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = None
        sys.modules[board.__name__] = board


def build():
    """A one-rank process group, then the model, loss, optimizer and autocast context as torchtitan's trainer builds
    them."""
    import torch.distributed as dist

    stub_unsent_modules()
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29535", rank=0, world_size=1)
    job = JobConfig()
    job.compile.enable, job.activation_checkpoint.mode = True, "none"
    job.training.local_batch_size, job.training.seq_len = MBS, S
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    dims.build_mesh()
    args = TransformerModelArgs(**SHAPE)
    args.update_from_config(job)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    flops_per_token = matmul_flops_per_token(model)
    model = parallelize_llama(model, dims, job)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = build_optimizers([model], job.optimizer, dims)
    amp = dist_utils.maybe_enable_amp(dims, job.training.mixed_precision_param, "cuda")
    return model, build_cross_entropy_loss(job), optimizers, amp, flops_per_token


def matmul_flops_per_token(model: torch.nn.Module) -> float:
    """Model FLOPs per token (forward and backward) of Megatron's formula for this model: 6 x the parameters of its
    matrix multiplications (every 2-D weight but the token embedding, a lookup) + 12 x layers x dim x seq (attention
    scores and their use)."""
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in name)
    return 6 * matmul + 12 * SHAPE["n_layers"] * SHAPE["dim"] * S


def main() -> None:
    from torchtitan.distributed import utils as dist_utils

    model, loss_fn, optimizers, amp, flops_per_token = build()
    batches = [torch.randint(0, SHAPE["vocab_size"], (MBS, S + 1), device="cuda") for _ in range(4)]
    valid = MBS * S * GAS

    def step() -> torch.Tensor:
        optimizers.zero_grad()
        total = torch.zeros((), device="cuda")
        for i in range(GAS):
            tokens = batches[i % len(batches)]
            with amp:
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / valid
            loss.backward()
            total += loss.detach()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        return total

    seconds, loss = median_step_seconds(step, WARM, STEPS)
    tokens = MBS * GAS * S
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    mfu = flops_per_token * tokens / seconds / PEAK
    print(json.dumps({"name": "titan-llama3-1B", "mbs": MBS, "gas": GAS, "s_per_iter": round(seconds, 4),
                      "tokens_per_s": round(tokens / seconds), "mfu": round(mfu, 4), "flops_per_token": flops_per_token,
                      "peak_mem_gb": peak, "loss": round(float(loss), 3)}), flush=True)


if __name__ == "__main__":
    main()
