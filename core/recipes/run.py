"""Run a YAML recipe: ``plait <method> --config recipe.yaml [--field value ...]``.

Every registered method gets this subcommand. The recipe names the method and its components
by registry name; flags mirror its fields (``--model``, ``--dataset``, ``--reward_funcs`` for
the top level, ``--beta``/``--learning_rate``/... for the ``training:`` section, dotted
``--peft.r 16`` into a section), and command-line values win over the YAML. Everything is
checked (names, types, ranges, plugin availability, data files) before a model is loaded and
before ``--num_processes N`` starts N copies of the same command (see :mod:`plait.recipes.launch`).

Paths inside a recipe are relative to the recipe file (``data_files: ../data/prefs.jsonl``);
paths on the command line are relative to the working directory; ``~`` is expanded in model
paths.

TRL's commands run unchanged: its script flags (``--model_name_or_path``, ``--dataset_name``,
``--use_peft --lora_r 8``, ``--dtype`` ... see :mod:`plait.trl.script_args`) are accepted next to
plait's, and a TRL recipe, every key at the top level (``datasets:`` mixtures, ``env:``,
``accelerate_config:`` included), is read as well as plait's sectioned one. Its paths, as in TRL,
are relative to the working directory. :func:`trl_sections` is the one place TRL's keys become
a recipe's sections.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import yaml

from plait.data import preflight
from plait.data.pretrained import remote_code
from plait.data.tokenizer import load_tokenizer
from plait.engine import run_folder
from plait.engine.config import (
    PluginsSpec,
    RunConfig,
    build_method_config,
    check_value,
    config_fields,
    parse_run_config,
    yaml_load,
)
from plait.engine.model_card import TRAINING_FIELDS
from plait.errors import PlaitError
from plait.manager import Plugins, make_plugins
from plait.registry import UnknownComponentError
from plait.trl.script_args import set_env

from .launch import MACHINE_SETTINGS, presets

logger = logging.getLogger("plait")

# `dataset: prefs.jsonl` is short for {path: json, data_files: prefs.jsonl}
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                      ".arrow": "arrow"}
LAUNCH_FLAGS = ("num_processes", "accelerate_config", *MACHINE_SETTINGS)
# top-level keys only plait's sectioned recipe has; a TRL recipe has its settings at the top
SECTIONED = ("method", "model", "dataset", "eval_dataset", "training", "ref_model", "peft", "loss", "plugins",
             "test_split_size")


def _recipe_fields() -> dict[str, attrs.Attribute]:
    return {a.name: a for a in attrs.fields(attrs.resolve_types(RunConfig))}


def trl_fields() -> dict[str, Any]:
    """TRL's script keys (ScriptArguments, ModelConfig, DatasetMixtureConfig, and GRPO/RLOO's
    reward_model_name_or_path) with their types."""
    from plait.trl import script_args

    hints: dict[str, Any] = {"reward_model_name_or_path": str | None}
    for cls in (script_args.ScriptArguments, script_args.ModelConfig, script_args.DatasetMixtureConfig):
        hints.update(typing.get_type_hints(cls))
    return hints


def trl_sections(given: Mapping[str, Any], data: dict, training: Mapping[str, Any]) -> dict:
    """TRL's script keys (``given``: only those the user set) into the recipe ``data``'s sections.

    model_name_or_path → model; dataset_name/_config/_train_split/_streaming → dataset (a file or
    folder is a local dataset); dataset_test_split → eval_dataset when ``training`` evaluates;
    datasets/streaming/test_split_size → a dataset mixture; model_revision/dtype/attn_implementation
    and load_in_4bit/8bit → model_init_kwargs; use_peft and lora_* → peft (LoRA fields over TRL's
    defaults over the recipe's own peft section); reward_model_name_or_path → one more reward_funcs.
    As in TRL, lora_* without use_peft (and without a peft section) change nothing.
    """
    from plait.trl.script_args import (
        INIT_FIELDS,
        LORA_FIELDS,
        QUANTIZATION_FIELDS,
        DatasetMixtureConfig,
        ModelConfig,
        ScriptArguments,
        quantization_kwargs,
    )

    def of(cls) -> dict:
        return {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(cls)}}

    try:
        model, script, mixture = ModelConfig(**of(ModelConfig)), ScriptArguments(**of(ScriptArguments)), \
            DatasetMixtureConfig(**of(DatasetMixtureConfig))
    except TypeError as err:  # a datasets: entry with a key DatasetConfig has not
        raise PlaitError(f"datasets: {err}; each entry takes path, name, data_dir, data_files, split, columns, "
                         "fraction") from err
    if "model_name_or_path" in given:
        data["model"] = _model(model.model_name_or_path, None)
    init = {INIT_FIELDS[k]: given[k] for k in INIT_FIELDS if k in given}
    if any(given.get(k) for k in QUANTIZATION_FIELDS) and quantization_kwargs(model):
        init["quantization_config"] = {"quant_method": "bitsandbytes", **quantization_kwargs(model)}
    if init:
        data["model_init_kwargs"] = {**(data.get("model_init_kwargs") or {}), **init}
    lora = {LORA_FIELDS[k]: getattr(model, k) for k in LORA_FIELDS if k in given}
    if model.use_peft:
        data["peft"] = {**model.lora_kwargs(), **(data.get("peft") or {}), **lora}
    elif "use_peft" in given:
        data.pop("peft", None)
    elif lora and data.get("peft") is not None:
        data["peft"] = {**data["peft"], **lora}
    elif lora:
        logger.warning("plait: %s set without use_peft: no LoRA adapters are trained (as in TRL); add --use_peft",
                       ", ".join(k for k in LORA_FIELDS if k in given))
    if mixture.datasets:
        data["dataset"] = [_dataset({**dataclasses.asdict(d), "streaming": mixture.streaming}, None)
                           for d in mixture.datasets]
    elif "dataset_name" in given:
        spec = _dataset(script.dataset_name, None)
        spec.update(split=script.dataset_train_split, streaming=script.dataset_streaming)
        if script.dataset_config is not None:
            spec["name"] = script.dataset_config
        data["dataset"] = spec
    elif isinstance(data.get("dataset"), Mapping):  # the recipe's dataset, with TRL's split flags
        data["dataset"] = {**data["dataset"], **{field: given[key] for key, field in
                                                 (("dataset_config", "name"), ("dataset_train_split", "split"),
                                                  ("dataset_streaming", "streaming")) if key in given}}
    if mixture.test_split_size is not None:
        data["test_split_size"] = mixture.test_split_size
    evaluates = training.get("eval_strategy", "no") not in ("no", None, False)
    if evaluates and isinstance(data.get("dataset"), Mapping) and data.get("test_split_size") is None \
            and data.get("eval_dataset") is None and ("dataset_name" in given or "dataset_test_split" in given):
        data["eval_dataset"] = {**data["dataset"], "split": script.dataset_test_split}
    if given.get("reward_model_name_or_path"):
        funcs = data.get("reward_funcs") or []  # TRL puts the reward model first
        data["reward_funcs"] = [given["reward_model_name_or_path"], *(funcs if isinstance(funcs, list) else [funcs])]
    return data


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
        elif Path(token).suffix.lower() in (".yaml", ".yml"):  # `plait dpo recipe.yaml`
            raise PlaitError(f"unexpected argument {token!r}; a recipe is given as --config {token}")
        else:
            raise PlaitError(f"unexpected argument {token!r}; config fields are given as --field value")
    return overrides


def _missing_value(key: str, annotation: Any) -> None:
    """``--beta`` followed by another flag or nothing: no value, which only a bool field may take (as true)."""
    if isinstance(annotation, str):  # a field declared under `from __future__ import annotations`
        try:
            annotation = eval(annotation, {"typing": typing, **vars(typing)})  # noqa: S307 - a declared type's text
        except Exception:  # noqa: BLE001 - a name of its own module: the field's check will judge the value
            return
    if annotation is not None and not _fits(annotation, True):
        what = getattr(annotation, "__name__", None) or str(annotation)
        raise PlaitError(f"--{key}: the value is missing; write --{key} VALUE ({what})")


def _underscored(key: str, known) -> str:
    """``--max-steps`` for ``--max_steps`` (and ``--training.max-steps``): a dashed flag names the field spelt
    with underscores, where no field is spelt with its dashes."""
    prefix = "training." if key.startswith("training.") else ""
    head, dot, rest = key[len(prefix):].partition(".")
    spelt = head.replace("-", "_")
    return f"{prefix}{spelt}{dot}{rest}" if "-" in head and head not in known and spelt in known else key


def _typed(tokens: list[str], annotation: Any = None) -> Any:
    """Tokens read as YAML (one token → a value, several → a list, none → True).

    When YAML's reading does not fit the field but the plain text does, the text wins:
    ``--save_strategy no`` is the string 'no' (YAML 1.1 would say False), ``--run_name 7`` is '7'.
    One token for a field that takes only a list is a list of one, as argparse's ``nargs="+"``
    gives: ``--rollout_filters zero_variance`` is ``[zero_variance]``.
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
    if annotation is None or _fits(annotation, value):
        return value
    readings = (raw, [value], [raw]) if len(tokens) == 1 else (raw,)
    return next((reading for reading in readings if _fits(annotation, reading)), value)


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
    trl = trl_fields()
    values: dict[str, Any] = {}
    for key, tokens in raw.items():
        key = _underscored(key, {*top, *training, *trl})
        head = key.split(".", 1)[0]
        if key.startswith("training."):
            key, head = key[len("training."):], key[len("training."):].split(".", 1)[0]
        if head == "method":
            raise PlaitError(f"--method: the method is the command ({command!r}); remove --method")
        annotation = top[head].type if head in top else training[head].type if head in training else trl.get(key)
        if not tokens and key == head:
            _missing_value(key, annotation)
        if head in top and head != "training":
            values[key] = _typed(tokens, top[head].type if key == head else None)
        elif head in training:
            value = values[key] = _typed(tokens, training[head].type if key == head else None)
            if key == head:
                check_value(f"--{key}", training[head].type, value)
        elif key in trl:
            value = _typed(tokens, trl[key])
            if typing.get_origin(trl[key]) in (typing.Union, types.UnionType) and list in map(typing.get_origin, typing.get_args(trl[key])) \
                    and isinstance(value, str):
                value = [value]  # --lora_target_modules all-linear: a list of one, as argparse's nargs="+" gives
            check_value(f"--{key}", trl[key], value)
            values[key] = value
        else:
            known = [f for f in [*top, *training, *trl] if f not in ("method", "training")]
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
    elif isinstance(value, Mapping) and value.get("data_files") is None and isinstance(value.get("path"), str) \
            and Path(value["path"]).suffix.lower() in DATA_FILE_BUILDERS:  # {path: prefs.jsonl}, as TRL's mixtures write it
        value = {**value, "path": DATA_FILE_BUILDERS[Path(value["path"]).suffix.lower()], "data_files": value["path"]}
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
        if isinstance(data.get(key), list):  # a mixture
            data[key] = [_dataset(item, base) for item in data[key]]
        elif data.get(key) is not None:
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


def _read_data(path: Path, source: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A recipe file's data in plait's sectioned shape, TRL's script keys for :func:`trl_sections`,
    and the launch settings (accelerate_config, num_processes, env) either shape may give at the top level."""
    data = _read_recipe(path)
    if not isinstance(data, Mapping):
        return data, {}, {}
    data = dict(data)
    launch = {key: data.pop(key) for key in (*LAUNCH_FLAGS, "env") if key in data}
    trl = trl_fields()
    sectioned = [key for key in data if key in SECTIONED]
    flat = [key for key in data if key not in _recipe_fields() and (key in trl or key in _training_fields())]
    if sectioned and flat:
        raise PlaitError(f"{source} mixes plait's sections ({', '.join(sectioned)}) with TRL's top-level keys "
                         f"({', '.join(flat[:4])}); write one shape: {flat[0]} under training: (or model:/dataset:/peft:), "
                         f"or TRL's flat keys without {sectioned[0]}:")
    if sectioned or not data:
        return _normalise(data, path.parent), {}, launch
    # TRL's shape: paths are relative to the working directory, as TRL reads them
    given = {key: data.pop(key) for key in list(data) if key in trl and key not in _recipe_fields()}
    shared = {key: data.pop(key) for key in list(data) if key in _recipe_fields()}
    return _normalise({**shared, "training": data}, None), given, launch


def _training_fields() -> set[str]:
    return set(config_fields(_training_arguments()))


def launch_settings(path: str | Path | None) -> dict[str, Any]:
    """A recipe's accelerate_config, num_processes, the machines' settings and env (plait's or TRL's shape)."""
    if path is None:
        return {}
    settings = _read_data(Path(path), Path(path).name)[2]
    kinds = {"num_processes": int, "accelerate_config": str, **MACHINE_SETTINGS}
    for key, kind in ((key, kinds[key] | None) for key in LAUNCH_FLAGS):
        check_value(f"{Path(path).name}: {key}", kind, settings.get(key))
    return settings


def load_recipe(path: str | Path | None = None, overrides: Mapping[str, Any] = {}, *, method: str | None = None,
                source: str | None = None) -> RunConfig:
    """Read a recipe (plait's sectioned shape or TRL's flat one) and apply ``overrides``: top-level
    fields by name (``model``, ``dataset``, ``reward_funcs``, dotted ``peft.r``), TRL's script
    keys (``model_name_or_path``, ``use_peft``, ``lora_r`` ...) through :func:`trl_sections`, every
    other key into ``training``.

    ``method`` (the command's) fills in a recipe that names none and must match one that does.
    With no ``path`` the recipe is built from the overrides alone.
    """
    if path is not None:
        path = Path(path)
        source = source or path.name
        data, given, _ = _read_data(path, source)
        if not isinstance(data, Mapping):
            return parse_run_config(data, source)  # the one-line "expected a mapping" error
    else:
        data, given, source = {}, {}, source or "command line"
    if method is not None:
        data.setdefault("method", method)
        if data["method"] != method:
            raise PlaitError(f"{source}: method is {data['method']!r} but the command is 'plait {method}'; "
                             f"run 'plait {data['method']}' or change method")
    top, trl = _recipe_fields(), trl_fields()
    # TRL's loss_type/loss_weights and plait's loss: section spell one choice: the command line's replaces the recipe's
    if overrides.keys() & {"loss_type", "loss_weights"}:
        data.pop("loss", None)
    if "loss" in overrides and isinstance(data.get("training"), Mapping):
        data["training"] = {k: v for k, v in data["training"].items() if k not in ("loss_type", "loss_weights")}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in top and head not in ("training", "method"):
            data[head] = _set(data.get(head), rest, value, key) if rest else value
            if head in ("dataset", "eval_dataset", "model", "ref_model"):
                data[head] = _normalise({head: data[head]}, None)[head]
        elif key in trl and key not in _training_fields():
            given[key] = value
        elif isinstance(data.get("training") or {}, Mapping):  # else parse_run_config names the bad section
            data["training"] = _set(data.get("training"), key, value, key)
    if given:
        data = trl_sections(given, data, data.get("training") or {})
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
    quantized = (config.model_init_kwargs or {}).get("quantization_config")
    if quantized is not None:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            which = "load_in_4bit" if quantized.get("load_in_4bit") else "load_in_8bit"
            raise PlaitError(f"{which}: quantized loading needs the bitsandbytes package and a CUDA GPU; "
                             f"pip install bitsandbytes, or remove {which}")
    if isinstance(config.dataset, list) and not config.dataset:
        raise PlaitError("datasets: the mixture is empty; list at least one {path: ...}")
    if config.test_split_size is not None and config.eval_dataset is not None:
        raise PlaitError("test_split_size: the evaluation data is already eval_dataset; remove one of them")
    for field, spec in dataset_specs(config):
        if spec.streaming and field != "eval_dataset" and args.max_steps <= 0:  # evaluation reads its set whole
            raise PlaitError(f"{field}.streaming: a stream has no length to count epochs by; set max_steps "
                             "(--max_steps N), or remove streaming (--dataset_streaming)")
        if spec.streaming and config.test_split_size is not None:
            raise PlaitError(f"{field}.streaming: test_split_size={config.test_split_size} splits rows a stream has "
                             "not read yet; give an eval_dataset (or --dataset_test_split) instead")
        files = spec.data_files
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])] if isinstance(files, dict) \
            else files if isinstance(files, list) else [files]
        for file in files:
            if isinstance(file, str) and "://" not in file and not any(c in file for c in "*?[") \
                    and not os.path.exists(file):
                raise PlaitError(f"{field}.data_files: {file!r} does not exist; fix the path (a recipe's paths are "
                                 "relative to the recipe file)")
    return args


def model_fields(args) -> dict[str, str]:
    """Model paths a method's Config names by convention (``teacher_model_name_or_path``,
    ``reward_model_path``, ...), beside the recipe's own ``model`` and ``ref_model``."""
    return {name: getattr(args, name) for name in config_fields(type(args))
            if name.endswith(("_model_name_or_path", "_model_path")) and isinstance(getattr(args, name), str)}


def check_inputs(config: RunConfig, args, plugins: Plugins | None = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
    """Every input of a recipe, in the order a run would meet them (:mod:`plait.data.preflight`); ``args``
    is its built Config. The models and the tokenizer resolve (no weights are read), each dataset loads
    and its first rows have a shape the method takes (the method's own ``prepare`` decides, as in the run),
    and ``output_dir`` can hold the run. ``say`` is told one line per input checked. Called by
    ``plait <method>`` (``--check`` included) after :func:`check_recipe`."""
    init_kwargs = config.model_init_kwargs or {}
    say(f"model {config.model}: {preflight.model_source(config.model, 'model', init_kwargs)}")
    # the tokenizer the run will use loads, with the Config's overrides (no weights are read)
    tokenizer = load_tokenizer(config.model, field="model", chat_template_path=args.chat_template_path,
                               eos_token=args.eos_token, pad_token=args.pad_token)
    say(f"tokenizer: {type(tokenizer).__name__}")
    if config.ref_model is not None:
        say(f"ref_model {config.ref_model}: {preflight.model_source(config.ref_model, 'ref_model', init_kwargs)}")
    for name, path in model_fields(args).items():
        say(f"{name} {path}: {preflight.model_source(path, f'training.{name}')}")
    plugins = plugins_for(config, plugins)
    method = plugins.methods.get(config.method, family="method").obj
    trainer = method.trainer.__new__(method.trainer)  # its prepare, without a model: see preflight.dataset_format
    trainer.plugins = plugins
    splits: dict[str, list] = {"train": [], "eval": []}  # (spec, its first rows) of each dataset the run loads
    for field, spec in dataset_specs(config):
        preflight.data_files(spec, field)
        head = preflight.dataset_head(spec, field)
        say(f"{field} {preflight.dataset_label(spec)}: {preflight.dataset_source(spec, field)}, "
            f"columns {', '.join(head.column_names)}")
        splits["eval" if field == "eval_dataset" else "train"].append((spec, head))
    for split, field in (("train", "dataset"), ("eval", "eval_dataset")):
        if splits[split]:
            rows = preflight.mixture_head([head for _, head in splits[split]], field)
            label = ", ".join(preflight.dataset_label(spec) for spec, _ in splits[split])
            decided = preflight.dataset_format(lambda head: trainer.prepare(head, tokenizer, args, split), rows,
                                               field, label)
            say(f"{field} rows for {config.method}: {decided}")
    run_folder.output_dir(args, config.method)
    say(f"output_dir {args.output_dir}: free for this run")


def check_launch(launching: dict[str, Any], say: Callable[[str], None]) -> bool:
    """Whether the command relaunches itself on several processes (or machines); if so, that the launch
    can start on this machine (the same check :func:`plait.recipes.launch.launch_command` makes).
    ``launching``: the :data:`LAUNCH_FLAGS` given."""
    from .launch import inside_launched_process, launch_plan

    several = launching.get("num_processes") not in (None, 1) or (launching.get("num_machines") or 1) > 1
    if not several and not launching.get("accelerate_config") or inside_launched_process():
        return False
    say(f"launch: {launch_plan(**launching).describe()}")
    return True


def dataset_specs(config: RunConfig) -> list[tuple[str, Any]]:
    """(field, DatasetSpec) for every dataset the recipe loads: each of a mixture, and eval_dataset."""
    mixture = config.dataset if isinstance(config.dataset, list) else [config.dataset]
    named = [(f"dataset[{i}]" if isinstance(config.dataset, list) else "dataset", spec) for i, spec in enumerate(mixture)]
    return named + ([("eval_dataset", config.eval_dataset)] if config.eval_dataset is not None else [])


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

    from plait.engine.model_card import dataset_label
    from plait.trl.script_args import load_mixture

    mixture = config.dataset if isinstance(config.dataset, list) else [config.dataset]
    splits = load_mixture(mixture, any(spec.streaming for spec in mixture), config.test_split_size)
    train, evaluation = splits["train"], splits.get("test")
    if config.eval_dataset is not None:
        evaluation = load_mixture([config.eval_dataset])["train"]  # evaluated whole, as plait evaluates any set
    trainer = method.trainer(model=config.model, args=args, train_dataset=train, eval_dataset=evaluation, **kwargs)
    trainer.card_datasets = tuple(dataset_label(spec) for field, spec in dataset_specs(config) if field != "eval_dataset")
    return trainer


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


HELP_ROWS = 8  # flags per group in the short `plait <method> --help`; --help-all lists every one
# TrainingArguments fields a run is most often given, first in their group (the short --help shows these): where
# it goes, how long and how fast it trains, how it logs and saves; then the rest the model card lists
COMMON_TRAINING = ("output_dir", "max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "logging_steps", "save_strategy", "report_to", "bf16")


def _first_sentence(text: str, limit: int = 110) -> str:
    """A field's help as one line: its first sentence, shortened to ``limit`` characters."""
    text = " ".join(str(text or "").split())
    match = re.search(r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<=[.!?])\s", text)  # "e.g. x" does not end a sentence
    text = (text[:match.start()] if match else text).rstrip(".")
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _described(field: dataclasses.Field, *origins: dataclasses.Field | None) -> str:
    """One line for a field: its help (its own ``metadata["help"]``, else the field it came from), and its default."""
    helps = [f.metadata.get("help") for f in (field, *origins) if f is not None and f.metadata]
    text = _first_sentence(next((h for h in helps if h), ""))
    return f"{text} (default: {_default(field)})" if text else f"default: {_default(field)}"


@attrs.frozen
class FlagGroup:
    """One group of ``plait <method> --help``: its title and (flag, description) rows, the common ones first."""

    title: str
    rows: tuple[tuple[str, str], ...]
    common: int  # how many of the first rows the short --help shows


def flag_groups(name: str, method) -> list[FlagGroup]:
    """The flags of ``plait <name>`` grouped by where each field comes from: the recipe's top level and TRL's
    script arguments (model, data), the method's own params class (method), the generation mixin and the
    fields generation backends contribute (generation), transformers' TrainingArguments and the chassis'
    fields (training), and the launch settings (launching). Each flag is listed once, in its first group."""
    from transformers import TrainingArguments

    from plait.engine.config import ModelLoading, contributed_fields
    from plait.online.generation import GenerationChoice, SamplingParams
    from plait.trl import script_args

    fields = config_fields(method.config)
    params = getattr(method.config, "params_class", None)
    params_fields = [a.name for a in attrs.fields(params)] if params is not None else []
    declared_here = set(getattr(params, "__annotations__", {})) if params is not None else set()
    generating = params is not None and issubclass(params, GenerationChoice)
    generation = ({a.name for a in attrs.fields(GenerationChoice)} | {a.name for a in attrs.fields(SamplingParams)}
                  if generating else set()) | (set(contributed_fields(params)) if params is not None else set())
    loading = [a.name for a in attrs.fields(ModelLoading)]
    trained = config_fields(TrainingArguments)

    def config_row(field: str) -> tuple[str, str]:
        return f"--{field}", _described(fields[field], trained.get(field))

    def trl_rows(*classes) -> list[tuple[str, str]]:
        return [(f"--{f.name}", _described(f)) for cls in classes for f in dataclasses.fields(cls)]

    model_top = [("--model PATH", "policy: a local folder or hub id (required)"),
                 ("--ref_model PATH", "reference policy (methods with a reference; default: a frozen copy)"),
                 ("--peft.FIELD VALUE", "LoRA adapters: peft.LoraConfig fields, e.g. --peft.r 16 --peft.target_modules "
                                        "all-linear"),
                 ("--model_init_kwargs.FIELD VALUE", "from_pretrained keyword arguments, e.g. "
                                                     "--model_init_kwargs.dtype bfloat16")]
    data_top = [("--dataset FILE|SPEC", "training data: a .jsonl/.json/.csv/.parquet file, a dataset name, or "
                                        "--dataset.FIELD (path, name, data_files, split) (required)"),
                ("--eval_dataset FILE|SPEC", "evaluation data, same forms"),
                ("--test_split_size FRACTION", "hold out this share of the training data for evaluation")]
    method_top = []
    if "loss" in fields:
        method_top.append(("--loss NAME ...", "losses by registry name (or a YAML list of {name, weight, ...})"))
    if "reward_funcs" in fields:
        method_top.append(("--reward_funcs NAME ...", "reward functions: registry names, import paths "
                                                      "pkg.module:func (from the working directory too), or "
                                                      "reward-model folders"))
    reward_model = [("--reward_model_name_or_path", "a reward model's folder or hub id, scored first (GRPO, RLOO)")] \
        if "reward_funcs" in fields else []
    sampling = [a.name for a in attrs.fields(SamplingParams)]
    generation_order = [f for f in sampling if f in generation] + [f for f in fields if f in generation
                                                                   and f not in sampling]
    method_fields = [f for f in params_fields if f in declared_here] + [f for f in params_fields if f not in declared_here]
    method_fields = [f for f in method_fields if f not in generation and f in fields]
    common_training = [f for f in (*COMMON_TRAINING, *TRAINING_FIELDS) if f in fields]
    chassis = [f for f in fields if f not in trained and f not in params_fields and f not in generation
               and f not in loading]
    groups = [
        ("model (the recipe's model:, ref_model:, peft:, model_init_kwargs:; TRL's model flags)",
         [*model_top, *trl_rows(script_args.ModelConfig), *reward_model,
          *(config_row(f) for f in loading if f in fields)], len(model_top) + 1),
        ("data (the recipe's dataset:, eval_dataset:; TRL's dataset flags)",
         [*data_top, *trl_rows(script_args.ScriptArguments, script_args.DatasetMixtureConfig)], len(data_top) + 1),
        (f"method ({method.config.__name__}'s own fields, in the recipe's training: section)",
         [*method_top, *(config_row(f) for f in method_fields)], HELP_ROWS),
        ("generation (how completions are sampled; also in training:)",
         [config_row(f) for f in generation_order if f in fields], HELP_ROWS),
        ("training (transformers.TrainingArguments and plait's run fields; also in training:)",
         [*(config_row(f) for f in common_training),
          *(config_row(f) for f in fields if f in trained and f not in common_training and f not in method_fields
            and f not in generation and f not in loading),
          *(config_row(f) for f in chassis)], len([f for f in COMMON_TRAINING if f in fields])),
        ("launching (also top-level keys of a recipe)",
         [("--num_processes N", "train on N data-parallel processes, relaunching this command (CPU: gloo)"),
          ("--accelerate_config NAME|PATH", f"a launch preset ({', '.join(presets())}) or an accelerate config file"),
          ("env: {VARIABLE: value}", "recipe key: environment variables set before the run starts"),
          ("--num_machines M", "run on M machines, this command on each (--num_processes then counts all machines')"),
          ("--machine_rank R", "this machine's rank, 0 to M-1 (0: the machine at --main_process_ip)"),
          ("--main_process_ip IP", "the address of machine 0, reachable from every machine"),
          ("--main_process_port P", "the port machine 0 listens on for the others (default 29500)")], 3),
    ]
    seen: set[str] = set()
    result = []
    for title, rows, common in groups:
        unique = []
        for flag, text in rows:
            key = flag.split()[0]
            if key not in seen:
                seen.add(key)
                unique.append((flag, text))
        if unique:
            result.append(FlagGroup(title, tuple(unique), common))
    return result


def fields_help(name: str, method, *, every: bool = False) -> str:
    """The ``plait <method> --help`` epilog: each group's common flags with a line each (``every``: all of them,
    as ``--help-all`` shows). Every field is also a key of the recipe."""
    parts = []
    for group in flag_groups(name, method):
        shown = group.rows if every else group.rows[:group.common]
        text = f"{group.title}:\n" + _rows(list(shown))
        if len(shown) < len(group.rows):
            text += f"\n  ... and {len(group.rows) - len(shown)} more: plait {name} --help-all"
        parts.append(text)
    note = ("--FIELD VALUE sets a field (several values make a list; --field-name is --field_name); "
            "the command line wins over the recipe")
    return "\n\n".join([*parts, note])


def _training_arguments():
    from transformers import TrainingArguments

    return TrainingArguments


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every flag of every group."""

    def __init__(self, option_strings, dest, name: str = "", method=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.command, self.method = name, method

    def __call__(self, parser, namespace, values, option_string=None):
        if self.method is not None:
            parser.epilog = fields_help(self.command, self.method, every=True)
        parser.print_help()
        parser.exit()


def add_method_arguments(parser: argparse.ArgumentParser, name: str, method=None) -> None:
    """The flags of ``plait <name>`` (``method``: the method's record, whose fields --help lists)."""
    parser.add_argument("--help-all", action=_HelpAll, name=name, method=method,
                        help="show every flag of every group, with its description and default, and exit")
    parser.add_argument("--config", help="YAML recipe, plait's (see examples/recipes/) or TRL's flat one; optional "
                                         "when --model_name_or_path (--model) and --dataset_name (--dataset) are given")
    # listed under "launching" below
    parser.add_argument("--num_processes", "--num-processes", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--accelerate_config", "--accelerate-config", metavar="NAME|PATH", help=argparse.SUPPRESS)
    for key, kind in MACHINE_SETTINGS.items():
        parser.add_argument(f"--{key}", f"--{key.replace('_', '-')}", type=kind, metavar=key.split("_")[-1].upper(),
                            help=argparse.SUPPRESS)
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
    given = {k.split(".")[0] for k in overrides}
    if args.config is None and not (given & {"model", "model_name_or_path"} and given & {"dataset", "dataset_name"}):
        raise PlaitError(f"plait {name}: no --config given; pass --config recipe.yaml, or --model PATH and --dataset FILE")
    settings = launch_settings(args.config)  # accelerate_config, num_processes, env: the command line wins
    set_env(settings.get("env"), args.config)
    launching = {key: getattr(args, key) if getattr(args, key) is not None else settings.get(key) for key in LAUNCH_FLAGS}
    config = load_recipe(args.config, overrides, method=name)
    # once, here: before a model loads and before N copies start (a model needing its own code is read with it)
    # what --check checked, one line each, on stderr: stdout holds the verdict alone
    say = (lambda line: print(f"plait: checked {line}", file=sys.stderr)) if args.check else (lambda line: None)
    with remote_code(config.training.get("trust_remote_code") is True):
        method_config = check_recipe(config, plugins)
        say(f"{name} recipe: component names, field types and ranges, {type(method_config).__name__}")
        check_inputs(config, method_config, plugins, say)
    relaunch = check_launch(launching, say)
    if args.check:
        print(f"plait: {args.config or 'the command line'} is a valid {name} recipe")
        return 0
    if relaunch:
        from .launch import launch

        command = [name, *(["--config", str(Path(args.config).resolve())] if args.config else []), *args.extra]
        return launch(command, **launching)
    run(config, plugins)  # a launched process leaves its group at exit (PlaitTrainer, leave_process_group_at_exit)
    return 0
