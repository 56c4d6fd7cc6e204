"""ckpt convert: `--all` skips a conversion only while the sizes and SHA-256s its marker
recorded still hold; a tokenizer whose special tokens fall outside the model's vocabulary is never written beside it
(GPT-2 BPE files of 1024 tokens without <|endoftext|>, as `opskit rehearse` writes for tr1-13B, made transformers add
it as id 1024 of a 1024-row model: `ckpt generate --prompt "...<|endoftext|>..."` died of an IndexError)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_ckpt import build_checkpoint

from opskit.ckpt.convert import ConvertError, convert_all, convert_step

OPSKIT = str(Path(sys.executable).with_name("opskit"))
PROMPT = "In the beginning<|endoftext|>And"
SHARD = "model-00001-of-00001.safetensors"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, "ckpt", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def kjv1024(tmp_path_factory):
    """The KJV tokenizer and dataset at 1024 tokens: a vocabulary Megatron's padding leaves as it is (1024 rows)."""
    from opskit.data.corpus import prepare_data

    return prepare_data("kjv", tmp_path_factory.mktemp("kjv1024"), vocab_size=1024, name="kjv")


@pytest.fixture(scope="module")
def gpt2_bpe_run(kjv1024, tmp_path_factory) -> Path:
    """A GPT-2 checkpoint (TP=1, fp32, 1024 rows) of a run with --vocab-file/--merge-file: the KJV BPE written as GPT-2
    files, whose vocabulary has no <|endoftext|>; the checkpoint dir."""
    from opskit.rehearse import _write_gpt2_files

    root = tmp_path_factory.mktemp("gpt2-bpe")
    (root / "files").mkdir()
    _write_gpt2_files(kjv1024.tokenizer_dir / "tokenizer.json", root / "files")
    build_checkpoint(root / "checkpoints", arch="gpt2", tp=1, vocab=1024, dtype=torch.float32,
                     data_prefix=kjv1024.data_prefix, tokenizer_type="GPT2BPETokenizer", tokenizer_name_or_path=None,
                     vocab_file=str(root / "files" / "gpt2-vocab.json"),
                     merge_file=str(root / "files" / "gpt2-merges.txt"))
    return root / "checkpoints"


@pytest.fixture(scope="module")
def converted(gpt2_bpe_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "hf"
    convert_step(gpt2_bpe_run, out)  # verified, the special-token prompt included
    return out


# --------------------------------------------------------------------------- item 10: special tokens in the vocabulary


def test_gpt2_bpe_files_convert_without_a_token_past_the_vocabulary(converted):
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert config["vocab_size"] == 1024
    for key in ("bos_token_id", "eos_token_id"):
        assert config[key] is None or 0 <= config[key] < 1024, config
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert len(tokenizer) <= 1024 and all(0 <= i < 1024 for i in tokenizer(PROMPT)["input_ids"])
    done = cli("generate", str(converted), "--prompt", PROMPT, "--max-new-tokens", "5")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith(PROMPT)
    sampled = json.loads(cli("generate", str(converted), "--prompt", PROMPT, "--max-new-tokens", "5", "--json").stdout)
    assert (sampled["prompt"], sampled["seed"], sampled["text"]) == (PROMPT, 0, done.stdout.rstrip("\n"))


def test_a_tokenizer_whose_special_token_is_past_the_vocabulary_is_refused(kjv1024, gpt2_bpe_run, tmp_path):
    """A tokenizer folder of 1024 tokens naming <|endoftext|> as its eos: transformers adds it as id 1024."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(kjv1024.tokenizer_dir, tokenizer)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((tokenizer / name).read_text())
        (tokenizer / name).write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    with pytest.raises(ConvertError, match=r"special token '<\|endoftext\|>' has id 1024, outside the model's "
                                           r"vocabulary of 1024"):
        convert_step(gpt2_bpe_run, tmp_path / "hf", tokenizer_dir=tokenizer, verify=False)
    assert not (tmp_path / "hf").exists()
    done = cli("convert", str(gpt2_bpe_run), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "hf"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: {tokenizer}: special token "), done.stderr
    assert not (tmp_path / "hf").exists()


def test_verification_and_generate_cover_special_tokens(converted, tmp_path):
    """A folder whose tokenizer adds <|endoftext|> past the 1024 rows (what the old conversion wrote): verification
    fails in one line, and `ckpt generate` refuses the prompt in one line instead of an IndexError."""
    from transformers import GPT2TokenizerFast

    from opskit.ckpt.convert import special_tokens_row

    old = tmp_path / "old"
    shutil.copytree(converted, old)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (old / name).unlink()
    files = tmp_path / "files"
    files.mkdir()
    vocab = json.loads((converted / "tokenizer.json").read_text())["model"]
    (files / "vocab.json").write_text(json.dumps(vocab["vocab"]))
    (files / "merges.txt").write_text("#version: 0.2\n" + "\n".join(
        m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]) + "\n")
    GPT2TokenizerFast.from_pretrained(files).save_pretrained(old)  # transformers' default: <|endoftext|> added

    assert special_tokens_row(converted, 1024, 32).max().item() < 1024
    with pytest.raises(ConvertError, match=r"verification failed: the written tokenizer gives token ids \[1024\], "
                                           r"outside the model's vocabulary of 1024"):
        special_tokens_row(old, 1024, 32)
    done = cli("generate", str(old), "--prompt", PROMPT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "token ids [1024], outside the model's vocabulary of 1024" in done.stderr


# --------------------------------------------------------------------------- item 7: intact means the recorded bytes


def damage_truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(1000)


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip], ids=["truncated", "flipped byte"])
def test_convert_all_redoes_or_reports_a_damaged_conversion(gpt2_bpe_run, tmp_path, damage):
    out = tmp_path / "hf"
    [first] = convert_all(gpt2_bpe_run, out, verify=False).converted
    assert not first.skipped
    shard = out / "global_step100" / SHARD
    intact = shard.read_bytes()
    [again] = convert_all(gpt2_bpe_run, out, verify=False).converted
    assert again.skipped

    damage(shard)
    reported = convert_all(gpt2_bpe_run, out, verify=False)
    [why] = [n.reason for n in reported.not_converted]
    assert reported.converted == [] and "damaged conversion: " + SHARD in why, why
    assert why.endswith("--force converts it again")
    done = cli("convert", str(gpt2_bpe_run), "--all", "--out", str(out), "--no-verify")
    assert done.returncode == 0 and "already converted" not in done.stdout, done.stdout
    assert done.stderr.count("\n") == 1 and "damaged conversion: " + SHARD in done.stderr, done.stderr

    [redone] = convert_all(gpt2_bpe_run, out, force=True, verify=False).converted
    assert not redone.skipped
    assert shard.read_bytes() == intact
    [skipped] = convert_all(gpt2_bpe_run, out, verify=False).converted
    assert skipped.skipped


def test_a_conversion_marker_without_digests_is_not_taken_as_intact(gpt2_bpe_run, tmp_path):
    """An older opskit's marker lists files but no digests: nothing proves them intact."""
    out = tmp_path / "hf"
    convert_all(gpt2_bpe_run, out, verify=False)
    marker_path = out / "global_step100" / ".opskit"
    marker = json.loads(marker_path.read_text())
    del marker["files"]
    marker_path.write_text(json.dumps(marker) + "\n")
    [result] = convert_all(gpt2_bpe_run, out, verify=False).not_converted
    assert "without recorded file digests" in result.reason
