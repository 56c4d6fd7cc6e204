"""Model-state bytes per parameter and what a step's checkpoint holds: one rule for ``opskit plan`` (memory per GPU,
checkpoint size, host memory of background saves) and the trainer (the host memory it reserves for them).

Bytes are per parameter, 1 byte = 8 bits; "shards" is the number of data-parallel ranks the sharded kinds are split
over (1 when they are not).
"""

from __future__ import annotations

MIXED_PRECISION_BYTES = {"fp32_weights": 4, "model_weights": 2, "optimizer_states": 8, "gradients": 4}
"""The tr1-13B / tr8-104B READMEs' breakdown ("Memory usage"): fp32 master weights, the fp16/bf16 weights the model
computes with, Adam's two fp32 moments, fp32 gradients."""
FP32_BYTES = {"fp32_weights": 0, "model_weights": 4, "optimizer_states": 8, "gradients": 4}
"""fp32 training at ZeRO-0: Adam steps the model's own fp32 weights, there is no master copy."""
FP32_MASTER_BYTES = 4
"""fp32 training at ZeRO stage >= 1: DeepSpeed's ZeRO optimizer steps an fp32 copy of its partition, cloned from the
model's weights even when they are fp32 already (``single_partition_of_fp32_groups``, deepspeed/runtime/zero/
stage_1_and_2.py), and saves it in its shards (measured: a fp32 ZeRO-1 step is 16 bytes per parameter)."""
BNB_OPTIMIZER_STATE_BYTES = 2
"""bitsandbytes' 8-bit Adam (``--use-bnb-optimizer``: ``bnb.optim.Adam8bit``): exp_avg and exp_avg_sq as uint8, one
byte each, with one fp32 absmax per block of 2048 values (4 / 2048 bytes per state and parameter: left out); Dettmers
et al. 2022, "8-bit Optimizers via Block-wise Quantization". It replaces Adam's 8 bytes of fp32 moments only: the fp32
master weights stay 4 bytes under fp16 / bf16."""
ADAM_STATE_BYTES = MIXED_PRECISION_BYTES["optimizer_states"]
SHARDED_BY_ZERO = ("fp32_weights", "optimizer_states")
"""What ZeRO stage 1 partitions over data parallelism: the optimizer states, fp32 master weights included (Rajbhandari
et al. 2020, ZeRO, section 5.1 "P_os"); DeepSpeed's BF16_Optimizer (bf16 with ZeRO stage 0, BLOOM-176B's "bf16 must use
z0! it implements its own zero stage 1 equivalent") partitions the same ones. These are also what each pipeline
stage's optimizer saves of every parameter it holds, a tied one included (:func:`checkpoint_bytes`)."""


def bytes_per_parameter(precision: str, bnb_optimizer: bool, zero_stage: int) -> dict[str, int]:
    """Model-state bytes of one parameter by kind (:data:`MIXED_PRECISION_BYTES` for ``fp16``/``bf16``,
    :data:`FP32_BYTES` for ``fp32``, with :data:`FP32_MASTER_BYTES` of fp32 weights at ZeRO stage >= 1), with
    :data:`BNB_OPTIMIZER_STATE_BYTES` of optimizer states under ``--use-bnb-optimizer``."""
    breakdown = dict(FP32_BYTES if precision == "fp32" else MIXED_PRECISION_BYTES)
    if precision == "fp32" and zero_stage >= 1:
        breakdown["fp32_weights"] = FP32_MASTER_BYTES
    if bnb_optimizer:
        breakdown["optimizer_states"] = BNB_OPTIMIZER_STATE_BYTES
    return breakdown


def sharded_over_dp(zero_stage: int, precision: str) -> bool:
    """Whether :data:`SHARDED_BY_ZERO` kinds are split over data-parallel ranks: ZeRO stage >= 1, or bf16 (DeepSpeed's
    BF16_Optimizer at ZeRO-0)."""
    return zero_stage >= 1 or precision == "bf16"


def checkpoint_bytes(parameters: float, breakdown: dict[str, int], shards: int = 1, tied: float = 0) -> float:
    """Bytes saved for ``parameters`` parameters: the model weights (the layer files), the fp32 master weights and the
    optimizer states (:data:`SHARDED_BY_ZERO`: the optimizer shards, ``1 / shards`` of them, or the ``mp_rank`` files
    at ZeRO-0 without bf16); gradients are not saved. DeepSpeed 0.19.8 writes one copy of each (with
    opskit.train.ds_compat's ``save_bf16_zero0_optimizer_once`` under bf16 + ZeRO-0).

    Args:
        parameters: the parameters counted once (a step: the model's count; one rank: its stage's share).
        breakdown: bytes per parameter by kind (:func:`bytes_per_parameter`).
        shards: the data-parallel ranks the sharded kinds are split over, for one rank's bytes; 1 for a whole step.
        tied: parameters a second pipeline stage holds too (at PP > 1 the last stage's copy of the embedding, tied to
            the LM head: DeepSpeed's ``TiedLayerSpec``): that stage's optimizer saves their sharded kinds again,
            while their model weights are saved once, by the first stage (a tied layer with a ``forward_fn`` has no
            layer file).

    A whole step (shards 1): tr11-176B-ml, 14 x 176.2e9 + 12 x 3.6e9 (the tied embedding: 250,880 x 14,336) =
    2.51e12 bytes, 2.28 TiB: the chronicles' "2.3TB checkpoint".
    """
    saved = {k: v for k, v in breakdown.items() if k != "gradients"}
    kept = sum(v for k, v in saved.items() if k not in SHARDED_BY_ZERO)
    split = sum(v for k, v in saved.items() if k in SHARDED_BY_ZERO)
    return parameters * kept + (parameters + tied) * split / shards


FP32_LOSS_BYTES = 4
"""Megatron computes the LM loss in fp32 (no ``--fp16-lm-cross-entropy``): each fp32 tensor the cross-entropy keeps
or makes over the logits is 4 bytes per logit."""


def cross_entropy_bytes_per_logit(logit_bytes: int, compiled: bool, vocab_parallel: bool) -> int:
    """Bytes per logit (``[b, s, V_pad / TP]``, one micro-batch) that the last pipeline stage's LM head and fp32
    cross-entropy (``opskit.train.model.lm_loss``) hold at once, at the start of the backward pass.

    The activation formula (Korthikanti et al. 2022) counts the transformer layers only; at the 1.3B GPT-2 shape
    (vocabulary 50,304, MBS 8) these buffers are 10.75 GiB eager, 19% of the measured peak: what kept ``opskit plan``
    17% under it (issue 50; docs/benchmarks.md#memory-against-the-plan, ``bench/memory_peak.py``'s breakdown of
    the peak). ``logit_bytes``: 2 for fp16/bf16 logits, 4 for fp32.

    - Eager at TP = 1, measured: the logits (kept by the pipeline engine until their backward) + ``F.cross_entropy``'s
      fp32 log-softmax output (saved for its backward: ``_log_softmax_backward_data`` reads ``result``, PyTorch's
      derivatives.yaml) + the two fp32 gradients its backward makes (NLL's, dense over the logits, and
      log-softmax's): ``logit_bytes + 12``, 14 in bf16. The peak is the moment log-softmax's gradient is allocated.
    - ``torch.compile`` at TP = 1, measured: inductor fuses the upcast, log-softmax and NLL and their backward; the
      logits and their gradient remain: ``2 * logit_bytes``.
    - TP > 1 (megatron-core's ``vocab_parallel_cross_entropy``, from its code, not measured): one fp32 copy of
      this rank's logits, in which the softmax and then its gradient are computed in place, and the gradient cast
      back to the logits' dtype: ``logit_bytes + 4 + logit_bytes``, 8 in bf16; in fp32 the copy is the logits
      themselves, 4.
    """
    if vocab_parallel:
        return FP32_LOSS_BYTES + (2 * logit_bytes if logit_bytes < FP32_LOSS_BYTES else 0)
    if compiled:
        return 2 * logit_bytes
    return logit_bytes + 3 * FP32_LOSS_BYTES


def gradients_allocated_at_peak(zero_stage: int, microbatches: int, in_flight: int) -> bool:
    """Whether a pipeline stage's gradients are allocated at its memory peak, the start of a backward pass with the
    most micro-batches' activations in flight.

    Under ZeRO stage >= 1 DeepSpeed's ZeRO optimizer (DeepSpeed 0.19.8 ``stage_1_and_2.py``, ``step``:
    ``free_grad_in_param_list``) frees the 16-bit gradients at every step once it has copied its partition out, and
    the next step's first backward allocates them again. A stage that runs no more micro-batches than it holds in
    flight (one micro-batch per step at PP = 1; 1F1B's warm-up covering the whole step) reaches its peak before any
    backward of the step: no gradient is allocated then (measured, the 1.3B GPT-2 at one micro-batch per step:
    docs/benchmarks.md#memory-against-the-plan). With gradient accumulation they are all there, from the step's
    first backward. At ZeRO stage 0 they are counted as allocated throughout (bf16: the fp32 gradient buffer of
    DeepSpeed's BF16_Optimizer lives from start to end)."""
    return zero_stage == 0 or microbatches > in_flight
