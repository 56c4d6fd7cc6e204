"""Training specs: one YAML file describes a whole training (model, parallelism, batch, optimizer, data,
checkpoints, SLURM header, paths), validated with pydantic.

Keys are the snake_case of Megatron-DeepSpeed's flags (``global_batch_size`` <-> ``--global-batch-size``) and of
sbatch's options (``cpus_per_task`` <-> ``--cpus-per-task``), so one name can be grepped from YAML to script to log
to checkpoint (the rule and its few exceptions: ``opskit.rules.flags``). The trainer's other flags go under
``megatron_args`` (``log_timers_to_tensorboard: true`` -> ``--log-timers-to-tensorboard``), checked against the
trainer's flag table when the spec is read; extra DeepSpeed JSON keys go under ``deepspeed_config``.

A spec is found by path, by exact name, or by a unique name prefix (``tr11`` -> ``tr11-176B-ml``); the project's own
``trainings/`` folder is searched before the bundled presets in ``opskit/spec/presets/``. A file may carry named
*variants* (partial specs under ``variants:``, deep-merged over the rest of the file; ``null`` deletes a key), chosen
with ``NAME:VARIANT`` (``tr8b-104B:cl``, ``tr8b:cl``, ``trainings/mine.yaml:cl``).

Relative paths (``paths.output``, ``data.dir``, ``data.corpus`` files) start from the spec's base directory: the
project directory holding its ``trainings/`` folder, else the spec file's folder, the current one for a bundled preset
(``Spec.base_dir``). Types are strict (``num_layers: true`` or ``2.0`` is refused, an int is a fine float) and a key
given twice in one mapping is refused with both lines.

String values of ``paths``, ``data`` paths, ``slurm.env`` and ``megatron_args`` may use ``$VAR`` / ``${VAR}``
(BigScience's ``$six_ALL_CCFRSCRATCH``): they are expanded from the environment where the job is rendered (``opskit
submit``), and an unset variable is an error there, never an empty string; ``Spec.with_placeholders`` is the copy
``opskit submit`` renders with, which keeps an unset ``$VAR`` literal and lists it (``Spec.problems``).

Every refusal is one line naming the file, the field, the reason and the fix; the cluster-level rules (divisibility
of batch sizes, heads, layers and vocabulary by the parallel layout, curriculum-learning alignment, the exit duration,
the DeepSpeed bf16 resume bug) are checked when the spec is read, so ``opskit plan`` and ``opskit submit`` never see a
spec that Megatron or SLURM would reject.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from opskit.rules import consistency, flags
from opskit.rules.consistency import listed, valid_node_counts
from opskit.rules.deepspeed import deepspeed_version_problem, installed_deepspeed_version
from opskit.rules.model_size import padded_vocab_size as _padded_vocab_size
from opskit.rules.reliability import PREFLIGHT_MARGIN
from opskit.spec.files import USER_SPEC_DIR, SpecError, find_spec, preset_dir
from opskit.spec.placeholders import ENV_VAR, has_value, var_of
from opskit.targets import check_url
from opskit.targets.base import TargetError

# Names end up in the job script's comment and #SBATCH lines: a newline there would start a line of shell code.
_ONE_LINE = r"^[^\x00-\x1f\x7f]+$"
_GROUP_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
_FLAG_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


def parse_slurm_time(value: str) -> float:
    """Minutes in an sbatch ``--time`` value: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.

    Raises:
        ValueError: for anything else (e.g. ``UNLIMITED``, which has no exit duration).
    """
    text = str(value).strip()
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    try:
        parts = [int(p) for p in rest.split(":")]
        d = int(days)
    except ValueError:
        raise ValueError(f"time {value!r}: expected sbatch's format, e.g. 20:00:00 or 4-04:00:00") from None
    if "-" in text:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        raise ValueError(f"time {value!r}: expected sbatch's format, e.g. 20:00:00 or 4-04:00:00")
    return d * 1440 + h * 60 + m + s / 60


class _Section(BaseModel):
    # Unknown keys are typos: reject them and let pydantic list the valid ones. Strict types: `num_layers: true`,
    # `2.0` or "4" is refused, never read as 1, 2 or 4. The one conversion kept: an int is a fine float (YAML reads
    # `lr: 1` as an int).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(_Section):
    """Architecture (Megatron-DeepSpeed GPT: GPT-2 style or BLOOM style)."""

    num_layers: int = Field(**flags.bounds("num_layers"))
    hidden_size: int = Field(**flags.bounds("hidden_size"))
    num_attention_heads: int = Field(**flags.bounds("num_attention_heads"))
    ffn_hidden_size: int | None = Field(default=None, **flags.bounds("ffn_hidden_size"))
    """Defaults to 4 * hidden_size, as in Megatron."""
    seq_length: int = Field(**flags.bounds("seq_length"))
    max_position_embeddings: int = Field(**flags.bounds("max_position_embeddings"))
    position_embedding_type: Literal["absolute", "alibi"] = "absolute"
    embed_layernorm: bool = False
    """LayerNorm right after the word embedding (BLOOM)."""
    pad_vocab_size_to: int | None = Field(default=None, **flags.bounds("pad_vocab_size_to"))
    make_vocab_size_divisible_by: int = Field(default=128, **flags.bounds("make_vocab_size_divisible_by"))
    init_method_std: float = Field(default=0.02, **flags.bounds("init_method_std"))
    hidden_dropout: float = Field(default=0.1, **flags.bounds("hidden_dropout"))
    attention_dropout: float = Field(default=0.1, **flags.bounds("attention_dropout"))
    precision: Literal["fp32", "fp16", "bf16"] = "bf16"
    checkpoint_activations: bool = False
    """``--checkpoint-activations``: recompute each layer's activations in the backward pass (full recompute)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """``--recompute-granularity`` (Megatron-LM's): ``full`` is ``checkpoint_activations``; ``selective`` recomputes
    only the LayerNorms' outputs and the MLP's activation in the backward pass (megatron-core's ``layernorm`` module
    and activation recompute; its ``core_attn`` saves nothing here: the fused attention kernels keep no scores),
    37% of a layer's activations for a few elementwise kernels, eager only (``torch.compile`` recomputes them
    itself)."""

    @property
    def ffn_size(self) -> int:
        """FFN width: ``ffn_hidden_size`` or Megatron's default 4 * hidden_size."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if problems := consistency.attention_problems(self.hidden_size, self.num_attention_heads, self.seq_length,
                                                      self.max_position_embeddings, _key_name):
            raise ValueError("; ".join(problems))
        return self


class ParallelSpec(_Section):
    """Layout over the job's nodes: TP x PP model replicas, the rest is data parallel."""

    nodes: int = Field(default=1, gt=0)
    gpus_per_node: int = Field(default=1, gt=0)
    """Processes per node (GPUs on a cluster, CPU processes locally)."""
    gpu: str | None = None
    """GPU model (``V100``, ``A100``): informative, and picks the default TFLOPs of ``opskit plan``."""
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    """Memory of one GPU as vendors count it (32 for a V100-32GB, 80 for an A100-80GB; GiB): ``opskit plan`` warns
    when its per-GPU estimate exceeds it."""
    tensor_model_parallel_size: int = Field(default=1, **flags.bounds("tensor_model_parallel_size"))
    pipeline_model_parallel_size: int = Field(default=1, **flags.bounds("pipeline_model_parallel_size"))
    sequence_parallel: bool = False
    """``--sequence-parallel`` (Megatron): TP ranks split the sequence outside the TP regions of each block, which
    divides those activations by TP (:func:`opskit.spec.plan.activation_bytes_per_layer`); no effect at TP = 1."""
    pp_partition_method: str | None = Field(default=None, pattern=_ONE_LINE)
    """``--pp-partition-method`` (Megatron-DeepSpeed), e.g. ``type:transformer|embedding`` (BLOOM-176B): counts the
    embeddings as layers when balancing pipeline stages, so num_layers need not be a multiple of PP."""
    zero_stage: int = Field(default=1, **flags.bounds("zero_stage"))
    """DeepSpeed ZeRO stage: 0 or 1."""
    deepspeed_version: str | None = Field(default=None, pattern=r"^\d+\.\d+(\.\d+)?([^\n]*)$")
    """DeepSpeed version the job will run with; default: the one installed where opskit runs (``opskit submit``)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def model_parallel_size(self) -> int:
        """GPUs of one model replica: TP * PP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """DP = GPUs / (TP * PP) (the spec checks that TP * PP divides the GPUs)."""
        return self.world_size // self.model_parallel_size


# Iterations a ramp-up or a curriculum may span, beyond which a value is a typo (tr1-13B's ramp-up: 312,500 at most;
# tr8b-104B's curriculum: 36,000): `opskit plan` replays both iteration by iteration.
MAX_ITERATIONS = 1 << 22


class BatchSpec(_Section):
    micro_batch_size: int = Field(**flags.bounds("micro_batch_size"))
    global_batch_size: int = Field(**flags.bounds("global_batch_size"))
    rampup_batch_size: tuple[int, int, int] | None = None
    """[start, increment, ramp-up samples], Megatron's --rampup-batch-size."""
    train_samples: int | None = Field(default=None, **flags.bounds("train_samples"))
    train_iters: int | None = Field(default=None, **flags.bounds("train_iters"))
    """``--train-iters``: the alternative to train_samples, without a batch ramp-up."""
    train_tokens: int | None = Field(default=None, **flags.bounds("train_tokens"))
    """``--train-tokens`` (curriculum learning, Megatron-DeepSpeed): stop after this many tokens."""

    @field_validator("rampup_batch_size", mode="before")
    @classmethod
    def _yaml_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # YAML has lists; strict mode wants the tuple

    @model_validator(mode="after")
    def _one_length(self) -> BatchSpec:
        if self.rampup_batch_size is not None:
            start, _, samples = self.rampup_batch_size
            # start <= 0: consistency.rampup_problems (the spec's rules)
            if start > 0 and samples // start > MAX_ITERATIONS:
                raise ValueError(f"rampup_batch_size {list(self.rampup_batch_size)}: {samples} ramp-up samples at a "
                                 f"start batch of {start} is up to {samples // start:,} iterations of ramp-up (more "
                                 f"than {MAX_ITERATIONS:,}: a typo?)")
        if problems := consistency.train_length_problems(self.train_samples, self.train_iters, self.rampup_batch_size,
                                                         _key_name):
            raise ValueError("; ".join(problems))
        return self

    @property
    def samples(self) -> int:
        """Samples of the whole run: train_samples, or train_iters * GBS (train_iters excludes a ramp-up)."""
        return self.train_samples if self.train_samples is not None else self.train_iters * self.global_batch_size


class OptimizerSpec(_Section):
    lr: float = Field(**flags.bounds("lr"))
    min_lr: float = Field(default=0.0, **flags.bounds("min_lr"))
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_warmup_samples: int = Field(default=0, **flags.bounds("lr_warmup_samples"))
    lr_decay_samples: int | None = Field(default=None, **flags.bounds("lr_decay_samples"))
    lr_decay_tokens: int | None = Field(default=None, **flags.bounds("lr_decay_tokens"))
    """``--lr-decay-tokens`` (Megatron-DeepSpeed, with curriculum learning): decay by consumed tokens."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = Field(default=0.01, **flags.bounds("weight_decay"))
    clip_grad: float = Field(default=1.0, **flags.bounds("clip_grad"))


class DataSpec(_Section):
    """Where the tokens come from: a corpus that ``opskit data prepare`` turns into a tokenizer and an indexed dataset
    (``corpus`` + ``dir``), or an indexed dataset prepared elsewhere (``data_path`` or the weighted split files) with
    its tokenizer. Paths prepared elsewhere are checked by ``opskit submit``, not when the spec is read; a relative
    one starts from the spec's base directory (``Spec.base_dir``), as ``dir`` and ``paths.output`` do."""

    corpus: str | list[str] | None = None
    """A named corpus (``kjv``) or a list of .txt/.jsonl files for ``opskit data prepare``."""
    dir: str | None = None
    """Folder that holds tokenizer.json and the indexed dataset (a relative path starts from the spec's base
    directory: see ``Spec.base_dir``)."""
    name: str = "corpus"
    """Dataset file stem: ``<dir>/<name>_text_document.bin/.idx``."""
    vocab_size: int = Field(gt=0)
    """Size of the tokenizer's vocabulary (the BPE that ``opskit data prepare`` trains, or the external one's)."""
    data_path: str | list[str] | None = None
    """``--data-path``: an indexed dataset prefix prepared elsewhere, or Megatron's ``weight prefix weight prefix``."""
    train_weighted_split_paths_path: str | None = None
    """``--train-weighted-split-paths-path`` (BigScience's catalogue blend, BLOOM-176B)."""
    valid_weighted_split_paths_path: str | None = None
    data_impl: Literal["mmap"] | None = None
    split: str | None = Field(default=None, pattern=r"^\d+(,\d+)*$")
    """``--split 949,50,1``: train/valid/test proportions of ``data_path``."""
    tokenizer_type: Literal["PretrainedFromHF", "GPT2BPETokenizer"] = "PretrainedFromHF"
    tokenizer_name_or_path: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None

    @property
    def prepared_by_opskit(self) -> bool:
        """True when ``opskit data prepare`` builds this data (a corpus), False for a dataset prepared elsewhere."""
        return self.corpus is not None

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        sources = [key for key in ("corpus", "data_path", "train_weighted_split_paths_path")
                   if getattr(self, key) is not None]
        if len(sources) != 1:
            raise ValueError(
                "set exactly one source: corpus (+ dir, built by `opskit data prepare`), data_path (a Megatron "
                "indexed dataset prefix) or train_weighted_split_paths_path" + (f"; got {', '.join(sources)}"
                                                                                if sources else ""))
        if self.corpus is not None:
            if self.dir is None:
                raise ValueError("corpus needs dir, the folder `opskit data prepare` writes the tokenizer and "
                                 "dataset to")
            extra = [k for k in ("tokenizer_name_or_path", "vocab_file", "merge_file") if getattr(self, k)]
            if extra or self.tokenizer_type != "PretrainedFromHF":
                raise ValueError(f"corpus brings its own tokenizer (opskit data prepare trains it): remove "
                                 f"{', '.join(extra) or 'tokenizer_type'}")
            return self
        problems = [*consistency.data_source_problems(self.data_path, self.train_weighted_split_paths_path,
                                                      self.valid_weighted_split_paths_path, _key_name),
                    *consistency.tokenizer_problems(self.tokenizer_type, self.tokenizer_name_or_path, self.vocab_file,
                                                    self.merge_file, _key_name)]
        if problems:
            raise ValueError("; ".join(problems))
        return self


class CheckpointSpec(_Section):
    """Checkpoints, evaluation, logging and the seed."""

    save_interval: int = Field(**flags.bounds("save_interval"))
    async_save: bool = flags.SPEC_DEFAULTS["checkpoint.async_save"]
    """Write checkpoints in the background (``--async-save``): training stands still only while the state is copied
    to host memory (which needs about the size of each rank's files in host RAM)."""
    log_interval: int = Field(default=100, **flags.bounds("log_interval"))
    eval_interval: int | None = Field(default=None, **flags.bounds("eval_interval"))
    eval_iters: int | None = Field(default=None, **flags.bounds("eval_iters"))
    tensorboard_queue_size: int | None = Field(default=None, **flags.bounds("tensorboard_queue_size"))
    seed: int = 1234


class SlurmSpec(_Section):
    """The SBATCH header. ``time`` is sbatch's format (minutes, MM:SS, HH:MM:SS, D-HH:MM:SS)."""

    job_name: str | None = Field(default=None, pattern=_ONE_LINE)
    """Defaults to the spec name."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    constraint: str | None = None
    cpus_per_task: int | None = Field(default=None, gt=0)
    hint: str | None = None
    """``--hint`` (BigScience: ``nomultithread``, physical cores only)."""
    gres: str | None = None
    time: str = "20:00:00"
    array: int = Field(default=1, gt=0)
    """Tasks in a chained array (--array=1-N%1)."""
    exit_margin_mins: float = Field(default=10, ge=0)
    """--exit-duration-in-mins = time limit minus this margin (BigScience: 1190 for 20 h)."""
    signal_margin_secs: int = Field(default=120, ge=0)
    """SLURM sends USR1 this long before the time limit (--signal=B:USR1@N)."""
    master_port: int = 6000
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment exported by the job script."""
    group: str | None = Field(default=None, pattern=_GROUP_NAME)
    """Unix group sharing the training (BigScience: six): ``opskit submit`` and ``cron`` look at its members' jobs."""
    max_failures: int = Field(default=3, gt=0)
    """Consecutive failed tasks (FAILED, NODE_FAIL or TIMEOUT in the run's ledger) after which the chain stops with an
    alert."""
    max_stalled_starts: int = Field(default=3, gt=0)
    """Task starts in a row that leave ``latest`` where the start before them left it (a restart storm: each start
    burns an allocation and saves nothing), after which the chain stops with the ``chain.restart_storm`` alert and its
    queued tasks are cancelled."""
    spare_nodes: int = Field(default=0, ge=0)
    """Nodes the job asks for beyond ``parallel.nodes``: a node blamed for a crash or a hang is swapped for one of them
    and training restarts inside the same allocation (opskit.allocation.in_job)."""
    in_job_restarts: int = Field(default=2, ge=0)
    """Training restarts inside one job after a crash or a hang, before the chain's next task takes over."""
    preflight: bool = True
    """Check the allocation's nodes at each task's start, before training (``opskit preflight``: GPUs, a timed GEMM,
    free disk, Xid lines, all-reduces) and keep the failing ones out, a spare taking their place."""
    preflight_margin: float = Field(default=PREFLIGHT_MARGIN, gt=0, lt=1)
    """A node whose GEMM is slower than the nodes' median by more than this share, measured twice, is kept out
    (``opskit preflight --margin``)."""
    cron_partition: str | None = Field(default=None, pattern=_ONE_LINE)
    """CPU partition of ``opskit cron install``'s self-resubmitting SLURM job (Jean Zay: compil)."""
    cron_account: str | None = Field(default=None, pattern=_ONE_LINE)
    """Account of that job (Jean Zay: six@cpu); default: ``account``."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:  # rendered unquoted as `export NAME=...`: anything but an identifier would run as code
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return value

    @field_validator("time", mode="before")
    @classmethod
    def _time_parses(cls, value: str | int) -> str:
        value = str(value)  # `time: 90` (minutes) arrives as an int
        parse_slurm_time(value)  # UNLIMITED has no exit duration: refuse at load time, not at submit
        return value

    @model_validator(mode="after")
    def _exit_before_the_limit(self) -> SlurmSpec:
        limit = self.time_minutes
        exit_after = limit - self.exit_margin_mins
        if exit_after >= limit:
            raise ValueError(f"exit_margin_mins {self.exit_margin_mins:g}: --exit-duration-in-mins {exit_after:g} is "
                             f"not below the time limit {self.time} ({limit:g} min), so SLURM kills the job before "
                             "it saves; set a margin of one iteration plus one checkpoint save (BigScience: 10)")
        if exit_after <= 0:
            raise ValueError(f"exit_margin_mins {self.exit_margin_mins:g} leaves no training time within the time "
                             f"limit {self.time} ({limit:g} min): use a smaller margin or a longer time")
        return self

    @property
    def time_minutes(self) -> float:
        """The time limit in minutes, parsed from sbatch's formats."""
        return parse_slurm_time(self.time)


class PathsSpec(_Section):
    output: str
    """Run directory (checkpoints/, tensorboard/, logs/main_log.txt, slurm/). A relative path starts from the spec's
    base directory, not the current one: the project directory holding ``trainings/`` for a spec there, the file's
    folder for another file, the current directory for a bundled preset (``Spec.base_dir``)."""
    hub_repos: dict[str, str] = Field(default_factory=dict)
    """Hugging Face Hub repositories the run publishes to, by kind (``logs: bigscience/tr11-176B-ml-logs``)."""

    @field_validator("output")
    @classmethod
    def _output_is_a_folder_of_its_own(cls, value: str) -> str:
        # "" and "." are the base directory itself, "/" the root: opskit writes its run files (kill-switch, slurm/,
        # checkpoints/) into the folder, so it must be one that holds nothing else.
        if not value.strip() or os.path.normpath(value) in (".", "/", "//"):
            raise ValueError(f"{value!r} is not a run directory of its own; name one, e.g. runs/<name>")
        return value


class SyncSpec(_Section):
    """Where ``opskit sync`` (and the hourly cron job) publishes logs, TensorBoard events and CodeCarbon CSVs."""

    targets: list[str] = Field(default_factory=list)
    """``hf://[datasets/]org/repo[/path]``, ``gs://bucket/prefix`` or ``file:///path``; each gets every kind."""
    workers: int = Field(default=8, ge=1, le=64)
    """Parallel transfers (gs://, file://)."""
    create_repo: bool = False
    """hf://: create the repository when it does not exist (``private`` or public)."""
    private: bool = True

    @field_validator("targets")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            try:
                check_url(url, "target")
            except TargetError as e:
                raise ValueError(str(e)) from None
        return urls


class EmailSpec(_Section):
    """Alert e-mail over SMTP; every key can come from the environment instead (``OPSKIT_SMTP_HOST``, ...)."""

    to: list[str] = Field(default_factory=list)
    sender: str = "opskit@localhost"
    host: str = "localhost"
    port: int | None = Field(default=None, gt=0, lt=65536)
    """Default: 465 with ``security: ssl``, 587 with ``starttls``, else 25."""
    security: Literal["none", "starttls", "ssl"] = "none"
    user: str | None = None
    password_env: str = Field(default="OPSKIT_SMTP_PASSWORD", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding the password (never the password itself: specs are shared)."""


class AlertsSpec(_Section):
    """Where ``opskit status NAME --alert`` sends alerts, and how often it repeats one."""

    email: EmailSpec = EmailSpec()
    webhook: str | None = Field(default=None, pattern=r"^https?://\S+$")
    """A URL that takes a Slack-compatible JSON POST (``{"text": ...}``)."""
    command: str | None = Field(default=None, pattern=_ONE_LINE)
    """A shell command run with the message on stdin and ``OPSKIT_ALERT_SUBJECT`` in its environment."""
    resend_hours: float = Field(default=6, gt=0)
    """The same alert is sent again only after this long (BigScience re-sent it every hour)."""
    runbook: list[str] = Field(default_factory=list)
    """Links for the message body (on-call guide, log viewer, how to relaunch)."""
    log_lines: int = Field(default=20, ge=0)
    """Last lines of main_log.txt quoted in the message."""


class DivergenceSpec(_Section):
    """What training does about a loss or grad-norm spike that does not come back (docs/reliability.md, issue 48).
    The spike rule is the watchdog's (``spike_window``, ``spike_threshold``)."""

    action: Literal["alert", "rollback"] = "rollback"
    """``rollback``: the trainer stops without saving, the job replays from the last complete step before the spike;
    a spike that comes back is rolled back to that step and its data skipped, one that does not was the machine's (a
    strike for the node) and training goes on with the data kept. ``alert``: a warning line, training goes on, the
    watchdog alerts. Rollback by default: a diverging run otherwise burns the night's GPU hours for nothing, the
    replay skips data only when the spike is reproducible, and ``max_rollbacks`` bounds it."""
    patience: int = Field(default=50, ge=1)
    """Iterations a spike may take to come back inside the band before it is acted on (NaN/Inf: at once). tr11's
    spike at 31216 came back in 35."""
    skip_after: int = Field(default=0, ge=0)
    """Iterations skipped past the spike's last flagged one (the skip starts right after the rollback step)."""
    digest_interval: int = Field(default=100, ge=0)
    """Every this many iterations, and before every save, the data-parallel replicas compare digests of their
    parameters (silent data corruption: Llama 3 counted 6 in 54 days); one that differs has its node kept out and the
    run resumes from the last step they agreed at. 0: never."""
    max_rollbacks: int = Field(default=3, ge=0)
    rollback_hours: float = Field(default=24, gt=0)
    """At most ``max_rollbacks`` rollbacks in ``rollback_hours``; the next spike holds the chain and asks a person
    (tr8-104B's case: change the LR, not skip more data)."""


class WatchdogSpec(_Section):
    """Thresholds of ``opskit status`` (docs/operations.md says what each finding means)."""

    append_to_main_log: bool = False
    """Append the PULSE / ALERT lines to main_log.txt, as BigScience's hourly job did (the public log shows gaps)."""
    max_pending_hours: float | None = Field(default=24, ge=0)
    """Alert when nothing has run for this long while jobs are pending (null: never)."""
    exclusive_reservation: bool = False
    """The nodes are reserved for this training: any wait (beyond a chain hand-over) is an alert."""
    queue_horizon_hours: float = Field(default=24, ge=0)
    """Warn when the last queued task would end within this many hours (submit more tasks)."""
    hang_factor: float = Field(default=10, gt=1)
    """Alert when no iteration line came for this many times the usual time between two of them, while running."""
    hang_min_minutes: float = Field(default=30, ge=0, le=10**6)
    """...and never before this many minutes (start-up, checkpoint loading, evaluation). Half of it is the trainer's
    ``--stack-dump-after-mins`` (which takes at most 10^6)."""
    in_job_timeout_mins: float | None = Field(default=None, gt=0, le=10**6)
    """The in-job watchdog: a rank with no heartbeat for this long (and for ``hang_factor`` times its usual time
    between iterations) is hung, and the job restarts training without it; null: ``hang_min_minutes / 2``, when the
    trainer's own stack dump fires. It must exceed a save's blocking time (``opskit submit`` checks the run's log)."""
    cancel_hung: bool = False
    """``scancel`` the running task when its hang is found, so the chain moves on (it resumes from the last save)."""
    straggler_ratio: float = Field(default=1.2, gt=1)
    """A rank whose forward passes take this many times the median of its pipeline stage's other ranks', in 3 log
    intervals in a row, is named a straggler (``log.straggler``; opskit.rules.stragglers)."""
    exclude_stragglers: bool = False
    """Put a straggler's node on the run's bad-node list, so the next submission and restart run without it."""
    spike_window: int = Field(default=100, ge=5)
    spike_threshold: float = Field(default=6.0, gt=0)
    """Robust z-score above which an lm loss / grad norm value is a spike (opskit.rules.spike_rule): the watchdog's
    and the trainer's divergence check."""
    divergence: DivergenceSpec = DivergenceSpec()
    throughput_drop: float = Field(default=0.5, gt=0, lt=1)
    """Warn when recent samples/s fall below this fraction of the median before them."""
    checkpoint_age_factor: float = Field(default=2, gt=1)
    """Warn when the newest checkpoint is older than this many save intervals (at the logged s/it) while running."""
    disk_warn_percent: float = Field(default=85, gt=0, le=100)
    disk_alert_percent: float = Field(default=95, gt=0, le=100)
    """Bytes and inodes used on the run directory's file system (BigScience's fs-watchdog alerted at 85%)."""
    alerts: AlertsSpec = AlertsSpec()

    def hang_limit_s(self, interval_s: float) -> float:
        """Seconds without an iteration line that make a hang, for lines usually ``interval_s`` apart: the
        watchdog's alert and the goodput account's hangs."""
        return max(self.hang_factor * interval_s, self.hang_min_minutes * 60)

    @property
    def in_job_timeout_s(self) -> float:
        """The in-job watchdog's floor in seconds (``in_job_timeout_mins``, else ``hang_min_minutes / 2``, at least
        10 s: one missed poll of the heartbeat files must not call a rank hung)."""
        minutes = self.in_job_timeout_mins or self.hang_min_minutes / 2
        return max(minutes * 60, 10.0)

    @model_validator(mode="after")
    def _warn_below_alert(self) -> WatchdogSpec:
        if self.disk_warn_percent > self.disk_alert_percent:
            raise ValueError(f"disk_warn_percent {self.disk_warn_percent:g} is above disk_alert_percent "
                             f"{self.disk_alert_percent:g}: the warning must come first")
        return self


class CurriculumSpec(_Section):
    """DeepSpeed's sequence-length curriculum (Li et al. 2021, arXiv:2108.06084), rendered as the DeepSpeed JSON's
    ``curriculum_learning`` block (``schedule_config`` flattened into this section)."""

    curriculum_type: Literal["seqlen"] = "seqlen"
    min_difficulty: int = Field(gt=0)
    """Starting sequence length; a multiple of 8 (Tensor Cores). 64 recommended for large models."""
    max_difficulty: int | None = Field(default=None, gt=0)
    """Final sequence length; defaults to model.seq_length ("always", DeepSpeed's guide)."""
    schedule_type: Literal["fixed_linear", "fixed_root"] = "fixed_linear"
    total_curriculum_step: int = Field(gt=0, le=MAX_ITERATIONS)
    """Steps from min to max difficulty; ~ train_tokens / GBS / seq_length / 2 (DeepSpeed's recommendation)."""
    difficulty_step: int = Field(default=8, gt=0)
    root_degree: int | None = Field(default=None, gt=0)
    """fixed_root only: 2 = square root."""

    @model_validator(mode="after")
    def _root_degree(self) -> CurriculumSpec:
        if (self.schedule_type == "fixed_root") != (self.root_degree is not None):
            raise ValueError("root_degree is required with schedule_type fixed_root, and only there")
        return self


FlagScalar = bool | int | float | str
FlagValue = FlagScalar | list[int | float | str] | None

# DeepSpeed JSON keys a spec section owns, besides those the flags fill (flags.DEEPSPEED_KEYS).
_SECTION_DS_KEYS = {("curriculum_learning",): "the curriculum_learning section"}


class Spec(_Section):
    """A whole training. Built by :func:`load_spec`; fields mirror Megatron-DeepSpeed flags."""

    name: str = Field(pattern=_ONE_LINE)
    description: str = ""
    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()
    batch: BatchSpec
    optimizer: OptimizerSpec
    data: DataSpec
    checkpoint: CheckpointSpec
    slurm: SlurmSpec = SlurmSpec()
    paths: PathsSpec
    sync: SyncSpec = SyncSpec()
    curriculum_learning: CurriculumSpec | None = None
    watchdog: WatchdogSpec = WatchdogSpec()
    megatron_args: dict[str, FlagValue] = Field(default_factory=dict)
    """The trainer's flags no section models (``opskit.rules.flags``: a flag the trainer does not define, one a
    section or opskit sets, or a value its type or choices refuse is an error here): ``key_name: value`` ->
    ``--key-name value``; ``true`` -> a bare switch, ``false``/``null`` -> left out, a list -> several values."""
    deepspeed_config: dict[str, Any] = Field(default_factory=dict)
    """Extra keys deep-merged into the rendered DeepSpeed JSON (e.g. ``zero_allow_untested_optimizer: true``)."""
    _file: Path | None = PrivateAttr(default=None)
    """The YAML file :func:`load_spec` read."""
    _variant: str | None = PrivateAttr(default=None)
    _unsettled: _Unsettled | None = PrivateAttr(default=None)
    """What a :meth:`with_placeholders` copy recorded instead of raising; None for a plain spec."""

    @field_validator("megatron_args")
    @classmethod
    def _verbatim_flags(cls, value: dict[str, FlagValue]) -> dict[str, FlagValue]:
        for key, flag_value in value.items():
            if not _FLAG_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not the snake_case of a flag (write log_timers_to_tensorboard "
                                 "for --log-timers-to-tensorboard)")
            if problem := flags.flag_problem(key, flag_value):
                raise ValueError(f"{key}: {problem}")
        return value

    @field_validator("deepspeed_config")
    @classmethod
    def _extra_ds_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        owners = {path: flags.FLAGS[dest].owner for path, dest in flags.DEEPSPEED_KEYS.items()} | _SECTION_DS_KEYS
        for path, owner in owners.items():
            node: Any = value
            for part in path:
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                raise ValueError(f"{'.'.join(path)} comes from {owner}; set it there")
        return value

    @model_validator(mode="after")
    def _cluster_rules(self) -> Spec:
        p, b = self.parallel, self.batch
        if world := consistency.world_size_problems(p.world_size, p.tensor_model_parallel_size,
                                                    p.pipeline_model_parallel_size, _field_name,
                                                    f" ({p.nodes} nodes x {p.gpus_per_node})"):
            sizes = consistency.batch_sizes_of(b.global_batch_size, b.rampup_batch_size)
            nodes = valid_node_counts(p.gpus_per_node, p.tensor_model_parallel_size,
                                      p.pipeline_model_parallel_size, b.micro_batch_size, sizes)
            fix = f"valid parallel.nodes for this layout: {listed(nodes)}" if nodes else "change TP or PP"
            raise ValueError(f"parallel: {world[0]}; {fix}")
        problems = [*self._layout_problems(), *self._batch_problems(), *self._curriculum_problems(),
                    *consistency.training_flag_problems({**self.megatron_args, "split": self.data.split}, _field_name),
                    *consistency.client_optimizer_problems(bool(self.megatron_args.get("use_bnb_optimizer")),
                                                           p.zero_stage,
                                                           self.deepspeed_config.get("zero_allow_untested_optimizer"),
                                                           _field_name)]
        version = self.parallel.deepspeed_version
        if version and (problem := deepspeed_resume_problem(self, version)):
            problems.append(f"parallel.deepspeed_version {version}: {problem}")
        if (gpus := _gres_gpus(self.slurm.gres)) is not None and gpus != self.parallel.gpus_per_node:
            problems.append(f"slurm.gres {self.slurm.gres} asks for {gpus} GPUs per node but parallel.gpus_per_node "
                            f"is {self.parallel.gpus_per_node}: make them equal")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _layout_problems(self) -> list[str]:
        m, p = self.model, self.parallel
        tp = p.tensor_model_parallel_size
        return [*consistency.tensor_parallel_problems(m.num_attention_heads, m.ffn_size, tp, _field_name),
                *consistency.recompute_problems(m.checkpoint_activations, m.recompute_granularity,
                                                bool(self.megatron_args.get("torch_compile")), _field_name),
                *consistency.sequence_parallel_problems(p.sequence_parallel, m.seq_length, tp, _field_name),
                *consistency.partition_method_problems(p.pp_partition_method, _field_name),
                *consistency.pipeline_problems(m.num_layers, p.pipeline_model_parallel_size, p.pp_partition_method,
                                               _field_name),
                *consistency.pad_vocab_problems(m.pad_vocab_size_to, m.make_vocab_size_divisible_by, tp,
                                                self.data.vocab_size, _field_name)]

    def _batch_problems(self) -> list[str]:
        b, p = self.batch, self.parallel
        return consistency.rampup_problems(b.global_batch_size, b.rampup_batch_size, _field_name) or \
            consistency.batch_problems(b.global_batch_size, b.rampup_batch_size, b.micro_batch_size, p.nodes,
                                       p.gpus_per_node, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                       _field_name)

    def _curriculum_problems(self) -> list[str]:
        cl = self.curriculum_learning
        if cl is None:
            return []
        return consistency.curriculum_problems(cl.min_difficulty, self.curriculum_max_difficulty, cl.difficulty_step,
                                               self.model.seq_length, _field_name)

    @property
    def curriculum_max_difficulty(self) -> int:
        """The curriculum's final sequence length (its max_difficulty, default model.seq_length)."""
        assert self.curriculum_learning is not None
        return self.curriculum_learning.max_difficulty or self.model.seq_length

    @property
    def variant(self) -> str | None:
        """The variant of the spec file this spec was built with (``cl`` for ``tr8b-104B:cl``), or None."""
        return self._variant

    @property
    def file(self) -> Path | None:
        """The YAML file the spec was read from."""
        return self._file

    @property
    def job_name(self) -> str:
        return self.slurm.job_name or self.name.replace(":", "-")

    @property
    def cli_name(self) -> str:
        """What to pass to other opskit commands for this spec: its name where that finds the same file (a preset,
        ``trainings/``), else its path (with ``:variant`` where there is one)."""
        suffix = f":{self._variant}" if self._variant else ""
        if self._file is None:
            return self.name
        base = self.name[: -len(suffix)] if suffix and self.name.endswith(suffix) else self.name
        try:
            if find_spec(base).resolve() == self._file.resolve():
                return base + suffix
        except SpecError:
            pass
        return str(self._file) + suffix

    @property
    def exit_duration_in_mins(self) -> float:
        """Time limit minus the margin, so the job saves before SLURM kills it (validated to be in (0, limit))."""
        return self.slurm.time_minutes - self.slurm.exit_margin_mins

    @property
    def base_dir(self) -> Path:
        """The folder relative paths of this spec (``paths.output``, ``data.dir``, ``data.corpus`` files) start from,
        absolute: for a file in a ``trainings/`` folder the project directory holding that folder (BigScience's
        layout: ``<project>/trainings/NAME.yaml``, runs under ``<project>/runs/NAME``), whatever the current
        directory; for another YAML file its own folder; for a bundled preset (or a spec built in memory) the current
        directory."""
        if self._file is None or self._file.resolve().parent == preset_dir().resolve():
            return Path.cwd()
        folder = self._file.resolve().parent
        return folder.parent if folder.name == USER_SPEC_DIR.name else folder

    def local_path(self, value: str, field: str, environ: Mapping[str, str] | None = None) -> Path:
        """A path field of the spec, ``$VAR`` expanded and made absolute from :attr:`base_dir`; in a
        :meth:`with_placeholders` copy a path that starts with an unset variable stays as written
        (``$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml``), relative: the user's variable, not our base directory.

        Raises:
            SpecError: an unset ``$VAR`` (see :meth:`expand`).
        """
        expanded = self.expand(value, field, environ)
        if self._unsettled is not None and (start := ENV_VAR.match(expanded)) and \
                var_of(start) in self._unsettled.unset:
            return Path(expanded)
        return (self.base_dir / Path(expanded).expanduser()).resolve()

    def expand(self, value: str, field: str, environ: Mapping[str, str] | None = None) -> str:
        """``value`` with ``$VAR`` / ``${VAR}`` replaced from ``environ`` (default: ``os.environ``); in a
        :meth:`with_placeholders` copy an unset or empty one stays as written and is recorded with ``field``.

        Raises:
            SpecError: naming the file, ``field`` and the variable when it is not set or set but empty (not in a
                :meth:`with_placeholders` copy): ``$six_ALL_CCFRSCRATCH/checkpoints`` must never become
                ``/checkpoints``.
        """
        env = os.environ if environ is None else environ

        def substitute(match: re.Match) -> str:
            var = var_of(match)
            if has_value(env, var):
                return env[var]
            state = "not set" if var not in env else "set but empty"
            if self._unsettled is None:
                raise SpecError(f"{self._file or self.name}: {field}: ${var} is {state} in this environment; export "
                                "it (as on the cluster's login node) or write the path out")
            self._unsettled.unset.setdefault(var, {})[field] = None
            if var in env:
                self._unsettled.empty.add(var)
            return match.group(0)

        return ENV_VAR.sub(substitute, value)

    def with_placeholders(self) -> Spec:
        """A copy that renders whatever this environment lacks: an unset ``$VAR`` stays literal in every value
        (:meth:`expand`, :meth:`local_path`) and a path refused by :meth:`refuse` is kept, both recorded for
        :attr:`problems` instead of raised; what checks a real path asks :meth:`unsettled` first. ``opskit submit``
        renders with it, so a dry run always shows the script and a real one lists every problem at once."""
        copy = self.model_copy()
        copy._unsettled = _Unsettled()
        return copy

    def refuse(self, field: str, message: str) -> None:
        """A path of ``field`` that cannot be used here (a file where a folder must be): raise it, or record it in a
        :meth:`with_placeholders` copy.

        Raises:
            SpecError: ``message``, unless this is a :meth:`with_placeholders` copy.
        """
        if self._unsettled is None:
            raise SpecError(message)
        self._unsettled.refused.setdefault(field, message)

    def unsettled(self, field: str) -> bool:
        """Whether ``field``'s value could not be settled here (an unset ``$VAR``, a refused path): checks of the
        real path behind it are skipped, the recorded problem already says why. False for a plain spec."""
        if self._unsettled is None:
            return False
        return field in self._unsettled.refused or any(field in fields for fields in self._unsettled.unset.values())

    @property
    def problems(self) -> list[str]:
        """What a :meth:`with_placeholders` copy met so far: each unset variable once, with the fields that use it
        and the fix, then each refused path; empty for a plain spec."""
        if self._unsettled is None:
            return []
        preset = self._file is None or self._file.resolve().parent == preset_dir().resolve()
        problems = []
        for var, fields in self._unsettled.unset.items():
            where = (f"or write it into your copy: opskit specs new mine --from {self.cli_name} --set {var}=/path"
                     if preset else f"or write the value into {self._file}")
            state = "set but empty" if var in self._unsettled.empty else "not set"
            problems.append(f"${var} is {state} here (used by {', '.join(fields)}): export it as on the cluster's "
                            f"login node, {where}")
        return problems + list(self._unsettled.refused.values())


@dataclass
class _Unsettled:
    """What a :meth:`Spec.with_placeholders` copy met: unset (or empty) variable -> fields using it (in order of use),
    the empty ones among them, and field -> why its path was refused."""

    unset: dict[str, dict[str, None]] = dataclasses.field(default_factory=dict)
    empty: set[str] = dataclasses.field(default_factory=set)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)


_MISSING = object()


def _gres_gpus(gres: str | None) -> int | None:
    """GPUs per node in an sbatch ``--gres`` value (``gpu:4``, ``gpu:a100:8``), None when it names no GPU count."""
    if not gres:
        return None
    match = re.fullmatch(r"gpu(?::[^:,]+)?:(\d+)", gres.strip())
    return int(match.group(1)) if match else None


def _key_name(key: str, value: Any = None) -> str:
    """The :data:`opskit.rules.consistency.Namer` inside one section (pydantic prefixes the section):
    ``hidden_size 128``."""
    return key if value is None else f"{key} {value}"


def _field_name(key: str, value: Any = None) -> str:
    """The :data:`opskit.rules.consistency.Namer` of a whole spec: the field's path,
    ``model.num_attention_heads 12``."""
    sections = (("model", ModelSpec), ("parallel", ParallelSpec), ("batch", BatchSpec), ("optimizer", OptimizerSpec),
                ("data", DataSpec), ("curriculum_learning", CurriculumSpec))
    path = next((f"{section}.{key}" for section, model in sections if key in model.model_fields),
                f"megatron_args.{key}")
    return _key_name(path, value)


def deepspeed_resume_problem(spec: Spec, version: str | None = None) -> str | None:
    """Why this DeepSpeed version cannot resume (or clips wrongly) the spec's precision / ZeRO stage / PP, or None;
    one line naming the spec fields (:func:`opskit.rules.deepspeed.deepspeed_version_problem`). ``version``
    defaults to the one the job runs: ``parallel.deepspeed_version``, else the installed DeepSpeed (None when
    neither is known)."""
    version = version or spec.parallel.deepspeed_version or installed_deepspeed_version()
    if not version:
        return None
    problem = deepspeed_version_problem(spec.model.precision, spec.parallel.zero_stage,
                                        spec.parallel.pipeline_model_parallel_size, spec.optimizer.clip_grad, version,
                                        _field_name)
    return problem.message if problem else None


def padded_vocab_size(vocab_size: int, model: ModelSpec, tp: int) -> int:
    """The model's padded vocabulary (:func:`opskit.rules.model_size.padded_vocab_size`; the spec checked
    ``pad_vocab_size_to`` already)."""
    return _padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by, tp, model.pad_vocab_size_to)
