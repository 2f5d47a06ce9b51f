"""Run a YAML recipe: ``plait <method> --config recipe.yaml [--field value ...]``.

Every registered method gets this subcommand. The recipe names the method and its components
by registry name; flags mirror its fields (``--model``, ``--dataset``, ``--reward_funcs`` for
the top level, ``--beta``/``--learning_rate``/... for the ``training:`` section, dotted
``--peft.r 16`` into a section), and command-line values win over the YAML. Everything is
checked (names, types, ranges, plugin availability, data files) before a model is loaded and
before ``--num_processes N`` starts N copies of the same command (see :mod:`plait.launch`).

Paths inside a recipe are relative to the recipe file (``data_files: ../data/prefs.jsonl``);
paths on the command line are relative to the working directory; ``~`` is expanded in model
paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import yaml

from .config import (PluginsSpec, RunConfig, build_method_config, check_value, config_fields, parse_run_config,
                     yaml_load)
from . import preflight
from .errors import PlaitError
from .manager import Plugins, make_plugins
from .registry import UnknownComponentError

logger = logging.getLogger("plait")

# `dataset: prefs.jsonl` is short for {path: json, data_files: prefs.jsonl}
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                      ".arrow": "arrow"}
LAUNCH_FLAGS = ("num_processes", "accelerate_config")


def _recipe_fields() -> dict[str, attrs.Attribute]:
    return {a.name: a for a in attrs.fields(attrs.resolve_types(RunConfig))}


# ---------------------------------------------------------------------------------------------
# Command-line values
# ---------------------------------------------------------------------------------------------


def parse_overrides(extra: list[str]) -> dict[str, list[str]]:
    """``--beta 0.2 --loss_type sigmoid sft --bf16`` → {"beta": ["0.2"], "loss_type": ["sigmoid", "sft"], "bf16": []}.

    Raw tokens per flag (``--field=value`` works too); :func:`override_values` types them.
    """
    overrides: dict[str, list[str]] = {}
    key = None
    for token in extra:
        if token.startswith("--") and len(token) > 2:
            key, eq, value = token[2:].partition("=")
            overrides[key] = [value] if eq else []
        elif key is not None:
            overrides[key].append(token)
        else:
            raise PlaitError(f"unexpected argument {token!r}; config fields are given as --field value")
    return overrides


def _typed(tokens: list[str], annotation: Any = None) -> Any:
    """Tokens read as YAML (one token → a value, several → a list, none → True).

    When YAML's reading does not fit the field but the plain text does, the text wins:
    ``--save_strategy no`` is the string 'no' (YAML 1.1 would say False), ``--run_name 7`` is '7'.
    """
    if not tokens:
        return True

    def read(token: str) -> Any:
        try:
            return yaml_load(token)
        except yaml.YAMLError:
            return token

    values = [read(token) for token in tokens]
    value, raw = (values[0], tokens[0]) if len(tokens) == 1 else (values, list(tokens))
    if annotation is not None and not _fits(annotation, value) and _fits(annotation, raw):
        return raw
    return value


def _fits(annotation: Any, value: Any) -> bool:
    try:
        check_value("", annotation, value)
        return True
    except PlaitError:
        return False


def override_values(raw: Mapping[str, list[str]], config_cls: type, command: str) -> dict[str, Any]:
    """Type each flag by the field it names; an unknown field is an error listing close matches."""
    top = _recipe_fields()
    training = config_fields(config_cls)
    values: dict[str, Any] = {}
    for key, tokens in raw.items():
        head = key.split(".", 1)[0]
        if key.startswith("training."):
            key, head = key[len("training."):], key[len("training."):].split(".", 1)[0]
        if head == "method":
            raise PlaitError(f"--method: the method is the command ({command!r}); remove --method")
        if head in top and head != "training":
            values[key] = _typed(tokens, top[head].type if key == head else None)
        elif head in training:
            value = values[key] = _typed(tokens, training[head].type if key == head else None)
            if key == head:
                check_value(f"--{key}", training[head].type, value)
        else:
            known = [f for f in [*top, *training] if f not in ("method", "training")]
            match = difflib.get_close_matches(head, known, n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join('--' + m for m in match)}?" if match
                    else f"'{command} --help' lists the fields")
            raise PlaitError(f"--{key}: {command} has no field {head!r}; {hint}")
    return values


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------


def _read_recipe(path: Path) -> Any:
    if not path.is_file():
        raise PlaitError(f"--config {str(path)!r}: no such file; pass the path of a YAML recipe")
    try:
        return yaml_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise PlaitError(f"{path}:{where} is not valid YAML ({getattr(err, 'problem', err)}); fix the syntax") from err


def _local(path: Any, base: Path | None) -> Any:
    """A recipe's relative path, made relative to the recipe's folder (URLs and absolute paths kept)."""
    if not isinstance(path, str) or base is None or "://" in path or os.path.isabs(path):
        return path
    return str(base / path)


def _dataset(value: Any, base: Path | None) -> Any:
    if isinstance(value, str):  # shorthand: a data file, or a dataset name/folder for load_dataset
        builder = DATA_FILE_BUILDERS.get(Path(value).suffix.lower())
        value = {"path": builder, "data_files": value} if builder else {"path": value}
        if builder is None and base is not None and value["path"].startswith((".", "/")):
            value["path"] = _local(value["path"], base)
    if isinstance(value, Mapping) and base is not None:
        value = dict(value)
        files = value.get("data_files")
        if isinstance(files, Mapping):
            value["data_files"] = {k: [_local(f, base) for f in v] if isinstance(v, list) else _local(v, base)
                                   for k, v in files.items()}
        elif isinstance(files, list):
            value["data_files"] = [_local(f, base) for f in files]
        else:
            value["data_files"] = _local(files, base)
        if isinstance(value.get("path"), str) and value["path"].startswith(("./", "../")):
            value["path"] = _local(value["path"], base)
    return value


def _model(value: Any, base: Path | None) -> Any:
    if not isinstance(value, str):
        return value
    value = os.path.expanduser(value)
    return _local(value, base) if value.startswith(("./", "../")) else value


def _normalise(data: dict, base: Path | None) -> dict:
    for key in ("dataset", "eval_dataset"):
        if data.get(key) is not None:
            data[key] = _dataset(data[key], base)
    for key in ("model", "ref_model"):
        if key in data:
            data[key] = _model(data[key], base)
    return data


def _set(section: Any, dotted: str, value: Any, path: str) -> dict:
    if section is not None and not isinstance(section, Mapping):
        raise PlaitError(f"--{path}: {path.split('.')[0]} is not a mapping in the recipe; set it whole")
    section = dict(section or {})
    head, _, rest = dotted.partition(".")
    section[head] = _set(section.get(head), rest, value, path) if rest else value
    return section


def load_recipe(path: str | Path | None = None, overrides: Mapping[str, Any] = {}, *, method: str | None = None,
                source: str | None = None) -> RunConfig:
    """Read a recipe and apply ``overrides``: top-level fields by name (``model``, ``dataset``,
    ``reward_funcs``, dotted ``peft.r``), every other key into ``training``.

    ``method`` (the command's) fills in a recipe that names none and must match one that does.
    With no ``path`` the recipe is built from the overrides alone.
    """
    if path is not None:
        path = Path(path)
        data = _read_recipe(path)
        source = source or path.name
        if not isinstance(data, Mapping):
            return parse_run_config(data, source)  # the one-line "expected a mapping" error
        data = _normalise(dict(data), path.parent)
    else:
        data, source = {}, source or "command line"
    if method is not None:
        data.setdefault("method", method)
        if data["method"] != method:
            raise PlaitError(f"{source}: method is {data['method']!r} but the command is 'plait {method}'; "
                             f"run 'plait {data['method']}' or change method")
    top = _recipe_fields()
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in top and head not in ("training", "method"):
            data[head] = _set(data.get(head), rest, value, key) if rest else value
            if head in ("dataset", "eval_dataset", "model", "ref_model"):
                data[head] = _normalise({head: data[head]}, None)[head]
        elif isinstance(data.get("training") or {}, Mapping):  # else parse_run_config names the bad section
            data["training"] = _set(data.get("training"), key, value, key)
    return parse_run_config(data, source)


def method_args(config: RunConfig, plugins: Plugins):
    """The method record and its Config (``DPOConfig``...) built from the recipe; loads nothing."""
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
    return method, build_method_config(method.config, values)


def plugins_for(config: RunConfig, plugins: Plugins | None = None) -> Plugins:
    """``plugins`` when given and the recipe asks for the default set, else the recipe's set."""
    spec = config.plugins
    if plugins is not None and spec == PluginsSpec():
        return plugins
    return make_plugins(disable=spec.disable, autoload=spec.autoload, on_import_error=spec.on_import_error)


def check_recipe(config: RunConfig, plugins: Plugins | None = None):
    """Everything that can be checked without loading a model: the method's Config (names, types,
    ranges), the trainer's own ``validate`` (component names, combinations), ``ref_model`` and
    ``peft`` sections, and that local data files exist. Returns the Config."""
    plugins = plugins_for(config, plugins)
    method, args = method_args(config, plugins)
    try:
        trainer = method.trainer.__new__(method.trainer)  # validate() runs before anything loads, by contract
        trainer.plugins = plugins
        trainer.validate(args)
    except UnknownComponentError as err:
        raise PlaitError(f"{err}; if it comes from a plugin package, install it (pip install <package>) "
                         "and check 'plait plugins'") from err
    except AttributeError as err:
        if err.obj is not trainer:
            raise
        # a method plugin's bug, not the recipe's: say which contract it breaks and whose it is
        source = plugins.methods.get(config.method, family="method")
        raise PlaitError(f"method {config.method!r} from plugin {source.plugin} ({source.distribution} {source.version}): "
                         f"{method.trainer.__name__}.validate() reads self.{err.name}, which only __init__ sets; "
                         "validate() must work before __init__ runs (plait --check); report this to its authors") from err
    if config.ref_model is not None and "ref_model" not in _init_parameters(method.trainer):
        raise PlaitError(f"ref_model: method {config.method!r} uses no reference model; remove ref_model")
    if config.peft is not None:
        _lora_config(config.peft)
    for field in ("dataset", "eval_dataset"):
        spec = getattr(config, field)
        if spec is None:
            continue
        files = spec.data_files
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])] if isinstance(files, dict) \
            else files if isinstance(files, list) else [files]
        for file in files:
            if isinstance(file, str) and "://" not in file and not any(c in file for c in "*?[") \
                    and not os.path.exists(file):
                raise PlaitError(f"{field}.data_files: {file!r} does not exist; fix the path (a recipe's paths are "
                                 "relative to the recipe file)")
    return args


def _init_parameters(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)


def _lora_config(peft: dict):
    from peft import LoraConfig

    try:
        return LoraConfig(**peft)
    except (TypeError, ValueError) as err:
        raise PlaitError(f"peft: {' '.join(str(err).split())}; see peft.LoraConfig for the accepted fields") from err


def build_trainer(config: RunConfig, plugins: Plugins | None = None):
    """Resolve every name in ``config`` and construct the method's trainer (loads the model)."""
    plugins = plugins_for(config, plugins)
    method, args = method_args(config, plugins)
    kwargs: dict[str, Any] = {"plugins": plugins}
    if config.ref_model is not None:
        if "ref_model" not in _init_parameters(method.trainer):
            raise PlaitError(f"ref_model: method {config.method!r} uses no reference model; remove ref_model")
        kwargs["ref_model"] = config.ref_model
    if config.peft is not None:
        kwargs["peft_config"] = _lora_config(config.peft)

    import datasets

    def load(spec):
        return datasets.load_dataset(spec.path, spec.name, data_files=spec.data_files, split=spec.split)

    train = load(config.dataset)
    evaluation = load(config.eval_dataset) if config.eval_dataset else None
    return method.trainer(model=config.model, args=args, train_dataset=train, eval_dataset=evaluation, **kwargs)


def run(config: RunConfig, plugins: Plugins | None = None):
    """Train as the recipe says and save the final model (with ``plait_run.json``) to ``output_dir``."""
    trainer = build_trainer(config, plugins)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.args.should_save:
        print(f"plait: saved the {config.method} model to {trainer.args.output_dir}")
    return trainer


# ---------------------------------------------------------------------------------------------
# The subcommand
# ---------------------------------------------------------------------------------------------


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    value = getattr(value, "value", value)  # enums print as their YAML spelling
    return "null" if value is None else str(value)


def _rows(rows: list[tuple[str, str]]) -> str:
    width = max((len(name) for name, _ in rows), default=0) + 2
    return "\n".join(f"  {name.ljust(width)}{text}".rstrip() for name, text in rows)


def fields_help(name: str, method) -> str:
    """The ``plait <method> --help`` epilog: every field the command accepts, with its default."""
    fields = config_fields(method.config)
    own = {a.name for a in attrs.fields(method.config.params_class)} if hasattr(method.config, "params_class") else set(fields)
    own |= {f for f in fields if f not in config_fields(_training_arguments())}
    top = [("--model PATH", "policy: a local folder or hub id (required)"),
           ("--dataset FILE|SPEC", "training data: a .jsonl/.json/.csv/.parquet file, a dataset name, "
                                   "or --dataset.FIELD (path, name, data_files, split) (required)"),
           ("--eval_dataset FILE|SPEC", "evaluation data, same forms"),
           ("--ref_model PATH", "reference policy (methods with a reference; default: a frozen copy)"),
           ("--peft.FIELD VALUE", "LoRA adapters: peft.LoraConfig fields, e.g. --peft.r 16 --peft.target_modules all-linear"),
           ("--model_init_kwargs.FIELD VALUE", "from_pretrained keyword arguments, e.g. --model_init_kwargs.dtype bfloat16")]
    if "loss" in fields:
        top.append(("--loss NAME ...", "losses by registry name (or a YAML list of {name, weight, ...})"))
    if "reward_funcs" in fields:
        top.append(("--reward_funcs NAME ...",
                    "reward functions: registry names, import paths pkg.module:func, or reward-model folders"))
    config_name = method.config.__name__
    parts = [
        "recipe fields (top level of the YAML):\n" + _rows(top),
        f"{config_name} fields (the recipe's training: section; --FIELD VALUE overrides, several values make a list):\n"
        + _rows([(f"--{f}", _default(fields[f])) for f in fields if f in own]),
        "transformers.TrainingArguments fields (also in training:):\n"
        + _rows([(f"--{f}", _default(fields[f])) for f in fields if f not in own]),
        "launching: --num_processes N runs N data-parallel processes (CPU: torch.distributed with gloo);\n"
        "--accelerate_config NAME|PATH picks a preset (cpu_ddp, multi_gpu, fsdp, zero1, zero2, zero3) or a file.",
    ]
    return "\n\n".join(parts)


def _training_arguments():
    from transformers import TrainingArguments

    return TrainingArguments


def add_method_arguments(parser: argparse.ArgumentParser, name: str, method=None) -> None:
    """The flags of ``plait <name>`` (``method``: the method's record, whose fields --help lists)."""
    parser.add_argument("--config", help="YAML recipe (see examples/recipes/); optional when --model and "
                                         "--dataset are given")
    parser.add_argument("--num_processes", type=int, metavar="N",
                        help="train on N processes (data parallel), relaunching this command")
    parser.add_argument("--accelerate_config", metavar="NAME|PATH",
                        help="launch preset (cpu_ddp, multi_gpu, fsdp, zero1, zero2, zero3) or an accelerate config file")
    parser.add_argument("--check", action="store_true",
                        help="check the recipe (names, types, ranges, data files) and exit without training")
    parser.usage = f"plait {name} [--config RECIPE] [--FIELD VALUE ...] [--num_processes N] [--accelerate_config NAME|PATH]"
    if method is not None:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = fields_help(name, method)


def run_method(name: str, method, args: argparse.Namespace, plugins: Plugins) -> int:
    """``plait <name> [--config ...] [--FIELD VALUE ...]``: check, then train (or relaunch on N processes)."""
    record = method or plugins.methods.get(name, family="method").obj
    overrides = override_values(parse_overrides(args.extra), record.config, f"plait {name}")
    if args.config is None and not {"model", "dataset"} <= {k.split(".")[0] for k in overrides}:
        raise PlaitError(f"plait {name}: no --config given; pass --config recipe.yaml, or --model PATH and --dataset FILE")
    config = load_recipe(args.config, overrides, method=name)
    # once, here: before a model loads and before N copies start
    preflight.check_inputs(config, check_recipe(config, plugins))
    if args.check:
        print(f"plait: {args.config or 'the command line'} is a valid {name} recipe")
        return 0
    from .launch import launch, inside_launched_process

    if (args.num_processes not in (None, 1) or args.accelerate_config) and not inside_launched_process():
        command = [name, *(["--config", str(Path(args.config).resolve())] if args.config else []), *args.extra]
        return launch(command, args.num_processes, args.accelerate_config)
    run(config, plugins)
    return 0
