"""Spec -> trainer flags, DeepSpeed config and the SLURM job script (``slurm_templates/train.slurm``), as pure
functions.

Every value that reaches the shell goes through ``shlex.quote``, so job names and paths with spaces, quotes or ``$()``
stay literal; the ``#SBATCH`` header too, since sbatch splits its lines on whitespace with the shell's quoting rules.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from opskit.runs import RunPaths, data_paths
from opskit.spec import Spec

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm_templates"


# Megatron-DeepSpeed spells this one flag with an underscore.
_UNDERSCORE_FLAGS = {"deepspeed_config"}


def _flag(key: str) -> str:
    return "--" + (key if key in _UNDERSCORE_FLAGS else key.replace("_", "-"))


def trainer_args(spec: Spec, run: RunPaths) -> list[str]:
    """The ``python -m opskit.train`` flags for a spec, Megatron-DeepSpeed spelling (key ``a_b`` -> ``--a-b``)."""
    m, p, b, o, c = spec.model, spec.parallel, spec.batch, spec.optimizer, spec.checkpoint
    tokenizer_dir, data_prefix = data_paths(spec)
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
        "zero_stage": p.zero_stage,
        "micro_batch_size": b.micro_batch_size,
        "global_batch_size": b.global_batch_size,
        "rampup_batch_size": b.rampup_batch_size,
        "train_samples": b.train_samples,
        "lr": o.lr,
        "min_lr": o.min_lr,
        "lr_decay_style": o.lr_decay_style,
        "lr_warmup_samples": o.lr_warmup_samples,
        "lr_decay_samples": o.lr_decay_samples,
        "adam_beta1": o.adam_beta1,
        "adam_beta2": o.adam_beta2,
        "adam_eps": o.adam_eps,
        "weight_decay": o.weight_decay,
        "clip_grad": o.clip_grad,
        "seed": c.seed,
        "log_interval": c.log_interval,
        "save_interval": c.save_interval,
        "exit_duration_in_mins": spec.exit_duration_in_mins,
        "save": run.checkpoints,
        "load": run.checkpoints,
        "tensorboard_dir": run.tensorboard,
        "kill_switch_path": run.kill_switch,
        "data_path": data_prefix,
        "tokenizer_type": "PretrainedFromHF",
        "tokenizer_name_or_path": tokenizer_dir,
        "deepspeed_config": run.ds_config,
    }
    args: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        args.append(_flag(key))
        args.extend(str(v) for v in value) if isinstance(value, tuple) else args.append(str(value))
    switches = {"embed_layernorm": m.embed_layernorm, "fp16": m.precision == "fp16",
                "bf16": m.precision == "bf16", "deepspeed": True}
    args += [_flag(key) for key, on in switches.items() if on]
    return args


def deepspeed_config(spec: Spec) -> dict:
    """The DeepSpeed JSON the job passes with ``--deepspeed_config`` (as BigScience's heredoc wrote it)."""
    config: dict = {
        "train_micro_batch_size_per_gpu": spec.batch.micro_batch_size,
        "train_batch_size": spec.batch.global_batch_size,
        "gradient_clipping": spec.optimizer.clip_grad,
        "zero_optimization": {"stage": spec.parallel.zero_stage},
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    if spec.model.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                          "min_loss_scale": 1, "initial_scale_power": 12}
    elif spec.model.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


@dataclass(frozen=True)
class RenderedJob:
    script: str
    ds_config: str


def render_job(spec: Spec, run: RunPaths, python: str = sys.executable) -> RenderedJob:
    """The job script and DeepSpeed config for a spec; ``python`` is the interpreter the job runs the trainer with."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    s = spec.slurm
    sbatch = {
        "job-name": spec.job_name,
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "reservation": s.reservation,
        "constraint": s.constraint,
        "nodes": spec.parallel.nodes,
        "ntasks-per-node": 1,
        "cpus-per-task": s.cpus_per_task,
        "gres": s.gres,
        "time": s.time,
        "signal": f"B:USR1@{s.signal_margin_secs}",
        "output": run.slurm_dir / "%x-%j.out",
    }
    script = env.get_template("train.slurm").render(
        sbatch={k: v for k, v in sbatch.items() if v is not None},
        spec=spec,
        run=run,
        python=python,
        gpus_per_node=spec.parallel.gpus_per_node,
        master_port=s.master_port,
        env=s.env,
        trainer_args=" ".join(shlex.quote(a) for a in trainer_args(spec, run)),
    )
    return RenderedJob(script=script, ds_config=json.dumps(deepspeed_config(spec), indent=2) + "\n")
