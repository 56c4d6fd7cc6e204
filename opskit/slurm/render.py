"""Spec -> trainer flags, DeepSpeed config and the SLURM job script (``opskit/slurm/templates/train.slurm``, which
the repository's ``slurm_templates/`` links to), as pure functions.

Every value that reaches the shell goes through ``shlex.quote``, so job names and paths with spaces, quotes or ``$()``
stay literal; the ``#SBATCH`` header too, since sbatch splits its lines on whitespace with the shell's quoting rules.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jinja2

from opskit.runs import RunPaths, data_paths
from opskit.slurm.chain import job_comment
from opskit.spec import Spec, deep_merge

# Megatron-DeepSpeed spells this one flag with an underscore.
_UNDERSCORE_FLAGS = {"deepspeed_config"}


def _flag(key: str) -> str:
    return "--" + (key if key in _UNDERSCORE_FLAGS else key.replace("_", "-"))


def trainer_args(spec: Spec, run: RunPaths, environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``python -m opskit.train`` flags for a spec, Megatron-DeepSpeed spelling (key ``a_b`` -> ``--a-b``): the
    structured sections first, then the data flags, then ``megatron_args`` verbatim, then the switches.

    Args:
        environ: where ``$VAR`` values come from (default ``os.environ``).

    Raises:
        SpecError: a ``$VAR`` in a path or flag value that is not set in this environment.
    """
    m, p, b, o, c = spec.model, spec.parallel, spec.batch, spec.optimizer, spec.checkpoint
    values: dict[str, object] = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "seq_length": m.seq_length,
        "max_position_embeddings": m.max_position_embeddings,
        "position_embedding_type": m.position_embedding_type,
        "init_method_std": m.init_method_std,
        "hidden_dropout": m.hidden_dropout,
        "attention_dropout": m.attention_dropout,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "pad_vocab_size_to": m.pad_vocab_size_to,
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "pp_partition_method": p.pp_partition_method,
        "zero_stage": p.zero_stage,
        "micro_batch_size": b.micro_batch_size,
        "global_batch_size": b.global_batch_size,
        "rampup_batch_size": b.rampup_batch_size,
        "train_samples": b.train_samples,
        "train_iters": b.train_iters,
        "train_tokens": b.train_tokens,
        "lr": o.lr,
        "min_lr": o.min_lr,
        "lr_decay_style": o.lr_decay_style,
        "lr_warmup_samples": o.lr_warmup_samples,
        "lr_decay_samples": o.lr_decay_samples,
        "lr_decay_tokens": o.lr_decay_tokens,
        "adam_beta1": o.adam_beta1,
        "adam_beta2": o.adam_beta2,
        "adam_eps": o.adam_eps,
        "weight_decay": o.weight_decay,
        "clip_grad": o.clip_grad,
        "seed": c.seed,
        "log_interval": c.log_interval,
        "save_interval": c.save_interval,
        "eval_interval": c.eval_interval,
        "eval_iters": c.eval_iters,
        "exit_duration_in_mins": spec.exit_duration_in_mins,
        "save": run.checkpoints,
        "load": run.checkpoints,
        "tensorboard_dir": run.tensorboard,
        "tensorboard_queue_size": c.tensorboard_queue_size,
        "kill_switch_path": run.kill_switch,
        "finished_flag_path": run.finished_flag,
        **data_flags(spec, environ),
        "deepspeed_config": run.ds_config,
    }
    switches = {"embed_layernorm": m.embed_layernorm, "checkpoint_activations": m.checkpoint_activations,
                "fp16": m.precision == "fp16", "bf16": m.precision == "bf16", "deepspeed": True}
    for key, value in spec.megatron_args.items():
        if value is True:
            switches[key] = True
        elif value is not False:
            values[key] = _expanded(spec, value, f"megatron_args.{key}", environ)
    args: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        args.append(_flag(key))
        args.extend(str(v) for v in value) if isinstance(value, (tuple, list)) else args.append(str(value))
    args += [_flag(key) for key, on in switches.items() if on]
    return args


def _expanded(spec: Spec, value, field: str, environ: Mapping[str, str] | None = None):
    """``value`` (a flag value or a list of them) with ``$VAR`` expanded in its strings."""
    if isinstance(value, list):
        return [_expanded(spec, v, field, environ) for v in value]
    return spec.expand(value, field, environ) if isinstance(value, str) else value


def data_flags(spec: Spec, environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The data and tokenizer flags: what ``opskit data prepare`` wrote (a corpus), or the spec's own paths.

    Raises:
        SpecError: a ``$VAR`` in a data path that is not set in this environment.
    """
    d = spec.data
    if d.prepared_by_opskit:
        tokenizer_dir, data_prefix = data_paths(spec, environ)
        return {"data_path": data_prefix, "tokenizer_type": "PretrainedFromHF", "tokenizer_name_or_path": tokenizer_dir}
    flags: dict[str, object] = {}
    for key in ("data_path", "train_weighted_split_paths_path", "valid_weighted_split_paths_path"):
        if (value := getattr(d, key)) is not None:
            flags[key] = _expanded(spec, value, f"data.{key}", environ)
    flags.update(data_impl=d.data_impl, split=d.split, tokenizer_type=d.tokenizer_type)
    for key in ("tokenizer_name_or_path", "vocab_file", "merge_file"):
        if (value := getattr(d, key)) is not None:
            flags[key] = spec.expand(value, f"data.{key}", environ)
    return flags


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
    flags = data_flags(spec)
    files: list[tuple[str, Path]] = []
    if "data_path" in flags:
        prefixes = flags["data_path"] if isinstance(flags["data_path"], list) else [flags["data_path"]]
        for prefix in prefixes:
            if _is_number(prefix):  # Megatron's blend: weight prefix weight prefix ...
                continue
            files += [("data.data_path", Path(f"{prefix}.bin")), ("data.data_path", Path(f"{prefix}.idx"))]
    for key in ("train_weighted_split_paths_path", "valid_weighted_split_paths_path", "vocab_file", "merge_file"):
        if key in flags:
            files.append((f"data.{key}", Path(str(flags[key]))))
    tokenizer = flags.get("tokenizer_name_or_path")
    if tokenizer is not None and Path(str(tokenizer)).is_dir():
        files.append(("data.tokenizer_name_or_path", Path(str(tokenizer)) / "tokenizer.json"))
    return files


def _is_number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def trainer_rejections(args: list[str]) -> list[str]:
    """Why ``python -m opskit.train`` would exit at once on ``args`` (its own argparse rules), or [].

    Lists every flag the trainer does not define, then the first error its parser and checks report for the rest
    (an invalid choice, a missing required flag, a combination it refuses). Pure Python: the trainer's flag module
    imports only argparse.
    """
    from opskit.train import args as trainer_flags

    parser = trainer_flags.build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    unknown: list[str] = []
    kept: list[str] = []
    skipping = False
    for arg in args:
        if arg.startswith("--"):
            skipping = arg not in known
            if skipping:
                unknown.append(arg)
                continue
        elif skipping:
            continue
        kept.append(arg)
    problems = [f"it does not accept {', '.join(unknown)}"] if unknown else []
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            trainer_flags.parse_args(kept)
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if "error: " in line]
        problems.append(lines[-1].split("error: ", 1)[1] if lines else stderr.getvalue().strip())
    return problems


def deepspeed_config(spec: Spec) -> dict:
    """The DeepSpeed JSON the job passes with ``--deepspeed_config`` (as BigScience's heredoc wrote it), with the
    curriculum-learning block and the spec's extra ``deepspeed_config`` keys."""
    config: dict = {
        "train_micro_batch_size_per_gpu": spec.batch.micro_batch_size,
        "train_batch_size": spec.batch.global_batch_size,
        "gradient_clipping": spec.optimizer.clip_grad,
        "zero_optimization": {"stage": spec.parallel.zero_stage},
    }
    if spec.model.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                          "min_loss_scale": 1, "initial_scale_power": 12}
    elif spec.model.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if (cl := spec.curriculum_learning) is not None:
        schedule = {"total_curriculum_step": cl.total_curriculum_step, "difficulty_step": cl.difficulty_step}
        if cl.root_degree is not None:
            schedule["root_degree"] = cl.root_degree
        config["curriculum_learning"] = {
            "enabled": True, "curriculum_type": cl.curriculum_type, "min_difficulty": cl.min_difficulty,
            "max_difficulty": spec.curriculum_max_difficulty, "schedule_type": cl.schedule_type,
            "schedule_config": schedule}
    config.update(steps_per_print=2000, wall_clock_breakdown=False)
    return deep_merge(config, spec.deepspeed_config)


def template_env() -> jinja2.Environment:
    """The job templates shipped in the package (``opskit/slurm/templates/``, read from an installed wheel too), with
    the ``q`` filter (``shlex.quote``) that every shell value goes through."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("opskit.slurm", "templates"),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


@dataclass(frozen=True)
class RenderedJob:
    script: str
    ds_config: str


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
        "nodes": spec.parallel.nodes,
        "ntasks-per-node": 1,
        "cpus-per-task": s.cpus_per_task,
        "hint": s.hint,
        "gres": s.gres,
        "exclude": ",".join(exclude) or None,
        "time": s.time,
        "signal": f"B:USR1@{s.signal_margin_secs}",
        "output": run.slurm_dir / "%x-%j.out",
    }
    ds_config = json.dumps(deepspeed_config(spec), indent=2) + "\n"  # no line of it can be the heredoc's delimiter
    script = env.get_template("train.slurm").render(
        sbatch={k: v for k, v in sbatch.items() if v is not None},
        spec=spec,
        run=run,
        python=python,
        gpus_per_node=spec.parallel.gpus_per_node,
        master_port=s.master_port,
        time_limit_s=int(s.time_minutes * 60),
        max_failures=s.max_failures,
        env={key: spec.expand(value, f"slurm.env.{key}") for key, value in s.env.items()},
        trainer_args=" ".join(shlex.quote(a) for a in trainer_args(spec, run)),
        ds_config=ds_config,
    )
    return RenderedJob(script=script, ds_config=ds_config)
