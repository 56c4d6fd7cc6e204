"""What the trainer prints and writes to TensorBoard, in Megatron-DeepSpeed's exact formats (reference section 2.3),
because users grep for these lines and ``opskit logs`` / ``opskit status`` parse them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


def print_datetime(message: str) -> None:
    """Megatron's ``[message] datetime: %Y-%m-%d %H:%M:%S`` line."""
    print(f"[{message}] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ", flush=True)


def timer_line(name: str, started: float) -> str:
    """Megatron's ``time (ms) | NAME: X``, X the milliseconds since ``started`` (time.time()): ``save-checkpoint``
    (what a save stopped training), ``save-checkpoint-background``, ``load-checkpoint`` and ``evaluate``, which
    opskit.history.goodput and opskit.history.measures read."""
    return f"time (ms) | {name}: {(time.time() - started) * 1000:.2f}"


def saved_line(iteration: int, save_dir: str) -> str:
    """Megatron's line once a step is complete and ``latest`` names it (what goodput and the tests look for)."""
    return f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}"


def memory_line(rank: int, iteration: int) -> str:
    """Megatron's one-time GPU memory report: ``[Rank N] (after K iterations) memory (MB) | allocated: ... |``."""
    import torch

    mb = 2**20
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | "
            f"allocated: {torch.cuda.memory_allocated() / mb:.1f} | "
            f"max allocated: {torch.cuda.max_memory_allocated() / mb:.1f} | "
            f"reserved: {torch.cuda.memory_reserved() / mb:.1f} | "
            f"max reserved: {torch.cuda.max_memory_reserved() / mb:.1f}")


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line (Megatron prints averages over ``--log-interval``)."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    nan_iterations: int = 0
    skipped_iterations: int = 0
    started: float = 0.0

    def add(self, loss: float, skipped: bool) -> None:
        self.iterations += 1
        if skipped:
            self.skipped_iterations += 1
        elif math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1
        else:
            self.nan_iterations += 1

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.loss_count if self.loss_count else float("nan")


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, consumed_tokens: int,
                   seconds_per_iteration: float, learning_rate: float, global_batch_size: int, lm_loss: float,
                   loss_scale: float | None, grad_norm: float | None, skipped_iterations: int,
                   nan_iterations: int, tflops: float, curriculum_seqlen: int | None = None) -> str:
    """Megatron-DeepSpeed's 2022 iteration line: `` iteration N/ T | key: value | ... |``; ``loss scale`` only with
    fp16 (pass None otherwise), ``curriculum seqlen`` only with curriculum learning."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" consumed tokens: {consumed_tokens:12d} |",
        f" elapsed time per iteration (s): {seconds_per_iteration:.2f} |",
        f" learning rate: {learning_rate:.3E} |",
        f" global batch size: {global_batch_size:5d} |",
    ]
    if lm_loss > 0:  # Megatron prints a loss key only when its average is positive
        parts.append(f" lm loss: {lm_loss:.6E} |")
    if loss_scale is not None:
        parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    parts.append(" num zeros: 0.0 |")
    if curriculum_seqlen is not None:
        parts.append(f" curriculum seqlen: {curriculum_seqlen:5d} |")
    parts += [
        f" number of skipped iterations: {skipped_iterations:3d} |",
        f" number of nan iterations: {nan_iterations:3d} |",
        f" samples per second: {global_batch_size / seconds_per_iteration:.3f} |",
        f" TFLOPs: {tflops:.2f} |",
    ]
    return "".join(parts)


def validation_lines(prefix: str, lm_loss: float, name: str | None = None) -> list[str]:
    """Megatron's evaluate_and_print_results block: a dash line, `` validation loss at {prefix} | lm loss value: X |
    lm loss PPL: Y | `` (`` {name} loss at ...`` for a named validation group), the dash line again;
    dashes = len(line) + 1, PPL = exp(min(20, loss))."""
    ppl = validation_ppl(lm_loss)
    line = f" {name or 'validation'} loss at {prefix} | lm loss value: {lm_loss:.6E} | lm loss PPL: {ppl:.6E} | "
    dashes = "-" * (len(line) + 1)
    return [dashes, line, dashes]


def validation_ppl(lm_loss: float) -> float:
    """Perplexity as Megatron prints it: ``exp(min(20, loss))`` (capped so it never overflows)."""
    return math.exp(min(20.0, lm_loss))


class TensorBoard:
    """Megatron's scalar tags on the last rank; a no-op elsewhere or without ``--tensorboard-dir``."""

    def __init__(self, log_dir: str | None, queue_size: int, enabled: bool):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def restart_marker(self, iteration: int, world_size: int) -> None:
        """``iteration-time/world_size``: world size at the (re)start iteration, 0 right after: a visible blip."""
        if self.writer:
            self.writer.add_scalar("iteration-time/world_size", world_size, iteration)
            self.writer.add_scalar("iteration-time/world_size", 0, iteration + 1)

    def iteration(self, iteration: int, samples: int, tokens: int, lr: float, batch_size: int, loss: float,
                  grad_norm: float | None, loss_scale: float | None, curriculum_seqlen: int | None = None) -> None:
        if not self.writer:
            return
        w = self.writer
        w.add_scalar("steps-vs-samples/y=steps,x=samples", iteration, samples)
        w.add_scalar("steps-vs-samples/y=samples,x=steps", samples, iteration)
        w.add_scalar("steps-vs-tokens/y=steps,x=tokens", iteration, tokens)
        w.add_scalar("steps-vs-tokens/y=tokens,x=steps", tokens, iteration)
        w.add_scalar("learning-rate/learning-rate", lr, iteration)
        w.add_scalar("learning-rate/learning-rate vs samples", lr, samples)
        w.add_scalar("learning-rate/learning-rate vs tokens", lr, tokens)
        w.add_scalar("batch-size/batch-size", batch_size, iteration)
        w.add_scalar("batch-size/batch-size vs samples", batch_size, samples)
        w.add_scalar("lm-loss-training/lm loss", loss, iteration)
        w.add_scalar("lm-loss-training/lm loss vs samples", loss, samples)
        w.add_scalar("lm-loss-training/lm loss vs tokens", loss, tokens)
        if loss_scale is not None:
            w.add_scalar("loss-scale/loss-scale", loss_scale, iteration)
            w.add_scalar("loss-scale/loss-scale vs samples", loss_scale, samples)
            w.add_scalar("loss-scale/loss-scale vs tokens", loss_scale, tokens)
        if curriculum_seqlen is not None:
            w.add_scalar("curriculum_seqlen", curriculum_seqlen, iteration)
        if grad_norm is not None:
            w.add_scalar("grad-norm/grad-norm", grad_norm, iteration)
            w.add_scalar("grad-norm/grad-norm vs samples", grad_norm, samples)
            w.add_scalar("grad-norm/grad-norm vs tokens", grad_norm, tokens)

    def validation(self, iteration: int, samples: int, tokens: int, loss: float, log_ppl: bool,
                   name: str | None = None) -> None:
        """``lm-loss-validation/lm loss validation`` (+ `` vs samples``, `` vs tokens``), and its ``ppl`` with
        ``--log-validation-ppl-to-tensorboard``; under ``lm-loss-validation/{name}/`` for a named group."""
        if not self.writer:
            return
        values = {"lm loss validation": loss}
        if log_ppl:
            values["lm loss validation ppl"] = validation_ppl(loss)
        section = f"lm-loss-validation/{name}" if name else "lm-loss-validation"
        for key, value in values.items():
            tag = f"{section}/{key}"
            self.writer.add_scalar(tag, value, iteration)
            self.writer.add_scalar(f"{tag} vs samples", value, samples)
            self.writer.add_scalar(f"{tag} vs tokens", value, tokens)

    def interval(self, iteration: int, samples: int, tokens: int, seconds_per_iteration: float, batch_size: int,
                 seq_length: int, dp_size: int, tflops: float) -> None:
        if not self.writer:
            return
        w = self.writer
        samples_per_sec = batch_size / seconds_per_iteration
        w.add_scalar("iteration-time/iteration-time", seconds_per_iteration, iteration)
        w.add_scalar("iteration-time/iteration-time vs samples", seconds_per_iteration, samples)
        w.add_scalar("iteration-time/iteration-time vs tokens", seconds_per_iteration, tokens)
        w.add_scalar("iteration-time/samples per second", samples_per_sec, iteration)
        w.add_scalar("iteration-time/samples per second per replica", samples_per_sec / dp_size, iteration)
        w.add_scalar("iteration-time/tokens per second", samples_per_sec * seq_length, iteration)
        w.add_scalar("iteration-time/tokens per second per replica", samples_per_sec * seq_length / dp_size,
                     iteration)
        w.add_scalar("iteration-time/TFLOPs per gpu (estimated)", tflops, iteration)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def current_loss_scale(optimizer) -> float | None:
    """The fp16 loss scale DeepSpeed's optimizer uses now (ZeRO: ``loss_scale_config.cur_scale``; FP16_Optimizer:
    ``cur_scale``), or None for an optimizer without loss scaling. Dynamic scaling halves it on an overflow (the step
    is then skipped) and doubles it after ``loss_scale_window`` clean steps."""
    config = getattr(optimizer, "loss_scale_config", None)
    scale = getattr(config, "cur_scale", None) if config is not None else getattr(optimizer, "cur_scale", None)
    return float(scale) if scale is not None else None
