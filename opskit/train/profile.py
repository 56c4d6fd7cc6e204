"""Megatron-LM's ``--profile``: iterations ``[--profile-step-start, --profile-step-end)`` of the ``--profile-ranks``
under a profiler. With ``--use-pytorch-profiler``, torch.profiler (CPU and CUDA activities) writes one Chrome trace
per rank into ``--tensorboard-dir`` (``rankR.<time>.pt.trace.json``, what TensorBoard's profiler plugin and
Perfetto read, as Megatron-LM's ``tensorboard_trace_handler``); without it, ``cudaProfilerStart`` / ``Stop`` bound
the range for ``nsys profile --capture-range=cudaProfilerApi``. torch is imported only when a rank profiles.
"""

from __future__ import annotations

from opskit.train.config import TrainConfig, TrainerError


class StepProfiler:
    """Starts and stops this rank's profiler around the training loop's iterations (numbers from 1, as logged).

    Raises:
        TrainerError: (at construction) an empty or reversed step range; the PyTorch profiler without
            ``--tensorboard-dir``; nsys's range on a machine without CUDA.
    """

    def __init__(self, config: TrainConfig, rank: int):
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.enabled = config.profile and rank in config.profile_ranks
        self.pytorch = config.use_pytorch_profiler
        self.rank, self.out = rank, config.tensorboard_dir
        self._active = None
        self._span = None  # the running iteration's record_function
        if config.profile:
            _check(config)

    def before_iteration(self, iteration: int) -> None:
        """Called before iteration ``iteration`` trains: starts the profiler at the range's first; each profiled
        iteration is a span named ``iteration N`` in the PyTorch trace."""
        if self.enabled and self._active is None and iteration == self.start:
            self._active = self._start()
        if self._active is not None and self.pytorch:
            import torch

            self._span = torch.profiler.record_function(f"iteration {iteration}")
            self._span.__enter__()

    def after_iteration(self, iteration: int) -> None:
        """Called after iteration ``iteration`` trained: stops the profiler after the range's last."""
        if self._span is not None:
            span, self._span = self._span, None
            span.__exit__(None, None, None)
        if self._active is not None and iteration >= self.end - 1:
            self.stop()

    def stop(self) -> None:
        """Stop (and write the trace) if the profiler runs: at the range's end, or when training stops inside it."""
        active, self._active = self._active, None
        if active is None:
            return
        import torch

        if self.pytorch:
            if torch.cuda.is_available():  # the range's kernels finished, so the trace holds them
                torch.cuda.synchronize()
            active.stop()
        else:
            torch.cuda.cudart().cudaProfilerStop()

    def _start(self):
        import torch

        if not self.pytorch:
            torch.cuda.cudart().cudaProfilerStart()
            return True
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.out, worker_name=f"rank{self.rank}"))
        profiler.start()
        return profiler


def _check(config: TrainConfig) -> None:
    if config.profile_step_end <= config.profile_step_start:
        raise TrainerError(f"--profile-step-start {config.profile_step_start} --profile-step-end "
                           f"{config.profile_step_end}: the end must come after the start (the range is "
                           "[start, end))")
    if config.use_pytorch_profiler and not config.tensorboard_dir:
        raise TrainerError("--profile --use-pytorch-profiler writes its traces into --tensorboard-dir: give one")
    if not config.use_pytorch_profiler:
        import torch

        if not torch.cuda.is_available():
            raise TrainerError("--profile without --use-pytorch-profiler marks the range for nsys (CUDA only): add "
                               "--use-pytorch-profiler")
