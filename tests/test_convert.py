"""opskit.ckpt.convert on real checkpoints of the real trainer: the HF BLOOM folder (TP=1, TP=2) and GPT-2 folder
(PP=2), logits equal to the trainer's own layers, --step, refusals (missing or garbage files, keys with no place),
atomic replacement, `opskit ckpt generate`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BASELINE_RUN, TP2_RUN

from opskit.ckpt.convert import ConvertError, convert_step
from opskit.ckpt.format.layout import CheckpointFormatError
from opskit.data.corpus import EOS_ID, read_documents
from opskit.fsutil import folder_entries, write_marker
from opskit.train.inference import GPTModel

OPSKIT = str(Path(sys.executable).with_name("opskit"))
LAYERS, HIDDEN, PADDED_VOCAB = 2, 64, 2048  # conftest's tiny BLOOM; vocab 2000 padded to a multiple of 128


@pytest.fixture(scope="module")
def run(bloom_run) -> Path:
    return bloom_run


@pytest.fixture(scope="module")
def converted(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "bloom"
    return convert_step(run / "checkpoints", out)


@pytest.fixture(scope="module")
def tokens(kjv_data) -> torch.Tensor:
    """Two real KJV chapters' first 32 tokens, [2, 32]."""
    docs = read_documents(kjv_data.data_prefix)
    return torch.tensor([docs[0][:32].tolist(), docs[500][:32].tolist()], dtype=torch.long)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def reference_logits(checkpoints: Path, tokens: torch.Tensor, step: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        return GPTModel.from_checkpoint(checkpoints, step=step)(tokens)


def copy_step(run: Path, tmp_path: Path, step: int = 20) -> Path:
    target = tmp_path / "ckpt" / f"global_step{step}"
    shutil.copytree(run / "checkpoints" / f"global_step{step}", target)
    return target


# --------------------------------------------------------------------------- the converted folder


def test_folder_is_a_bloom_for_causal_lm(converted, run):
    out = converted.out_dir
    assert converted.iteration == 20
    assert converted.step_dir == run / "checkpoints" / "global_step20"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bloom"
    assert config["architectures"] == ["BloomForCausalLM"]
    assert (config["vocab_size"], config["n_layer"], config["n_head"], config["hidden_size"]) == \
        (PADDED_VOCAB, LAYERS, 4, HIDDEN)
    assert config["tie_word_embeddings"] is True
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][
        "transformer.ln_f.weight"] == "model-00001-of-00001.safetensors"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 3)

    # BLOOM's count (BigScience's formula, ALiBi and embedding LayerNorm): l(12h^2 + 13h) + Vh + 4h.
    expected = LAYERS * (12 * HIDDEN**2 + 13 * HIDDEN) + PADDED_VOCAB * HIDDEN + 4 * HIDDEN
    assert converted.num_parameters == expected == 231_296

    from safetensors import safe_open

    with safe_open(out / "model-00001-of-00001.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("transformer.word_embeddings.weight").shape == (PADDED_VOCAB, HIDDEN)
        assert f.get_tensor("transformer.h.0.self_attention.query_key_value.weight").dtype == torch.float32
    assert sum(1 for n in names if n.startswith("transformer.h.")) == LAYERS * 12
    assert "transformer.word_embeddings_layernorm.weight" in names and "transformer.ln_f.bias" in names


def test_transformers_logits_equal_the_trainers_layers(converted, run, tokens):
    theirs = hf_logits(converted.out_dir, tokens)
    ours = reference_logits(run / "checkpoints", tokens)
    assert theirs.shape == ours.shape == (2, 32, PADDED_VOCAB)
    assert (theirs - ours).abs().max().item() < 1e-5
    # A trained model, not an untouched init: the next-token loss on real text is well below uniform (ln 2000 = 7.6).
    loss = torch.nn.functional.cross_entropy(ours[:, :-1].reshape(-1, PADDED_VOCAB), tokens[:, 1:].reshape(-1))
    assert loss.item() < 7.0


def test_step_picks_an_older_checkpoint(run, tokens, tmp_path):
    # Through the CLI: --step, and the default output folder <run>/hf/global_stepN.
    done = subprocess.run([OPSKIT, "ckpt", "convert", str(run / "checkpoints"), "--step", "10"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = run / "hf" / "global_step10"
    assert done.stdout.startswith(f"converted {run / 'checkpoints' / 'global_step10'} (iteration 10, bloom, "
                                  "231,296 parameters, 1 shard(s), verified: max abs logits diff ")
    assert done.stdout.strip().endswith(f") -> {out}")
    older = hf_logits(out, tokens)
    assert (older - reference_logits(run / "checkpoints", tokens, step=10)).abs().max().item() < 1e-5
    assert (older - reference_logits(run / "checkpoints", tokens)).abs().max().item() > 1e-2

    with pytest.raises(CheckpointFormatError, match=r"global_step15: no such checkpoint step$"):
        convert_step(run / "checkpoints", tmp_path / "x", step=15)


def test_generate_continues_the_prompt(converted):
    done = subprocess.run([OPSKIT, "ckpt", "generate", str(converted.out_dir), "--prompt", "And God said",
                           "--max-new-tokens", "12"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("And God said")
    assert len(done.stdout.strip()) > len("And God said")


def test_generate_on_a_folder_without_config(tmp_path):
    done = subprocess.run([OPSKIT, "ckpt", "generate", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr == f"error: {tmp_path}: no config.json (not a Hugging Face model folder)\n"


# --------------------------------------------------------------------------- refusals


def test_pp2_gpt_run_converts_to_gpt2(gpt_pp2_run, tokens, tmp_path):
    """A GPT-style run at PP=2 (layers split over two stages' files): a GPT2LMHeadModel with the tanh GELU the trainer
    computes, position embeddings, and logits equal to the trainer's merged layers."""
    result = convert_step(gpt_pp2_run / "checkpoints", tmp_path / "hf", max_shard_bytes=300_000)
    assert (result.arch, result.iteration, result.shards) == ("gpt2", 2, 3)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["activation_function"], config["n_positions"]) == ("gpt2", "gelu_fast", 32)
    from transformers import AutoTokenizer

    # config and tokenizer files are written without transformers: its own reading of them agrees on eos.
    eos = AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id
    assert config["bos_token_id"] == config["eos_token_id"] == eos == EOS_ID
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-5
    ours = reference_logits(gpt_pp2_run / "checkpoints", tokens)
    assert (hf_logits(tmp_path / "hf", tokens) - ours).abs().max().item() <= 1e-5


def test_absolute_positions_and_other_ffn_sizes_are_refused(run, tmp_path):
    step = copy_step(run, tmp_path)
    embedding = step / "layer_01-model_00-model_states.pt"
    state = torch.load(embedding, weights_only=False)
    state["position_embeddings.weight"] = torch.zeros(32, HIDDEN)
    torch.save(state, embedding)
    with pytest.raises(ConvertError, match=r"layer_01-model_00-model_states.pt: keys \['position_embeddings.weight'\] "
                                           r"have no place in the converted model$"):
        convert_step(step, tmp_path / "hf")

    step = copy_step(run, tmp_path / "ffn")
    client = step / "mp_rank_00_model_states.pt"
    state = torch.load(client, weights_only=False)
    state["args"].ffn_hidden_size = 3 * HIDDEN
    torch.save(state, client)
    with pytest.raises(ConvertError, match=r"^ffn_hidden_size 192 != 4 \* hidden_size; BLOOM's MLP is fixed at 4h$"):
        convert_step(step, tmp_path / "hf")

    with pytest.raises(ConvertError, match=r"^--dtype fp8: expected one of fp32, fp16, bf16$"):
        convert_step(run / "checkpoints", tmp_path / "hf", dtype="fp8")
    assert not (tmp_path / "hf").exists()


def test_missing_layer_file_is_named(run, tmp_path):
    step = copy_step(run, tmp_path)
    (step / "layer_04-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as info:
        convert_step(step, tmp_path / "hf")
    assert str(info.value).startswith(f"{step / 'layer_04-model_00-model_states.pt'}: no such file")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_layer_file_is_named(run, tmp_path, damage):
    step = copy_step(run, tmp_path)
    layer = step / "layer_03-model_00-model_states.pt"
    data = layer.read_bytes()
    layer.write_bytes(b"not a checkpoint" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError) as info:
        convert_step(step, tmp_path / "hf")
    assert str(info.value).startswith(f"{layer}: cannot be loaded (")
    assert "\n" not in str(info.value)


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(CheckpointFormatError, match="neither a global_stepN folder nor a checkpoint dir"):
        convert_step(tmp_path, tmp_path / "hf")


# --------------------------------------------------------------------------- atomic output


def test_output_folder_is_replaced_atomically(run, tmp_path, tokens):
    parent = tmp_path / "share"
    out = parent / "bloom"
    convert_step(run / "checkpoints", out, verify=False)  # an earlier conversion: opskit's own, --force replaces it
    (out / "stale-shard.safetensors").write_text("from an older conversion")  # one with another shard layout
    (out / "config.json").write_text("{}")
    marker = json.loads((out / ".opskit").read_text())
    write_marker(out, marker["command"], folder_entries(out), marker["source"])

    convert_step(run / "checkpoints", out, step=10, force=True)
    assert sorted(os.listdir(parent)) == ["bloom"]  # no staging folder, no moved-aside old folder left
    assert "stale-shard.safetensors" not in os.listdir(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "bloom"
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    # A conversion that fails half-way leaves the previous folder exactly as it was, and nothing beside it.
    bad = copy_step(run, tmp_path / "bad")
    (bad / "layer_06-model_00-model_states.pt").write_bytes(b"\0" * 100)
    with pytest.raises(CheckpointFormatError):
        convert_step(bad, out, force=True)
    assert sorted(os.listdir(parent)) == ["bloom"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (hf_logits(out, tokens) - reference_logits(run / "checkpoints", tokens, step=10)).abs().max() < 1e-5


# --------------------------------------------------------------------------- tensor-parallel checkpoints


def test_tp2_checkpoint_merges_to_the_same_model(trained, tokens, tmp_path):
    """The session's TP=2 run (conftest's ``TP2_RUN``): its two shards per layer merge (column splits on dim 0, row
    splits on dim 1, vocabulary rows on dim 0) into a model whose transformers logits equal the merged trainer
    layers', and equal the TP=1 run's of the same flags at the same step (``BASELINE_RUN``: the same weights trained
    the same way)."""
    checkpoints = trained(2, **TP2_RUN).save
    assert (checkpoints / "global_step20" / "layer_03-model_01-model_states.pt").is_file()
    result = convert_step(checkpoints, tmp_path / "hf")
    assert result.averaged == []  # the trainer keeps replicated tensors identical across TP ranks
    merged = reference_logits(checkpoints, tokens)
    assert (hf_logits(result.out_dir, tokens) - merged).abs().max().item() <= 1e-5
    tp1 = trained(**BASELINE_RUN).save
    assert (merged - reference_logits(tp1, tokens, step=20)).abs().max().item() <= 1e-4
