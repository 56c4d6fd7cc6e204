"""Numbers derived from a spec, before any GPU-hour is spent. Pure functions, no torch.

Formulas from BigScience's math/README.md and the tr1/tr8 READMEs (reference section 1.9).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from opskit.spec import Spec, padded_vocab_size
from opskit.train.schedules import BatchRampup

# Mixed-precision Adam: 4 (fp32 weights) + 2 (half weights) + 8 (Adam states) + 4 (gradients) bytes per parameter.
BYTES_PER_PARAMETER = 18


def parameter_count(spec: Spec) -> int:
    """GPT: ``l(12h^2 + 13h) + Vh + sh + 2h``; BLOOM (ALiBi, embedding LayerNorm): ``l(12h^2 + 13h) + Vh + 4h``.

    V is the padded vocabulary, s the position-embedding count, as in the BigScience READMEs."""
    m = spec.model
    h, layers = m.hidden_size, m.num_layers
    vocab = padded_vocab_size(spec.data.vocab_size, m, spec.parallel.tensor_model_parallel_size)
    blocks = layers * (12 * h**2 + 13 * h)
    positions = m.max_position_embeddings * h if m.position_embedding_type == "absolute" else 0
    embed_norm = 2 * h if m.embed_layernorm else 0
    return blocks + vocab * h + positions + embed_norm + 2 * h


@dataclass(frozen=True)
class Plan:
    parameters: int
    hidden_per_layer: float
    hidden_per_head: float
    data_parallel_size: int
    train_iters: int
    tokens: int
    model_state_gb_per_gpu: float
    """18 bytes/parameter split over TP*PP (ZeRO-1 would shard the 12 optimizer bytes over DP too)."""

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(spec: Spec) -> Plan:
    params = parameter_count(spec)
    p = spec.parallel
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    rampup = BatchRampup(spec.batch.global_batch_size, spec.batch.rampup_batch_size)
    return Plan(
        parameters=params,
        hidden_per_layer=spec.model.hidden_size / spec.model.num_layers,
        hidden_per_head=spec.model.hidden_size / spec.model.num_attention_heads,
        data_parallel_size=p.data_parallel_size,
        train_iters=rampup.train_iters(spec.batch.train_samples),
        tokens=spec.batch.train_samples * spec.model.seq_length,
        model_state_gb_per_gpu=BYTES_PER_PARAMETER * params / mp / 1e9,
    )
