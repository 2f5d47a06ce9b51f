"""Run a YAML recipe: ``plait <method> --config recipe.yaml [--field value ...]``.

Every registered method gets this subcommand; the recipe names the method and its components
by registry name, and everything is validated (names, types, ranges, plugin availability)
before a model or dataset is loaded.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from typing import Any

from .cli import Command
from .config import RunConfig, build_method_config, config_fields, load_run_config, yaml_load
from .errors import PlaitError
from .manager import Plugins, make_plugins

logger = logging.getLogger("plait")


def parse_overrides(extra: list[str]) -> dict[str, Any]:
    """``--beta 0.2 --loss_type sigmoid`` → {"beta": 0.2, "loss_type": "sigmoid"} (values read as YAML)."""
    overrides, key = {}, None
    for token in extra:
        if token.startswith("--"):
            key, _, value = token[2:].partition("=")
            overrides[key] = yaml_load(value) if value else True
        elif key is not None:
            overrides[key] = yaml_load(token)
            key = None
        else:
            raise PlaitError(f"unexpected argument {token!r}; config fields are given as --field value")
    return overrides


def plugins_for(config: RunConfig) -> Plugins:
    spec = config.plugins
    return make_plugins(disable=spec.disable, autoload=spec.autoload, on_import_error=spec.on_import_error)


def build_trainer(config: RunConfig, plugins: Plugins | None = None):
    """Resolve every name in ``config`` and construct the method's trainer (loads the model)."""
    plugins = plugins or plugins_for(config)
    method = plugins.methods.get(config.method, family="method").obj
    values = dict(config.training)
    fields = config_fields(method.config)
    for section in ("loss", "reward_funcs"):
        if getattr(config, section) is not None:
            if section not in fields:
                raise PlaitError(f"{section}: method {config.method!r} takes no {section}; remove the section")
            values[section] = getattr(config, section)
    if config.model_init_kwargs is not None:
        values["model_init_kwargs"] = config.model_init_kwargs
    args = build_method_config(method.config, values)

    kwargs: dict[str, Any] = {"plugins": plugins}
    if config.ref_model is not None:
        if "ref_model" not in inspect.signature(method.trainer.__init__).parameters:
            raise PlaitError(f"ref_model: method {config.method!r} uses no reference model; remove ref_model")
        kwargs["ref_model"] = config.ref_model
    if config.peft is not None:
        from peft import LoraConfig

        try:
            kwargs["peft_config"] = LoraConfig(**config.peft)
        except TypeError as err:
            raise PlaitError(f"peft: {err}; see peft.LoraConfig for the accepted fields") from err

    import datasets

    def load(spec):
        return datasets.load_dataset(spec.path, spec.name, data_files=spec.data_files, split=spec.split)

    train = load(config.dataset)
    evaluation = load(config.eval_dataset) if config.eval_dataset else None
    return method.trainer(model=config.model, args=args, train_dataset=train, eval_dataset=evaluation, **kwargs)


def run(config: RunConfig, plugins: Plugins | None = None):
    trainer = build_trainer(config, plugins)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    return trainer


def method_command(name: str) -> Command:
    """The ``plait <name>`` subcommand of a registered method."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", required=True, help="YAML recipe (see examples/recipes/)")

    def run_command(args: argparse.Namespace, plugins: Plugins) -> int:
        config = load_run_config(args.config, parse_overrides(args.extra))
        if config.method != name:
            raise PlaitError(f"{args.config}: method is {config.method!r} but the command is 'plait {name}'; "
                             f"run 'plait {config.method}' or change method")
        run(config)
        return 0

    return Command(run_command, add_arguments, help=f"train with the {name!r} method from a YAML recipe",
                   accepts_extra=True)
