"""opskit.spec.schema: finding specs (path, name, prefix, trainings/ shadowing), one-line validation errors, sbatch
times."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from opskit.spec.files import SpecError, find_spec, preset_names
from opskit.spec.load import load_spec
from opskit.spec.schema import parse_slurm_time

PRESET = Path(__file__).resolve().parents[1] / "opskit" / "spec" / "presets" / "tiny.yaml"


def preset() -> dict:
    return yaml.safe_load(PRESET.read_text())


def write(path: Path, raw: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return path


def spec_error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}:"), message
    return message


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """An empty working directory, so the developer's own trainings/ folder cannot leak in."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- finding specs


def test_bundled_preset_by_exact_name(in_tmp):
    assert "tiny" in preset_names()
    spec = load_spec("tiny")
    assert spec.name == "tiny"
    assert find_spec("tiny").resolve() == PRESET.resolve()
    assert spec.model.hidden_size == 128 and spec.model.position_embedding_type == "alibi"
    assert spec.batch.global_batch_size == 16
    assert spec.job_name == "tiny"  # slurm.job_name defaults to the spec name


def test_unique_prefix_and_path(in_tmp):
    assert load_spec("ti").name == "tiny"
    raw = preset()
    raw["model"]["num_layers"] = 3
    path = write(in_tmp / "elsewhere" / "mine.yaml", raw)
    by_path = load_spec(str(path))
    assert by_path.name == "mine"  # the file stem, when the YAML has no name
    assert by_path.model.num_layers == 3
    raw["name"] = "explicit"
    assert load_spec(str(write(in_tmp / "other.yml", raw))).name == "explicit"


def test_missing_spec_file_is_one_line(in_tmp):
    with pytest.raises(SpecError, match=r"^nope\.yaml: no such spec file$"):
        load_spec("nope.yaml")


def test_ambiguous_prefix_and_unknown_name_list_candidates(in_tmp):
    raw = preset()
    write(in_tmp / "trainings" / "tr11-176B-ml.yaml", raw)
    write(in_tmp / "trainings" / "tr11b-1B3.yaml", raw)
    write(in_tmp / "trainings" / "tr8-104B.yaml", raw)

    with pytest.raises(SpecError) as info:
        load_spec("tr1")
    assert str(info.value) == "spec 'tr1' is ambiguous: tr1-13B, tr11-176B-ml, tr11b-1B3"

    assert load_spec("tr11-").name == "tr11-176B-ml"
    assert load_spec("tr8-").name == "tr8-104B"
    with pytest.raises(SpecError, match=r"^spec 'tr8' is ambiguous: tr8-104B, tr8b-104B$"):
        load_spec("tr8")

    with pytest.raises(SpecError) as info:
        load_spec("tr12")
    assert str(info.value) == ("no spec named 'tr12'; known: tiny, tr1-13B, tr11-176B-ml, tr11b-1B3, tr8-104B, "
                               "tr8b-104B")


def test_trainings_folder_shadows_presets(in_tmp):
    raw = preset()
    raw["description"] = "the project's own tiny"
    raw["model"]["num_layers"] = 2
    write(in_tmp / "trainings" / "tiny.yaml", raw)
    spec = load_spec("tiny")
    assert spec.description == "the project's own tiny"
    assert spec.model.num_layers == 2
    assert find_spec("tiny") == Path("trainings") / "tiny.yaml"


def test_a_folder_named_like_a_spec_does_not_hide_it(in_tmp):
    # BigScience keeps per-training folders (logs, scripts) named exactly like the training.
    (in_tmp / "tiny").mkdir()
    assert load_spec("tiny").name == "tiny"


# --------------------------------------------------------------------------- validation errors


def test_unknown_key_lists_valid_keys(in_tmp):
    raw = preset()
    raw["model"]["num_layerz"] = raw["model"].pop("num_layers")
    message = spec_error(write(in_tmp / "typo.yaml", raw))
    assert "model.num_layerz: unknown key (expected one of: num_layers, hidden_size, num_attention_heads," in message
    assert "model.num_layers: Field required" in message

    raw = preset()
    raw["slurmm"] = raw.pop("slurm")
    message = spec_error(write(in_tmp / "section.yaml", raw))
    assert message == (f"{in_tmp / 'section.yaml'}: slurmm: unknown key (expected one of: name, description, model, "
                       f"parallel, batch, optimizer, data, checkpoint, slurm, paths, sync, curriculum_learning, "
                       f"watchdog, megatron_args, deepspeed_config, variants)")


def test_wrong_type_names_the_field(in_tmp):
    raw = preset()
    raw["batch"]["micro_batch_size"] = "eight"
    message = spec_error(write(in_tmp / "type.yaml", raw))
    assert re.search(r"batch\.micro_batch_size: Input should be a valid integer", message), message

    raw = preset()
    raw["model"]["position_embedding_type"] = "rotary"
    message = spec_error(write(in_tmp / "literal.yaml", raw))
    assert "model.position_embedding_type: Input should be 'absolute' or 'alibi'" in message


def test_hidden_not_divisible_by_heads(in_tmp):
    raw = preset()
    raw["model"]["num_attention_heads"] = 3
    message = spec_error(write(in_tmp / "heads.yaml", raw))
    assert message.endswith("model: hidden_size 128 must be divisible by num_attention_heads 3"), message


def test_global_batch_not_divisible_by_micro_batch_times_dp(in_tmp):
    raw = preset()
    raw["batch"]["global_batch_size"] = 12  # MBS 8, DP 1
    message = spec_error(write(in_tmp / "gbs.yaml", raw))
    assert "batch.global_batch_size 12 is not divisible by micro_batch_size*DP = 8" in message

    raw = preset()
    raw["parallel"]["gpus_per_node"] = 4  # DP 4: MBS*DP = 32 does not divide 16
    message = spec_error(write(in_tmp / "dp.yaml", raw))
    assert "batch.global_batch_size 16 is not divisible by micro_batch_size*DP = 32" in message

    raw["batch"]["global_batch_size"] = 64
    assert load_spec(str(write(in_tmp / "dp-ok.yaml", raw))).parallel.data_parallel_size == 4


def test_rampup_increment_must_divide(in_tmp):
    raw = preset()
    raw["batch"]["rampup_batch_size"] = [8, 3, 100]  # 16 - 8 = 8 is no multiple of 3
    message = spec_error(write(in_tmp / "rampup.yaml", raw))
    assert "batch.rampup_batch_size: global_batch_size - start = 8 must be a positive multiple of the increment 3" \
        in message

    raw["batch"]["rampup_batch_size"] = [8, 8, 100]
    assert load_spec(str(write(in_tmp / "rampup-ok.yaml", raw))).batch.rampup_batch_size == (8, 8, 100)

    raw["batch"]["rampup_batch_size"] = [4, 4, 100]  # divides 16-4, but MBS 8 does not divide the start batch 4
    message = spec_error(write(in_tmp / "rampup-mbs.yaml", raw))
    assert "rampup_batch_size start 4 is not divisible by micro_batch_size*DP = 8" in message


def test_invalid_yaml_names_the_line(in_tmp):
    text = PRESET.read_text()
    lines = text.splitlines()
    at = lines.index("  micro_batch_size: 8")
    lines.insert(at + 1, "   oops: 1")  # over-indented: no mapping value allowed here
    path = write(in_tmp / "broken.yaml", "\n".join(lines) + "\n")
    message = spec_error(path)
    assert message.startswith(f"{path}: line {at + 2} not valid YAML"), message


def test_not_a_mapping(in_tmp):
    message = spec_error(write(in_tmp / "list.yaml", "- model\n- batch\n"))
    assert "expected a mapping of sections" in message and "got list" in message


# --------------------------------------------------------------------------- sbatch times and exit duration


@pytest.mark.parametrize("value, minutes", [
    ("20:00:00", 1200),
    ("100:00:00", 6000),
    ("4-04:00:00", 6000),
    ("3", 3),
    ("1:30", 1.5),  # MM:SS
    ("2-0", 2880),  # D-H
    ("1-12:30", 2190),  # D-H:M
    (" 45 ", 45),
])
def test_parse_slurm_time(value, minutes):
    assert parse_slurm_time(value) == pytest.approx(minutes)


@pytest.mark.parametrize("value", ["UNLIMITED", "1:2:3:4", "", "2-", "1-2-3", "20h"])
def test_parse_slurm_time_rejects(value):
    with pytest.raises(ValueError, match="expected sbatch's format"):
        parse_slurm_time(value)


def test_exit_duration_is_time_limit_minus_margin(in_tmp):
    raw = preset()
    raw["slurm"] = {"time": "20:00:00"}  # BigScience: 20 h, 10 min margin -> --exit-duration-in-mins 1190
    spec = load_spec(str(write(in_tmp / "bs.yaml", raw)))
    assert spec.slurm.exit_margin_mins == 10
    assert spec.exit_duration_in_mins == 1190

    raw["slurm"] = {"time": "1", "exit_margin_mins": 0.5}
    assert load_spec(str(write(in_tmp / "short.yaml", raw))).exit_duration_in_mins == 0.5

    raw["slurm"] = {"time": "UNLIMITED"}  # no exit duration can be derived: refused when the spec is read
    message = spec_error(write(in_tmp / "unlimited.yaml", raw))
    assert "slurm.time: time 'UNLIMITED': expected sbatch's format" in message


def test_names_that_would_break_the_job_script_are_refused(in_tmp):
    # The job script exports env names unquoted and puts names on comment / #SBATCH lines.
    raw = preset()
    raw["slurm"]["env"] = {"OMP_NUM_THREADS": "2", "X=$(touch pwned) Y": "1"}
    message = spec_error(write(in_tmp / "env.yaml", raw))
    assert "slurm.env: Value error, " not in message
    assert "slurm.env: 'X=$(touch pwned) Y' is not a valid environment variable name" in message

    raw = preset()
    raw["slurm"]["job_name"] = "tr11\ntouch pwned"
    message = spec_error(write(in_tmp / "job.yaml", raw))
    assert "slurm.job_name: String should match pattern" in message

    raw = preset()
    raw["name"] = "tiny\nrm -rf ~"
    assert "name: String should match pattern" in spec_error(write(in_tmp / "name.yaml", raw))

    raw = preset()
    raw["slurm"]["job_name"] = "it's a \"job\" $(touch pwned) #1"  # odd but harmless: quoted when rendered
    assert load_spec(str(write(in_tmp / "odd.yaml", raw))).job_name == "it's a \"job\" $(touch pwned) #1"


def test_cli_name_is_what_other_commands_accept(in_tmp):
    # Hints such as "run `opskit data prepare X` first" must name something `opskit` can find again.
    assert load_spec("tiny").cli_name == "tiny"
    assert load_spec("ti").cli_name == "tiny"
    raw = preset()
    write(in_tmp / "trainings" / "tr8-104B.yaml", raw)
    assert load_spec("trainings/tr8-104B.yaml").cli_name == "tr8-104B"
    path = write(in_tmp / "elsewhere" / "mine.yaml", raw)
    assert load_spec(str(path)).cli_name == str(path)
    raw["name"] = "tiny"  # named like the preset, but another file
    path = write(in_tmp / "elsewhere" / "copy.yaml", raw)
    assert load_spec(str(path)).cli_name == str(path)


def test_unquoted_sbatch_times_stay_times(in_tmp):
    # YAML 1.1 would read 20:00:00 as the base-60 integer 72000 (= 72000 minutes for sbatch).
    text = yaml.safe_dump(preset(), sort_keys=False).replace("time: '3'", "time: 20:00:00")
    assert "time: 20:00:00" in text
    spec = load_spec(str(write(in_tmp / "unquoted.yaml", text)))
    assert spec.slurm.time == "20:00:00"
    assert spec.exit_duration_in_mins == 20 * 60 - spec.slurm.exit_margin_mins
    minutes = load_spec(str(write(in_tmp / "minutes.yaml", text.replace("time: 20:00:00", "time: 90"))))
    assert minutes.slurm.time_minutes == 90


def test_an_empty_variable_is_refused_like_an_unset_one(in_tmp, monkeypatch):
    """An exported but empty $six_ALL_CCFRSCRATCH must not render the run at /checkpoints/..."""
    from opskit.run.paths import RunPaths

    monkeypatch.setenv("six_ALL_CCFRSCRATCH", "")
    with pytest.raises(SpecError) as info:
        RunPaths.of(load_spec("tr11"))
    message = str(info.value)
    assert "\n" not in message, message
    assert "paths.output: $six_ALL_CCFRSCRATCH is set but empty in this environment" in message, message
    spec = load_spec("tr11").with_placeholders()  # what `opskit submit` renders with: kept literal, listed
    assert RunPaths.of(spec).root == Path("$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml")
    assert spec.problems[0].startswith("$six_ALL_CCFRSCRATCH is set but empty here (used by paths.output)")
