"""The model as a DeepSpeed ``PipelineModule`` with Megatron-DeepSpeed's layer list, so checkpoints get its file names.

Layer indices (reference section 2.1): 0 cast, 1 embedding (tied), 2 transpose, 3..L+2 transformer blocks, L+3 undo
transpose, L+4 final LayerNorm, L+5 tied embedding as LM head (no state_dict of its own), L+6 cast. Our activations are
already ``[b, s, h]`` and our casts happen elsewhere, so 0, 2, L+3 and L+6 are identity functions kept only for the
numbering: they make the files ``layer_01``, ``layer_03..layer_{L+2}``, ``layer_{L+4}``. Under sequence parallelism 2
and L+3 enter and leave it (``[b, s, h]`` <-> this TP rank's ``[s/TP, b, h]``, :func:`model.to_sequence_parallel`).

The topology always carries a model axis, even at TP=1, because DeepSpeed names files after it (``-model_00``) and
numbers ``mp_rank_XX`` as ``pp * TP + tp``.
"""

from __future__ import annotations

from functools import partial

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from opskit.train.model import (
    EmbeddingPipe,
    FinalLayerNorm,
    GPTConfig,
    ParallelTransformerLayerPipe,
    from_sequence_parallel,
    lm_logits,
    lm_loss,
    to_sequence_parallel,
    tp_group,
)
from opskit.train.sequence_parallel import token_split_parameters


def _keep_layer_number(x):
    """Identity; stands where Megatron-DeepSpeed has a cast or transpose, to keep its layer numbering."""
    return x


def _seed_layer(seed) -> None:
    """Seed each layer from (base seed + layer index), so weights do not depend on the pipeline partition; DeepSpeed
    calls it again before every layer of every micro-batch's forward (its per-micro-batch dropout seeds).

    Seeds the CPU and CUDA generators, which is what ``torch.manual_seed`` changes here, without its other devices:
    on a CUDA machine it also queues a lazy MTIA and XPU seed, each with a ``traceback.format_stack()``, about 1 ms
    per call, 30 ms per micro-batch of a 24-layer model (measured on an H100: the trainer's host time over the bare
    model's). Casting to int avoids DeepSpeed 0.19.8's crash on numpy-int seeds with several stages."""
    seed = int(seed)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def set_dropout_position(model: PipelineModule, micro_batches_done: int) -> None:
    """Place DeepSpeed's per-micro-batch dropout seeds at ``micro_batches_done``, the micro-batches this rank has
    trained so far in the run (``consumed samples / (MBS * DP)``), before an iteration's ``train_batch``.

    DeepSpeed seeds layer ``l`` of a forward with ``base_seed * (micro_offset + 1) + l``, where ``micro_offset`` is
    a counter on the module that every forward advances and no checkpoint saves: a resumed run restarted it at 0 and
    drew other dropout masks than the uninterrupted run (an inexact resume whenever dropout is on), and validation's
    forwards moved it too. Set from the consumed samples, which every checkpoint saves, the masks of an iteration
    are a function of the run's position alone, whatever came before in this process."""
    model.micro_offset = micro_batches_done


class GPTModelPipe(PipelineModule):
    """GPT/BLOOM pipeline. DeepSpeed checkpoints only ``ParallelTransformerLayerPipe`` layers of a ``GPTModelPipe``
    when activation checkpointing is on, which is why the class carries Megatron-DeepSpeed's name."""

    def __init__(self, cfg: GPTConfig, topology: PipeModelDataParallelTopology, seed: int,
                 activation_checkpoint_interval: int = 0, partition_method: str = "type:transformer|embedding"):
        enter, leave = ((to_sequence_parallel, from_sequence_parallel) if cfg.sequence_parallel
                        else (_keep_layer_number, _keep_layer_number))
        layers = [
            _keep_layer_number,
            TiedLayerSpec("embed", EmbeddingPipe, cfg, tied_weight_attr=["word_embeddings.weight"]),
            enter,
            *[LayerSpec(ParallelTransformerLayerPipe, cfg) for _ in range(cfg.num_layers)],
            leave,
            LayerSpec(FinalLayerNorm, cfg),
            TiedLayerSpec("embed", EmbeddingPipe, cfg, forward_fn=lm_logits,
                          tied_weight_attr=["word_embeddings.weight"]),
            _keep_layer_number,
        ]
        super().__init__(
            layers=layers,
            topology=topology,
            loss_fn=partial(lm_loss, vocab_parallel=topology.get_dim("model") > 1),
            partition_method=partition_method,
            seed_layers=True,
            seed_fn=_seed_layer,
            base_seed=seed,
            activation_checkpoint_interval=activation_checkpoint_interval,
        )
        self._token_split = token_split_parameters(self)

    def get_tied_weights_and_groups(self) -> list[tuple[torch.nn.Parameter, object]]:
        """DeepSpeed's tied weights with their groups, plus, under sequence parallelism, each parameter a TP rank
        applies to its own tokens only, with the TP group. The pipeline engine all-reduces each one's accumulated
        gradient (the fp32 one under its bf16 optimizer) over its group once per step, after the last micro-batch's
        backward and before the DP reduction, clipping and the optimizer step (``_exec_reduce_tied_grads``): one
        sum per parameter and step, where Megatron-LM sums the same gradients (``finalize_model_grads``)."""
        tied = super().get_tied_weights_and_groups()
        if not self._token_split:
            return tied
        group = tp_group()
        return [*tied, *((param, group) for param in self._token_split)]


def word_embeddings(model: GPTModelPipe) -> list[torch.nn.Module]:
    """This stage's word-embedding modules (``weight [V_pad / TP, h]``): the first stage's, and the last stage's tied
    copy for the LM head (one module when both are on this stage)."""
    return [layer.word_embeddings for layer in model.modules() if isinstance(layer, EmbeddingPipe)]


def make_topology(tp: int, pp: int, dp: int) -> PipeModelDataParallelTopology:
    """Axes ``['pipe', 'data', 'model']``: TP fastest, then DP, then PP (the order megatron-core uses too)."""
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def compile_stage(model: GPTModelPipe) -> None:
    """``torch.compile`` this pipeline stage in place (same parameters, same state-dict keys) and its loss function
    (at TP = 1 the fp32 cross-entropy then fuses into a few passes over the logits).

    At TP = 1 without activation checkpointing the stage's layers, embedding and LM head included, become one graph,
    as a bare model compiles: one graph entry per micro-batch instead of one per layer, and fusions across layer
    boundaries (measured on an H100, docs/benchmarks.md#trainer-speed-on-one-gpu). DeepSpeed's per-layer seeding becomes
    one seed per micro-batch, its first layer's, so dropout masks differ from a per-layer run's (compiled dropout never
    drew eager's masks).
    Otherwise (megatron-core's TP layers, or DeepSpeed's checkpointed layer ranges) each transformer block is compiled
    on its own."""
    model.loss_fn = torch.compile(model.loss_fn)
    if model.activation_checkpoint_interval == 0 and model.topology().get_dim("model") == 1:
        model.forward = partial(_run_whole_stage, model, torch.compile(_layers_in_order(model.forward_funcs)))
        return
    for layer in model.forward_funcs:
        if isinstance(layer, ParallelTransformerLayerPipe):
            layer.compile()


def _layers_in_order(layers: list):
    """The stage's layers as one function of the stage input (a closure: its own code, so its compiled graph does
    not share a cache entry with the compiled ``partial`` of the loss)."""
    layers = tuple(layers)

    def run_layers(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    return run_layers


def _run_whole_stage(model: GPTModelPipe, run_layers, x: torch.Tensor) -> torch.Tensor:
    """``PipelineModule.forward`` without checkpointing, its seeding kept once per micro-batch (DeepSpeed's seed for
    the stage's first layer: ``base_seed * (micro_offset + 1) + first layer index``)."""
    model.micro_offset += 1
    model.seed_fn(model.base_seed * (model.micro_offset + 1) + model._local_start)
    return run_layers(x)
