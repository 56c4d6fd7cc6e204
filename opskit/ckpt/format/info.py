"""What is in a run's checkpoint dir: ``opskit ckpt list`` (steps, sizes, degrees, completeness, counters),
``opskit ckpt inspect`` (architecture and per-file tensors) and the step a resume reads (:func:`resume_point`),
reading pickles and zip headers only (no tensor data, no torch).

The one definition of a complete step (:func:`describe_step`; ``ckpt list/check/set-latest/prune/backup/convert``,
the watchdog and the trainer's resume all use it): ``mp_rank_00_model_states.pt`` loads and has ``args``; every file
the step's TP x PP x DP layout needs is there -- the layer files ``args`` implies (embedding, blocks, final LayerNorm,
per TP rank), the ``TP * PP`` ``mp_rank_XX`` files, and the optimizer shards DeepSpeed 0.19.8 writes
(:func:`optimizer_shards`; where a step has them they are its only copy of the optimizer state, the ``mp_rank`` files
hold none: :func:`redundant_optimizer_bytes` measures the copy older bf16 ZeRO-0 steps carry, which no resume reads) --
and each is readable to its end: zip directory intact, every record's local header
where the directory says and its data inside the file (a truncated copy fails that), data.pkl's CRC-32 right and its
pickle loadable. Bytes flipped inside tensor data pass these header checks: ``ckpt check`` also reads every file and
compares each record's CRC-32 (:func:`opskit.ckpt.format.tensorfile.verify_crc`). A weights-only backup's copy of a step
(no optimizer shards) stays incomplete; ``ckpt convert/inspect/check`` read its weights all the same, saying so
(:func:`weights_only_copy`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.format.layout import (
    EMBEDDING_LAYER,
    FIRST_BLOCK_LAYER,
    LAYER_FILE,
    MP_RANK_FILE,
    OPTIMIZER_FILE,
    STEP_DIR,
    CheckpointFormatError,
    expected_layers,
    final_norm_layer,
    latest_state,
    layer_file_name,
    load_state,
    step_dirs,
)
from opskit.ckpt.format.manifest import is_manifest
from opskit.ckpt.format.tensorfile import TensorRef
from opskit.fsutil import read_json

ZERO_FILE_SUFFIX = "_optim_states.pt"


@dataclass
class StepInfo:
    """One ``global_stepN`` folder. ``size_bytes``: all its files; ``files``: every file a complete step of its layout
    has (empty when ``mp_rank_00`` is unusable); ``problems``: one line per missing or unreadable file (full path
    first); ``absent_optimizer``: the optimizer shards among ``files`` that are not there (each also a problem);
    ``dtype``: of the transformer weights (``bf16``/``fp16``/``fp32``)."""

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
    files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    absent_optimizer: list[Path] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def weights_problems(self) -> list[str]:
        """``problems`` less the absent optimizer shards: empty when every weight file (layer files, ``mp_rank_XX``)
        is there and readable. Not a kind of complete: only a weights-only backup's copy of a step may be read
        without its shards (:func:`weights_only_copy`), and nothing resumes from one."""
        absent = {f"{f}: no such file" for f in self.absent_optimizer}
        return [p for p in self.problems if p not in absent]

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


def _enabled(config: dict, *keys: str) -> bool:
    return any(isinstance(config.get(k), dict) and config[k].get("enabled") is True for k in keys)


def optimizer_shards(state: dict, mp_size: int, names: set[str]) -> tuple[list[str], int | None]:
    """(file names of the optimizer shards a step needs, DP size), as DeepSpeed 0.19.8 writes them.

    DeepSpeed writes ``{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` for every DP rank ``dp`` and
    model-parallel rank ``mp < TP * PP`` whenever its optimizer is partitioned: ZeRO stage >= 1, or bf16 (the
    BF16_Optimizer, at ZeRO-0 too); ``prefix`` is ``bf16_`` under bf16, else empty (``engine._get_zero_ckpt_name``).
    ZeRO-0 fp32/fp16 writes none: the optimizer state is inside the ``mp_rank`` files. The saved ``ds_config``
    (``mp_rank_00``) says which; without one (older writers), the shards present do. The DP size is DeepSpeed's
    ``dp_world_size`` in ``mp_rank_00``, else the highest DP rank among the shards present + 1.

    Args:
        state: ``mp_rank_00``'s pickle (light). mp_size: ``TP * PP``. names: the file names in the step folder.
    """
    present = [m for n in names if (m := OPTIMIZER_FILE.match(n))]
    dp = state.get("dp_world_size")
    if not isinstance(dp, int) or dp < 1:
        dp = max((int(m.group(2)) for m in present), default=-1) + 1 or None
    config = state.get("ds_config")
    if isinstance(config, dict):
        bf16 = _enabled(config, "bf16", "bfloat16")
        zero = config.get("zero_optimization")
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        prefix = ("bf16_" if bf16 else "") if bf16 or (isinstance(stage, int) and stage >= 1) else None
    else:
        prefix = min((m.group(1) or "" for m in present), default=None)
    if prefix is None or dp is None:
        return [], dp
    return [f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}{ZERO_FILE_SUFFIX}" for mp in range(mp_size)
            for d in range(dp)], dp


def redundant_optimizer_bytes(state, info: StepInfo) -> int:
    """Bytes of optimizer state that one of ``info``'s ``mp_rank_XX_model_states.pt`` files (``state``, its pickle
    with :class:`~opskit.ckpt.format.tensorfile.TensorRef` tensors) holds although the step's optimizer shards hold
    it: the storages under its ``optimizer`` entry when ``info`` needs shards (:func:`optimizer_shards`), else 0 (at
    ZeRO-0 without bf16 that entry is the only copy). bf16 + ZeRO-0 steps saved by DeepSpeed 0.18.5-0.19.8 without
    opskit.train.ds_compat's ``save_bf16_zero0_optimizer_once`` carry DP rank 0's states there a second time
    (:func:`opskit.rules.deepspeed.bf16_zero0_optimizer_saved_twice`); a resume reads the shards only, so the copy
    costs disk, save and backup time and nothing else."""
    if not any(OPTIMIZER_FILE.match(f.name) for f in info.files) or not isinstance(state, dict):
        return 0
    storages: dict[int, int] = {}  # record offset -> bytes: tensors viewing one storage count it once
    pending = [state.get("optimizer")]
    while pending:
        item = pending.pop()
        if isinstance(item, TensorRef):
            storages[item.offset] = item.storage_numel * item.itemsize
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return sum(storages.values())


def saved_files_digest(path: str | Path) -> str:
    """A digest of a step folder's file names, sizes and modification times: what a conversion of the step records,
    so that a step saved again under the same name (after a rollback) is told apart from the one converted."""
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode()
                          ).hexdigest()


def describe_step(path: str | Path, latest: bool = False) -> StepInfo:
    """Read one step folder's headers into a :class:`StepInfo` (never raises for a damaged step: see ``problems``;
    complete = no problems, the definition in the module docstring)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    match = STEP_DIR.match(path.name)
    info = StepInfo(iteration=int(match.group(1)) if match else -1, path=path,
                    size_bytes=sum(f.stat().st_size for f in files), latest=latest)
    client_file = path / "mp_rank_00_model_states.pt"
    state, problem = _client_state(client_file)
    if state is None:
        info.problems.append(problem if client_file.is_file() else f"{client_file}: no such file")
        return info
    args = state["args"]
    info.tp, info.pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    info.num_layers = args.num_layers
    info.consumed_samples = getattr(args, "consumed_train_samples", None)
    info.consumed_tokens = state.get("tokens")
    shards, info.dp = optimizer_shards(state, info.tp * info.pp, {f.name for f in files})
    info.files = [path / layer_file_name(i, t) for i in expected_layers(info.num_layers) for t in range(info.tp)]
    info.files += [path / f"mp_rank_{m:02d}_model_states.pt" for m in range(info.tp * info.pp)]
    info.files += [path / name for name in shards]
    block_keys: dict[int, set] = {}  # TP rank -> the first block's keys: every block of that rank has the same ones
    for f in info.files:
        if f == client_file:
            continue
        if not f.is_file():
            info.problems.append(f"{f}: no such file")
            if OPTIMIZER_FILE.match(f.name):
                info.absent_optimizer.append(f)
            continue
        try:
            loaded = load_state(f, light=True)
        except CheckpointFormatError as e:
            info.problems.append(str(e))
            continue
        if OPTIMIZER_FILE.match(f.name) and not (isinstance(loaded, dict) and "optimizer_state_dict" in loaded):
            info.problems.append(f"{f}: no 'optimizer_state_dict' (not a DeepSpeed optimizer shard)")
        if info.dtype is None and f.name.startswith(f"layer_{FIRST_BLOCK_LAYER:02d}-"):  # the blocks' weights
            info.dtype = next((dtype_name(v) for v in loaded.values() if isinstance(v, TensorRef)), None)
        if (layer := LAYER_FILE.match(f.name)) and (wrong := _misplaced_keys(f, layer, loaded, info.num_layers,
                                                                             block_keys)):
            info.problems.append(wrong)
    unexpected = [f for f in files if (LAYER_FILE.match(f.name) or MP_RANK_FILE.match(f.name)
                                       or OPTIMIZER_FILE.match(f.name)) and f not in info.files]
    info.problems += [f"{f}: not expected for TP={info.tp}, PP={info.pp}, {info.num_layers} layers" for f in unexpected]
    return info


def _misplaced_keys(path: Path, match: re.Match, state, num_layers: int, block_keys: dict[int, set]) -> str | None:
    """Why a layer file's keys do not fit its position (a block file where the final LayerNorm belongs, ...), or
    None: the embedding holds ``word_embeddings.weight``, the final LayerNorm exactly ``weight`` and ``bias``, every
    block of a TP rank the keys of the first one (``block_keys``, filled here). What convert refuses, from the
    pickle already read."""
    keys = set(state) if isinstance(state, dict) else set()
    index, tp_rank = int(match.group(1)), int(match.group(2))
    if index == final_norm_layer(num_layers):
        expected, ok = "only 'weight' and 'bias' (the final LayerNorm)", keys == {"weight", "bias"}
    elif index == EMBEDDING_LAYER:
        expected, ok = "'word_embeddings.weight' (the embedding)", "word_embeddings.weight" in keys
    else:
        first = block_keys.setdefault(tp_rank, keys)
        expected, ok = f"the keys of layer_{FIRST_BLOCK_LAYER:02d} (a transformer block)", keys == first and \
            keys != {"weight", "bias"}
    return None if ok else f"{path}: keys {sorted(keys)[:6]} do not fit its position: expected {expected}"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume from a run's checkpoint dir starts (:func:`resume_point`).

    Attributes:
        directory: the checkpoint dir. latest: the tag ``latest`` holds (None: no ``latest``, or an unusable one).
        broken: what stops a resume from ``latest``'s step (the ``latest`` file, or the incomplete step folder),
            None when nothing does. problem: why, one line naming the file. step: the step to resume from
            (``latest``'s, or the newest complete step before it), None when there is none.
    """

    directory: Path
    latest: str | None = None
    broken: Path | None = None
    problem: str | None = None
    step: StepInfo | None = None

    @property
    def fallback(self) -> bool:
        """``latest`` cannot be used, but an older complete step can."""
        return self.problem is not None and self.step is not None

    @property
    def _verdict(self) -> str:
        return "incomplete" if self.broken and self.broken.name != "latest" else "unusable"

    @property
    def warning(self) -> str:
        """The trainer's line when it falls back (:data:`FALLBACK_LINE` finds it in a log)."""
        return (f"WARNING: checkpoint {self.broken} is {self._verdict} ({self.problem}); resuming from "
                f"{self.step.path.name}, the newest complete step")

    @property
    def error(self) -> str | None:
        """Why no resume is possible (``latest`` is there, but no step to resume from), or None."""
        if self.problem is None or self.step is not None:
            return None
        latest = self.directory / "latest"
        what = f"{latest} names {self.latest}, which is incomplete" if self._verdict == "incomplete" else \
            f"{latest} is unusable"
        older = "no older step" if self.latest else "no step"
        return (f"{what} ({self.problem}), and {older} is complete: restore a step from a backup (opskit ckpt "
                "verify), or move latest away to start from scratch")


# The trainer's fallback line (ResumePoint.warning), anywhere in a log line (launchers prefix lines).
FALLBACK_LINE = re.compile(r"WARNING: checkpoint (?P<broken>.+?) is (?:incomplete|unusable) \((?P<problem>.*)\); "
                           r"resuming from (?P<tag>global_step[0-9]+), the newest complete step")


def resume_point(directory: str | Path) -> ResumePoint:
    """The step a resume from ``directory`` reads: ``latest``'s when it is complete; when ``latest`` names a missing or
    incomplete step, the newest complete step before it; when ``latest`` is unusable (binary, not a tag), the newest
    complete step. Nothing without ``latest`` (a fresh start). Reads headers only; never raises for damage."""
    directory = Path(directory)
    tag, problem = latest_state(directory)
    if tag is None and problem is None:
        return ResumePoint(directory)
    steps = step_dirs(directory)
    broken, below = directory / "latest", None  # an unusable latest: any step will do
    if tag is not None:
        below = int(STEP_DIR.match(tag).group(1))
        if below not in steps:
            problem = f"{broken}: names {tag}, which does not exist"
        else:
            info = describe_step(steps[below], latest=True)
            if info.complete:
                return ResumePoint(directory, tag, step=info)
            broken, problem = steps[below], info.problems[0]
    for iteration in sorted(steps, reverse=True):
        if below is None or iteration < below:
            info = describe_step(steps[iteration])
            if info.complete:
                return ResumePoint(directory, tag, broken, problem, info)
    return ResumePoint(directory, tag, broken, problem)


def list_steps(directory: str | Path) -> tuple[str | None, list[StepInfo]]:
    """(``latest`` tag or None -- None also when it is unusable: :func:`~opskit.ckpt.format.layout.latest_state` says
    why --, every ``global_stepN`` of a run's checkpoint dir, ascending).

    Raises:
        CheckpointFormatError: when ``directory`` has no ``global_stepN`` folders.
    """
    directory = Path(directory)
    steps = step_dirs(directory)
    if not steps:
        raise CheckpointFormatError(f"{directory}: no global_stepN folders (not a checkpoint dir)")
    latest, _problem = latest_state(directory)
    return latest, [describe_step(p, latest=p.name == latest) for p in steps.values()]


def inspect_step(path: str | Path) -> dict:
    """Architecture (from the saved ``args``) and, per file, every tensor's name, shape and dtype.

    Returns:
        ``{"step": N, "path": str, "architecture": {...}, "reshaped_from": str | None, "complete": bool,
        "problems": [...], "weights_only_backup": bool, "files": {name: {key: {"shape": [...], "dtype": "bf16"}}}}``;
        the optimizer files are listed by size only (their tensors are flat fp32 partitions); ``complete`` and
        ``problems`` as :func:`describe_step` says; ``weights_only_backup``: the step is a weights-only backup's copy
        whose only problems are the shards it left out (:func:`weights_only_copy`);
        ``reshaped_from``: the client state's ``global_stepN at TP=.. PP=.. DP=..`` of a run resumed on another
        layout (opskit.train.checkpointing).

    Raises:
        CheckpointFormatError: no readable ``mp_rank_00_model_states.pt``.
    """
    path = Path(path)
    state, problem = _client_state(path / "mp_rank_00_model_states.pt")
    if state is None:
        raise CheckpointFormatError(problem or f"{path / 'mp_rank_00_model_states.pt'}: no such file")
    args = vars(state["args"])
    arch_keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings", "position_embedding_type", "embed_layernorm",
                 "use_bnb_optimizer",  # gives the word embedding a LayerNorm too (rules.model.has_embedding_layernorm)
                 "padded_vocab_size", "original_vocab_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "params_dtype", "fp16", "bf16", "bias_gelu_fusion", "openai_gelu",
                 "glu_activation", "layernorm_epsilon", "tokenizer_name_or_path")
    files: dict[str, dict] = {}
    for f in sorted(path.iterdir()):
        if f.name.endswith(ZERO_FILE_SUFFIX) or not f.name.endswith(".pt") or not f.is_file():
            files[f.name] = {"size_bytes": f.stat().st_size}
            continue
        try:
            loaded = load_state(f, light=True)
        except CheckpointFormatError:  # named in problems
            files[f.name] = {}
            continue
        tensors = loaded.items() if LAYER_FILE.match(f.name) else \
            ((k, v) for k, v in loaded.items() if isinstance(v, TensorRef))
        files[f.name] = {k: {"shape": list(v.shape), "dtype": dtype_name(v)} for k, v in tensors
                         if isinstance(v, TensorRef)}
    info = describe_step(path)
    return {"step": state.get("iteration"), "path": str(path),
            "architecture": {k: args[k] for k in arch_keys if k in args},
            "consumed_samples": args.get("consumed_train_samples"), "consumed_tokens": state.get("tokens"),
            "reshaped_from": state.get("reshaped_from"), "complete": info.complete, "problems": info.problems,
            "weights_only_backup": weights_only_copy(info), "files": files}


def weights_only_copy(info: StepInfo) -> bool:
    """Whether an incomplete step folder is a weights-only backup's copy that lacks only what the backup left out:
    ``<root>/global_stepN`` whose ``<root>/manifests/global_stepN.json`` is opskit's, complete and ``weights_only``,
    its ``left_out`` names exactly the optimizer shards the step's layout needs and the folder lacks
    (``info.absent_optimizer``), every other file is there and readable (``info.weights_problems`` empty), and every
    file the manifest lists is there with its size (no read: ``ckpt check`` reads the CRC-32s). Such a folder serves
    ``ckpt convert``/``inspect``/``check`` (the weights); it is not complete and cannot resume. Never raises: an
    unreadable manifest is no such copy."""
    folder = info.path
    if not info.absent_optimizer or info.weights_problems:
        return False
    try:
        manifest = read_json(folder.parent / "manifests" / f"{folder.name}.json")
    except (OSError, ValueError):  # missing, not JSON, not text
        return False
    if not (is_manifest(manifest, folder.name) and manifest["complete"] and manifest.get("weights_only") is True):
        return False
    left_out = manifest.get("left_out")
    if not (isinstance(left_out, list) and all(isinstance(name, str) for name in left_out)
            and sorted(left_out) == sorted(f.name for f in info.absent_optimizer)):
        return False
    try:
        return all(e["path"] == f"{folder.name}/{Path(e['path']).name}"
                   and (folder / Path(e["path"]).name).stat().st_size == e["size"] for e in manifest["files"])
    except OSError:  # a listed file is not there
        return False
