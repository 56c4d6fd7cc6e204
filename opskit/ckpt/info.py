"""What is in a run's checkpoint dir: ``opskit ckpt list`` (steps, sizes, degrees, completeness, counters) and
``opskit ckpt inspect`` (architecture and per-file tensors), reading pickles and zip headers only (no tensor data).

"Complete" means: ``mp_rank_00`` loads and has ``args``; every layer file that ``args`` implies (embedding, blocks,
final LayerNorm, for each TP rank) and every ``mp_rank_XX`` file (``TP * PP`` of them) is there, loads, and has every
tensor record inside the file (a truncated copy fails that).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.layout import (
    FIRST_BLOCK_LAYER,
    LAYER_FILE,
    MP_RANK_FILE,
    STEP_DIR,
    CheckpointFormatError,
    expected_layers,
    layer_file_name,
    load_state,
    read_latest,
    step_dirs,
)
from opskit.ckpt.tensorfile import TensorRef

ZERO_FILE_SUFFIX = "_optim_states.pt"


@dataclass
class StepInfo:
    """One ``global_stepN`` folder. ``size_bytes``: all its files; ``problems``: one line per missing or unreadable
    file (full path first); ``dtype``: of the transformer weights (``bf16``/``fp16``/``fp32``)."""

    iteration: int
    path: Path
    size_bytes: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    num_layers: int | None = None
    dtype: str | None = None
    consumed_samples: int | None = None
    consumed_tokens: int | None = None
    latest: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    def as_json(self) -> dict:
        return {"step": self.iteration, "path": str(self.path), "size_bytes": self.size_bytes, "tp": self.tp,
                "pp": self.pp, "dp": self.dp, "num_layers": self.num_layers, "dtype": self.dtype,
                "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens,
                "latest": self.latest, "complete": self.complete, "problems": self.problems}


DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def dtype_name(ref: TensorRef) -> str:
    """``fp32``/``fp16``/``bf16`` (Megatron's names), else torch's name."""
    return DTYPE_NAMES.get(ref.dtype_name, ref.dtype_name)


def _client_state(path: Path) -> tuple[dict | None, str | None]:
    try:
        state = load_state(path, light=True)
    except CheckpointFormatError as e:
        return None, str(e)
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        return None, f"{path}: no 'args' (not written by Megatron-DeepSpeed?)"
    return state, None


def describe_step(path: str | Path, latest: bool = False) -> StepInfo:
    """Read one step folder's headers into a :class:`StepInfo` (never raises for a damaged step: see ``problems``)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    match = STEP_DIR.match(path.name)
    info = StepInfo(iteration=int(match.group(1)) if match else -1, path=path,
                    size_bytes=sum(f.stat().st_size for f in files), latest=latest)
    state, problem = _client_state(path / "mp_rank_00_model_states.pt")
    if state is None:
        info.problems.append(problem if (path / "mp_rank_00_model_states.pt").is_file() else
                             f"{path / 'mp_rank_00_model_states.pt'}: no such file")
        return info
    args = state["args"]
    info.tp, info.pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    info.num_layers = args.num_layers
    info.consumed_samples = getattr(args, "consumed_train_samples", None)
    info.consumed_tokens = state.get("tokens")
    zero_files = [f for f in files if f.name.endswith(ZERO_FILE_SUFFIX)]
    info.dp = len(zero_files) // (info.tp * info.pp) if zero_files else state.get("dp_world_size")
    expected = [path / layer_file_name(i, t) for i in expected_layers(info.num_layers) for t in range(info.tp)]
    expected += [path / f"mp_rank_{m:02d}_model_states.pt" for m in range(1, info.tp * info.pp)]
    for f in expected:
        if not f.is_file():
            info.problems.append(f"{f}: no such file")
            continue
        try:
            loaded = load_state(f, light=True)
        except CheckpointFormatError as e:
            info.problems.append(str(e))
            continue
        if info.dtype is None and f.name.startswith(f"layer_{FIRST_BLOCK_LAYER:02d}-"):  # the blocks' weights
            info.dtype = next((dtype_name(v) for v in loaded.values() if isinstance(v, TensorRef)), None)
    unexpected = [f for f in files if (LAYER_FILE.match(f.name) or MP_RANK_FILE.match(f.name)) and f not in expected
                  and f.name != "mp_rank_00_model_states.pt"]
    info.problems += [f"{f}: not expected for TP={info.tp}, PP={info.pp}, {info.num_layers} layers" for f in unexpected]
    return info


def list_steps(directory: str | Path) -> tuple[str | None, list[StepInfo]]:
    """(``latest`` tag or None, every ``global_stepN`` of a run's checkpoint dir, ascending).

    Raises:
        CheckpointFormatError: when ``directory`` has no ``global_stepN`` folders.
    """
    directory = Path(directory)
    steps = step_dirs(directory)
    if not steps:
        raise CheckpointFormatError(f"{directory}: no global_stepN folders (not a checkpoint dir)")
    latest = read_latest(directory)
    return latest, [describe_step(p, latest=p.name == latest) for p in steps.values()]


def inspect_step(path: str | Path) -> dict:
    """Architecture (from the saved ``args``) and, per file, every tensor's name, shape and dtype.

    Returns:
        ``{"step": N, "path": str, "args": {...}, "files": {name: {key: {"shape": [...], "dtype": "bf16"}}}}``;
        the optimizer files are listed by size only (their tensors are flat fp32 partitions).

    Raises:
        CheckpointFormatError: no readable ``mp_rank_00_model_states.pt``.
    """
    path = Path(path)
    state, problem = _client_state(path / "mp_rank_00_model_states.pt")
    if state is None:
        raise CheckpointFormatError(problem or f"{path / 'mp_rank_00_model_states.pt'}: no such file")
    args = vars(state["args"])
    arch_keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings", "position_embedding_type", "embed_layernorm", "padded_vocab_size",
                 "original_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "params_dtype", "fp16", "bf16", "bias_gelu_fusion", "openai_gelu", "glu_activation",
                 "layernorm_epsilon", "tokenizer_name_or_path")
    files: dict[str, dict] = {}
    for f in sorted(path.iterdir()):
        if f.name.endswith(ZERO_FILE_SUFFIX) or not f.name.endswith(".pt"):
            files[f.name] = {"size_bytes": f.stat().st_size}
            continue
        loaded = load_state(f, light=True)
        tensors = loaded.items() if LAYER_FILE.match(f.name) else \
            ((k, v) for k, v in loaded.items() if isinstance(v, TensorRef))
        files[f.name] = {k: {"shape": list(v.shape), "dtype": dtype_name(v)} for k, v in tensors
                         if isinstance(v, TensorRef)}
    return {"step": state.get("iteration"), "path": str(path),
            "architecture": {k: args[k] for k in arch_keys if k in args},
            "consumed_samples": args.get("consumed_train_samples"), "consumed_tokens": state.get("tokens"),
            "files": files}
