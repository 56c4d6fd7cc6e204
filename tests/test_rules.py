"""opskit.rules against independent figures (hand-computed walks, the BigScience READMEs and logs, Megatron-DeepSpeed's
own rules), and the promise that the spec and the trainer apply the same rules: the DeepSpeed JSON a rendered job
carries is the config the trainer builds from it and the rendered flags. Pure Python and fast: no trainer run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from opskit.rules import consistency
from opskit.rules.deepspeed import (
    Contradiction,
    bf16_zero0_optimizer_load_broken,
    bf16_zero0_optimizer_saved_twice,
    deepspeed_config,
    deepspeed_version_problem,
    with_flags,
)
from opskit.rules.model_size import VocabPaddingError, megatron_flops_per_iteration, padded_vocab_size
from opskit.rules.schedule import BatchRampup, SeqlenSchedule, annealing_lr, iterations_to_tokens
from opskit.run.paths import RunPaths
from opskit.spec.files import SpecError
from opskit.spec.load import load_spec
from opskit.spec.new import list_specs
from opskit.spec.schema import _field_name
from opskit.submission.render import render_job, trainer_args
from opskit.train.args import parse_args

BIGSCIENCE_ENV = ("six_ALL_CCFRWORK", "six_ALL_CCFRSCRATCH")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in BIGSCIENCE_ENV:
        monkeypatch.setenv(name, str(tmp_path / name))
    return tmp_path


def trainer_error(argv: list[str]) -> str:
    """The one-line ``error:`` the trainer's parser exits with."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit):
        parse_args(argv)
    return stderr.getvalue().split("error: ", 1)[1].strip()


LENGTHLESS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--data-path", "/d/x",
              "--tokenizer-name-or-path", "/d/tok"]
TINY = [*LENGTHLESS, "--train-samples", "80"]


# --------------------------------------------------------------------------- ramp-up


def test_rampup_walk_by_hand():
    # start 2, increment 2, 12 samples, GBS 8: 3 increments of 4 samples. GBS 2 at consumed 0 and 2, 4 at 4, 6 at 8;
    # consumed 14 > 12 ends the ramp after 4 iterations.
    ramp = BatchRampup(8, (2, 2, 12))
    assert list(ramp.rampup_steps()) == [(2, 0), (2, 2), (4, 4), (6, 8)]
    assert ramp.rampup_end() == (4, 14)
    assert ramp.train_iters(100) == 4 + (100 - 14) // 8 == 14
    assert [ramp.consumed_samples(n) for n in (0, 3, 4, 6)] == [0, 8, 14, 30]
    assert [ramp.iterations_to_samples(s) for s in (0, 4, 5, 14, 20)] == [0, 2, 3, 4, 5]
    assert ramp.rows(100) == [(2, 2, 4), (4, 1, 4), (6, 1, 6), (8, 10, 80)]
    assert BatchRampup(64).train_iters(640) == 10 and BatchRampup(64).consumed_samples(3) == 192
    with pytest.raises(ValueError, match="not a multiple of the increment 4"):
        BatchRampup(8, (2, 4, 12))


def test_tr1_13B_rampup_figures():
    # tr1-13B README: "--rampup-batch-size 16 16 5_000_000", "over 63 (`(1024-16)/16`) intervals", "79365
    # (`5_000_000/63`) is the number of samples before the next GBS increment", "4960 steps (`79365/16`)".
    ramp = BatchRampup(1024, (16, 16, 5_000_000))
    assert int(ramp.samples_per_increment) == 79_365
    rows = ramp.rows(300_000_000)
    assert [gbs for gbs, *_ in rows[:-1]] == list(range(16, 1024, 16))  # 63 increments, then the full GBS
    # Megatron holds GBS 16 while consumed <= 79365.08: 4961 iterations of 16 (79376 samples), one more than 4960.
    assert rows[0] == (16, 4961, 79_376)
    # The log: "iteration 168000/  311541 | consumed samples: 153013584".
    assert ramp.train_iters(300_000_000) == 311_541
    assert ramp.consumed_samples(168_000) == 153_013_584


def test_tr8b_and_tr11_log_figures():
    tr8b = BatchRampup(2048, (16, 16, 6_000_000))  # tr8b-104B: "iteration 6502/ 159576 | consumed samples: 216960"
    assert tr8b.train_iters(300_000_000) == 159_576 and tr8b.consumed_samples(6502) == 216_960
    tr11 = BatchRampup(2048, (192, 16, 9_765_625))  # tr11-176B-ml: "iteration 12695/  115311 | ... 9841584"
    assert tr11.train_iters(220_000_000) == 115_311 and tr11.consumed_samples(12695) == 9_841_584


def test_learning_rate_by_hand():
    common = dict(max_lr=1.0, min_lr=0.1, warmup_steps=100, decay_steps=1100)
    assert annealing_lr(**common, decay_style="cosine", num_steps=50) == 0.5  # half-way up the warmup
    assert annealing_lr(**common, decay_style="cosine", num_steps=600) == pytest.approx(0.55)  # cos(pi/2)
    assert annealing_lr(**common, decay_style="linear", num_steps=350) == pytest.approx(0.775)  # a quarter down
    assert annealing_lr(**common, decay_style="linear", num_steps=5000) == 0.1
    assert annealing_lr(**common, decay_style="constant", num_steps=5000) == 1.0
    # --lr-decay-tokens: half of the tokens after the warmup's 1000 -> half-way down.
    assert annealing_lr(**common, decay_style="linear", num_steps=900, decay_tokens=3000, num_tokens=2000,
                        warmup_tokens=1000) == pytest.approx(0.55)
    # tr11-176B-ml's log: "learning rate: 5.969E-05" at consumed samples 9841584.
    assert f"{annealing_lr(max_lr=6e-5, min_lr=6e-6, warmup_steps=183_105, decay_steps=200_000_000, decay_style='cosine', num_steps=9_841_584):.3E}" == "5.969E-05"  # noqa: E501


def test_seqlen_curriculum_is_deepspeeds_scheduler():
    # tr8b-104B-cl's block; DeepSpeed's own CurriculumScheduler (what the trainer runs) gives the same lengths.
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    for root in (None, 2):
        schedule = SeqlenSchedule(64, 2048, 36_000, 8, root)
        config = {"min_difficulty": 64, "max_difficulty": 2048,
                  "schedule_type": "fixed_root" if root else "fixed_linear",
                  "schedule_config": {"total_curriculum_step": 36_000, "difficulty_step": 8,
                                      **({"root_degree": root} if root else {})}}
        deepspeed = CurriculumScheduler(config)
        for step in (1, 145, 146, 9000, 18_000, 35_999, 36_000, 50_000):
            assert schedule.seqlen(step) == deepspeed.update_difficulty(step), (root, step)
    assert [SeqlenSchedule(64, 2048, 36_000, 8).seqlen(s) for s in (1, 145, 146, 36_000)] == [64, 64, 72, 2048]
    # Every iteration of a curriculum of 4 steps from 8 to 32 (step 8), then 32: 8 + 8*6 + 16*6 + 24*6 + 32*6 tokens
    # after 5 iterations of GBS 6.
    short = SeqlenSchedule(8, 32, 4, 8)
    assert [short.seqlen(i) for i in range(1, 6)] == [8, 16, 24, 32, 32]
    assert iterations_to_tokens(BatchRampup(6), 32, 6 * (8 + 16 + 24 + 32), short) == 4
    assert iterations_to_tokens(BatchRampup(6), 32, 6 * (8 + 16 + 24 + 32) + 1, short) == 5


# --------------------------------------------------------------------------- model


def test_padded_vocab_bigscience():
    assert padded_vocab_size(250_680, 128, 4) == 250_880  # tr11-176B-ml: BLOOM's tokenizer at TP=4
    assert padded_vocab_size(250_680, 128, 4, pad_vocab_size_to=250_880) == 250_880  # its --pad-vocab-size-to
    assert padded_vocab_size(50_257, 128, 2) == 50_432  # tr1-13B: GPT-2's at TP=2
    with pytest.raises(VocabPaddingError, match=r"250000 is smaller than the tokenizer's vocabulary \(250680\)"):
        padded_vocab_size(250_680, 128, 4, pad_vocab_size_to=250_000)
    # tr11: "A single train iteration is about 105 secs" at 150 TFLOPs on 384 GPUs.
    flops = megatron_flops_per_iteration(2048, 2048, 70, 14336, 250_880, recompute=True)
    assert 100 < flops / (384 * 150e12) < 110


def test_pad_vocab_size_to_is_megatron_deepspeeds_rule(in_tmp):
    """Megatron-DeepSpeed (_vocab_size_with_padding) wants a multiple of make_vocab_size_divisible_by, and its
    vocab-parallel embedding a multiple of TP; the spec asked for make_vocab_size_divisible_by * TP, the trainer for TP
    only."""
    assert consistency.pad_vocab_problems(384, 128, 4, None, consistency.flag_name) == []  # the spec refused it
    assert consistency.pad_vocab_problems(96, 32, 3, None, consistency.flag_name) == []
    assert consistency.pad_vocab_problems(250_880, 128, 4, 250_680, consistency.flag_name) == []
    message = trainer_error([*TINY, "--pad-vocab-size-to", "2100"])  # the trainer accepted it
    assert message.startswith("--pad-vocab-size-to 2100 is not divisible by --make-vocab-size-divisible-by 128 and "
                              "--tensor-model-parallel-size 1 (Megatron-DeepSpeed's vocabulary padding rule): use 2176")
    assert parse_args([*TINY, "--pad-vocab-size-to", "2100", "--make-vocab-size-divisible-by", "4"]).pad_vocab_size_to
    raw = _raw_tiny(in_tmp)
    raw["model"]["pad_vocab_size_to"] = 384 * (-(-raw["data"]["vocab_size"] // 384))
    raw["parallel"].update(gpus_per_node=4, tensor_model_parallel_size=4)
    raw["batch"]["global_batch_size"] = raw["batch"]["micro_batch_size"]
    assert _spec(in_tmp, raw, "tp4").model.pad_vocab_size_to % 384 == 0


def _raw_tiny(tmp: Path) -> dict:
    raw = yaml.safe_load(load_spec("tiny").file.read_text())
    raw["paths"]["output"] = str(tmp / "run")
    return raw


def _spec(tmp: Path, raw: dict, name: str):
    """The spec of ``raw`` written as ``tmp/name.yaml``."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(str(path))


# --------------------------------------------------------------------------- the same rule, two namers


def test_one_rule_names_the_spec_field_or_the_flag():
    assert consistency.tensor_parallel_problems(4, 256, 3, _field_name) == [
        "model.num_attention_heads 4 is not divisible by parallel.tensor_model_parallel_size 3 (Megatron splits heads "
        "over TP): use TP in 1, 2, 4"]
    assert trainer_error([*TINY, "--tensor-model-parallel-size", "3"]).startswith(
        "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3 (Megatron splits heads over TP): "
        "use TP in 1, 2, 4")
    assert trainer_error([*TINY, "--pipeline-model-parallel-size", "5"]).startswith(
        "--pipeline-model-parallel-size 5 exceeds the 2 layers (+2 embeddings)")
    assert trainer_error([*TINY, "--rampup-batch-size", "2", "4", "16"]).startswith(
        "--rampup-batch-size: global_batch_size - start = 6 must be a positive multiple of the increment 4")


@pytest.mark.parametrize(("overrides", "spec_says", "flags", "trainer_says"), [
    ({"megatron_args": {"override_lr_scheduler": True, "use_checkpoint_lr_scheduler": True}},
     "megatron_args.override_lr_scheduler and megatron_args.use_checkpoint_lr_scheduler are mutually exclusive",
     ["--override-lr-scheduler", "--use-checkpoint-lr-scheduler"],
     "--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive"),
    ({"megatron_args": {"skip_train_iteration_range": ["9-3"]}},
     "megatron_args.skip_train_iteration_range: '9-3': the end of a skip range cannot be smaller than its start",
     ["--skip-train-iteration-range", "9-3"],
     "--skip-train-iteration-range: '9-3': the end of a skip range cannot be smaller than its start"),
    ({"megatron_args": {"skip_train_iteration_range": 1}},  # a scalar, as the fuzz test wrote it: a traceback before
     "megatron_args.skip_train_iteration_range: '1' is not START-END",
     ["--skip-train-iteration-range", "1"], "--skip-train-iteration-range: '1' is not START-END"),
    ({"batch": {"rampup_batch_size": [0, 4, 96]}},  # the trainer's ramp-up walk never ended
     "batch.rampup_batch_size 0 4 96: the start batch size and the ramp-up samples must be > 0",
     ["--rampup-batch-size", "0", "4", "96"],
     "--rampup-batch-size 0 4 96: the start batch size and the ramp-up samples must be > 0"),
    ({"parallel": {"pp_partition_method": "layers"}},
     "parallel.pp_partition_method 'layers': use parameters, uniform or type:REGEX",
     ["--pp-partition-method", "layers"], "--pp-partition-method 'layers': use parameters, uniform or type:REGEX"),
])
def test_the_trainers_flag_rules_are_the_specs(overrides, spec_says, flags, trainer_says):
    # Once these passed spec validation and `opskit plan`, and the job's trainer exited at start.
    with pytest.raises(SpecError) as refused:
        load_spec("tiny", overrides=overrides)
    assert spec_says in str(refused.value)
    assert trainer_error([*TINY, *flags]).startswith(trainer_says)


def test_deepspeed_version_rule_for_spec_and_trainer():
    spec = deepspeed_version_problem("fp16", 0, 32, 1.0, "0.19.8", _field_name)
    assert not spec.resume_only and spec.message.startswith(
        "model.precision fp16 with parallel.zero_stage 0 and parallel.pipeline_model_parallel_size 32 clips gradients "
        "with pipeline stage 0's norm only on DeepSpeed 0.19.8")
    assert deepspeed_version_problem("fp16", 0, 32, 0.0, "0.19.8", _field_name) is None
    assert deepspeed_version_problem("fp16", 0, 32, 1.0, "0.18.5", _field_name) is None
    assert deepspeed_version_problem("bf16", 0, 1, 1.0, "0.18.3", consistency.flag_name).message.startswith(
        "--bf16 with --zero-stage 0 on DeepSpeed 0.18.3 saves the optimizer states but never loads them back")
    # 0.18.5-0.19.8 fail loading bf16 ZeRO-0 optimizer states (KeyError: 0); the trainer loads them itself there
    assert deepspeed_version_problem("bf16", 0, 2, 1.0, "0.19.8", consistency.flag_name) is None
    assert [bf16_zero0_optimizer_load_broken(v) for v in ("0.18.4", "0.18.5", "0.19.8", "0.20.0")] == \
        [False, True, True, False]
    # the same change saved those states twice (in mp_rank files too); the trainer saves them once there
    assert [bf16_zero0_optimizer_saved_twice(v) for v in ("0.18.4", "0.18.5", "0.19.8", "0.20.0")] == \
        [False, True, True, False]
    assert deepspeed_version_problem("bf16", 1, 1, 1.0, "0.19.8", consistency.flag_name) is None
    # The trainer meets the clipping rule with the DeepSpeed installed here (0.19.8 in CI).
    message = trainer_error([*TINY, "--pipeline-model-parallel-size", "2", "--zero-stage", "0"])
    assert message.startswith("fp32 (neither --fp16 nor --bf16) with --zero-stage 0 and --pipeline-model-parallel-size "
                              "2 clips gradients with pipeline stage 0's norm only on DeepSpeed 0.19")
    assert message.endswith("use --zero-stage 1, or --clip-grad 0 (python -m opskit.train --help lists the flags)")
    parse_args([*TINY, "--pipeline-model-parallel-size", "2", "--zero-stage", "0", "--clip-grad", "0"])


# --------------------------------------------------------------------------- --train-iters


def test_train_iters_is_megatrons_alternative_to_train_samples(in_tmp):
    """The spec accepted batch.train_iters (and `opskit plan` planned it) but the trainer refused --train-iters."""
    raw = _raw_tiny(in_tmp)
    raw["batch"]["train_iters"] = 7
    del raw["batch"]["train_samples"]
    spec = _spec(in_tmp, raw, "iters")
    args = parse_args(trainer_args(spec, RunPaths(in_tmp / "run")))
    gbs = spec.batch.global_batch_size
    assert (args.train_iters, args.train_samples, args.lr_decay_samples) == (7, 7 * gbs, 7 * gbs)
    assert BatchRampup(gbs).train_iters(args.train_samples) == 7
    assert trainer_error([*TINY, "--train-iters", "5"]).startswith(
        "set exactly one of --train-samples and --train-iters")
    assert trainer_error(LENGTHLESS).startswith("set exactly one of --train-samples and --train-iters")
    assert trainer_error([*LENGTHLESS, "--train-iters", "5", "--rampup-batch-size", "4", "4", "16"]).startswith(
        "--rampup-batch-size needs --train-samples: Megatron refuses --rampup-batch-size with --train-iters")
    raw["batch"]["rampup_batch_size"] = [4, 4, 16]
    with pytest.raises(SpecError, match="batch: rampup_batch_size needs train_samples: Megatron refuses"):
        _spec(in_tmp, raw, "ramp")


# --------------------------------------------------------------------------- the DeepSpeed JSON


def _names() -> list[str]:
    return [entry.name for entry in list_specs() if entry.origin == "preset"]


@pytest.mark.parametrize("name", _names())
def test_the_jobs_deepspeed_json_is_the_trainers_config(name, in_tmp):
    """What the job script carries, read back by the trainer with the rendered flags, is the same config."""
    from opskit.train.build import build_deepspeed_config

    spec = load_spec(name)
    run = RunPaths(in_tmp / "run")
    job = render_job(spec, run)
    carried = json.loads(job.ds_config)
    run.ds_config.parent.mkdir(parents=True, exist_ok=True)
    run.ds_config.write_text(job.ds_config)
    args = parse_args(trainer_args(spec, run))
    start = BatchRampup(args.global_batch_size, args.rampup_batch_size and tuple(args.rampup_batch_size)).batch_size(0)
    assert build_deepspeed_config(args, start) == carried
    assert carried["train_batch_size"] == (spec.batch.rampup_batch_size or [spec.batch.global_batch_size])[0]
    assert ("curriculum_learning" in carried) == (spec.curriculum_learning is not None)


def test_a_json_may_repeat_flags_never_contradict_them():
    implied = deepspeed_config(micro_batch_size=2, train_batch_size=16, clip_grad=1.0, zero_stage=1, precision="fp16")
    assert implied["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                               "min_loss_scale": 1, "initial_scale_power": 12}  # tr1-13B's block
    assert "bf16" not in implied and implied["steps_per_print"] == 2000
    assert with_flags({}, implied) == implied
    mine = {"fp16": {"enabled": True, "initial_scale_power": 16}, "zero_optimization": {"reduce_bucket_size": 5e8},
            "train_batch_size": 1024, "steps_per_print": 10}
    merged = with_flags(mine, implied)
    assert merged["fp16"] == {"enabled": True, "initial_scale_power": 16}  # the JSON's own block is kept
    assert merged["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e8}
    assert (merged["train_batch_size"], merged["steps_per_print"]) == (16, 10)
    for contradicting, key in (({"gradient_clipping": 0.5}, "gradient_clipping"),
                               ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage"),
                               ({"bf16": {"enabled": True}}, "bf16.enabled")):
        with pytest.raises(Contradiction, match=f"^{key} is "):
            with_flags(contradicting, implied)


def test_the_world_size_rule_is_one_for_the_spec_and_the_trainer():
    from opskit.rules.consistency import flag_name, world_size_problems

    assert world_size_problems(48, 4, 12, flag_name) == []
    assert world_size_problems(56, 4, 12, flag_name) == [
        "56 processes are not divisible by TP*PP = 48 (--tensor-model-parallel-size 4, --pipeline-model-parallel-size "
        "12)"]


def test_the_trainers_curriculum_block_meets_the_specs_rule():
    from opskit.train.schedules import SeqlenCurriculum

    block = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 64, "max_difficulty": 2048,
             "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 36_000,
                                                                  "difficulty_step": 8}}
    assert SeqlenCurriculum(block, 2048).seqlen(146) == 72
    for change, message in [
            ({"min_difficulty": 60}, "curriculum_learning.min_difficulty 60 is not a multiple of 8"),
            ({"max_difficulty": 4096}, "curriculum_learning.max_difficulty 4096 exceeds --seq-length 2048"),
            ({"schedule_config": {"total_curriculum_step": 10, "difficulty_step": 12}},
             "curriculum_learning.schedule_config.difficulty_step 12 is not a multiple of 8"),
            ({"min_difficulty": True}, "curriculum_learning.min_difficulty is True; expected a positive integer")]:
        with pytest.raises(ValueError, match=message):
            SeqlenCurriculum({**block, **change}, 2048)


def test_every_rule_is_applied_by_both_the_spec_and_the_trainer():
    """A rule applied on one side only lets the other accept what it refuses (the ramp-up's start of 0 once hung the
    trainer). The one exception needs the data-parallel size, which only the spec knows before the job starts."""
    import inspect
    from pathlib import Path

    import opskit.spec.schema
    import opskit.train

    spec_only = {"batch_problems": "needs DP; the trainer meets it at run time (rules.schedule.num_microbatches)"}
    rules = [name for name, f in vars(consistency).items() if name.endswith("_problems") and inspect.isfunction(f)]
    spec_text = Path(opskit.spec.schema.__file__).read_text()
    train_text = "".join(p.read_text() for p in Path(opskit.train.__file__).parent.glob("*.py"))
    assert len(rules) >= 14
    for rule in rules:
        assert f"{rule}(" in spec_text, rule
        assert (f"{rule}(" in train_text) != (rule in spec_only), rule


def test_the_slowest_rank_is_measured_against_its_own_stages_other_ranks():
    """Ranks of different stages do different work: stage 1's 30 ms is not slow next to stage 0's 10 ms; a rank at
    13 ms among 10 ms peers of its stage is 1.3x; a stage of one rank is compared with nobody; the line reads back."""
    from opskit.rules.stragglers import SlowestRank, parse_slowest_rank_line, slowest_rank, straggler

    places = [("n1", 0, 0), ("n1", 1, 0), ("n2", 0, 1), ("n2", 1, 1), ("n3", 0, 0), ("n3", 1, 1)]
    slow = slowest_rank(11, 20, [10.0, 10.0, 30.0, 30.0, 13.0, 30.0], places)
    assert (slow.rank, slow.node, slow.local_rank, slow.stage, round(slow.ratio, 6), slow.others_ms) == (
        4, "n3", 0, 0, 1.3, 10.0)
    assert parse_slowest_rank_line(slow.line()) == SlowestRank(11, 20, 4, "n3", 0, 0, 13.0, 1.3, 10.0)
    assert parse_slowest_rank_line("[default3]:" + slow.line()) is None  # the caller strips torchrun's prefix
    assert slowest_rank(1, 10, [10.0, 30.0], [("n1", 0, 0), ("n1", 1, 1)]) is None
    same = [SlowestRank(i, i + 9, 4, "n3", 0, 0, 13.0, 1.3, 10.0) for i in (1, 11, 21)]
    assert straggler(same, 1.2) == same[-1]
    assert straggler(same[:2], 1.2) is None  # 2 intervals are not 3
    assert straggler(same, 1.35) is None
    moved = [*same[:2], SlowestRank(21, 30, 1, "n1", 1, 0, 13.0, 1.3, 10.0)]
    assert straggler(moved, 1.2) is None  # noise moves around; a straggler stays
