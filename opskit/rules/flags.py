"""The trainer's flags as data: ``python -m opskit.train``'s parser, the spec's ``megatron_args`` check and the job
renderer all read this one table, so every value a valid spec can hold is one the trainer's parser accepts.

Spec field -> flag, ONE rule: the field ``section.name`` of the model / parallel / batch / optimizer / data /
checkpoint sections is the flag ``--name-with-dashes`` (Megatron-DeepSpeed's spelling; a :class:`Flag` with that
``section``), with the value as the spec holds it, left out when None. The exceptions, documented here and nowhere
else:

- spec fields without a flag of their name (:data:`FIELD_EXCEPTIONS`): ``model.precision`` is ``--fp16`` /
  ``--bf16`` (fp32: neither); the layout and cluster fields (``parallel.nodes``, ``gpus_per_node``, ``gpu``,
  ``gpu_memory_gb``, ``deepspeed_version``) and the corpus fields (``data.corpus``, ``dir``, ``name``,
  ``vocab_size``) reach the trainer otherwise or not at all;
- flags opskit derives (a :class:`Flag` with ``derived``): the run directory's paths (``--save``, ``--load``,
  ``--tensorboard-dir``, ``--kill-switch-path``, ``--finished-flag-path``, ``--deepspeed_config``, from
  ``runs.RunPaths``), ``--exit-duration-in-mins`` (``slurm.time`` minus ``slurm.exit_margin_mins``), the
  ``--deepspeed`` switch (always on);
- a corpus ``opskit data prepare`` builds (``data.corpus``) gives ``--data-path``, ``--tokenizer-type`` and
  ``--tokenizer-name-or-path`` from ``data.dir`` / ``data.name`` instead of the data section's own fields.

Every other flag is free: the spec sets it under ``megatron_args`` (``key_name: value`` -> ``--key-name value``).
Megatron-DeepSpeed spells ``--deepspeed_config`` with an underscore; the table keeps that spelling.

Defaults are Megatron-DeepSpeed's (the trainer keeps its flags' semantics); a spec field with a default has the same
one, or None (the flag is left out, so the trainer's default applies), except the opskit choices of
:data:`SPEC_DEFAULTS` (``checkpoint.async_save``: jobs save in the background unless the spec says not). Value
bounds (``gt``/``ge``/``lt``/``le``) are the flag's too: the trainer's parser applies them and the spec field
declares them with :func:`bounds`. tests/test_flags_property.py checks both.
"""

from __future__ import annotations

import argparse
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SECTIONS = ("model", "parallel", "batch", "optimizer", "data", "checkpoint")
"""The spec sections whose fields are trainer flags by the one rule."""

_RUN_DIR = "paths.output"


@dataclass(frozen=True)
class Flag:
    """One flag of ``python -m opskit.train``: what argparse takes, and where a rendered job's value comes from.

    ``section`` names the spec section holding the field of the same name (``--num-layers`` <- ``model.num_layers``);
    ``derived`` says what opskit derives the flag from (never ``megatron_args``); neither: a free flag.
    """

    option: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple | None = None
    nargs: int | str | None = None
    metavar: str | tuple[str, ...] | None = None
    required: bool = False
    switch: bool = False
    """``store_true``: present or not, no value."""
    help: str | None = None
    section: str | None = None
    derived: str | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    """Bounds of the value (pydantic's names): the trainer's parser refuses a value outside them, and the spec field
    of the flag takes the same (:func:`bounds`), so one side cannot accept what the other refuses."""

    def __post_init__(self):
        if self.switch:  # a switch left out is off
            object.__setattr__(self, "default", False)

    @property
    def dest(self) -> str:
        """The argparse attribute and ``megatron_args`` key: ``--num-layers`` -> ``num_layers``."""
        return self.option[2:].replace("-", "_")

    @property
    def field(self) -> str | None:
        """The spec field that sets this flag (``model.num_layers``), or None."""
        return f"{self.section}.{self.dest}" if self.section else None

    @property
    def owner(self) -> str | None:
        """Where a spec sets this flag when not under ``megatron_args``: its field or what it is derived from."""
        return self.field or self.derived

    @property
    def bounds(self) -> dict[str, float]:
        """The flag's bounds as ``pydantic.Field`` keyword arguments (``{"gt": 0}``); {} when it has none."""
        return {key: value for key in ("gt", "ge", "lt", "le") if (value := getattr(self, key)) is not None}

    def bound_problem(self, value: float) -> str | None:
        """Which bound ``value`` breaks (``must be > 0``), or None; NaN breaks every bound."""
        for key, (sign, holds) in _BOUND_TESTS.items():
            limit = getattr(self, key)
            if limit is not None and not holds(value, limit):
                return f"must be {sign} {limit:g}"
        return None

    def argparse_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``ArgumentParser.add_argument`` for this flag."""
        if self.switch:
            return {"action": "store_true", "help": self.help}
        kwargs = {"type": self._bounded_type() if self.bounds else self.type, "default": self.default,
                  "help": self.help}
        kwargs.update({key: getattr(self, key) for key in ("choices", "nargs", "metavar", "required")
                       if getattr(self, key) not in (None, False)})
        return kwargs

    def _bounded_type(self) -> Callable[[str], Any]:
        """``type`` that also refuses a value outside the bounds (argparse then names the flag)."""
        def convert(text: str):
            value = self.type(text)
            if problem := self.bound_problem(value):
                raise argparse.ArgumentTypeError(f"{problem}, got {text}")
            return value

        convert.__name__ = self.type.__name__  # argparse's "invalid int value" names the type
        return convert


_BOUND_TESTS: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    "gt": (">", operator.gt), "ge": (">=", operator.ge), "lt": ("<", operator.lt), "le": ("<=", operator.le)}

MAX_BATCH = 1 << 20
"""The largest micro or global batch (samples): beyond it a value is a typo (BLOOM-176B: 2048), and the planner's
node-count search and ramp-up table grow with it."""


GROUPS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("model", (
        Flag("--num-layers", section="model", type=int, required=True, gt=0),
        Flag("--hidden-size", section="model", type=int, required=True, gt=0),
        Flag("--ffn-hidden-size", section="model", type=int, gt=0, help="default 4 * hidden size"),
        Flag("--num-attention-heads", section="model", type=int, required=True, gt=0),
        Flag("--seq-length", section="model", type=int, required=True, gt=0),
        Flag("--max-position-embeddings", section="model", type=int, gt=0, help="default: --seq-length"),
        Flag("--position-embedding-type", section="model", choices=("absolute", "alibi"), default="absolute"),
        Flag("--embed-layernorm", section="model", switch=True, help="LayerNorm after the word embedding (BLOOM)"),
        Flag("--init-method-std", section="model", type=float, default=0.02, gt=0),
        Flag("--hidden-dropout", section="model", type=float, default=0.1, ge=0, lt=1),
        Flag("--attention-dropout", section="model", type=float, default=0.1, ge=0, lt=1),
        Flag("--make-vocab-size-divisible-by", section="model", type=int, default=128, gt=0),
        Flag("--pad-vocab-size-to", section="model", type=int, gt=0),
        Flag("--fp16", switch=True, derived="model.precision",
             help="fp16 with DeepSpeed's loss scaling (the DeepSpeed config's fp16 block; default dynamic, initial "
                  "scale 2^12)"),
        Flag("--bf16", switch=True, derived="model.precision"),
        Flag("--loss-scale", type=float,
             help="accepted, no effect: as in Megatron-DeepSpeed, the DeepSpeed config's fp16.loss_scale governs "
                  "(0 = dynamic)"),
    )),
    ("parallelism", (
        Flag("--tensor-model-parallel-size", type=int, default=1, section="parallel", gt=0),
        Flag("--pipeline-model-parallel-size", type=int, default=1, section="parallel", gt=0),
        Flag("--sequence-parallel", section="parallel", switch=True,
             help="Megatron's sequence parallelism: LayerNorms, dropouts and residual adds on s/TP tokens per TP "
                  "rank, reduce-scatter + all-gather instead of all-reduce (no effect at TP = 1)"),
        Flag("--sync-tp-duplicated-parameters", switch=True,
             help="average the parameters every TP rank holds a copy of (LayerNorms, row-parallel biases, position "
                  "embeddings) over the TP group after every step, so they stay bitwise equal"),
        Flag("--deepspeed", switch=True, derived="opskit (always on)",
             help="accepted for compatibility; DeepSpeed is always used"),
        Flag("--deepspeed_config", derived="opskit (the rendered ds_config.json)",
             help="DeepSpeed JSON; missing keys are filled from the flags"),
        Flag("--zero-stage", type=int, default=1, section="parallel", ge=0, le=1),
        Flag("--checkpoint-activations", section="model", switch=True),
        Flag("--recompute-granularity", choices=("full", "selective"), section="model",
             help="full: as --checkpoint-activations; selective: recompute only the LayerNorms' outputs and the MLP's "
                  "activation in the backward pass (eager model)"),
        Flag("--deepspeed-activation-checkpointing", switch=True,
             help="accepted, no effect: --checkpoint-activations always uses DeepSpeed's (pipeline) activation "
                  "checkpointing"),
        Flag("--pp-partition-method", section="parallel",
             help="DeepSpeed PipelineModule partition_method: parameters, uniform or type:REGEX (default: "
                  "type:transformer|embedding, BLOOM-176B's)"),
        Flag("--abort-on-unmet-fused-kernel-constraints", switch=True,
             help="accepted, no effect: this trainer has no fused softmax kernels whose constraints could fail"),
        Flag("--torch-compile", switch=True, help="opskit extension: torch.compile the model (GPUs)"),
        Flag("--distributed-backend", choices=("nccl", "gloo"), help="default: nccl with CUDA, gloo on CPU"),
    )),
    ("batch and schedule", (
        Flag("--micro-batch-size", type=int, required=True, section="batch", gt=0, le=MAX_BATCH),
        Flag("--global-batch-size", type=int, required=True, section="batch", gt=0, le=MAX_BATCH),
        Flag("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"), section="batch"),
        Flag("--train-samples", type=int, section="batch", gt=0),
        Flag("--train-iters", type=int, section="batch", gt=0,
             help="instead of --train-samples (Megatron's; not with --rampup-batch-size)"),
        Flag("--train-tokens", type=int, section="batch", gt=0,
             help="accepted, no effect, as in Megatron-DeepSpeed since its PR #177: --train-samples ends training"),
        Flag("--lr", type=float, required=True, section="optimizer", ge=0),  # 0 as in Megatron: a frozen model
        Flag("--min-lr", type=float, default=0.0, section="optimizer", ge=0),
        Flag("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear", section="optimizer"),
        Flag("--lr-warmup-samples", type=int, default=0, section="optimizer", ge=0),
        Flag("--lr-decay-samples", type=int, section="optimizer", gt=0, help="default: --train-samples"),
        Flag("--lr-decay-tokens", type=int, section="optimizer", gt=0,
             help="decay the LR over this many consumed tokens instead of samples (curriculum learning: shorter "
                  "sequences early); warmup stays in samples"),
        Flag("--override-lr-scheduler", switch=True),
        Flag("--use-checkpoint-lr-scheduler", switch=True),
        Flag("--optimizer", choices=("adam",), default="adam"),
        Flag("--use-bnb-optimizer", switch=True,
             help="bitsandbytes' 8-bit Adam (pip install bitsandbytes); the word embedding becomes bitsandbytes' "
                  "StableEmbedding, as in Megatron-DeepSpeed: a LayerNorm after it, xavier-uniform init, 32-bit "
                  "optimizer states"),
        Flag("--adam-beta1", type=float, default=0.9, section="optimizer"),
        Flag("--adam-beta2", type=float, default=0.999, section="optimizer"),
        Flag("--adam-eps", type=float, default=1e-8, section="optimizer"),
        Flag("--weight-decay", type=float, default=0.01, section="optimizer", ge=0),
        Flag("--clip-grad", type=float, default=1.0, section="optimizer", ge=0),
        Flag("--seed", type=int, default=1234, section="checkpoint"),
    )),
    ("data", (
        Flag("--data-path", nargs="+", section="data",
             help="indexed dataset prefix (without .bin/.idx), or a blend: WEIGHT PREFIX WEIGHT PREFIX ... (weights "
                  "are normalised; each prefix is split by --split on its own)"),
        Flag("--train-weighted-split-paths-path", section="data",
             help="instead of --data-path: a file holding one group \"NAME: WEIGHT START:END PREFIX, ...\" "
                  "(BigScience's catalogue blend; START:END are fractions of each dataset's documents)"),
        Flag("--valid-weighted-split-paths-path", section="data",
             help="the validation groups, same format, one or more \"NAME: ...\" groups on one line; each is "
                  "evaluated and printed under its NAME"),
        Flag("--data-impl", choices=("mmap",), default="mmap", section="data"),
        Flag("--tokenizer-type", choices=("PretrainedFromHF", "GPT2BPETokenizer"), default="PretrainedFromHF",
             section="data"),
        Flag("--tokenizer-name-or-path", section="data", help="PretrainedFromHF: a folder with tokenizer.json"),
        Flag("--vocab-file", section="data", help="GPT2BPETokenizer: GPT-2's vocab.json"),
        Flag("--merge-file", section="data", help="GPT2BPETokenizer: GPT-2's merges.txt"),
        Flag("--num-workers", type=int, default=2,
             help="accepted, no effect: samples are read from the mmap in the training process (no DataLoader)"),
        Flag("--valid-num-workers", type=int, default=2,
             help="accepted, no effect: validation samples are read in the training process too"),
        Flag("--split", default="969, 30, 1", section="data",
             help="train,valid,test weights: the documents, in index order, are cut proportionally (Megatron's "
                  "rule; default 969, 30, 1)"),
    )),
    ("validation", (
        Flag("--eval-interval", type=int, section="checkpoint", gt=0,
             help="validate every N iterations and at the end of training (default: never)"),
        Flag("--eval-iters", type=int, default=100, section="checkpoint", ge=0,
             help="global batches of the valid split per validation (default 100)"),
    )),
    ("checkpoints and exit", (
        Flag("--save", derived=_RUN_DIR),
        Flag("--load", derived=_RUN_DIR),
        Flag("--save-interval", type=int, section="checkpoint", gt=0),
        Flag("--async-save", switch=True, section="checkpoint",
             help="write checkpoints in the background (Megatron-LM's flag): training goes on once the state is "
                  "copied to host memory; `latest` moves when every rank's files are written"),
        Flag("--exit-interval", type=int),
        Flag("--exit-duration-in-mins", type=float, derived="slurm.time and slurm.exit_margin_mins"),
        Flag("--kill-switch-path", derived=_RUN_DIR, help="if this file exists: save and exit"),
        Flag("--finished-flag-path", derived=_RUN_DIR,
             help="opskit extension: write this file when training completes, so the chain's later tasks exit at "
                  "start"),
        Flag("--stack-dump-after-mins", type=float, derived="watchdog.hang_min_minutes (half of it)", ge=0, lt=1e6,
             help="opskit extension: when one iteration takes this long, every rank prints its Python stacks (the "
                  "watchdog names the rank a hang waits for); default off"),
        Flag("--skip-train-iteration-range", nargs="+", metavar="START-END",
             help="skip the global batches of data these iterations would have trained on (e.g. 101-200 251-300); "
                  "iteration, LR and consumed samples do not advance"),
    )),
    ("divergence", (
        Flag("--divergence-action", choices=("alert", "rollback"), default="alert",
             derived="watchdog.divergence.action",
             help="opskit extension: on a loss/grad-norm spike that has not come back within --divergence-patience "
                  "iterations, or a NaN: print a warning (alert), or stop without saving and report it to the job "
                  "for a replay and rollback (rollback)"),
        Flag("--divergence-patience", type=int, default=50, derived="watchdog.divergence.patience", gt=0),
        Flag("--spike-window", type=int, default=100, derived="watchdog.spike_window", ge=5),
        Flag("--spike-threshold", type=float, default=6.0, derived="watchdog.spike_threshold", gt=0),
        Flag("--replica-digest-interval", type=int, default=0, derived="watchdog.divergence.digest_interval", ge=0,
             help="opskit extension: every N iterations, and before every save, the data-parallel replicas compare "
                  "digests of their parameters (bitwise equal under ZeRO-0/1); one that differs stops the run for the "
                  "job, which keeps its node out (default 0: never)"),
        Flag("--divergence-replay", metavar="ITERATION:METRIC:VALUE:BASELINE", derived="the job's triage",
             help="opskit extension, set by the job: this run replays a spike; at ITERATION its METRIC is judged "
                  "reproduced or not"),
    )),
    ("logging", (
        Flag("--log-interval", type=int, default=100, section="checkpoint", gt=0),
        Flag("--tensorboard-dir", derived=_RUN_DIR),
        Flag("--tensorboard-queue-size", type=int, default=1000, section="checkpoint", gt=0),
        Flag("--log-batch-size-to-tensorboard", switch=True,
             help="accepted; batch-size/batch-size (+ vs samples) is always written"),
        Flag("--log-timers-to-tensorboard", switch=True,
             help="accepted, no effect: the trainer keeps no Megatron timers to write"),
        Flag("--log-validation-ppl-to-tensorboard", switch=True,
             help="also write 'lm-loss-validation/lm loss validation ppl'"),
        Flag("--profile", switch=True,
             help="profile iterations [--profile-step-start, --profile-step-end) of the --profile-ranks (Megatron-LM): "
                  "with --use-pytorch-profiler, Chrome traces into --tensorboard-dir; else the range for nsys "
                  "(--capture-range=cudaProfilerApi)"),
        Flag("--profile-step-start", type=int, default=10, ge=1),
        Flag("--profile-step-end", type=int, default=12, gt=1),
        Flag("--profile-ranks", type=int, nargs="+", default=[0], metavar="RANK", ge=0,
             help="global ranks to profile (default 0)"),
        Flag("--use-pytorch-profiler", switch=True, help="--profile with torch.profiler instead of nsys's range"),
        Flag("--codecarbon-dir",
             help="CodeCarbon's offline emissions CSVs (emissions-RANK.csv) go here, when the codecarbon package is "
                  "installed (pip install codecarbon); otherwise a warning and training goes on"),
    )),
)
"""Every flag of ``python -m opskit.train``, by ``--help`` group, in ``--help`` order (the rendered command line's
order too)."""

FLAGS: dict[str, Flag] = {flag.dest: flag for _, flags in GROUPS for flag in flags}
"""The table by argparse attribute / ``megatron_args`` key."""


def bounds(key: str) -> dict[str, float]:
    """The bounds of flag ``key`` (``num_layers``) as ``pydantic.Field`` keyword arguments: what the spec field of
    the same name declares (:attr:`Flag.bounds`)."""
    return FLAGS[key].bounds

FIELD_EXCEPTIONS: dict[str, str] = {
    "model.precision": "--fp16 / --bf16 (fp32: neither)",
    "parallel.nodes": "the job's #SBATCH --nodes and torchrun's --nnodes",
    "parallel.gpus_per_node": "torchrun's --nproc_per_node",
    "parallel.gpu": "opskit plan's TFLOPs (informative)",
    "parallel.gpu_memory_gb": "opskit plan's memory warning",
    "parallel.deepspeed_version": "the spec's DeepSpeed version rules",
    "data.corpus": "opskit data prepare (then --data-path and --tokenizer-name-or-path come from data.dir)",
    "data.dir": "--data-path and --tokenizer-name-or-path of a prepared corpus",
    "data.name": "--data-path of a prepared corpus",
    "data.vocab_size": "opskit data prepare and the vocabulary padding rules",
}
"""Fields of :data:`SECTIONS` that are no flag of their own name, and what they become instead."""

SPEC_DEFAULTS: dict[str, object] = {
    "checkpoint.async_save": True,
}
"""Spec fields whose default is opskit's choice rather than the trainer flag's (Megatron's, kept for commands written
for Megatron-DeepSpeed): an opskit job saves in the background unless the spec sets ``async_save: false``."""

DEEPSPEED_KEYS: dict[tuple[str, ...], str] = {
    ("train_micro_batch_size_per_gpu",): "micro_batch_size",
    ("train_batch_size",): "global_batch_size",
    ("gradient_clipping",): "clip_grad",
    ("zero_optimization", "stage"): "zero_stage",
    ("fp16", "enabled"): "fp16",
    ("bf16", "enabled"): "bf16",
}
"""DeepSpeed JSON keys whose value is a flag's (key path -> flag dest): the spec's extra ``deepspeed_config`` may not
set them, since the flag's owner does."""


def spec_fields() -> dict[str, Flag]:
    """The flags the one rule derives from spec fields, by field (``model.num_layers`` -> ``--num-layers``)."""
    return {flag.field: flag for flag in FLAGS.values() if flag.field}


def flag_problem(key: str, value: Any) -> str | None:
    """Why the spec's ``megatron_args`` may not hold ``key: value``, or None; one clause naming the fix.

    ``value`` is a YAML scalar or list: ``true`` is a bare switch, ``false`` / ``null`` leaves the flag out, a list
    gives several values. Checked against the table: the flag exists, no spec field or derivation owns it, and its
    argparse type, choices, nargs and bounds take the value (``$VAR`` strings are checked as written).
    """
    flag = FLAGS.get(key)
    if flag is None:
        return f"opskit's trainer has no --{key.replace('_', '-')} (python -m opskit.train --help lists its flags)"
    if flag.owner:
        return f"{flag.option} comes from {flag.owner}; set it there"
    if value is None or value is False:
        return None
    if flag.switch:
        return None if value is True else f"{flag.option} is a switch: use true or false"
    if value is True:
        return f"{flag.option} takes a value, not true"
    values = value if isinstance(value, list) else [value]
    if not values:
        return "an empty list; use false or null to leave the flag out"
    count = 1 if flag.nargs is None else flag.nargs
    if isinstance(count, int) and len(values) != count:
        return f"{flag.option} takes {count} value{'s' if count > 1 else ''}, got {len(values)}"
    for item in values:
        if isinstance(item, bool):
            return f"{flag.option} takes {_kind(flag)}, not {str(item).lower()}"
        try:
            parsed = flag.type(str(item))
        except (TypeError, ValueError):
            return f"{flag.option} takes {_kind(flag)}, not {item!r}"
        if flag.choices is not None and parsed not in flag.choices:
            return f"{flag.option} takes one of {', '.join(map(str, flag.choices))}, not {item!r}"
        if flag.bounds and (problem := flag.bound_problem(parsed)):
            return f"{flag.option} {problem}, not {item!r}"
    return None


def _kind(flag: Flag) -> str:
    return {int: "an integer", float: "a number"}.get(flag.type, "a string")
