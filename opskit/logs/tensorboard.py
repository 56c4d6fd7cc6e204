"""Read Megatron's TensorBoard scalars (reference section 2.3) back into iteration records, so that ``opskit logs
plot`` overlays event directories (e.g. BigScience's published ``tr11-176B-ml-logs/tensorboard``) with text logs."""

from __future__ import annotations

from pathlib import Path

from opskit.logs.parse import LogFormatError

# Record key -> Megatron's tag (x = iteration).
TAGS = {
    "lm_loss": "lm-loss-training/lm loss",
    "grad_norm": "grad-norm/grad-norm",
    "learning_rate": "learning-rate/learning-rate",
    "loss_scale": "loss-scale/loss-scale",
    "global_batch_size": "batch-size/batch-size",
    "num_zeros": "num-zeros/num-zeros",
    "params_norm": "params-norm/params-norm",
    "consumed_samples": "steps-vs-samples/y=samples,x=steps",
    "consumed_tokens": "steps-vs-tokens/y=tokens,x=steps",
    "elapsed_time_per_iteration_s": "iteration-time/iteration-time",
    "samples_per_second": "iteration-time/samples per second",
    "tflops": "iteration-time/TFLOPs per gpu (estimated)",
}
VALIDATION_TAGS = {
    "validation_lm_loss": "lm-loss-validation/lm loss validation",
    "validation_ppl": "lm-loss-validation/lm loss validation ppl",
}
_INTEGERS = {"consumed_samples", "consumed_tokens", "global_batch_size"}


def is_event_dir(path: Path) -> bool:
    """A folder holding ``*tfevents*`` files (directly or in sub-folders)."""
    return path.is_dir() and any(path.rglob("*tfevents*"))


def read_event_dir(path: str | Path) -> list[dict]:
    """Iteration records (then validation records), by step, from every event file under ``path``.

    Raises:
        LogFormatError: no event file under ``path``, or none with Megatron's ``lm-loss-training/lm loss`` tag.
    """
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    path = Path(path)
    if not is_event_dir(path):
        raise LogFormatError(f"{path}: no TensorBoard event files (*tfevents*) in this folder")
    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(str(path))
    multiplexer.Reload()
    by_step: dict[int, dict] = {}
    validation: dict[int, dict] = {}
    for run, tags in multiplexer.Runs().items():
        scalars = set(tags.get("scalars", []))
        for key, tag in {**TAGS, **VALIDATION_TAGS}.items():
            if tag not in scalars:
                continue
            target = validation if key in VALIDATION_TAGS else by_step
            for event in multiplexer.Scalars(run, tag):
                value = int(event.value) if key in _INTEGERS else float(event.value)
                target.setdefault(event.step, {})[key] = value
    if not any("lm_loss" in r for r in by_step.values()):
        raise LogFormatError(f"{path}: no '{TAGS['lm_loss']}' scalars: not a Megatron TensorBoard folder")
    records = [{"kind": "iteration", "iteration": step, "train_iters": None, **values}
               for step, values in sorted(by_step.items())]
    records += [{"kind": "validation", "iteration": step, "dataset": "validation", "where": f"iteration {step}",
                 **values} for step, values in sorted(validation.items())]
    return records
