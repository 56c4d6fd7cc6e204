"""``--sync-tp-duplicated-parameters``: keep the parameters every TP rank holds a full copy of bitwise equal.

LayerNorms (input, post-attention, embedding, final), the biases of the row-parallel linears (added after the
all-reduce) and the position embeddings are replicated, not split, across TP ranks; each rank updates its own copy. When
the optimizer treats ranks differently (BLOOM-176B: DeepSpeed's BF16_Optimizer skipped gradient clipping on TP ranks
> 0) the copies drift apart and a TP merge must then pick or average diverged weights (reference section 4).
Megatron-DeepSpeed (PR #272, #307) all-reduces them with ``ReduceOp.AVG`` over the TP group in place, without
autograd, in every forward; we do the same once before training and after every optimizer step, which gives the
forwards the same values with one flattened all-reduce per iteration (averaged in fp32: gloo has no AVG).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def tp_duplicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """This rank's replicated parameters: every LayerNorm's weight and bias, row-parallel biases, position embeddings.

    Raises:
        ValueError: when the model has none (nothing would be kept in sync).
    """
    from megatron.core.tensor_parallel import RowParallelLinear

    from opskit.train.model import EmbeddingPipe

    params: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            params += [module.weight, module.bias]
        elif isinstance(module, RowParallelLinear) and module.bias is not None:
            params.append(module.bias)
        elif isinstance(module, EmbeddingPipe) and module.position_embeddings is not None:
            params.append(module.position_embeddings.weight)
    if not params:
        raise ValueError("no TP-duplicated parameters found on this pipeline stage")
    return params


@torch.no_grad()
def sync_tp_duplicated_parameters(params: list[nn.Parameter], group, tp_size: int) -> None:
    """Replace each parameter by its mean over the ``tp_size`` ranks of ``group`` (one all-reduce, in fp32).
    Every rank ends with the same bits: all receive the same sum and divide it the same way."""
    if tp_size == 1:
        return
    flat = _flatten_dense_tensors([p.detach().float() for p in params])
    dist.all_reduce(flat, group=group)
    flat.div_(tp_size)
    for param, mean in zip(params, _unflatten_dense_tensors(flat, params), strict=True):
        param.copy_(mean)
