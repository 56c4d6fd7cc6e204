"""Write sharded safetensors files block by block, without ever holding a whole output tensor or shard in memory.

A safetensors file is ``u64 header length | JSON header {name: {dtype, shape, data_offsets}} | raw little-endian
data`` (https://huggingface.co/docs/safetensors, "Format"). Every output shape is known from the checkpoint's pickles
before any tensor is read, so the header is written first, the file is sized, and each block (a run of whole rows of
one output tensor) is ``pwrite``-n at its place in one call: memory holds one block at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from opskit.ckpt.tensorfile import RowSpan

SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}

# A block of an output tensor: (values, first row); values are whole rows (1-D tensors: a run of elements), a tensor
# or a RowSpan still in the checkpoint file.
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
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (cast to ``dtype``) to ``path``; ``progress(source bytes)`` after each tensor.

    Returns:
        Bytes of tensor data written.
    """
    import torch

    itemsize = dtype.itemsize
    header: dict[str, dict] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    offsets = {}
    for t in tensors:
        nbytes = numel(t.shape) * itemsize
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[str(dtype)], "shape": list(t.shape),
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
        for t in tensors:
            row_bytes = numel(t.shape[1:]) * itemsize
            for values, row in t.blocks():
                at = data_start + offsets[t.name] + row * row_bytes
                if isinstance(values, RowSpan):
                    if values.ref.dtype == dtype and _copy_file_range(values, fd, at):
                        continue
                    values = values.read()
                _pwrite_all(fd, values.to(dtype).contiguous().view(-1).view(torch.uint8).numpy(), at)
            if progress:
                progress(t.source_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return offset


def _copy_file_range(span: RowSpan, fd: int, offset: int) -> bool:
    """Copy a span's bytes from its checkpoint file into ``fd`` at ``offset`` inside the kernel: ``copy_file_range``
    (same file system), else ``sendfile``; False when the tensor is not contiguous or neither call works here."""
    source = span.ref.file_range(span.start, span.stop)
    if source is None:
        return False
    src = os.open(span.ref.path, os.O_RDONLY)
    try:
        for copy in (_copy_range, _send_range):
            try:
                copy(src, fd, *source, offset)
                return True
            except OSError:  # EXDEV, EINVAL, ENOSYS: try the next way (a partial copy is simply rewritten)
                continue
        return False
    finally:
        os.close(src)


def _copy_range(src: int, fd: int, start: int, count: int, offset: int) -> None:
    while count:
        done = os.copy_file_range(src, fd, count, start, offset)
        if done == 0:
            raise OSError("copy_file_range copied nothing")
        start, offset, count = start + done, offset + done, count - done


def _send_range(src: int, fd: int, start: int, count: int, offset: int) -> None:
    os.lseek(fd, offset, os.SEEK_SET)
    while count:
        done = os.sendfile(fd, src, start, count)
        if done == 0:
            raise OSError("sendfile copied nothing")
        start, count = start + done, count - done


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` as transformers reads it."""
    from opskit.fsutil import atomic_write_text

    atomic_write_text(folder / "model.safetensors.index.json",
                      json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a shape."""
    n = 1
    for s in shape:
        n *= s
    return n
