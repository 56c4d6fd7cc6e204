"""Megatron-DeepSpeed semantics of the embedded trainer beyond the basics of test_train.py: curriculum learning,
--sync-tp-duplicated-parameters, GPT-2 BPE tokenizer files and vocab padding, weighted data blends, fp16 loss-scale
bookkeeping, CodeCarbon. Trainer runs are real subprocesses on the KJV (tiny model, a few iterations); the refusals at
start and the single-rank runs that need no process of their own run in one process (``batch``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, run_trainer, run_trainer_cases, tiny_trainer_args
from test_train import batch_run, one_line_error, records, resumed_from, succeeded

from opskit.logs.grammar import parse_iteration_line

GBS = 8
SEQ = 32
BLENDS = [["0.3", "a", "0.7"], ["x", "a", "0.7", "b"], ["-1", "a", "2", "b"]]


# ---------------------------------------------------------------------------------------------------------- batch

@pytest.fixture(scope="module")
def batch(kjv_data, numbers_prefix, tmp_path_factory) -> SimpleNamespace:
    """This module's single-rank command lines that need no trainer process of their own, run in one process
    (conftest's ``run_trainer_cases``) in the environment of :func:`offline_hub_cache` (no case reaches the Hub): the
    refusals at start, the runs that only check what they print, then :func:`batch_runs`. ``.done[name]``,
    ``.folder``, and ``.flags[name]`` a run's ``tiny_trainer_args`` overrides (its folder: ``.folder / name``)."""
    folder = tmp_path_factory.mktemp("batch")
    for name, curriculum in (("off", {**CURRICULUM, "enabled": False}), ("on", CURRICULUM),
                             ("beyond", {**CURRICULUM, "max_difficulty": 2 * SEQ})):
        (folder / f"{name}.json").write_text(json.dumps({"curriculum_learning": curriculum}))
    (folder / "train-splits.txt").write_text(f'"train: 0.4 0:0.9 {kjv_data.data_prefix}, 0.6 0:0.9 {numbers_prefix}"\n')
    (folder / "valid-splits.txt").write_text(f'"valid_kjv: 1 0.9:1 {folder / "gone"}"\n')
    (folder / "valid-both-splits.txt").write_text(f'"valid_kjv: 1 0.9:1 {kjv_data.data_prefix}" '
                                                  f'"valid_numbers: 1 0.9:1 {numbers_prefix}"\n')

    def args(name: str, **flags) -> list[str]:
        return tiny_trainer_args(kjv_data, folder / name, **{"save": None, "load": None, **flags})

    gpt2 = dict(tokenizer_name_or_path=None, tokenizer_type="GPT2BPETokenizer", vocab_file=folder / "v.json")
    blend = args("blend", data_path=None, train_samples=2 * GBS, split="90,10,0", eval_interval=2, eval_iters=1)
    halves = ["--data-path", "0.5", str(kjv_data.data_prefix), "0.5"]
    cases = {
        "curriculum off": args("off", train_samples=GBS, deepspeed_config=folder / "off.json"),
        "curriculum beyond seq length": args("beyond", deepspeed_config=folder / "beyond.json"),
        "train iters": args("iters", train_samples=None, train_iters=3),
        "pad vocab size to": args("to", train_samples=GBS, pad_vocab_size_to=2100, make_vocab_size_divisible_by=4),
        "pad vocab size to, too small": args("small", pad_vocab_size_to=1900, make_vocab_size_divisible_by=4),
        "gpt2 without merges": args("gpt2", **gpt2),
        "gpt2 files missing": args("gpt2", **gpt2, merge_file=folder / "m.txt"),
        **{f"blend {' '.join(value)}": args("bad-blend", data_path=None) + ["--data-path", *value]
           for value in BLENDS},
        "blend": blend + [*halves, numbers_prefix],
        "blend of a missing prefix": blend + [*halves, str(folder / "missing")],
        "weighted split of a missing prefix": args(
            "weighted", data_path=None, train_samples=2 * GBS, eval_interval=2, eval_iters=1,
            train_weighted_split_paths_path=folder / "train-splits.txt",
            valid_weighted_split_paths_path=folder / "valid-splits.txt"),
        "hub tokenizer absent": args("hub", tokenizer_name_or_path="opskit-test/absent"),
    }
    runs = batch_runs(kjv_data, folder)
    for name, flags in runs.items():
        cases[name] = tiny_trainer_args(kjv_data, folder / name, **flags)
    with pytest.MonkeyPatch.context() as env:
        for var, value in offline_hub_cache(kjv_data.tokenizer_dir, folder / "hf").items():
            env.setenv(var, value)
        done = run_trainer_cases(cases, folder / "cases")
    return SimpleNamespace(done=done, folder=folder, flags=runs)


def batch_runs(kjv_data, folder: Path) -> dict[str, dict]:
    """The fresh runs of :func:`batch`, name -> ``tiny_trainer_args`` overrides, each in ``folder / name``; the resume
    or PP=2 run a test compares one with runs in a process of its own."""
    curriculum = {**CURRICULUM_RUN, "deepspeed_config": folder / "on.json"}
    vocab, merges = gpt2_bpe_files(kjv_data.tokenizer_dir, folder)
    tokenized = dict(train_samples=2 * GBS, save=None, load=None, make_vocab_size_divisible_by=48)
    return {
        "curriculum": curriculum,
        "curriculum-stopped-at-3": {**curriculum, "exit_interval": 3},
        "curriculum-validated": dict(train_samples=8 * GBS, deepspeed_config=folder / "on.json", save=None, load=None,
                                     split="90,10,0", eval_interval=3, eval_iters=1),
        "hf-tokenizer": tokenized,
        "gpt2-bpe-files": {**tokenized, "tokenizer_name_or_path": None, "tokenizer_type": "GPT2BPETokenizer",
                           "vocab_file": vocab, "merge_file": merges},
        "hub-tokenizer": dict(train_samples=GBS, save=None, load=None, tokenizer_name_or_path="opskit-test/kjv-bpe"),
        "weighted-split-paths": dict(data_path=None, train_samples=2 * GBS, save=None, load=None, eval_interval=2,
                                     eval_iters=1, train_weighted_split_paths_path=folder / "train-splits.txt",
                                     valid_weighted_split_paths_path=folder / "valid-both-splits.txt"),
        "codecarbon": dict(train_samples=2 * GBS, save_interval=1, codecarbon_dir=folder / "codecarbon" / "emissions"),
    }


def offline_hub_cache(tokenizer_dir: str, home: Path) -> dict[str, str]:
    """The Hugging Face cache in ``home`` with the KJV tokenizer as the Hub repository ``opskit-test/kjv-bpe``, laid out
    by hand as huggingface_hub writes it; the environment that reads it as a node without internet does."""
    import shutil

    snapshot = home / "hub" / "models--opskit-test--kjv-bpe" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(Path(tokenizer_dir) / "tokenizer.json", snapshot / "tokenizer.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------------------------------------------------- curriculum

CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": SEQ,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 8}}
CURRICULUM_RUN = dict(train_samples=8 * GBS, save_interval=3, lr_warmup_samples=2 * GBS, lr_decay_tokens=1200,
                      hidden_dropout=0.1, attention_dropout=0.1)  # the resume exact with dropout on
"""8 iterations under :data:`CURRICULUM` (``batch``'s runs; their ds_config: ``batch.folder / "on.json"``),
checkpoints at 3, 6 and 8."""


def expected_seqlen(iteration: int) -> int:
    """fixed_linear by hand (reference 2.4): floor(step/total * (max - min) + min), down to a multiple of the step."""
    d = math.floor(iteration / 6 * (SEQ - 8) + 8)
    return min(d - d % 8, SEQ)


def test_curriculum_truncates_counts_tokens_logs_and_resumes(batch, kjv_data, tmp_path):
    """The straight run and the same run stopped at 3 (both in ``batch``); resumed from a copy of the straight run's
    step 3 in a process of its own."""
    run = batch_run(batch, "curriculum")
    runs = {"straight": records(run.stdout),
            "stopped": records(succeeded(batch.done["curriculum-stopped-at-3"]).stdout),
            "resumed": records(resumed_from(kjv_data, run, "global_step3", tmp_path).stdout)}
    straight = runs["straight"]
    assert sorted(straight) == list(range(1, 9))
    tokens = 0
    for iteration, record in straight.items():
        assert record["curriculum_seqlen"] == expected_seqlen(iteration), iteration
        tokens += GBS * expected_seqlen(iteration)
        assert record["consumed_tokens"] == tokens
        assert record["consumed_samples"] == iteration * GBS
    assert [straight[i]["curriculum_seqlen"] for i in (1, 2, 4, 6, 8)] == [8, 16, 24, 32, 32]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("curriculum_seqlen")} == {
        i: expected_seqlen(i) for i in range(1, 9)}
    # --lr-decay-tokens: cosine over the tokens consumed before each step, from those consumed when warmup ended.
    before = {i: straight[i - 1]["consumed_tokens"] if i > 1 else 0 for i in straight}
    warmup_tokens = before[2]
    for iteration, record in straight.items():
        if iteration <= 2:
            expected = 3e-3 * iteration * GBS / (2 * GBS)
        else:
            ratio = min(1.0, (before[iteration] - warmup_tokens) / (1200 - warmup_tokens))  # min-lr past 1200
            expected = 3e-4 + 0.5 * (math.cos(math.pi * ratio) + 1) * (3e-3 - 3e-4)
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-3), iteration
    assert sorted(runs["stopped"]) == [1, 2, 3] and sorted(runs["resumed"]) == list(range(4, 9))
    for iteration, record in {**runs["stopped"], **runs["resumed"]}.items():
        for key in ("lm_loss", "curriculum_seqlen", "consumed_tokens", "learning_rate"):
            assert record[key] == straight[iteration][key], (iteration, key)


def test_curriculum_pp2_with_full_length_validation_trains_like_pp1(batch, kjv_data, tmp_path):
    """The pipeline stages exchange new activation shapes when the seqlen changes and around validation (which runs
    at the full --seq-length): PP=2 gives PP=1's losses (PP=1: ``batch``'s run)."""
    args = tiny_trainer_args(kjv_data, tmp_path, **batch.flags["curriculum-validated"], pipeline_model_parallel_size=2)
    outputs = {1: succeeded(batch.done["curriculum-validated"]).stdout, 2: succeeded(run_trainer(args, nproc=2)).stdout}
    one, two = records(outputs[1]), records(outputs[2])
    assert sorted(two) == list(range(1, 9))
    for iteration in one:
        assert two[iteration]["curriculum_seqlen"] == expected_seqlen(iteration)
        assert two[iteration]["lm_loss"] == pytest.approx(one[iteration]["lm_loss"], rel=1e-5), iteration

    def valid(stdout: str) -> list[float]:
        return [float(line.split("lm loss value: ")[1].split(" ")[0]) for line in stdout.splitlines()
                if "validation loss at" in line]

    assert len(valid(outputs[2])) == 3 and valid(outputs[2]) == pytest.approx(valid(outputs[1]), rel=1e-5)


def test_without_curriculum_the_line_has_no_seqlen_field(batch):
    (record,) = records(succeeded(batch.done["curriculum off"]).stdout).values()
    assert "curriculum_seqlen" not in record and record["consumed_tokens"] == GBS * SEQ


def test_curriculum_beyond_seq_length_is_a_one_line_error(batch):
    one_line_error(batch.done["curriculum beyond seq length"], "curriculum_learning.max_difficulty", str(2 * SEQ),
                   str(batch.folder / "beyond.json"))


def test_micro_batches_truncate_tokens_and_labels_alike(kjv_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from opskit.train.data import GPTSamples, micro_batches

    samples = GPTSamples(IndexedDataset(str(kjv_data.data_prefix)), SEQ, 1234)
    length = {"now": 8}
    batches = micro_batches(samples, 0, 4, 1, 0, seqlen=lambda: length["now"])
    tokens, labels = next(batches)
    assert tokens.shape == labels.shape == (4, 8)
    full = torch.from_numpy(np.stack([samples[i] for i in range(4)]))
    assert torch.equal(tokens, full[:, :8]) and torch.equal(labels, full[:, 1:9])
    length["now"] = SEQ
    tokens, labels = next(batches)
    assert tokens.shape == (4, SEQ) and torch.equal(labels[:, :-1], tokens[:, 1:])


# ---------------------------------------------------------------------------------------------------------- TP sync

REPLICATED = ("input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
              "post_attention_layernorm.bias", "self_attention.dense.bias", "mlp.dense_4h_to_h.bias")


def _average_in_two_processes(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from opskit.train.tp_sync import sync_tp_duplicated_parameters

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    params = [torch.nn.Parameter(torch.full((3,), float(rank + 1))),
              torch.nn.Parameter(torch.tensor([[0.1, 0.2], [0.3, 0.4]]) * (rank + 1))]
    sync_tp_duplicated_parameters(params, dist.group.WORLD, 2)
    torch.save([p.detach() for p in params], f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_sync_averages_over_the_group_in_place(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_average_in_two_processes, args=(port, str(tmp_path)), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first[0], torch.full((3,), 1.5))
    assert torch.allclose(first[1], torch.tensor([[0.15, 0.3], [0.45, 0.6]]))


def test_tp2_sync_heals_and_keeps_duplicated_parameters_bitwise_equal(kjv_data, tmp_path):
    """BLOOM-176B's case: TP copies that drifted apart in a checkpoint. fp32 + ZeRO-0 keeps no master copy, so a
    perturbed layer file is what training resumes from; with the flag the copies are equal again after one step,
    without it they stay apart (DeepSpeed 0.19.8 itself keeps them equal, so drift is made by hand)."""
    import shutil

    def layer(save: Path, step: int, name: str, tp_rank: int) -> dict:
        return torch.load(save / f"global_step{step}" / f"layer_{name}-model_0{tp_rank}-model_states.pt",
                          weights_only=False)

    first = tmp_path / "first"
    succeeded(run_trainer(tiny_trainer_args(kjv_data, first, train_samples=4 * GBS, tensor_model_parallel_size=2,
                                            zero_stage=0, exit_interval=2, save_interval=2), nproc=2))
    drifted = first / "checkpoints" / "global_step2" / "layer_03-model_01-model_states.pt"
    state = torch.load(drifted, weights_only=False)
    state["input_layernorm.weight"] += 0.01
    state["self_attention.dense.bias"] -= 0.01
    torch.save(state, drifted)
    results = {}
    for sync in (True, False):
        out = tmp_path / f"sync-{sync}"
        shutil.copytree(first, out)
        args = tiny_trainer_args(kjv_data, out, train_samples=4 * GBS, tensor_model_parallel_size=2, zero_stage=0,
                                 save_interval=1, exit_interval=3, sync_tp_duplicated_parameters=sync)
        results[sync] = succeeded(run_trainer(args, nproc=2)).stdout
        save = out / "checkpoints"
        blocks = [[layer(save, 3, name, r) for r in (0, 1)] for name in ("03", "04")]
        for ranks in blocks:
            assert not torch.equal(ranks[0]["mlp.dense_h_to_4h.weight"], ranks[1]["mlp.dense_h_to_4h.weight"])
            for key in REPLICATED:
                if sync:
                    assert torch.equal(ranks[0][key], ranks[1][key]), key
                elif ranks is blocks[0] and key in ("input_layernorm.weight", "self_attention.dense.bias"):
                    assert not torch.equal(ranks[0][key], ranks[1][key]), key  # the drift stays (and spreads)
        embed, final = [layer(save, 3, "01", r) for r in (0, 1)], [layer(save, 3, "06", r) for r in (0, 1)]
        if sync:
            assert all(torch.equal(embed[0][k], embed[1][k]) for k in ("word_embeddings.norm.weight",
                                                                       "word_embeddings.norm.bias"))
            assert all(torch.equal(final[0][k], final[1][k]) for k in ("weight", "bias"))
    assert "> syncing 16 TP-duplicated parameters over the 2 TP ranks after every step" in results[True]
    assert "TP-duplicated" not in results[False]


# ---------------------------------------------------------------------------------------------------------- tokenizer

def gpt2_bpe_files(tokenizer_dir: str, out: Path) -> tuple[Path, Path]:
    """GPT-2's vocab.json and merges.txt for the KJV BPE tokenizer, as Megatron's GPT2BPETokenizer reads them."""
    model = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]
    vocab, merges = out / "vocab.json", out / "merges.txt"
    vocab.write_text(json.dumps(model["vocab"]))
    merges.write_text("#version: 0.2\n" + "".join(f"{' '.join(m) if isinstance(m, list) else m}\n"
                                                  for m in model["merges"]))
    return vocab, merges


def test_gpt2_bpe_files_train_like_the_same_tokenizer_from_hf(batch):
    hf, bpe = succeeded(batch.done["hf-tokenizer"]), succeeded(batch.done["gpt2-bpe-files"])
    padded = " > padded vocab (size: 2000) with 16 dummy tokens (new size: 2016)"  # 42 * 48
    assert padded in hf.stdout and padded in bpe.stdout
    assert [r["lm_loss"] for r in records(bpe.stdout).values()] == [r["lm_loss"] for r in records(hf.stdout).values()]


def test_hub_tokenizer_name_from_the_offline_cache(batch):
    """tr11's --tokenizer-name-or-path is a Hub repository: read from the Hugging Face cache, as on a compute node
    without internet (HF_HUB_OFFLINE=1); the cache is laid out by hand, as huggingface_hub writes it
    (:func:`offline_hub_cache`, the environment of ``batch``)."""
    done = succeeded(batch.done["hub-tokenizer"])
    assert " > padded vocab (size: 2000) with 48 dummy tokens (new size: 2048)" in done.stdout
    one_line_error(batch.done["hub tokenizer absent"], "--tokenizer-name-or-path opskit-test/absent",
                   "Hugging Face Hub")


def test_vocab_padding_follows_tp_and_pad_vocab_size_to(kjv_data, tmp_path, batch):
    args = tiny_trainer_args(kjv_data, tmp_path, train_samples=GBS, tensor_model_parallel_size=2,
                             make_vocab_size_divisible_by=48, save_interval=1)
    done = succeeded(run_trainer(args, nproc=2))
    assert " > padded vocab (size: 2000) with 16 dummy tokens (new size: 2016)" in done.stdout  # 21 * 96
    embed = torch.load(tmp_path / "checkpoints" / "global_step1" / "layer_01-model_01-model_states.pt",
                       weights_only=False)
    assert embed["word_embeddings.weight"].shape == (1008, 64)
    # Megatron-DeepSpeed's rule: --pad-vocab-size-to is a multiple of --make-vocab-size-divisible-by (and TP).
    done = succeeded(batch.done["pad vocab size to"])
    assert " > padded vocab (size: 2000) with 100 dummy tokens (new size: 2100)" in done.stdout
    one_line_error(batch.done["pad vocab size to, too small"], "--pad-vocab-size-to 1900", "2000")


def test_train_iters_trains_that_many_iterations(batch):
    """--train-iters (Megatron's iteration-based length; the spec's batch.train_iters) instead of --train-samples."""
    done = succeeded(batch.done["train iters"])
    got = records(done.stdout)
    assert sorted(got) == [1, 2, 3] and got[3]["consumed_samples"] == 3 * GBS
    assert "setting training iterations to 3" in done.stdout


def test_gpt2_tokenizer_needs_its_files(batch):
    one_line_error(batch.done["gpt2 without merges"], "--vocab-file", "--merge-file")
    one_line_error(batch.done["gpt2 files missing"], "--vocab-file", str(batch.folder / "v.json"))


# ---------------------------------------------------------------------------------------------------------- blends

@pytest.fixture(scope="module")
def numbers_prefix(tmp_path_factory) -> str:
    """A second indexed dataset whose token ids (1900..1999) tell its samples apart from the KJV's text."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("numbers") / "numbers_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(400):
        builder.add_document(torch.from_numpy(rng.integers(1900, 2000, size=64).astype(np.int64)), [64])
    builder.finalize(prefix + ".idx")
    return prefix


def test_blend_follows_the_weights_and_each_datasets_split(kjv_data, numbers_prefix):
    from opskit.rules.formats import parse_data_path
    from opskit.train.data import blend_samples

    blend = parse_data_path(["3", str(kjv_data.data_prefix), "7", numbers_prefix])
    assert blend == [(0.3, str(kjv_data.data_prefix)), (0.7, numbers_prefix)]
    train = blend_samples(blend, "90,10,0", 0, SEQ, 1234)
    from_numbers = np.array([train[i].min() >= 1900 for i in range(2000)])
    for n in (10, 100, 2000):  # every prefix within one sample of its share
        assert abs(from_numbers[:n].sum() - 0.7 * n) <= 1, n
    valid = blend_samples(blend, "90,10,0", 1, SEQ, 1234)
    valid_numbers = {tuple(valid[i]) for i in range(200) if valid[i].min() >= 1900}
    train_numbers = {tuple(train[i]) for i in range(2000) if from_numbers[i]}
    assert valid_numbers and not valid_numbers & train_numbers  # each dataset's split is its own


@pytest.mark.parametrize("value", BLENDS, ids=" ".join)
def test_bad_blend_is_a_one_line_error(batch, value):
    one_line_error(batch.done[f"blend {' '.join(value)}"], "--data-path", "WEIGHT PREFIX")


def test_trainer_trains_on_a_blend(batch):
    done = succeeded(batch.done["blend"])
    assert sorted(records(done.stdout)) == [1, 2] and "validation loss at iteration 2" in done.stdout
    one_line_error(batch.done["blend of a missing prefix"], "--data-path", str(batch.folder / "missing"))


# ---------------------------------------------------------------------------------------------------------- fp16

def test_loss_scale_skipped_and_nan_iterations_in_the_line(monkeypatch):
    """DeepSpeed refuses fp16 on this CPU (test_train.py checks the one-line error), so the bookkeeping is checked
    against DeepSpeed's own dynamic loss scaler and the log parser."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig

    from opskit.train.log import IntervalStats, current_loss_scale, iteration_line

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # for its OVERFLOW message, without a process group

    class ZeroOptimizerLike:  # DeepSpeedZeroOptimizer (ZeRO-1): cur_scale is a property over its loss_scaler
        def __init__(self, scaler):
            self.loss_scaler = scaler

        cur_scale = property(lambda self: self.loss_scaler.cur_scale)

    scaler = DynamicLossScaler(init_scale=2**12, scale_window=500, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    zero_optimizer = ZeroOptimizerLike(scaler)
    assert current_loss_scale(zero_optimizer) == 4096.0
    scaler.update_scale(True)  # an overflow: the step is skipped and the scale halves
    assert current_loss_scale(zero_optimizer) == 2048.0
    fp16_config = LossScaleConfig(torch.float16, dynamic_loss_scale=False, static_loss_scale=512.0,
                                  dynamic_loss_args=None)
    assert current_loss_scale(SimpleNamespace(loss_scale_config=fp16_config)) == 512.0  # FP16_Optimizer (ZeRO-0)
    assert current_loss_scale(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1)) is None

    stats = IntervalStats()
    for loss, skipped in ((2.0, False), (float("nan"), True), (float("inf"), False), (4.0, False)):
        stats.add(loss, skipped=skipped)
    assert (stats.skipped_iterations, stats.nan_iterations, stats.mean_loss) == (1, 1, 3.0)
    line = iteration_line(iteration=4, train_iters=10, consumed_samples=32, consumed_tokens=1024,
                          seconds_per_iteration=0.5, learning_rate=1e-3, global_batch_size=8, lm_loss=stats.mean_loss,
                          loss_scale=2048.0, grad_norm=1.0, skipped_iterations=stats.skipped_iterations,
                          nan_iterations=stats.nan_iterations, tflops=0.1)
    assert "| lm loss: 3.000000E+00 | loss scale: 2048.0 | grad norm: 1.000 |" in line
    record = parse_iteration_line(line)
    assert (record["loss_scale"], record["skipped_iterations"], record["nan_iterations"]) == (2048.0, 1, 1)


# ---------------------------------------------------------------------------------------------------------- CodeCarbon

def test_codecarbon_writes_offline_emissions(batch):
    pytest.importorskip("codecarbon")
    done = succeeded(batch.done["codecarbon"])
    rows = (batch.flags["codecarbon"]["codecarbon_dir"] / "emissions-000.csv").read_text().splitlines()
    assert rows[0].startswith("timestamp,project_name,run_id") and len(rows) >= 2, rows
    assert "the codecarbon package is not installed" not in done.stdout


def test_codecarbon_missing_is_one_warning(kjv_data, tmp_path):
    hide = tmp_path / "hide" / "codecarbon"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('No module named codecarbon')\n")
    env = dict(os.environ, PYTHONPATH=f"{hide.parent}{os.pathsep}{REPO}", OMP_NUM_THREADS="2")
    args = tiny_trainer_args(kjv_data, tmp_path, train_samples=GBS, save=None, load=None,
                             codecarbon_dir=tmp_path / "cc")
    done = subprocess.run([sys.executable, "-m", "opskit.train", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    succeeded(done)
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "--codecarbon-dir" in line]
    assert warnings == [f"WARNING: --codecarbon-dir {tmp_path / 'cc'}: the codecarbon package is not installed "
                        "(pip install codecarbon); training without emissions tracking"]


# ---------------------------------------------------------------------------------------------------------- weighted

def test_weighted_split_paths_parse_like_megatron_deepspeed():
    from opskit.rules.formats import parse_weighted_split_paths

    text = '"train: 0.3 0:0.95 /d/a_text_document, 0.7 0.1:0.9 /d/b_text_document"\n'
    assert parse_weighted_split_paths(text) == [
        ("train", [(0.3, 0.0, 0.95, "/d/a_text_document"), (0.7, 0.1, 0.9, "/d/b_text_document")])]
    two = parse_weighted_split_paths('"valid_a: 1 0.95:1 /d/a" "valid_b: 2 0.95:1 /d/b"')
    assert [name for name, _ in two] == ["valid_a", "valid_b"]
    for bad in ("train: 1 0:1 /d/a", '"train 1 0:1 /d/a"', '"train: 1 0.9:0.1 /d/a"', '"train: 1 0:1"',
                '"train: x 0:1 /d/a"', '"train: 0 0:1 /d/a"'):
        with pytest.raises(ValueError):
            parse_weighted_split_paths(bad)


def test_trainer_reads_weighted_split_paths_with_named_validation(batch):
    done = succeeded(batch.done["weighted-split-paths"])
    assert sorted(records(done.stdout)) == [1, 2]
    for name in ("valid_kjv", "valid_numbers"):
        for prefix in ("iteration 2", "the end of training for val data"):
            assert f"\n {name} loss at {prefix} | lm loss value: " in done.stdout, (name, prefix)
    losses = {name: float(done.stdout.split(f" {name} loss at iteration 2 | lm loss value: ")[1].split(" ")[0])
              for name in ("valid_kjv", "valid_numbers")}
    assert losses["valid_kjv"] != losses["valid_numbers"]
    splits = batch.folder / "valid-splits.txt"
    one_line_error(batch.done["weighted split of a missing prefix"], "--valid-weighted-split-paths-path", str(splits),
                   str(batch.folder / "gone"))


# ---------------------------------------------------------------------------------------------------------- presets

def test_every_bigscience_preset_command_line_is_accepted(monkeypatch, tmp_path):
    """Every preset's and variant's rendered command line parses in the trainer's own parser (tr8b-104B:bnb's
    --use-bnb-optimizer included)."""
    import yaml

    from opskit.run.paths import RunPaths
    from opskit.spec.load import load_spec
    from opskit.submission.render import trainer_args
    from opskit.train.args import parse_args

    for var in ("six_ALL_CCFRWORK", "six_ALL_CCFRSCRATCH"):
        monkeypatch.setenv(var, str(tmp_path / var))
    names = []
    for preset in sorted((REPO / "opskit" / "spec" / "presets").glob("*.yaml")):
        for variant in [None, *yaml.safe_load(preset.read_text()).get("variants", {})]:
            names.append(preset.stem + (f":{variant}" if variant else ""))
            spec = load_spec(names[-1])
            run = RunPaths.of(spec)
            assert parse_args(trainer_args(spec, run)).finished_flag_path == str(run.finished_flag)
    assert len(names) == 10 and {"tr8b-104B:bnb", "tiny:gpu"} <= set(names)
