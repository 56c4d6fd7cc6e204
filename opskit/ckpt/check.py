"""``opskit ckpt check``: is a checkpoint step safe to merge and resume from?

- TP consistency: every tensor that must be identical on all TP ranks (``layout.tp_rule == "replicated"``: LayerNorms,
  row-parallel biases, position embeddings, embedding LayerNorm, final LayerNorm) is compared with TP rank 0's copy;
  the max abs difference is reported per key and layer, and any difference is a mismatch (exact equality, as
  Megatron-DeepSpeed's ``test_layer_norm_consistent`` and ``compare_tp_weights.py`` require; reference section 4:
  the 176B run's BF16 optimizer let TP ranks' LayerNorms drift apart).
- RNG states (``torch_rng_state``, ``np_rng_state``, ``random_rng_state``, ``cuda_rng_state``) agree among the TP
  ranks of each pipeline stage (``mp_rank_{pp*TP+tp}`` files).
- NaN/Inf: every tensor of every layer file, one tensor in memory at a time.
- Completeness: :func:`opskit.ckpt.format.info.describe_step` (headers), then, with ``crc``, every byte of every file
  the step needs (optimizer shards included) against its zip record's CRC-32
  (:func:`opskit.ckpt.format.tensorfile.verify_crc`): the only check here that sees bytes flipped inside tensor data.
- A redundant copy: an ``mp_rank`` file holding optimizer state that the step's optimizer shards hold already (bf16 +
  ZeRO-0 steps saved before opskit's fix, :func:`opskit.ckpt.format.info.redundant_optimizer_bytes`) is reported with
  its bytes: a finding, not a problem (the resume reads the shards).
- A weights-only backup's copy of a step (:func:`opskit.ckpt.format.info.weights_only_copy`) is checked as a step of
  weights: the shards its backup left out are reported in ``left_out``, not as problems (what the copy serves,
  ``convert``/``inspect``, reads no optimizer state); every other check reads every file it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opskit.ckpt.format.info import describe_step, redundant_optimizer_bytes, weights_only_copy
from opskit.ckpt.format.layout import LAYER_FILE, CheckpointFormatError, layer_file_name, load_state, tp_rule
from opskit.ckpt.format.tensorfile import TensorFileError, TensorRef, verify_crc

RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state")


@dataclass
class CheckReport:
    """``tp_diffs``: ``{"layer": i, "key": k, "max_abs_diff": d, "ranks": [tp ranks that differ from 0]}`` for every
    replicated tensor (``d == 0`` when consistent); ``rng``: ``{"pp": s, "key": k, "agree": bool}``; ``nonfinite``:
    ``{"file": name, "key": k, "nan": n, "inf": n}``; ``problems``: missing/unreadable files; ``corrupt``: files whose
    bytes fail their CRC-32; ``crc_bytes``: bytes read for the CRC checks; ``left_out``: the optimizer shards a
    weights-only backup's copy lacks (file names; empty for any other step); ``redundant``: ``{"file": name, "bytes":
    n}`` for each ``mp_rank`` file with a redundant copy of the optimizer state (not a problem)."""

    step: Path
    tp_diffs: list[dict] = field(default_factory=list)
    rng: list[dict] = field(default_factory=list)
    nonfinite: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    crc_bytes: int = 0
    left_out: list[str] = field(default_factory=list)
    redundant: list[dict] = field(default_factory=list)

    @property
    def redundant_bytes(self) -> int:
        return sum(r["bytes"] for r in self.redundant)

    @property
    def tp_mismatches(self) -> list[dict]:
        return [d for d in self.tp_diffs if d["max_abs_diff"] > 0]

    @property
    def ok(self) -> bool:
        return not (self.tp_mismatches or self.nonfinite or self.problems or self.corrupt
                    or any(not r["agree"] for r in self.rng))

    def as_json(self) -> dict:
        return {"step": str(self.step), "ok": self.ok, "tp_mismatches": self.tp_mismatches,
                "tp_checked": len(self.tp_diffs), "rng": self.rng, "nonfinite": self.nonfinite,
                "problems": self.problems, "corrupt": self.corrupt, "crc_bytes": self.crc_bytes,
                "weights_only_backup": bool(self.left_out), "left_out": self.left_out, "redundant": self.redundant,
                "redundant_bytes": self.redundant_bytes}


def replicated_diff(shards: list) -> tuple[float, list[int]]:
    """(max abs difference to rank 0 over all ranks, the ranks that differ) for one replicated tensor's TP copies."""
    first = shards[0].float()
    diffs = [(s.float() - first).abs().max().item() if s.numel() else 0.0 for s in shards[1:]]
    return max(diffs, default=0.0), [rank for rank, d in enumerate(diffs, start=1) if d > 0]


def _rng_equal(a, b) -> bool:
    import numpy as np  # numpy, torch: only once RNG states are compared
    import torch

    if isinstance(a, TensorRef) or isinstance(b, TensorRef):
        a, b = (x.read() if isinstance(x, TensorRef) else x for x in (a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        same_length = isinstance(b, (tuple, list)) and len(a) == len(b)
        return same_length and all(_rng_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def check_step(path: str | Path, progress=None, crc: bool = True) -> CheckReport:
    """Run every check on one ``global_stepN`` folder; ``progress(done, total)`` is called per layer, then per file
    CRC-checked (``crc``: read every file the step needs to its end, of a weights-only backup's copy every file it
    has).

    Raises:
        CheckpointFormatError: only when ``mp_rank_00`` is unusable (everything else lands in the report).
    """
    import torch  # torch (train extra): only when a step is checked, not when backup or convert import this

    info = describe_step(path)
    report = CheckReport(Path(path), problems=list(info.problems))
    if weights_only_copy(info):
        report.problems, report.left_out = info.weights_problems, [f.name for f in info.absent_optimizer]
    if info.tp is None:
        return report
    layers = sorted({int(m.group(1)) for f in Path(path).iterdir() if (m := LAYER_FILE.match(f.name))})
    for done, index in enumerate(layers, start=1):
        files = [Path(path) / layer_file_name(index, t) for t in range(info.tp)]
        if not all(f.is_file() for f in files):
            continue
        try:
            shards = [load_state(f) for f in files]
        except CheckpointFormatError:  # already listed in problems by describe_step
            continue
        for key in shards[0]:
            absent = [files[rank] for rank, shard in enumerate(shards) if key not in shard]
            if absent:
                report.problems.append(f"{absent[0]}: no {key} (TP rank 0 has it)")
                continue
            for rank, shard in enumerate(shards):
                tensor = shard[key].read()
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    report.nonfinite.append({"file": files[rank].name, "key": key,
                                             "nan": int(torch.isnan(tensor).sum()),
                                             "inf": int(torch.isinf(tensor).sum())})
            if tp_rule(key) == "replicated" and info.tp > 1:
                diff, ranks = replicated_diff([s[key].read() for s in shards])
                report.tp_diffs.append({"layer": index, "key": key, "max_abs_diff": diff, "ranks": ranks})
        if progress:
            progress(done, len(layers))
    for pp in range(info.pp):
        states = []
        for t in range(info.tp):
            mp_file = Path(path) / f"mp_rank_{pp * info.tp + t:02d}_model_states.pt"
            try:
                states.append(load_state(mp_file))
            except CheckpointFormatError:  # missing or unreadable: already in problems
                continue
            if nbytes := redundant_optimizer_bytes(states[-1], info):
                report.redundant.append({"file": mp_file.name, "bytes": nbytes})
        for key in RNG_KEYS:
            if states and key in states[0]:
                report.rng.append({"pp": pp, "key": key,
                                   "agree": all(_rng_equal(states[0][key], s.get(key)) for s in states[1:])})
    if crc:
        _check_crcs(report, info.files, progress)
    return report


def crc_problem(path: Path) -> tuple[str | None, int]:
    """The CRC-32 rule of ``ckpt check`` (and of ``ckpt backup``, which must not call a corrupt step verified) for one
    file of a step: read every record to its end against the zip directory's CRC-32.

    Returns:
        (None, bytes read) when intact, else (one line naming the file and the failing record or the read error, 0).
    """
    try:
        return None, verify_crc(path)
    except (TensorFileError, OSError) as e:
        return (str(e) if isinstance(e, TensorFileError) else f"{path}: unreadable ({e})"), 0


def _check_crcs(report: CheckReport, files: list[Path], progress) -> None:
    readable = [f for f in files if f.is_file() and not any(p.startswith(f"{f}: ") for p in report.problems)]
    for done, f in enumerate(readable, start=1):
        problem, nbytes = crc_problem(f)
        report.crc_bytes += nbytes
        if problem:
            report.corrupt.append(problem)
        if progress:
            progress(done, len(readable))
