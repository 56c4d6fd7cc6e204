"""opskit ckpt list / inspect / check / convert on hand-built Megatron-DeepSpeed checkpoints (tests/megatron_ckpt.py:
fp16 GPT-2 with position embeddings, bf16 BLOOM with embedding LayerNorm, padded vocabularies, TP=2, PP=2) and on the
trainer's own run: transformers' logits equal the checkpoint's forward, a planted TP desync is reported and averaged,
damaged steps are named."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import plant_redundant_optimizer_copy
from megatron_ckpt import build_checkpoint

from opskit.ckpt.check import check_step
from opskit.ckpt.convert import ConvertError, convert_step
from opskit.ckpt.format.info import inspect_step, list_steps
from opskit.ckpt.format.layout import CheckpointFormatError
from opskit.train.inference import GPTModel

OPSKIT = str(Path(sys.executable).with_name("opskit"))
VOCAB, HIDDEN = 2000, 64


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OPSKIT, "ckpt", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def gpt2_fp16(kjv_data, tmp_path_factory) -> Path:
    """fp16 GPT-2, TP=2, PP=2, vocabulary 2000 padded to 2048; the checkpoint dir."""
    root = tmp_path_factory.mktemp("mds-gpt2") / "checkpoints"
    build_checkpoint(root, arch="gpt2", tp=2, pp=2, dtype=torch.float16, tokenizer_dir=kjv_data.tokenizer_dir,
                     data_prefix=kjv_data.data_prefix)
    return root


@pytest.fixture(scope="module")
def bloom_bf16(kjv_data, tmp_path_factory) -> Path:
    """bf16 BLOOM (ALiBi, embedding LayerNorm), TP=2, 3 layers; the checkpoint dir."""
    root = tmp_path_factory.mktemp("mds-bloom") / "checkpoints"
    build_checkpoint(root, arch="bloom", tp=2, layers=3, dtype=torch.bfloat16, tokenizer_dir=kjv_data.tokenizer_dir,
                     data_prefix=kjv_data.data_prefix, seed=1)
    return root


@pytest.fixture(scope="module")
def tokens(kjv_data) -> torch.Tensor:
    from opskit.data.corpus import read_documents

    docs = read_documents(kjv_data.data_prefix)
    return torch.tensor([docs[3][:32].tolist(), docs[700][:32].tolist()], dtype=torch.long)


def logits_pair(checkpoints: Path, folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' fp32 logits of ``folder``, the checkpoint's own forward in fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = GPTModel.from_checkpoint(checkpoints)(tokens)
    return theirs, ours


def copy_checkpoints(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "checkpoints"
    shutil.copytree(source, target)
    return target


# --------------------------------------------------------------------------- conversion of hand-built checkpoints


def test_fp16_gpt2_tp2_pp2_converts_to_matching_gpt2(gpt2_fp16, tokens, tmp_path):
    result = convert_step(gpt2_fp16, tmp_path / "hf", dtype="fp32", max_shard_bytes=200_000)
    assert (result.arch, result.iteration, result.averaged) == ("gpt2", 100, [])
    assert result.shards > 1 and result.max_abs_diff <= 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["activation_function"], config["vocab_size"], config["n_positions"], config["n_inner"]) == \
        ("gelu_fast", 2048, 32, 4 * HIDDEN)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert {"transformer.wpe.weight", "transformer.h.1.attn.c_attn.weight", "transformer.ln_f.bias"} <= \
        set(index["weight_map"])
    theirs, ours = logits_pair(gpt2_fp16, tmp_path / "hf", tokens)
    assert theirs.shape == (2, 32, 2048)
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_default_dtype_is_the_checkpoints_and_vocab_can_be_trimmed(gpt2_fp16, tokens, tmp_path):
    from safetensors import safe_open

    result = convert_step(gpt2_fp16, tmp_path / "hf", trim_vocab=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["dtype"], config["vocab_size"]) == ("float16", VOCAB)
    name = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"][
        "transformer.wte.weight"]
    with safe_open(tmp_path / "hf" / name, "pt") as f:
        wte = f.get_tensor("transformer.wte.weight")
    assert (wte.dtype, tuple(wte.shape)) == (torch.float16, (VOCAB, HIDDEN))
    assert result.max_abs_diff <= 1e-4  # fp16 weights either side, computed in fp32
    theirs, ours = logits_pair(gpt2_fp16, tmp_path / "hf", tokens)
    assert (theirs - ours[..., :VOCAB]).abs().max().item() <= 1e-5


def test_bf16_bloom_with_embedding_layernorm_converts_to_matching_bloom(bloom_bf16, tokens, tmp_path):
    result = convert_step(bloom_bf16, tmp_path / "hf", dtype="fp32")
    assert (result.arch, result.averaged) == ("bloom", [])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["n_layer"], config["vocab_size"]) == ("bloom", 3, 2048)
    theirs, ours = logits_pair(bloom_bf16, tmp_path / "hf", tokens)
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_verification_through_the_first_blocks_and_its_failure_on_a_wrong_activation(kjv_data, bloom_bf16,
                                                                                     tmp_path):
    """Models too large to load twice are verified through their first blocks; and verification catches the tr1-13B
    converter bug (a config saying exact `gelu` where the run computed the tanh GELU): nothing is written then."""
    from opskit.ckpt.convert import verify_conversion

    partial = convert_step(bloom_bf16, tmp_path / "bloom", dtype="fp32", verify_layers=1)
    assert (partial.verified_layers, partial.num_layers) == (1, 3) and partial.max_abs_diff <= 1e-5

    # Weights 10x the init std: MLP inputs of order 1, where exact and tanh GELU differ visibly (as in a trained 13B).
    step = build_checkpoint(tmp_path / "ckpt", arch="gpt2", tp=2, dtype=torch.float16, scale=10.0,
                            tokenizer_dir=kjv_data.tokenizer_dir, data_prefix=kjv_data.data_prefix)
    good = convert_step(step, tmp_path / "gpt2", dtype="fp32")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    with pytest.raises(ConvertError, match=r"verification failed: transformers' logits differ from the checkpoint's "
                                           r"own forward by .* on 3 sequences of 32 tokens$"):
        verify_conversion(step, tmp_path / "gpt2", "fp32")
    assert good.max_abs_diff < 1e-4


def test_gpt2_bpe_tokenizer_run_takes_its_vocab_and_merge_files(kjv_data, tokens, tmp_path):
    """tr1-13B ran with --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file (no tokenizer folder): the
    converted model gets a GPT2TokenizerFast built from those files, which tokenizes like the original."""
    from transformers import AutoTokenizer

    original = json.loads((Path(kjv_data.tokenizer_dir) / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(original["vocab"]))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in original["merges"]))
    step = build_checkpoint(tmp_path / "ckpt", arch="gpt2", tp=1, data_prefix=kjv_data.data_prefix,
                            tokenizer_name_or_path=None, tokenizer_type="GPT2BPETokenizer",
                            vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    result = convert_step(step, tmp_path / "hf", dtype="fp32")
    assert result.max_abs_diff <= 1e-5
    text = "And God said, Let there be light: and there was light."
    converted = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert converted(text)["input_ids"] == AutoTokenizer.from_pretrained(kjv_data.tokenizer_dir)(text)["input_ids"]

    missing = build_checkpoint(tmp_path / "none", arch="gpt2", tp=1, tokenizer_name_or_path=None)
    with pytest.raises(ConvertError, match=r"^the run's tokenizer is not readable here \(tokenizer_name_or_path None, "
                                           r"vocab_file None, merge_file None\); pass --tokenizer DIR$"):
        convert_step(missing, tmp_path / "hf2")


# --------------------------------------------------------------------------- list / inspect


def test_list_reads_degrees_dtype_counters_and_latest(gpt2_fp16, bloom_run):
    latest, steps = list_steps(gpt2_fp16)
    assert latest == "global_step100"
    (step,) = steps
    assert (step.tp, step.pp, step.dp, step.dtype, step.complete, step.latest) == (2, 2, 1, "fp16", True, True)
    assert (step.consumed_samples, step.consumed_tokens) == (1600, 1600 * 32)

    done = cli("list", str(bloom_run / "checkpoints"), "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["latest"] == "global_step20"
    assert [(s["step"], s["consumed_samples"], s["consumed_tokens"], s["latest"], s["complete"], s["dtype"])
            for s in listed["steps"]] == [(10, 80, 80 * 32, False, True, "fp32"), (20, 160, 160 * 32, True, True,
                                                                                    "fp32")]
    assert all(s["size_bytes"] > 100_000 for s in listed["steps"])


def test_inspect_reads_megatron_args_it_cannot_import(bloom_bf16):
    report = inspect_step(bloom_bf16 / "global_step100")
    assert report["architecture"]["position_embedding_type"] == "alibi"  # a megatron.enums enum in the pickle
    assert report["files"]["layer_03-model_01-model_states.pt"]["self_attention.query_key_value.weight"] == \
        {"shape": [3 * HIDDEN // 2, HIDDEN], "dtype": "bf16"}
    assert report["files"]["zero_pp_rank_0_mp_rank_01_optim_states.pt"]["size_bytes"] > 0
    done = cli("inspect", str(bloom_bf16))
    assert done.returncode == 0, done.stderr
    assert "position_embedding_type: alibi" in done.stdout
    assert "word_embeddings.norm.weight" in done.stdout


def test_list_and_inspect_read_headers_without_torch_numpy_or_deepspeed(gpt2_fp16, bloom_run):
    """`list` and `inspect` run on login nodes: they read pickles and zip headers only, with placeholders for the
    numpy RNG states and torch dtypes in the args, so none of the heavy modules is imported."""
    probe = ("import sys, json\n"
             "from opskit.ckpt.format.info import list_steps, inspect_step\n"
             "latest, steps = list_steps(sys.argv[1])\n"
             "report = inspect_step(sys.argv[2])\n"
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'deepspeed', 'megatron'})\n"
             "print(json.dumps([heavy, steps[-1].dtype, steps[-1].complete, report['architecture']['num_layers']]))\n")
    for checkpoints in (gpt2_fp16, bloom_run / "checkpoints"):
        last = max(checkpoints.glob("global_step*"), key=lambda p: int(p.name.removeprefix("global_step")))
        done = subprocess.run([sys.executable, "-c", probe, str(checkpoints), str(last)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        heavy, dtype, complete, layers = json.loads(done.stdout)
        assert (heavy, complete, layers) == ([], True, 2)
        assert dtype in ("fp16", "fp32")


# --------------------------------------------------------------------------- planted TP desync


def test_layernorm_desync_is_reported_by_check_and_averaged_by_convert(bloom_bf16, tmp_path):
    root = copy_checkpoints(bloom_bf16, tmp_path)
    shard = root / "global_step100" / "layer_04-model_01-model_states.pt"
    state = torch.load(shard, weights_only=True)
    drifted = state["post_attention_layernorm.weight"].float() + 0.125
    state["post_attention_layernorm.weight"] = drifted.to(torch.bfloat16)
    torch.save(state, shard)

    report = check_step(root / "global_step100")
    assert not report.ok
    assert [(d["layer"], d["key"], d["ranks"]) for d in report.tp_mismatches] == \
        [(4, "post_attention_layernorm.weight", [1])]
    diff = report.tp_mismatches[0]["max_abs_diff"]
    assert diff == pytest.approx(0.125, abs=0.01)  # bf16 rounding of 1 + 0.125
    assert len(report.tp_diffs) == 2 + 3 * 6 + 2  # embedding LN, 6 per block, final LN: all compared

    done = cli("check", str(root))
    assert done.returncode == 1
    assert f"TP mismatch: layer_04 post_attention_layernorm.weight: max abs diff {diff:.3g} (TP ranks [1] vs 0)" in \
        done.stdout

    converted = cli("convert", str(root), "--out", str(tmp_path / "hf"), "--dtype", "fp32", "--no-verify")
    assert converted.returncode == 0, converted.stderr
    assert ("warning: TP copies differ, averaged: transformer.h.1.post_attention_layernorm.weight (layer_04, "
            f"max abs diff {diff:.3g})") in converted.stderr
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model-00001-of-00001.safetensors", "pt") as f:
        merged = f.get_tensor("transformer.h.1.post_attention_layernorm.weight")
    rank0 = torch.load(root / "global_step100" / "layer_04-model_00-model_states.pt", weights_only=True)
    expected = (rank0["post_attention_layernorm.weight"].float() + drifted.to(torch.bfloat16).float()) / 2
    assert torch.equal(merged, expected)


def test_check_passes_a_consistent_trainer_checkpoint_and_agreeing_rng(bloom_run):
    done = cli("check", str(bloom_run / "checkpoints"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["problems"] == [] and report["nonfinite"] == []
    assert {r["key"] for r in report["rng"]} >= {"torch_rng_state", "np_rng_state", "random_rng_state"}


@pytest.mark.parametrize("tp,pp,run", [(2, 1, "tp2_run"), (1, 2, "gpt_pp2_run"), (2, 2, "tp2_pp2_bf16_run")],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_check_passes_model_parallel_trainer_checkpoints(request, tp, pp, run):
    """The trainer seeds Python's and NumPy's generators as Megatron does (seed + 100 * pipeline rank), so the TP
    ranks of a stage save equal RNG states and ``ckpt check`` passes the trainer's own checkpoints (it flagged them):
    the latest step of the session's shared TP=2, PP=2 and TP=2 x PP=2 runs."""
    checkpoints = request.getfixturevalue(run) / "checkpoints"
    checked = cli("check", str(checkpoints), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    assert report["ok"], report
    assert {(r["pp"], r["key"]) for r in report["rng"]} >= {
        (stage, key) for stage in range(pp) for key in ("random_rng_state", "np_rng_state", "torch_rng_state")}
    step = checkpoints / (checkpoints / "latest").read_text()
    for rank in range(tp * pp):  # Megatron's rule: seed + 100 * pipeline rank (nothing draws from these two)
        saved = torch.load(step / f"mp_rank_{rank:02d}_model_states.pt", weights_only=False)
        seed = 1234 + 100 * (rank // tp)
        assert saved["random_rng_state"] == random.Random(seed).getstate(), rank
        name, keys, *position = saved["np_rng_state"]
        want_name, want_keys, *want_position = np.random.RandomState(seed).get_state()
        assert (name, position) == (want_name, want_position) and np.array_equal(keys, want_keys), rank


def test_check_finds_nan_and_rng_disagreement(gpt2_fp16, tmp_path):
    root = copy_checkpoints(gpt2_fp16, tmp_path)
    step = root / "global_step100"
    layer = step / "layer_04-model_00-model_states.pt"  # block 1 of 2
    state = torch.load(layer, weights_only=True)
    state["mlp.dense_h_to_4h.bias"][5] = float("nan")
    torch.save(state, layer)
    # Stage 1's TP rank 1 gets stage 0's RNG states (plain torch.load cannot even read these args: megatron.enums).
    shutil.copy(step / "mp_rank_00_model_states.pt", step / "mp_rank_03_model_states.pt")
    report = check_step(step)
    assert report.nonfinite == [{"file": layer.name, "key": "mlp.dense_h_to_4h.bias", "nan": 1, "inf": 0}]
    assert sorted((r["pp"], r["key"]) for r in report.rng if not r["agree"]) == \
        [(1, "np_rng_state"), (1, "random_rng_state"), (1, "torch_rng_state")]
    assert not report.ok


# --------------------------------------------------------------------------- damaged steps


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_step_is_incomplete_in_list_and_refused_by_convert(gpt2_fp16, tmp_path, damage):
    root = copy_checkpoints(gpt2_fp16, tmp_path)
    victim = root / "global_step100" / "layer_04-model_01-model_states.pt"
    if damage == "truncated":
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) - 5000])  # the zip directory survives no truncation; nor do records
    else:
        victim.unlink()

    done = cli("list", str(root), "--json")
    assert done.returncode == 0, done.stderr
    (step,) = json.loads(done.stdout)["steps"]
    assert step["complete"] is False
    assert step["problems"][0].startswith(f"{victim}: ")

    table = cli("list", str(root))
    assert "NO" in table.stdout and victim.name in table.stdout

    with pytest.raises(CheckpointFormatError) as info:
        convert_step(root, tmp_path / "hf")
    assert str(info.value).startswith(f"{victim}: ")
    assert ("no such file" if damage == "missing" else "cannot be loaded") in str(info.value)
    assert not (tmp_path / "hf").exists()
    refused = cli("convert", str(root), "--out", str(tmp_path / "hf"))
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {victim}: ") and refused.stderr.count("\n") == 1


def test_convert_all_skips_converted_steps(bloom_run, tmp_path):
    first = cli("convert", str(bloom_run / "checkpoints"), "--all", "--out", str(tmp_path / "hf"), "--no-verify")
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("converted ") == 2
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["global_step10", "global_step20"]
    again = cli("convert", str(bloom_run / "checkpoints"), "--all", "--out", str(tmp_path / "hf"), "--no-verify")
    assert again.returncode == 0, again.stderr
    assert [line.split()[0] for line in again.stdout.splitlines()] == ["skipped", "skipped"]


@pytest.mark.parametrize("mapped", [True, False])
def test_tensor_rows_copied_file_to_file_are_exact(tmp_path, monkeypatch, mapped):
    """The writer copies unconverted rows from the mapped checkpoint files (row-parallel shards gathered row by row,
    several blocks at once), else reads and writes them: both ways give the same bytes as torch.cat."""
    from safetensors.torch import load_file

    from opskit.ckpt.format.tensorfile import ColumnSpan, RowSpan, load_lazy
    from opskit.ckpt.safetensors_out import OutTensor, write_safetensors

    source = {"a": torch.randn(300, 7, dtype=torch.bfloat16), "b": torch.arange(10, dtype=torch.float16),
              "c0": torch.randn(5000, 3, dtype=torch.bfloat16), "c1": torch.randn(5000, 5, dtype=torch.bfloat16)}
    torch.save(source, tmp_path / "source.pt")
    refs = load_lazy(tmp_path / "source.pt")
    if not mapped:
        monkeypatch.setattr("mmap.mmap", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no mmap here")))
    columns = (refs["c0"], refs["c1"])  # 5000 rows x 2 shards: more buffers than one pwritev takes
    tensors = [OutTensor("a", (300, 7), 0, lambda: iter([(RowSpan(refs["a"], 0, 100), 0),
                                                         (RowSpan(refs["a"], 100, 300), 100)])),
               OutTensor("c", (5000, 8), 0, lambda: iter([(ColumnSpan(columns, 0, 1), 0),
                                                          (ColumnSpan(columns, 1, 5000), 1)])),
               OutTensor("b", (10,), 0, lambda: iter([(RowSpan(refs["b"], 0, 10), 0)]))]
    write_safetensors(tmp_path / "out.safetensors", tensors[:2], torch.bfloat16, workers=2)
    write_safetensors(tmp_path / "b.safetensors", tensors[2:], torch.float32)  # a dtype change: read + convert
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["a"], source["a"])
    assert torch.equal(out["c"], torch.cat([source["c0"], source["c1"]], dim=1))
    assert torch.equal(load_file(tmp_path / "b.safetensors")["b"], source["b"].float())


def test_check_json_of_a_bf16_step_is_json_alone(tp2_pp2_bf16_run, tmp_path):
    """A bf16 ZeRO-0 pipeline step (tr11's) as DeepSpeed 0.19.8 wrote it before opskit kept one optimizer copy: its
    mp_rank files pickle DeepSpeed objects (BF16_Optimizer's fragments); unpickling them imports DeepSpeed, whose
    logger prints its accelerator line to stdout at import: `--json` output must stay parseable (that line went to
    stdout before)."""
    step = tmp_path / "checkpoints" / "global_step10"
    shutil.copytree(tp2_pp2_bf16_run / "checkpoints" / "global_step10", step)
    (step.parent / "latest").write_text(step.name)
    assert len(plant_redundant_optimizer_copy(step)) == 4
    checked = cli("check", str(step.parent), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"] is True
