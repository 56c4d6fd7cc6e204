"""Numbers derived from a spec, before any GPU-hour is spent. Pure functions, no torch.

What ``opskit plan`` prints, each with its source (docs/plan.md has the derivations and the seed figures each one
reproduces):

- parameters: Megatron's exact count (padded vocabulary) and the BigScience READMEs' one-liner
  ``l*(12h^2 + 13h) + V*h + s*h + 2h`` (math/README.md; BLOOM: ``l*(12h^2 + 13h) + V*h + 4h``);
- memory: 18 bytes per parameter with mixed-precision Adam (tr1-13B README), split over TP, PP stages and ZeRO, plus
  an activation estimate after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models"), with and without full activation checkpointing, and at the peak (the start of a backward pass) the last
  stage's logits and fp32 cross-entropy buffers, and the gradients only where they are allocated by then (issue 50,
  measured: docs/benchmarks.md#memory-against-the-plan);
- the layout and the node counts a batch ramp-up allows (Megatron's divisibility rule);
- the ramp-up schedule, ``train_iters`` and the LR schedule in iterations, replayed with Megatron's own rules
  (``opskit.rules.schedule``: microbatches.py, training.py update_train_iters, learning_rates.py);
- curriculum learning (DeepSpeed's seqlen curriculum: fixed_linear / fixed_root);
- FLOPs per iteration (Megatron-DeepSpeed's log formula, Narayanan et al. 2021 eq. 3) and days at a TFLOPs figure,
  ``tokens * 8 * params / (gpus * TFLOPs)`` (math/README.md), with the ramp-up's pipeline-bubble slowdown.

Units: bytes in ``*_bytes``, 1e9 bytes in ``*_gb`` (the READMEs' 234 GB), 2**30 bytes in ``*_gib`` (GPU memory as
vendors and torch.cuda count it), seconds, days of 86 400 s, FLOPs (not FLOP/s) per iteration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from opskit.errors import OpskitError
from opskit.rules.consistency import (
    RECOMPUTE_MODES,
    batch_sizes_of,
    recompute_mode,
    recomputes_fully,
    valid_node_counts,
)
from opskit.rules.memory import (
    ADAM_STATE_BYTES,
    BNB_OPTIMIZER_STATE_BYTES,
    SHARDED_BY_ZERO,
    bytes_per_parameter,
    checkpoint_bytes,
    cross_entropy_bytes_per_logit,
    gradients_allocated_at_peak,
    sharded_over_dp,
)
from opskit.rules.model_size import has_embedding_layernorm, megatron_flops_per_iteration, splits_sequence
from opskit.rules.schedule import BatchRampup, SeqlenSchedule, iterations_to_tokens, tokens_per_iteration
from opskit.spec.schema import Spec, deepspeed_resume_problem, padded_vocab_size


class PlanError(OpskitError, ValueError):
    """An argument of ``opskit plan`` the planner cannot use (one line naming the option)."""

GIB = 2**30
SECONDS_PER_DAY = 86_400

# Mixed-precision Adam: 4 (fp32 weights) + 2 (model weights) + 8 (Adam states) + 4 (gradients) bytes per parameter.
BYTES_PER_PARAMETER = 18

ACHIEVED_TFLOPS = {"V100": 45.0, "A100": 150.0}
"""TFLOPs per GPU BigScience planned with, by GPU model: tr1-13B README "Estimated run time" (V100, 45) and
math/README.md's BLOOM-176B example (A100, 150; the training logged 149)."""


# --------------------------------------------------------------------------- parameters


def layer_parameters(hidden: int, ffn: int | None = None) -> int:
    """Parameters of one transformer layer: QKV + dense ``4h^2 + 4h``, MLP ``2hf + f + h``, two LayerNorms ``4h``;
    ``12h^2 + 13h`` for Megatron's default ``f = 4h`` (math/README.md)."""
    f = ffn or 4 * hidden
    return 4 * hidden**2 + 2 * hidden * f + 9 * hidden + f


def gpt_parameters(layers: int, hidden: int, vocab: int, positions: int, ffn: int | None = None) -> int:
    """GPT-2 style: ``l*(12h^2 + 13h) + V*h + s*h + 2h`` (learned positions, final LayerNorm); BigScience
    math/README.md and the tr8-104B README."""
    return layers * layer_parameters(hidden, ffn) + vocab * hidden + positions * hidden + 2 * hidden


def bloom_parameters(layers: int, hidden: int, vocab: int, ffn: int | None = None) -> int:
    """BLOOM: ``l*(12h^2 + 13h) + V*h + 4h`` (ALiBi, so no position embeddings; embedding and final LayerNorms);
    BigScience math/README.md."""
    return layers * layer_parameters(hidden, ffn) + vocab * hidden + 4 * hidden


def parameter_count(spec: Spec) -> int:
    """Megatron's exact parameter count (tied LM head counted once) with the padded vocabulary.

    GPT: ``l*(12h^2 + 13h) + V*h + s*h + 2h``; BLOOM (ALiBi, embedding LayerNorm): ``l*(12h^2 + 13h) + V*h + 4h``;
    V is the padded vocabulary, s the position-embedding count, as in the BigScience READMEs."""
    m = spec.model
    vocab = padded_vocab_size(spec.data.vocab_size, m, spec.parallel.tensor_model_parallel_size)
    positions = m.max_position_embeddings if m.position_embedding_type == "absolute" else 0
    embed_norm = 2 * m.hidden_size if _embedding_norm(spec) else 0
    return gpt_parameters(m.num_layers, m.hidden_size, vocab, positions, m.ffn_size) + embed_norm


def _embedding_norm(spec: Spec) -> bool:
    return has_embedding_layernorm(spec.model.embed_layernorm, bool(spec.megatron_args.get("use_bnb_optimizer")))


def readme_parameter_count(spec: Spec) -> int:
    """The BigScience READMEs' sanity-check one-liner, ``l*(12h^2 + 13h) + v*h + s*h + 2h`` with the tokenizer's
    vocabulary (unpadded) and s = seq_length, whatever the architecture (the tr11-176B README applies it to BLOOM too;
    the tr1-13B one leaves out the 2h). Printed by them as ``f"{n / 10**9:.0f}B"``: 13B, 104B, 176B."""
    m = spec.model
    return gpt_parameters(m.num_layers, m.hidden_size, spec.data.vocab_size, m.seq_length)


@dataclass(frozen=True)
class ParameterPlan:
    total: int
    """Megatron's exact count, padded vocabulary."""
    architecture: str
    """``gpt`` (learned positions) or ``bloom`` (ALiBi)."""
    padded_vocab_size: int
    per_layer: int
    embedding: int
    """Word (and position) embeddings and the embedding LayerNorm."""
    readme_formula: int
    """The READMEs' one-liner (tokenizer vocabulary, s*h): what printed "13B", "104B", "176B"."""
    readme_billions: int
    hidden_per_layer: float
    hidden_per_head: float


def _parameter_plan(spec: Spec) -> ParameterPlan:
    m = spec.model
    total = parameter_count(spec)
    readme = readme_parameter_count(spec)
    vocab = padded_vocab_size(spec.data.vocab_size, m, spec.parallel.tensor_model_parallel_size)
    return ParameterPlan(
        total=total, architecture="bloom" if m.position_embedding_type == "alibi" else "gpt",
        padded_vocab_size=vocab, per_layer=layer_parameters(m.hidden_size, m.ffn_size),
        embedding=total - m.num_layers * layer_parameters(m.hidden_size, m.ffn_size) - 2 * m.hidden_size,
        readme_formula=readme, readme_billions=round(readme / 1e9),
        hidden_per_layer=m.hidden_size / m.num_layers, hidden_per_head=m.hidden_size / m.num_attention_heads)


# --------------------------------------------------------------------------- memory


def model_state_bytes(parameters: float, bytes_per_parameter: float = BYTES_PER_PARAMETER) -> float:
    """Bytes of the weights, gradients and Adam states of ``parameters`` parameters: 18 each with mixed precision
    (tr1-13B README: "Total: 234GB (18*13)"; tr8-104B: "1872GB (18*104)")."""
    return parameters * bytes_per_parameter


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               attention_scores: bool = False, sequence_parallel: bool = False) -> float:
    """Activations one transformer layer keeps for the backward pass of one micro-batch, without recomputation.

    ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes with 16-bit activations and tensor parallelism ``t``. Source:
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1 and Table 2.
    With sequence parallelism their ``10`` replicated bytes are split too, ``s*b*h*(34 + 5*a*s/h)/t``, except that
    opskit's trainer keeps the two column-parallel linears' inputs gathered (``4*s*b*h``; Megatron gathers them again
    in backward): ``s*b*h*(4 + 30/t + 5*a*s/(h*t))``, the same at t = 1. The ``5*a*s/(h*t)`` term is
    the ``[b, a, s, s]`` attention scores, softmax and dropout mask that Megatron's unfused softmax keeps (BigScience's
    runs); opskit's trainer uses fused attention kernels (flash / FlexAttention) that keep none of them, so the term
    is counted only with ``attention_scores=True``. Measured against the trainer:
    docs/benchmarks.md#trainer-speed-on-one-gpu.
    """
    scores = 5 * heads * seq / (hidden * tp) if attention_scores else 0.0
    if sequence_parallel:
        return seq * micro_batch * hidden * (4 + 30 / tp + scores)
    return seq * micro_batch * hidden * (10 + 24 / tp + scores)


def selectively_recomputed_bytes_per_layer(seq: int, micro_batch: int, hidden: int, tp: int = 1,
                                           sequence_parallel: bool = False) -> float:
    """What ``--recompute-granularity selective`` drops from one layer's activations
    (:func:`activation_bytes_per_layer`) per micro-batch: the two LayerNorms' 16-bit outputs, ``4*s*b*h`` (replicated
    over TP; with sequence parallelism the column-parallel linears keep their gathered copies instead, and nothing is
    dropped there), and the MLP activation's output, ``8*s*b*h/t`` (opskit.train.model.recomputed_in_backward;
    megatron-core's ``layernorm`` module and its activation recompute)."""
    return seq * micro_batch * hidden * ((0 if sequence_parallel else 4) + 8 / tp)


def checkpointed_bytes_per_layer(seq: int, micro_batch: int, hidden: int, tp: int = 1,
                                 sequence_parallel: bool = False) -> float:
    """What full activation checkpointing keeps per layer and micro-batch: the layer's 16-bit input, ``2*s*b*h``
    bytes, replicated over TP, or with sequence parallelism this rank's ``1/t`` of it; Korthikanti et al. 2022,
    section 4.2."""
    return 2 * seq * micro_batch * hidden / (tp if sequence_parallel else 1)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage, per GPU (one TP rank of the stage)."""

    index: int
    layers: int
    embedding: bool
    """Holds the word embeddings (first stage; the last holds the tied LM-head copy)."""
    lm_head: bool
    parameters: int
    """Parameters of the whole stage (all TP ranks)."""
    parameters_per_gpu: float
    in_flight_microbatches: int
    """Micro-batches whose activations the stage holds at once under 1F1B: min(PP - index, micro-batches)."""
    model_state_gib: float
    optimizer_state_gib: float
    """The optimizer states within ``model_state_gib`` (Adam's moments; bitsandbytes' 8-bit ones with bnb)."""
    gradient_gib: float
    """The gradients within ``model_state_gib``."""
    gradients_at_peak: bool
    """Whether the gradients are allocated at the stage's peak (:func:`opskit.rules.memory.gradients_allocated_at_peak`:
    not under ZeRO-1 when the stage runs no more micro-batches per step than it holds in flight)."""
    activation_gib_no_recompute: float
    activation_gib_recompute: float
    activation_gib_selective: float
    """With ``--recompute-granularity selective`` (:func:`selectively_recomputed_bytes_per_layer`)."""
    lm_loss_gib: float
    """The last stage's logits and fp32 cross-entropy buffers at the start of its backward, one micro-batch
    (:func:`opskit.rules.memory.cross_entropy_bytes_per_logit`); 0 on the other stages."""

    def peak_gib(self, recompute: str) -> float:
        """GiB per GPU at the start of the stage's backward pass with the most activations in flight, its peak:
        model states (less the gradients where they are not allocated yet), the layers' activations under
        ``recompute`` (:data:`opskit.rules.consistency.RECOMPUTE_MODES`), and the LM head's loss buffers; never below
        the model states with every gradient (where that backward makes them, its end)."""
        states = self.model_state_gib - (0.0 if self.gradients_at_peak else self.gradient_gib)
        activations = {"full": self.activation_gib_recompute, "selective": self.activation_gib_selective,
                       "none": self.activation_gib_no_recompute}[recompute]
        return max(states + activations + self.lm_loss_gib, self.model_state_gib)


@dataclass(frozen=True)
class MemoryPlan:
    bytes_per_parameter: dict[str, int]
    total_bytes_per_parameter: int
    replica_gb: float
    """Model states of one full replica, 1e9 bytes: bytes/param * parameters."""
    replica_gb_readme: float
    """The READMEs' arithmetic, bytes/param * the rounded billions (234 for 13B, 1872 for 104B)."""
    sharded_over: int
    """How many GPUs share fp32 weights and optimizer states (DP under ZeRO-1 / bf16's optimizer, else 1)."""
    sharding: str
    optimizer: str
    """Which Adam and how many bytes its states take per parameter."""
    stages: list[StagePlan]
    heaviest_stage: int
    model_state_gib_per_gpu: float
    optimizer_state_gib_per_gpu: float
    """The heaviest GPU's optimizer states (within ``model_state_gib_per_gpu``)."""
    activation_gib_per_gpu_no_recompute: float
    activation_gib_per_gpu_recompute: float
    activation_gib_per_gpu_selective: float
    activation_checkpointing: bool
    """Full recompute (``model.checkpoint_activations`` or ``recompute_granularity: full``)."""
    recompute: str
    """The spec's activation recompute, one of :data:`opskit.rules.consistency.RECOMPUTE_MODES`."""
    advised_recompute: str | None
    """The least recompute whose heaviest GPU fits with :data:`RECOMPUTE_MARGIN` of it spare (``full`` when none
    does; None without ``parallel.gpu_memory_gb``)."""
    total_gib_per_gpu: float
    """The heaviest GPU's peak (:meth:`StagePlan.peak_gib` with the spec's checkpointing choice): model states,
    activations and the LM head's loss buffers at the start of a backward pass."""
    gpu_memory_gib: float | None
    fits: bool | None
    no_recompute_fits: bool | None
    """Whether the heaviest GPU fits without activation checkpointing, with :data:`RECOMPUTE_MARGIN` of the GPU
    left over (None without ``parallel.gpu_memory_gb``): where it does, full recompute only costs time."""
    checkpoint_bytes: int
    """One ``global_stepN`` on disk: every model-state byte but the gradients, the tied embedding's optimizer part
    on both pipeline stages that hold it (:func:`opskit.rules.memory.checkpoint_bytes`); within 5% of what the
    trainer writes (tests/test_ckpt_bytes.py)."""
    checkpoint_gb: float
    """:attr:`checkpoint_bytes` in 1e9 bytes."""
    async_save_host_gib_per_node: float | None
    """Host RAM the background saves keep per node (the node's share of a step; torch may pin up to twice that),
    None without ``checkpoint.async_save``."""


RECOMPUTE_MARGIN = 0.15
"""Share of GPU memory the advice to drop activation checkpointing leaves unplanned: the estimate's measured error
(within 10%, docs/benchmarks.md#tr11s-layout-on-4-gpus) plus the allocator's fragmentation."""


def spec_bytes_per_parameter(spec: Spec) -> dict[str, int]:
    """Model-state bytes of one parameter by kind for this spec (:func:`opskit.rules.memory.bytes_per_parameter`; the
    word embedding's exception under ``--use-bnb-optimizer``: :func:`stable_embedding_states`)."""
    return bytes_per_parameter(spec.model.precision, _bnb(spec), spec.parallel.zero_stage)


def stable_embedding_states(spec: Spec) -> bool:
    """Whether the word embedding keeps 32-bit Adam states (8 bytes per parameter) under ``--use-bnb-optimizer``.

    Megatron-DeepSpeed's StableEmbedding registers the word embedding with bitsandbytes' ``GlobalOptimManager`` for
    32-bit states, by parameter identity; the trainer does the same (``opskit.train.build.build_optimizer``), and it
    holds only where DeepSpeed hands bitsandbytes the model's own parameters: fp32 with ZeRO-0. Under ZeRO-1, or fp16
    / bf16 (whose DeepSpeed optimizers step flat fp32 partitions), every state is 8-bit, as in BigScience's tr8b-104B
    BNB runs (fp16, ZeRO-1). Parameters below bitsandbytes' ``min_8bit_size`` (4096 values: LayerNorms and biases of
    small models) also keep 32-bit states there; the plan leaves them out."""
    return _bnb(spec) and spec.model.precision == "fp32" and spec.parallel.zero_stage == 0


def _compiled(spec: Spec) -> bool:
    """Whether the trainer runs the model under ``torch.compile`` (``megatron_args.torch_compile``)."""
    return bool(spec.megatron_args.get("torch_compile"))


def _bnb(spec: Spec) -> bool:
    return bool(spec.megatron_args.get("use_bnb_optimizer"))


def pipeline_stages(spec: Spec) -> list[tuple[int, bool, bool]]:
    """(transformer layers, holds the embedding, holds the LM head) of each pipeline stage.

    Megatron-DeepSpeed's default partition (``type:transformer``) balances transformer layers only; the first stage
    also holds the word embeddings, the last the tied LM-head copy. ``type:transformer|embedding`` (BLOOM-176B) counts
    the two embeddings as layers: 70 layers on 12 stages give [embed|5], 10 x [6], [5|embed]. Uneven counts go to the
    first stages, as DeepSpeed's ``partition_uniform``."""
    layers, pp = spec.model.num_layers, spec.parallel.pipeline_model_parallel_size
    method = spec.parallel.pp_partition_method or "type:transformer"
    with_embeddings = method.startswith("type:") and "embedding" in method.lower()
    units = layers + 2 if with_embeddings and pp > 1 else layers
    sizes = [units // pp + (1 if i < units % pp else 0) for i in range(pp)]
    stages = []
    for i, size in enumerate(sizes):
        first, last = i == 0, i == pp - 1
        if with_embeddings and pp > 1:
            size -= int(first) + int(last)
        stages.append((max(size, 0), first, last))
    return stages


def _memory_plan(spec: Spec) -> MemoryPlan:
    """Memory per GPU of each pipeline stage at its peak, the start of the backward pass with the most activations in
    flight (:meth:`StagePlan.peak_gib`), and what a checkpoint holds.

    Terms and sources: model states (:func:`opskit.rules.memory.bytes_per_parameter`, the READMEs' 18 bytes, split
    by ZeRO); the layers' activations (:func:`activation_bytes_per_layer`, Korthikanti et al. 2022); what issue 50
    found missing against the 1.3B GPT-2's measured peak (+17% eager, docs/benchmarks.md#memory-against-the-plan):
    the last stage's logits and fp32 cross-entropy (:func:`opskit.rules.memory.cross_entropy_bytes_per_logit`, eager
    or ``torch.compile``), and gradients counted although ZeRO-1 frees them at every step
    (:func:`opskit.rules.memory.gradients_allocated_at_peak`). Not counted: allocator fragmentation (the reserved
    memory, 5-9 GiB over the 1.3B GPT-2's peaks), the CUDA context, fused kernels' temporary buffers. Counted as the
    READMEs do, above what DeepSpeed's ZeRO-1 holds: 4 bytes of fp32 gradients per parameter (it keeps bf16 ones and a
    ``reduce_bucket_size`` buffer) and Korthikanti's two dropout masks per layer (none without dropout): the plan
    stays 1-6% over the measured peaks."""
    m, p, b = spec.model, spec.parallel, spec.batch
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    breakdown = spec_bytes_per_parameter(spec)
    per_param = sum(breakdown.values())
    sharded = sharded_over_dp(p.zero_stage, m.precision)
    shards = dp if sharded else 1
    sharding = ("ZeRO-1: fp32 weights and optimizer states over DP" if p.zero_stage >= 1 else
                "bf16 optimizer (ZeRO-0): fp32 weights and optimizer states over DP" if sharded else
                "none (ZeRO-0): every DP rank holds all model states")
    kept = sum(v for k, v in breakdown.items() if k not in SHARDED_BY_ZERO)
    split = sum(v for k, v in breakdown.items() if k in SHARDED_BY_ZERO)
    optimizer = breakdown["optimizer_states"]
    # StableEmbedding's 32-bit states: the extra bytes of each word-embedding parameter (first stage, tied LM head)
    stable_extra = ADAM_STATE_BYTES - optimizer if stable_embedding_states(spec) else 0
    total = parameter_count(spec)
    vocab = padded_vocab_size(spec.data.vocab_size, m, tp)
    h = m.hidden_size
    embedding = vocab * h + (m.max_position_embeddings * h if m.position_embedding_type == "absolute" else 0) + (
        2 * h if _embedding_norm(spec) else 0)
    tied = embedding if pp > 1 else 0  # the last stage's whole copy of the embedding layer, tied to its LM head
    microbatches = max(b.global_batch_size // (b.micro_batch_size * dp), 1)
    scale = 2 if m.precision == "fp32" else 1  # the activation formulas count 16-bit activations
    sp = splits_sequence(p.sequence_parallel, tp)
    full_layer = scale * activation_bytes_per_layer(m.seq_length, b.micro_batch_size, h, m.num_attention_heads, tp,
                                                    sequence_parallel=sp)
    kept_layer = scale * checkpointed_bytes_per_layer(m.seq_length, b.micro_batch_size, h, tp, sequence_parallel=sp)
    selective_layer = full_layer - scale * selectively_recomputed_bytes_per_layer(m.seq_length, b.micro_batch_size, h,
                                                                                    tp, sequence_parallel=sp)
    logits = b.micro_batch_size * m.seq_length * vocab / tp
    loss_bytes = cross_entropy_bytes_per_logit(2 * scale, _compiled(spec), vocab_parallel=tp > 1)
    stages = []
    for index, (layers, first, last) in enumerate(pipeline_stages(spec)):
        params = layers * layer_parameters(h, m.ffn_size) + (embedding if first else 0) + (
            tied + 2 * h if last else 0)
        per_gpu = params / tp
        word_embeddings = vocab * h / tp if first or (last and pp > 1) else 0
        optimizer_bytes = (per_gpu * optimizer + word_embeddings * stable_extra) / shards
        in_flight = min(pp - index, microbatches)
        no_recompute = layers * in_flight * full_layer
        recompute = layers * in_flight * kept_layer + (full_layer if layers else 0)
        stages.append(StagePlan(
            index=index, layers=layers, embedding=first, lm_head=last, parameters=params, parameters_per_gpu=per_gpu,
            in_flight_microbatches=in_flight,
            model_state_gib=(per_gpu * (kept + split / shards) + word_embeddings * stable_extra / shards) / GIB,
            optimizer_state_gib=optimizer_bytes / GIB, gradient_gib=per_gpu * breakdown["gradients"] / GIB,
            gradients_at_peak=gradients_allocated_at_peak(p.zero_stage, microbatches, in_flight),
            activation_gib_no_recompute=no_recompute / GIB, activation_gib_recompute=recompute / GIB,
            activation_gib_selective=layers * in_flight * selective_layer / GIB,
            lm_loss_gib=logits * loss_bytes / GIB if last else 0.0))

    mode = recompute_mode(m.checkpoint_activations, m.recompute_granularity)

    def peak(stage: StagePlan) -> float:
        return stage.peak_gib(mode)

    heaviest = max(stages, key=peak)
    without = max(stage.peak_gib("none") for stage in stages)
    # StableEmbedding's 32-bit states are saved too, for the word embeddings of both stages that hold them
    step_bytes = checkpoint_bytes(total, breakdown, tied=tied) + stable_extra * vocab * h * (2 if pp > 1 else 1)
    return MemoryPlan(
        bytes_per_parameter=dict(breakdown), total_bytes_per_parameter=per_param,
        replica_gb=model_state_bytes(total, per_param) / 1e9,
        replica_gb_readme=float(per_param * round(total / 1e9)),
        sharded_over=shards, sharding=sharding, optimizer=_optimizer_text(spec), stages=stages,
        heaviest_stage=heaviest.index, model_state_gib_per_gpu=heaviest.model_state_gib,
        optimizer_state_gib_per_gpu=heaviest.optimizer_state_gib,
        activation_gib_per_gpu_no_recompute=heaviest.activation_gib_no_recompute,
        activation_gib_per_gpu_recompute=heaviest.activation_gib_recompute,
        activation_gib_per_gpu_selective=heaviest.activation_gib_selective,
        activation_checkpointing=mode == "full", recompute=mode, advised_recompute=_advised_recompute(stages, p),
        total_gib_per_gpu=peak(heaviest),
        gpu_memory_gib=p.gpu_memory_gb, fits=None if p.gpu_memory_gb is None else peak(heaviest) <= p.gpu_memory_gb,
        no_recompute_fits=None if p.gpu_memory_gb is None else without <= p.gpu_memory_gb * (1 - RECOMPUTE_MARGIN),
        checkpoint_bytes=round(step_bytes), checkpoint_gb=step_bytes / 1e9,
        async_save_host_gib_per_node=step_bytes / p.nodes / GIB if spec.checkpoint.async_save else None)


def _advised_recompute(stages: list[StagePlan], p) -> str | None:
    """The least recompute (none, then selective, then full) whose heaviest stage fits ``p.gpu_memory_gb`` with
    :data:`RECOMPUTE_MARGIN` spare; full when neither fits; None without a GPU size."""
    if p.gpu_memory_gb is None:
        return None
    room = p.gpu_memory_gb * (1 - RECOMPUTE_MARGIN)
    return next((mode for mode in RECOMPUTE_MODES[:-1] if max(s.peak_gib(mode) for s in stages) <= room), "full")


def _optimizer_text(spec: Spec) -> str:
    if not _bnb(spec):
        return f"Adam: two fp32 moments, {ADAM_STATE_BYTES} bytes per parameter"
    stable = (f", the word embedding's 32-bit ({ADAM_STATE_BYTES} bytes: StableEmbedding)"
              if stable_embedding_states(spec) else
              " (the word embedding's too: ZeRO-1, fp16 and bf16 step flat fp32 partitions)")
    return f"bitsandbytes 8-bit Adam: {BNB_OPTIMIZER_STATE_BYTES} bytes per parameter{stable}"


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LayoutPlan:
    nodes: int
    gpus_per_node: int
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    replicas: int
    """Full model copies (= DP)."""
    gpus_per_replica: int
    nodes_per_replica: float
    microbatches_per_iteration: int
    """GBS / (MBS * DP) at the full global batch size (gradient-accumulation steps)."""
    batch_granularity: int
    """MBS * DP: every global batch size must be a multiple of it."""
    valid_nodes_rampup: list[int]
    """Node counts for which the whole ramp-up splits into micro-batches (start, increment and GBS)."""
    valid_nodes_full_batch: list[int]
    """Node counts for the full global batch size alone (a layout to switch to once the ramp-up is over)."""


def _layout_plan(spec: Spec) -> LayoutPlan:
    p, b = spec.parallel, spec.batch
    sizes = batch_sizes_of(b.global_batch_size, b.rampup_batch_size)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    return LayoutPlan(
        nodes=p.nodes, gpus_per_node=p.gpus_per_node, world_size=p.world_size, tensor_parallel=tp,
        pipeline_parallel=pp, data_parallel=p.data_parallel_size, replicas=p.data_parallel_size,
        gpus_per_replica=tp * pp, nodes_per_replica=tp * pp / p.gpus_per_node,
        microbatches_per_iteration=b.global_batch_size // (b.micro_batch_size * p.data_parallel_size),
        batch_granularity=b.micro_batch_size * p.data_parallel_size,
        valid_nodes_rampup=valid_node_counts(p.gpus_per_node, tp, pp, b.micro_batch_size, sizes),
        valid_nodes_full_batch=valid_node_counts(p.gpus_per_node, tp, pp, b.micro_batch_size,
                                                 [b.global_batch_size]))


# --------------------------------------------------------------------------- batch ramp-up and schedule


@dataclass(frozen=True)
class RampupRow:
    global_batch_size: int
    iterations: int
    """Iterations run at this GBS, replayed with Megatron's rules (the last row: after the ramp-up)."""
    samples: int
    nominal_iterations: int | None
    """The READMEs' arithmetic, int(samples_per_increment / GBS): "4960 steps at GBS 16, 2480 at 32" (ramp rows)."""


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    global_batch_size: int
    rampup_start: int | None
    rampup_increment: int | None
    rampup_samples: int | None
    num_increments: int | None
    samples_per_increment: float | None
    rows: list[RampupRow]
    rampup_iterations: int
    """Iterations of Megatron's ramp-up loop (until consumed samples exceed the ramp-up samples)."""
    rampup_consumed_samples: int
    train_samples: int
    train_iters: int
    """The iteration count Megatron computes (update_train_iters): the ``/ N`` of every log line."""
    tokens: int
    """Tokens of the run: train_tokens where set, else train_samples * seq_length (no curriculum)."""


def rampup_rows(rampup: BatchRampup, train_samples: int) -> list[RampupRow]:
    """Per-GBS iterations and samples of Megatron's run (:meth:`BatchRampup.rows`), with the READMEs' nominal
    iteration counts on the ramp-up rows."""
    per_increment = rampup.samples_per_increment
    *ramp, rest = rampup.rows(train_samples)
    return [RampupRow(gbs, n, samples, int(per_increment / gbs) if per_increment else None)
            for gbs, n, samples in ramp] + [RampupRow(*rest, None)]


def rampup_samples_fixed_steps(steps: int, start: int, increment: int, steps_per_increment: int) -> int:
    """Samples consumed after ``steps`` iterations if every GBS value lasted ``steps_per_increment`` iterations: the
    tr1-13B README's LR-warmup arithmetic ("2000=160*12+80 ... 216_320 samples ``16*160*12*(12+1)/2+16*13*80``").

    This is the README's model, not Megatron's: Megatron's ramp-up holds each GBS for a fixed number of *samples*
    (samples_per_increment), so it runs many more iterations at the small batch sizes; see
    :meth:`BatchRampup.iterations_to_samples` for the iteration at which the same sample count is really reached."""
    full, rest = divmod(steps, steps_per_increment)
    ramp = sum((start + k * increment) * steps_per_increment for k in range(full))
    return ramp + (start + full * increment) * rest


# --------------------------------------------------------------------------- curriculum learning


def seqlen_schedule(spec: Spec) -> SeqlenSchedule | None:
    """The spec's sequence-length curriculum as :class:`opskit.rules.schedule.SeqlenSchedule`, or None."""
    cl = spec.curriculum_learning
    if cl is None:
        return None
    return SeqlenSchedule(cl.min_difficulty, spec.curriculum_max_difficulty, cl.total_curriculum_step,
                          cl.difficulty_step, cl.root_degree)


@dataclass(frozen=True)
class CurriculumPlan:
    curriculum_type: str
    schedule_type: str
    min_difficulty: int
    max_difficulty: int
    difficulty_step: int
    total_curriculum_step: int
    recommended_total_curriculum_step: float
    """DeepSpeed's guide (tr8-104B README): ~ train_tokens / GBS / seq_length / 2 ("~= 36_000" for 300B tokens)."""
    iterations_per_difficulty_step: float
    """total / ((max - min) / difficulty_step): the period between seqlen switches (fixed_linear; tr8b's eval
    interval of 150)."""
    curriculum_tokens: int
    """Tokens of the curriculum's iterations (fewer than GBS * seq_length each)."""
    iterations_to_train_tokens: int | None
    """Iterations until train_tokens are consumed, with the curriculum's shorter sequences."""


def _rampup(spec: Spec) -> BatchRampup:
    return BatchRampup(spec.batch.global_batch_size, spec.batch.rampup_batch_size)


def _iterations_to_tokens(spec: Spec, tokens: int) -> int:
    return iterations_to_tokens(_rampup(spec), spec.model.seq_length, tokens, seqlen_schedule(spec))


def _curriculum_plan(spec: Spec, tokens: int) -> CurriculumPlan | None:
    cl = spec.curriculum_learning
    if cl is None:
        return None
    top, gbs, seq = spec.curriculum_max_difficulty, spec.batch.global_batch_size, spec.model.seq_length
    steps = tokens_per_iteration(_rampup(spec), seq, seqlen_schedule(spec))  # >= total_curriculum_step iterations
    cl_tokens = sum(next(steps)[1] for _ in range(cl.total_curriculum_step))
    return CurriculumPlan(
        curriculum_type=cl.curriculum_type, schedule_type=cl.schedule_type, min_difficulty=cl.min_difficulty,
        max_difficulty=top, difficulty_step=cl.difficulty_step, total_curriculum_step=cl.total_curriculum_step,
        recommended_total_curriculum_step=tokens / gbs / seq / 2,
        iterations_per_difficulty_step=cl.total_curriculum_step / ((top - cl.min_difficulty) / cl.difficulty_step),
        curriculum_tokens=cl_tokens,
        iterations_to_train_tokens=(_iterations_to_tokens(spec, spec.batch.train_tokens)
                                    if spec.batch.train_tokens else None))


# --------------------------------------------------------------------------- learning rate


@dataclass(frozen=True)
class LrPlan:
    lr: float
    min_lr: float
    decay_style: str
    warmup_samples: int
    warmup_iterations: int
    decay_samples: int | None
    """--lr-decay-samples, or Megatron's default train_samples (None under token-based decay)."""
    decay_iterations: int | None
    decay_tokens: int | None
    decay_tokens_iterations: int | None


def _lr_plan(spec: Spec, samples: int) -> LrPlan:
    o = spec.optimizer
    rampup = _rampup(spec)
    decay_samples = o.lr_decay_samples if o.lr_decay_samples is not None else (
        None if o.lr_decay_tokens is not None else samples)
    return LrPlan(
        lr=o.lr, min_lr=o.min_lr, decay_style=o.lr_decay_style, warmup_samples=o.lr_warmup_samples,
        warmup_iterations=rampup.iterations_to_samples(o.lr_warmup_samples),
        decay_samples=decay_samples,
        decay_iterations=rampup.iterations_to_samples(decay_samples) if decay_samples is not None else None,
        decay_tokens=o.lr_decay_tokens,
        decay_tokens_iterations=_iterations_to_tokens(spec, o.lr_decay_tokens) if o.lr_decay_tokens else None)


# --------------------------------------------------------------------------- throughput and time


def training_days(tokens: float, parameters: float, gpus: int, tflops: float, flops_per_token: float = 8) -> float:
    """Days to train: ``tokens * 8 * params / (gpus * TFLOPs * 1e12 * 86400)``.

    8 = 2 FLOPs per multiply-add x (1 forward + 1 recomputed forward + 2 backward) (BigScience math/README.md, after
    Narayanan et al. 2021); use 6 for a run without activation recomputation and a TFLOPs figure measured so.
    Example: 300B tokens, 13B parameters, 256 GPUs at 45 TFLOPs -> 31.35 days (tr1-13B README)."""
    return tokens * flops_per_token * parameters / (gpus * tflops * 1e12 * SECONDS_PER_DAY)


def pipeline_bubble_factor(microbatches: float, stages: int) -> float:
    """Time of a pipelined iteration relative to its bubble-free time: ``(m + p - 1) / m`` for m micro-batches on p
    stages (1F1B/GPipe bubble fraction (p - 1)/m; Narayanan et al. 2021, section 2.2)."""
    return (microbatches + stages - 1) / microbatches


@dataclass(frozen=True)
class TimePlan:
    tflops: float | None
    """Achieved TFLOPs per GPU assumed (--tflops, or the GPU model's BigScience figure)."""
    tflops_source: str
    gpus: int
    flops_per_iteration_recompute: float
    """Megatron-DeepSpeed's log formula at the full GBS, with activation recomputation (c = 4)."""
    flops_per_iteration_no_recompute: float
    """The same without recomputation (c = 3)."""
    seconds_per_iteration: float | None
    """At the full GBS: the spec's FLOPs per iteration / (GPUs * TFLOPs); what the log's TFLOPs column inverts."""
    flops_per_token_per_parameter: int
    """8 with activation checkpointing, 6 without (see training_days)."""
    days: float | None
    """tokens * factor * params / (gpus * TFLOPs): every iteration at the full-batch efficiency."""
    rampup_days: float | None
    """Days spent in the ramp-up, including its pipeline-bubble slowdown."""
    days_with_rampup_slowdown: float | None
    """days + the ramp-up's extra time: each ramp iteration with m = GBS/(MBS*DP) micro-batches runs
    ((m + p - 1)/m) / ((M + p - 1)/M) times slower per token than at the full GBS's M micro-batches."""


def _time_plan(spec: Spec, parameters: int, tokens: int, rows: list[RampupRow], tflops: float | None,
               gpus: int | None, warnings: list[str]) -> TimePlan:
    m, p, b = spec.model, spec.parallel, spec.batch
    source = "--tflops"
    if tflops is None and p.gpu in ACHIEVED_TFLOPS:
        tflops, source = ACHIEVED_TFLOPS[p.gpu], f"BigScience's {p.gpu} figure"
    elif tflops is None:
        source = "none: pass --tflops"
    gpus = gpus or p.world_size
    vocab = padded_vocab_size(spec.data.vocab_size, m, p.tensor_model_parallel_size)
    flops = {rc: megatron_flops_per_iteration(b.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, vocab,
                                              recompute=rc) for rc in (True, False)}
    full = recomputes_fully(m.checkpoint_activations, m.recompute_granularity)
    factor = 8 if full else 6
    if tflops is None:
        return TimePlan(None, source, gpus, flops[True], flops[False], None, factor, None, None, None)
    seconds = flops[full] / (gpus * tflops * 1e12)
    days = training_days(tokens, parameters, gpus, tflops, factor)
    mp = p.model_parallel_size
    dp = gpus / mp
    ramp_rows = rows[:-1]
    slowdown_days = rampup_days = None
    if gpus % mp:
        warnings.append(f"--gpus {gpus} is not a multiple of TP*PP = {mp}: no ramp-up slowdown estimate")
    elif any(r.global_batch_size % (b.micro_batch_size * (gpus // mp)) for r in rows):
        warnings.append(f"the ramp-up cannot run on {gpus} GPUs (DP {dp:g}: a GBS of the ramp does not split into "
                        f"micro-batches of {b.micro_batch_size}); no ramp-up slowdown estimate")
    else:
        pp = p.pipeline_model_parallel_size
        full = pipeline_bubble_factor(b.global_batch_size / (b.micro_batch_size * dp), pp)
        per_token_day = factor * parameters / (gpus * tflops * 1e12 * SECONDS_PER_DAY)
        rampup_days = sum(r.samples * m.seq_length * per_token_day * pipeline_bubble_factor(
            r.global_batch_size / (b.micro_batch_size * dp), pp) / full for r in ramp_rows)
        plain = sum(r.samples * m.seq_length * per_token_day for r in ramp_rows)
        slowdown_days = days + rampup_days - plain
    return TimePlan(tflops, source, gpus, flops[True], flops[False], seconds, factor, days, rampup_days,
                    slowdown_days)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    name: str
    parameters: ParameterPlan
    memory: MemoryPlan
    layout: LayoutPlan
    batch: BatchPlan
    lr: LrPlan
    curriculum: CurriculumPlan | None
    time: TimePlan
    warnings: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        """JSON-ready: the sections above, plus the flat keys of opskit 0.1 (``parameters``, ``train_iters``, ...);
        docs/plan.md lists every key."""
        data = asdict(self)
        data["parameter_details"] = data.pop("parameters")
        data.update(
            parameters=self.parameters.total, hidden_per_layer=self.parameters.hidden_per_layer,
            hidden_per_head=self.parameters.hidden_per_head, data_parallel_size=self.layout.data_parallel,
            train_iters=self.batch.train_iters, tokens=self.batch.tokens,
            model_state_gb_per_gpu=self.memory.model_state_gib_per_gpu * GIB / 1e9)
        return data


def make_plan(spec: Spec, tflops: float | None = None, gpus: int | None = None) -> Plan:
    """Every number ``opskit plan`` shows for a validated spec.

    Args:
        tflops: achieved TFLOPs per GPU for the time estimate (default: BigScience's figure for parallel.gpu).
        gpus: GPUs for the time estimate (default: the layout's nodes * gpus_per_node).

    Raises:
        PlanError: ``tflops`` not a positive finite number (``inf`` would print days 0 and non-JSON ``Infinity``),
            ``gpus`` not positive.
    """
    if tflops is not None and not (math.isfinite(tflops) and tflops > 0):
        raise PlanError(f"--tflops {tflops}: expected a positive finite number of TFLOPs per GPU")
    if gpus is not None and gpus <= 0:
        raise PlanError(f"--gpus {gpus}: expected a positive number of GPUs")
    warnings: list[str] = []
    b, m = spec.batch, spec.model
    params = _parameter_plan(spec)
    rampup = _rampup(spec)
    samples = b.samples
    rows = rampup_rows(rampup, samples)
    ramp_iterations, ramp_consumed = rampup.rampup_end()
    tokens = b.train_tokens or samples * m.seq_length
    start, incr, ramp_samples = b.rampup_batch_size or (None, None, None)
    increments = (b.global_batch_size - start) // incr if incr else None
    batch = BatchPlan(
        micro_batch_size=b.micro_batch_size, global_batch_size=b.global_batch_size, rampup_start=start,
        rampup_increment=incr, rampup_samples=ramp_samples, num_increments=increments,
        samples_per_increment=rampup.samples_per_increment, rows=rows,
        rampup_iterations=ramp_iterations, rampup_consumed_samples=ramp_consumed, train_samples=samples,
        train_iters=rampup.train_iters(samples) if b.train_iters is None else b.train_iters, tokens=tokens)
    memory = _memory_plan(spec)
    time = _time_plan(spec, params.total, tokens, rows, tflops, gpus, warnings)
    plan = Plan(spec.name, params, memory, _layout_plan(spec), batch, _lr_plan(spec, samples),
                _curriculum_plan(spec, tokens), time, warnings)
    warnings.extend(_warnings(spec, plan))
    return plan


def _warnings(spec: Spec, plan: Plan) -> list[str]:
    """What would not fail validation but deserves a look before the GPU-hours are spent."""
    found = []
    if plan.batch.rampup_start is not None and plan.batch.train_samples < plan.batch.rampup_consumed_samples:
        found.append(f"batch.train_samples {plan.batch.train_samples:,} ends inside the batch ramp-up "
                     f"({plan.batch.rampup_consumed_samples:,} samples): Megatron's train_iters is "
                     f"{plan.batch.train_iters:,} and the full global batch size is never reached")
    mem = plan.memory
    if mem.fits is False:
        which = "with" if mem.activation_checkpointing else "without"
        found.append(f"GPU memory: {mem.total_gib_per_gpu:.1f} GiB estimated on pipeline stage {mem.heaviest_stage} "
                     f"({which} activation checkpointing) exceeds the {mem.gpu_memory_gib:g} GiB of one "
                     f"{spec.parallel.gpu or 'GPU'}")
    advised = mem.advised_recompute
    needs = None if advised is None else max(s.peak_gib(advised) for s in mem.stages)
    if advised is not None and RECOMPUTE_MODES.index(advised) < RECOMPUTE_MODES.index(mem.recompute):
        gain = ("turning model.checkpoint_activations off should give up to ~1.3x the tokens/s" if advised == "none"
                else "model.recompute_granularity: selective recomputes only elementwise ops (full recompute: 4/3 "
                     "of the compute)")
        without = "without recompute" if advised == "none" else "with selective recompute"
        found.append(f"{mem.recompute} activation recompute, yet {without} the heaviest GPU needs "
                     f"~{needs:.1f} GiB of {mem.gpu_memory_gib:g}: {gain}")
    elif mem.fits is False and needs is not None and needs <= mem.gpu_memory_gib * (1 - RECOMPUTE_MARGIN):
        found.append(f"with {advised} activation recompute the heaviest GPU would fit (~{needs:.1f} GiB)")
    if problem := deepspeed_resume_problem(spec):
        found.append(problem)
    cl = plan.curriculum
    if cl is not None:
        if spec.batch.rampup_batch_size is not None:
            found.append("curriculum learning with a batch ramp-up: DeepSpeed's guide removes --rampup-batch-size "
                         "(tr8-104B README)")
        ratio = cl.total_curriculum_step / cl.recommended_total_curriculum_step
        if not 0.5 <= ratio <= 2:
            found.append(f"curriculum_learning.total_curriculum_step {cl.total_curriculum_step} is {ratio:.1f}x the "
                         f"recommended ~{cl.recommended_total_curriculum_step:,.0f} (tokens / GBS / seq_length / 2)")
    if spec.batch.train_tokens is not None:
        found.append(f"batch.train_tokens: Megatron-DeepSpeed parses --train-tokens but stops on train_iters "
                     f"({plan.batch.train_iters:,} from train_samples) since PR #177; the time estimate counts "
                     f"train_tokens")
    seconds = plan.time.seconds_per_iteration
    if seconds is not None and spec.slurm.exit_margin_mins * 60 < seconds:
        found.append(f"slurm.exit_margin_mins {spec.slurm.exit_margin_mins:g} is shorter than one iteration "
                     f"(~{seconds:.0f} s at {plan.time.tflops:g} TFLOPs): the job may be killed before it saves")
    return found
