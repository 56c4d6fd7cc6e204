"""Sequence parallelism's collectives (``--sequence-parallel``): the tokens ``[s, ...]`` split over the TP group along
their first (sequence) dimension, rank ``r`` holding rows ``r*s/TP .. (r+1)*s/TP``, and the autograd functions that
move between the split and the whole (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2: the ``g`` / ``g-bar`` conjugates); and the mark on the parameters each TP rank
applies to its own tokens only, whose gradients are summed over TP once per step (an all-reduce per block and
micro-batch instead made the split 9% slower than none on 4 H200s: docs/benchmarks.md#tr11s-layout-on-4-gpus).

megatron-core has the same functions (``megatron.core.tensor_parallel.mappings``) but allocates their outputs with
``torch.cuda.current_device()``, so they cannot run on a CPU, where the trainer is tested; these allocate beside their
input. All take the TP process group and run outside torch.compile's graphs (dynamo cannot keep a process group in an
autograd function's context): a compiled block breaks its graph at each of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...] -> [n * TP, ...]``, the ranks' parts in rank order."""
    out = x.new_empty((x.shape[0] * group.size(), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """``[n * TP, ...] -> [n, ...]``: this rank's rows of the sum over the group."""
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _split(x: torch.Tensor, group) -> torch.Tensor:
    """``[n * TP, ...] -> [n, ...]``: this rank's rows."""
    rows = x.shape[0] // group.size()
    return x[group.rank() * rows:(group.rank() + 1) * rows].contiguous()


class _ToPart(torch.autograd.Function):
    """Forward: this rank's part of the whole (``summed``: of the ranks' sum); backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, summed):
        ctx.group = group
        return (_reduce_scatter if summed else _split)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, partial_grads):
        ctx.group, ctx.partial_grads = group, partial_grads
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter if ctx.partial_grads else _split)(grad, ctx.group), None, None


@torch.compiler.disable
def scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The whole tokens (the same on every rank) -> this rank's part; backward all-gathers."""
    return _ToPart.apply(x, group, False)


@torch.compiler.disable
def gather(x: torch.Tensor, group, partial_grads: bool) -> torch.Tensor:
    """This rank's tokens -> the whole; backward reduce-scatters when each rank's gradient is a partial sum
    (``partial_grads``: a column-parallel linear follows), else keeps this rank's part of a gradient every rank
    holds whole."""
    return _Gather.apply(x, group, partial_grads)


@torch.compiler.disable
def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums of the whole tokens (a row-parallel linear's products) -> this rank's part of their sum;
    backward all-gathers."""
    return _ToPart.apply(x, group, True)


def mark_token_split(*params: torch.Tensor) -> None:
    """Mark parameters every TP rank holds whole but applies to its own tokens only (a block's LayerNorms, the
    row-parallel biases): each rank's gradient is then its tokens' share, and their sum over TP is what TP = 1
    computes. megatron-core's attribute name, ``sequence_parallel``."""
    for param in params:
        param.sequence_parallel = True


def token_split_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``module``'s parameters marked by :func:`mark_token_split` (or by megatron-core), in module order. Their
    gradients are summed over TP once per optimizer step, after the last micro-batch's backward, as Megatron-LM
    does (``finalize_model_grads``): :meth:`opskit.train.pipe.GPTModelPipe.get_tied_weights_and_groups`."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
