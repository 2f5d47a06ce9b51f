"""Every field of TRL 1.16's SFTConfig, DPOConfig, KTOConfig, RewardConfig, GRPOConfig, RLOOConfig and
DistillationConfig is a field of plait's matching config, accepted by the Python config, a YAML recipe and
the installed ``plait`` command, with TRL's default or a difference documented in docs/trl-differences.md.

TRL's fields come from a checked-in list (tests/data/trl_1_16_config_fields.json: each init field that
TrainingArguments lacks or whose default TRL overrides, with TRL's default), not from importing TRL, which
is never installed beside plait. What each field does is pinned by the tests of the feature it belongs to.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from plait.cli import main
from plait.engine.config import config_fields
from plait.manager import default_plugins
from plait.recipes.run import load_recipe, method_args

ROOT = Path(__file__).resolve().parents[1]
TRL_FIELDS = {name: fields for name, fields in json.loads((ROOT / "tests/data/trl_1_16_config_fields.json").read_text()).items()
              if not name.startswith("_")}
PLAIT_METHOD = {"SFTConfig": "sft", "DPOConfig": "dpo", "KTOConfig": "kto", "RewardConfig": "reward_model",
                "GRPOConfig": "grpo", "RLOOConfig": "rloo", "DistillationConfig": "distill"}
CONFIGS = sorted(TRL_FIELDS)


def method(trl_config: str):
    return default_plugins().methods.get(PLAIT_METHOD[trl_config], family="method").obj


def plait_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def documented_fields() -> set[str]:
    """Field names in backticks in the first column of docs/trl-differences.md's table."""
    rows = [line.split("|")[1] for line in (ROOT / "docs/trl-differences.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| field")]
    return {name for cell in rows for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)}


@functools.cache
def fresh(config_cls):
    return config_cls(output_dir="unused", report_to="none")


def same_default(config_cls, name: str, trl_value: Any, ours: Any) -> bool:
    if ours == trl_value:
        return True
    if ours is None and getattr(fresh(config_cls), name) == trl_value:
        return True  # resolved in __post_init__ (gradient_checkpointing: on, set under transformers 5's name)
    # plait's loss_type None means "the method's default loss": compare that loss with TRL's default
    default_loss = getattr(config_cls.params_class, "default_loss", None)
    return name == "loss_type" and ours is None and trl_value in (default_loss, [default_loss])


def given_values(trl_config: str) -> dict[str, Any]:
    """TRL's default of every listed field, as a user porting a TRL config would write it out."""
    return {name: value for name, value in TRL_FIELDS[trl_config].items()
            if not (isinstance(value, str) and value.startswith(("<", "HubStrategy", "IntervalStrategy")))}


@pytest.mark.parametrize("trl_config", CONFIGS)
def test_every_trl_field_is_a_plait_field(trl_config):
    fields = config_fields(method(trl_config).config)
    missing = sorted(set(TRL_FIELDS[trl_config]) - set(fields))
    assert not missing, f"{PLAIT_METHOD[trl_config]} lacks TRL 1.16's {trl_config} fields: {', '.join(missing)}"


@pytest.mark.parametrize("trl_config", CONFIGS)
def test_defaults_are_trls_or_documented(trl_config):
    config_cls = method(trl_config).config
    fields, documented = config_fields(config_cls), documented_fields()
    differing = {name: (value, plait_default(fields[name])) for name, value in TRL_FIELDS[trl_config].items()
                 if name in fields and not same_default(config_cls, name, value, plait_default(fields[name]))}
    undocumented = {name: f"TRL {trl!r}, plait {ours!r}" for name, (trl, ours) in differing.items() if name not in documented}
    assert not undocumented, f"{trl_config}: defaults differ from TRL 1.16 without a row in docs/trl-differences.md: {undocumented}"


@pytest.mark.parametrize("trl_config", CONFIGS)
def test_python_and_yaml_accept_every_field_at_trls_default(trl_config, tmp_path, tiny_model_path):
    values = {**given_values(trl_config), "output_dir": str(tmp_path / "out"), "report_to": "none"}
    config_cls = method(trl_config).config
    from_python = config_cls(**values)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"method": PLAIT_METHOD[trl_config], "model": str(tiny_model_path),
                                      "dataset": str(ROOT / "examples/data/demo_preferences.jsonl"), "training": values}))
    _, from_yaml = method_args(load_recipe(recipe, method=PLAIT_METHOD[trl_config]), default_plugins())
    for name, value in given_values(trl_config).items():
        assert getattr(from_python, name) == getattr(from_yaml, name), name
    assert type(from_yaml) is config_cls


def cli_tokens(name: str, value: Any) -> list[str]:
    if value == []:
        return []  # a bare flag means True; an empty list is the default anyway
    if isinstance(value, list):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", json.dumps(value) if isinstance(value, (dict, bool)) or value is None else str(value)]


@pytest.mark.parametrize("trl_config", CONFIGS)
def test_the_plait_command_accepts_every_field_at_trls_default(trl_config, tmp_path, tiny_model_path, capsys):
    # plait.cli.main is the console script's entry point; in-process it skips 7 interpreter start-ups
    name = PLAIT_METHOD[trl_config]
    recipe = ROOT / "examples/recipes" / f"{name}_tiny.yaml"
    models = ["--model", str(tiny_model_path)] + (["--teacher_model_name_or_path", str(tiny_model_path)] if name == "distill" else [])
    flags = [token for field, value in given_values(trl_config).items() for token in cli_tokens(field, value)]
    # the models after TRL's defaults: the last flag wins, and TRL's teacher default is None
    status = main([name, "--config", str(recipe), *flags, *models, "--output_dir", str(tmp_path / "out"), "--check"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "is a valid" in out.out
