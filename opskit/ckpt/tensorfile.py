"""Read ``torch.save`` files lazily: the pickled structure now, each tensor's bytes only when asked, with ``pread``.

A ``torch.save`` file (zip format, torch >= 1.6) is an uncompressed zip holding ``<name>/data.pkl`` (the pickled
object, whose tensors refer to storages by key) and one record ``<name>/data/<key>`` per storage. :func:`load_lazy`
unpickles ``data.pkl`` with every tensor replaced by a :class:`TensorRef` (file, record offset, dtype, shape, strides):
no tensor data is touched, so "are the headers loadable and is every record inside the file" (every local header where
the zip directory says, each record ending before the next begins, data.pkl's CRC-32) costs a few KB of reads per
file; :func:`verify_crc` reads everything and checks every record's CRC-32 (bytes flipped inside tensor data); a
converter can read one tensor (or a block of its rows) at a time, so its memory does not grow with the
file. Classes from modules that are not installed here (``megatron.enums.PositionEmbeddingType`` in Megatron-DeepSpeed's
saved ``args``) load as :class:`Missing` placeholders instead of failing; :class:`PositionEmbeddingType` values become
their names (``"alibi"``).

Format source: ``torch/serialization.py`` (``_save``/``_load``: persistent id ``('storage', StorageType, key,
location, numel)``, tensors rebuilt by ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``).
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path


class TensorFileError(ValueError):
    """A file that is not a readable ``torch.save`` zip (truncated, foreign, or a record outside the file)."""


# Megatron-DeepSpeed's megatron/enums.py: pickled into args as PositionEmbeddingType(value).
_POSITION_EMBEDDING_TYPES = {1: "rotary", 2: "absolute", 3: "alibi"}


ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "int8": 1, "int16": 2, "int32": 4,
             "int64": 8, "bool": 1}
_STORAGE_DTYPES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                   "DoubleStorage": "float64", "ByteStorage": "uint8", "CharStorage": "int8", "ShortStorage": "int16",
                   "IntStorage": "int32", "LongStorage": "int64", "BoolStorage": "bool"}


class Missing:
    """Placeholder for an object of a class this interpreter cannot (or, ``light``, should not) import; ``qualname``
    names the class, ``args`` are the arguments it was built with. One subclass per class path: pickle's ``NEWOBJ``
    needs a type (DeepSpeed's ``fragment_address`` in a bf16 optimizer's state)."""

    qualname = ""

    def __new__(cls, *args, **_kwargs):
        placeholder = super().__new__(cls)
        placeholder.args = args
        return placeholder

    def __setstate__(self, state):  # pickled instances restore their __dict__; keep nothing
        pass

    def __repr__(self) -> str:
        return f"Missing({self.qualname})"


_MISSING_CLASSES: dict[str, type[Missing]] = {}


def _missing_class(module: str, name: str):
    if name == "PositionEmbeddingType":
        return lambda value: _POSITION_EMBEDDING_TYPES.get(value, f"PositionEmbeddingType({value})")
    qualname = f"{module}.{name}"
    if qualname not in _MISSING_CLASSES:
        _MISSING_CLASSES[qualname] = type(name, (Missing,), {"qualname": qualname})
    return _MISSING_CLASSES[qualname]


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a ``torch.save`` file, not yet read.

    Attributes:
        path: the file. offset: byte offset of its storage record in the file. storage_offset: elements into the
        storage. shape, stride: in elements. dtype_name: torch's name of the dtype (``"bfloat16"``); ``dtype`` is the
        ``torch.dtype`` itself (importing torch).
    """

    path: Path
    offset: int
    storage_numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype_name: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def _is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self):
        """The tensor, in its own dtype and freshly allocated memory (not a file mapping)."""
        if not self._is_contiguous():  # rare (a saved view): read the whole storage and take the view
            import torch

            storage = self._pread(0, self.storage_numel)
            return torch.as_strided(storage, self.shape, self.stride, self.storage_offset).clone()
        return self._pread(self.storage_offset, self.numel).view(self.shape)

    def file_range(self, start: int, stop: int) -> tuple[int, int] | None:
        """(byte offset in the file, byte count) of rows ``[start, stop)``, or None for a non-contiguous tensor."""
        if not self._is_contiguous():
            return None
        row = self.numel // self.shape[0] if self.shape and self.shape[0] else 0
        return self.offset + (self.storage_offset + start * row) * self.itemsize, (stop - start) * row * self.itemsize

    def read_bytes(self) -> bytes | None:
        """The tensor's raw bytes (no torch), or None for a non-contiguous tensor."""
        if not self.shape or not self._is_contiguous():
            return None
        offset, count = self.file_range(0, self.shape[0])
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), count, offset)
        if len(data) != count:
            raise TensorFileError(f"{self.path}: ends inside a tensor record (truncated)")
        return data

    def read_rows(self, start: int, stop: int):
        """Rows ``[start, stop)`` along dim 0 of a contiguous tensor: ``[stop - start, *shape[1:]]``."""
        if not self._is_contiguous():
            return self.read()[start:stop]
        row = self.numel // self.shape[0] if self.shape and self.shape[0] else 0
        return self._pread(self.storage_offset + start * row, (stop - start) * row).view(stop - start,
                                                                                          *self.shape[1:])

    def _pread(self, first: int, count: int):
        import torch

        buffer = torch.empty(count * self.itemsize, dtype=torch.uint8)  # uninitialised: no zero-fill pass
        view, done, start = memoryview(buffer.numpy()), 0, self.offset + first * self.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise TensorFileError(f"{self.path}: ends inside a tensor record (truncated)")
                done += n
        finally:
            os.close(fd)
        return buffer.view(self.dtype)


@dataclass(frozen=True)
class FileBlock:
    """Where a block of output bytes lies in checkpoint files: ``rows`` rows, row ``i`` being the concatenation over
    ``pieces`` ``(path, offset, width)`` of the ``width`` bytes at ``offset + i * width`` of ``path``."""

    rows: int
    pieces: tuple[tuple[Path, int, int], ...]


@dataclass(frozen=True)
class RowSpan:
    """Rows ``[start, stop)`` of a tensor still in its file: a writer can copy the bytes file to file (no pass
    through torch) when no dtype change is needed, or :meth:`read` them."""

    ref: TensorRef
    start: int
    stop: int

    @property
    def dtype_name(self) -> str:
        return self.ref.dtype_name

    def file_block(self) -> FileBlock | None:
        """The span's bytes as one contiguous piece; None for a non-contiguous tensor."""
        where = self.ref.file_range(self.start, self.stop)
        return None if where is None else FileBlock(1, ((self.ref.path, *where),))

    def read(self):
        return self.ref.read_rows(self.start, self.stop)


@dataclass(frozen=True)
class ColumnSpan:
    """Rows ``[start, stop)`` of tensors still in their files, concatenated on dim 1 (TP shards of a row-parallel
    weight): output row ``i`` is row ``start + i`` of every ref in turn."""

    refs: tuple[TensorRef, ...]
    start: int
    stop: int

    @property
    def dtype_name(self) -> str:
        return self.refs[0].dtype_name

    def file_block(self) -> FileBlock | None:
        """One piece per ref (its rows' bytes, one row wide); None when a ref is not contiguous."""
        pieces = []
        for ref in self.refs:
            where = ref.file_range(self.start, self.stop)
            if where is None:
                return None
            pieces.append((ref.path, where[0], where[1] // max(1, self.stop - self.start)))
        return FileBlock(self.stop - self.start, tuple(pieces))

    def read(self):
        import torch

        return torch.cat([ref.read_rows(self.start, self.stop) for ref in self.refs], dim=1)


@dataclass(frozen=True)
class ZipRecord:
    """One record of a ``torch.save`` zip: its ``name``, where its data starts (byte offset), its ``size`` in bytes and
    the CRC-32 the central directory holds for it."""

    name: str
    start: int
    size: int
    crc: int


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as e:  # ValueError: a directory entry with impossible fields
        raise TensorFileError(f"{path}: not a torch.save zip file ({e})") from None


def _checked_records(archive: zipfile.ZipFile, raw, path: Path) -> list[ZipRecord]:
    """Every record of ``archive``, checked against the file itself (headers only): a local header where the central
    directory says, with the same name; stored uncompressed, as ``torch.save`` writes; the data inside the file and
    ending before the next record (or the central directory) begins. A truncated or spliced file fails here.

    Raises:
        TensorFileError: naming the first record that fails.
    """
    infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
    ends = [i.header_offset for i in infos[1:]] + [archive.start_dir]
    file_size = os.fstat(raw.fileno()).st_size
    records = []
    for info, limit in zip(infos, ends, strict=True):
        header = os.pread(raw.fileno(), 30, info.header_offset)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise TensorFileError(f"{path}: broken zip record {info.filename} (no local header at byte "
                                  f"{info.header_offset})")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        if os.pread(raw.fileno(), name_len, info.header_offset + 30) != name:
            raise TensorFileError(f"{path}: broken zip record {info.filename} (its local header names another)")
        if info.compress_type != zipfile.ZIP_STORED:
            raise TensorFileError(f"{path}: record {info.filename} is compressed (torch.save stores records as is)")
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > file_size:
            raise TensorFileError(f"{path}: record {info.filename} ends at byte {start + info.file_size}, past "
                                  f"the end of the file ({file_size} bytes): truncated")
        if start + info.file_size > limit:
            raise TensorFileError(f"{path}: record {info.filename} ends at byte {start + info.file_size}, inside "
                                  f"what follows it (byte {limit}): broken zip directory")
        records.append(ZipRecord(info.filename, start, info.file_size, info.CRC))
    return records


def _record_offsets(path: Path) -> tuple[str, dict[str, tuple[int, int]], bytes]:
    """(archive prefix, storage key -> (data offset, size), data.pkl bytes), reading only zip headers and data.pkl
    (whose CRC-32 is checked)."""
    archive = _open_zip(path)
    with archive, open(path, "rb") as raw:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise TensorFileError(f"{path}: no data.pkl record (not written by torch.save)")
        prefix = pickles[0][: -len("data.pkl")]
        records = {r.name[len(prefix) + len("data/"):]: (r.start, r.size)
                   for r in _checked_records(archive, raw, path) if r.name.startswith(prefix + "data/")}
        try:
            pickled = archive.read(pickles[0])
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise TensorFileError(f"{path}: {pickles[0]} unreadable ({e})") from None
    return prefix, records, pickled


def verify_crc(path: str | Path, block: int = 16 << 20) -> int:
    """Read every record of a ``torch.save`` zip to its end and compare its CRC-32 with the zip directory's: the one
    check that sees bytes changed inside tensor data (headers alone cannot). Reads the whole file, ``block`` bytes
    at a time.

    Returns:
        The number of bytes read.

    Raises:
        TensorFileError: a broken zip (as :func:`load_lazy`), or the first record whose data does not match its CRC.
    """
    path = Path(path)
    archive = _open_zip(path)
    done = 0
    with archive, open(path, "rb") as raw:
        for record in _checked_records(archive, raw, path):
            crc = 0
            for offset in range(record.start, record.start + record.size, block):
                data = os.pread(raw.fileno(), min(block, record.start + record.size - offset), offset)
                crc = zlib.crc32(data, crc)
                done += len(data)
            if crc != record.crc:
                raise TensorFileError(f"{path}: record {record.name} fails its CRC-32 check (its bytes changed "
                                      "after torch.save wrote them)")
    return done


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path, records: dict[str, tuple[int, int]], light: bool):
        import io

        super().__init__(io.BytesIO(data))
        self.path, self.records, self.light = path, records, light

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *rest: data
        if module == "torch" and name in _STORAGE_DTYPES:  # legacy typed storage classes: keep the dtype's name
            return _STORAGE_DTYPES[name]
        if (module, name) == ("torch", "Size"):  # param_shapes in mp_rank files
            return tuple
        if self.light and module == "torch" and name in ITEMSIZES:  # a dtype in args (Megatron's params_dtype)
            return f"torch.{name}"
        if self.light and module.split(".")[0] in ("torch", "numpy", "deepspeed", "megatron"):
            return _missing_class(module, name)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _missing_class(module, name)

    def persistent_load(self, pid):
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or key not in self.records:
            raise TensorFileError(f"{self.path}: storage {key!r} has no record in the zip")
        if storage_type not in ITEMSIZES:
            raise TensorFileError(f"{self.path}: storage {key!r} of an unsupported type {storage_type!r}")
        offset, size = self.records[key]
        if size < numel * ITEMSIZES[storage_type]:
            raise TensorFileError(f"{self.path}: storage record {key} holds {size} bytes, expected "
                                  f"{numel * ITEMSIZES[storage_type]}")
        return (offset, numel, storage_type)

    def _rebuild_tensor(self, storage, storage_offset, size, stride, *_ignored):
        offset, numel, dtype = storage
        return TensorRef(self.path, offset, numel, storage_offset, tuple(size), tuple(stride), dtype)


def load_lazy(path: str | Path, light: bool = False):
    """Unpickle a ``torch.save`` zip file with :class:`TensorRef` in place of every tensor (no data read).
    ``light``: neither torch, numpy, deepspeed nor megatron is imported; their other objects (RNG states' numpy arrays)
    become :class:`Missing` placeholders.

    Raises:
        TensorFileError: not a zip, a record past the end of the file (truncated), or an unreadable pickle.
    """
    path = Path(path)
    _prefix, records, pickled = _record_offsets(path)
    try:
        return _LazyUnpickler(pickled, path, records, light).load()
    except TensorFileError:
        raise
    except Exception as e:  # a corrupt pickle: name it in one line
        raise TensorFileError(f"{path}: cannot unpickle data.pkl ({type(e).__name__}: {e})") from None


def materialize(obj):
    """``obj`` with every :class:`TensorRef` inside (dicts, lists, tuples) read into a tensor."""
    if isinstance(obj, TensorRef):
        return obj.read()
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, materialize(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(materialize(v) for v in obj)
    return obj

