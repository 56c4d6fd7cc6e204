"""Tests for opskit.data.corpus on the real King James Bible text, tokenizers and megatron-core."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from opskit.data.corpus import (
    EOS_ID,
    PAD_ID,
    DataError,
    PreparedData,
    kjv_documents,
    load_corpus,
    prepare_data,
    read_documents,
)
from opskit.errors import OpskitError

# Not from the KJV: exercises the byte-level round trip on non-ASCII, CRLF, tabs, double spaces.
UNICODE_DOC = "Genèse 1\r\n\t« Au commencement »  Dieu créa — 起初神创造天地 🙂\n"


@pytest.fixture(scope="session")
def kjv() -> list[str]:
    """The real corpus; tests that use it skip where Debian's bible-kjv is not installed."""
    if shutil.which("bible") is None:
        pytest.skip("needs the `bible` command: apt-get install bible-kjv")
    return kjv_documents()


@pytest.fixture(scope="session")
def small_inputs(kjv, tmp_path_factory) -> list[Path]:
    """Genesis 1-5 as a jsonl (with a blank line), Exodus 1-2 and a Unicode text as .txt files."""
    folder = tmp_path_factory.mktemp("inputs")
    jsonl = folder / "genesis.jsonl"
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(kjv[:5])]
    jsonl.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    texts = {"exodus1.txt": kjv[50], "exodus2.txt": kjv[51], "unicode.txt": UNICODE_DOC}
    for file_name, text in texts.items():
        (folder / file_name).write_bytes(text.encode("utf-8"))
    return [jsonl] + [folder / file_name for file_name in texts]


@pytest.fixture(scope="session")
def small(small_inputs, tmp_path_factory) -> PreparedData:
    return prepare_data(small_inputs, tmp_path_factory.mktemp("small"), 1000, name="small")


def _mtimes(prepared: PreparedData) -> dict[str, int]:
    files = [
        prepared.tokenizer_dir / "tokenizer.json",
        Path(f"{prepared.data_prefix}.bin"),
        Path(f"{prepared.data_prefix}.idx"),
        prepared.data_prefix.parent / "manifest.json",
    ]
    return {file.name: file.stat().st_mtime_ns for file in files}


def test_load_corpus_reads_jsonl_and_txt_in_order(kjv, small_inputs):
    assert list(load_corpus(small_inputs)) == kjv[:5] + [kjv[50], kjv[51], UNICODE_DOC]
    assert list(load_corpus(str(small_inputs[1]))) == [kjv[50]]


def test_tokens_round_trip_through_megatron_indexed_dataset(small_inputs, small):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = list(load_corpus(small_inputs))
    tokenizer = Tokenizer.from_file(str(small.tokenizer_dir / "tokenizer.json"))
    expected = [tokenizer.encode(document).ids + [EOS_ID] for document in documents]
    megatron = IndexedDataset(str(small.data_prefix))  # megatron's own reader, kept alive

    assert len(megatron) == small.num_documents == len(documents) == 8
    assert [megatron[index].tolist() for index in range(len(megatron))] == expected
    assert megatron[0].dtype == np.uint16
    assert megatron.document_indices.tolist() == list(range(len(documents) + 1))
    assert int(megatron.sequence_lengths.sum()) == small.num_tokens
    assert small.vocab_size == tokenizer.get_vocab_size() == 1000

    reader = read_documents(small.data_prefix)
    assert len(reader) == len(documents)
    assert [tokens.tolist() for tokens in reader] == expected
    assert reader[-1].tolist() == expected[-1]
    assert reader.lengths.tolist() == [len(tokens) for tokens in expected]
    with pytest.raises(IndexError):
        reader[len(documents)]


def test_arrays_outlive_the_reader(small):
    """megatron unmaps its files in __del__; read_documents must hand out copies (or segfault)."""
    first = read_documents(small.data_prefix)[0]
    lengths = read_documents(small.data_prefix).lengths
    gc.collect()
    assert first[-1] == EOS_ID and len(first) == lengths[0] > 100


def test_idx_file_is_mmidIdx_with_uint16_tokens(small):
    header = Path(f"{small.data_prefix}.idx").read_bytes()[:34]
    assert header[:9] == b"MMIDIDX\x00\x00"
    assert int.from_bytes(header[9:17], "little") == 1  # version
    assert header[17] == 8  # megatron's DType code for uint16
    assert int.from_bytes(header[18:26], "little") == small.num_documents  # sequences
    assert int.from_bytes(header[26:34], "little") == small.num_documents + 1  # doc indices
    assert Path(f"{small.data_prefix}.bin").stat().st_size == 2 * small.num_tokens


def test_tokenizer_folder_loads_with_transformers_and_decodes_losslessly(small_inputs, small):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(small.tokenizer_dir))
    plain = PreTrainedTokenizerFast(tokenizer_file=str(small.tokenizer_dir / "tokenizer.json"))
    dataset = read_documents(small.data_prefix)
    for index, document in enumerate(load_corpus(small_inputs)):
        ids = hf(document, add_special_tokens=False)["input_ids"]
        assert ids == dataset[index][:-1].tolist()
        assert hf.decode(ids) == document
        assert plain.decode(ids) == document
    first = dataset[0].tolist()
    assert hf.decode(first, skip_special_tokens=False) == next(load_corpus(small_inputs)) + "</s>"


def test_special_token_ids_follow_bloom(small):
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.from_file(str(small.tokenizer_dir / "tokenizer.json"))
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<pad>")] == [0, 1, 2, 3]
    hf = AutoTokenizer.from_pretrained(str(small.tokenizer_dir))
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2, 3)
    assert tokenizer.encode("In the beginning").ids[0] > 3  # no bos is prepended


def test_literal_special_token_text_is_not_an_end_of_document(tmp_path):
    corpus = tmp_path / "tricky.txt"
    corpus.write_text("Text that quotes </s> and <pad> markup. " * 20)
    prepared = prepare_data([corpus], tmp_path / "out", 300)
    tokens = read_documents(prepared.data_prefix)[0].tolist()
    assert tokens[-1] == EOS_ID
    assert not {EOS_ID, PAD_ID} & set(tokens[:-1])


def test_kjv_documents_are_unwrapped_chapters_without_verse_numbers(kjv):
    assert len(kjv) == 1189
    assert kjv[0].startswith(
        "In the beginning God created the heaven and the earth. And the earth was without form,"
    )
    assert "upon the face of the deep. And the Spirit" in kjv[0]  # a wrapped line, rejoined
    assert kjv[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert not any(re.search(r"\d|\n", document) for document in kjv)  # the KJV has no digits
    assert sum(len(document.encode()) for document in kjv) > 3_000_000


def test_prepare_full_kjv_then_reuse_without_bible(kjv, tmp_path, monkeypatch):
    started = time.perf_counter()
    first = prepare_data("kjv", tmp_path, 8000, name="kjv")
    elapsed = time.perf_counter() - started
    print(f"prepare_data('kjv', vocab 8000): {elapsed:.1f} s, {first.num_tokens} tokens")

    assert first.data_prefix == tmp_path / "kjv_text_document"
    assert (first.num_documents, first.vocab_size, first.reused) == (1189, 8000, False)
    assert int(read_documents(first.data_prefix).lengths.sum()) == first.num_tokens > 800_000
    assert len((tmp_path / "kjv.jsonl").read_text().splitlines()) == 1189

    monkeypatch.setenv("PATH", "")  # no `bible`, no apt-get: the cached jsonl must suffice
    again = prepare_data("kjv", tmp_path, 8000, name="kjv")
    assert again == dataclasses.replace(first, reused=True)


def test_second_run_skips_and_changes_rebuild(small_inputs, tmp_path):
    out = tmp_path / "out"
    stages: list[str] = []
    first = prepare_data(small_inputs, out, 600, name="small")
    mtimes = _mtimes(first)

    second = prepare_data(
        small_inputs, out, 600, name="small", progress=lambda *event: stages.append(event[0])
    )
    assert second.reused and not stages
    assert _mtimes(second) == mtimes
    assert second == dataclasses.replace(first, reused=True)

    bigger = prepare_data(small_inputs, out, 700, name="small", force=True)  # replaces its own earlier dataset
    assert not bigger.reused and bigger.vocab_size == 700
    assert _mtimes(bigger)["small_text_document.bin"] != mtimes["small_text_document.bin"]
    assert json.loads((out / "manifest.json").read_text())["requested_vocab_size"] == 700

    changed = tmp_path / "changed.txt"
    changed.write_text("And God said, Let there be light: and there was light.")
    assert not prepare_data(small_inputs + [changed], out, 700, name="small", force=True).reused


def test_truncated_output_is_rebuilt(small_inputs, tmp_path):
    first = prepare_data(small_inputs, tmp_path, 600, name="small")
    bin_path = Path(f"{first.data_prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    rebuilt = prepare_data(small_inputs, tmp_path, 600, name="small")
    assert not rebuilt.reused
    assert bin_path.stat().st_size == 2 * rebuilt.num_tokens
    assert [p.name for p in tmp_path.glob(".*")] == [".opskit"]  # its marker; no staging files or folders left


def test_progress_reports_every_stage_to_completion(small_inputs, tmp_path):
    events: list[tuple[str, int, int]] = []
    prepared = prepare_data(small_inputs, tmp_path, 600, progress=lambda *e: events.append(e))
    stages = [stage for stage, _, _ in events]
    assert sorted(set(stages), key=stages.index) == ["scan", "train", "tokenize"]
    assert events[-1] == ("tokenize", prepared.num_documents, prepared.num_documents)
    assert ("scan", len(small_inputs), len(small_inputs)) in events


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ('{"text": "unterminated', "invalid JSON"),
        ('{"content": "no text key"}', "string field 'text'"),
        ('["not", "an", "object"]', "string field 'text'"),
        ('{"text": 7}', "string field 'text'"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, bad_line, expected):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n\n' + bad_line + '\n{"text": "also fine"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(corpus))}, line 3: .*{expected}"):
        prepare_data([corpus], tmp_path / "out", 1000)
    with pytest.raises(DataError, match="line 3"):
        list(load_corpus(corpus))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_file_is_named(tmp_path, small_inputs):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=rf"^{re.escape(str(missing))}: input file not found$"):
        prepare_data(small_inputs + [missing], tmp_path / "out", 1000)


@pytest.mark.parametrize("vocab_size", [299, 0, 8000.0, True])
def test_vocab_size_too_small_or_not_an_int(small_inputs, tmp_path, vocab_size):
    with pytest.raises(DataError, match=r"^vocab_size: expected an integer >= 300 .*got"):
        prepare_data(small_inputs, tmp_path, vocab_size)


def test_vocab_size_300_is_enough(small_inputs, tmp_path):
    assert prepare_data(small_inputs, tmp_path, 300).vocab_size == 300


@pytest.mark.parametrize(
    ("file_name", "content", "expected"),
    [
        ("empty.jsonl", '{"text": ""}\n\n', "empty corpus"),
        ("notes.csv", "text\nhello\n", "expected a .jsonl or .txt file"),
        ("latin1.txt", "caf\xe9", "expected UTF-8 text"),
    ],
)
def test_unusable_inputs(tmp_path, file_name, content, expected):
    path = tmp_path / file_name
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: .*{expected}"):
        prepare_data([path], tmp_path / "out", 1000)


def test_errors_are_single_line_opskit_errors(tmp_path):
    with pytest.raises(OpskitError) as raised:  # the base the CLI prints as one line
        read_documents(tmp_path / "nothing_text_document")
    assert isinstance(raised.value, DataError) and isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)
    assert str(tmp_path / "nothing_text_document.bin") in str(raised.value)
    with pytest.raises(DataError, match="^name: "):
        prepare_data("kjv", tmp_path, 1000, name="../escape")
    with pytest.raises(DataError, match="^source: "):
        prepare_data([], tmp_path, 1000)


def test_import_is_light():
    """The CLI imports opskit.data.corpus on login nodes; the ML stack must load only when used."""
    code = "import sys, opskit.data.corpus; print(' '.join(sorted(sys.modules)))"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=root, env={"PYTHONPATH": str(root)},
    )
    loaded = {module.split(".")[0] for module in run.stdout.split()}
    assert "opskit" in loaded
    assert not loaded & {"megatron", "numpy", "tokenizers", "torch", "transformers"}
