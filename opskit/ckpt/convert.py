"""Convert a Megatron-DeepSpeed checkpoint step (any TP, any PP) into a Hugging Face ``GPT2LMHeadModel`` or
``BloomForCausalLM`` folder, streaming tensor by tensor.

Which model: ALiBi + embedding LayerNorm -> BLOOM; absolute position embeddings without embedding LayerNorm -> GPT-2
(reference section 2.1 for the checkpoint keys, section 3 for both transformers converters' rules):

- TP merge (:func:`opskit.ckpt.format.layout.tp_rule`): column-parallel weights and vocabulary rows are concatenated on
  dim 0, row-parallel weights on dim 1; replicated tensors are taken from rank 0 when all ranks agree and **averaged**
  when they do not (transformers' BLOOM converter and ds_to_universal's rule), and the averaged names are reported.
  PP needs no merge: every layer lives in one stage's files, and a step folder holds them all.
- BLOOM: keys keep their names under ``transformer.h.{i}``; BLOOM's fused QKV uses Megatron's per-head ``[q|k|v]``
  rows, so no reordering. GPT-2: ``query_key_value`` rows ``[head][q|k|v][hn]`` become ``c_attn``'s
  ``[q all heads | k | v]``, and every Linear ``[out, in]`` becomes a Conv1D ``[in, out]`` (transposed); activation
  ``gelu_fast`` when the run used the fused bias-GELU (Megatron's default, and what opskit's trainer computes),
  ``gelu_new`` with ``--openai-gelu``, else exact ``gelu`` (the tr1-13B converter bug was writing ``gelu``).
- The LM head is tied to the word embeddings. The padded vocabulary is kept unless ``trim_vocab``.

Memory: pickles are read lazily (:mod:`opskit.ckpt.format.tensorfile`) and each output tensor is written block by block
(row chunks of at most CHUNK_BYTES, a few at once) into pre-sized safetensors shards
(:mod:`opskit.ckpt.safetensors_out`); blocks that keep their dtype go from the mapped checkpoint pages straight into
the output, so peak memory is a few blocks (plus a cast copy), whatever the model size. Neither torch nor transformers
is imported unless a block needs a cast or an average (config and tokenizer files are written without them); they,
tokenizers and the trainer's model (:mod:`opskit.train.inference`, torch) are imported inside the functions that use
them.
The folder is built under a temporary name, verified, and renamed into place: a failure never leaves a half-written
model and never replaces a good one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opskit.ckpt.check import replicated_diff
from opskit.ckpt.format.info import describe_step, list_steps, saved_files_digest, weights_only_copy
from opskit.ckpt.format.layout import (
    EMBEDDING_LAYER,
    FIRST_BLOCK_LAYER,
    CheckpointFormatError,
    final_norm_layer,
    load_args,
    load_state,
    resolve_step_dir,
    scan_step_dir,
    tp_rule,
)
from opskit.ckpt.format.tensorfile import ITEMSIZES, ColumnSpan, RowSpan
from opskit.ckpt.safetensors_out import OutTensor, numel, plan_shards, shard_name, write_index, write_safetensors
from opskit.data.corpus import read_documents
from opskit.errors import OpskitError
from opskit.fsutil import (
    claim_dir,
    damaged_entries,
    folder_entries,
    has_marker,
    read_marker,
    replace_dir,
    write_marker,
)
from opskit.rules.model_size import has_embedding_layernorm

# What transformers' tokenizers read from a folder; a tokenizer folder's other files (weights...) are not copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
DEFAULT_WORKERS = 2
CONVERT_COMMAND = "ckpt convert"  # the marker's command for a conversion folder
CHUNK_BYTES = 64 * 1024**2  # row chunks (one write each): memory per writer thread, whatever the tensor
VERIFY_ATOL = 1e-4
VERIFY_RTOL = 1e-5
VERIFY_WHOLE_MAX_PARAMETERS = 10**9
VERIFY_PARTIAL_LAYERS = 2

GPT2_BLOCK_KEYS = {
    "input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
    "post_attention_layernorm.weight": "ln_2.weight", "post_attention_layernorm.bias": "ln_2.bias",
    "self_attention.query_key_value.weight": "attn.c_attn.weight",
    "self_attention.query_key_value.bias": "attn.c_attn.bias",
    "self_attention.dense.weight": "attn.c_proj.weight", "self_attention.dense.bias": "attn.c_proj.bias",
    "mlp.dense_h_to_4h.weight": "mlp.c_fc.weight", "mlp.dense_h_to_4h.bias": "mlp.c_fc.bias",
    "mlp.dense_4h_to_h.weight": "mlp.c_proj.weight", "mlp.dense_4h_to_h.bias": "mlp.c_proj.bias",
}
BLOOM_BLOCK_KEYS = {k: k for k in GPT2_BLOCK_KEYS}


class ConvertError(OpskitError, ValueError):
    """A checkpoint this converter cannot turn into the asked format, or a failed verification; one line."""


@dataclass(frozen=True)
class Converted:
    """One converted step. ``averaged``: replicated tensors whose TP copies differed (``"h.0.ln_1.weight (layer_03,
    max abs diff 1.2e-03)"``); ``max_abs_diff``: verification's logits difference (None when not verified);
    ``skipped``: already converted (``--all``); ``verified_layers``: blocks the verification ran through;
    ``weights_only_backup``: converted from a weights-only backup's copy of the step (no optimizer shards:
    :func:`opskit.ckpt.format.manifest.weights_only_copy`)."""

    out_dir: Path
    step_dir: Path
    iteration: int
    arch: str
    num_parameters: int
    shards: int = 0
    averaged: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    skipped: bool = False
    verified_layers: int | None = None
    num_layers: int = 0
    weights_only_backup: bool = False


@dataclass(frozen=True)
class NotConverted:
    """A step ``--all`` left alone, and why: ``incomplete step: <its first problem>``, or ``<out>: <why its earlier
    conversion is not intact>; --force converts it again``."""

    step_dir: Path
    reason: str


@dataclass(frozen=True)
class Conversions:
    """What ``opskit ckpt convert`` did, in step order: the steps converted now or found already converted
    (``Converted.skipped``), and the steps it did not convert."""

    converted: list[Converted] = field(default_factory=list)
    not_converted: list[NotConverted] = field(default_factory=list)

    def as_json(self) -> dict:
        """``{"converted": [<Converted's fields>...], "not_converted": [{"step_dir", "reason"}...]}``; paths as
        strings."""
        return {"converted": [asdict(c) for c in self.converted],
                "not_converted": [asdict(n) for n in self.not_converted]}


# --------------------------------------------------------------------------- what the saved args say


def model_arch(args: argparse.Namespace, where: Path) -> str:
    """``"bloom"`` or ``"gpt2"`` from the saved args.

    Raises:
        ConvertError: GLU MLPs, post-LayerNorm residuals, or a position-embedding / embedding-LayerNorm combination
        that is neither model.
    """
    position = str(getattr(args, "position_embedding_type", "absolute"))  # flag added in 2021; absolute before
    embed_ln = has_embedding_layernorm(getattr(args, "embed_layernorm", False),
                                       getattr(args, "use_bnb_optimizer", False))  # BLOOM's, or a StableEmbedding's
    if getattr(args, "glu_activation", None):
        raise ConvertError(f"{where}: --glu-activation {args.glu_activation}: neither GPT-2 nor BLOOM has a GLU MLP")
    if position == "alibi" and embed_ln:
        return "bloom"
    if position == "absolute" and not embed_ln:
        if getattr(args, "apply_residual_connection_post_layernorm", False):
            raise ConvertError(f"{where}: --apply-residual-connection-post-layernorm: GPT-2 has no such option")
        return "gpt2"
    raise ConvertError(f"{where}: position_embedding_type {position} with embedding LayerNorm {embed_ln} "
                       "(--embed-layernorm or --use-bnb-optimizer): neither GPT-2 (absolute, no embedding LayerNorm) "
                       "nor BLOOM (alibi + embedding LayerNorm)")


def activation_function(args: argparse.Namespace) -> str:
    """transformers' name for the run's GELU (transformers' megatron_gpt2 converter's rule). Runs of opskit's trainer
    carry no ``bias_gelu_fusion``: it always computes the tanh GELU, i.e. ``gelu_fast``."""
    if getattr(args, "bias_gelu_fusion", True):
        return "gelu_fast"
    return "gelu_new" if getattr(args, "openai_gelu", False) else "gelu"


def original_vocab_size(args: argparse.Namespace, client_state: dict) -> int | None:
    """The tokenizer's vocabulary before Megatron's padding, when the checkpoint records it."""
    info = client_state.get("checkpoint_info") or {}
    return getattr(args, "original_vocab_size", None) or info.get("original_vocab_size")


def hf_config(arch: str, args: argparse.Namespace, vocab_size: int, dtype: str, n_positions: int | None,
              eos_token_id: int | None = None) -> dict:
    """``config.json`` of ``GPT2LMHeadModel`` or ``BloomForCausalLM`` from the saved args (sizes, epsilon, dropouts,
    activation), written as JSON without importing transformers (which fills every other field with its defaults
    when it loads it); GPT-2's single special token (bos = eos) is the tokenizer's ``eos_token_id``; when it has none,
    GPT-2's own 50256 where the vocabulary has that row, else none (null: an id past the vocabulary is no token).

    Raises:
        ConvertError: BLOOM with an FFN other than 4h or an exact-erf GELU (BLOOM's MLP is fixed: 4h, tanh GELU).
    """
    common = {"initializer_range": getattr(args, "init_method_std", 0.02), "tie_word_embeddings": True,
              "dtype": DTYPES[dtype]}
    epsilon = getattr(args, "layernorm_epsilon", 1e-5)
    if arch == "gpt2":
        special = eos_token_id if eos_token_id is not None else (50256 if vocab_size > 50256 else None)
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab_size,
                "n_positions": n_positions, "n_embd": args.hidden_size, "n_layer": args.num_layers,
                "n_head": args.num_attention_heads, "n_inner": args.ffn_hidden_size,
                "activation_function": activation_function(args), "resid_pdrop": args.hidden_dropout,
                "embd_pdrop": args.hidden_dropout, "attn_pdrop": args.attention_dropout,
                "layer_norm_epsilon": epsilon, "scale_attn_weights": True, "bos_token_id": special,
                "eos_token_id": special, **common}
    if args.ffn_hidden_size != 4 * args.hidden_size:
        raise ConvertError(f"ffn_hidden_size {args.ffn_hidden_size} != 4 * hidden_size; BLOOM's MLP is fixed at 4h")
    if activation_function(args) == "gelu":
        raise ConvertError("the run used the exact (erf) GELU; BLOOM's MLP computes the tanh approximation")
    return {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "vocab_size": vocab_size,
            "hidden_size": args.hidden_size, "n_layer": args.num_layers, "n_head": args.num_attention_heads,
            "layer_norm_epsilon": epsilon, "hidden_dropout": args.hidden_dropout,
            "attention_dropout": args.attention_dropout,
            "apply_residual_connection_post_layernorm": bool(getattr(args, "apply_residual_connection_post_layernorm",
                                                                     False)),
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "pretraining_tp": 1, "slow_but_exact": False,
            "use_cache": True, **common}


# --------------------------------------------------------------------------- output tensors, block by block


def _row_chunks(rows: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` row ranges of at most CHUNK_BYTES each."""
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _chunked(tensor, first_row: int = 0) -> Iterator[tuple[object, int]]:
    """Blocks of whole rows of an in-memory tensor (copied contiguous one chunk at a time)."""
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
    for start, stop in _row_chunks(tensor.shape[0], row_bytes):
        yield tensor[start:stop], first_row + start


def _replicated(name: str, refs: list, averaged: list[str], where: str) -> OutTensor:
    def blocks():
        raw = [r.read_bytes() for r in refs]
        if raw[0] is not None and raw.count(raw[0]) == len(raw):  # identical copies: rank 0's, file to file
            yield RowSpan(refs[0], 0, refs[0].shape[0]), 0
            return
        tensors = [r.read() for r in refs]
        diff, _ranks = replicated_diff(tensors)
        if diff == 0:
            yield tensors[0], 0
            return
        import torch

        averaged.append(f"{name} ({where}, max abs diff {diff:.3g})")
        yield torch.stack([t.float() for t in tensors]).mean(0), 0

    return OutTensor(name, tuple(refs[0].shape), sum(r.nbytes for r in refs), blocks)


def _cat_rows(name: str, refs: list, keep_rows: int | None = None, transpose: bool = False) -> OutTensor:
    """Shards concatenated on dim 0 (column-parallel, vocabulary), read in row chunks; ``keep_rows`` trims padding;
    ``transpose`` for GPT-2's Conv1D (``[in, out]``: the merged tensor is read whole, then written in row chunks)."""
    rows = sum(r.shape[0] for r in refs)
    keep = min(rows, keep_rows or rows)
    shape = (keep, *refs[0].shape[1:])

    def blocks():
        if transpose:
            import torch

            yield from _chunked(torch.cat([r.read() for r in refs]).t())
            return
        start = 0
        for ref in refs:
            stop = min(start + ref.shape[0], keep)
            for first, last in _row_chunks(max(0, stop - start), ref.nbytes // max(1, ref.shape[0])):
                yield RowSpan(ref, first, last), start + first
            start += ref.shape[0]

    return OutTensor(name, shape[::-1] if transpose else shape, sum(r.nbytes for r in refs), blocks)


def _cat_columns(name: str, refs: list, transpose: bool = False) -> OutTensor:
    """Row-parallel weights: shards concatenated on dim 1, written in row chunks (each chunk reads the same rows of
    every shard); transposed for GPT-2, each shard is a run of whole output rows."""
    shape = (refs[0].shape[0], sum(r.shape[1] for r in refs))

    def blocks():
        if transpose:
            start = 0
            for ref in refs:
                yield from _chunked(ref.read().t(), start)
                start += ref.shape[1]
            return
        for first, last in _row_chunks(shape[0], shape[1] * refs[0].itemsize):
            yield ColumnSpan(tuple(refs), first, last), first

    return OutTensor(name, shape[::-1] if transpose else shape, sum(r.nbytes for r in refs), blocks)


def _gpt2_qkv(name: str, refs: list, heads: int, head_dim: int) -> OutTensor:
    """``query_key_value`` shards (rows ``[head][q|k|v][head_dim]``; TP ranks hold contiguous heads) -> ``c_attn``:
    rows regrouped to ``[q of all heads | k | v]`` (Megatron's ``fix_query_key_value_ordering`` for version >= 2),
    then, for the weight, transposed to Conv1D's ``[h_in, 3h]``."""
    is_weight = len(refs[0].shape) == 2

    def blocks():
        import torch

        merged = torch.cat([r.read() for r in refs])
        regrouped = merged.view(heads, 3, head_dim, -1).transpose(0, 1).reshape(3 * heads * head_dim, -1)
        yield from _chunked(regrouped.t() if is_weight else regrouped.view(-1))

    shape = (refs[0].shape[1], 3 * heads * head_dim) if is_weight else (3 * heads * head_dim,)
    return OutTensor(name, shape, sum(r.nbytes for r in refs), blocks)


def _block_tensor(arch: str, name: str, key: str, refs: list, args, averaged: list[str], where: str) -> OutTensor:
    rule = tp_rule(key)
    if rule == "replicated":
        return _replicated(name, refs, averaged, where)
    if arch == "gpt2" and key.startswith("self_attention.query_key_value."):
        return _gpt2_qkv(name, refs, args.num_attention_heads, args.hidden_size // args.num_attention_heads)
    transpose = arch == "gpt2" and key.endswith(".weight")
    return _cat_columns(name, refs, transpose) if rule == "cat1" else _cat_rows(name, refs, transpose=transpose)


def plan_tensors(step, args: argparse.Namespace, arch: str, keep_vocab_rows: int | None,
                 averaged: list[str]) -> list[OutTensor]:
    """Every output tensor of the HF model, in layer order, from a scanned step (headers only; nothing read yet).

    Raises:
        ConvertError: a key that has no place in the target model (named with its file).
    """
    shards = {index: [load_state(f) for f in files] for index, files in step.layers.items()}
    prefix = "transformer."
    embedding = shards[EMBEDDING_LAYER]
    extra = ["position_embeddings.weight"] if arch == "gpt2" else ["word_embeddings.norm.weight",
                                                                     "word_embeddings.norm.bias"]
    _refuse_unknown(step, EMBEDDING_LAYER, embedding[0], {"word_embeddings.weight", *extra})
    out = [_cat_rows(prefix + ("wte.weight" if arch == "gpt2" else "word_embeddings.weight"),
                     [s["word_embeddings.weight"] for s in embedding], keep_vocab_rows)]
    hf_names = {"position_embeddings.weight": "wpe.weight", "word_embeddings.norm.weight":
                "word_embeddings_layernorm.weight", "word_embeddings.norm.bias": "word_embeddings_layernorm.bias"}
    out += [_replicated(prefix + hf_names[key], [s[key] for s in embedding], averaged, "layer_01") for key in extra]
    names = GPT2_BLOCK_KEYS if arch == "gpt2" else BLOOM_BLOCK_KEYS
    for i in range(args.num_layers):
        index = FIRST_BLOCK_LAYER + i
        layer = shards[index]
        _refuse_unknown(step, index, layer[0], set(names))
        for key in layer[0]:
            out.append(_block_tensor(arch, f"{prefix}h.{i}.{names[key]}", key, [s[key] for s in layer], args,
                                     averaged, f"layer_{index:02d}"))
    final = shards[final_norm_layer(args.num_layers)]
    _refuse_unknown(step, final_norm_layer(args.num_layers), final[0], {"weight", "bias"})
    for part in ("weight", "bias"):
        out.append(_replicated(f"{prefix}ln_f.{part}", [s[part] for s in final], averaged,
                               f"layer_{final_norm_layer(args.num_layers):02d}"))
    return out


def _refuse_unknown(step, index: int, state: dict, known: set[str]) -> None:
    unknown = sorted(set(state) - known)
    if unknown:
        raise ConvertError(f"{step.layers[index][0]}: keys {unknown} have no place in the converted model")
    missing = sorted(known - set(state))
    if missing:
        raise ConvertError(f"{step.layers[index][0]}: keys {missing} missing")


# --------------------------------------------------------------------------- conversion


def convert_step(path: str | Path, out_dir: str | Path, step: int | None = None, dtype: str | None = None,
                 trim_vocab: bool = False, tokenizer_dir: str | Path | None = None, verify: bool = True,
                 verify_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 progress: Callable[[int, int], None] | None = None, workers: int | None = None,
                 force: bool = False) -> Converted:
    """Convert ``path`` (run checkpoint dir + ``step``/``latest``, or a step folder) to an HF folder at ``out_dir``:
    a new or empty folder (its mode kept), or with ``force`` a folder an earlier conversion wrote (its ``.opskit``
    marker); the folder is built beside it, marked, and renamed into place. The step must be complete, or a weights-only
    backup's copy of one (:func:`opskit.ckpt.format.manifest.weights_only_copy`: the weights are all there).

    Args:
        dtype: ``fp32``/``fp16``/``bf16``; default: the checkpoint's own.
        trim_vocab: drop Megatron's vocabulary padding (rows past the tokenizer's size).
        tokenizer_dir: tokenizer folder copied into the output; default: the saved ``--tokenizer-name-or-path``.
        verify: load the result in transformers and compare logits with the checkpoint's own forward.
        verify_layers: verify with the first N blocks only; default: the whole model up to 1e9 parameters (both
            models in fp32 take 8 bytes per parameter), else the first 2 blocks.
        progress: ``progress(bytes_read, bytes_total)`` of checkpoint bytes, after each tensor.
        workers: blocks written at once (threads). Default 2: one maps source pages while another writes; more
            mostly wait, since writes into one file serialize on its inode lock (ext4, tmpfs;
            docs/benchmarks.md#checkpoint-conversion).

    Raises:
        CheckpointFormatError: incomplete or unreadable step (the first bad file named). ConvertError: a model
        neither GPT-2 nor BLOOM, a bad ``dtype``, a missing tokenizer, or a failed verification.
        OutputRefusedError: ``out_dir`` is a file, holds files opskit did not write, or (without ``force``) an
        earlier conversion (:func:`opskit.fsutil.claim_dir`); checked before any work and again before the rename.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    claim_dir(out_dir, force, command=CONVERT_COMMAND)
    step_path = resolve_step_dir(path, step)
    info = describe_step(step_path)
    weights_only = weights_only_copy(info)
    if info.problems and not weights_only:
        raise CheckpointFormatError(info.problems[0])
    scanned = scan_step_dir(step_path)
    client_state = load_state(scanned.mp_rank_file(), light=True)  # args only: torch need not be imported
    args = client_state["args"]
    arch = model_arch(args, step_path)
    dtype = dtype or info.dtype
    tokenizer = load_tokenizer(args, tokenizer_dir)
    keep_rows = original_vocab_size(args, client_state) if trim_vocab else None
    if trim_vocab and keep_rows is None:
        raise ConvertError(f"{step_path}: the checkpoint does not record the unpadded vocabulary size; cannot trim")
    averaged: list[str] = []
    tensors = plan_tensors(scanned, args, arch, keep_rows, averaged)
    n_positions = next((t.shape[0] for t in tensors if t.name.endswith("wpe.weight")), None)
    if problem := tokenizer.vocabulary_problem(tensors[0].shape[0]):
        raise ConvertError(problem)
    config = hf_config(arch, args, tensors[0].shape[0], dtype, n_positions, tokenizer.eos_token_id)
    parameters = sum(numel(t.shape) for t in tensors)
    if verify_layers is None and parameters > VERIFY_WHOLE_MAX_PARAMETERS:
        verify_layers = VERIFY_PARTIAL_LAYERS

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shards = _write_shards(staging, tensors, DTYPES[dtype], max_shard_bytes, progress,
                               workers or DEFAULT_WORKERS)
        _write_side_files(staging, config, tokenizer)
        try:
            max_abs_diff = verify_conversion(step_path, staging, dtype, verify_layers) if verify else None
        except ConvertError as e:
            raise ConvertError(f"{e}; nothing was written to {out_dir}") from None
        write_marker(staging, CONVERT_COMMAND, folder_entries(staging), conversion_source(step_path, info.iteration),
                     digests="sha256")
        # again: something may have been written there during the conversion
        claim_dir(out_dir, force, command=CONVERT_COMMAND)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Converted(out_dir, step_path, info.iteration, arch, parameters, shards, averaged, max_abs_diff,
                     verified_layers=(verify_layers or args.num_layers) if verify else None,
                     num_layers=args.num_layers, weights_only_backup=weights_only)


def _write_shards(folder: Path, tensors: list[OutTensor], dtype: str, max_shard_bytes: int,
                  progress: Callable[[int, int], None] | None, workers: int) -> int:
    """The safetensors shards (``dtype``: torch's name) and their index into ``folder``; returns the number of
    shards."""
    shards = plan_shards(tensors, ITEMSIZES[dtype], max_shard_bytes)
    total_source, done, total_size, weight_map = sum(t.source_bytes for t in tensors), 0, 0, {}

    def tick(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, total_source)

    for number, shard in enumerate(shards):
        name = shard_name(number, len(shards))
        total_size += write_safetensors(folder / name, shard, dtype, tick, workers=workers)
        weight_map.update({t.name: name for t in shard})
    write_index(folder, weight_map, total_size)
    return len(shards)


@dataclass(frozen=True)
class RunTokenizer:
    """The run's tokenizer as the converted folder gets it: the files of ``folder`` copied as they are, or (runs
    with ``--vocab-file``/``--merge-file``) ``fast``, a transformers tokenizer saved with ``save_pretrained``.
    ``special_ids``: each special token -> the id transformers gives it when it loads the converted folder (a token
    the tokenizer's vocabulary lacks is added after its last id); ``size``: ids in use, added tokens included;
    ``source``: what was read, for messages."""

    eos_token_id: int | None
    folder: Path | None = None
    fast: object = None
    special_ids: dict[str, int] = field(default_factory=dict)
    size: int = 0
    source: str = ""

    def save(self, out: Path) -> None:
        if self.fast is not None:
            self.fast.save_pretrained(out)
            return
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, out / name)

    def vocabulary_problem(self, vocab_size: int) -> str | None:
        """Why this tokenizer cannot drive a model of ``vocab_size`` embedding rows (None when it can): a special
        token, or any token, with an id at or past ``vocab_size`` (a prompt holding it would index past the
        embedding: IndexError in transformers)."""
        outside = {token: i for token, i in self.special_ids.items() if not 0 <= i < vocab_size}
        if outside:
            token, i = next(iter(outside.items()))
            return (f"{self.source}: special token {token!r} has id {i}, outside the model's vocabulary of "
                    f"{vocab_size} (ids 0-{vocab_size - 1}): the run never trained such a token; pass --tokenizer DIR "
                    "with a tokenizer whose special tokens are in the vocabulary")
        if self.size > vocab_size:
            return (f"{self.source}: {self.size} tokens (added ones included), more than the model's vocabulary of "
                    f"{vocab_size}: pass --tokenizer DIR with the tokenizer the run trained with")
        return None


# GPT-2's one special token (unk = bos = eos), which transformers' GPT-2 tokenizers add when the vocabulary lacks it.
GPT2_SPECIAL = "<|endoftext|>"


def load_tokenizer(args: argparse.Namespace, tokenizer_dir: str | Path | None = None) -> RunTokenizer:
    """The run's tokenizer: ``tokenizer_dir``, else the saved ``--tokenizer-name-or-path`` (PretrainedFromHF), else
    the saved ``--vocab-file``/``--merge-file`` (GPT2BPETokenizer, as tr1-13B ran). A tokenizer folder is not loaded:
    its files are copied (transformers' import alone costs ~2 s), and its special tokens are looked up with
    ``tokenizers``. GPT-2 BPE files become a transformers tokenizer of exactly Megatron's GPT2BPETokenizer
    vocabulary: GPT-2's ``<|endoftext|>`` is its special token only where the vocabulary holds it (transformers
    would otherwise add it past the last id, outside the model's embedding).

    Raises:
        ConvertError: none of them is readable here.
    """
    folder = tokenizer_dir or getattr(args, "tokenizer_name_or_path", None)
    if folder is not None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise ConvertError(f"{folder}: no tokenizer.json (pass --tokenizer DIR)")
        eos, special_ids, size = _folder_special_tokens(folder)
        return RunTokenizer(eos, folder=folder, special_ids=special_ids, size=size, source=str(folder))
    vocab, merges = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
    if vocab and merges and Path(vocab).is_file() and Path(merges).is_file():
        from transformers import GPT2TokenizerFast

        try:
            special = GPT2_SPECIAL if GPT2_SPECIAL in json.loads(Path(vocab).read_text(encoding="utf-8")) else None
        except (ValueError, TypeError):
            raise ConvertError(f"--vocab-file {vocab}: not a GPT-2 vocab.json (a JSON object of tokens)") from None
        with tempfile.TemporaryDirectory() as folder:  # the file names every transformers version reads
            shutil.copy(vocab, Path(folder) / "vocab.json")
            shutil.copy(merges, Path(folder) / "merges.txt")
            fast = GPT2TokenizerFast.from_pretrained(folder, unk_token=special, bos_token=special, eos_token=special)
            return RunTokenizer(fast.eos_token_id, fast=fast, size=len(fast), source=f"--vocab-file {vocab}",
                                special_ids={t: fast.convert_tokens_to_ids(t) for t in fast.all_special_tokens})
    raise ConvertError(f"the run's tokenizer is not readable here (tokenizer_name_or_path None, vocab_file {vocab}, "
                       f"merge_file {merges}); pass --tokenizer DIR")


def _folder_special_tokens(folder: Path) -> tuple[int | None, dict[str, int], int]:
    """(eos id, special token -> id, ids in use) of a tokenizer folder, as transformers numbers them: the special
    tokens ``special_tokens_map.json`` or else ``tokenizer_config.json`` names (transformers' precedence), each
    looked up in ``tokenizer.json``, one it lacks added after the last id. Without ``tokenizer.json``: (None, {},
    0), nothing to check."""
    named: dict[str, object] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            try:
                config = json.loads((folder / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                raise ConvertError(f"{folder / name}: not a JSON object") from None
            if not isinstance(config, dict):
                raise ConvertError(f"{folder / name}: not a JSON object")
            named.update({k: v for k, v in config.items() if k.endswith("_token") or k == "additional_special_tokens"})
    if not (folder / "tokenizer.json").is_file():
        return None, {}, 0
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    roles: dict[str, str] = {}  # token -> its first role, in the order transformers adds missing ones
    for role, value in named.items():
        for token in value if isinstance(value, list) else [value]:
            token = token.get("content") if isinstance(token, dict) else token  # a serialized AddedToken
            if isinstance(token, str):
                roles.setdefault(token, role)
    special_ids: dict[str, int] = {}
    for token in roles:
        found = tokenizer.token_to_id(token)
        if found is None:
            found, size = size, size + 1
        special_ids[token] = found
    eos = next((t for t, role in roles.items() if role == "eos_token"), None)
    return (special_ids[eos] if eos is not None else None), special_ids, size


def _write_side_files(folder: Path, config: dict, tokenizer: RunTokenizer) -> None:
    """``config.json``, ``generation_config.json`` (bos/eos/pad as in the config) and the tokenizer's files."""
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for name, content in (("config.json", config), ("generation_config.json", generation)):  # staged folder
        (folder / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    tokenizer.save(folder)


def convert_all(checkpoint_dir: str | Path, out_root: str | Path, force: bool = False, **options) -> Conversions:
    """Convert every complete step of a run (or of a weights-only backup: its steps' copies, as :func:`convert_step`
    takes them) into ``out_root/global_stepN``; a step whose folder holds an intact conversion of that same step
    (:func:`conversion_problem`) is skipped (``Converted.skipped``), an incomplete step is not converted
    (:class:`NotConverted`, with its first problem), and neither is a damaged or stale conversion without ``force``
    (with it, the step is converted again). ``force`` and ``options`` as :func:`convert_step`.

    Raises:
        OutputRefusedError: before anything is converted, for the first step folder :func:`convert_step` would
            refuse (a user's folder, another command's, or one holding files the conversion did not write).
    """
    _latest, steps = list_steps(checkpoint_dir)
    plan = [(info, Path(out_root) / info.path.name, info.complete or weights_only_copy(info)) for info in steps]
    problems = {out: conversion_problem(out, info.path, info.iteration) for info, out, usable in plan if usable}
    for _info, out, usable in plan:  # every refusal before the first (long) conversion
        if usable and problems[out] and (force or not has_marker(out, CONVERT_COMMAND)):
            claim_dir(out, force, command=CONVERT_COMMAND)
    done = Conversions()
    for info, out, usable in plan:
        if not usable:
            done.not_converted.append(NotConverted(info.path, f"incomplete step: {info.problems[0]}"))
        elif problems[out] is None:
            done.converted.append(Converted(out, info.path, info.iteration, "", 0, skipped=True))
        elif not force and has_marker(out, CONVERT_COMMAND):
            done.not_converted.append(NotConverted(info.path, f"{out}: {problems[out]}; --force converts it again"))
        else:
            done.converted.append(convert_step(info.path, out, force=force, **options))
    return done


def convert_checkpoint(directory: str | Path, hf_dir: Path, step: int | None = None, all_steps: bool = False,
                       out: Path | None = None, to: str = "hf", **options) -> Conversions:
    """``opskit ckpt convert``: one step of ``directory`` (``step``, else the one ``latest`` names; or a step folder
    itself) into ``out`` (default ``hf_dir/global_stepN``), or with ``all_steps`` every step into ``out`` (default
    ``hf_dir``) as :func:`convert_all`. ``hf_dir`` is the run's folder of converted steps
    (:attr:`opskit.run.paths.RunPaths.hf_dir`); ``options`` as :func:`convert_step`.

    Raises:
        ConvertError: a ``to`` other than ``hf``; and as :func:`convert_step` / :func:`convert_all`.
    """
    if to != "hf":
        raise ConvertError(f"--to {to}: only 'hf' is implemented (hf:// publishing is `opskit ckpt publish`)")
    if all_steps:
        return convert_all(directory, out or hf_dir, **options)
    step_dir = resolve_step_dir(directory, step)
    return Conversions([convert_step(step_dir, out or hf_dir / step_dir.name, **options)])


def conversion_source(step_path: Path, iteration: int | None) -> dict:
    """What a conversion was made from, as its marker records it: the step folder's resolved path, its iteration,
    and :func:`opskit.ckpt.format.info.saved_files_digest` (a step saved again after a rollback differs)."""
    return {"step": str(Path(step_path).resolve()), "iteration": iteration, "files": saved_files_digest(step_path)}


def conversion_problem(out: Path, step_path: Path, iteration: int | None) -> str | None:
    """Why ``out`` is not an intact conversion of the step at ``step_path`` (None when it is): no conversion marker,
    one made from another step or an earlier save of it, or a file the marker lists missing, of another size or with
    other bytes than it recorded (:func:`opskit.fsutil.damaged_entries`: every file is read); a marker without
    recorded digests (an older opskit's) cannot prove its files intact."""
    marker = read_marker(out)
    if marker is None or marker.get("command") != CONVERT_COMMAND:
        return "no conversion by opskit"
    if marker.get("source") != conversion_source(step_path, iteration):
        return f"converted from another checkpoint than {step_path} as saved now (stale)"
    if "entries" not in marker:
        return "damaged conversion (its marker lists no files)"
    damaged = damaged_entries(out, marker)
    if damaged is None:
        return "conversion without recorded file digests (an older opskit): its files cannot be proven intact"
    if damaged:
        shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        return f"damaged conversion: {shown}"
    return None


# --------------------------------------------------------------------------- verification


def verification_tokens(args: argparse.Namespace, tokenizer_dir: Path, count: int = 3, length: int = 32):
    """``[count, length]`` token ids of real text: the run's own dataset when it is readable here, else a fixed
    passage through the tokenizer. ``length`` is capped by the model's positions."""
    import torch

    length = min(length, args.max_position_embeddings or length, args.seq_length or length)
    # Megatron-DeepSpeed's --data-path is a list ("[weight] prefix" pairs); opskit's trainer saves one prefix.
    prefix = args.data_path[-1] if isinstance(args.data_path, list) else args.data_path
    try:
        docs = read_documents(prefix)
        chosen = [docs[i][:length] for i in range(len(docs)) if len(docs[i]) >= length][:count]
        if len(chosen) == count:
            return torch.tensor([d.tolist() for d in chosen], dtype=torch.long)
    except Exception:  # dataset not on this machine: fall back to text
        pass
    from transformers import AutoTokenizer

    text = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
            "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ") * 4
    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
    return torch.tensor([ids[i * 7:i * 7 + length] for i in range(count)], dtype=torch.long)


def special_tokens_row(folder: Path, vocab_size: int, length: int):
    """``[1, <= length]`` token ids of a prompt holding every special token of the tokenizer written to ``folder``,
    encoded by that tokenizer as ``ckpt generate`` encodes a prompt (``"In the beginning<|endoftext|>And"``).

    Raises:
        ConvertError: the tokenizer gives an id (for the prompt, a special token or its last token) at or past
            ``vocab_size``.
    """
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("In the beginning" + "".join(f"{t}And" for t in tokenizer.all_special_tokens))["input_ids"]
    outside = sorted({i for i in [*ids, *tokenizer.all_special_ids, len(tokenizer) - 1] if not 0 <= i < vocab_size})
    if outside:
        raise ConvertError(f"{folder}: verification failed: the written tokenizer gives token ids {outside}, "
                           f"outside the model's vocabulary of {vocab_size} (special tokens "
                           f"{tokenizer.all_special_tokens})")
    return torch.tensor([ids[:length]], dtype=torch.long)


def verify_conversion(step_path: Path, folder: Path, dtype: str, num_layers: int | None = None) -> float:
    """Max abs difference between transformers' logits of ``folder`` and the checkpoint's own forward
    (:class:`opskit.train.inference.GPTModel`, weights rounded to ``dtype`` like the conversion, computed in fp32), on
    real text and on a prompt with every special token through the written tokenizer (:func:`special_tokens_row`).

    Args:
        num_layers: compare models cut after this many blocks (same embedding, final LayerNorm and head), for models
            that do not fit twice in memory in fp32; None: the whole model.

    Raises:
        ConvertError: keys missing when transformers loads the folder, a token id of the written tokenizer outside the
        model's vocabulary, or a difference above ``max(1e-4, 1e-5 * max |logit|)``.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from opskit.train.inference import GPTModel

    hf_logging.disable_progress_bar()
    args = load_args(scan_step_dir(step_path))
    tokens = verification_tokens(args, folder)
    cut = {} if num_layers is None else {"num_hidden_layers": min(num_layers, args.num_layers)}
    model, loading = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True,
                                                          **cut)
    missing = [k for k in loading["missing_keys"] if k != "lm_head.weight"]
    unexpected = [k for k in loading["unexpected_keys"] if not cut or not _block_index(k) >= num_layers]
    if missing or unexpected:
        raise ConvertError(f"{folder}: transformers reports missing keys {missing}, unexpected {unexpected}")
    special = special_tokens_row(folder, model.config.vocab_size, tokens.shape[1])
    reference = GPTModel.from_checkpoint(step_path, num_layers=num_layers).to(getattr(torch, DTYPES[dtype])).float()
    diff, largest = 0.0, 0.0
    with torch.no_grad():
        for batch in (tokens, special):
            theirs = model.eval()(batch).logits
            ours = reference(batch)[..., : theirs.shape[-1]]
            diff = max(diff, (theirs - ours).abs().max().item())
            largest = max(largest, ours.abs().max().item())
    tolerance = max(VERIFY_ATOL, VERIFY_RTOL * largest)  # fp32 sums in another order, large logits
    if not diff <= tolerance:
        raise ConvertError(f"{step_path}: verification failed: transformers' logits differ from the checkpoint's own "
                           f"forward by {diff:.3g} (> {tolerance:.3g}) on {tokens.shape[0]} sequences of "
                           f"{tokens.shape[1]} tokens")
    return diff


def _block_index(key: str) -> int:
    """``transformer.h.12.attn.c_attn.weight`` -> 12; -1 for keys outside the blocks."""
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["transformer", "h"] and parts[2].isdigit() else -1
