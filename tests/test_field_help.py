"""``plait <method> --help`` shows every config field with one line read from the dataclass field's
``metadata["help"]``: transformers' own for TrainingArguments' fields, the ``field_help`` class variable
of plait's attrs params and options classes for the rest (:func:`plait.engine.config.field_help`).

Every field of every built-in method's Config has such a line; plait's own lines are one line under 160
characters (transformers' are theirs, some longer: the command shortens them); and a ``field_help`` key
names a field of its class, so a misspelt key fails here instead of leaving its field without a line.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import attrs
import pytest
from transformers import TrainingArguments

from plait.data import versions
from plait.engine.config import CHECKPOINTING_HELP, ModelLoading, field_help, method_config, plugin_options
from plait.manager import default_plugins

TRAINING_HELP = {f.name: f.metadata.get("help") for f in dataclasses.fields(TrainingArguments)}
LIMIT = 160


@functools.cache
def configs() -> dict[str, type]:
    return {component.name: component.obj.config for component in default_plugins().methods}


METHODS = sorted(configs())


def help_classes() -> list[type]:
    """The attrs classes whose ``field_help`` reaches a Config: each method's params class and its attrs
    bases, the model-loading fields every Config has, and the options classes plugins contribute (the
    generation backends')."""
    classes = {klass for config in configs().values() for klass in config.params_class.__mro__ if attrs.has(klass)}
    classes.update((ModelLoading, *plugin_options("plait.generation_options")))
    return sorted(classes, key=lambda klass: f"{klass.__module__}.{klass.__qualname__}")


def misspelt_keys(klass: type) -> list[str]:
    """The keys of a class's own ``field_help`` that name none of its fields (its bases' included)."""
    return sorted(set(vars(klass).get("field_help", {})) - set(attrs.fields_dict(klass)))


def own_help_problem(text: str) -> str | None:
    """Why a help line written by plait is not one line under the limit, or None."""
    if not text or not text.strip():
        return "empty"
    if "\n" in text or "\r" in text:
        return "more than one line"
    if len(text) >= LIMIT:
        return f"{len(text)} characters (limit {LIMIT})"
    return None


def test_every_builtin_method_is_checked():
    assert {"method.dpo", "method.grpo", "method.ppo", "method.sft", "method.prm", "method.online_dpo"} <= set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_every_config_field_has_a_one_line_help(method):
    config = configs()[method]
    problems = {}
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        text = field.metadata.get("help")
        if text is not None and text == TRAINING_HELP.get(field.name):
            problem = None if text.strip() else "empty"  # transformers' text: shown shortened
        else:
            problem = "no help" if text is None else own_help_problem(text)
        if problem:
            problems[field.name] = problem
    assert problems == {}, f"{config.__name__}: fields without a one-line help: {problems}"


def test_field_help_keys_name_real_fields():
    classes = help_classes()
    # the shared mixins and the backends' options are among the classes checked, not only the leaves
    assert {"LossChoice", "RewardChoice", "AgentChoice", "ReferenceSync", "RolloutParams", "OnlineParams",
            "GenerationChoice", "PreferenceParams"} <= {klass.__qualname__ for klass in classes}
    backends = plugin_options("plait.generation_options")
    assert backends and set(backends) <= set(classes)
    assert {klass.__qualname__: misspelt_keys(klass) for klass in classes if misspelt_keys(klass)} == {}


def test_a_misspelt_key_is_caught_and_leaves_its_field_without_help():
    @attrs.define
    class Knobs:
        """A params class whose help names ``betta`` for ``beta``."""

        field_help: ClassVar[dict[str, str]] = {"betta": "strength of the KL term", "steps": "optimizer steps"}
        beta: float = 0.1
        steps: int = 1

    assert misspelt_keys(Knobs) == ["betta"]
    config = method_config("KnobsConfig", Knobs)
    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(config)}
    assert helps["steps"] == "optimizer steps" and helps["beta"] is None


def test_subclass_help_overrides_its_bases():
    # ORPO's beta is its odds-ratio weight, not the preference loss's temperature that CPO and ORPO share
    orpo, cpo = (configs()[name].params_class for name in ("method.orpo", "method.cpo"))
    assert field_help(orpo)["beta"] != field_help(cpo)["beta"]
    assert field_help(orpo)["max_length"] == field_help(cpo)["max_length"]


def test_redeclared_checkpointing_fields_keep_transformers_help():
    config = configs()["method.sft"]
    fields = {f.name: f for f in dataclasses.fields(config)}
    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    for name, _, _ in versions.CONFIG_FIELDS:
        expected = inherited[name].metadata["help"] if name in inherited else CHECKPOINTING_HELP[name]
        assert fields[name].metadata["help"] == expected
    # the names plait adds on a transformers without them (< 5.20) have a line of their own
    for old, new in versions.CHECKPOINTING_NAMES:
        assert own_help_problem(CHECKPOINTING_HELP[new]) is None
