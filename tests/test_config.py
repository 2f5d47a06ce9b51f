"""Configs: method_config (TrainingArguments + attrs params) and YAML recipes with one-line errors."""

import dataclasses
import pickle
import re

import attrs
import pytest
import torch
from transformers import TrainingArguments

from plait.engine.config import build_method_config, cpu_bf16_support, load_run_config, method_config, yaml_load
from plait.errors import PlaitError
from plait.params import positive


@attrs.frozen
class ToyParams:
    """Parameters of a toy method."""

    beta: float = attrs.field(default=0.1, validator=positive)
    loss_type: str = "sigmoid"


# module level, as a method plugin does it, so instances pickle (checkpoints store training_args.bin)
ToyConfig = method_config("ToyConfig", ToyParams, defaults={"learning_rate": 1e-6, "logging_steps": 5})

RECIPE = "method: dpo\nmodel: tiny\ndataset: {path: json, data_files: prefs.jsonl}\n"


def load(tmp_path, text: str):
    """Load a recipe the way `plait <method> --config` does, then build the method's config."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    run = load_run_config(path)
    return run, build_method_config(ToyConfig, run.training)


MALFORMED = {
    "yaml-syntax": ("method: dpo\nmodel: [tiny\ndataset: {path: json}\n",
                    ["config.yaml: line 3 is not valid YAML", "expected ',' or ']'", "fix the syntax"]),
    "yaml-tab": ("method: dpo\n\tmodel: tiny\n", ["config.yaml: line 2 is not valid YAML", "fix the syntax"]),
    "top-level-list": ("- method: dpo\n- model: tiny\n",
                       ["config.yaml: expected a mapping of RunConfig fields", "[{'method': 'dpo'}, {'model': 'tiny'}]",
                        "write it as {method: ..., model: ..., dataset: ..."]),
    "empty-file": ("", ["config.yaml: expected a mapping of RunConfig fields, got None", "write it as {method: ..."]),
    "missing-method": ("model: tiny\ndataset: {path: json}\n",
                       ["config.yaml.method: required field is missing", "add `method: ...`"]),
    "missing-model": ("method: dpo\ndataset: {path: json}\n",
                      ["config.yaml.model: required field is missing", "add `model: ...`"]),
    "misspelt-top-level-key": ("method: dpo\nmodel: tiny\ndatset: {path: json}\n",
                               ["config.yaml: unknown field 'datset'", "did you mean 'dataset'"]),
    "dataset-without-path": ("method: dpo\nmodel: tiny\ndataset: {data_files: prefs.jsonl}\n",
                             ["config.yaml.dataset.path: required field is missing", "add `path: ...`"]),
    "dataset-not-a-mapping": ("method: dpo\nmodel: tiny\ndataset: prefs.jsonl\n",
                              ["config.yaml.dataset: expected a mapping of DatasetSpec fields", "'prefs.jsonl'",
                               "write it as {path: ..., name: ..., data_files: ..., split: ..., data_dir: ..."]),
    "misspelt-nested-key": (RECIPE + "eval_dataset: {path: json, splt: test}\n",
                            ["config.yaml.eval_dataset: unknown field 'splt'", "did you mean 'split'"]),
    "method-not-a-string": ("method: 3\nmodel: tiny\ndataset: {path: json}\n",
                            ["config.yaml.method: expected str, got 3 (int)", "fix the value's type"]),
    "training-not-a-mapping": (RECIPE + "training: [1, 2]\n",
                               ["config.yaml.training: expected dict, got [1, 2] (list)", "fix the value's type"]),
    "import-error-policy": (RECIPE + "plugins: {on_import_error: maybe}\n",
                            ["plugins.on_import_error: 'maybe' is not valid", "use 'fail' or 'skip'"]),
    "bool-given-as-string": (RECIPE + "plugins: {autoload: 'no'}\n",
                             ["config.yaml.plugins.autoload: expected bool, got 'no' (str)", "fix the value's type"]),
    "plugins-disable-not-a-list": (RECIPE + "plugins: {disable: dpo_sigmoid}\n",
                                   ["config.yaml.plugins.disable: expected list, got 'dpo_sigmoid' (str)"]),
    "wrong-type-in-training": (RECIPE + "training: {learning_rate: abc}\n",
                               ["training.learning_rate: expected float, got 'abc' (str)", "fix the value's type"]),
    "training-bool-as-string": (RECIPE + "training: {bf16: 'yes'}\n",
                                ["training.bf16: expected bool | None, got 'yes' (str)"]),
    "float-for-int": (RECIPE + "training: {per_device_train_batch_size: 2.5}\n",
                      ["training.per_device_train_batch_size: expected int, got 2.5 (float)"]),
    "unknown-training-field": (RECIPE + "training: {learning_rat: 1.0e-5}\n",
                               ["training: unknown field 'learning_rat'", "did you mean 'learning_rate'"]),
    "method-param-out-of-range": (RECIPE + "training: {beta: -1}\n",
                                  ["training: ToyConfig: beta=-1 must be a number > 0"]),
    "duplicate-key": (RECIPE + "training:\n  beta: 0.1\n  max_steps: 3\n  beta: 0.2\n",
                      ["config.yaml: line 7 is not valid YAML", "key 'beta' is also on line 5", "remove one"]),
    "duplicate-key-in-a-flow-mapping": (RECIPE + "peft: {r: 8, r: 16}\n",
                                        ["line 4", "key 'r' is also on line 4"]),
    "batch-size-zero": (RECIPE + "training: {per_device_train_batch_size: 0}\n",
                        ["training: per_device_train_batch_size=0 must be an integer >= 1"]),
    "learning-rate-nan": (RECIPE + "training: {learning_rate: .nan}\n",
                          ["training: learning_rate=nan must be a finite number > 0"]),
}


@pytest.mark.parametrize("text, phrases", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_config_gives_one_line_error(tmp_path, text, phrases):
    with pytest.raises(PlaitError) as err:
        load(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message


def test_missing_config_file(tmp_path):
    with pytest.raises(PlaitError) as err:
        load_run_config(tmp_path / "nope.yaml")
    assert str(err.value) == f"--config '{tmp_path / 'nope.yaml'}': no such file; pass the path of a YAML recipe"


def test_a_good_recipe_loads_with_yaml_12_floats(tmp_path):
    run, config = load(tmp_path, RECIPE + "loss: sigmoid\ntraining: {learning_rate: 5e-6, beta: 2e-1, max_steps: 3}\n")
    assert run.dataset.path == "json" and run.dataset.data_files == "prefs.jsonl" and run.dataset.split == "train"
    assert run.loss == "sigmoid" and run.plugins.on_import_error == "fail"
    assert config.learning_rate == 5e-6 and config.max_steps == 3 and config.params == ToyParams(beta=0.2)


def test_yaml_load_reads_exponents_as_floats_and_keeps_strings():
    assert yaml_load("a: 1e-5\nb: -2E+3\nc: .5e1\nd: 5.0e-6\ne: '1e-5'\nf: 1e\ng: 12") == {
        "a": 1e-5, "b": -2e3, "c": 5.0, "d": 5e-6, "e": "1e-5", "f": "1e", "g": 12}


def test_yaml_merge_keys_may_override_what_they_merge():
    """``<<: *defaults`` then a key of its own is an override on purpose, not a duplicate."""
    assert yaml_load("base: &b {lr: 1, steps: 2}\nrun:\n  <<: *b\n  lr: 3\n") == {
        "base": {"lr": 1, "steps": 2}, "run": {"lr": 3, "steps": 2}}


def test_command_line_overrides_replace_training_fields(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(RECIPE + "training: {beta: 0.2, max_steps: 3}\n")
    assert load_run_config(path, {"beta": 0.5}).training == {"beta": 0.5, "max_steps": 3}


# -- method_config ------------------------------------------------------------------------------


def test_method_config_composes_training_arguments_and_params(tmp_path):
    config = ToyConfig(output_dir=str(tmp_path), beta=0.3, per_device_train_batch_size=2)
    assert isinstance(config, TrainingArguments)
    assert config.params == ToyParams(beta=0.3, loss_type="sigmoid") and config.beta == 0.3
    assert config.per_device_train_batch_size == 2
    assert ToyConfig.params_class is ToyParams and ToyConfig.__doc__ == ToyParams.__doc__


def test_method_defaults_override_training_arguments_defaults(tmp_path):
    config, plain = ToyConfig(output_dir=str(tmp_path)), TrainingArguments(output_dir=str(tmp_path))
    assert (config.learning_rate, config.logging_steps) == (1e-6, 5)
    assert (plain.learning_rate, plain.logging_steps) != (1e-6, 5)
    assert ToyConfig(output_dir=str(tmp_path), learning_rate=3e-4).learning_rate == 3e-4


@pytest.mark.skipif(torch.cuda.is_available() or cpu_bf16_support()[0],
                    reason="checks the choice made on a CPU-only machine without bf16 units")
def test_precision_left_unset_is_fp32_on_cpu(tmp_path):
    config = ToyConfig(output_dir=str(tmp_path))
    assert config.bf16 is False and config.fp16 is False  # TRL's bf16=True default would fail here


def test_method_config_rejects_out_of_range_params_naming_the_config(tmp_path):
    with pytest.raises(PlaitError, match=r"^ToyConfig: beta=0 must be a number > 0$"):
        ToyConfig(output_dir=str(tmp_path), beta=0)


@pytest.mark.parametrize("field, value, phrase", [
    ("per_device_train_batch_size", 0, "must be an integer >= 1"),
    ("gradient_accumulation_steps", 0, "must be an integer >= 1"),
    ("learning_rate", 0.0, "must be a finite number > 0"),
    ("learning_rate", -1e-5, "must be a finite number > 0"),
    ("learning_rate", float("inf"), "must be a finite number > 0"),
    ("max_steps", 0, "must be a positive number of optimizer steps, or -1 to train num_train_epochs"),
    ("num_train_epochs", -2.0, "must be a finite number >= 0"),
    ("adam_beta2", 1.0, "must be in [0, 1)"),
])
def test_training_numbers_transformers_accepts_but_that_train_wrongly_are_refused(tmp_path, field, value, phrase):
    with pytest.raises(PlaitError, match=rf"^{field}={value!r} {re.escape(phrase)}"):
        ToyConfig(output_dir=str(tmp_path), **{field: value})


def test_overwrite_output_dir_and_resume_latest_are_fields(tmp_path):
    """transformers 5 has no overwrite_output_dir; resume_from_checkpoint also takes true/'latest'."""
    assert "overwrite_output_dir" not in {f.name for f in dataclasses.fields(TrainingArguments)}
    assert ToyConfig(output_dir=str(tmp_path), overwrite_output_dir=True).overwrite_output_dir is True
    with pytest.raises(PlaitError, match=r"^resume_from_checkpoint=True: output_dir .* holds no complete checkpoint"):
        ToyConfig(output_dir=str(tmp_path), resume_from_checkpoint=True)
    assert ToyConfig(output_dir=str(tmp_path), resume_from_checkpoint=False).resume_from_checkpoint is None


def test_config_pickles_like_training_args_bin(tmp_path):
    config = ToyConfig(output_dir=str(tmp_path), beta=0.25, max_steps=7)
    torch.save(config, tmp_path / "training_args.bin")
    for restored in (pickle.loads(pickle.dumps(config)), torch.load(tmp_path / "training_args.bin", weights_only=False)):
        assert type(restored) is ToyConfig
        assert restored.params == ToyParams(beta=0.25) and restored.max_steps == 7
        assert restored.to_dict() == config.to_dict()
