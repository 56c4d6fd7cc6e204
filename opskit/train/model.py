"""GPT / BLOOM layers with Megatron-DeepSpeed's module and parameter names, read top to bottom.

Names matter: checkpoints must hold exactly Megatron-DeepSpeed's keys (``word_embeddings.weight``,
``word_embeddings.norm.weight``, ``self_attention.query_key_value.weight``, ...; reference section 2.1), so that
``opskit ckpt convert`` and Megatron-DeepSpeed's own tools read them. Activations flow as ``[batch, seq, hidden]``.

Tensor parallelism (``GPTConfig.tensor_parallel``): the trainer builds megatron-core's ColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding (same parameter names, Megatron's TP splits: QKV and h->4h on dim 0, dense
and 4h->h on dim 1, vocabulary on dim 0), which need ``megatron.core.parallel_state`` set up, also at TP=1. The plain
torch path (``tensor_parallel=False``) is for single-process use of merged weights (``opskit.train.inference``).

Sources: Megatron-LM / Megatron-DeepSpeed ``megatron/model/transformer.py`` and ``language_model.py`` (architecture and
initialisation), BLOOM (ALiBi slopes, embedding LayerNorm, tanh-approximate GELU).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from opskit.rules.model_size import has_embedding_layernorm
from opskit.train import sequence_parallel


@dataclass(frozen=True)
class GPTConfig:
    """The architecture, in Megatron's names. ``padded_vocab_size`` already includes Megatron's padding."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int
    position_embedding_type: str = "absolute"  # "absolute" (GPT-2) or "alibi" (BLOOM)
    embed_layernorm: bool = False
    stable_embedding: bool = False
    """bitsandbytes' StableEmbedding, Megatron-DeepSpeed's word embedding under ``--use-bnb-optimizer``: a LayerNorm
    after it (as ``embed_layernorm``) and :func:`init_xavier_uniform_unpartitioned` instead of N(0, std); the trainer
    keeps its optimizer states in 32 bits (``main._build_optimizer``)."""
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``--sequence-parallel``, TP > 1): between the TP regions of a block each TP
    rank holds ``s / TP`` of the sequence (activations ``[s/TP, b, h]``, sequence first as in Megatron), its
    LayerNorms, residual adds and dropouts run on those tokens only, and the all-reduce after each row-parallel
    linear becomes a reduce-scatter after it and an all-gather before the next column-parallel one (Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2). Not overlapped with
    compute: megatron-core's overlapping path is CUDA-only (:class:`_PlainAtOneRank`)."""
    selective_recompute: bool = False
    """``--recompute-granularity selective``: the two LayerNorms' outputs and the MLP's activation are recomputed in
    the backward pass instead of kept (:func:`recomputed_in_backward`)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_norm(self) -> bool:
        """Whether a LayerNorm follows the word embedding (:func:`opskit.rules.model_size.has_embedding_layernorm`)."""
        return has_embedding_layernorm(self.embed_layernorm, self.stable_embedding)


def tp_size_and_rank(cfg: GPTConfig) -> tuple[int, int]:
    """(TP size, TP rank) from megatron-core's parallel state, or (1, 0) on the plain path."""
    if not cfg.tensor_parallel:
        return 1, 0
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _mp_config():
    """megatron-core's layer config: weights initialised on the CPU as the full matrix, then split, so that every TP
    size draws the same weights from the same seed."""
    from megatron.core import ModelParallelConfig, parallel_state

    return ModelParallelConfig(tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               use_cpu_initialization=True, perform_initialization=True)


def linear(cfg: GPTConfig, in_features: int, out_features: int, std: float, parallel: str | None) -> nn.Module:
    """A Linear with Megatron's init (N(0, std) weight, zero bias). ``parallel``: ``"column"`` (output split over TP),
    ``"row"`` (input split, output all-reduced) or None. Forward: ``[..., in] -> [..., out(/TP for column)]``; with
    sequence parallelism a column-parallel one all-gathers its input's first dimension first and a row-parallel one
    reduce-scatters its output's."""
    if not cfg.tensor_parallel:
        layer = nn.Linear(in_features, out_features)
        init_normal(layer.weight, std)
        nn.init.zeros_(layer.bias)
        return layer
    column, row = _parallel_linears()
    init = lambda w: init_normal(w, std)  # noqa: E731
    if parallel == "column":
        return column(in_features, out_features, config=_mp_config(), init_method=init, bias=True,
                      gather_output=False, sequence_parallel=cfg.sequence_parallel)
    return row(in_features, out_features, config=_mp_config(), init_method=init, bias=True, input_is_parallel=True,
               skip_bias_add=False, sequence_parallel=cfg.sequence_parallel)


class _NoExtraState:
    """megatron-core's layers add an ``_extra_state`` entry (None, for Transformer Engine) to their state dicts, and a
    load pre-hook that inserts one; Megatron-DeepSpeed checkpoints have none, so neither save nor expect it."""

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if f"{prefix}_extra_state" in unexpected_keys:  # put there by megatron-core's own pre-hook
            unexpected_keys.remove(f"{prefix}_extra_state")


class _PlainAtOneRank:
    """megatron-core's Column/RowParallelLinear returning only the output, and at TP = 1 computed as ``F.linear``
    (the same product: no rank to gather from or reduce over). megatron-core's own autograd function adds the bias
    and sums its gradient in separate passes over ``[b, s, out]``; ``F.linear`` lets torch.compile put the bias in
    the GEMM's epilogue (measured on an H100: docs/benchmarks.md#trainer-speed-on-one-gpu). With ``sequence_parallel``
    the subclass's ``sequence_parallel_forward`` runs instead, on :mod:`opskit.train.sequence_parallel`'s collectives:
    megatron-core's own sequence-parallel path allocates on CUDA, so it cannot run on a CPU, where the trainer is
    tested."""

    def __init__(self, *args, sequence_parallel: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.one_rank = self.tp_group is None or self.tp_group.size() == 1
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_rank:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            return self.sequence_parallel_forward(x)
        return super().forward(x)[0]


def tp_group():
    """This rank's TP process group (megatron-core's ``parallel_state``, set up by the trainer's build)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


class LayerNorm(nn.LayerNorm):
    """A transformer block's ``nn.LayerNorm(h, eps)`` (keys ``weight``, ``bias``); under sequence parallelism it
    normalises this rank's tokens only, so its parameters are marked for the step's TP gradient sum
    (:func:`opskit.train.sequence_parallel.mark_token_split`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        if cfg.sequence_parallel:
            sequence_parallel.mark_token_split(self.weight, self.bias)


@lru_cache(maxsize=1)
def _parallel_linears() -> tuple[type, type]:
    """megatron-core's Column/RowParallelLinear (:class:`_PlainAtOneRank`), built on first use so that importing this
    module does not import megatron-core."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Column(_PlainAtOneRank, _NoExtraState, ColumnParallelLinear):
        def sequence_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
            """``[s/TP, b, in] -> [s, b, out/TP]``: all-gather forward, reduce-scatter backward (the TP ranks'
            input gradients are partial sums)."""
            return F.linear(sequence_parallel.gather(x, self.tp_group, partial_grads=True), self.weight,
                            self.bias)

    class Row(_PlainAtOneRank, _NoExtraState, RowParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.sequence_parallel:
                sequence_parallel.mark_token_split(self.bias)

        def sequence_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
            """``[s, b, in/TP] -> [s/TP, b, out]``: reduce-scatter of the partial products, then the bias on this
            rank's tokens (marked in ``__init__``: its gradient is summed over TP once per step,
            :func:`opskit.train.sequence_parallel.token_split_parameters`)."""
            return sequence_parallel.reduce_scatter(F.linear(x, self.weight), self.tp_group) + self.bias

        def _forward_impl(self, *args, **kwargs):
            # megatron-core 0.16's RowParallelLinear passes tp_group=None here, which makes it warn on every call:
            # a graph break in each torch.compile'd layer. Its own group is the same one.
            return super()._forward_impl(*args, **{**kwargs, "tp_group": kwargs.get("tp_group") or self.tp_group})

    return Column, Row


def init_normal(weight: torch.Tensor, std: float) -> None:
    """Megatron's init_method_normal: N(0, std)."""
    nn.init.normal_(weight, mean=0.0, std=std)


def init_xavier_uniform_unpartitioned(weight: torch.Tensor, vocab_rows: int) -> None:
    """Xavier-uniform for the word embedding ``[V_pad (or a TP slice of it), h]`` with the bound of the whole,
    unpartitioned matrix: U(-a, a), ``a = sqrt(6 / (V_pad + h))`` whatever TP is. Megatron-DeepSpeed's
    ``xavier_uniform_tensor_parallel_`` under ``--use-bnb-optimizer`` (BigScience's PR 182: bitsandbytes'
    StableEmbedding computed the bound on each TP slice, about sqrt(TP) times too wide for V >> h)."""
    bound = math.sqrt(6.0 / (vocab_rows + weight.shape[1]))
    nn.init.uniform_(weight, -bound, bound)


def _init_word_embedding(cfg: GPTConfig):
    """The word embedding's init: Xavier-uniform for a StableEmbedding, else Megatron's N(0, init_method_std). Always
    applied to the full ``[V_pad, h]`` matrix (megatron-core's CPU initialisation splits it afterwards)."""
    if cfg.stable_embedding:
        return lambda w: init_xavier_uniform_unpartitioned(w, cfg.padded_vocab_size)
    return lambda w: init_normal(w, cfg.init_method_std)


def _embedding_norm(cfg: GPTConfig) -> nn.LayerNorm | None:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if cfg.embedding_norm else None


class WordEmbedding(nn.Module):
    """Token embedding ``weight [V_pad, h]``, with the optional LayerNorm (BLOOM's, or a StableEmbedding's) as
    ``.norm`` (keys ``word_embeddings.norm.*``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.padded_vocab_size, cfg.hidden_size))
        _init_word_embedding(cfg)(self.weight)
        self.norm = _embedding_norm(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        x = F.embedding(tokens, self.weight)
        return self.norm(x) if self.norm is not None else x


def word_embedding(cfg: GPTConfig) -> nn.Module:
    """The word embedding: plain, or megatron-core's VocabParallelEmbedding (``weight [V_pad/TP, h]``, rows of this
    rank's vocabulary slice, output all-reduced) with the same optional ``.norm``."""
    if not cfg.tensor_parallel:
        return WordEmbedding(cfg)
    return _vocab_parallel_embedding()(cfg)


@lru_cache(maxsize=1)
def _vocab_parallel_embedding() -> type:
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    class VocabParallelWordEmbedding(_NoExtraState, VocabParallelEmbedding):
        def __init__(self, cfg: GPTConfig):
            super().__init__(cfg.padded_vocab_size, cfg.hidden_size, config=_mp_config(),
                             init_method=_init_word_embedding(cfg))
            self.norm = _embedding_norm(cfg)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = super().forward(tokens)
            return self.norm(x) if self.norm is not None else x

    return VocabParallelWordEmbedding


class EmbeddingPipe(nn.Module):
    """Pipeline layer 1 (and, tied, the LM head): word (+ position) embeddings.

    Also serves as the output layer: :func:`lm_logits` multiplies by the same word-embedding matrix, as Megatron does.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tensor_parallel = cfg.tensor_parallel
        self.word_embeddings = word_embedding(cfg)
        if cfg.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            init_normal(self.position_embeddings.weight, cfg.init_method_std)
        else:
            self.position_embeddings = None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] int -> [b, s, h]
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(positions)
        return self.embedding_dropout(x)


def to_sequence_parallel(x: torch.Tensor) -> torch.Tensor:
    """Pipeline layer 2 under sequence parallelism: the embeddings ``[b, s, h]`` (whole on every TP rank) -> this
    rank's ``[s/TP, b, h]``, sequence first (Megatron-DeepSpeed's transpose there). Backward all-gathers."""
    return sequence_parallel.scatter(x.transpose(0, 1), tp_group())


def from_sequence_parallel(x: torch.Tensor) -> torch.Tensor:
    """Pipeline layer L+3 under sequence parallelism: ``[s/TP, b, h]`` -> the whole ``[b, s, h]`` on every TP rank,
    for the final LayerNorm and the LM head. Backward keeps this rank's part of the gradient: the LM head's copy
    region has already summed it over TP."""
    return sequence_parallel.gather(x, tp_group(), partial_grads=False).transpose(0, 1)


def lm_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output layer: ``[b, s, h] @ W_emb^T -> [b, s, V_pad / TP]`` logits (this rank's vocabulary slice), in
    the model's dtype (:func:`lm_loss` takes them to fp32). Under TP the input passes megatron-core's copy region:
    identity forward, all-reduce backward."""
    if embedding.tensor_parallel:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        # the group given, as megatron-core wants it soon: without one it warns on every call, a graph break under
        # torch.compile
        hidden = copy_to_tensor_model_parallel_region(hidden, tp_group())
    return F.linear(hidden, embedding.word_embeddings.weight)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes ``[num_heads]`` (Press et al. 2021): geometric from ``2^(-8/n)``; for a head count that is not
    a power of two, the closest power's slopes plus every other slope of the next power (as BLOOM does)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def attention_bias(cfg: GPTConfig, seq: int, device: torch.device) -> torch.Tensor:
    """Additive attention bias ``[heads/TP or 1, s, s]``: causal mask (``-inf`` above the diagonal) plus, with ALiBi,
    ``slope_h * key_position`` for this rank's heads (softmax is shift-invariant per row, so this equals
    ``-slope_h * (i - j)``)."""
    causal = torch.full((seq, seq), float("-inf"), device=device).triu(1)
    if cfg.position_embedding_type != "alibi":
        return causal.unsqueeze(0)
    tp, rank = tp_size_and_rank(cfg)
    local = cfg.num_attention_heads // tp
    slopes = alibi_slopes(cfg.num_attention_heads)[rank * local:(rank + 1) * local].to(device)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    return slopes[:, None, None] * positions[None, None, :] + causal


def flex_alibi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Causal ALiBi attention with FlexAttention on GPUs: the bias ``slope_h * (k - q)`` is applied inside the fused
    kernel and fully masked blocks are skipped, instead of materialising a ``[heads, s, s]`` bias.
    ``q, k, v: [b, heads/TP, s, head_dim] -> [b, heads/TP, s, head_dim]``."""
    kernel, block_mask, slopes = _flex_alibi(q.shape[2], q.device, cfg.num_attention_heads, *tp_size_and_rank(cfg))
    return kernel(q, k, v, score_mod=lambda score, b, h, qi, ki: score + slopes[h] * (ki - qi), block_mask=block_mask)


@lru_cache(maxsize=8)
def _flex_alibi(seq: int, device: torch.device, heads: int, tp: int, rank: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    local = heads // tp
    slopes = alibi_slopes(heads)[rank * local:(rank + 1) * local].to(device)
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device=device)
    return torch.compile(flex_attention), block_mask, slopes


class SelfAttention(nn.Module):
    """Fused QKV projection (rows ordered per head ``[head][q|k|v][head_dim]``, Megatron checkpoint_version >= 2.0)."""

    def __init__(self, cfg: GPTConfig, output_std: float):
        super().__init__()
        self.cfg = cfg
        self.local_heads = cfg.num_attention_heads // tp_size_and_rank(cfg)[0]
        self.query_key_value = linear(cfg, cfg.hidden_size, 3 * cfg.hidden_size, cfg.init_method_std, "column")
        self.dense = linear(cfg, cfg.hidden_size, cfg.hidden_size, output_std, "row")

    def forward(self, x: torch.Tensor, recompute_input=None) -> torch.Tensor:
        """``[b, s, h] -> [b, s, h]`` (sequence parallel ``[s/TP, b, h]``); ``recompute_input``: how to make ``x``
        again in the backward pass instead of keeping it (:func:`recomputed_in_backward`), or None."""
        with recomputed_in_backward(x, recompute_input):
            qkv = self.query_key_value(x)  # [b, s, 3h/TP]; sequence parallel: gathered, [s, b, 3h/TP]
        if self.cfg.sequence_parallel:
            qkv = qkv.transpose(0, 1)
        b, s, _ = qkv.shape
        qkv = qkv.unflatten(-1, (self.local_heads, 3, self.cfg.head_dim))
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # each [b, heads, s, head_dim]
        dropout = self.cfg.attention_dropout if self.training else 0.0
        if self.cfg.position_embedding_type == "alibi" and q.is_cuda and dropout == 0.0:
            context = flex_alibi_attention(q, k, v, self.cfg)
        elif self.cfg.position_embedding_type == "alibi":
            bias = attention_bias(self.cfg, s, x.device).to(q.dtype)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
        else:  # no bias to add: the fused causal kernels (flash attention on GPUs)
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        context = context.permute(2, 0, 1, 3) if self.cfg.sequence_parallel else context.transpose(1, 2)
        return self.dense(context.reshape(*context.shape[:2], -1))  # the row-parallel linear reduce-scatters


@contextmanager
def recomputed_in_backward(output: torch.Tensor, recompute):
    """Inside the block (the one op that takes ``output``), what autograd saves of ``output`` (that op's input, kept
    for its weight gradient) is dropped, and ``recompute()`` (the op that made it, on inputs autograd keeps anyway)
    makes it again in the backward pass; ``recompute`` None: nothing is dropped. Megatron-core's output-discarding
    checkpointing of its ``--recompute-granularity selective`` module ``layernorm`` (and of its activation function),
    written with autograd's saved-tensor hooks. A saved tensor is
    ``output`` when it shares its storage (the linear's flattened view of it included); it is rebuilt with the same
    size, strides and offset. Only while the block runs, when ``output`` is alive and its storage cannot belong to
    another tensor. Exact: the op runs again on the same inputs (LayerNorm, GELU: no randomness).

    Memory (eager, one layer, 16-bit): the two LayerNorm outputs (2 ``s*b*h`` bytes each) and the activation's
    output (8 ``s*b*h``) of the 32 the layer keeps (docs/benchmarks.md#memory-against-the-plan)."""
    if recompute is None or not torch.is_grad_enabled():
        yield
        return
    # plain values only: autograd keeps the hooks as long as what they saved, and a closure over ``output`` would keep
    # the very tensor this drops
    storage, dtype = output.untyped_storage().data_ptr(), output.dtype

    def pack(saved: torch.Tensor):
        if saved.untyped_storage().data_ptr() != storage or saved.dtype != dtype:
            return saved
        return saved.size(), saved.stride(), saved.storage_offset()

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        with torch.no_grad():
            return recompute().as_strided(*packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class MLP(nn.Module):
    """h -> ffn -> h with the tanh-approximate GELU of Megatron's fused bias-GELU (``gelu_fast`` / BLOOM's GELU)."""

    def __init__(self, cfg: GPTConfig, output_std: float):
        super().__init__()
        self.dense_h_to_4h = linear(cfg, cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_method_std, "column")
        self.dense_4h_to_h = linear(cfg, cfg.ffn_hidden_size, cfg.hidden_size, output_std, "row")

    def forward(self, x: torch.Tensor, recompute_input=None) -> torch.Tensor:
        """``recompute_input``: as :meth:`SelfAttention.forward`'s; given, the activation's output is made again in
        the backward pass too (selective recompute)."""
        with recomputed_in_backward(x, recompute_input):
            h = self.dense_h_to_4h(x)
        activation = F.gelu(h, approximate="tanh")
        recompute = (lambda: F.gelu(h, approximate="tanh")) if recompute_input is not None else None
        with recomputed_in_backward(activation, recompute):
            return self.dense_4h_to_h(activation)


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LayerNorm transformer block. The class name is the one DeepSpeed's ``type:transformer`` partitioning and
    activation checkpointing look for."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # Megatron's scaled_init_method_normal for the two output projections: std / sqrt(2 * num_layers).
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.input_layernorm = LayerNorm(cfg)
        self.self_attention = SelfAttention(cfg, output_std)
        self.post_attention_layernorm = LayerNorm(cfg)
        self.mlp = MLP(cfg, output_std)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]; sequence parallel [s/TP, b, h]
        selective = self.cfg.selective_recompute
        attended = x + self.dropout(self.self_attention(
            self.input_layernorm(x), (lambda: self.input_layernorm(x)) if selective else None))
        return attended + self.dropout(self.mlp(
            self.post_attention_layernorm(attended), (lambda: self.post_attention_layernorm(attended)) if selective
            else None))


class FinalLayerNorm(nn.LayerNorm):
    """Layer L+4: a bare LayerNorm, so its checkpoint keys are just ``weight`` and ``bias``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_epsilon)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_parallel: bool = False) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (Megatron's default, without ``--fp16-lm-cross-entropy``): logits
    ``[b, s, V_pad / TP]`` in any float dtype, labels ``[b, s]`` -> scalar (nats per token). With ``vocab_parallel``
    (TP > 1), megatron-core's vocab-parallel cross-entropy combines the ranks' vocabulary slices; at TP = 1 plain
    cross-entropy computes the same, and under ``torch.compile`` (``pipe.compile_stage``) fuses into a few
    passes over the logits instead of materialising their fp32 copy and softmax."""
    if vocab_parallel:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.float(), labels).mean()
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
