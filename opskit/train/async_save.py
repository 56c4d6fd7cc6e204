"""Checkpoint saves in the background (``--async-save``, Megatron-LM's flag), in Megatron-DeepSpeed's layout.

A save copies every tensor DeepSpeed hands to its checkpoint engine into host memory (buffers kept from one save to
the next, copied on the current CUDA stream, so the optimizer step after the save cannot overwrite what is being
copied) and returns to training; one writer thread per rank writes the files. The buffers are carved from a
:class:`HostArena` that a thread reserves and page-locks while the run starts, so the first save does not stop
training to pin them (18 GB took 15 s on an H100 host: docs/benchmarks.md#checkpoint-saves). The next save waits for the
previous one. ``latest`` moves only when every rank's writer has written every file of the step: the ranks agree with an
all-reduce on a gloo group after each iteration while a save is under way, then rank 0 writes ``latest`` (atomically). A
crash before that leaves ``latest`` at the previous complete step, as a synchronous save does.

Why our own engine rather than DeepSpeed's ``DecoupledCheckpointEngine`` (0.19): it writes through DeepSpeed's
``FastCheckpointEngine`` (the async_io op, which needs libaio built in), waits for each rank's own writes only and
has rank 0 write ``latest`` without knowing the other ranks' files are complete, and a failed write kills its
subprocess with a traceback. torch.distributed.checkpoint's ``async_save`` writes its own layout (``.distcp``), which
``opskit ckpt`` and Megatron-DeepSpeed's tools cannot read. DeepSpeed's ``CheckpointEngine`` interface is kept: the
engine still decides which file holds what.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from opskit.ckpt.format.layout import save_failed_message, write_latest
from opskit.train.checkpointing import CheckpointError, failure_reason, write_through_python_file
from opskit.train.log import saved_line, timer_line

_END_OF_SAVE = object()
"""Queued after a save's last file: the writer has written the step when it gets there."""

_CLOSE_TIMEOUT_S = 60
"""How long closing waits for the file being written (the rest of the queue is dropped)."""

_ALIGNMENT = 512
"""Bytes each arena buffer starts on (a multiple of every dtype's size, and of a cache line)."""

_TOUCH_CHUNK = 1 << 28
"""Bytes the arena's thread faults in at a time before page-locking it (256 MiB)."""


class HostArena:
    """Host memory for one rank's checkpoint snapshots, reserved ahead of the first save: a thread faults its pages in
    and, on a CUDA machine, page-locks it (``cudaHostRegister``) while training starts, so device-to-host copies into
    it are asynchronous. Each buffer it hands out has a storage of its own, exactly its size (``torch.save`` writes a
    view's whole storage: views of one big tensor would write the arena into every file).

    Args:
        nbytes: bytes to reserve (the rank's share of a step, :func:`opskit.rules.memory.checkpoint_bytes`).
        pin: page-lock it (only where CUDA is available).
    """

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = max(int(nbytes), 0)
        self._memory = torch.empty(self.nbytes, dtype=torch.uint8)  # no page is touched yet
        self._bytes = memoryview(self._memory.numpy())
        self._offset = 0
        self.pinned = False
        self._ready = threading.Thread(target=self._prepare, args=(pin,), name="opskit-checkpoint-arena", daemon=True)
        self._ready.start()

    def _prepare(self, pin: bool) -> None:
        for start in range(0, self.nbytes, _TOUCH_CHUNK):  # page faults here, not in the save
            self._memory[start:start + _TOUCH_CHUNK].zero_()
        if pin and self.nbytes:
            self.pinned = torch.cuda.cudart().cudaHostRegister(self._memory.data_ptr(), self.nbytes, 0) == 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A buffer shaped and typed like ``tensor``, or None when the arena has no room left for it. Waits for the
        arena's preparation (the first save only, and only if it comes that early)."""
        self._ready.join()
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-self._offset // _ALIGNMENT) * _ALIGNMENT
        if nbytes == 0 or start + nbytes > self.nbytes:
            return None
        self._offset = start + nbytes
        return torch.frombuffer(self._bytes[start:start + nbytes], dtype=tensor.dtype).view(tensor.shape)

    def release(self) -> None:
        """Undo the page-locking (the buffers stay readable)."""
        self._ready.join()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._memory.data_ptr())
            self.pinned = False


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine that snapshots each file's tensors into host memory and queues the file for a
    writer thread; files are torch.save'd as :func:`~opskit.train.checkpointing.write_through_python_file` does for
    a synchronous save (same bytes on disk, an OSError naming its file), then fsync'ed.

    Host memory: one buffer per tensor of this rank's files, kept for the next save, carved from ``arena`` (about
    the size of the rank's files: tr11's 2.3 TB over 384 GPUs is about 6 GB per rank); a tensor the arena has no room
    for gets a buffer of its own (pinned for a CUDA tensor, which torch's allocator rounds up to a power of two).
    """

    def __init__(self, zipfile_serialization: bool, arena: HostArena | None = None):
        super().__init__(None)
        self.zipfile_serialization = zipfile_serialization
        self.arena = arena
        self._outside_arena = 0  # bytes of buffers the arena had no room for, this save
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._written = threading.Event()
        self._written.set()
        self._failure: tuple[BaseException, str] | None = None
        self._dropping = False
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._thread = threading.Thread(target=self._write_queued_files, name="opskit-checkpoint-writer", daemon=True)
        self._thread.start()

    # DeepSpeed's interface: create, then save per file, then commit
    def create(self, info: CheckpointCommitInfo) -> None:
        self._written.clear()
        self._failure = None

    def save(self, state_dict, path: str) -> None:
        copies: list[int] = [0, 0]  # tensors copied, of which on a GPU
        snapshot = self._snapshot(state_dict, os.path.basename(path), copies)
        ready = None
        if copies[1]:
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put((snapshot, path, ready))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        self._queue.put(_END_OF_SAVE)
        if self._outside_arena:
            print(f"warning: {self._outside_arena / 2**20:,.1f} MiB of this rank's checkpoint did not fit its host "
                  f"arena of {self.arena.nbytes / 2**20:,.1f} MiB: allocated at this save instead", flush=True)
            self._outside_arena = 0
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot copies each tensor: DeepSpeed need not clone them first

    # what the trainer asks
    def written(self, wait: bool) -> bool:
        """Whether every file of the save under way is written (or one failed); with ``wait``, block until then."""
        return self._written.wait() if wait else self._written.is_set()

    @property
    def failure(self) -> tuple[BaseException, str] | None:
        """The first error of the save under way and the file it happened on, or None."""
        return self._failure

    def close(self) -> None:
        """Stop the writer after the file it is writing (files still queued are dropped: a save under way at an
        error is never completed, ``latest`` stays where it was)."""
        self._dropping = True
        self._queue.put(None)
        self._thread.join(timeout=_CLOSE_TIMEOUT_S)
        if self.arena is not None and not self._thread.is_alive():
            self.arena.release()

    def _snapshot(self, item, file_name: str, copies: list[int]):
        """``item`` with every tensor replaced by its copy in this file's host buffers; containers rebuilt, other
        leaves kept (the trainer builds its client state anew for each save)."""
        if isinstance(item, torch.Tensor):
            return self._host_copy(item.detach(), (file_name, copies[0]), copies)
        if isinstance(item, dict):
            copied = item.copy()
            for key, value in item.items():
                copied[key] = self._snapshot(value, file_name, copies)
            return copied
        if type(item) in (list, tuple):
            return type(item)(self._snapshot(value, file_name, copies) for value in item)
        if isinstance(item, np.ndarray):
            return item.copy()
        return item

    def _host_copy(self, tensor: torch.Tensor, key: tuple[str, int], copies: list[int]) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._new_buffer(tensor)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        copies[0] += 1
        copies[1] += tensor.is_cuda
        return buffer

    def _new_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host memory for a copy of ``tensor``: from the arena, else its own (pinned for a CUDA tensor, so the copy
        is asynchronous)."""
        if self.arena is not None:
            if (buffer := self.arena.take(tensor)) is not None:
                return buffer
            self._outside_arena += tensor.numel() * tensor.element_size()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)

    def _write_queued_files(self) -> None:
        while (job := self._queue.get()) is not None:
            if job is _END_OF_SAVE:
                self._written.set()
                continue
            snapshot, path, ready = job
            if self._failure is not None or self._dropping:
                continue  # the step cannot become complete: its other files are not worth writing
            try:
                if ready is not None:
                    ready.synchronize()
                write_through_python_file(self.zipfile_serialization, snapshot, path, fsync=True)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
                self._failure = (e, path)


@dataclass(frozen=True)
class _PendingSave:
    tag: str
    iteration: int
    started: float
    """time.time() when the save began."""


class BackgroundSaves:
    """The saves of this run written in the background, and ``latest`` moved when every rank has written its files.

    Every rank calls :meth:`poll` after each iteration, :meth:`wait` before a save and at the end of training (the
    calls are collective on their own gloo group while a save is under way), and :meth:`close` when the run ends.
    """

    def __init__(self, writer: BackgroundCheckpointEngine, save_dir: str):
        self.writer = writer
        self.save_dir = save_dir
        self.group = dist.new_group(backend="gloo")  # CPU flags: no CUDA sync in the training loop
        self.pending: _PendingSave | None = None

    @classmethod
    def install(cls, engine, save_dir: str, reserve_bytes: int) -> BackgroundSaves:
        """Give the DeepSpeed ``engine`` a :class:`BackgroundCheckpointEngine` (its loads are unchanged) with a
        :class:`HostArena` of ``reserve_bytes``. Collective: every rank calls it, in the same order among the process
        groups it creates."""
        arena = HostArena(reserve_bytes, pin=torch.cuda.is_available())
        writer = BackgroundCheckpointEngine(engine.checkpoint_engine.zipfile_serialization, arena)
        engine.checkpoint_engine = writer
        return cls(writer, save_dir)

    def started(self, tag: str, iteration: int, started: float) -> None:
        """Record the save DeepSpeed has just handed to the writer."""
        self.pending = _PendingSave(tag, iteration, started)

    def poll(self) -> None:
        """Move ``latest`` if the save under way is written on every rank; return at once otherwise.

        Raises:
            CheckpointError: a file of it could not be written, here or on another rank (one line; ``latest``
                unchanged).
        """
        self._settle(wait=False)

    def wait(self) -> None:
        """Block until the save under way is written on every rank, then move ``latest``.

        Raises:
            CheckpointError: as :meth:`poll`.
        """
        self._settle(wait=True)

    def close(self) -> None:
        self.writer.close()

    def _settle(self, wait: bool) -> None:
        pending = self.pending
        if pending is None:
            return
        written = self.writer.written(wait)
        failure = self.writer.failure
        if failure is not None and not isinstance(failure[0], OSError):
            raise failure[0]  # a defect, not the file system: its traceback, as a synchronous save would show
        flags = torch.tensor([int(not written), int(failure is not None)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        writing, failed = flags.tolist()
        if failed:
            self.pending = None
            reason = failure_reason(failure[0], Path(failure[1])) if failure else "a file failed on another rank"
            raise CheckpointError(save_failed_message(pending.tag, reason))
        if writing:
            return
        self.pending = None
        if dist.get_rank() == 0:
            try:
                write_latest(self.save_dir, pending.tag)
            except OSError as e:
                raise CheckpointError(save_failed_message(pending.tag, failure_reason(e, Path(self.save_dir)))) \
                    from None
            print(saved_line(pending.iteration, self.save_dir), flush=True)
            print(timer_line("save-checkpoint-background", pending.started), flush=True)
