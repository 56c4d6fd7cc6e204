"""Training specs: one YAML file describes a whole training (model, parallelism, batch, optimizer, data,
checkpoints, SLURM header, paths), validated with pydantic.

Keys are the snake_case of Megatron-DeepSpeed's flags (``global_batch_size`` <-> ``--global-batch-size``) and of
sbatch's options (``cpus_per_task`` <-> ``--cpus-per-task``), so one name can be grepped from YAML to script to log
to checkpoint.

A spec is found by path, by exact name, or by a unique name prefix (``tr11`` -> ``tr11-176B-ml``); the project's own
``trainings/`` folder is searched before the bundled presets in ``opskit/presets/``.
"""

from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

USER_SPEC_DIR = Path("trainings")
# Names end up in the job script's comment and #SBATCH lines: a newline there would start a line of shell code.
_ONE_LINE = r"^[^\x00-\x1f\x7f]+$"


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1 without base-60 integers: ``time: 20:00:00`` stays the string sbatch expects, not 72000."""


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)


class SpecError(ValueError):
    """A spec that cannot be found, read or validated; the message is one line naming the file and field."""


class _Section(BaseModel):
    # Unknown keys are typos: reject them and let pydantic list the valid ones.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Section):
    """Architecture (Megatron-DeepSpeed GPT: GPT-2 style or BLOOM style)."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    ffn_hidden_size: int | None = Field(default=None, gt=0)
    """Defaults to 4 * hidden_size, as in Megatron."""
    seq_length: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    position_embedding_type: Literal["absolute", "alibi"] = "absolute"
    embed_layernorm: bool = False
    """LayerNorm right after the word embedding (BLOOM)."""
    pad_vocab_size_to: int | None = Field(default=None, gt=0)
    make_vocab_size_divisible_by: int = Field(default=128, gt=0)
    init_method_std: float = Field(default=0.02, gt=0)
    hidden_dropout: float = Field(default=0.1, ge=0, lt=1)
    attention_dropout: float = Field(default=0.1, ge=0, lt=1)
    precision: Literal["fp32", "fp16", "bf16"] = "bf16"

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"seq_length {self.seq_length} exceeds max_position_embeddings {self.max_position_embeddings}"
            )
        return self


class ParallelSpec(_Section):
    """Layout over the job's nodes: TP x PP model replicas, the rest is data parallel."""

    nodes: int = Field(default=1, gt=0)
    gpus_per_node: int = Field(default=1, gt=0)
    """Processes per node (GPUs on a cluster, CPU processes locally)."""
    tensor_model_parallel_size: int = Field(default=1, gt=0)
    pipeline_model_parallel_size: int = Field(default=1, gt=0)
    zero_stage: Literal[0, 1] = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """DP = GPUs / (TP * PP)."""
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @model_validator(mode="after")
    def _model_parallel_divides_world(self) -> ParallelSpec:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % mp:
            raise ValueError(f"{self.world_size} processes are not divisible by TP*PP = {mp}")
        return self


class BatchSpec(_Section):
    micro_batch_size: int = Field(gt=0)
    global_batch_size: int = Field(gt=0)
    rampup_batch_size: tuple[int, int, int] | None = None
    """[start, increment, ramp-up samples], Megatron's --rampup-batch-size."""
    train_samples: int = Field(gt=0)


class OptimizerSpec(_Section):
    lr: float = Field(gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    lr_warmup_samples: int = Field(default=0, ge=0)
    lr_decay_samples: int | None = Field(default=None, gt=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = Field(default=0.01, ge=0)
    clip_grad: float = Field(default=1.0, ge=0)


class DataSpec(_Section):
    corpus: str | list[str]
    """A named corpus (``kjv``) or a list of .txt/.jsonl files for ``opskit data prepare``."""
    dir: str
    """Folder that holds tokenizer.json and the indexed dataset (relative paths: to the current directory)."""
    name: str = "corpus"
    """Dataset file stem: ``<dir>/<name>_text_document.bin/.idx``."""
    vocab_size: int = Field(gt=0)
    """Size of the BPE tokenizer that ``opskit data prepare`` trains."""


class CheckpointSpec(_Section):
    save_interval: int = Field(gt=0)
    log_interval: int = Field(default=1, gt=0)
    seed: int = 42


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

    @property
    def time_minutes(self) -> float:
        """The time limit in minutes, parsed from sbatch's formats."""
        return parse_slurm_time(self.time)


class PathsSpec(_Section):
    output: str
    """Run directory (checkpoints/, tensorboard/, logs/main_log.txt, slurm/); relative to the current directory."""


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
    _file: Path | None = PrivateAttr(default=None)
    """The YAML file :func:`load_spec` read."""

    @model_validator(mode="after")
    def _batch_fits_layout(self) -> Spec:
        mbs_dp = self.batch.micro_batch_size * self.parallel.data_parallel_size
        for what, gbs in [("global_batch_size", self.batch.global_batch_size), *self._rampup_sizes()]:
            if gbs % mbs_dp:
                raise ValueError(
                    f"batch.{what} {gbs} is not divisible by micro_batch_size*DP = {mbs_dp}"
                )
        return self

    def _rampup_sizes(self) -> list[tuple[str, int]]:
        if self.batch.rampup_batch_size is None:
            return []
        start, incr, _ = self.batch.rampup_batch_size
        if incr <= 0 or (self.batch.global_batch_size - start) % incr:
            raise ValueError(
                f"batch.rampup_batch_size: global_batch_size - start = {self.batch.global_batch_size - start} "
                f"must be a positive multiple of the increment {incr}"
            )
        return [("rampup_batch_size start", start), ("rampup_batch_size increment", incr)]

    @property
    def job_name(self) -> str:
        return self.slurm.job_name or self.name

    @property
    def cli_name(self) -> str:
        """What to pass to other opskit commands for this spec: its name where that finds the same file (a preset,
        ``trainings/``), else its path."""
        if self._file is None:
            return self.name
        try:
            if find_spec(self.name).resolve() == self._file.resolve():
                return self.name
        except SpecError:
            pass
        return str(self._file)

    @property
    def exit_duration_in_mins(self) -> float:
        """Time limit minus the margin, so the job saves before SLURM kills it."""
        return max(self.slurm.time_minutes - self.slurm.exit_margin_mins, 0.5)


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


def padded_vocab_size(vocab_size: int, model: ModelSpec, tp: int) -> int:
    """Megatron's vocab padding: ``--pad-vocab-size-to`` or the next multiple of make_vocab_size_divisible_by * TP."""
    if model.pad_vocab_size_to is not None:
        return model.pad_vocab_size_to
    multiple = model.make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def preset_names() -> list[str]:
    """Names of the bundled presets."""
    files = resources.files("opskit.presets").iterdir()
    return sorted(p.name[: -len(".yaml")] for p in files if p.name.endswith(".yaml"))


def _candidates() -> dict[str, Path]:
    """Spec name -> file; the user's ``trainings/`` folder shadows bundled presets of the same name."""
    found = {name: Path(str(resources.files("opskit.presets") / f"{name}.yaml")) for name in preset_names()}
    if USER_SPEC_DIR.is_dir():
        found.update({p.stem: p for p in sorted(USER_SPEC_DIR.glob("*.yaml"))})
    return found


def find_spec(name_or_path: str) -> Path:
    """Resolve a spec argument to its YAML file.

    Raises:
        SpecError: when nothing or more than one spec matches.
    """
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.is_file():  # a folder named like a spec (logs, runs) is no spec
        if not path.is_file():
            raise SpecError(f"{name_or_path}: no such spec file")
        return path
    candidates = _candidates()
    if name_or_path in candidates:
        return candidates[name_or_path]
    matches = [n for n in candidates if n.startswith(name_or_path)]
    if len(matches) == 1:
        return candidates[matches[0]]
    if matches:
        raise SpecError(f"spec {name_or_path!r} is ambiguous: {', '.join(sorted(matches))}")
    raise SpecError(f"no spec named {name_or_path!r}; known: {', '.join(sorted(candidates))}")


def load_spec(name_or_path: str) -> Spec:
    """Find, read and validate a spec.

    Raises:
        SpecError: one line naming the file and every invalid field with what was expected.
    """
    path = find_spec(name_or_path)
    try:
        raw = yaml.load(path.read_text(), Loader=_SpecLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of sections (model, batch, ...), got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"{path}: {_describe(e)}") from None
    spec._file = path
    return spec


def _describe(error: ValidationError) -> str:
    """Every pydantic error as `field.path: message`, joined on one line."""
    parts = []
    for err in error.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = f"unknown key (expected one of: {', '.join(_section_keys(err['loc'][:-1]))})"
        parts.append(f"{field}: {message}")
    return "; ".join(parts)


def _section_keys(loc: tuple) -> list[str]:
    """The valid keys of the section at `loc` (a pydantic error location), for 'unknown key' messages."""
    model: type[BaseModel] = Spec
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
