"""Spec -> trainer flags, DeepSpeed config and the SLURM job script (``opskit/slurm/templates/train.slurm``, which
the repository's ``slurm_templates/`` links to), as pure functions.

Every value that reaches the shell goes through ``shlex.quote``, so job names and paths with spaces, quotes or ``$()``
stay literal; the ``#SBATCH`` header too, since sbatch splits its lines on whitespace with the shell's quoting rules.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jinja2

from opskit.allocation.divergence import Bounds
from opskit.allocation.in_job import Limits
from opskit.allocation.job import JobConfig, job_flags
from opskit.rules import flags
from opskit.rules.deepspeed import deepspeed_config as rules_deepspeed_config
from opskit.rules.formats import parse_data_path
from opskit.rules.schedule import BatchRampup
from opskit.run.chain import job_comment
from opskit.run.paths import RunPaths, data_paths
from opskit.spec.load import deep_merge
from opskit.spec.schema import Spec


def trainer_args(spec: Spec, run: RunPaths, environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``python -m opskit.train`` flags for a spec, walking the trainer's flag table (``opskit.rules.flags``) in
    its order: a flag with a spec field takes the field's value (``model.num_layers`` -> ``--num-layers``), the data
    flags come from :func:`data_flags`, the derived ones from the run directory (``run``), the time limit and the
    precision, every other flag from ``megatron_args``. A value None (or a switch that is off) leaves the flag out.

    Args:
        environ: where ``$VAR`` values come from (default ``os.environ``).

    Raises:
        SpecError: a ``$VAR`` in a path or flag value that is not set in this environment.
    """
    values = {**_derived_flags(spec, run), **data_flags(spec, environ)}
    for key, value in spec.megatron_args.items():
        values[key] = _expanded(spec, value, f"megatron_args.{key}", environ)
    args: list[str] = []
    for key, flag in flags.FLAGS.items():
        value = values.get(key) if flag.section in (None, "data") else getattr(getattr(spec, flag.section), key)
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag.option)
        elif isinstance(value, (tuple, list)):
            args += [flag.option, *(str(v) for v in value)]
        else:  # `--adam-eps=-1e-05`: argparse would read a separate `-1e-05` as an unknown option
            args += [f"{flag.option}={value}"] if str(value).startswith("-") else [flag.option, str(value)]
    return args


def _derived_flags(spec: Spec, run: RunPaths) -> dict[str, object]:
    """The flags opskit derives (``Flag.derived``): the run directory's paths, the exit duration, the precision."""
    return {
        "fp16": spec.model.precision == "fp16", "bf16": spec.model.precision == "bf16", "deepspeed": True,
        "deepspeed_config": run.ds_config, "save": run.checkpoints, "load": run.checkpoints,
        "exit_duration_in_mins": spec.exit_duration_in_mins, "kill_switch_path": run.kill_switch,
        "finished_flag_path": run.finished_flag, "tensorboard_dir": run.tensorboard,
        # the stacks are in the log before the watchdog's hang floor passes
        "stack_dump_after_mins": spec.watchdog.hang_min_minutes / 2 or None,
        "divergence_action": spec.watchdog.divergence.action,
        "divergence_patience": spec.watchdog.divergence.patience,
        "replica_digest_interval": spec.watchdog.divergence.digest_interval,
        "spike_window": spec.watchdog.spike_window, "spike_threshold": spec.watchdog.spike_threshold,
    }


def _expanded(spec: Spec, value, field: str, environ: Mapping[str, str] | None = None):
    """``value`` (a flag value or a list of them) with ``$VAR`` expanded in its strings."""
    if isinstance(value, list):
        return [_expanded(spec, v, field, environ) for v in value]
    return spec.expand(value, field, environ) if isinstance(value, str) else value


# Data fields that name local files: a relative one starts from the spec's base directory, as paths.output and
# data.dir do (``Spec.local_path``), not from wherever the command or the job happens to run.
FILE_FIELDS = ("data_path", "train_weighted_split_paths_path", "valid_weighted_split_paths_path", "vocab_file",
               "merge_file")


def data_flags(spec: Spec, environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The data and tokenizer flags: what ``opskit data prepare`` wrote (a corpus: the one exception to the field ->
    flag rule of the data section), or the data section's fields by the rule, ``$VAR`` expanded and each file
    (:data:`FILE_FIELDS`; the prefixes of a ``data_path`` blend, not its weights; a ``tokenizer_name_or_path`` that is
    a folder there, not a Hub name) made absolute from ``Spec.base_dir``.

    Raises:
        SpecError: a ``$VAR`` in a data path that is not set in this environment.
    """
    d = spec.data
    if d.prepared_by_opskit:
        tokenizer_dir, data_prefix = data_paths(spec, environ)
        return {"data_path": data_prefix, "tokenizer_type": "PretrainedFromHF", "tokenizer_name_or_path": tokenizer_dir}
    values = {}
    for key, flag in flags.FLAGS.items():
        if flag.section != "data" or (value := getattr(d, key)) is None:
            continue
        field = f"data.{key}"
        if key == "data_path" and isinstance(value, list) and len(value) > 1:  # WEIGHT PREFIX ...: the prefixes
            values[key] = [_expanded(spec, v, field, environ) if i % 2 == 0 else
                           str(spec.local_path(v, field, environ)) for i, v in enumerate(value)]
        elif key in FILE_FIELDS:
            values[key] = [str(spec.local_path(v, field, environ)) for v in value] if isinstance(value, list) \
                else str(spec.local_path(value, field, environ))
        elif key == "tokenizer_name_or_path" and (local := spec.local_path(value, field, environ)).is_dir():
            values[key] = str(local)
        else:
            values[key] = _expanded(spec, value, field, environ)
    return values


def data_files(spec: Spec) -> list[tuple[str, Path]]:
    """(field, file) of every local file the job reads its data and tokenizer from; a tokenizer given as a Hub name
    (no such local folder) is left out, since the job reads it from the Hugging Face cache.

    Raises:
        SpecError: a ``$VAR`` in a data path that is not set in this environment.
    """
    d = spec.data
    if d.prepared_by_opskit:
        tokenizer_dir, prefix = data_paths(spec)
        return [("data.dir", tokenizer_dir / "tokenizer.json"), ("data.dir", Path(f"{prefix}.bin")),
                ("data.dir", Path(f"{prefix}.idx"))]
    given = data_flags(spec)
    files: list[tuple[str, Path]] = []
    if "data_path" in given:
        prefixes = given["data_path"] if isinstance(given["data_path"], list) else [given["data_path"]]
        for _, prefix in parse_data_path([str(p) for p in prefixes]):  # one prefix, or Megatron's weighted blend
            files += [("data.data_path", Path(f"{prefix}.bin")), ("data.data_path", Path(f"{prefix}.idx"))]
    for key in ("train_weighted_split_paths_path", "valid_weighted_split_paths_path", "vocab_file", "merge_file"):
        if key in given:
            files.append((f"data.{key}", Path(str(given[key]))))
    tokenizer = given.get("tokenizer_name_or_path")
    if tokenizer is not None and Path(str(tokenizer)).is_dir():
        files.append(("data.tokenizer_name_or_path", Path(str(tokenizer)) / "tokenizer.json"))
    return files


def deepspeed_config(spec: Spec) -> dict:
    """The DeepSpeed JSON the job passes with ``--deepspeed_config`` (as BigScience's heredoc wrote it; built by
    :func:`opskit.rules.deepspeed.deepspeed_config`, the trainer's builder too), with the curriculum-learning block
    and the spec's extra ``deepspeed_config`` keys. ``train_batch_size`` is the first iteration's GBS (a ramp-up's
    start), so the trainer reads back exactly this config."""
    b = spec.batch
    curriculum = None
    if (cl := spec.curriculum_learning) is not None:
        schedule = {"total_curriculum_step": cl.total_curriculum_step, "difficulty_step": cl.difficulty_step}
        if cl.root_degree is not None:
            schedule["root_degree"] = cl.root_degree
        curriculum = {
            "enabled": True, "curriculum_type": cl.curriculum_type, "min_difficulty": cl.min_difficulty,
            "max_difficulty": spec.curriculum_max_difficulty, "schedule_type": cl.schedule_type,
            "schedule_config": schedule}
    config = rules_deepspeed_config(
        micro_batch_size=b.micro_batch_size,
        train_batch_size=BatchRampup(b.global_batch_size, b.rampup_batch_size).batch_size(0),
        clip_grad=spec.optimizer.clip_grad, zero_stage=spec.parallel.zero_stage, precision=spec.model.precision,
        curriculum=curriculum)
    return deep_merge(config, spec.deepspeed_config)


def template_env() -> jinja2.Environment:
    """The job templates shipped in the package (``opskit/slurm/templates/``, read from an installed wheel too), with
    the ``q`` filter (``shlex.quote``) that every shell value goes through."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("opskit.slurm", "templates"),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def _one_flag_per_line(args: list[str]) -> str:
    """The trainer's arguments, quoted, one flag and its values per continued line: a changed flag is a one-line diff
    (of the golden files, or of two runs' scripts)."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(arg))
    return " \\\n        ".join(" ".join(line) for line in lines)


@dataclass(frozen=True)
class RenderedJob:
    script: str
    ds_config: str


def job_config(spec: Spec, run: RunPaths) -> JobConfig:
    """What the job script passes to :mod:`opskit.allocation.job` for a spec (the trainer's flags:
    :func:`trainer_args`)."""
    s, w, d = spec.slurm, spec.watchdog, spec.watchdog.divergence
    return JobConfig(run, spec.cli_name, spec.parallel.nodes, spec.parallel.gpus_per_node, s.master_port,
                     int(s.time_minutes * 60), s.max_failures, s.max_stalled_starts, s.in_job_restarts, s.preflight,
                     Limits(w.in_job_timeout_s, w.hang_min_minutes * 60, w.hang_factor),
                     tuple(trainer_args(spec, run)), Bounds(d.skip_after, d.max_rollbacks, d.rollback_hours),
                     s.preflight_margin)


def render_job(spec: Spec, run: RunPaths, python: str = sys.executable, exclude: list[str] = ()) -> RenderedJob:
    """The job script and DeepSpeed config for a spec.

    Args:
        python: the interpreter the job runs the trainer (and the chain's ledger hook) with.
        exclude: nodes for ``#SBATCH --exclude`` (the run's bad-node list).

    Raises:
        ChainError: a run directory no job comment can carry. ``SpecError``: an unset ``$VAR``.
    """
    env = template_env()
    s = spec.slurm
    sbatch = {
        "job-name": spec.job_name,
        "comment": job_comment(run),  # which run the job is: every task and resubmission carries it
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "reservation": s.reservation,
        "constraint": s.constraint,
        "nodes": spec.parallel.nodes + s.spare_nodes,
        "ntasks-per-node": 1,
        "cpus-per-task": s.cpus_per_task,
        "hint": s.hint,
        "gres": s.gres,
        "exclude": ",".join(exclude) or None,
        "time": s.time,
        "signal": f"B:USR1@{s.signal_margin_secs}",
        "output": run.job_output,
    }
    job = job_config(spec, run)
    ds_config = json.dumps(deepspeed_config(spec), indent=2) + "\n"  # no line of it can be the heredoc's delimiter
    script = env.get_template("train.slurm").render(
        sbatch={k: v for k, v in sbatch.items() if v is not None},
        spec=spec,
        run=run,
        python=python,
        job_flags=_one_flag_per_line(job_flags(job)),
        env={key: spec.expand(value, f"slurm.env.{key}") for key, value in s.env.items()},
        trainer_args=_one_flag_per_line(list(job.trainer_args)),
        ds_config=ds_config,
    )
    return RenderedJob(script=script, ds_config=ds_config)
