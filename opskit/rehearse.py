"""``opskit rehearse NAME``: the spec the user will submit, scaled down, through the real (local) SLURM, before a GPU
hour is spent.

The rehearsal spec is the production spec with overrides, validated by the same :func:`opskit.spec.load.validate_spec`,
so every spec rule holds for it too. Each scaling rule is one function returning its overrides and what it said
(``model.num_layers 70 -> 4``); everything it does not name stays as the spec has it (flags under ``megatron_args``,
ZeRO stage, optimizer, clipping, weight decay, dropout, curriculum, skip ranges, evaluation). Then two chained array
tasks run: the first stops on the spec's own exit duration, made deterministic by the trainer's simulated clock
(``OPSKIT_REHEARSAL_MINUTES_PER_ITERATION``, :mod:`opskit.train.exit`), with a checkpoint; the second resumes and
finishes. Then an uninterrupted twin of both tasks (the same spec in a run directory of its own, one task on a clock
that never reaches the exit duration) trains after them, and the resumed losses are compared with its losses as
printed. The checkpoint, conversion, watchdog and log stages use the library calls behind ``opskit ckpt check``,
``ckpt convert``, ``status`` and ``logs show``.

Output: ``<root>/<spec cli name, ':' -> '-'>/`` (``root``: ``rehearsals/`` under the spec's base directory), marked
as ``rehearse``'s (``.opskit``); the run directory is its ``run/``, the twin's its ``twin/``, the prepared demo data
is shared by every rehearsal under ``<root>/.data/``. The production run directory is never touched.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from opskit.ckpt.check import check_step
from opskit.ckpt.convert import ConvertError, convert_step, model_arch
from opskit.ckpt.format.layout import load_args, resolve_step_dir, scan_step_dir
from opskit.data.corpus import prepare_data
from opskit.errors import OpskitError
from opskit.fsutil import (
    OutputRefusedError,
    atomic_write_text,
    brief,
    folder_entries,
    has_marker,
    read_marker,
    unlisted_entries,
    write_marker,
)
from opskit.logs.crash import JOB_HEADER, line_source
from opskit.logs.parse import parse_text, read_tail, timeline
from opskit.monitor.watchdog import run_checks
from opskit.rules import consistency
from opskit.rules.formats import parse_skip_ranges
from opskit.rules.model_size import padded_vocab_size
from opskit.rules.schedule import BatchRampup, SeqlenSchedule, iterations_to_tokens, tokens_per_iteration
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.slurm.pending import HopelessWatch
from opskit.spec.files import SpecError
from opskit.spec.load import deep_merge, validate_spec
from opskit.spec.placeholders import unset_variables
from opskit.spec.plan import make_plan
from opskit.spec.schema import Spec
from opskit.submission.render import data_files
from opskit.submission.submit import submit
from opskit.train import REHEARSAL_CLOCK_ENV

COMMAND = "rehearse"
DEFAULT_RANKS_PER_NODE = 4
DEFAULT_ITERATIONS = 40
HIDDEN_PER_HEAD = 16
HEADS_PER_TP_RANK = 4
"""Heads at TP=1 (hidden 64); at TP=T, T * max(1, 4 // T) heads, so the heads divide over TP."""
SEQ_LENGTH = 64
MAX_MICRO_BATCH = 2
MICRO_BATCHES = 2
"""Micro-batches per global batch at the full size (>= 2: gradient accumulation is exercised)."""
RAMPUP_MICRO_BATCHES = 4
"""... with a batch ramp-up: 1 -> 4 micro-batches, so the ramp-up has several stages."""
DEMO_VOCAB = 1024
"""The demo tokenizer's size for a spec whose tokenizer cannot be had offline (a Hub name, GPT-2's files)."""
CLUSTER_ONLY = ("partition", "account", "qos", "reservation", "constraint", "gres", "hint")
WAIT_S = 900
"""Real seconds both tasks may take together (and the twin alone) before the rehearsal cancels them."""
RUN, TWIN = "run", "twin"
"""The run directories of the chain and of its uninterrupted twin, in the rehearsal folder."""

Status = Literal["ok", "failed", "skipped"]


class RehearsalError(OpskitError, RuntimeError):
    """A rehearsal that cannot start (its folder is not opskit's, bad arguments); one line."""


@dataclass
class Stage:
    name: str
    status: Status
    reason: str


@dataclass
class Rehearsal:
    """What :func:`rehearse` did: the stages in order, what the scaled-down spec changed, the planner's numbers for the
    full-size spec, where it ran."""

    spec: str
    folder: Path
    stages: list[Stage] = field(default_factory=list)
    substitutions: list[str] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    twin_job_id: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No stage failed (skipped ones are allowed)."""
        return all(s.status != "failed" for s in self.stages)

    def as_json(self) -> dict:
        return {**asdict(self), "folder": str(self.folder), "ok": self.ok}


@dataclass(frozen=True)
class Shape:
    """The rehearsal's layout and size, decided once and read by every scaling rule."""

    nodes: int
    ranks_per_node: int
    tp: int
    pp: int
    iterations: int
    seq_length: int
    vocab_size: int

    @property
    def dp(self) -> int:
        return self.nodes * self.ranks_per_node // (self.tp * self.pp)


# --------------------------------------------------------------------------- scaling rules


def _said(said: list[str], field_name: str, old: Any, new: Any, why: str = "") -> None:
    if old != new:
        said.append(f"{field_name} {_shown(old)} -> {_shown(new)}{f' ({why})' if why else ''}")


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000 else str(value)


def fit_layout(tp: int, pp: int, ranks: int) -> tuple[int, int]:
    """TP and PP for ``ranks`` processes: the spec's when TP * PP fits, else the larger of the two is reduced first
    (PP by one, TP halved, so TP stays a divisor of the spec's) until they fit: BLOOM's TP=4 PP=12 on 4 ranks becomes
    TP=2 PP=2, which still exercises both tensor and pipeline parallelism."""
    while tp * pp > ranks:
        if pp >= tp and pp > 1:
            pp -= 1
        else:
            tp //= 2
    return max(tp, 1), max(pp, 1)


def scale_layout(spec: Spec, shape: Shape) -> tuple[dict, list[str]]:
    """``parallel``: the local cluster's nodes and ranks, TP and PP as :func:`fit_layout` decided."""
    p, said = spec.parallel, []
    _said(said, "parallel.nodes x gpus_per_node", f"{p.nodes} x {p.gpus_per_node}",
          f"{shape.nodes} x {shape.ranks_per_node}", "CPU ranks of the local cluster")
    why = f"TP*PP {p.model_parallel_size} > {shape.nodes * shape.ranks_per_node} ranks; the larger one reduced first"
    _said(said, "parallel.tensor_model_parallel_size", p.tensor_model_parallel_size, shape.tp, why)
    _said(said, "parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size, shape.pp, why)
    _said(said, "data parallel size", p.data_parallel_size, shape.dp)
    return {"parallel": {"nodes": shape.nodes, "gpus_per_node": shape.ranks_per_node,
                         "tensor_model_parallel_size": shape.tp, "pipeline_model_parallel_size": shape.pp}}, said


def _rehearsal_layers(spec: Spec, pp: int) -> int:
    """Two layers per pipeline stage, or the fewest above that the spec's ``pp_partition_method`` accepts."""
    layers = 2 * pp
    while consistency.pipeline_problems(layers, pp, spec.parallel.pp_partition_method, lambda key, value=None: key):
        layers += 1
    return min(layers, max(spec.model.num_layers, 2 * pp))


def scale_model(spec: Spec, shape: Shape) -> tuple[dict, list[str]]:
    """``model``: layers per stage, heads divisible by TP, hidden = heads * 16, the FFN/hidden ratio, the sequence
    length; position embedding, embedding LayerNorm, init, dropout and recompute stay. ``pad_vocab_size_to`` (a
    multiple of the production vocabulary) goes: the rehearsal vocabulary is padded by Megatron's rule instead."""
    m, said = spec.model, []
    heads = shape.tp * max(1, HEADS_PER_TP_RANK // shape.tp)
    hidden = heads * HIDDEN_PER_HEAD
    out: dict[str, Any] = {"num_layers": _rehearsal_layers(spec, shape.pp), "hidden_size": hidden,
                           "num_attention_heads": heads, "seq_length": shape.seq_length,
                           "max_position_embeddings": shape.seq_length}
    if m.ffn_hidden_size is not None:
        ratio = m.ffn_hidden_size / m.hidden_size
        out["ffn_hidden_size"] = max(shape.tp, round(ratio * hidden / shape.tp) * shape.tp)
        _said(said, "model.ffn_hidden_size", m.ffn_hidden_size, out["ffn_hidden_size"], f"ffn/hidden {ratio:g} kept")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings"):
        _said(said, f"model.{key}", getattr(m, key), out[key])
    if m.pad_vocab_size_to is not None:
        out["pad_vocab_size_to"] = None
        padded = padded_vocab_size(shape.vocab_size, m.make_vocab_size_divisible_by, shape.tp)
        said.append(f"model.pad_vocab_size_to {m.pad_vocab_size_to:,} -> unset (the rehearsal vocabulary "
                    f"{shape.vocab_size} padded by the same rule, {m.make_vocab_size_divisible_by} x TP {shape.tp}: "
                    f"{padded})")
    return {"model": out}, said


def scale_precision(spec: Spec) -> tuple[dict, list[str]]:
    """fp16 -> bf16: DeepSpeed's CPU accelerator has no fp16 (bf16 and fp32 run on CPU as the spec has them)."""
    if spec.model.precision != "fp16":
        return {}, []
    return {"model": {"precision": "bf16"}}, [
        "model.precision fp16 -> bf16 (DeepSpeed's CPU accelerator has no fp16; bf16 keeps a 16-bit mixed-precision "
        f"path with ZeRO stage {spec.parallel.zero_stage})"]


@dataclass(frozen=True)
class _Schedules:
    """The production and rehearsal ramp-ups and lengths, so every count maps by its place in the run."""

    full: BatchRampup
    full_iters: int
    new: BatchRampup
    iterations: int

    def iteration(self, full_iteration: int) -> int:
        """The rehearsal iteration at the same fraction of the run as ``full_iteration`` (>= 1 when that is)."""
        new = round(full_iteration / self.full_iters * self.iterations)
        return max(new, 1 if full_iteration > 0 else 0)

    def samples(self, full_samples: int) -> int:
        """A sample count of the production run (LR warmup, decay) at the same place in the rehearsal."""
        return self.new.consumed_samples(self.iteration(self.full.iterations_to_samples(full_samples)))


def _tokens_after(rampup: BatchRampup, seq_length: int, iterations: int, curriculum: SeqlenSchedule | None) -> int:
    """Tokens consumed by ``iterations`` iterations (ramp-up and curriculum replayed)."""
    consumed = done = 0
    for _, tokens in tokens_per_iteration(rampup, seq_length, curriculum):
        if done == iterations:
            return consumed
        consumed, done = consumed + tokens, done + 1
    return consumed + (iterations - done) * rampup.global_batch_size * seq_length


def _rampup(spec: Spec, shape: Shape, gbs: int, unit: int) -> tuple[int, int, int] | None:
    """The ramp-up of a rehearsal global batch ``gbs``: start and increment scaled by gbs / GBS, in multiples of
    ``unit`` (MBS * DP), and ramp-up samples such that it spans the same share of the run (at least one iteration per
    stage)."""
    b = spec.batch
    if b.rampup_batch_size is None:
        return None
    start, incr, samples = b.rampup_batch_size
    ratio = gbs / b.global_batch_size
    start_new = min(max(unit, round(start * ratio / unit) * unit), gbs - unit)
    incr_new = max(unit, round(incr * ratio / unit) * unit)
    if (gbs - start_new) % incr_new:
        incr_new = unit
    full = BatchRampup(b.global_batch_size, b.rampup_batch_size)
    share = full.rampup_end()[0] / full.train_iters(b.samples)
    stages = (gbs - start_new) // incr_new + 1
    target = max(stages, round(share * shape.iterations))
    samples_new = start_new
    while BatchRampup(gbs, (start_new, incr_new, samples_new)).rampup_end()[0] < target:
        samples_new += unit
    return start_new, incr_new, samples_new


def scale_schedule(spec: Spec, shape: Shape) -> tuple[dict, list[str]]:
    """``batch``, ``optimizer``, ``curriculum_learning``, ``checkpoint`` and the skip ranges: the same ramp-up, LR
    schedule, curriculum, evaluation and checkpointing, compressed into ``shape.iterations`` iterations (every count
    moved to the same place in the run, by :class:`opskit.rules.schedule.BatchRampup`'s walk)."""
    b, o, c, said = spec.batch, spec.optimizer, spec.checkpoint, []
    mbs = min(b.micro_batch_size, MAX_MICRO_BATCH)
    unit = mbs * shape.dp
    gbs = unit * (RAMPUP_MICRO_BATCHES if b.rampup_batch_size else MICRO_BATCHES)
    rampup = _rampup(spec, shape, gbs, unit)
    full = BatchRampup(b.global_batch_size, b.rampup_batch_size)
    full_iters = b.train_iters or full.train_iters(b.samples)
    sched = _Schedules(full, full_iters, BatchRampup(gbs, rampup), shape.iterations)
    batch: dict[str, Any] = {"micro_batch_size": mbs, "global_batch_size": gbs, "rampup_batch_size": rampup}
    if b.train_iters is not None:
        batch["train_iters"] = shape.iterations
    else:
        batch["train_samples"] = sched.new.consumed_samples(shape.iterations)
    out: dict[str, Any] = {"batch": batch}
    for key in ("micro_batch_size", "global_batch_size", "rampup_batch_size", "train_samples", "train_iters"):
        if key in batch:
            _said(said, f"batch.{key}", getattr(b, key), batch[key])
    said.append(f"train iterations {full_iters:,} -> {shape.iterations}")

    optimizer: dict[str, Any] = {}
    if o.lr_warmup_samples:
        optimizer["lr_warmup_samples"] = sched.samples(o.lr_warmup_samples)
    if o.lr_decay_samples is not None:
        optimizer["lr_decay_samples"] = sched.samples(o.lr_decay_samples)
    curriculum, full_cl, new_cl = _scaled_curriculum(spec, shape, sched, said)
    if curriculum:
        out["curriculum_learning"] = curriculum
    for key, section, values in (("lr_decay_tokens", "optimizer", optimizer), ("train_tokens", "batch", batch)):
        tokens = getattr(o if section == "optimizer" else b, key)
        if tokens is not None:
            iteration = sched.iteration(iterations_to_tokens(full, spec.model.seq_length, tokens, full_cl))
            values[key] = _tokens_after(sched.new, shape.seq_length, iteration, new_cl)
            _said(said, f"{section}.{key}", tokens, values[key])
    for key in ("lr_warmup_samples", "lr_decay_samples"):
        if key in optimizer:
            _said(said, f"optimizer.{key}", getattr(o, key), optimizer[key])
    if optimizer:
        out["optimizer"] = optimizer

    checkpoint: dict[str, Any] = {"save_interval": max(1, shape.iterations // 4), "log_interval": 1}
    if c.eval_interval is not None:
        checkpoint["eval_interval"] = max(1, shape.iterations // 3)
        if c.eval_iters:
            checkpoint["eval_iters"] = min(c.eval_iters, 2)
    for key, value in checkpoint.items():
        _said(said, f"checkpoint.{key}", getattr(c, key), value)
    out["checkpoint"] = checkpoint
    if ranges := spec.megatron_args.get("skip_train_iteration_range"):
        out["megatron_args"] = {"skip_train_iteration_range": _scaled_skip_ranges(list(ranges), sched)}
        _said(said, "megatron_args.skip_train_iteration_range", list(ranges),
              out["megatron_args"]["skip_train_iteration_range"], "same places in the run")
    return out, said


def _scaled_curriculum(spec: Spec, shape: Shape, sched: _Schedules, said: list[str]
                       ) -> tuple[dict, SeqlenSchedule | None, SeqlenSchedule | None]:
    """The seqlen curriculum over the same share of the run, its difficulties scaled to the new sequence length
    (multiples of the difficulty step, at least one step). Returns the overrides and both schedules."""
    cl = spec.curriculum_learning
    if cl is None:
        return {}, None, None
    step, seq = cl.difficulty_step, spec.model.seq_length

    def scaled(difficulty: int) -> int:
        return max(step, round(difficulty / seq * shape.seq_length / step) * step)

    max_new = None if cl.max_difficulty is None else min(scaled(cl.max_difficulty), shape.seq_length)
    min_new = min(scaled(cl.min_difficulty), (max_new or shape.seq_length) - step)
    total_new = sched.iteration(cl.total_curriculum_step)
    out = {"min_difficulty": min_new, "max_difficulty": max_new, "total_curriculum_step": total_new}
    for key, value in out.items():
        _said(said, f"curriculum_learning.{key}", getattr(cl, key), value)
    full_cl = SeqlenSchedule(cl.min_difficulty, spec.curriculum_max_difficulty, cl.total_curriculum_step, step,
                             cl.root_degree)
    new_cl = SeqlenSchedule(min_new, max_new or shape.seq_length, total_new, step, cl.root_degree)
    return out, full_cl, new_cl


def _scaled_skip_ranges(ranges: list[str], sched: _Schedules) -> list[str]:
    """Each ``START-END`` at the same place in the rehearsal, at least one iteration, apart from the one before."""
    out, last = [], 0
    for start, end in parse_skip_ranges(ranges):
        first = max(sched.iteration(start), last + 2)
        last = max(first, sched.iteration(end))
        out.append(f"{first}-{last}")
    return out


def minutes_per_iteration(exit_duration_mins: float, iterations: int, twin: bool = False) -> float:
    """The simulated clock's step such that task 1 passes the exit duration after ``iterations // 2 + 1``
    iterations (the trainer stops when the minutes *exceed* the duration) and task 2, with fewer left, finishes;
    ``twin``: such that all ``iterations`` stay under it (the uninterrupted twin trains them in one task)."""
    stops_after = iterations + 1 if twin else iterations // 2 + 1
    return exit_duration_mins / (stops_after - 0.5)


def scale_backend(spec: Spec) -> tuple[dict, list[str]]:
    """``distributed_backend: nccl`` -> gloo: NCCL needs GPUs (the trainer's default is gloo on CPU)."""
    if spec.megatron_args.get("distributed_backend") != "nccl":
        return {}, []
    return {"megatron_args": {"distributed_backend": "gloo"}}, [
        "megatron_args.distributed_backend nccl -> gloo (NCCL needs GPUs)"]


def scale_slurm(spec: Spec, shape: Shape, folder: Path, environ: dict[str, str], twin: bool = False
                ) -> tuple[dict, list[str]]:
    """``slurm``: cluster-only sbatch options dropped, the local node's CPUs, a job name of its own, two tasks, the
    simulated clock in ``env`` (the spec's time limit and exit margin stay: the exit duration is the production one),
    environment values that name unset variables dropped. ``twin``: one task, ``-twin`` after the job name, a clock
    that stays under the exit duration (:func:`minutes_per_iteration`)."""
    s, said = spec.slurm, []
    out: dict[str, Any] = {key: None for key in CLUSTER_ONLY if getattr(s, key) is not None}
    if out:
        said.append(f"slurm: {', '.join(f'{k} {getattr(s, k)}' for k in out)} dropped (cluster-only)")
    out["cpus_per_task"] = os.cpu_count() or 1
    _said(said, "slurm.cpus_per_task", s.cpus_per_task, out["cpus_per_task"], "the local node's CPUs")
    out["job_name"] = f"rehearse-{spec.job_name}" + ("-twin" if twin else "")
    out["array"] = 1 if twin else 2
    # one port per rehearsal folder: two rehearsals (or a test) on this host never share torchrun's rendezvous
    out["master_port"] = 20000 + int(hashlib.sha256(str(folder).encode()).hexdigest(), 16) % 9000
    env: dict[str, str | None] = {}  # merged over the spec's env: None drops a variable
    for key, value in s.env.items():
        if unset := unset_variables(value, environ):
            env[key] = None
            said.append(f"slurm.env.{key} dropped (${unset[0]} is not set here)")
    clock = minutes_per_iteration(spec.exit_duration_in_mins, shape.iterations, twin)
    env.update({"OMP_NUM_THREADS": "1", REHEARSAL_CLOCK_ENV: f"{clock:.6g}"})
    stops = (f"all {shape.iterations} iterations stay under it" if twin
             else f"task 1 stops after {shape.iterations // 2 + 1} iterations")
    said.append(f"exit duration {spec.exit_duration_in_mins:g} min ({s.time} - {s.exit_margin_mins:g} min) kept; "
                f"simulated clock: 1 iteration = {clock:.6g} min, so {stops}")
    out["env"] = env
    return {"slurm": out}, said


def scale_paths(spec: Spec, run: RunPaths, environ: dict[str, str]) -> tuple[dict, list[str]]:
    """``paths.output`` -> the rehearsal's run directory; ``megatron_args`` paths naming unset variables -> a folder of
    the rehearsal run (others naming unset variables dropped); no sync targets."""
    said = [f"paths.output {spec.paths.output} -> {run.root}"]
    out: dict[str, Any] = {"paths": {"output": str(run.root)}}
    args = {}
    for key, value in spec.megatron_args.items():
        if not (unset := unset_variables(value, environ)):
            continue
        if key.endswith(("_dir", "_path")):
            args[key] = str(run.root / key.removesuffix("_dir").removesuffix("_path"))
            said.append(f"megatron_args.{key} {value} -> {args[key]} (${unset[0]} is not set here)")
        else:
            args[key] = None
            said.append(f"megatron_args.{key} dropped (${unset[0]} is not set here)")
    if args:
        out["megatron_args"] = args
    if spec.sync.targets:
        out["sync"] = {"targets": []}
        said.append("sync.targets dropped (a rehearsal publishes nothing)")
    return out, said


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataPlan:
    """Where the rehearsal's data comes from: the spec's own (``overrides`` empty) or the demo corpus prepared into
    ``folder`` at ``vocab_size``, with the files the spec's tokenizer and data settings need in ``files``."""

    overrides: dict
    said: list[str]
    vocab_size: int
    folder: Path | None = None
    files: Path | None = None
    tokenizer_type: str | None = None
    weighted: bool = False


def plan_data(spec: Spec, data_root: Path) -> DataPlan:
    """The spec's own data when every file it reads exists here (:func:`opskit.submission.render.data_files`), else the
    KJV demo corpus prepared with the spec's tokenizer settings as far as offline allows: a corpus spec's own BPE at
    its vocabulary size; for a Hub tokenizer or GPT-2's vocabulary files (not reachable offline), a byte-level BPE of
    :data:`DEMO_VOCAB` tokens trained on the corpus, written as what the spec reads (a tokenizer folder, GPT-2 vocab
    and merge files, weighted split files)."""
    try:
        present = all(path.is_file() for _, path in data_files(spec))
    except SpecError:
        present = False
    d = spec.data
    if present:
        return DataPlan({}, ["data: the spec's own (every file present)"], d.vocab_size)
    vocab = d.vocab_size if d.prepared_by_opskit else DEMO_VOCAB
    folder = data_root / f"kjv-bpe{vocab}"
    files = data_root / f"kjv-bpe{vocab}-files"
    prefix = str(folder / "kjv_text_document")
    data: dict[str, Any]
    if d.prepared_by_opskit:
        data = {"corpus": "kjv", "dir": str(folder), "name": "kjv"}
        said = [f"data: {d.corpus} in {d.dir} not prepared -> the KJV demo corpus, opskit's BPE at the spec's "
                f"{vocab} tokens, in {folder}"]
        return DataPlan({"data": data}, said, vocab, folder, files)
    data = {"vocab_size": vocab, "data_path": None, "train_weighted_split_paths_path": None,
            "valid_weighted_split_paths_path": None, "tokenizer_name_or_path": None, "vocab_file": None,
            "merge_file": None}
    weighted = d.train_weighted_split_paths_path is not None
    if weighted:
        data["train_weighted_split_paths_path"] = str(files / "train-splits.txt")
        data["valid_weighted_split_paths_path"] = str(files / "valid-splits.txt")
        source = f"weighted split files -> KJV split 95/5 ({files})"
    else:
        data["data_path"] = prefix
        source = f"data_path -> {prefix}"
    if d.tokenizer_type == "GPT2BPETokenizer":
        data["vocab_file"], data["merge_file"] = str(files / "gpt2-vocab.json"), str(files / "gpt2-merges.txt")
        tokenizer = "GPT-2 vocab/merge files -> a byte-level BPE trained on KJV, written as GPT-2 files"
    else:
        data["tokenizer_name_or_path"] = str(folder / "tokenizer")
        tokenizer = f"tokenizer {d.tokenizer_name_or_path} -> a byte-level BPE trained on KJV"
    said = [f"data: the spec's files are not here: the KJV demo corpus; {source}; {tokenizer} (not reachable "
            f"offline); vocab_size {d.vocab_size:,} -> {vocab}"]
    return DataPlan({"data": data}, said, vocab, folder, files, d.tokenizer_type, weighted)


def prepare(plan: DataPlan) -> str:
    """Prepare the demo data a :class:`DataPlan` names (once: later rehearsals reuse it); returns the stage's reason.

    Raises:
        OpskitError: the preparation failed (``DataError``), or the tokenizer came out smaller than planned.
    """
    if plan.folder is None:
        return "the spec's own data"
    done = prepare_data("kjv", plan.folder, vocab_size=plan.vocab_size, name="kjv")
    if done.vocab_size != plan.vocab_size:
        raise RehearsalError(f"{plan.folder}: the KJV tokenizer has {done.vocab_size} tokens, not "
                             f"{plan.vocab_size}")
    plan.files.mkdir(parents=True, exist_ok=True)
    if plan.tokenizer_type == "GPT2BPETokenizer":
        _write_gpt2_files(done.tokenizer_dir / "tokenizer.json", plan.files)
    if plan.weighted:
        prefix = done.data_prefix
        atomic_write_text(plan.files / "train-splits.txt", f'"train: 1 0:0.95 {prefix}"\n')
        atomic_write_text(plan.files / "valid-splits.txt", f'"valid: 1 0.95:1 {prefix}"\n')
    how = "reused" if done.reused else "prepared"
    return f"KJV {how}: {done.num_tokens:,} tokens, vocabulary {done.vocab_size} ({plan.folder.name})"


def _write_gpt2_files(tokenizer_json: Path, folder: Path) -> None:
    """GPT-2's ``vocab.json`` / ``merges.txt`` of a byte-level BPE (what ``--vocab-file`` / ``--merge-file`` read)."""
    model = json.loads(tokenizer_json.read_text())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    atomic_write_text(folder / "gpt2-vocab.json", json.dumps(model["vocab"], ensure_ascii=False))
    atomic_write_text(folder / "gpt2-merges.txt", "#version: 0.2\n" + "\n".join(merges) + "\n")


# --------------------------------------------------------------------------- the rehearsal spec


def rehearsal_spec(spec: Spec, folder: Path, data: DataPlan, nodes: int = 1,
                   ranks_per_node: int = DEFAULT_RANKS_PER_NODE, iterations: int = DEFAULT_ITERATIONS,
                   environ: dict[str, str] | None = None, twin: bool = False) -> tuple[Spec, list[str]]:
    """The scaled-down spec (every rule applied as overrides, validated like any spec) and what changed.

    ``twin``: the chain's uninterrupted twin, by the same rules: it differs only in its run directory
    (``<folder>/twin`` instead of ``<folder>/run``, and the ``megatron_args`` paths moved there), its job name and
    task count, and its simulated clock (:func:`scale_slurm`).

    Raises:
        SpecError: the scaled-down spec breaks a spec rule (one line naming the field).
        RehearsalError: ``iterations`` or the ranks out of range.
    """
    if iterations < 8:
        raise RehearsalError(f"--iterations {iterations}: use at least 8 (two tasks, two saves, two evaluations)")
    if nodes < 1 or ranks_per_node < 1:
        raise RehearsalError("--nodes and the ranks per node must be at least 1")
    environ = dict(os.environ if environ is None else environ)
    # never more nodes or ranks per node than the spec has: a rehearsal adds no data parallelism of its own
    nodes, ranks_per_node = min(nodes, spec.parallel.nodes), min(ranks_per_node, spec.parallel.gpus_per_node)
    tp, pp = fit_layout(spec.parallel.tensor_model_parallel_size, spec.parallel.pipeline_model_parallel_size,
                        nodes * ranks_per_node)
    shape = Shape(nodes, ranks_per_node, tp, pp, iterations, min(spec.model.seq_length, SEQ_LENGTH), data.vocab_size)
    run = RunPaths(folder / (TWIN if twin else RUN))
    overrides: dict = {}
    said: list[str] = []
    rules: list[Callable[[], tuple[dict, list[str]]]] = [
        lambda: scale_layout(spec, shape), lambda: scale_model(spec, shape), lambda: scale_precision(spec),
        lambda: scale_backend(spec),
        lambda: scale_schedule(spec, shape), lambda: scale_slurm(spec, shape, folder, environ, twin),
        lambda: scale_paths(spec, run, environ), lambda: (data.overrides, data.said)]
    for rule in rules:
        more, words = rule()
        overrides = deep_merge(overrides, more) if more else overrides
        said += words
    raw = _with_nones(spec.model_dump(mode="json", exclude_none=True), overrides)
    return validate_spec(raw, spec.file or Path(spec.name), spec.variant), said


def _with_nones(raw: dict, overrides: dict) -> dict:
    """``overrides`` over ``raw`` (None deletes a key, as in a variant)."""
    return deep_merge(raw, overrides)


# --------------------------------------------------------------------------- the folder


def rehearsal_folder(spec: Spec, root: Path | None = None) -> Path:
    """``<root>/<spec name, ':' -> '-'>`` (``tr8b-104B-cl``; the name, not a path: a spec given by path has its
    file's name); ``root`` default: ``rehearsals/`` under the spec's base directory."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", spec.name).strip(".") or "spec"
    return Path(root if root is not None else spec.base_dir / "rehearsals").absolute() / name


def claim_folder(spec: Spec, folder: Path, force: bool) -> None:
    """Make ``folder`` the rehearsal's: a missing or empty one, or with ``force`` one an earlier rehearsal wrote
    (replaced) that holds only what its marker lists (:func:`seal_folder`). Never the production run directory, nor
    inside it.

    Raises:
        OutputRefusedError: a folder opskit's rehearse did not write, one without ``force``, one holding files the
            rehearsal did not write (named), or one inside the production run directory.
    """
    try:
        production = RunPaths.of(spec).root.resolve()
    except SpecError:
        production = None
    if production is not None and (folder.resolve() == production or production in folder.resolve().parents):
        raise OutputRefusedError(f"{folder}: inside the production run directory {production}; choose another --out")
    if folder.is_dir() and any(folder.iterdir()):
        if not has_marker(folder, COMMAND):
            what = (read_marker(folder) or {}).get("command")
            who = f"`opskit {what}`" if what else "someone else"
            raise OutputRefusedError(f"{folder}: exists and was written by {who}, not `opskit rehearse`; choose "
                                     "another --out")
        if not force:
            raise OutputRefusedError(f"{folder}: an earlier rehearsal; --force replaces it")
        marker = read_marker(folder)
        if "entries" not in marker:
            raise OutputRefusedError(f"{folder}: a rehearsal that was killed before it listed its files; opskit "
                                     "cannot tell them from yours: remove the folder yourself or choose another --out")
        if extra := unlisted_entries(folder, marker):
            raise OutputRefusedError(f"{folder}: holds entries the rehearsal did not write ({brief(extra)}); "
                                     "--force would delete them: move them away or choose another --out")
        shutil.rmtree(folder)
    elif folder.exists() and not folder.is_dir():
        raise OutputRefusedError(f"{folder}: exists and is not a folder; choose another --out")
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, COMMAND)


# --------------------------------------------------------------------------- the planner's numbers


def plan_numbers(spec: Spec) -> dict[str, Any]:
    """The planner's headline numbers for the full-size spec (:func:`opskit.spec.plan.make_plan`, nothing
    recomputed)."""
    plan = make_plan(spec)
    lay, mem, t = plan.layout, plan.memory, plan.time
    return {
        "parameters": plan.parameters.total,
        "layout": f"{lay.nodes} nodes x {lay.gpus_per_node} GPUs: TP={lay.tensor_parallel} "
                  f"PP={lay.pipeline_parallel} DP={lay.data_parallel}",
        "memory_gib_per_gpu": round(mem.total_gib_per_gpu, 1),
        "fits": mem.fits,
        "train_iters": plan.batch.train_iters,
        "tokens": plan.batch.tokens,
        "days": None if t.days_with_rampup_slowdown is None else round(t.days_with_rampup_slowdown, 1),
        "warnings": plan.warnings,
    }


# --------------------------------------------------------------------------- the run


def rehearse(spec: Spec, nodes: int = 1, iterations: int = DEFAULT_ITERATIONS, root: Path | None = None,
             force: bool = False, ranks_per_node: int = DEFAULT_RANKS_PER_NODE, wait_s: float = WAIT_S,
             on_stage: Callable[[Stage], None] | None = None) -> Rehearsal:
    """Rehearse ``spec`` scaled down on the local SLURM; every stage ends green, red or skipped with one line.

    Args:
        root: where rehearsal folders go (default ``rehearsals/`` under the spec's base directory).
        force: replace an earlier rehearsal's folder.
        wait_s: real seconds both tasks may take before they are cancelled (red), and the twin after them.
        on_stage: called with each stage as it ends (progress).

    Raises:
        OutputRefusedError: the folder is not the rehearsal's (:func:`claim_folder`). RehearsalError: bad numbers.
    """
    started = time.monotonic()
    folder = rehearsal_folder(spec, root)
    result = Rehearsal(spec.name, folder, plan=plan_numbers(spec))

    def stage(name: str, status: Status, reason: str) -> None:
        result.stages.append(Stage(name, status, reason))
        if on_stage is not None:
            on_stage(result.stages[-1])

    data = plan_data(spec, folder.parent / ".data")
    try:
        small, result.substitutions = rehearsal_spec(spec, folder, data, nodes, ranks_per_node, iterations)
        twin, _ = rehearsal_spec(spec, folder, data, nodes, ranks_per_node, iterations, twin=True)
    except SpecError as e:
        stage("spec scaled down", "failed", str(e))
        return _skip_rest(result, stage, started)
    claim_folder(spec, folder, force)
    try:
        atomic_write_text(folder / "spec.yaml", _spec_yaml(small))
        atomic_write_text(folder / "twin.yaml", _spec_yaml(twin))
        p = small.parallel
        stage("spec scaled down", "ok", f"{len(result.substitutions)} substitutions; "
                                        f"TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
                                        f"DP={p.data_parallel_size}, {small.model.precision}, ZeRO-{p.zero_stage}")
        try:
            stage("data", "ok", prepare(data))
        except (OpskitError, OSError) as e:
            stage("data", "failed", str(e))
            return _skip_rest(result, stage, started)
        _run_chain(small, twin, result, stage, iterations, wait_s)
    finally:
        seal_folder(folder)
    result.seconds = time.monotonic() - started
    return result


def seal_folder(folder: Path) -> None:
    """List every file of the ended rehearsal in its marker: what a later ``--force`` may delete, and nothing a user
    adds afterwards (a rehearsal killed before this keeps a marker listing nothing, which ``--force`` refuses)."""
    write_marker(folder, COMMAND, entries=folder_entries(folder))


def _spec_yaml(spec: Spec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False)


LATER_STAGES = ("submit", "task 1: exit duration", "task 2: resume", "exact resume", "ckpt check", "ckpt convert",
                "status", "logs show")


def _skip_rest(result: Rehearsal, stage: Callable[[str, Status, str], None], started: float) -> Rehearsal:
    done = {s.name for s in result.stages}
    first_failed = next((s.name for s in result.stages if s.status == "failed"), "an earlier stage")
    for name in ("data", *LATER_STAGES):
        if name not in done:
            stage(name, "skipped", f"{first_failed} failed")
    result.seconds = time.monotonic() - started
    return result


def _run_chain(spec: Spec, twin: Spec, result: Rehearsal, stage: Callable[[str, Status, str], None], iterations: int,
               wait_s: float) -> None:
    """Submit two tasks, wait for them (cancelling on failure, timeout or Ctrl-C), train their uninterrupted
    ``twin`` after them, then check every stage."""
    run = RunPaths.of(spec)
    try:
        sub = submit(spec, array=2)
    except client.SchedulerUnreachable as e:
        stage("submit", "failed", f"SLURM did not answer ({e}): start it: scripts/local-slurm.sh start")
        _skip_rest(result, stage, 0)
        return
    except OpskitError as e:
        stage("submit", "failed", str(e))
        _skip_rest(result, stage, 0)
        return
    result.job_id = sub.job_id
    stage("submit", "ok", f"job {sub.job_id}: 2 chained tasks on the local SLURM ({sub.run.script.name})")
    failure = _wait_or_cancel(spec, run, sub.job_id, wait_s)
    task1, task2 = _task_stages(run, sub.job_id, iterations, failure)
    stage(*task1)
    stage(*task2)
    if task1[1] != "ok" or task2[1] != "ok":
        _skip_rest(result, stage, 0)
        return
    stage("exact resume", *_exact_resume(twin, run, sub.job_id, result, wait_s))
    for name, check in (("ckpt check", _ckpt_check), ("ckpt convert", _ckpt_convert), ("status", _status),
                        ("logs show", _logs_show)):
        try:
            status, reason = check(spec, run, iterations)
        except Exception as e:  # noqa: BLE001 -- any failure of a stage is that stage's red line, never a traceback
            status, reason = "failed", " ".join(f"{type(e).__name__}: {e}".split())[:300]
        stage(name, status, reason)


def _wait(spec: Spec, run: RunPaths, job_id: str, wait_s: float) -> str | None:
    """Until the job has left the queue: None, or why it was stopped early (a failed task, a pending reason that
    never clears, the time limit)."""
    deadline = time.monotonic() + wait_s
    watch = HopelessWatch(then="then rehearse again")
    while time.monotonic() < deadline:
        if failed := [r for r in chain.read_ledger(run) if r.state not in ("COMPLETED", "SKIPPED")]:
            return f"task {failed[0].task} {failed[0].state} (exit code {failed[0].exit_code})"
        try:
            queued = [e for e in client.squeue() if e.array_id == job_id]
        except client.SchedulerUnreachable:
            queued = None  # keep waiting: a slow controller is not an ended job
        if queued == []:
            return None
        if queued and (stuck := watch.check(queued)):
            return f"{stuck} (cancelled)"
        time.sleep(1)
    return f"not done after {wait_s:g} s: cancelled"


def _wait_or_cancel(spec: Spec, run: RunPaths, job_id: str, wait_s: float) -> str | None:
    """:func:`_wait`, then ``scancel`` (:func:`_cancel`) when it says why the job stopped early, or on Ctrl-C."""
    finished = False
    try:
        failure = _wait(spec, run, job_id, wait_s)
        finished = True
    finally:
        if not finished or failure:
            _cancel(job_id)
    return failure


def _cancel(job_id: str, wait_s: float = 120) -> None:
    """``scancel`` the rehearsal's array and wait (up to ``wait_s``) until no task of it is queued or completing, so a
    red rehearsal leaves nothing behind."""
    deadline = time.monotonic() + wait_s
    try:
        client.scancel([job_id])
        while time.monotonic() < deadline and any(e.array_id == job_id for e in client.squeue()):
            time.sleep(1)
    except client.SlurmError:
        pass


def _task_texts(run: RunPaths, job_id: str) -> dict[str, str]:
    """Each array task's section of main_log.txt, by task id (``1``, ``2``)."""
    try:
        log = run.main_log.read_text(errors="replace")
    except OSError:
        return {}
    starts = list(JOB_HEADER.finditer(log))
    out = {}
    for i, m in enumerate(starts):
        task = m["task"]
        if task.startswith(f"{job_id}_"):
            out[task.removeprefix(f"{job_id}_")] = log[m.start():starts[i + 1].start() if i + 1 < len(starts)
                                                      else len(log)]
    return out


def _trainer_error(text: str) -> str:
    """The trainer's one-line error (``error: ...``), else the last exception line of a traceback, else the last
    line."""
    lines = [line_source(line)[2] for line in text.splitlines()]  # without srun's and torchrun's prefixes
    for line in lines:
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    for line in lines:  # a rank's own exception comes before torchrun's ChildFailedError summary
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "no output"


def _task_stages(run: RunPaths, job_id: str, iterations: int, failure: str | None
                 ) -> tuple[tuple[str, Status, str], tuple[str, Status, str]]:
    tasks = _task_texts(run, job_id)
    first, second = tasks.get("1", ""), tasks.get("2", "")
    exit_line = re.search(r"\[exiting program after ([\d.]+) minutes\]", first)
    saved = re.findall(r"successfully saved checkpoint at iteration +(\d+)", first)
    if exit_line and saved:
        task1 = ("task 1: exit duration", "ok", f"stopped by its exit duration after {float(exit_line[1]):g} "
                                                f"simulated min with a checkpoint at iteration {saved[-1]}")
    else:
        why = _trainer_error(first) if first else (failure or "task 1 never started")
        return ("task 1: exit duration", "failed", why), ("task 2: resume", "skipped", "task 1 failed")
    loaded = loaded_iteration(second)
    if loaded is not None and run.finished_flag.is_file() and failure is None:
        flag = run.finished_flag.read_text().strip()
        return task1, ("task 2: resume", "ok", f"resumed at iteration {loaded}; {flag.split(' ', 2)[-1]}")
    why = _trainer_error(second) if second else (failure or "task 2 never started")
    if loaded is not None and not run.finished_flag.is_file() and failure is None:
        why = f"resumed at iteration {loaded} but no finished flag ({run.finished_flag})"
    return task1, ("task 2: resume", "failed", why)


def loaded_iteration(text: str) -> int | None:
    """The iteration a task's text says its checkpoint was loaded at (Megatron's ``successfully loaded checkpoint
    from DIR at iteration N``), or None."""
    loaded = re.search(r"successfully loaded checkpoint from .+ at iteration (\d+)", text)
    return int(loaded[1]) if loaded else None


# --------------------------------------------------------------------------- exact resume


def _exact_resume(twin: Spec, run: RunPaths, job_id: str, result: Rehearsal, wait_s: float) -> tuple[Status, str]:
    """Train the chain's uninterrupted ``twin`` (one task, after the chain: each asks every CPU of the node) and
    compare the losses the chain printed with its (:func:`compare_with_twin`)."""
    twin_run = RunPaths.of(twin)
    try:
        sub = submit(twin)
    except OpskitError as e:
        return "failed", f"the uninterrupted twin was not submitted: {e}"
    result.twin_job_id = sub.job_id
    failure = _wait_or_cancel(twin, twin_run, sub.job_id, wait_s)
    twin_text = "".join(_task_texts(twin_run, sub.job_id).values())  # its one task (no array: task id 0)
    if failure is not None or not twin_run.finished_flag.is_file():
        why = failure or (_trainer_error(twin_text) if twin_text else "it never started")
        return "failed", f"the uninterrupted twin (job {sub.job_id}) did not finish: {why}"
    tasks = _task_texts(run, job_id)
    second = tasks.get("2", "")
    status, reason = compare_with_twin(tasks.get("1", ""), second, twin_text, loaded_iteration(second) or 0)
    return status, f"{reason}; twin: job {sub.job_id} in {twin_run.root.name}/"


LossKey = tuple[float, int, str, str]
"""Where a loss was printed, in print order: (iteration, 0 for the training line / 1 for a validation line, what,
where); iteration ``inf`` for the evaluation at the end of training."""


def printed_losses(text: str) -> dict[LossKey, str]:
    """The losses a log's text printed, as printed (Megatron's ``%.6E``, ``-`` for an iteration line without one):
    each iteration line's lm loss (``losses``) and each validation line's (``valid losses``, by set name)."""
    out: dict[LossKey, str] = {}
    for r in parse_text(text).records:
        if r["kind"] == "iteration":
            key = (r["iteration"], 0, "losses", f"iteration {r['iteration']}")
            out[key] = _as_printed(r.get("lm_loss"))
        else:
            at = math.inf if r["iteration"] is None else r["iteration"]
            out[(at, 1, f"{r['dataset']} losses", r["where"])] = _as_printed(r["validation_lm_loss"])
    return out


def _as_printed(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.6E}"  # the trainer's format: the text the line had


def compare_with_twin(first: str, second: str, twin: str, resumed_at: int) -> tuple[Status, str]:
    """The chain's losses (task 1's ``first`` text up to ``resumed_at``, then task 2's ``second``) against the
    uninterrupted ``twin``'s, key by key in print order: green when every one is equal as printed, else red at the
    first that differs (or that one side did not print). A difference before the resume says the training itself
    is not repeatable, so its resume cannot be judged."""
    chain = {k: v for k, v in printed_losses(first).items() if k[0] <= resumed_at}
    resumed = {k: v for k, v in printed_losses(second).items() if k[0] > resumed_at}
    iterations = sorted(k[0] for k in resumed if k[1] == 0)
    if not iterations:
        return "failed", f"task 2 printed no iteration line after the resume at iteration {resumed_at}"
    chain |= resumed
    uninterrupted = printed_losses(twin)
    for key in sorted(chain.keys() | uninterrupted.keys()):
        ours, theirs = chain.get(key, "not printed"), uninterrupted.get(key, "not printed")
        if ours != theirs:
            at, _, what, where = key
            if at > resumed_at:
                return "failed", f"{what} part at {where}: {ours} resumed, {theirs} uninterrupted"
            return "failed", (f"{what} part at {where}, before the resume at iteration {resumed_at}: {ours} task 1, "
                              f"{theirs} uninterrupted (the training itself does not repeat: its resume cannot be "
                              "judged)")
    evaluations = sum(k[1] == 1 for k in resumed)
    evaluated = f" and {evaluations} validation loss{'' if evaluations == 1 else 'es'}" if evaluations else ""
    return "ok", (f"lm losses of iterations {iterations[0]}-{iterations[-1]}{evaluated} equal the uninterrupted "
                  f"twin's as printed (iterations 1-{resumed_at} too)")


def _ckpt_check(spec: Spec, run: RunPaths, iterations: int) -> tuple[Status, str]:
    step = resolve_step_dir(run.checkpoints, None)
    report = check_step(step)
    if report.ok:
        return "ok", f"{step.name}: complete, TP copies equal, no NaN, CRCs intact"
    found = [*report.problems, *report.corrupt, *(f"TP copies differ: {d['key']}" for d in report.tp_mismatches),
             *(f"NaN/Inf in {d['key']}" for d in report.nonfinite), *(f"RNG differs: {r['key']}" for r in report.rng
                                                                        if not r["agree"])]
    return "failed", f"{step.name}: {'; '.join(found[:2])}"


def _ckpt_convert(spec: Spec, run: RunPaths, iterations: int) -> tuple[Status, str]:
    """``ckpt convert`` with verification; skipped (said) for a model transformers has no class for (absolute
    positions with an embedding LayerNorm: tr8b-104B's cl, emb-norm and bnb variants), which the training does not
    need."""
    step = resolve_step_dir(run.checkpoints, None)
    try:
        model_arch(load_args(scan_step_dir(step), light=True), step)
    except ConvertError as e:
        return "skipped", f"no transformers model for it: {str(e).removeprefix(f'{step}: ')}"
    done = convert_step(step, run.hf_dir / step.name, verify=True)
    return "ok", (f"{done.arch}, {done.num_parameters:,} parameters, logits verified (max abs diff "
                  f"{done.max_abs_diff:.2g})")


def _status(spec: Spec, run: RunPaths, iterations: int) -> tuple[Status, str]:
    report = run_checks(spec)
    bad = report.alerts
    if bad:
        return "failed", "; ".join(f"{f.key}: {f.message}" for f in bad[:2])
    warned = [f.key for f in report.findings if f.severity == "warn"]
    return "ok", f"{report.severity}: {len(report.findings)} findings" + (f" (warn: {', '.join(warned)})"
                                                                          if warned else "")


def _logs_show(spec: Spec, run: RunPaths, iterations: int) -> tuple[Status, str]:
    records = timeline(read_tail(run.main_log, iterations).records)
    if not records:
        return "failed", f"{run.main_log}: no iteration lines"
    last = records[-1]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    if last["iteration"] != iterations:
        return "failed", f"last iteration {last['iteration']}, expected {iterations}"
    if not losses or not all(math.isfinite(x) for x in losses):
        return "failed", f"lm loss not finite: {losses[-3:]}"
    return "ok", f"iteration {last['iteration']}/{last['train_iters']}, lm loss {losses[0]:.3f} -> {losses[-1]:.3f}"
