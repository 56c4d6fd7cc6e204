"""opskit.spec.plan and the BigScience presets: every figure the seed notes print, reproduced from the specs; the
validation rules (one line, with the fix); variants; `opskit specs`; rendering the real cluster's job; property tests
over random specs. Pure Python and fast: no trainer, no SLURM."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from opskit.cli.app import app
from opskit.rules.deepspeed import installed_deepspeed_version
from opskit.rules.schedule import BatchRampup, annealing_lr, num_microbatches
from opskit.run.paths import RunPaths
from opskit.spec.files import SpecError
from opskit.spec.load import load_spec, validate_spec
from opskit.spec.new import list_specs
from opskit.spec.plan import (
    ACHIEVED_TFLOPS,
    GIB,
    activation_bytes_per_layer,
    bloom_parameters,
    gpt_parameters,
    make_plan,
    model_state_bytes,
    pipeline_bubble_factor,
    pipeline_stages,
    rampup_samples_fixed_steps,
    seqlen_schedule,
    training_days,
)
from opskit.spec.schema import Spec, deepspeed_resume_problem, padded_vocab_size, parse_slurm_time
from opskit.submission.render import deepspeed_config, render_job, trainer_args
from opskit.submission.submit import data_problems, trainer_problems
from opskit.train.args import parse_args

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "opskit" / "spec" / "presets"
BIGSCIENCE_ENV = ("six_ALL_CCFRWORK", "six_ALL_CCFRSCRATCH")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """An empty working directory (no trainings/ leaking in) and no BigScience variables."""
    monkeypatch.chdir(tmp_path)
    for var in BIGSCIENCE_ENV:
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def jean_zay(tmp_path, monkeypatch) -> Path:
    """Jean Zay's $six_ALL_CCFRWORK / $six_ALL_CCFRSCRATCH, as folders under tmp_path."""
    for var in BIGSCIENCE_ENV:
        (tmp_path / var).mkdir()
        monkeypatch.setenv(var, str(tmp_path / var))
    return tmp_path


def raw_of(name: str) -> dict:
    return yaml.safe_load((PRESETS / f"{name}.yaml").read_text())


def write(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def refused(path: Path) -> str:
    """The one-line SpecError of a spec file."""
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:"), message
    return message


def refused_variant(path: Path, variant: str) -> str:
    """The one-line SpecError of a variant of a spec file."""
    with pytest.raises(SpecError) as info:
        load_spec(f"{path}:{variant}")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: variant {variant}: "), message
    return message


def plan_of(name: str, **kwargs):
    return make_plan(load_spec(name), **kwargs)


# --------------------------------------------------------------------------- presets and variants

ALL_SPECS = ["tiny", "tr1-13B", "tr8-104B", "tr8b-104B", "tr8b-104B:cl", "tr8b-104B:emb-norm", "tr8b-104B:bnb",
             "tr11-176B-ml", "tr11-176B-ml:24n"]


def test_every_preset_and_variant_is_listed_and_valid(in_tmp):
    assert [e.name for e in list_specs()] == ["tiny", "tiny:gpu", "tr1-13B", "tr11-176B-ml", "tr11-176B-ml:24n",
                                              "tr8-104B", "tr8b-104B", "tr8b-104B:cl", "tr8b-104B:emb-norm",
                                              "tr8b-104B:bnb"]
    for entry in list_specs():
        spec = load_spec(entry.name)
        assert spec.name == entry.name and entry.description and entry.origin == "preset"
        assert spec.cli_name == entry.name
        assert spec.description == entry.description


def test_tr1_13B_reproduces_its_slurm_script(in_tmp):
    s = load_spec("tr1-13B")
    m, p, b, o, c, sl = s.model, s.parallel, s.batch, s.optimizer, s.checkpoint, s.slurm
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (40, 5120, 32, 20480)
    assert (m.seq_length, m.max_position_embeddings, m.position_embedding_type) == (2048, 2048, "absolute")
    assert (m.precision, m.checkpoint_activations, m.init_method_std) == ("fp16", True, 0.02)
    assert (p.gpus_per_node, p.gpu, p.gpu_memory_gb, p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size, p.zero_stage) == (4, "V100", 32, 2, 4, 1)
    assert p.nodes == 32 and p.data_parallel_size == 16  # "at most we can use 32 nodes (32*4/(4*2)=16)"
    assert (b.micro_batch_size, b.global_batch_size, b.rampup_batch_size) == (1, 1024, (16, 16, 5_000_000))
    assert b.train_samples == 300_000_000
    assert (o.lr, o.min_lr, o.lr_decay_style, o.lr_warmup_samples, o.lr_decay_samples) == (
        1e-4, 1e-5, "cosine", 216_320, 126_953_125)
    assert o.lr_decay_samples == 260_000_000_000 // 2048  # "tokens2samples = 260B / 2048"
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (0.9, 0.999, 1e-8, 0.1, 1.0)
    assert (c.save_interval, c.log_interval, c.eval_interval, c.eval_iters, c.tensorboard_queue_size, c.seed) == (
        1500, 10, 1000, 5, 5, 42)
    assert (sl.job_name, sl.account, sl.constraint, sl.cpus_per_task, sl.hint, sl.gres, sl.time, sl.array) == (
        "tr1-13B-round3", "six@v100", "v100-32g", 40, "nomultithread", "gpu:4", "20:00:00", 5)
    assert sl.partition is None and sl.qos is None and sl.reservation is None
    assert s.exit_duration_in_mins == 1190  # 60*20 - 10
    assert s.paths.output == "$six_ALL_CCFRSCRATCH/checkpoints/tr1-13B"
    assert s.paths.hub_repos == {k: f"bigscience/tr1-13B-{k}" for k in ("checkpoints", "tensorboard", "codecarbon",
                                                                         "logs")}
    d = s.data
    assert (d.data_path, d.split, d.tokenizer_type, d.vocab_size) == (
        "$six_ALL_CCFRWORK/datasets-custom/oscar-en/meg-gpt2_text_document", "949,50,1", "GPT2BPETokenizer", 50257)
    assert s.megatron_args["loss_scale"] == 12 and s.megatron_args["deepspeed_activation_checkpointing"] is True


def test_tr8_104B_is_the_readmes_wide_setup(in_tmp):
    s = load_spec("tr8-104B")
    assert (s.model.num_layers, s.model.hidden_size, s.model.num_attention_heads) == (32, 16384, 32)
    assert (s.parallel.tensor_model_parallel_size, s.parallel.pipeline_model_parallel_size) == (4, 32)
    assert s.batch.rampup_batch_size == (32, 32, 6_000_000) and s.batch.global_batch_size == 2048
    assert (s.optimizer.lr, s.optimizer.min_lr, s.optimizer.adam_beta2) == (6e-5, 6e-6, 0.95)
    assert (s.checkpoint.save_interval, s.checkpoint.log_interval, s.checkpoint.seed) == (300, 1, 43)
    plan = plan_of("tr8-104B")
    assert plan.parameters.hidden_per_layer == 512  # "hidden/layers ration of 512"
    assert plan.layout.gpus_per_replica == 128 and plan.layout.nodes_per_replica == 32  # "104B needs 128 gpus"
    assert plan_of("tr1-13B").layout.gpus_per_replica == 8  # "13B took 8 gpus for a single replica"


def test_tr11_reproduces_its_slurm_script(in_tmp):
    s = load_spec("tr11")
    m, p, b, o = s.model, s.parallel, s.batch, s.optimizer
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (70, 14336, 112, 2048)
    assert (m.position_embedding_type, m.embed_layernorm, m.pad_vocab_size_to, m.precision) == (
        "alibi", True, 250880, "bf16")
    assert m.init_method_std == round(math.sqrt(1 / (3 * 14336)), 4) == 0.0048
    assert (p.nodes, p.gpus_per_node, p.gpu, p.gpu_memory_gb) == (48, 8, "A100", 80)
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.zero_stage) == (4, 12, 0)
    assert p.pp_partition_method == "type:transformer|embedding"
    assert (b.micro_batch_size, b.global_batch_size, b.rampup_batch_size, b.train_samples) == (
        2, 2048, (192, 16, 9_765_625), 220_000_000)
    assert (o.lr_warmup_samples, o.lr_decay_samples, o.adam_beta2) == (183_105, 200_000_000, 0.95)
    assert o.lr_warmup_samples * 2048 == pytest.approx(375e6, rel=1e-5)  # "375M tokens"
    sl = s.slurm
    assert (sl.partition, sl.constraint, sl.reservation, sl.qos, sl.account, sl.cpus_per_task, sl.gres, sl.time) == (
        "gpu_p5", "a100", "hug", "qos_gpu-gc", "six@a100", 64, "gpu:8", "100:00:00")
    assert s.exit_duration_in_mins == 5990  # "for 100h 5990"
    assert (s.checkpoint.save_interval, s.checkpoint.eval_iters) == (100, 1)
    assert s.data.tokenizer_name_or_path.startswith("bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-no-norm")
    assert s.slurm.env["CUDA_LAUNCH_BLOCKING"] == "1"
    assert s.megatron_args["sync_tp_duplicated_parameters"] is True and s.megatron_args["valid_num_workers"] == 0
    assert s.paths.hub_repos == {"logs": "bigscience/tr11-176B-ml-logs"}


def test_tr8b_variants_are_deep_merged_overlays(in_tmp):
    base, cl = load_spec("tr8b-104B"), load_spec("tr8b:cl")
    assert cl.name == "tr8b-104B:cl" and cl.variant == "cl" and cl.cli_name == "tr8b-104B:cl"
    assert base.batch.rampup_batch_size == (16, 16, 6_000_000) and base.curriculum_learning is None
    # CL: "remove --rampup-batch-size, add --train-tokens, double --train-samples, add --lr-decay-tokens"
    assert cl.batch.rampup_batch_size is None
    assert (cl.batch.train_samples, cl.batch.train_tokens) == (600_000_000, 300_000_000_000)
    assert cl.optimizer.lr_decay_samples is None and cl.optimizer.lr_decay_tokens == 126_953_125 * 2048
    assert cl.optimizer.lr_warmup_samples == 3_750_000 and cl.checkpoint.eval_interval == 150
    assert cl.model.embed_layernorm and not base.model.embed_layernorm
    c = cl.curriculum_learning
    assert (c.min_difficulty, c.max_difficulty, c.schedule_type, c.total_curriculum_step, c.difficulty_step) == (
        64, 2048, "fixed_linear", 36000, 8)
    # Everything else is the base's.
    assert cl.model.num_layers == base.model.num_layers == 64 and cl.optimizer.lr == base.optimizer.lr == 6e-5
    assert cl.megatron_args == base.megatron_args and cl.slurm.job_name == "tr8b-104B"

    emb = load_spec("tr8b-104B:emb-norm")
    assert emb.parallel.nodes == 64 and emb.parallel.data_parallel_size == 2 and emb.model.embed_layernorm
    assert emb.exit_duration_in_mins == 1185 and emb.slurm.job_name == "tr8b-104B-emb-norm"
    assert emb.megatron_args["skip_train_iteration_range"] == ["13251-14000", "16651-19500"]
    assert emb.megatron_args["loss_scale"] == 12  # merged key by key, not replaced
    assert deepspeed_config(emb)["zero_allow_untested_optimizer"] is True
    bnb = load_spec("tr8b-104B:bnb")  # tr8b-104B-bnb.slurm: the base's flags plus --use-bnb-optimizer, still ZeRO-1
    assert bnb.megatron_args["use_bnb_optimizer"] is True and not bnb.model.embed_layernorm
    assert bnb.parallel.zero_stage == 1 and deepspeed_config(bnb)["zero_allow_untested_optimizer"] is True
    assert bnb.paths.output.endswith("/tr8b-104B/bnb") and bnb.slurm.job_name == "tr8b-104B-bnb"
    # StableEmbedding's LayerNorm counts: 2h parameters more than the base
    assert make_plan(bnb).parameters.total == make_plan(base).parameters.total + 2 * 11600

    with pytest.raises(SpecError, match=r"tr8b-104B\.yaml: no variant 'nope' \(known: cl, emb-norm, bnb\)$"):
        load_spec("tr8b-104B:nope")


def test_tr11_24_nodes(in_tmp):
    for spec in (load_spec("tr11-176B-ml:24n"), load_spec("tr11", overrides={"parallel": {"nodes": 24}})):
        assert spec.parallel.nodes == 24 and spec.parallel.data_parallel_size == 4
    plan = plan_of("tr11:24n")
    assert plan.layout.replicas == 4 and plan.batch.train_iters == 115311  # the layout never changes the schedule


def test_variants_in_user_files(in_tmp):
    raw = raw_of("tiny")
    raw["variants"] = {
        "two": {"description": "two GPUs", "parallel": {"gpus_per_node": 2}, "batch": {"global_batch_size": 32}},
        "ramp": {"batch": {"rampup_batch_size": [8, 8, 320]}},
        "typo": {"modle": {"num_layers": 2}},
    }
    path = write(in_tmp / "trainings" / "mine.yaml", raw)
    two = load_spec("mine:two")
    assert (two.name, two.parallel.gpus_per_node, two.batch.global_batch_size) == ("mine:two", 2, 32)
    assert two.model.num_layers == 4 and two.job_name == "mine-two"
    assert load_spec(f"{path}:ramp").batch.rampup_batch_size == (8, 8, 320)
    assert load_spec(f"{path}:ramp").cli_name == "mine:ramp"
    assert load_spec("mine").batch.global_batch_size == 16  # the base is untouched
    message = refused_variant(path, "typo")  # the message names the file, then the variant
    assert message.startswith(f"{path}: variant typo: modle: unknown key (expected one of: name, description, model")
    assert [e.name for e in list_specs()][:4] == ["mine", "mine:two", "mine:ramp", "mine:typo"]
    raw["variants"]["named"] = {"name": "x"}
    write(path, raw)
    with pytest.raises(SpecError, match=r"variants\.named\.name: not allowed in a variant"):
        load_spec("mine:two")  # a malformed variant spoils the whole file
    assert "variants.named.name: not allowed in a variant" in list_specs()[0].error


# --------------------------------------------------------------------------- the seed figures


def test_parameter_counts_as_the_readmes_print_them(in_tmp):
    # `print(f'Model size: {(l*(12*h**2 + 13*h) + v*h + s*h + 2*h) / 10**9 :.0f}B')`
    assert f"{plan_of('tr1-13B').parameters.readme_formula / 1e9:.0f}B" == "13B"
    assert f"{plan_of('tr8-104B').parameters.readme_formula / 1e9:.0f}B" == "104B"
    assert f"{plan_of('tr8b-104B').parameters.readme_formula / 1e9:.0f}B" == "104B"
    tr11 = plan_of("tr11-176B-ml")
    assert f"{tr11.parameters.readme_formula / 1e9:.0f}B" == "176B"
    # "hidden/layers ratio: 204, hidden/heads ratio: 128"
    assert (int(tr11.parameters.hidden_per_layer), int(tr11.parameters.hidden_per_head)) == (204, 128)
    # Megatron's exact counts (padded vocabularies); BLOOM-176B's is the published 176,247,271,424.
    assert tr11.parameters.total == bloom_parameters(70, 14336, 250880) == 176_247_271_424
    assert tr11.parameters.architecture == "bloom"
    assert plan_of("tr1-13B").parameters.total == gpt_parameters(40, 5120, 50432, 2048) == 12_854_282_240
    assert padded_vocab_size(50257, load_spec("tr1-13B").model, 2) == 50432  # a multiple of 128 * TP


def test_model_state_memory_234_and_1872_GB(in_tmp):
    # "Total: 234GB (18*13)", "Total: 1872GB (18*104)"
    assert model_state_bytes(13e9) == 234e9 and model_state_bytes(104e9) == 1872e9
    tr1, tr8 = plan_of("tr1-13B").memory, plan_of("tr8-104B").memory
    assert tr1.bytes_per_parameter == {"fp32_weights": 4, "model_weights": 2, "optimizer_states": 8, "gradients": 4}
    assert (tr1.replica_gb_readme, tr8.replica_gb_readme) == (234, 1872)
    assert tr1.replica_gb == pytest.approx(18 * 12_854_282_240 / 1e9)  # 231.4 GB with the exact count
    # "we use 256GB (8x 32GB gpus) per each full replica": the estimate fits a V100 with room for activations.
    assert tr1.fits and tr1.total_gib_per_gpu < 32 and tr1.sharded_over == 16


def test_tr11_checkpoint_is_the_chronicles_2_3_tb_and_its_background_saves_need_48_gib_per_node(in_tmp):
    """"With 2.3TB checkpoint size and 40 secs to save": 14 bytes per parameter (16-bit weights, fp32 master weights,
    Adam's moments; no gradients) of 176B, and the last stage's optimizer part of its tied embedding (12 bytes of
    each of its 3.6e9 parameters), is 2.51e12 bytes, 2.28 TiB; spread over 48 nodes."""
    plan = plan_of("tr11-176B-ml")
    memory, total, tied = plan.memory, plan.parameters.total, plan.parameters.embedding
    assert memory.checkpoint_bytes == pytest.approx(14 * total + 12 * tied)
    assert memory.checkpoint_gb == memory.checkpoint_bytes / 1e9
    assert memory.checkpoint_bytes / 2**40 == pytest.approx(2.28, abs=0.01)
    assert memory.async_save_host_gib_per_node == pytest.approx(memory.checkpoint_gb * 1e9 / 48 / GIB)
    synchronous = make_plan(load_spec("tr11-176B-ml", {"checkpoint": {"async_save": False}}))
    assert synchronous.memory.async_save_host_gib_per_node is None
    bnb = plan_of("tr8b-104B:bnb")
    # 8-bit moments: 2 + 4 + 2, the tied embedding's 4 + 2 on the last stage too
    assert bnb.memory.checkpoint_bytes == pytest.approx(8 * bnb.parameters.total + 6 * bnb.parameters.embedding)


def test_bnb_counts_two_bytes_of_optimizer_state_per_parameter(in_tmp):
    base, bnb = plan_of("tr8b-104B").memory, plan_of("tr8b-104B:bnb").memory
    assert bnb.bytes_per_parameter == {"fp32_weights": 4, "model_weights": 2, "optimizer_states": 2, "gradients": 4}
    assert bnb.total_bytes_per_parameter == 12 and bnb.replica_gb_readme == 12 * 104
    # The heaviest GPU (stage 0: 2 layers + embeddings, TP=4, ZeRO-1 over DP=4): every state 8-bit under fp16 ZeRO-1,
    # the word embedding's too; the one difference in parameters is StableEmbedding's LayerNorm (2h).
    stage, base_stage = bnb.stages[bnb.heaviest_stage], base.stages[base.heaviest_stage]
    assert bnb.optimizer_state_gib_per_gpu * GIB == pytest.approx(stage.parameters_per_gpu * 2 / 4)
    assert base.optimizer_state_gib_per_gpu * GIB == pytest.approx(base_stage.parameters_per_gpu * 8 / 4)
    assert stage.parameters_per_gpu - base_stage.parameters_per_gpu == 2 * 11600 / 4
    assert bnb.optimizer_state_gib_per_gpu / base.optimizer_state_gib_per_gpu == pytest.approx(1 / 4, rel=1e-4)
    assert base.model_state_gib_per_gpu - bnb.model_state_gib_per_gpu == pytest.approx(
        base.optimizer_state_gib_per_gpu - bnb.optimizer_state_gib_per_gpu, rel=1e-4)
    assert "bitsandbytes 8-bit Adam: 2 bytes per parameter (the word embedding's too" in bnb.optimizer

    # fp32 with ZeRO-0, where the trainer's StableEmbedding override takes hold: the word embedding counts 8 bytes.
    raw = raw_of("tiny")
    raw["megatron_args"] = {"use_bnb_optimizer": True}
    raw["parallel"]["zero_stage"] = 0
    tiny = make_plan(load_spec(str(write(in_tmp / "bnb-tiny.yaml", raw)))).memory
    [only] = tiny.stages
    words = padded_vocab_size(8000, load_spec("tiny").model, 1) * 128  # V_pad * h of the tiny preset
    assert only.optimizer_state_gib * GIB == only.parameters_per_gpu * 2 + words * (8 - 2)
    assert "the word embedding's 32-bit (8 bytes: StableEmbedding)" in tiny.optimizer

    done = CliRunner().invoke(app, ["plan", "tr8b-104B:bnb"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert "12 = 4 fp32 weights + 2 model weights + 2 optimizer states + 4 gradients" in done.stdout
    assert f"optimizer states {bnb.optimizer_state_gib_per_gpu:.3g} GiB of them" in done.stdout


def test_tr1_rampup_schedule(in_tmp):
    b = plan_of("tr1-13B").batch
    # "over 63 (`(1024-16)/16`) intervals", "79365 (`5_000_000/63`) is the number of samples before the next GBS
    # increment ... 4960 steps (`79365/16`) ... 2480 steps. Then 1653 steps at GBS=48, 1240 at GBS=64"
    assert b.num_increments == 63 and int(b.samples_per_increment) == 79_365
    rows = {r.global_batch_size: r for r in b.rows[:-1]}
    assert [rows[g].nominal_iterations for g in (16, 32, 48, 64)] == [4960, 2480, 1653, 1240]
    # What Megatron really runs (its ramp-up replayed): one more iteration where 79365.08 is not a multiple of GBS.
    assert [rows[g].iterations for g in (16, 32, 48, 64)] == [4961, 2480, 1654, 1240]
    assert list(rows) == list(range(16, 1024, 16))
    assert sum(r.iterations for r in b.rows) == b.train_iters == 311_541  # the log's "168000/  311541"
    assert b.rows[-1].global_batch_size == 1024


def test_tr1_warmup_216320_samples(in_tmp):
    # "2000=160*12+80 ... so we will get to 2000 in 216_320 samples `16*160*12*(12+1)/2+16*13*80`": the README's
    # model holds each GBS for 160 steps.
    assert rampup_samples_fixed_steps(2000, start=16, increment=16, steps_per_increment=160) == 216_320
    assert 16 * 160 * 12 * (12 + 1) // 2 + 16 * 13 * 80 == 216_320
    # Megatron holds each GBS for 79_365 samples instead, so 216_320 samples take 8641 iterations, not 2000.
    lr = plan_of("tr1-13B").lr
    assert (lr.warmup_samples, lr.warmup_iterations) == (216_320, 8641)
    rampup = BatchRampup(1024, (16, 16, 5_000_000))
    assert rampup.consumed_samples(8640) < 216_320 <= rampup.consumed_samples(8641)


def test_31_35_days_and_the_math_readme_example():
    # tr1-13B: `Btokens=300; Bmodel=13; n_gpus=256; Tflops=45` -> "31.35 days"
    assert f"{training_days(300e9, 13e9, 256, 45):0.2f}" == "31.35"
    # math/README.md: 450B tokens, 167B (sic) parameters, 384 GPUs at 150 TFLOPs -> 120.80 days
    assert f"{training_days(450e9, 167e9, 384, 150):.2f}" == "120.80"


def test_time_estimates_from_the_specs(in_tmp):
    tr1 = plan_of("tr1-13B", gpus=256, tflops=45).time
    # The spec trains 300M samples (614.4B tokens; the README's 31.35 days are for 300B) with the exact count.
    assert tr1.days == pytest.approx(training_days(614.4e9, 12_854_282_240, 256, 45))
    assert tr1.days_with_rampup_slowdown is None  # the ramp-up cannot run on 256 GPUs (DP 32 > 16)
    tr1 = plan_of("tr1-13B").time  # 32 nodes, the V100's 45 TFLOPs by default
    assert (tr1.gpus, tr1.tflops) == (128, ACHIEVED_TFLOPS["V100"])
    assert tr1.days < tr1.days_with_rampup_slowdown  # "much slower in the first 10k steps"

    tr11 = plan_of("tr11-176B-ml").time
    assert (tr11.gpus, tr11.tflops) == (384, 150)
    # "A single train iteration is about 105 secs" at "149-150 TFLOPs per GPU"
    assert 100 < tr11.seconds_per_iteration < 110
    # "7 days after the launch the training finished the batch size ramp up stage" (20B tokens): the estimate,
    # bubble slowdown included, is 6.4 days (5.7 without it).
    assert 5.5 < tr11.rampup_days < 7.5
    assert tr11.days == pytest.approx(training_days(220e6 * 2048, 176_247_271_424, 384, 150))


def test_tr11_log_lines(in_tmp):
    """The chronicles' log lines: consumed samples, learning rate and TFLOPs at their iterations."""
    spec = load_spec("tr11")
    rampup = BatchRampup(spec.batch.global_batch_size, spec.batch.rampup_batch_size)
    plan = make_plan(spec)
    for iteration, samples, lr, seconds, tflops in [(12695, 9_841_584, "5.969E-05", 105.22, "149.02"),
                                                    (31214, 47_768_496, "5.279E-05", 106.46, "147.29"),
                                                    (31251, 47_844_272, "5.277E-05", 106.09, "147.80")]:
        assert rampup.consumed_samples(iteration) == samples
        learning_rate = annealing_lr(max_lr=6e-5, min_lr=6e-6, warmup_steps=183_105, decay_steps=200_000_000,
                                     decay_style="cosine", num_steps=samples)
        assert f"{learning_rate:.3E}" == lr
        assert f"{plan.time.flops_per_iteration_recompute / (seconds * 384 * 1e12):.2f}" == tflops
    assert plan.batch.train_iters == 115_311  # "iteration 12695/  115311"
    assert plan.batch.tokens == 220_000_000 * 2048  # "450B tokens"
    assert 9_765_625 * 2048 == 20_000_000_000  # "over 9_765_625 samples (~20B tokens)"


def test_tr1_and_tr8b_log_lines(in_tmp):
    tr1 = BatchRampup(1024, (16, 16, 5_000_000))
    assert tr1.consumed_samples(168_000) == 153_013_584  # "iteration 168000/ 311541 | consumed samples: 153013584"
    spec = load_spec("tr8b-104B")
    rampup = BatchRampup(spec.batch.global_batch_size, spec.batch.rampup_batch_size)
    assert make_plan(spec).batch.train_iters == 159_576  # "iteration 6502/ 159576"
    for iteration, samples, gbs in [(6502, 216_960, 80), (6503, 217_040, 80), (8600, 464_560, 160),
                                    (12000, 1_519_744, 528), (12001, 1_520_272, 528), (13251, 2_333_840, 800),
                                    (14000, 3_014_320, 1024)]:
        assert rampup.consumed_samples(iteration) == samples
        assert rampup.batch_size(rampup.consumed_samples(iteration - 1)) == gbs


def test_tr11_layout(in_tmp):
    plan = plan_of("tr11-176B-ml")
    lay = plan.layout
    # "One replica is 48 GPUs -> 8 replicas -> with MBS=2 (8*2) can do GBS increments of 16"
    assert (lay.world_size, lay.gpus_per_replica, lay.replicas, lay.batch_granularity) == (384, 48, 8, 16)
    assert plan.batch.rampup_increment == 16
    assert lay.valid_nodes_rampup == [6, 12, 24, 48]
    # "784/(2*8) = 49 microbatches over 12 PP stages"
    assert num_microbatches(784, 2, 8) == 49 and lay.microbatches_per_iteration == 128
    # 'type:transformer|embedding': [embed|5 blocks], 10 x [6], [5|embed]
    assert pipeline_stages(load_spec("tr11")) == [(5, True, False), *[(6, False, False)] * 10, (5, False, True)]
    memory = plan.memory
    assert memory.sharded_over == 8  # bf16 with ZeRO-0: DeepSpeed's bf16 optimizer shards like ZeRO-1
    assert memory.fits and memory.total_gib_per_gpu < 80
    # Why BLOOM trained with --checkpoint-activations: Megatron-DeepSpeed's unfused softmax kept the [b, a, s, s]
    # scores, and stage 0's layers x micro-batches in flight would not have fit an A100 without recomputation.
    stage = memory.stages[0]
    scores_kept = stage.layers * stage.in_flight_microbatches * activation_bytes_per_layer(
        2048, 2, 14336, 112, tp=4, attention_scores=True) / 2**30
    assert stage.model_state_gib + scores_kept > 140
    assert memory.activation_gib_per_gpu_no_recompute > 50  # fused attention keeps no scores, and still too much
    without = make_plan(load_spec("tr11", overrides={"model": {"checkpoint_activations": False}}))
    assert without.memory.fits is False
    assert any(w.startswith("GPU memory: ") and "(without activation checkpointing) exceeds the 80 GiB of one A100"
               in w for w in without.warnings)
    assert not any(w.startswith("GPU memory") for w in plan.warnings)


def test_tr1_valid_node_counts(in_tmp):
    lay = plan_of("tr1-13B").layout
    assert lay.valid_nodes_rampup == [2, 4, 8, 16, 32]  # "at most we can use 32 nodes"
    # "Once GBS reaches 1024 ... 64 nodes or may be even 128 nodes ... So 96 nodes won't work"
    assert {64, 128} <= set(lay.valid_nodes_full_batch) and 96 not in lay.valid_nodes_full_batch
    assert max(lay.valid_nodes_full_batch) * 4 == 8192  # "we can use up to 8192 GPUs (1024*2*4)"


def test_tr8b_curriculum_learning(in_tmp):
    plan = plan_of("tr8b-104B:cl")
    cl = plan.curriculum
    # "total iterations 300B/2K/2K = 71525 steps. So total_curriculum_step ~= 36_000"
    assert int(300e9 / 2048 / 2048) == 71525
    assert round(cl.recommended_total_curriculum_step, -3) == 36_000 == cl.total_curriculum_step
    # eval every 150: "the current period between switching seqlen"
    assert cl.iterations_per_difficulty_step == pytest.approx(145.16, abs=0.01)
    assert cl.min_difficulty % 8 == 0 and cl.max_difficulty == 2048
    spec = load_spec("tr8b-104B:cl")
    seqlens = [seqlen_schedule(spec).seqlen(step) for step in (1, 145, 146, 18000, 36000, 50000)]
    assert seqlens == [64, 64, 72, 1056, 2048, 2048]
    assert cl.curriculum_tokens < 36_000 * 2048 * 2048
    assert plan.batch.rampup_start is None and plan.batch.train_iters == 600_000_000 // 2048
    # "LR_WARMUP_SAMPLES= 375e6/100 = 3_750_000, this leads to 375e6/100/2048 = 1.8K warmup steps"
    assert plan.lr.warmup_iterations == math.ceil(3_750_000 / 2048) == 1832
    # Token-based decay and stop: fewer tokens per step during the curriculum, so more steps than 260e9/4.2M.
    assert plan.lr.decay_tokens_iterations > 260e9 / (2048 * 2048)
    assert cl.iterations_to_train_tokens > 71525
    assert any("--train-tokens" in w for w in plan.warnings)
    assert deepspeed_config(spec)["curriculum_learning"] == {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 64, "max_difficulty": 2048,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 36000, "difficulty_step": 8}}


def test_formula_sources():
    # Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per layer at t = 1.
    assert activation_bytes_per_layer(2048, 1, 5120, 32, attention_scores=True) == 2048 * 5120 * (
        34 + 5 * 32 * 2048 / 5120)
    assert activation_bytes_per_layer(2048, 1, 5120, 32) == 2048 * 5120 * 34  # fused attention keeps no scores
    # TP 4: 10 + 24/4 bytes per s*b*h; sequence parallelism splits all but the two gathered linear inputs (4 + 30/4)
    assert activation_bytes_per_layer(2048, 1, 5120, 32, tp=4) == 2048 * 5120 * 16
    assert activation_bytes_per_layer(2048, 1, 5120, 32, tp=4, sequence_parallel=True) == 2048 * 5120 * 11.5
    assert activation_bytes_per_layer(2048, 1, 5120, 32, sequence_parallel=True) == 2048 * 5120 * 34
    assert pipeline_bubble_factor(12, 12) == pytest.approx(23 / 12)
    assert BatchRampup(64).iterations_to_samples(65) == 2
    assert parse_slurm_time("100:00:00") - 10 == 5990


# --------------------------------------------------------------------------- validation rules


def test_rampup_with_train_iters_is_refused(in_tmp):
    raw = raw_of("tr1-13B")
    raw["batch"]["train_iters"] = raw["batch"].pop("train_samples") // 1024
    message = refused(write(in_tmp / "iters.yaml", raw))
    assert message.endswith("batch: rampup_batch_size needs train_samples: Megatron refuses --rampup-batch-size with "
                            "--train-iters (the ramp is counted in samples); replace train_iters with train_samples")
    raw["batch"]["rampup_batch_size"] = None  # without a ramp-up, train_iters is fine
    spec = load_spec(str(write(in_tmp / "iters-ok.yaml", raw)))
    assert make_plan(spec).batch.train_iters == 300_000_000 // 1024
    assert "--train-iters" in trainer_args(spec, RunPaths(in_tmp), environ={v: "/x" for v in BIGSCIENCE_ENV})
    raw["batch"]["train_samples"] = 5
    assert "set exactly one of train_samples and train_iters" in refused(write(in_tmp / "both.yaml", raw))


def test_batch_not_divisible_lists_the_valid_node_counts(in_tmp):
    raw = raw_of("tr1-13B")
    raw["parallel"]["nodes"] = 128  # the script's NNODES: DP 64 cannot split the ramp-up's GBS 16
    message = refused(write(in_tmp / "nodes.yaml", raw))
    assert ("batch.rampup_batch_size start 16 is not divisible by micro_batch_size*DP = 64 (1*64 at 128 nodes); "
            "valid parallel.nodes for this layout: 2, 4, 8, 16, 32") in message
    assert "batch.rampup_batch_size increment 16 is not divisible" in message
    assert "global_batch_size" not in message  # 1024 splits fine

    with pytest.raises(SpecError) as info:  # the same through `opskit plan tr11 --nodes 7`
        load_spec("tr11", overrides={"parallel": {"nodes": 7}})
    assert str(info.value).endswith("(with parallel.nodes=7 from the command line)")
    assert ("parallel: 56 processes (7 nodes x 8) are not divisible by TP*PP = 48 (parallel.tensor_model_parallel_size "
            "4, parallel.pipeline_model_parallel_size 12); valid parallel.nodes for this layout: 6, 12, 24, 48") in \
        str(info.value)

    raw = raw_of("tiny")
    raw["batch"]["global_batch_size"] = 12
    assert "no node count works with micro_batch_size 8: use a micro_batch_size that divides 12" in refused(
        write(in_tmp / "mbs.yaml", raw))


def test_heads_ffn_layers_and_vocab_must_divide_the_layout(in_tmp):
    raw = raw_of("tiny")
    raw["parallel"].update(gpus_per_node=3, tensor_model_parallel_size=3)
    assert ("model.num_attention_heads 4 is not divisible by parallel.tensor_model_parallel_size 3 (Megatron splits "
            "heads over TP): use TP in 1, 2, 4") in refused(write(in_tmp / "tp.yaml", raw))

    raw = raw_of("tr11-176B-ml")
    raw["parallel"]["pp_partition_method"] = None
    assert ("model.num_layers 70 is not divisible by parallel.pipeline_model_parallel_size 12: use PP in 1, 2, 5, 7, "
            "10, 14, 35, 70, or set parallel.pp_partition_method (e.g. 'type:transformer|embedding') to balance "
            "uneven stages") in refused(write(in_tmp / "pp.yaml", raw))

    raw = raw_of("tr11-176B-ml")
    raw["model"]["pad_vocab_size_to"] = 250000
    assert ("model.pad_vocab_size_to 250000 is not divisible by model.make_vocab_size_divisible_by 128 and "
            "parallel.tensor_model_parallel_size 4 (Megatron-DeepSpeed's vocabulary padding rule): use 250112"
            ) in refused(write(in_tmp / "vocab.yaml", raw))
    raw["model"]["pad_vocab_size_to"] = 250112  # 128 * 1954, 4 * 62528: Megatron-DeepSpeed pads to it (not 512 * k)
    assert make_plan(load_spec(str(write(in_tmp / "vocab.yaml", raw)))).parameters.padded_vocab_size == 250112
    raw["model"]["pad_vocab_size_to"] = 249856
    assert "is below data.vocab_size 250000" in refused(write(in_tmp / "small.yaml", raw))


def test_bf16_zero0_on_deepspeed_versions_that_cannot_resume(in_tmp, jean_zay, monkeypatch):
    raw = raw_of("tr11-176B-ml")
    for version in ("0.18.0", "0.18.4"):
        raw["parallel"]["deepspeed_version"] = version
        message = refused(write(in_tmp / f"ds-{version}.yaml", raw))
        assert (f"parallel.deepspeed_version {version}: model.precision bf16 with parallel.zero_stage 0 on DeepSpeed "
                f"{version} saves the optimizer states but never loads them back") in message
        assert "use parallel.zero_stage 1" in message
    for version in ("0.18.5", "0.19.8"):  # the trainer loads the states itself there (opskit.train.ds_compat)
        raw["parallel"]["deepspeed_version"] = version
        assert load_spec(str(write(in_tmp / f"ds-{version}.yaml", raw))).parallel.zero_stage == 0
    raw["parallel"]["deepspeed_version"] = "0.17.6"
    assert load_spec(str(write(in_tmp / "ok-0.17.6.yaml", raw))).parallel.deepspeed_version == "0.17.6"
    raw["parallel"].update(deepspeed_version="0.19.8", zero_stage=1)  # ZeRO-1 resumes fine
    load_spec(str(write(in_tmp / "z1.yaml", raw)))

    # Not pinned: `opskit submit` and `opskit plan` check the DeepSpeed installed here.
    raw = raw_of("tiny")
    raw["model"]["precision"] = "bf16"
    raw["parallel"]["zero_stage"] = 0
    raw["paths"]["output"] = str(in_tmp / "run")
    spec = load_spec(str(write(in_tmp / "bf16.yaml", raw)))
    monkeypatch.setattr("opskit.spec.schema.installed_deepspeed_version", lambda: "0.18.3")
    [problem] = trainer_problems(spec)
    assert re.search(r"on DeepSpeed 0\.18\.3 saves the optimizer states but never loads them", problem)
    assert any("never loads them back" in w for w in make_plan(spec).warnings)
    for version in ("0.17.6", "0.19.8"):
        monkeypatch.setattr("opskit.spec.schema.installed_deepspeed_version", lambda v=version: v)
        assert trainer_problems(spec) == []
        assert not any("zero_stage 0" in w for w in make_plan(spec).warnings)


def test_zero0_pipeline_clipping_on_deepspeed_0_19(in_tmp, jean_zay):
    raw = raw_of("tr8-104B")  # fp16, PP=32, clip_grad 1.0
    raw["parallel"].update(zero_stage=0, deepspeed_version="0.19.8")
    message = refused(write(in_tmp / "z0.yaml", raw))
    assert ("parallel.deepspeed_version 0.19.8: model.precision fp16 with parallel.zero_stage 0 and "
            "parallel.pipeline_model_parallel_size 32 clips gradients with pipeline stage 0's norm only") in message
    raw["optimizer"]["clip_grad"] = 0.0
    load_spec(str(write(in_tmp / "noclip.yaml", raw)))
    raw["optimizer"]["clip_grad"] = 1.0
    raw["parallel"]["deepspeed_version"] = "0.18.5"  # not measured there: not refused
    load_spec(str(write(in_tmp / "older.yaml", raw)))


def test_curriculum_rules(in_tmp):
    raw = raw_of("tr8b-104B")
    cl = raw["variants"]["cl"]
    cl["curriculum_learning"]["min_difficulty"] = 60
    cl["curriculum_learning"]["difficulty_step"] = 12
    path = write(in_tmp / "cl.yaml", raw)
    message = refused_variant(path, "cl")
    assert ("curriculum_learning.min_difficulty 60 is not a multiple of 8 (Tensor Core alignment, DeepSpeed's "
            "curriculum guide): use 56 or 64") in message
    assert "curriculum_learning.difficulty_step 12 is not a multiple of 8" in message
    cl["curriculum_learning"].update(min_difficulty=64, difficulty_step=8, max_difficulty=4096)
    assert "curriculum_learning.max_difficulty 4096 exceeds model.seq_length 2048: use 2048" in refused_variant(
        write(in_tmp / "cl.yaml", raw), "cl")
    cl["curriculum_learning"].update(max_difficulty=None, schedule_type="fixed_root")
    assert "root_degree is required with schedule_type fixed_root" in refused_variant(
        write(in_tmp / "cl.yaml", raw), "cl")
    cl["curriculum_learning"]["root_degree"] = 2
    spec = load_spec(f"{write(in_tmp / 'cl.yaml', raw)}:cl")
    assert spec.curriculum_max_difficulty == 2048
    assert seqlen_schedule(spec).seqlen(9000) == 1056  # sqrt(1/4) of the way


def test_exit_duration_must_be_below_the_time_limit(in_tmp):
    raw = raw_of("tiny")
    raw["slurm"].update(time="20:00:00", exit_margin_mins=0)
    assert ("slurm: exit_margin_mins 0: --exit-duration-in-mins 1200 is not below the time limit 20:00:00 (1200 min), "
            "so SLURM kills the job before it saves; set a margin of one iteration plus one checkpoint save "
            "(BigScience: 10)") in refused(write(in_tmp / "exit.yaml", raw))
    raw["slurm"].update(time="10", exit_margin_mins=10)
    assert "leaves no training time within the time limit 10" in refused(write(in_tmp / "none.yaml", raw))


def test_unknown_keys_and_other_refusals(in_tmp):
    raw = raw_of("tr11-176B-ml")
    raw["curriculum_learning"] = {"min_dificulty": 64, "total_curriculum_step": 10}
    raw["parallel"]["zero_stag"] = 1
    message = refused(write(in_tmp / "typos.yaml", raw))
    assert "parallel.zero_stag: unknown key (expected one of: nodes, gpus_per_node, gpu, gpu_memory_gb," in message
    assert ("curriculum_learning.min_dificulty: unknown key (expected one of: curriculum_type, min_difficulty,"
            in message)

    raw = raw_of("tr11-176B-ml")
    raw["slurm"]["gres"] = "gpu:4"
    assert ("slurm.gres gpu:4 asks for 4 GPUs per node but parallel.gpus_per_node is 8: make them equal"
            in refused(write(in_tmp / "gres.yaml", raw)))
    raw = raw_of("tr11-176B-ml")
    raw["megatron_args"]["num_layers"] = 2
    raw["megatron_args"]["Bad-Key"] = True
    message = refused(write(in_tmp / "flags.yaml", raw))
    assert "megatron_args: num_layers: --num-layers comes from model.num_layers; set it there" in message
    raw["megatron_args"] = {"fp16": True}
    assert "--fp16 comes from model.precision" in refused(write(in_tmp / "fp16.yaml", raw))
    raw["megatron_args"] = {"Bad-Key": True}
    assert "'Bad-Key' is not the snake_case of a flag" in refused(write(in_tmp / "key.yaml", raw))
    raw = raw_of("tr11-176B-ml")
    raw["deepspeed_config"] = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
    assert "deepspeed_config: zero_optimization.stage comes from parallel.zero_stage; set it there" in refused(
        write(in_tmp / "ds.yaml", raw))
    raw = raw_of("tr1-13B")
    del raw["data"]["merge_file"]
    assert "data: tokenizer_type GPT2BPETokenizer needs vocab_file and merge_file" in refused(
        write(in_tmp / "merges.yaml", raw))
    raw = raw_of("tiny")
    raw["data"]["data_path"] = "/somewhere/x_text_document"
    assert "data: set exactly one source" in refused(write(in_tmp / "two-sources.yaml", raw))


def test_environment_variables_in_paths(in_tmp, monkeypatch):
    spec = load_spec("tr11")
    with pytest.raises(SpecError) as info:
        RunPaths.of(spec)
    assert str(info.value) == (f"{PRESETS / 'tr11-176B-ml.yaml'}: paths.output: $six_ALL_CCFRSCRATCH is not set in "
                               "this environment; export it (as on the cluster's login node) or write the path out")
    monkeypatch.setenv("six_ALL_CCFRSCRATCH", "/gpfsssd/scratch/rech/six/commun")
    assert RunPaths.of(spec).root == Path("/gpfsssd/scratch/rech/six/commun/checkpoints/tr11-176B-ml")
    expanded = spec.expand("${six_ALL_CCFRSCRATCH}/x $(not a var)", "f")
    assert expanded == "/gpfsssd/scratch/rech/six/commun/x $(not a var)"


def test_a_placeholder_copy_keeps_unset_variables_literal_and_lists_them(in_tmp, monkeypatch):
    spec = load_spec("tr11").with_placeholders()
    run = RunPaths.of(spec)  # the user's variable stays first, never made absolute with our directory
    assert run.root == Path("$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml") and spec.unsettled("paths.output")
    assert spec.expand("${six_ALL_CCFRWORK}/a", "slurm.env.A") == "${six_ALL_CCFRWORK}/a"
    spec.expand("$six_ALL_CCFRWORK/b", "slurm.env.B")
    spec.expand("$six_ALL_CCFRWORK/b", "slurm.env.B")  # a field used twice is named once
    assert spec.problems == [
        "$six_ALL_CCFRSCRATCH is not set here (used by paths.output): export it as on the cluster's login node, or "
        "write it into your copy: opskit specs new mine --from tr11-176B-ml --set six_ALL_CCFRSCRATCH=/path",
        "$six_ALL_CCFRWORK is not set here (used by slurm.env.A, slurm.env.B): export it as on the cluster's login "
        "node, or write it into your copy: opskit specs new mine --from tr11-176B-ml --set six_ALL_CCFRWORK=/path"]
    assert not spec.unsettled("data.vocab_file")
    # The spec it was copied from still refuses, and a set variable is expanded in the copy too.
    with pytest.raises(SpecError, match=r"\$six_ALL_CCFRSCRATCH is not set in this environment"):
        RunPaths.of(load_spec("tr11"))
    monkeypatch.setenv("six_ALL_CCFRSCRATCH", str(in_tmp))
    spec = load_spec("tr11").with_placeholders()
    assert RunPaths.of(spec).root == in_tmp / "checkpoints" / "tr11-176B-ml" and spec.problems == []


# --------------------------------------------------------------------------- rendering the real jobs


def test_tiny_still_renders_and_the_trainer_accepts_it(in_tmp):
    spec = load_spec("tiny")
    run = RunPaths.of(spec)
    assert run.root == in_tmp / "runs" / "tiny"
    assert parse_args(trainer_args(spec, run)).data_path == [str(in_tmp / "data" / "kjv" / "kjv_text_document")]
    assert trainer_problems(spec) == []
    job = render_job(spec, run)
    assert "#SBATCH --job-name=tiny" in job.script and "--exit-duration-in-mins 2.0 " in job.script
    assert f"--data-path {in_tmp}/data/kjv/kjv_text_document" in job.script
    assert f"--finished-flag-path {run.finished_flag} \\\n" in job.script
    assert "--hint" not in job.script and "--checkpoint-activations" not in job.script  # only where the spec says
    script = in_tmp / "train.slurm"
    script.write_text(job.script)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert json.loads(job.ds_config)["zero_optimization"] == {"stage": 1}
    [missing] = data_problems(spec)  # one line for the three files `opskit data prepare` writes
    assert re.fullmatch(r".*tokenizer\.json is missing: run `opskit data prepare tiny` first", missing)


def test_the_hang_floor_sets_when_every_rank_prints_its_stacks(in_tmp):
    """Half of watchdog.hang_min_minutes is the trainer's --stack-dump-after-mins (0: no flag, no dumps); a floor the
    trainer's flag could not take is refused in the spec, in one line."""
    def flags(minutes: float) -> list[str]:
        args = trainer_args(load_spec("tiny", {"watchdog": {"hang_min_minutes": minutes}}), RunPaths(in_tmp / "run"))
        return args[args.index("--stack-dump-after-mins"):][:2] if "--stack-dump-after-mins" in args else []

    assert flags(30) == ["--stack-dump-after-mins", "15.0"] and flags(0.25) == ["--stack-dump-after-mins", "0.125"]
    assert flags(0) == []
    assert parse_args(trainer_args(load_spec("tiny", {"watchdog": {"hang_min_minutes": 10**6}}),
                                   RunPaths(in_tmp / "run"))).stack_dump_after_mins == 5 * 10**5
    raw = yaml.safe_load((REPO / "opskit" / "spec" / "presets" / "tiny.yaml").read_text())
    for bad in (10**7, float("nan"), -1):
        raw["watchdog"] = {"hang_min_minutes": bad}
        assert "watchdog.hang_min_minutes: Input should be" in refused(write(in_tmp / "bad.yaml", raw))


@pytest.mark.parametrize(("spec_env", "caller", "expected"), [
    ({}, None, "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, None, "max_split_size_mb:512"),
    ({}, "garbage_collection_threshold:0.8", "garbage_collection_threshold:0.8"),
])
def test_the_job_lets_pytorch_reuse_fragmented_memory_unless_told_otherwise(in_tmp, spec_env, caller, expected):
    """The job script's environment part, run by bash: expandable segments by default (MBS 16 of the 1.3B model
    ran out of memory without them); the spec's slurm.env or the caller's environment (sbatch exports it) wins."""
    spec = load_spec("tiny", {"slurm": {"env": spec_env}})
    script = render_job(spec, RunPaths(in_tmp / "run")).script
    preamble = script[:script.index("\nexec ") + 1]  # the exports: all before the hand-over to opskit's job
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update({"PYTORCH_CUDA_ALLOC_CONF": caller} if caller else {})
    done = subprocess.run(["bash", "-c", preamble + 'echo "$PYTORCH_CUDA_ALLOC_CONF"'], capture_output=True,
                          text=True, env=env, cwd=in_tmp)
    assert (done.returncode, done.stdout.strip().splitlines()[-1]) == (0, expected), done.stderr


def test_tr11_renders_the_real_cluster_job(jean_zay):
    spec = load_spec("tr11-176B-ml")
    run = RunPaths.of(spec)
    assert run.root == jean_zay / "six_ALL_CCFRSCRATCH" / "checkpoints" / "tr11-176B-ml"
    job = render_job(spec, run)
    header = [line for line in job.script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=tr11-176B-ml", f"#SBATCH --comment=opskit-run:{run.root}",
                      "#SBATCH --partition=gpu_p5", "#SBATCH --account=six@a100",
                      "#SBATCH --qos=qos_gpu-gc", "#SBATCH --reservation=hug", "#SBATCH --constraint=a100",
                      "#SBATCH --nodes=48", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=64",
                      "#SBATCH --hint=nomultithread", "#SBATCH --gres=gpu:8", "#SBATCH --time=100:00:00",
                      "#SBATCH --signal=B:USR1@120", f"#SBATCH --output={run.slurm_dir}/%x-%j.out"]
    work = jean_zay / "six_ALL_CCFRWORK"
    assert f"export TRANSFORMERS_CACHE={work}/models\n" in job.script
    assert "--gpus-per-node 8" in job.script  # each node's torchrun: --nproc_per_node 8 (allocation.node_step)
    args = trainer_args(spec, run)
    text = " ".join(args)
    for expected in ["--num-layers 70 --hidden-size 14336", "--num-attention-heads 112", "--seq-length 2048",
                     "--position-embedding-type alibi", "--init-method-std 0.0048", "--pad-vocab-size-to 250880",
                     "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 12",
                     "--pp-partition-method type:transformer|embedding", "--zero-stage 0", "--micro-batch-size 2",
                     "--global-batch-size 2048 --rampup-batch-size 192 16 9765625 --train-samples 220000000",
                     "--lr 6e-05 --min-lr 6e-06 --lr-decay-style cosine --lr-warmup-samples 183105 "
                     "--lr-decay-samples 200000000", "--adam-beta2 0.95", "--clip-grad 1.0", "--seed 42",
                     "--eval-interval 1000 --eval-iters 1", "--save-interval 100", "--log-interval 1",
                     "--exit-duration-in-mins 5990.0", "--tensorboard-queue-size 5",
                     f"--train-weighted-split-paths-path {work}/code/tr11-176B-ml/Megatron-DeepSpeed/data/"
                     "train-splits.txt",
                     "--data-impl mmap --tokenizer-type PretrainedFromHF --tokenizer-name-or-path bigscience-catalogue",
                     "--optimizer adam", "--num-workers 2 --valid-num-workers 0", "--distributed-backend nccl",
                     "--embed-layernorm", "--checkpoint-activations", "--bf16", "--sync-tp-duplicated-parameters",
                     "--abort-on-unmet-fused-kernel-constraints", "--deepspeed-activation-checkpointing"]:
        assert expected in text, expected
    assert "--pp-partition-method 'type:transformer|embedding'" in job.script  # quoted for the shell
    assert json.loads(job.ds_config) == {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 192, "gradient_clipping": 1.0,  # the ramp's start
        "zero_optimization": {"stage": 0}, "bf16": {"enabled": True, "immediate_grad_update": True},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}, "steps_per_print": 2000,
        "wall_clock_breakdown": False}  # BigScience's heredoc plus the two speed settings of opskit.rules.deepspeed
    script = jean_zay / "train.slurm"
    script.write_text(job.script)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0

    # `opskit submit` refuses it here: the catalogue split files are missing, and DeepSpeed 0.19.8 cannot resume
    # bf16 with ZeRO-0 (the trainer accepts every flag).
    train, valid = data_problems(spec)  # every missing file, not only the first
    assert re.fullmatch(r".*train-splits\.txt is missing \(data\.train_weighted_split_paths_path of .*BigScience wrote "
                        r"it with data/catalogue/load_ratios_meg_ds_format\.py\)", train)
    assert re.fullmatch(r".*valid-splits\.txt is missing \(data\.valid_weighted_split_paths_path of .*", valid)
    assert_trainer_verdict(spec, run)


def assert_trainer_verdict(spec: Spec, run: RunPaths) -> None:
    """The trainer's parser takes the job's flags (a valid spec holds only flags it accepts), and `opskit submit`
    refuses exactly what this DeepSpeed cannot resume."""
    parse_args(trainer_args(spec, run))
    version = spec.parallel.deepspeed_version or installed_deepspeed_version()
    if version and (problem := deepspeed_resume_problem(spec, version)):
        assert trainer_problems(spec) == [f"{spec.file}: {problem} (or pin parallel.deepspeed_version to the "
                                          "cluster's)"]
        assert problem in make_plan(spec).warnings
    else:
        assert trainer_problems(spec) == []


def test_tr1_renders_gpt2_data_flags(jean_zay):
    spec = load_spec("tr1-13B")
    text = " ".join(trainer_args(spec, RunPaths.of(spec)))
    work = jean_zay / "six_ALL_CCFRWORK"
    assert (f"--data-path {work}/datasets-custom/oscar-en/meg-gpt2_text_document --data-impl mmap "
            f"--tokenizer-type GPT2BPETokenizer --vocab-file {work}/code/tr1-13B/Megatron-DeepSpeed-tr1-13B/data/"
            "gpt2-vocab.json") in text and "--split 949,50,1" in text
    assert "--rampup-batch-size 16 16 5000000" in text and "--fp16" in text and "--loss-scale 12" in text
    assert f"--codecarbon-dir {jean_zay}/six_ALL_CCFRSCRATCH/checkpoints/tr1-13B/codecarbon" in text
    ds = deepspeed_config(spec)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                          "min_loss_scale": 1, "initial_scale_power": 12}
    assert re.fullmatch(r".*meg-gpt2_text_document\.bin is missing \(data\.data_path of .*tr1-13B\.yaml\): prepare it "
                        r"before submitting \(Megatron's tools/preprocess_data\.py.*", data_problems(spec)[0])
    assert [p.split(" is missing")[0].rsplit("/", 1)[1] for p in data_problems(spec)] == [
        "meg-gpt2_text_document.bin", "meg-gpt2_text_document.idx", "gpt2-vocab.json", "gpt2-merges.txt"]
    emb = load_spec("tr8b-104B:emb-norm")
    assert "--skip-train-iteration-range 13251-14000 16651-19500" in " ".join(trainer_args(emb, RunPaths.of(emb)))
    for name in ("tr1-13B", "tr8-104B", "tr8b-104B:cl", "tr8b-104B:bnb", "tr11-176B-ml:24n"):
        spec = load_spec(name)
        assert_trainer_verdict(spec, RunPaths.of(spec))


# --------------------------------------------------------------------------- the command line


@pytest.fixture
def cli(in_tmp):
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_specs_commands(cli, in_tmp):
    done = cli("specs", "list")
    assert done.exit_code == 0, done.output
    for name in ALL_SPECS:
        assert name in done.stdout

    done = cli("specs", "show", "tr8b:cl")
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("# tr8b-104B:cl from ")
    shown = yaml.safe_load(done.stdout)
    assert "rampup_batch_size" not in shown["batch"] and shown["curriculum_learning"]["total_curriculum_step"] == 36000
    assert "variants" not in shown
    assert "; variants: cl, emb-norm, bnb (NAME:VARIANT)" in cli("specs", "show", "tr8b-104B").stdout.splitlines()[0]
    full = yaml.safe_load(cli("specs", "show", "tiny", "--defaults").stdout)
    assert full["model"]["make_vocab_size_divisible_by"] == 128 and full["slurm"]["master_port"] == 6000

    done = cli("specs", "new", "my11", "--from", "tr11:24n")
    assert done.exit_code == 0, done.output
    assert "renamed for my11: paths.output, paths.hub_repos, slurm.job_name" in done.stdout
    spec = load_spec("my11")
    assert spec.parallel.nodes == 24 and spec.slurm.job_name == "my11" and spec.file == Path("trainings/my11.yaml")
    assert spec.paths.output == "$six_ALL_CCFRSCRATCH/checkpoints/my11"
    assert spec.paths.hub_repos == {"logs": "bigscience/my11-logs"}
    assert (in_tmp / "trainings" / "my11.yaml").read_text().startswith("# Created by `opskit specs new my11 --from "
                                                                      "tr11:24n`")
    before = (in_tmp / "trainings" / "my11.yaml").read_text()
    done = cli("specs", "new", "my11", "--from", "tiny")
    assert done.exit_code == 1
    assert done.stderr == "error: trainings/my11.yaml: exists (written by opskit earlier); --force replaces it\n"
    assert (in_tmp / "trainings" / "my11.yaml").read_text() == before

    done = cli("specs", "new", "mine", "--from", "tr8b-104B")  # a whole file keeps its variants
    assert done.exit_code == 0, done.output
    assert "still mentions tr8b-104B: data.merge_file, data.vocab_file" in done.stderr
    assert load_spec("mine:cl").paths.output == "$six_ALL_CCFRSCRATCH/checkpoints/mine/cl"
    assert cli("specs", "list").stdout.index("mine:cl") < cli("specs", "list").stdout.index("tiny")
    assert cli("specs", "new", "a:b", "--from", "tiny").exit_code == 1


def test_specs_new_writes_the_environment_variables_out(in_tmp, monkeypatch):
    runner = CliRunner()
    monkeypatch.setattr("opskit.slurm.client.squeue", lambda *a, **k: [])  # the dry run's queue look-up

    def new(*args: str, input: str | None = None):
        return runner.invoke(app, ["specs", "new", *args], input=input)

    done = new("mine", "--from", "tr11", "--set", "six_ALL_CCFRWORK=/gpfswork/six",
               "--set", "six_ALL_CCFRSCRATCH=/gpfsscratch/six")
    assert done.exit_code == 0, done.output
    assert "  written out: $six_ALL_CCFRWORK, $six_ALL_CCFRSCRATCH\n" in done.stdout
    assert "not set here" not in done.stderr
    text = (in_tmp / "trainings" / "mine.yaml").read_text()
    assert "$six" not in text and "TRANSFORMERS_CACHE: /gpfswork/six/models\n" in text
    spec = load_spec("mine")
    assert spec.paths.output == "/gpfsscratch/six/checkpoints/mine"
    assert spec.data.train_weighted_split_paths_path == \
        "/gpfswork/six/code/tr11-176B-ml/Megatron-DeepSpeed/data/train-splits.txt"
    dry = runner.invoke(app, ["submit", "mine", "--dry-run"])
    assert dry.exit_code == 0 and "is not set here" not in dry.stdout, dry.output
    assert "# warning: /gpfswork/six/code/tr11-176B-ml/Megatron-DeepSpeed/data/train-splits.txt is missing" in \
        dry.stdout

    # Not a terminal, no --set: nothing asked, the variables still unset here named with the fix.
    done = new("other", "--from", "tr8b-104B:bnb")
    assert done.exit_code == 0, done.output
    assert ("warning: trainings/other.yaml uses $six_ALL_CCFRWORK, $six_ALL_CCFRSCRATCH, not set here: export them "
            "before `opskit submit other`, or write them out with `opskit specs new other --from tr8b-104B:bnb "
            "--force --set VAR=VALUE`\n") in done.stderr
    assert load_spec("other").paths.output == "$six_ALL_CCFRSCRATCH/checkpoints/other/bnb"

    # A terminal is asked once per variable: the value here is the default; empty keeps $VAR where it is unset.
    monkeypatch.setattr("opskit.cli.specs._interactive", lambda: True)
    monkeypatch.setenv("six_ALL_CCFRSCRATCH", "/scratch/here")
    done = new("asked", "--from", "tr1-13B", input="\n\n")
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("$six_ALL_CCFRWORK (empty: keep $six_ALL_CCFRWORK): \n$six_ALL_CCFRSCRATCH (enter "
                                  "$six_ALL_CCFRSCRATCH to keep it) [/scratch/here]: \n")
    spec = load_spec("asked")
    assert (spec.paths.output, spec.data.data_path) == (
        "/scratch/here/checkpoints/asked", "$six_ALL_CCFRWORK/datasets-custom/oscar-en/meg-gpt2_text_document")
    assert "warning: trainings/asked.yaml uses $six_ALL_CCFRWORK, not set here: export it" in done.stderr

    # A bad --set: one line, exit 1 as every refusal (docs/operations.md), nothing written.
    before = sorted(p.name for p in (in_tmp / "trainings").iterdir())
    for args, message in [
            (["--set", "six_ALL_CCFRWORK=/a", "--set", "six_ALL_CCFRWORK=/b"],
             "--set six_ALL_CCFRWORK given twice (six_ALL_CCFRWORK=/a and six_ALL_CCFRWORK=/b): keep one"),
            (["--set", "=x"], "--set =x: '' is not an environment variable name (letters, digits and _, not starting "
                              "with a digit)"),
            (["--set", "six_ALL_CCFRWORK"], "--set six_ALL_CCFRWORK: expected VAR=VALUE, e.g. --set "
                                            "six_ALL_CCFRWORK=/path"),
            (["--set", "six_ALL_CCFRWORK="], "--set six_ALL_CCFRWORK=: expected a value after '=' (the path "
                                             "$six_ALL_CCFRWORK stands for)"),
            (["--set", "HOME=/a"], "--set HOME: tr11 does not use $HOME (it uses $six_ALL_CCFRWORK, "
                                   "$six_ALL_CCFRSCRATCH)")]:
        done = new("bad", "--from", "tr11", *args)
        assert (done.exit_code, done.stdout, done.stderr) == (1, "", f"error: {message}\n"), args
    assert sorted(p.name for p in (in_tmp / "trainings").iterdir()) == before


def test_plan_command(cli):
    done = cli("plan", "tr1-13B", "--gpus", "256", "--tflops", "45", "--json")
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)
    assert plan["name"] == "tr1-13B" and plan["parameters"] == 12_854_282_240 and plan["train_iters"] == 311_541
    assert plan["parameter_details"]["readme_billions"] == 13 and plan["memory"]["replica_gb_readme"] == 234
    assert plan["time"]["gpus"] == 256 and plan["batch"]["rows"][0] == {
        "global_batch_size": 16, "iterations": 4961, "samples": 79376, "nominal_iterations": 4960}
    done = cli("plan", "tr11", "--nodes", "24")
    assert done.exit_code == 0, done.output
    assert "4 replicas of 48 GPUs (6 nodes)" in done.stdout and "115,311" in done.stdout
    warnings = make_plan(load_spec("tr11:24n")).warnings
    assert done.stderr == "".join(f"warning: {w}\n" for w in warnings)
    done = cli("plan", "tr11", "--nodes", "7")
    assert done.exit_code == 1 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    done = cli("plan", "tr8b:cl")
    assert done.exit_code == 0 and "total_curriculum_step" in done.stdout and "36,000" in done.stdout
    done = cli("data", "prepare", "tr11")
    assert done.exit_code == 1
    assert done.stderr == (f"error: {PRESETS / 'tr11-176B-ml.yaml'}: data: this spec reads a dataset prepared "
                           "elsewhere (data.train_weighted_split_paths_path); `opskit data prepare` only builds a "
                           "data.corpus: prepare it with Megatron's tools/preprocess_data.py, or give the spec a "
                           "corpus and dir\n")


@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_plan_refuses_a_non_finite_tflops_in_one_line(cli, value):
    """--tflops inf printed `Infinity` under --json, which is not JSON."""
    done = cli("plan", "tiny", "--tflops", value, "--json")
    assert (done.exit_code, done.stdout) == (1, ""), done.output
    assert done.stderr == "error: --tflops inf: expected a positive finite number of TFLOPs per GPU\n"


def test_specs_new_bad_set_exits_as_documented(cli, in_tmp):
    """docs/operations.md gives every refusal exit 1; `specs new --set` said 2."""
    assert "Every refusal is one `error:` line" in (REPO / "docs" / "operations.md").read_text()
    done = cli("specs", "new", "bad", "--from", "tr11", "--set", "six_ALL_CCFRWORK=")
    assert (done.exit_code, done.stdout) == (1, "")
    assert done.stderr.startswith("error: --set six_ALL_CCFRWORK=: expected a value") and done.stderr.count("\n") == 1


def test_plan_json_keys_are_documented(in_tmp):
    docs = (REPO / "docs" / "plan.md").read_text()

    def keys(value, prefix=""):
        if isinstance(value, dict):
            for key, inner in value.items():
                yield f"{prefix}{key}"
                yield from keys(inner, f"{prefix}{key}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            yield from keys(value[0], f"{prefix}[].")

    found = set()
    for name in ("tr8b-104B:cl", "tr11-176B-ml"):
        found |= set(keys(make_plan(load_spec(name)).as_json()))
    missing = sorted(k for k in found if f"`{k.rsplit('.', 1)[-1]}`" not in docs)
    assert not missing, missing


def test_plan_does_not_import_torch(in_tmp):
    probe = ("import sys\nfrom opskit.cli.app import app\n"
             "for argv in (['plan', 'tr11-176B-ml', '--nodes', '24', '--json'], ['plan', 'tr8b:cl'],\n"
             "             ['specs', 'list'], ['specs', 'show', 'tr1-13B']):\n"
             "    try:\n        app(argv, prog_name='opskit')\n    except SystemExit as e:\n"
             "        assert not e.code, (argv, e.code)\n"
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed', 'megatron', 'numpy'})\n"
             "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=in_tmp, timeout=120)
    assert "HEAVY=\n" in done.stderr, done.stderr[-2000:]


# --------------------------------------------------------------------------- property tests over random specs

@st.composite
def random_specs(draw) -> dict:
    """Spec mappings around Megatron's rules: half drawn to satisfy them (so the planner sees many valid specs), half
    free (so every refusal gets exercised)."""
    valid = draw(st.booleans())
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    heads = tp * draw(st.sampled_from([1, 2, 4])) if valid else draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    seq = draw(st.sampled_from([16, 32, 64, 128, 256]))
    layers = pp * draw(st.integers(1, 6)) if valid else draw(st.integers(1, 24))
    if valid:
        dp = draw(st.integers(1, 4))
        world = tp * pp * dp
        gpn = draw(st.sampled_from([g for g in (1, 2, 4, 8) if world % g == 0]))
        nodes = world // gpn
    else:
        gpn, nodes = draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 8))
        dp = max(nodes * gpn // (tp * pp), 1)
    mbs = draw(st.integers(1, 4))
    unit = mbs * dp if valid else 1
    gbs = unit * draw(st.integers(1, 64))
    rampup = None
    if draw(st.booleans()):
        start, incr = unit * draw(st.integers(1, 8)), unit * draw(st.integers(1, 8))
        gbs = start + incr * draw(st.integers(0, 8)) if valid or draw(st.booleans()) else gbs
        rampup = [start, incr, draw(st.integers(0, 5000))]
    raw = {
        "name": "random",
        "model": {"num_layers": layers, "hidden_size": heads * draw(st.sampled_from([8, 16, 24, 64])),
                  "num_attention_heads": heads, "seq_length": seq, "max_position_embeddings": seq,
                  "position_embedding_type": draw(st.sampled_from(["absolute", "alibi"])),
                  "embed_layernorm": draw(st.booleans()), "precision": draw(st.sampled_from(["fp32", "fp16", "bf16"])),
                  "checkpoint_activations": draw(st.booleans())},
        "parallel": {"nodes": nodes, "gpus_per_node": gpn, "tensor_model_parallel_size": tp,
                     "pipeline_model_parallel_size": pp, "zero_stage": draw(st.sampled_from([0, 1])),
                     "gpu_memory_gb": draw(st.sampled_from([None, 16, 80]))},
        "batch": {"micro_batch_size": mbs, "global_batch_size": gbs, "train_samples": draw(st.integers(1, 50_000))},
        "optimizer": {"lr": 1e-3, "lr_warmup_samples": draw(st.integers(0, 2000))},
        "data": {"corpus": "kjv", "dir": "data", "vocab_size": draw(st.integers(300, 70_000))},
        "checkpoint": {"save_interval": 100},
        "slurm": {"time": draw(st.sampled_from(["30", "20:00:00"])),
                  "exit_margin_mins": draw(st.sampled_from([5, 10]) if valid else st.sampled_from([0, 5, 10, 45]))},
        "paths": {"output": "runs/x"},
    }
    if rampup:
        raw["batch"]["rampup_batch_size"] = rampup
    if draw(st.booleans()):
        raw["parallel"]["pp_partition_method"] = "type:transformer|embedding"
    if draw(st.booleans()):
        raw["model"]["pad_vocab_size_to"] = (128 * tp * draw(st.integers(3, 600)) if valid
                                             else draw(st.integers(300, 80_000)))
    if draw(st.booleans()):
        raw["curriculum_learning"] = {
            "min_difficulty": 8 * draw(st.integers(1, seq // 8 - 1)) if valid else draw(st.integers(1, 64)),
            "total_curriculum_step": draw(st.integers(1, 300)),
            "difficulty_step": 8 if valid else draw(st.sampled_from([4, 8, 16]))}
    return raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=random_specs(), tflops=st.sampled_from([None, 1.0, 150.0]), gpus=st.sampled_from([None, 1, 7, 64]))
def test_planner_never_crashes_and_accepted_specs_divide(raw, tflops, gpus):
    path = Path("random.yaml")
    try:
        spec = validate_spec(raw, path)
    except SpecError as e:
        assert "\n" not in str(e) and str(e).startswith("random.yaml: ")
        event("refused")
        return
    event("accepted")
    assert isinstance(spec, Spec)
    m, p, b = spec.model, spec.parallel, spec.batch
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    assert p.world_size == tp * pp * dp
    assert m.num_attention_heads % tp == 0 and m.ffn_size % tp == 0
    assert m.num_layers % pp == 0 or p.pp_partition_method is not None
    assert padded_vocab_size(spec.data.vocab_size, m, tp) % tp == 0
    assert padded_vocab_size(spec.data.vocab_size, m, tp) >= spec.data.vocab_size
    assert 0 < spec.exit_duration_in_mins < spec.slurm.time_minutes
    if spec.curriculum_learning is not None:
        assert spec.curriculum_learning.min_difficulty % 8 == 0
    # Every batch size Megatron can use splits into micro-batches (its own assert): a ramp-up's are start + k * incr.
    start, incr, _ = b.rampup_batch_size or (b.global_batch_size, 1, 0)
    for gbs in range(start, b.global_batch_size + 1, incr):
        num_microbatches(gbs, b.micro_batch_size, dp)

    plan = make_plan(spec, tflops=tflops, gpus=gpus)
    json.dumps(plan.as_json())
    if plan.batch.train_samples >= plan.batch.rampup_consumed_samples:
        assert sum(r.iterations for r in plan.batch.rows) == plan.batch.train_iters
    else:  # the run ends inside the ramp-up: Megatron's train_iters counts back from the ramp's end
        assert any("ends inside the batch ramp-up" in w for w in plan.warnings)
    assert p.nodes in plan.layout.valid_nodes_rampup
    assert sum(layers for layers, _, _ in pipeline_stages(spec)) == m.num_layers
    assert plan.memory.total_gib_per_gpu > 0 and plan.parameters.total > 0
    assert re.fullmatch(r"gpt|bloom", plan.parameters.architecture)


def test_a_relative_path_set_into_a_spec_starts_from_the_project_for_every_field(in_tmp, monkeypatch):
    """`--set VAR=rel/path` resolved paths.output from the project but the split files (and every
    other data file) from the current directory, so the job read other files than submit checked."""
    from opskit.run.paths import RunPaths
    from opskit.submission.render import data_files, trainer_args

    runner = CliRunner()
    done = runner.invoke(app, ["specs", "new", "rel", "--from", "tr11", "--set", "six_ALL_CCFRWORK=work",
                               "--set", "six_ALL_CCFRSCRATCH=scratch"])
    assert done.exit_code == 0, done.output
    elsewhere = in_tmp / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_spec(str(in_tmp / "trainings" / "rel.yaml"))
    args = trainer_args(spec, RunPaths.of(spec))
    data = in_tmp / "work" / "code" / "tr11-176B-ml" / "Megatron-DeepSpeed" / "data"
    assert args[args.index("--train-weighted-split-paths-path") + 1] == str(data / "train-splits.txt")
    assert args[args.index("--valid-weighted-split-paths-path") + 1] == str(data / "valid-splits.txt")
    assert args[args.index("--save") + 1] == str(in_tmp / "scratch" / "checkpoints" / "rel" / "checkpoints")
    assert ("data.train_weighted_split_paths_path", data / "train-splits.txt") in data_files(spec)


def test_sequence_parallel_splits_the_activations_and_needs_a_divisible_sequence(in_tmp):
    """``parallel.sequence_parallel`` renders ``--sequence-parallel`` and divides what full recompute keeps per layer
    by TP (tr11: TP 4); a sequence the TP ranks cannot split evenly is refused, naming the fields."""
    plain, split = (make_plan(load_spec("tr11-176B-ml", {"parallel": {"sequence_parallel": sp}})).memory.stages[0]
                    for sp in (False, True))
    inputs = split.layers * split.in_flight_microbatches * 2 * 2048 * 2 * 14336  # every layer's 16-bit input...
    recomputed = activation_bytes_per_layer(2048, 2, 14336, 112, tp=4, sequence_parallel=True)  # ...and one layer's
    assert split.activation_gib_recompute * 2**30 == pytest.approx(inputs / 4 + recomputed)
    assert plain.activation_gib_recompute * 2**30 == pytest.approx(inputs + 2048 * 2 * 14336 * (10 + 24 / 4))
    assert split.model_state_gib == plain.model_state_gib
    for sp in (False, True):
        spec = load_spec("tiny", {"parallel": {"sequence_parallel": sp}})
        assert ("--sequence-parallel" in trainer_args(spec, RunPaths.of(spec))) == sp
    with pytest.raises(SpecError, match=r"parallel\.sequence_parallel splits model\.seq_length 2050 over "
                                        r"parallel\.tensor_model_parallel_size 4"):
        load_spec("tr11-176B-ml", {"parallel": {"sequence_parallel": True},
                                   "model": {"seq_length": 2050, "max_position_embeddings": 2050}})


def test_bf16_at_zero0_keeps_no_16bit_gradients_and_the_plan_advises_on_recompute(in_tmp):
    """tr11's layout (bf16, ZeRO-0): the trainer's DeepSpeed config frees each 16-bit gradient once it is added into
    the fp32 buffer (``bf16.immediate_grad_update``), so a GPU holds the READMEs' 18 bytes split as ZeRO-1 splits
    them; and a spec that recomputes where the activations would fit is told what recompute costs."""
    tr11 = plan_of("tr11-176B-ml").memory
    stage = tr11.stages[0]
    per_gpu = stage.parameters_per_gpu
    assert tr11.total_bytes_per_parameter == 18
    # (2 bf16 weights + 4 fp32 gradients) + (4 fp32 weights + 8 Adam) / DP 8, word embeddings' part
    assert stage.model_state_gib * 2**30 == pytest.approx(per_gpu * (2 + 4 + 12 / 8))
    assert tr11.checkpoint_gb == pytest.approx((176.2e9 * 14 + 3.6e9 * 12) / 1e9, rel=0.01)  # no gradients
    # tr11 recomputes in full; without recompute it would not fit, with selective recompute it would (issue 50)
    assert tr11.no_recompute_fits is False and tr11.advised_recompute == "selective"
    assert [w for w in plan_of("tr11-176B-ml").warnings if "recompute" in w] == [
        "full activation recompute, yet with selective recompute the heaviest GPU needs ~61.9 GiB of 80: "
        "model.recompute_granularity: selective recomputes only elementwise ops (full recompute: 4/3 of the compute)"]
    assert deepspeed_config(load_spec("tr11-176B-ml"))["bf16"]["immediate_grad_update"] is True

    bench = make_plan(load_spec(str(REPO / "bench" / "specs" / "gpt2-1.3B.yaml"), {
        "model": {"checkpoint_activations": True}, "parallel": {"gpu_memory_gb": 80},
        "batch": {"micro_batch_size": 4}}))
    assert bench.memory.no_recompute_fits is True
    assert any("turning model.checkpoint_activations off should give up to ~1.3x" in w for w in bench.warnings)
    tight = make_plan(load_spec(str(REPO / "bench" / "specs" / "gpt2-1.3B.yaml"), {
        "model": {"checkpoint_activations": True}, "parallel": {"gpu_memory_gb": 30},
        "batch": {"micro_batch_size": 4}}))
    assert tight.memory.no_recompute_fits is False and tight.memory.advised_recompute == "full"
    assert not any("recompute" in w for w in tight.warnings)
