"""Corpus preparation (``opskit data prepare``): text corpus -> byte-level BPE tokenizer + Megatron indexed dataset.

`prepare_data` turns documents into the two things a Megatron-style trainer reads:

* a tokenizer folder (``tokenizer.json`` from the `tokenizers` library plus
  ``tokenizer_config.json`` and ``special_tokens_map.json``) that
  ``transformers.AutoTokenizer.from_pretrained(folder)`` loads (checked with 4.57 and 5.23),
  i.e. Megatron's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <folder>``;
* Megatron's mmap indexed dataset ``<name>_text_document.bin`` / ``.idx`` (the ``MMIDIDX``
  format), written by megatron-core's ``IndexedDatasetBuilder`` exactly as
  ``tools/preprocess_data.py --append-eod`` does: one sequence per document, each ending with
  the end-of-document token ``</s>``. Its path without suffix is Megatron's ``--data-path``.

Special tokens follow BLOOM's convention: ``<unk>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos/eod),
``<pad>``=3.

Sources:

* ``.jsonl`` files, one JSON object per line with the document under ``"text"`` (the
  convention of Megatron's ``preprocess_data.py``), and ``.txt`` files, one document per file;
* the named corpus ``"kjv"``: the King James Version of the Bible (1611), 1189 documents, one per
  chapter, about 4.1 MB of ASCII text. The text is public domain (its copyright expired; only in
  the United Kingdom does the Crown still hold rights to it by letters patent). It is printed by
  the ``bible`` command of the Debian package ``bible-kjv`` (Bible Retrieval System by Chip
  Chapin, "unrestricted use", with Debian changes under GPL-2+) from the data in
  ``bible-kjv-text``; see /usr/share/doc/bible-kjv/copyright. Only the program's output text is
  used here: no code of it is copied or linked.

`torch`, `numpy`, `tokenizers` and megatron-core (the ``opskit[train]`` extra) are imported
inside the functions that need them, so importing this module stays cheap for the CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from opskit.errors import OpskitError
from opskit.fsutil import (
    OutputRefusedError,
    atomic_write_text,
    claim_dir,
    folder_entries,
    has_marker,
    replace_dir,
    staging_path,
    write_marker,
)

if TYPE_CHECKING:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MIN_VOCAB_SIZE = 300
"""Smallest accepted vocab: 256 byte symbols + 4 special tokens + some merges."""

KJV = "kjv"
KJV_CHAPTERS = 1189
KJV_DEBIAN_PACKAGE = "bible-kjv"
_KJV_RANGE = "Genesis1:1-Revelation22:21"
_KJV_HEADING = re.compile(r"\S.* \d+")  # "Genesis 1", "Song of Solomon 2", "1 John 5"
_KJV_VERSE = re.compile(r"\s+\d+ (.*)")  # "  12 And the earth brought forth grass, ..."

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
_MANIFEST_VERSION = 1
_BATCH = 256  # documents per encode_batch call and per progress report

Source = str | Path | Sequence[str | Path]
"""``"kjv"``, one ``.jsonl``/``.txt`` path, or a list of such paths."""
Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``; see `prepare_data` for the stages."""


class DataError(OpskitError, ValueError):
    """Bad input or output for data preparation; the message is one line naming the culprit (a ValueError too,
    for callers older than :class:`OpskitError`)."""


@dataclass(frozen=True)
class PreparedData:
    """What `prepare_data` produced.

    Attributes:
        tokenizer_dir: folder with ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json``.
        data_prefix: ``<output_dir>/<name>_text_document``, without ``.bin``/``.idx``
            (Megatron's ``--data-path``).
        num_documents: documents written, one sequence each.
        num_tokens: tokens written, including one appended ``</s>`` per document.
        vocab_size: the trained tokenizer's actual vocab size (can be below the requested
            size on a small corpus).
        reused: True when the outputs already matched the inputs and nothing was rebuilt.
    """

    tokenizer_dir: Path
    data_prefix: Path
    num_documents: int
    num_tokens: int
    vocab_size: int
    reused: bool = False


# --------------------------------------------------------------------------- corpus reading


def kjv_documents() -> list[str]:
    """Extract the King James Bible as one document per chapter.

    Runs ``bible -l80 Genesis1:1-Revelation22:21`` (Debian package ``bible-kjv``, installed with
    apt-get when missing and running as root), drops chapter headings and verse numbers, and joins
    wrapped lines and verses with single spaces.

    Returns:
        1189 strings (Genesis 1 .. Revelation 22), 4,136,659 ASCII characters in all; the first
        starts with "In the beginning God created the heaven and the earth.".

    Raises:
        DataError: if the ``bible`` command is missing and cannot be installed, fails, or its
            output does not have 1189 chapters.
    """
    command = [_bible_command(), "-l80", _KJV_RANGE]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as err:
        raise DataError(f"{' '.join(command)}: failed to print the KJV text ({err})") from None
    chapters = _parse_bible(result.stdout)
    if len(chapters) != KJV_CHAPTERS:
        raise DataError(f"bible output: expected {KJV_CHAPTERS} chapters, got {len(chapters)}")
    return chapters


def _bible_command() -> str:
    """Path of the ``bible`` program, installing Debian's ``bible-kjv`` if possible."""
    found = shutil.which("bible")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise DataError(
            f"bible: command not found; install the Debian package {KJV_DEBIAN_PACKAGE} "
            f"(apt-get install {KJV_DEBIAN_PACKAGE}) or pass .jsonl/.txt files instead of 'kjv'"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", KJV_DEBIAN_PACKAGE]
    for command in (["apt-get", "update", "-qq"], install):
        try:
            subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        except subprocess.CalledProcessError as err:
            last = (err.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"{' '.join(command)}: exit {err.returncode} ({last})") from None
        except OSError as err:
            raise DataError(f"{' '.join(command)}: {err}") from None
    return shutil.which("bible") or "bible"


def _parse_bible(text: str) -> list[str]:
    """Split ``bible`` output into chapters of plain prose.

    The layout is: blank line, heading ``Book N``, blank line, then verses ``  N text`` whose
    overflow continues on unindented lines.

    Args:
        text: the program's stdout.

    Returns:
        One string per chapter, verses joined by single spaces.

    Raises:
        DataError: on a line before the first heading.
    """
    chapters: list[list[str]] = []
    after_blank = True
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            after_blank = True
            continue
        verse = _KJV_VERSE.fullmatch(line)
        if after_blank and _KJV_HEADING.fullmatch(line):
            chapters.append([])
        elif chapters and verse:
            chapters[-1].append(verse.group(1))
        elif chapters and chapters[-1]:
            chapters[-1][-1] += " " + line.strip()
        else:
            raise DataError(f"bible output, line {number}: expected a heading, got {line!r}")
        after_blank = False
    return [" ".join(verses) for verses in chapters]


def load_corpus(source: Source) -> Iterator[str]:
    """Yield the documents of a corpus, in order; empty documents are skipped.

    Args:
        source: the string ``"kjv"`` (see `kjv_documents`), or a path or list of paths to
            ``.jsonl`` files (one JSON object per line, document under ``"text"``; blank lines
            ignored) and ``.txt`` files (the whole UTF-8 file is one document, kept byte for
            byte).

    Returns:
        An iterator of document strings; files are read lazily, one at a time.

    Raises:
        DataError: on a missing file, an unsupported suffix, invalid UTF-8, or a jsonl line
            that is not a JSON object with a string ``"text"`` (naming file and line number).
    """
    if _is_kjv(source):
        yield from kjv_documents()
        return
    for path in _input_paths(source):
        yield from _read_file(path)


def _is_kjv(source: Source) -> bool:
    return isinstance(source, str) and source == KJV


def _input_paths(source: Source) -> list[Path]:
    """Check that every input is an existing ``.jsonl``/``.txt`` file.

    Raises:
        DataError: on an empty list, a missing file or another suffix.
    """
    items = [source] if isinstance(source, (str, Path)) else list(source)
    if not items:
        raise DataError(f"source: expected '{KJV}' or at least one .jsonl/.txt path, got none")
    paths = [Path(item) for item in items]
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: input file not found")
        if path.suffix not in (".jsonl", ".txt"):
            raise DataError(f"{path}: expected a .jsonl or .txt file, got suffix {path.suffix!r}")
    return paths


def _read_file(path: Path) -> Iterator[str]:
    """Documents of one ``.jsonl`` or ``.txt`` file (see `load_corpus`)."""
    if path.suffix == ".txt":
        yield from _read_txt(path)
    else:
        yield from _read_jsonl(path)


def _read_txt(path: Path) -> Iterator[str]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: expected UTF-8 text, {err.reason} at byte {err.start}") from None
    if text:
        yield text


def _read_jsonl(path: Path) -> Iterator[str]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                text = _jsonl_text(line, f"{path}, line {number}")
                if text:
                    yield text


def _jsonl_text(line: bytes, where: str) -> str:
    """The ``"text"`` field of one jsonl line; `where` names file and line for errors."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: expected UTF-8, {err.reason} at byte {err.start}") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where}: expected a JSON object with a string field 'text'")
    return text


# --------------------------------------------------------------------------- preparation


def output_paths(output_dir: str | Path, name: str) -> tuple[Path, Path]:
    """``(tokenizer folder, data prefix)`` that `prepare_data` writes under `output_dir` for dataset `name`."""
    output_dir = Path(output_dir)
    return output_dir / TOKENIZER_DIR, output_dir / f"{name}_text_document"


def prepare_data(
    source: Source,
    output_dir: str | Path,
    vocab_size: int,
    name: str = "corpus",
    progress: Progress | None = None,
    force: bool = False,
) -> PreparedData:
    """Train a byte-level BPE tokenizer on a corpus and write Megatron's indexed dataset.

    Writes into `output_dir`: ``tokenizer/`` (see module docstring),
    ``<name>_text_document.bin``/``.idx`` (uint16 tokens when the vocab is below 65500, else
    int32), ``manifest.json``, and for ``"kjv"`` the extracted corpus ``kjv.jsonl``, which later
    runs read instead of calling ``bible``. Every file is written under a temporary name and
    renamed; ``manifest.json`` is written last. When it matches the request (name, vocab_size,
    SHA-256 of every input file) and the outputs are intact, nothing is rebuilt.

    Ownership: `output_dir` must be missing, empty (its mode is kept) or opskit's own (its
    ``.opskit`` marker, or the ``manifest.json`` of an earlier preparation); it is marked before
    anything is written into it. Outputs of the same request are rebuilt when damaged or
    unfinished; a dataset prepared for another request is replaced only with `force`.

    Args:
        source: ``"kjv"``, a ``.jsonl``/``.txt`` path, or a list of them (see `load_corpus`).
        output_dir: folder for the outputs; created if missing.
        vocab_size: requested tokenizer vocab size including the 4 special tokens; >= 300.
        name: dataset name used in the file names; letters, digits, ``.``, ``_``, ``-``.
        progress: optional ``progress(stage, done, total)`` callback. Stages, in order:
            ``"extract"`` (kjv only, 0/1 then 1/1), ``"scan"`` (files read), ``"train"`` and
            ``"tokenize"`` (documents processed out of all documents).
        force: rebuild over a dataset opskit prepared here for other inputs or settings.

    Returns:
        The `PreparedData` describing the outputs; ``reused`` tells whether they were kept.

    Raises:
        DataError: on a bad vocab_size or name, unreadable/invalid inputs (see `load_corpus`),
            or a corpus without any non-empty document.
        OutputRefusedError: `output_dir` is a file or holds files opskit did not write (also with
            `force`), or (without `force`) a dataset prepared for another request.
    """
    _check_vocab_size(vocab_size)
    _check_name(name)
    output_dir = Path(output_dir)
    earlier = _claim_output_dir(output_dir)
    report = progress or (lambda stage, done, total: None)
    paths = _kjv_cache(output_dir, report) if _is_kjv(source) else _input_paths(source)
    request = {
        "version": _MANIFEST_VERSION,
        "name": name,
        "requested_vocab_size": vocab_size,
        "inputs": [_fingerprint(path) for path in paths],
    }
    reused = _reuse(output_dir, request)
    if reused is not None:
        return reused
    if earlier is not None and {key: earlier.get(key) for key in request} != request and not force:
        raise OutputRefusedError(f"{output_dir}: holds a dataset opskit prepared with other inputs or settings; "
                                 "--force rebuilds it")
    (output_dir / MANIFEST).unlink(missing_ok=True)
    num_documents = _count_documents(paths, report)
    if num_documents == 0:
        raise DataError(f"{', '.join(map(str, paths))}: empty corpus, no non-empty document")
    tokenizer = _train_tokenizer(
        _reporting(_documents(paths), "train", num_documents, report), vocab_size, num_documents
    )
    tokenizer_dir, data_prefix = output_paths(output_dir, name)
    _save_tokenizer(tokenizer, tokenizer_dir)
    num_tokens = _write_indexed_dataset(
        tokenizer, _reporting(_documents(paths), "tokenize", num_documents, report), data_prefix
    )
    result = PreparedData(
        tokenizer_dir, data_prefix, num_documents, num_tokens, tokenizer.get_vocab_size()
    )
    _write_json_atomic(output_dir / MANIFEST, {**request, **_result_fields(result)})
    return result


def _claim_output_dir(output_dir: Path) -> dict | None:
    """Create or adopt `output_dir` for `prepare_data` (see its ownership rule) and mark it; return the manifest of
    an earlier preparation there, if any.

    Raises:
        OutputRefusedError: a file, or a non-empty folder that is not opskit's.
    """
    earlier = _earlier_manifest(output_dir)
    if earlier is None and not has_marker(output_dir):
        claim_dir(output_dir, force=False, flag="data.dir")
    output_dir.mkdir(parents=True, exist_ok=True)
    if not has_marker(output_dir):
        write_marker(output_dir, "data prepare")
    return earlier


def _earlier_manifest(output_dir: Path) -> dict | None:
    """``manifest.json`` of an earlier `prepare_data` (its fields say so; folders prepared before the ``.opskit``
    marker existed have only this), else None."""
    try:
        manifest = json.loads((output_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    fields = ("version", "name", "requested_vocab_size", "inputs")
    return manifest if isinstance(manifest, dict) and all(key in manifest for key in fields) else None


def _check_vocab_size(vocab_size: int) -> None:
    is_int = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if not is_int or vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab_size: expected an integer >= {MIN_VOCAB_SIZE} for byte-level BPE (256 byte "
            f"symbols + {len(SPECIAL_TOKENS)} special tokens + merges), got {vocab_size!r}"
        )


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise DataError(f"name: expected letters, digits, '.', '_', '-' only, got {name!r}")


def _kjv_cache(output_dir: Path, report: Progress) -> list[Path]:
    """``[output_dir/kjv.jsonl]``, extracting the KJV into it first if it is missing."""
    cache = output_dir / f"{KJV}.jsonl"
    if not cache.is_file():
        report("extract", 0, 1)
        lines = "".join(json.dumps({"text": text}) + "\n" for text in kjv_documents())
        atomic_write_text(cache, lines)
        report("extract", 1, 1)
    return [cache]


def _fingerprint(path: Path) -> dict[str, str | int]:
    """Absolute path, size in bytes and SHA-256 of an input file, for the manifest."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _reuse(output_dir: Path, request: dict) -> PreparedData | None:
    """The existing result if ``manifest.json`` matches `request` and the outputs are intact."""
    try:
        manifest = json.loads((output_dir / MANIFEST).read_text())
        if any(manifest.get(key) != value for key, value in request.items()):
            return None
        result = PreparedData(
            tokenizer_dir=output_dir / TOKENIZER_DIR,
            data_prefix=output_dir / manifest["data_prefix"],
            num_documents=manifest["num_documents"],
            num_tokens=manifest["num_tokens"],
            vocab_size=manifest["vocab_size"],
            reused=True,
        )
        bin_bytes = _suffixed(result.data_prefix, ".bin").stat().st_size
        intact = (
            (result.tokenizer_dir / "tokenizer.json").is_file()
            and _suffixed(result.data_prefix, ".idx").is_file()
            and bin_bytes == result.num_tokens * _token_dtype(result.vocab_size)().itemsize
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if intact else None


def _result_fields(result: PreparedData) -> dict[str, str | int]:
    """The manifest's description of the outputs (paths relative to the output folder)."""
    return {
        "data_prefix": result.data_prefix.name,
        "dtype": _token_dtype(result.vocab_size).__name__,
        "num_documents": result.num_documents,
        "num_tokens": result.num_tokens,
        "vocab_size": result.vocab_size,
    }


def _documents(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        yield from _read_file(path)


def _count_documents(paths: list[Path], report: Progress) -> int:
    """Read every input once, validating it; reports ``("scan", files_done, files)``."""
    count = 0
    for done, path in enumerate(paths, 1):
        count += sum(1 for _ in _read_file(path))
        report("scan", done, len(paths))
    return count


def _reporting(documents: Iterable[str], stage: str, total: int, report: Progress) -> Iterator[str]:
    """Pass `documents` through, reporting ``(stage, done, total)`` every `_BATCH` and at end."""
    done = 0
    report(stage, 0, total)
    for done, document in enumerate(documents, 1):
        yield document
        if done % _BATCH == 0:
            report(stage, done, total)
    if done % _BATCH:
        report(stage, done, total)


def _train_tokenizer(
    documents: Iterable[str], vocab_size: int, num_documents: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, no prefix space) with `tokenizers`.

    Args:
        documents: training texts.
        vocab_size: target vocab size including the special tokens (>= 300).
        num_documents: number of documents, if known (only used for the trainer's bookkeeping).

    Returns:
        A `tokenizers.Tokenizer` with ``<unk>``, ``<s>``, ``</s>``, ``<pad>`` at ids 0..3, all 256
        byte symbols, and up to ``vocab_size`` entries; no post-processor (no bos/eos added).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer, length=num_documents)
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Atomically (re)place `folder` with the tokenizer and its transformers config files.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``,
    no clean-up of spaces so decoding is lossless) and ``special_tokens_map.json``, so that
    ``transformers.AutoTokenizer.from_pretrained(folder)`` works without importing transformers
    here (it belongs to the ``opskit[convert]`` extra).

    Args:
        tokenizer: a tokenizer from `_train_tokenizer`.
        folder: destination folder; an existing one is replaced when its marker says `data prepare` wrote it and
            it holds nothing else (:func:`opskit.fsutil.claim_dir`).

    Raises:
        OutputRefusedError: `folder` holds files the preparation did not write (named), or is not opskit's.
    """
    special = dict(zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS, strict=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **special,
    }
    staging = staging_path(folder)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        write_marker(staging, "data prepare", folder_entries(staging))
        claim_dir(folder, force=True, flag="data.dir", command="data prepare")  # only files it wrote are replaced
        replace_dir(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_indexed_dataset(
    tokenizer: Tokenizer, documents: Iterable[str], data_prefix: Path
) -> int:
    """Tokenize documents and write ``<data_prefix>.bin``/``.idx`` with megatron-core.

    Each document becomes one sequence ``tokenizer.encode(doc).ids + [EOS_ID]`` and one document
    (Megatron's ``--append-eod``). Special-token strings inside the text (a literal ``</s>``)
    are encoded as plain text, so only the appended eod marks a document end. Both files are
    written under temporary names and renamed.

    Args:
        tokenizer: the tokenizer to encode with.
        documents: document texts.
        data_prefix: output path without the ``.bin``/``.idx`` suffix.

    Returns:
        The number of tokens written, eod tokens included.
    """
    import torch

    indexed_dataset = _indexed_dataset_module()
    dtype = _token_dtype(tokenizer.get_vocab_size())
    final = {suffix: _suffixed(data_prefix, suffix) for suffix in (".bin", ".idx")}
    staging = {suffix: staging_path(path) for suffix, path in final.items()}
    tokenizer.encode_special_tokens = True  # not saved in tokenizer.json; affects encoding only
    num_tokens = 0
    try:
        builder = indexed_dataset.IndexedDatasetBuilder(str(staging[".bin"]), dtype=dtype)
        for batch in _batches(documents, _BATCH):
            for encoding in tokenizer.encode_batch(batch):
                builder.add_item(torch.tensor(encoding.ids + [EOS_ID], dtype=torch.int64))
                builder.end_document()
                num_tokens += len(encoding.ids) + 1
        builder.finalize(str(staging[".idx"]))
        for suffix in (".bin", ".idx"):
            os.replace(staging[suffix], final[suffix])
    finally:
        for path in staging.values():
            path.unlink(missing_ok=True)
    return num_tokens


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _token_dtype(vocab_size: int) -> type:
    """numpy.uint16 below 65500 token ids, else numpy.int32 (megatron's `DType.optimal_dtype`)."""
    import numpy

    return numpy.uint16 if vocab_size < 65500 else numpy.int32


def _indexed_dataset_module() -> ModuleType:
    """Import ``megatron.core.datasets.indexed_dataset``.

    Importing it imports all of ``megatron.core`` (a few seconds on CPU), which warns four times
    that Transformer Engine and Apex are missing; those are irrelevant to data files and hidden.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _suffixed(data_prefix: Path, suffix: str) -> Path:
    """``<data_prefix>.bin`` / ``.idx`` (the prefix may itself contain dots)."""
    return data_prefix.with_name(data_prefix.name + suffix)


def _write_json_atomic(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- reading back


class TokenDocuments:
    """Read-only access to a prepared dataset: one array of token ids per document.

    A thin wrapper over megatron-core's ``IndexedDataset`` (the ``indexed`` attribute), which
    mmaps the files. It hands out copies because megatron's arrays are views into mmaps that its
    ``__del__`` unmaps: ``IndexedDataset(p)[0].tolist()`` without keeping the dataset alive
    reads freed memory and kills the interpreter with a segmentation fault.

    Attributes:
        indexed: the underlying ``megatron.core.datasets.indexed_dataset.IndexedDataset``; keep a
            reference to it for as long as arrays obtained from it are used.
    """

    def __init__(self, indexed: IndexedDataset) -> None:
        self.indexed = indexed

    def __len__(self) -> int:
        """Number of documents (one sequence each)."""
        return len(self.indexed)

    def __getitem__(self, index: int) -> numpy.ndarray:
        """Token ids of document `index` (negative counts from the end), ending with ``EOS_ID``.

        Returns:
            A 1-D uint16 (vocab < 65500) or int32 numpy array, shape ``[document length]``.

        Raises:
            IndexError: if `index` is out of range.
        """
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} out of range for {len(self)} documents")
        return self.indexed[index % len(self)].copy()

    def __iter__(self) -> Iterator[numpy.ndarray]:
        return (self[index] for index in range(len(self)))

    @property
    def lengths(self) -> numpy.ndarray:
        """Tokens per document, eod included: int32 array of shape ``[len(self)]``."""
        return self.indexed.sequence_lengths.copy()


def read_documents(data_prefix: str | Path) -> TokenDocuments:
    """Open a prepared dataset with megatron-core's mmap reader (CPU only, no CUDA needed).

    Args:
        data_prefix: path without ``.bin``/``.idx``, e.g. ``PreparedData.data_prefix``.

    Returns:
        A `TokenDocuments`: ``len(docs)`` documents, ``docs[i]`` document ``i``'s token ids.

    Raises:
        DataError: if ``<data_prefix>.bin`` or ``.idx`` is missing.
    """
    data_prefix = Path(data_prefix)
    for suffix in (".bin", ".idx"):
        path = _suffixed(data_prefix, suffix)
        if not path.is_file():
            raise DataError(f"{path}: indexed dataset file not found (run prepare_data first)")
    return TokenDocuments(_indexed_dataset_module().IndexedDataset(str(data_prefix)))
