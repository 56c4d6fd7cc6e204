"""``--use-bnb-optimizer``: bitsandbytes' 8-bit Adam in the embedded trainer, run for real on CPU (BigScience's
tr8b-104B BNB experiments), and the word embedding Megatron-DeepSpeed builds under it (bitsandbytes' StableEmbedding:
a LayerNorm, xavier-uniform on the unpartitioned matrix, 32-bit optimizer states).

One 12-iteration ZeRO-0 run (per-parameter optimizer states, so the 32-bit embedding states are visible) with a
checkpoint at 6 serves the loss, state, checkpoint, resume and convert tests; the ZeRO-1 runs train in its process.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_trainer, run_trainer_cases, tiny_trainer_args
from test_train import HIDDEN, one_line_error, records, succeeded

from opskit.ckpt.convert import convert_step
from opskit.train.model import GPTConfig, WordEmbedding, init_xavier_uniform_unpartitioned

GBS = 8
ITERATIONS = 12
SAVED = 6


def bnb_args(data, out: Path, **overrides) -> list[str]:
    """The tiny BLOOM with 8-bit Adam, no --embed-layernorm (the StableEmbedding brings its own norm), ZeRO-0."""
    flags = dict(train_samples=ITERATIONS * GBS, save_interval=SAVED, log_interval=1, use_bnb_optimizer=True,
                 embed_layernorm=None, zero_stage=0)
    return tiny_trainer_args(data, out, **{**flags, **overrides})


@pytest.fixture(scope="module")
def bnb_runs(kjv_data, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """This file's single-rank trainings, one after the other in one process: name -> (the run folder, the finished
    run). ``straight``: the 12-iteration run, first (test_bnb_resume_is_exact's reference: nothing trained before it
    in its process); ``zero1``: 2 iterations at ZeRO-1, not saved; ``zero1-allowed``: the same with
    ``zero_allow_untested_optimizer`` in the DeepSpeed config."""
    root = tmp_path_factory.mktemp("bnb")
    ds = root / "ds.json"
    ds.write_text('{"zero_allow_untested_optimizer": true}')
    zero1 = dict(zero_stage=1, train_samples=2 * GBS, save=None, load=None)
    runs = {"straight": (root / "straight", {}), "zero1": (root / "zero1", zero1),
            "zero1-allowed": (root / "zero1-allowed", {**zero1, "deepspeed_config": ds})}
    done = run_trainer_cases({name: bnb_args(kjv_data, out, **flags) for name, (out, flags) in runs.items()},
                             root / "cases")
    return {name: (out, done[name]) for name, (out, _) in runs.items()}


@pytest.fixture(scope="module")
def bnb_run(bnb_runs) -> tuple[Path, subprocess.CompletedProcess]:
    """The 12-iteration ZeRO-0 run with a checkpoint at 6: (its run folder, the finished run)."""
    out, done = bnb_runs["straight"]
    return out, succeeded(done)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_bnb_loss_falls_with_8bit_states_and_a_32bit_embedding(bnb_run):
    out, done = bnb_run
    losses = [records(done.stdout)[i]["lm_loss"] for i in range(1, ITERATIONS + 1)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    step = out / "checkpoints" / f"global_step{ITERATIONS}"
    client = _load(step / "mp_rank_00_model_states.pt")  # ZeRO-0: the optimizer's state_dict is saved here
    assert client["args"].use_bnb_optimizer and not client["args"].embed_layernorm
    vocab = client["args"].padded_vocab_size
    states = [state["__bnb_optimizer_quant_state__"] for state in client["optimizer"]["state"].values()]
    embedding = [s for s in states if s["state1"].shape == (vocab, HIDDEN)]
    assert len(embedding) == 1 and {embedding[0]["state1"].dtype, embedding[0]["state2"].dtype} == {torch.float32}
    big = [s for s in states if s["state1"].numel() >= 4096 and s is not embedding[0]]  # bitsandbytes' min_8bit_size
    assert len(big) == 8  # QKV, dense, h->4h, 4h->h of both blocks
    assert all(s["state1"].dtype == s["state2"].dtype == torch.uint8 and "absmax1" in s for s in big)
    assert all(s["state1"].dtype == torch.float32 for s in states if s["state1"].numel() < 4096)  # LayerNorms, biases
    # The StableEmbedding's LayerNorm, under Megatron-DeepSpeed's names in the embedding's layer file.
    layer = _load(step / "layer_01-model_00-model_states.pt")
    assert {k: tuple(v.shape) for k, v in layer.items()} == {
        "word_embeddings.weight": (vocab, HIDDEN), "word_embeddings.norm.weight": (HIDDEN,),
        "word_embeddings.norm.bias": (HIDDEN,)}


def test_bnb_resume_is_exact(bnb_run, kjv_data, tmp_path):
    """The checkpoint at 6 (8-bit states, quantisation maps, absmax) resumes to the uninterrupted run's losses."""
    out, straight = bnb_run
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(out / "checkpoints" / f"global_step{SAVED}", tmp_path / "checkpoints" / f"global_step{SAVED}")
    (tmp_path / "checkpoints" / "latest").write_text(f"global_step{SAVED}")
    resumed = succeeded(run_trainer(bnb_args(kjv_data, tmp_path)))
    assert f"at global_step{SAVED}" in resumed.stdout
    got, want = records(resumed.stdout), records(straight.stdout)  # ZeRO-0 in fp32 prints no grad norm
    assert sorted(got) == list(range(SAVED + 1, ITERATIONS + 1))
    for iteration, fields in got.items():
        assert (fields["lm_loss"], fields["learning_rate"]) == (want[iteration]["lm_loss"],
                                                                want[iteration]["learning_rate"]), iteration


def test_bnb_checkpoint_converts_to_bloom(bnb_run, tmp_path):
    """ALiBi + the StableEmbedding's norm is BLOOM (word_embeddings_layernorm); convert verifies the logits."""
    out, _ = bnb_run
    result = convert_step(out / "checkpoints", tmp_path / "hf", verify=True)
    assert result.arch == "bloom" and result.iteration == ITERATIONS and result.max_abs_diff is not None
    assert '"model_type": "bloom"' in (result.out_dir / "config.json").read_text()


def test_zero1_needs_zero_allow_untested_optimizer_and_then_trains(bnb_runs):
    """DeepSpeed 0.19.8 takes the client 8-bit Adam under ZeRO-1 only with the key (BigScience's JSON had it);
    without it the trainer says so in one line instead of DeepSpeed's assertion."""
    one_line_error(bnb_runs["zero1"][1], "--use-bnb-optimizer with --zero-stage 1 needs",
                   '"zero_allow_untested_optimizer": true')
    done = succeeded(bnb_runs["zero1-allowed"][1])
    assert sorted(records(done.stdout)) == [1, 2]


def test_missing_bitsandbytes_is_one_line(kjv_data, tmp_path):
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no bitsandbytes here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "opskit.train", *bnb_args(kjv_data, tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 2
    assert one_line_error(done) == "error: --use-bnb-optimizer needs bitsandbytes: pip install bitsandbytes"


def test_stable_embedding_init_is_xavier_uniform_of_the_whole_matrix():
    """Megatron-DeepSpeed's xavier_uniform_tensor_parallel_: the bound of the unpartitioned [V, h], also for a TP
    slice (bitsandbytes' own StableEmbedding took the slice's, sqrt(TP) times wider at TP > 1)."""
    vocab, hidden = 512, 64
    bound = math.sqrt(6 / (vocab + hidden))
    cfg = GPTConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=4 * hidden,
                    seq_length=8, max_position_embeddings=8, padded_vocab_size=vocab, stable_embedding=True)
    torch.manual_seed(0)
    embedding = WordEmbedding(cfg)
    assert embedding.norm is not None  # the StableEmbedding's LayerNorm, without --embed-layernorm
    assert bound * 0.99 < embedding.weight.abs().max().item() <= bound
    tp_slice = torch.empty(vocab // 4, hidden)
    init_xavier_uniform_unpartitioned(tp_slice, vocab)
    assert bound * 0.99 < tp_slice.abs().max().item() <= bound
    plain = WordEmbedding(GPTConfig(**{**cfg.__dict__, "stable_embedding": False}))
    assert plain.norm is None and plain.weight.abs().max().item() < 0.02 * 6  # N(0, 0.02)
