"""Write sharded safetensors files block by block, without ever holding a whole output tensor or shard in memory.

A safetensors file is ``u64 header length | JSON header {name: {dtype, shape, data_offsets}} | raw little-endian
data`` (https://huggingface.co/docs/safetensors, "Format"). Every output shape is known from the checkpoint's pickles
before any tensor is read, so the header is written first, the file is sized, and each block (a run of whole rows of
one output tensor) is written at its place, several blocks at once by a thread pool: memory holds a few blocks.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.format.tensorfile import ITEMSIZES, ColumnSpan, FileBlock, RowSpan
from opskit.fsutil import atomic_write_text

IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per pwritev call
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the window in at once, not page by page
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

# A block of an output tensor: (values, first row); values are whole rows (1-D tensors: a run of elements), a tensor
# or a RowSpan/ColumnSpan still in the checkpoint files.
Block = tuple[object, int]


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its name, shape, the bytes it reads from the checkpoint, and a generator of its blocks."""

    name: str
    shape: tuple[int, ...]
    source_bytes: int
    blocks: Callable[[], Iterator[Block]]


def plan_shards(tensors: list[OutTensor], itemsize: int, max_shard_bytes: int) -> list[list[OutTensor]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = numel(t.shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors(path: Path, tensors: list[OutTensor], dtype, progress: Callable[[int], None] | None = None,
                      metadata: dict[str, str] | None = None, workers: int = 1) -> int:
    """Write ``tensors`` (cast to ``dtype``: a ``torch.dtype`` or its name, ``"bfloat16"``) to ``path``;
    ``progress(source bytes)`` after each tensor, in order. torch is imported only for blocks that need a cast or are
    tensors already.

    Blocks are written by ``workers`` threads at once (each block has its own place in the file; the copies release
    the GIL), at most ``2 * workers`` blocks in flight, so memory stays at a few blocks whatever the file size.

    Returns:
        Bytes of tensor data written.

    Raises:
        The first error of a block (e.g. :class:`~opskit.ckpt.format.tensorfile.TensorFileError` for a truncated file).
    """
    dtype = str(dtype).removeprefix("torch.")
    itemsize = ITEMSIZES[dtype]
    header: dict[str, dict] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    offsets = {}
    for t in tensors:
        nbytes = numel(t.shape) * itemsize
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + nbytes]}
        offsets[t.name] = offset
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as the reference writer does
    data_start = 8 + len(encoded)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, len(encoded).to_bytes(8, "little") + encoded, 0)
        os.ftruncate(fd, data_start + offset)
        with ThreadPoolExecutor(workers) as pool:
            _write_blocks(pool, 2 * workers, tensors, dtype, fd,
                          {name: data_start + at for name, at in offsets.items()}, progress)
        os.fsync(fd)
    finally:
        os.close(fd)
    return offset


def _write_blocks(pool: ThreadPoolExecutor, in_flight: int, tensors: list[OutTensor], dtype, fd: int,
                  starts: dict[str, int], progress: Callable[[int], None] | None) -> None:
    """Submit every block of ``tensors`` to ``pool`` (blocking while ``in_flight`` are queued or running); report
    each tensor once all its blocks are written."""
    slots = threading.Semaphore(in_flight)
    failures: list[BaseException] = []
    pending: deque[tuple[OutTensor, list[Future]]] = deque()

    def finished(future: Future) -> None:
        if future.exception() is not None:
            failures.append(future.exception())
        slots.release()

    def report(all_done: bool) -> None:
        while pending and (all_done or all(f.done() for f in pending[0][1])):
            tensor, futures = pending.popleft()
            for future in futures:
                future.result()
            if progress:
                progress(tensor.source_bytes)

    for t in tensors:
        row_bytes = numel(t.shape[1:]) * ITEMSIZES[dtype]
        futures = []
        for values, row in t.blocks():
            slots.acquire()
            if failures:
                raise failures[0]
            futures.append(pool.submit(_write_block, values, dtype, fd, starts[t.name] + row * row_bytes))
            futures[-1].add_done_callback(finished)
        pending.append((t, futures))
        report(all_done=False)
    report(all_done=True)


def _write_block(values, dtype: str, fd: int, at: int) -> None:
    """One block at byte ``at`` of ``fd``: file to file when it is still in the checkpoint and keeps its dtype, else
    read, cast and written."""
    if isinstance(values, (RowSpan, ColumnSpan)):
        block = values.file_block() if values.dtype_name == dtype else None
        if block is not None and _copy_mapped(block, fd, at):
            return
        values = values.read()
    import torch  # torch: only for a block that needs a cast

    _pwrite_all(fd, values.to(getattr(torch, dtype)).contiguous().view(-1).view(torch.uint8).numpy(), at)


def _copy_mapped(block: FileBlock, fd: int, at: int) -> bool:
    """Write ``block`` at ``at`` straight from the checkpoint files' pages: each piece's bytes mapped read-only
    (``mmap``, pre-faulted), rows gathered by ``pwritev``: one copy, page cache to page cache, no buffer of our own.
    False when a file cannot be mapped here (then the caller reads instead)."""
    if block.rows == 0 or not all(width for _path, _offset, width in block.pieces):
        return True
    try:
        pieces = [(_mapped(path, offset, width * block.rows), width) for path, offset, width in block.pieces]
    except (OSError, ValueError):  # a file system without mmap: read + write instead
        return False
    rows = [view[i * width:(i + 1) * width] for i in range(block.rows) for view, width in pieces]
    for first in range(0, len(rows), IOV_MAX):
        batch = rows[first:first + IOV_MAX]
        _pwritev_all(fd, batch, at)
        at += sum(len(row) for row in batch)
    return True  # the mappings go with the last view


def _mapped(path: Path, offset: int, length: int) -> memoryview:
    """``length`` bytes at ``offset`` of ``path``, mapped read-only (the window starts on a page boundary)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        window = mmap.mmap(f.fileno(), offset + length - start, flags=mmap.MAP_SHARED | MAP_POPULATE,
                           prot=mmap.PROT_READ, offset=start)
    if len(window) < offset + length - start:
        raise ValueError(f"{path}: shorter than its records")
    return memoryview(window)[offset - start:]


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev``, continued after a short write (a single call writes at most ~2 GiB)."""
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views = views[1:]
        if views and written:
            views = [views[0][written:], *views[1:]]


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` as transformers reads it."""
    atomic_write_text(folder / "model.safetensors.index.json",
                      json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a shape."""
    n = 1
    for s in shape:
        n *= s
    return n
