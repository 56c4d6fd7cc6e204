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
their names (``"alibi"``). torch is imported only where tensor data is read: headers (``ckpt list``, ``inspect``)
never import it.

Format source: ``torch/serialization.py`` (``_save``/``_load``: persistent id ``('storage', StorageType, key,
location, numel)``, tensors rebuilt by ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import sys
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from opskit.errors import OpskitError


class TensorFileError(OpskitError, ValueError):
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
    # ValueError: a directory entry with impossible fields; NotImplementedError: "zip file version 12.7" (a flipped
    # byte in the directory)
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as e:
        raise TensorFileError(f"{path}: not a torch.save zip file ({e})") from None


# Zip headers (APPNOTE 4.3): end of central directory, its zip64 locator and record, central and local file headers.
_EOCD = struct.Struct("<4s4H2LH")
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_FULL = 0xFFFFFFFF


def _broken(path: Path, what: str) -> TensorFileError:
    return TensorFileError(f"{path}: broken zip structure ({what})")


def _central_directory(fd: int, path: Path, file_size: int) -> tuple[list[tuple], int]:
    """(central directory entries as ``(name bytes, header fields, local header offset, size)``, where the directory
    ends), read strictly as torch's reader (miniz) needs them: the end record last in the file (torch writes no
    comment), one disk, entry counts and directory bounds that agree, zip64 fields where 32 bits do not suffice.
    Python's zipfile forgives much of this, miniz does not (a flipped "disk number" byte is "unsupported multidisk")."""
    tail = os.pread(fd, _EOCD.size, file_size - _EOCD.size) if file_size >= _EOCD.size else b""
    if len(tail) < _EOCD.size:
        raise _broken(path, "no end of central directory")
    sig, disk, cd_disk, here, total, cd_size, cd_offset, comment = _EOCD.unpack(tail)
    end = file_size - _EOCD.size
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or here != total:
        raise _broken(path, "end of central directory")
    locator = os.pread(fd, _EOCD64_LOCATOR.size, end - _EOCD64_LOCATOR.size) if end >= _EOCD64_LOCATOR.size else b""
    if locator[:4] == b"PK\x06\x07" or _FULL in (cd_size, cd_offset) or 0xFFFF in (here, total):  # zip64
        sig, disk, offset, disks = _EOCD64_LOCATOR.unpack(locator) if len(locator) == 20 else (b"", 0, -1, 0)
        record = os.pread(fd, _EOCD64.size, offset) if 0 <= offset < file_size else b""
        if sig != b"PK\x06\x07" or disk or disks != 1 or len(record) < _EOCD64.size:
            raise _broken(path, "zip64 locator")
        sig, size, _made, _needed, disk, cd_disk, here, total, cd_size, cd_offset = _EOCD64.unpack(record)
        if sig != b"PK\x06\x06" or size != _EOCD64.size - 12 or disk or cd_disk or here != total:
            raise _broken(path, "zip64 end of central directory")
        end = offset
    if cd_offset + cd_size != end:
        raise _broken(path, "central directory size and offset")
    directory, entries, at = os.pread(fd, cd_size, cd_offset), [], 0
    for _ in range(total):
        fields = _CENTRAL.unpack_from(directory, at) if at + _CENTRAL.size <= len(directory) else None
        if fields is None or fields[0] != b"PK\x01\x02":
            raise _broken(path, f"central directory entry {len(entries)}")
        name_len, extra_len, comment_len, disk = fields[10:14]
        sizes = [fields[9], fields[8], fields[16]]  # uncompressed, compressed, local header offset
        name = directory[at + _CENTRAL.size:at + _CENTRAL.size + name_len]
        extra = directory[at + _CENTRAL.size + name_len:at + _CENTRAL.size + name_len + extra_len]
        sizes = _zip64_sizes(extra, sizes, path, name)
        directory_like = fields[15] & 0x10 or name.endswith(b"/")  # miniz then reads no data from it
        if disk or fields[2] & 0x41 or fields[4] != zipfile.ZIP_STORED or sizes[0] != sizes[1] or directory_like:
            raise _broken(path, f"{name!r} is split, encrypted, compressed, of two sizes or a directory")
        entries.append((name, fields[2:8], sizes[2], sizes[0]))  # needed, flags, method, time, date, crc
        at += _CENTRAL.size + name_len + extra_len + comment_len
    if at != len(directory):
        raise _broken(path, "central directory length")
    return entries, cd_offset


def _zip64_sizes(extra: bytes, sizes: list[int], path: Path, name: bytes) -> list[int]:
    """``sizes`` (uncompressed, compressed, offset) with each 0xFFFFFFFF replaced from the zip64 extra field."""
    wanted = [i for i, v in enumerate(sizes) if v == _FULL]
    at = 0
    while wanted and at + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, at)
        if kind == 1:
            if length < 8 * len(wanted):
                break
            for n, i in enumerate(wanted):
                sizes[i] = struct.unpack_from("<Q", extra, at + 4 + 8 * n)[0]
            return sizes
        at += 4 + length
    if wanted:
        raise _broken(path, f"{name!r} has no zip64 sizes")
    return sizes


def _checked_records(archive: zipfile.ZipFile, raw, path: Path) -> list[ZipRecord]:
    """Every record of ``archive``, checked against the file itself (headers only, :func:`_central_directory`): each
    local header where the directory says, agreeing with the directory on name, flags, method, time, CRC-32 and sizes;
    stored uncompressed, as ``torch.save`` writes; the data inside the file and ending before the next record (or the
    central directory) begins. A truncated, spliced or header-damaged file fails here.

    Raises:
        TensorFileError: naming the first record that fails.
    """
    fd = raw.fileno()
    file_size = os.fstat(fd).st_size
    entries, directory_start = _central_directory(fd, path, file_size)
    if len(entries) != len(archive.infolist()):
        raise _broken(path, "entry count")
    entries.sort(key=lambda e: e[2])
    ends = [e[2] for e in entries[1:]] + [directory_start]
    records = []
    for (name, central, offset, size), limit in zip(entries, ends, strict=True):
        text = name.decode("utf-8", "replace")
        header = os.pread(fd, _LOCAL.size, offset) if 0 <= offset < file_size else b""
        local = _LOCAL.unpack(header) if len(header) == _LOCAL.size else None
        if local is None or local[0] != b"PK\x03\x04":
            raise TensorFileError(f"{path}: broken zip record {text} (no local header at byte {offset})")
        name_len, extra_len = local[9:11]
        # With a data descriptor (flag bit 3, as torch writes) the local CRC and sizes are zero.
        described = (0, 0, 0) if central[1] & 0x08 else (central[5], size, size)
        agree = local[1:6] == central[:5] and (local[6:9] == described or local[7:9] == (_FULL, _FULL))
        if not agree or os.pread(fd, name_len, offset + _LOCAL.size) != name:
            raise TensorFileError(f"{path}: broken zip record {text} (its local header disagrees with the directory)")
        start = offset + _LOCAL.size + name_len + extra_len
        if start + size > file_size:
            raise TensorFileError(f"{path}: record {text} ends at byte {start + size}, past the end of the file "
                                  f"({file_size} bytes): truncated")
        if start + size > limit:
            raise TensorFileError(f"{path}: record {text} ends at byte {start + size}, inside what follows it "
                                  f"(byte {limit}): broken zip directory")
        records.append(ZipRecord(text, start, size, central[5]))
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
        except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, EOFError) as e:  # RuntimeError: "encrypted"
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
            # Importing a class's module can print: DeepSpeed's logger writes its accelerator line to stdout at import
            # (a bf16 pipeline step pickles DeepSpeed objects), which would break `--json` output.
            with contextlib.redirect_stdout(sys.stderr):
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

