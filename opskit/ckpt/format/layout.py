"""Read Megatron-DeepSpeed checkpoint folders (reference section 2.1) and merge their TP/PP shards.

A run's checkpoint directory holds ``latest`` and ``global_stepN/`` folders; a step folder holds one
``layer_XX-model_YY-model_states.pt`` per layer and TP rank, one ``mp_rank_MM_model_states.pt`` per (PP, TP) rank
(``MM = pp * TP + tp``) carrying the training ``args``, and the optimizer shards
``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`` (one per DP rank and ``MM``) that a resume reads but weights
never need. Which files a complete step has: :func:`opskit.ckpt.format.info.describe_step`.

TP merge rules, as in transformers' BLOOM converter and DeepSpeed's ds_to_universal: replicated tensors (LayerNorms,
row-parallel biases, position embeddings) are averaged, row-parallel weights concatenated on dim 1, everything else on
dim 0.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.tensorfile import TensorFileError, load_lazy, materialize
from opskit.errors import OpskitError
from opskit.fsutil import atomic_write_text, read_bounded
from opskit.rules.model_size import has_embedding_layernorm

LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_RANK_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIMIZER_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
STEP_DIR = re.compile(r"^global_step([0-9]+)\Z")

REPLICATED_SUFFIXES = (
    "input_layernorm.weight", "input_layernorm.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "self_attention.dense.bias", "mlp.dense_4h_to_h.bias",
    "word_embeddings.norm.weight", "word_embeddings.norm.bias",
    "position_embeddings.weight",
)
ROW_PARALLEL_WEIGHTS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")

# Megatron-DeepSpeed's pipeline layer numbering: 1 embedding, 3..L+2 blocks, L+4 final LayerNorm.
EMBEDDING_LAYER = 1
FIRST_BLOCK_LAYER = 3


def universal_checkpoint_info(args: argparse.Namespace) -> dict:
    """DeepSpeed's ``universal_checkpoint_info`` for our layer list: how ``ds_to_universal`` merges each parameter's
    TP slices, which the trainer saves with every step (Megatron-DeepSpeed's ``_universal_checkpoint_info``). The
    patterns are the TP merge rules above over the engine's parameter names (``tied_modules.embed.*``,
    ``<layer>.<key>``), only those the model of the training ``args`` has (GPT-2's absolute position embeddings, a
    LayerNorm after the word embedding): ds_to_universal refuses a pattern that matches nothing.
    ``original_vocab_size`` is the saved *padded* size: ds_to_universal then keeps the trained padding rows (it would
    cut them off at the tokenizer's size), so a resume at the same padded size is exact, and DeepSpeed's loader adds
    zero rows where the new layout pads further.

    Source: DeepSpeed ``deepspeed/checkpoint/ds_to_universal.py`` (``merge_tp_slices``) and Megatron-DeepSpeed
    ``megatron/model/gpt_model.py`` (``_universal_checkpoint_info``).
    """
    embedding_norm = has_embedding_layernorm(args.embed_layernorm, getattr(args, "use_bnb_optimizer", False))
    absent = (() if args.position_embedding_type == "absolute" else ("position_embeddings.",)) + \
        (() if embedding_norm else ("norm.",))
    replicated = [name for name in REPLICATED_SUFFIXES if not name.startswith(absent)
                  and not name.startswith(tuple("word_embeddings." + a for a in absent))]
    escaped = lambda names: [rf".*\.{re.escape(name)}$" for name in names]  # noqa: E731
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": args.padded_vocab_size,
        "padded_vocab_size": args.padded_vocab_size,
        "vocabulary_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight$"],
        "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\."],
        "tp_replicated_parameter_patterns": [*escaped(replicated), r"\d+\.(weight|bias)$"],
        "parameter_with_row_parallelism_patterns": escaped(ROW_PARALLEL_WEIGHTS),
    }


def final_norm_layer(num_layers: int) -> int:
    """Index of the final LayerNorm's file: ``layer_{L+4}``."""
    return num_layers + 4


def expected_layers(num_layers: int) -> list[int]:
    """Layer-file indices of an ``num_layers``-block model: embedding, blocks, final LayerNorm."""
    return [EMBEDDING_LAYER, *range(FIRST_BLOCK_LAYER, FIRST_BLOCK_LAYER + num_layers), final_norm_layer(num_layers)]


def layer_file_name(index: int, tp_rank: int) -> str:
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


def read_latest(directory: str | Path) -> str | None:
    """The tag in ``<dir>/latest`` (``global_stepN``, e.g. ``global_step95000``), or None when there is no ``latest``.

    Raises:
        CheckpointFormatError: ``latest`` is a directory, unreadable, not text, or not a ``global_stepN`` tag (empty,
            a path such as ``../x``): one line quoting what it holds.
    """
    path = Path(directory) / "latest"
    if not path.exists() and not path.is_symlink():
        return None
    expected = "expected a tag such as global_step1000"
    if path.is_dir():
        raise CheckpointFormatError(f"{path}: a directory, {expected}")
    try:
        data = read_bounded(path, 4096)  # a tag is ~20 bytes: a device or a huge file is no latest
    except OSError as e:
        raise CheckpointFormatError(f"{path}: unreadable ({e.strerror or e}), {expected}") from None
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        more = "..." if len(data) > 16 else ""
        raise CheckpointFormatError(f"{path}: not text ({len(data)} bytes: {data[:16]!r}{more}), {expected}") from None
    if not STEP_DIR.match(tag):
        raise CheckpointFormatError(f"{path}: holds {tag[:40]!r}, {expected}")
    return tag


def latest_state(directory: str | Path) -> tuple[str | None, str | None]:
    """(tag, None) from :func:`read_latest`; (None, None) without ``latest``; (None, why) when it is unusable."""
    try:
        return read_latest(directory), None
    except CheckpointFormatError as e:
        return None, str(e)


def write_latest(directory: str | Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically (temp file + rename; no newline, as DeepSpeed writes it)."""
    atomic_write_text(Path(directory) / "latest", tag)


# The trainer's line after a save (opskit.train.log, as Megatron prints it): goodput's account and the watchdog's
# evidence that a step was saved (re.match on the line less its srun/torchrun prefixes, re.search on a raw line).
SAVED_LINE = re.compile(r"  successfully saved checkpoint at iteration +(\d+) ")
# The trainer's error line when a save fails (opskit.train.checkpointing); the watchdog looks for it in the log.
SAVE_FAILED_LINE = re.compile(r"error: saving (global_step\d+) failed: (.+)$")


def save_failed_message(tag: str, reason: str) -> str:
    """What the trainer prints after ``error: `` when saving ``tag`` failed (matched by ``SAVE_FAILED_LINE``)."""
    return f"saving {tag} failed: {reason}"


def step_dirs(directory: str | Path) -> dict[int, Path]:
    """Iteration -> ``global_stepN`` folder of a run's checkpoint dir, ascending."""
    directory = Path(directory)
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()} \
        if directory.is_dir() else {}
    return dict(sorted(found.items()))


class CheckpointFormatError(OpskitError, ValueError):
    """A folder that is not a (complete) Megatron-DeepSpeed checkpoint; one line naming the folder and what is wrong."""


def existing_checkpoint_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, for commands that act on a run's checkpoints (a missing one is not "no steps").

    Raises:
        CheckpointFormatError: it is not an existing folder.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointFormatError(f"{directory}: no such checkpoint dir (expected a folder of global_stepN folders)")
    return directory


@dataclass(frozen=True)
class StepDir:
    """One ``global_stepN`` folder.

    Attributes:
        path: the folder.
        layers: layer index -> files ordered by TP rank.
        tp, pp: parallel degrees read from the file names.
    """

    path: Path
    layers: dict[int, list[Path]]
    tp: int
    pp: int

    @property
    def iteration(self) -> int:
        return int(STEP_DIR.match(self.path.name).group(1)) if STEP_DIR.match(self.path.name) else -1

    def mp_rank_file(self, pp_rank: int = 0, tp_rank: int = 0) -> Path:
        return self.path / f"mp_rank_{pp_rank * self.tp + tp_rank:02d}_model_states.pt"


def resolve_step_dir(path: str | Path, step: int | None = None) -> Path:
    """A run's checkpoint dir (+ optional step) or a step folder -> the ``global_stepN`` folder to read.

    Raises:
        CheckpointFormatError: when there is no ``latest`` to follow or the step is missing.
    """
    path = Path(path)
    if step is not None:
        target = path / f"global_step{step}"
    elif any(path.glob("layer_*-model_states.pt")):
        return path
    elif tag := read_latest(path):
        target = path / tag
        if not target.is_dir():
            raise CheckpointFormatError(f"{path / 'latest'}: names {tag}, which does not exist")
        return target
    else:
        raise CheckpointFormatError(f"{path}: neither a global_stepN folder nor a checkpoint dir with a 'latest' file")
    if not target.is_dir():
        raise CheckpointFormatError(f"{target}: no such checkpoint step")
    return target


def scan_step_dir(path: str | Path) -> StepDir:
    """Index a step folder's layer files and infer TP and PP.

    Raises:
        CheckpointFormatError: no layer files, a layer missing a TP rank, or mp_rank files that do not match TP.
    """
    path = Path(path)
    layers: dict[int, dict[int, Path]] = {}
    mp_ranks = 0
    for f in path.iterdir():
        if m := LAYER_FILE.match(f.name):
            layers.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
        elif MP_RANK_FILE.match(f.name):
            mp_ranks += 1
    if not layers:
        raise CheckpointFormatError(f"{path}: no layer_XX-model_YY-model_states.pt files")
    tp = max(len(ranks) for ranks in layers.values())
    for index, ranks in sorted(layers.items()):
        if sorted(ranks) != list(range(tp)):
            raise CheckpointFormatError(f"{path}: layer_{index:02d} has TP ranks {sorted(ranks)}, expected 0..{tp - 1}")
    if mp_ranks == 0 or mp_ranks % tp:
        raise CheckpointFormatError(f"{path}: {mp_ranks} mp_rank_XX_model_states.pt files for TP={tp}")
    return StepDir(path, {i: [r[t] for t in range(tp)] for i, r in sorted(layers.items())}, tp, mp_ranks // tp)


def load_state(path: Path, lazy: bool = True, light: bool = False):
    """A checkpoint file's pickled object; with ``lazy`` its tensors are
    :class:`~opskit.ckpt.format.tensorfile.TensorRef` (nothing read yet), else tensors. Classes not installed here
    (``megatron.enums``) load as placeholders; with ``light`` (headers only) torch, numpy and deepspeed are not imported
    either.

    Raises:
        CheckpointFormatError: truncated, foreign or unreadable file, naming it.
    """
    try:
        state = load_lazy(path, light)
        return state if lazy else materialize(state)
    except (TensorFileError, OSError) as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise CheckpointFormatError(f"{path}: cannot be loaded ({reason})") from None


def load_args(step: StepDir, light: bool = False) -> argparse.Namespace:
    """The training ``args`` saved in ``mp_rank_00_model_states.pt``; ``light``: its pickle only (no torch, no tensor
    data: :func:`load_state`), enough for the architecture, the layout flags and the counters."""
    path = step.mp_rank_file()
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such file (every step needs mp_rank_00_model_states.pt)")
    state = load_state(path, light=light)
    if not isinstance(state, dict) or "args" not in state:
        raise CheckpointFormatError(f"{path}: no 'args' (not written by Megatron-DeepSpeed?)")
    return state["args"]


def tp_rule(key: str) -> str:
    """How one layer-file key's TP shards combine: ``"replicated"`` (identical on every rank; LayerNorms,
    row-parallel biases, position embeddings, the final LayerNorm's bare ``weight``/``bias``), ``"cat1"``
    (row-parallel weights) or ``"cat0"`` (column-parallel weights/biases, vocabulary rows)."""
    if key.endswith(REPLICATED_SUFFIXES) or key in ("weight", "bias"):
        return "replicated"
    return "cat1" if key.endswith(ROW_PARALLEL_WEIGHTS) else "cat0"


def merge_tp(key: str, shards: list):
    """Merge one tensor's TP shards (ordered by rank) by the rules in the module docstring."""
    import torch  # torch: only when tensors are merged, not when folders are read (ckpt list, run paths)

    if len(shards) == 1:
        return shards[0]
    rule = tp_rule(key)
    if rule == "replicated":
        return torch.stack([s.float() for s in shards]).mean(0).to(shards[0].dtype)
    return torch.cat(shards, dim=1 if rule == "cat1" else 0)


def merged_layers(step: StepDir, only: set[int] | None = None) -> dict[int, dict]:
    """Layer index -> its state dict merged to TP=1 (PP needs no merging: each layer lives in one stage's files);
    ``only``: just these layer indices."""
    merged = {}
    for index, files in step.layers.items():
        if only is not None and index not in only:
            continue
        shards = [load_state(f, lazy=False) for f in files]
        merged[index] = {key: merge_tp(key, [s[key] for s in shards]) for key in shards[0]}
    return merged
