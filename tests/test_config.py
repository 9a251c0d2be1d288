"""Config loading: presets, overrides, and errors that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastgrpo.config import Config, ConfigError, all_keys, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.name)
def test_every_preset_loads_and_its_first_line_is_the_command_that_runs_it(preset):
    load_config(preset)
    first = preset.read_text().splitlines()[0]
    assert first.startswith("# fastgrpo train ") and preset.name in first


def test_overrides_are_read_as_yaml_values_and_win_over_the_file(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("algo:\n  beta: 0.1\nrollout:\n  num_generations: 4\n")
    config = load_config(preset, ["algo.beta=0.0", "rollout.num_generations=8", "algo.delta=null"])
    assert config.algo.beta == 0.0 and isinstance(config.algo.beta, float)
    assert config.rollout.num_generations == 8
    assert config.algo.delta is None
    assert load_config(preset).algo.beta == 0.1


def test_exponent_without_a_dot_is_a_float_not_a_string():
    assert load_config(None, ["train.learning_rate=5e-5"]).train.learning_rate == 5e-5


def test_unknown_key_in_a_file_suggests_the_nearest_valid_key(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  num_generation: 4\n")
    with pytest.raises(ConfigError, match="Did you mean 'rollout.num_generations'"):
        load_config(preset)


def test_a_key_given_without_its_section_is_pointed_at_the_right_section():
    with pytest.raises(ConfigError, match="Did you mean 'train.learning_rate'"):
        load_config(None, ["learning_rate=1e-5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.temperature=0", r"must be in \(0, 10\]"),
        ("rollout.top_p=1.5", r"must be in \(0, 1\]"),
        ("train.steps=-1", "must be >= 0"),
        ("train.steps=1.5", "must be int"),
        ("algo.beta=true", "must be float"),
        ("model.dtype=fp32", "choose one of"),
        ("task.name=jsonl", "needs task.path"),
        ("algo.loss_type=cispo", "epsilon_high"),
        ("model.device=tpu", "use auto, cpu, cuda"),
        ("rollout", "must look like section.key=value"),
        ("rollout=3", "is a section"),
    ],
)
def test_bad_values_are_refused_with_a_message_that_names_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_or_malformed_config_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("task:\n  system_prompt: café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.yaml is not UTF-8 text"):
        load_config(latin)


def test_all_keys_lists_every_section_field():
    keys = all_keys()
    assert "algo.epsilon_high" in keys and "rewards" in keys and "train.micro_batch_tokens" in keys
    assert len(keys) == len(set(keys))
    assert Config().rewards == [{"name": "math_accuracy", "weight": 1.0}]


def test_on_and_off_read_by_yaml_as_booleans_still_mean_on_and_off():
    assert load_config(None, ["train.fused_lm_head=off"]).train.fused_lm_head == "off"
    assert load_config(None, ["train.fused_lm_head=on"]).train.fused_lm_head == "on"


def test_master_weights_takes_yaml_off_and_names_its_choices_for_anything_else():
    from fastgrpo.config import ConfigError, load_config

    assert load_config(overrides=["train.master_weights=off"]).train.master_weights == "off"
    assert load_config().train.bf16_rounding == "stochastic"
    for bad in ("on", "bf16", "true"):
        with pytest.raises(ConfigError, match="choose one of auto, fp32, off"):
            load_config(overrides=[f"train.master_weights={bad}"])


NUMERIC = (int, float, "int | None", "float | None", "int", "float")


def test_every_numeric_key_has_a_checked_range_that_holds_its_default():
    from fastgrpo.config import RANGES, in_range
    from fastgrpo.config_keys import key_table

    numeric = [key for key, kind, _, _ in key_table() if kind in NUMERIC]
    assert sorted(numeric) == sorted(RANGES)
    for key in numeric:
        section, name = key.split(".")
        default = getattr(getattr(Config(), section), name)
        assert default is None or in_range(default, RANGES[key]), key


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.learning_rate=10", r"'train.learning_rate' is 10.0; it must be in \[0, 1\]"),
        ("train.adam_beta1=1.5", r"'train.adam_beta1' is 1.5; it must be in \[0, 1\)"),
        ("train.adam_beta2=1", r"'train.adam_beta2' is 1.0; it must be in \[0, 1\)"),
        ("task.num_operands=0", r"'task.num_operands' is 0; it must be in \[2, 16\]"),
        ("algo.epsilon_low=2", r"'algo.epsilon_low' is 2.0; it must be in \[0, 1\]"),
        ("eval.temperature=-1", r"'eval.temperature' is -1.0; it must be in \[0, 10\]"),
        ("train.learning_rate=.nan", "'train.learning_rate' is nan; give a finite number"),
        ("train.max_grad_norm=.inf", "'train.max_grad_norm' is inf; give a finite number"),
        ("train.max_nonfinite_steps=0", "'train.max_nonfinite_steps' is 0; it must be >= 1"),
        ("train.reward_timeout=0", "'train.reward_timeout' is 0.0; it must be > 0 "),
        ("train.reward_timeout=-5", r"-5.0; it must be > 0 \(.*null for no limit\)"),
        ("train.reward_timeout=.inf", r"is inf; give a finite number \(.*null for no limit\)"),
    ],
)
def test_values_outside_their_range_are_refused_with_the_range_and_the_default(override, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, [override])
    assert "the default is" in str(error.value) or "finite" in str(error.value)


def test_reward_timeout_is_sixty_seconds_unless_set_and_null_turns_it_off():
    assert Config().train.reward_timeout == 60.0
    assert load_config(None, ["train.reward_timeout=0.5"]).train.reward_timeout == 0.5
    assert load_config(None, ["train.reward_timeout=null"]).train.reward_timeout is None
    with pytest.raises(ConfigError, match="'train.reward_timeout' must be float, got '60s'"):
        load_config(None, ["train.reward_timeout=60s"])


def test_key_table_gives_every_key_a_type_a_default_and_a_meaning():
    from fastgrpo.config_keys import key_table

    rows = {key: rest for key, *rest in key_table()}
    assert list(rows) == all_keys()
    assert rows["train.learning_rate"][:2] == ["float", "1e-05"]
    assert "learning rate" in rows["train.learning_rate"][2]
    assert rows["rollout.num_generations"][:2] == ["int", "8"]
    assert all(meaning for _, _, meaning in rows.values())
