"""The argument classes of TRL's training scripts, for scripts written against ``trl``.

A script that does ``from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config``
runs on plait with ``from plait import ...`` instead: the same dataclasses, field names and
defaults as TRL 1.16, and a :class:`PlaitParser` (alias ``TrlParser``) whose
``parse_args_and_config()`` reads ``--config recipe.yaml`` (flat keys, an ``env:`` mapping) and
then the command line, which wins.

The ``plait <method>`` command reads the same keys (``--model_name_or_path``, ``--use_peft``,
``--lora_r``, ``datasets:`` ...); :func:`plait.recipes.run.trl_sections` turns them into a recipe's
sections with the helpers here (:meth:`ModelConfig.lora_kwargs`, :func:`quantization_kwargs`,
:func:`load_mixture`), so a script and the command build the same LoRA and the same data.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

import yaml

from plait.errors import PlaitError


@dataclass
class ScriptArguments:
    """Which dataset a script trains on (TRL's ``ScriptArguments``). ``dataset_name`` is anything
    ``datasets.load_dataset`` resolves: a hub name, a local folder or a data file."""

    dataset_name: str | None = field(default=None, metadata={"help": "dataset to load: a hub name, a folder or a "
                                                                      "data file; ignored when datasets is given"})
    dataset_config: str | None = field(default=None, metadata={"help": "the dataset's configuration name "
                                                                        "(load_dataset's name)"})
    dataset_train_split: str = field(default="train", metadata={"help": "split to train on"})
    dataset_test_split: str = field(default="test", metadata={"help": "split to evaluate on (when eval_strategy "
                                                                      "is not 'no')"})
    dataset_streaming: bool = field(default=False, metadata={"help": "stream the dataset instead of downloading it "
                                                                     "(plait's commands refuse it: they prepare data whole)"})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": "DDP workaround for models with boolean "
                                                                       "bias buffers"})


@dataclass
class DatasetConfig:
    """One dataset of a mixture: ``datasets.load_dataset``'s arguments, plus ``columns`` to keep
    and ``fraction``, the dataset's share of the mixture."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """Several datasets trained on as one (``datasets:`` in a recipe), concatenated in order."""

    datasets: list[DatasetConfig] = field(default_factory=list, metadata={"help": "the datasets of the mixture"})
    streaming: bool = field(default=False, metadata={"help": "stream every dataset of the mixture"})
    test_split_size: float | None = field(default=None, metadata={"help": "hold out this share (or row count) "
                                                                          "of the mixture for evaluation"})

    def __post_init__(self):
        self.datasets = [DatasetConfig(**d) if isinstance(d, dict) else d for d in self.datasets]


@dataclass
class ModelConfig:
    """The model a script loads and how: revision, dtype, attention, LoRA adapters, 4/8-bit
    quantization (TRL's ``ModelConfig``, same fields and defaults)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "model to train: a hub id or a folder"})
    model_revision: str = field(default="main", metadata={"help": "branch, tag or commit of the model"})
    dtype: str | None = field(default="float32", metadata={"help": "dtype to load the weights in ('auto', "
                                                                   "'bfloat16', 'float16', 'float32')"})
    attn_implementation: str | None = field(default=None, metadata={"help": "attention kernel, e.g. sdpa"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters instead of all weights"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "modules to adapt "
                                                                                  "(e.g. all-linear)"})
    lora_target_parameters: list[str] | None = field(default=None, metadata={"help": "parameters to adapt"})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={"help": "modules trained in full "
                                                                                   "and saved"})
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "peft task type (SEQ_CLS for reward "
                                                                       "models)"})
    use_rslora: bool = field(default=False, metadata={"help": "rank-stabilized LoRA (alpha / sqrt(r))"})
    use_dora: bool = field(default=False, metadata={"help": "weight-decomposed LoRA (DoRA)"})
    load_in_8bit: bool = field(default=False, metadata={"help": "load the base model in 8 bits (bitsandbytes)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "load the base model in 4 bits (bitsandbytes)"})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit type: nf4 or fp4"})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "quantize the quantization constants"})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "dtype 4-bit weights are stored in"})

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise PlaitError("load_in_8bit and load_in_4bit are both true; keep one")
        if isinstance(self.lora_target_modules, (list, tuple)) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]  # 'all-linear' is peft's keyword, not a module

    def lora_kwargs(self) -> dict[str, Any]:
        """``peft.LoraConfig``'s arguments: a recipe's ``peft:`` section."""
        kwargs = {peft_name: getattr(self, name) for name, peft_name in LORA_FIELDS.items()}
        if self.lora_target_parameters is None:  # older peft has no such argument
            del kwargs["target_parameters"]
        return {**kwargs, "bias": "none"}


# ModelConfig's fields and the peft.LoraConfig / from_pretrained arguments they become
LORA_FIELDS = {"lora_task_type": "task_type", "lora_r": "r", "lora_target_modules": "target_modules",
               "lora_target_parameters": "target_parameters", "lora_alpha": "lora_alpha",
               "lora_dropout": "lora_dropout", "use_rslora": "use_rslora", "use_dora": "use_dora",
               "lora_modules_to_save": "modules_to_save"}
INIT_FIELDS = {"model_revision": "revision", "dtype": "dtype", "attn_implementation": "attn_implementation"}
QUANTIZATION_FIELDS = ("load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                       "bnb_4bit_quant_storage")


def quantization_kwargs(model_args: ModelConfig) -> dict[str, Any] | None:
    """``BitsAndBytesConfig``'s arguments for ``load_in_4bit``/``load_in_8bit``, else None."""
    if model_args.load_in_4bit:
        return {"load_in_4bit": True, "bnb_4bit_compute_dtype": model_args.dtype,  # compute in the weights' dtype
                "bnb_4bit_quant_type": model_args.bnb_4bit_quant_type,
                "bnb_4bit_use_double_quant": model_args.use_bnb_nested_quant,
                "bnb_4bit_quant_storage": model_args.bnb_4bit_quant_storage}
    if model_args.load_in_8bit:
        return {"load_in_8bit": True}
    return None


def get_quantization_config(model_args: ModelConfig):
    """A ``transformers.BitsAndBytesConfig`` for a 4- or 8-bit base model, or None."""
    kwargs = quantization_kwargs(model_args)
    if kwargs is None:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**kwargs)


def get_peft_config(model_args: ModelConfig):
    """A ``peft.LoraConfig`` when ``use_peft``, else None."""
    if not model_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise PlaitError("use_peft: the peft package is not installed; pip install peft") from err
    return LoraConfig(**model_args.lora_kwargs())


def get_kbit_device_map() -> dict[str, int] | None:
    """Where a quantized model goes: whole on this process's GPU (``{"": local index}``), or None
    without CUDA (bitsandbytes needs one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def load_mixture(datasets: list, streaming: bool = False, test_split_size: float | None = None):
    """Load each dataset (``DatasetConfig``-like: attributes path, name, data_dir, data_files, split,
    columns, fraction), keep its ``columns``, and concatenate them into a ``DatasetDict`` with
    ``train`` (and ``test`` when ``test_split_size`` is given).

    With ``fraction`` on every dataset the shares are normalised to sum to 1 and the mixture is as
    large as it can be without repeating rows: N = min_i(rows_i / share_i), and dataset i gives its
    first round(share_i · N) rows. Without fractions every row of every dataset is kept.
    """
    import datasets as hf

    if not datasets:
        raise PlaitError("datasets: the mixture is empty; list at least one {path: ...}")
    fractions = [d.fraction for d in datasets]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise PlaitError(f"datasets: fraction is set on some datasets and not others ({fractions}); "
                             "set it on all or none")
        if streaming:
            raise PlaitError("datasets: fraction needs row counts, which a streamed dataset has not; "
                             "remove fraction or streaming")
        if any(f < 0 for f in fractions) or sum(fractions) <= 0:
            raise PlaitError(f"datasets: fractions {fractions} must be >= 0 and not all 0; fix them")
    loaded = []
    for d in datasets:
        part = hf.load_dataset(d.path, d.name, data_dir=d.data_dir, data_files=d.data_files, split=d.split,
                               streaming=streaming)
        loaded.append(part.select_columns(d.columns) if d.columns is not None else part)
    if fractions[0] is not None:
        shares = [f / sum(fractions) for f in fractions]
        size = min(len(part) / share for part, share in zip(loaded, shares) if share > 0)
        loaded = [part.select(range(round(share * size))) for part, share in zip(loaded, shares)]
    combined = hf.concatenate_datasets(loaded)
    if streaming:  # read lazily as training asks for rows
        if test_split_size is not None:
            raise PlaitError(f"test_split_size={test_split_size} splits rows a stream has not read yet; give a test "
                             "split of its own (dataset_test_split), or remove streaming")
        return hf.IterableDatasetDict({"train": combined})
    if test_split_size is not None:
        return combined.train_test_split(test_size=test_split_size)
    return hf.DatasetDict({"train": combined})


def get_dataset(mixture: DatasetMixtureConfig):
    """The mixture as a ``DatasetDict`` (``train``, and ``test`` with ``test_split_size``)."""
    return load_mixture(mixture.datasets, mixture.streaming, mixture.test_split_size)


def _parser_base():
    from transformers import HfArgumentParser

    return HfArgumentParser


class PlaitParser(_parser_base()):
    """``transformers.HfArgumentParser`` that also reads ``--config recipe.yaml``.

    The YAML's keys become the dataclasses' defaults and the command line overrides them; an
    ``env:`` mapping in the YAML is put into ``os.environ`` first. ``config`` is reserved for the
    file's path, so no dataclass may have a field of that name.
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        for cls in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(cls)}:
                raise PlaitError(f"{cls.__name__} has a field named 'config', which PlaitParser keeps for the "
                                 "--config file; rename the field")
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field):
        """HfArgumentParser's flag for ``field``; for a type it cannot read (``str | bool | None``,
        ``int | str | None``, ``Any`` ... as plait's Configs have), a flag whose text is read as YAML, as
        ``plait <method>`` reads it (``--resume_from_checkpoint latest``, ``--scale_rewards false``)."""
        if field.type is not Any:  # Any would be called on the text
            try:  # on a copy: HfArgumentParser narrows field.type in place, which would change the Config class
                return _parser_base()._parse_dataclass_field(parser, copy.copy(field))
            except (ValueError, TypeError, AttributeError):  # its type readers fail before the flag is added
                if f"--{field.name}" in parser._option_string_actions:
                    raise
        from plait.engine.config import yaml_load

        names = [f"--{field.name}", *([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        parser.add_argument(*names, type=yaml_load, nargs="+", action=_OneOrMany, default=default,
                            help=field.metadata.get("help"))

    def parse_args_and_config(self, args: Iterable[str] | None = None, return_remaining_strings: bool = False,
                              fail_with_unknown_args: bool = True, separate_remaining_strings: bool = False):
        """The dataclasses from ``--config`` and the command line (``sys.argv`` by default).

        With ``return_remaining_strings`` the unknown keys come last (the file's and the command
        line's in one list, or as two lists with ``separate_remaining_strings``); otherwise an
        unknown key in the file is an error unless ``fail_with_unknown_args=False``.
        """
        args = list(sys.argv[1:] if args is None else args)
        from_file: list[str] = []
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise PlaitError("--config: give the path of a YAML file")
            path = args[at + 1]
            del args[at:at + 2]
            from_file = self.set_defaults_with_config(**read_flat_yaml(path))
        output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            *parsed, from_command_line = output
            if separate_remaining_strings:
                return (*parsed, from_file, from_command_line)
            return (*parsed, from_file + from_command_line)
        if fail_with_unknown_args and from_file:
            raise PlaitError(f"--config: keys no dataclass has: {from_file[::2]}; remove them or pass "
                             "fail_with_unknown_args=False")
        return output

    def set_defaults_with_config(self, **values) -> list[str]:
        """Make ``values`` the defaults of the arguments they name (subcommands included; a required
        argument given here is required no more); returns the rest as ``--key value`` strings."""
        used: set[str] = set()

        def apply(parser: argparse.ArgumentParser) -> None:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub in action.choices.values():
                        apply(sub)
                elif action.dest in values:
                    action.default, action.required = values[action.dest], False
                    used.add(action.dest)

        apply(self)
        return [token for key, value in values.items() if key not in used for token in (f"--{key}", str(value))]


TrlParser = PlaitParser


class _OneOrMany(argparse.Action):
    """``--field a`` gives a, ``--field a b`` gives [a, b] (as ``plait <method>`` reads flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def read_flat_yaml(path: str) -> dict[str, Any]:
    """A flat YAML file's keys, with its ``env:`` mapping moved into ``os.environ``."""
    from plait.engine.config import yaml_load

    try:
        with open(path) as handle:
            data = yaml_load(handle.read())
    except OSError as err:
        raise PlaitError(f"--config {path!r}: cannot be read ({err.strerror}); fix the path") from err
    except yaml.YAMLError as err:
        raise PlaitError(f"--config {path!r} is not valid YAML ({getattr(err, 'problem', err)}); fix the syntax") from err
    if not isinstance(data, dict):
        raise PlaitError(f"--config {path!r}: expected a YAML mapping of field: value, got {type(data).__name__}")
    set_env(data.pop("env", None), path)
    return data


def set_env(env: Any, source: str) -> None:
    """A recipe's ``env:`` mapping into ``os.environ`` (values as strings)."""
    if env is None:
        return
    if not isinstance(env, dict):
        raise PlaitError(f"{source}: env must be a mapping of VARIABLE: value, got a {type(env).__name__}")
    os.environ.update({str(key): str(value) for key, value in env.items()})
