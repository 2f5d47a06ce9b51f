"""Configs: a method's Config class, and the YAML run config that names components by registry name.

A method writes its own knobs once, as an attrs class with validators. :func:`method_config`
composes them with transformers' ``TrainingArguments`` into the single dataclass TRL users
know (``DPOConfig(output_dir=..., beta=0.1, learning_rate=...)``), validated by attrs so every
bad value is one line naming the field, the value and the valid range.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Mapping

import attrs
import torch
import yaml
from transformers import TrainingArguments

from plait.data import versions
from plait.errors import PlaitError
from plait.params import non_negative, positive

from . import run_folder
from .checkpointing import checkpointing_kwargs
from .redact import masked
from .run_folder import config_fields, serialisable

logger = logging.getLogger("plait")


# ---------------------------------------------------------------------------------------------
# Method configs: TrainingArguments + the method's attrs parameters
# ---------------------------------------------------------------------------------------------


def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and why: its flags (/proc/cpuinfo, else torch's
    cpuinfo probes) name AVX-512 BF16 or AMX-BF16 and torch's kernels run at AVX-512 level.
    Without them bf16 is emulated through fp32 and autocast only adds casts."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
        units = [name for name in ("avx512_bf16", "amx_bf16") if name in flags]
    except (OSError, StopIteration):
        units = [name for name, probe in (("avx512_bf16", torch.cpu._is_avx512_bf16_supported),
                                          ("amx_bf16", torch.cpu._is_amx_tile_supported)) if probe()]
    capability = torch.backends.cpu.get_cpu_capability()
    if not units:
        return False, f"CPU without AVX-512 BF16 or AMX (torch kernels: {capability})"
    if not capability.startswith("AVX512"):
        return False, f"CPU has {'/'.join(units)} but torch's kernels run at {capability}"
    return True, f"CPU with {'/'.join(units)} (torch kernels: {capability})"


def trains_on_cpu(args: TrainingArguments) -> bool:
    """Whether the run trains on the CPU: told so, or no accelerator to train on."""
    return args.use_cpu or not torch.accelerator.is_available()


def method_args(config_class: type, args: TrainingArguments) -> TrainingArguments:
    """``args`` as ``config_class``: a plain ``TrainingArguments`` (or another subclass with no method params) keeps
    every value it was given, the method's own fields take their defaults, as TRL 1.16 converts it. A Config of
    another method is refused: its method's fields would be dropped unseen."""
    if isinstance(args, config_class):
        return args
    if not isinstance(args, TrainingArguments) or hasattr(args, "params"):
        raise PlaitError(f"args is a {type(args).__name__}; pass a {config_class.__name__} (or plain "
                         "transformers.TrainingArguments, converted to it)")
    given = config_fields(type(args))
    values = {name: getattr(args, name) for name in config_fields(config_class) if name in given}
    # TrainingArguments' remove_unused_columns=True would drop the columns plait's methods read (TRL's trainers keep
    # theirs by naming them as the model's signature): left at that default, the method's own default holds.
    if values.get("remove_unused_columns") == given["remove_unused_columns"].default:
        del values["remove_unused_columns"]
    return config_class(**values)


def _hardware_defaults(args: TrainingArguments) -> None:
    """Fields left as None are chosen from the hardware: bf16 autocast wherever the device
    computes bf16 natively (a bf16 GPU, a CPU with AVX-512 BF16 or AMX), fp32 otherwise.
    TRL's bf16=True default fails on a CPU (transformers wants use_cpu) and is slow without bf16 units."""
    on_cpu = trains_on_cpu(args)
    if args.bf16 is None:
        if args.fp16:
            args.bf16, reason = False, "fp16 asked for"
        elif on_cpu:
            args.bf16, reason = cpu_bf16_support()
        elif torch.cuda.is_available():
            args.bf16 = torch.cuda.is_bf16_supported()
            reason = f"CUDA {'with' if args.bf16 else 'without'} bf16 support"
        else:
            args.bf16, reason = False, f"{torch.accelerator.current_accelerator()} not known to compute bf16 natively"
        _log_precision_once(args.bf16, reason)
    if args.bf16 and on_cpu:  # transformers refuses bf16 without a GPU unless told the run is on the CPU
        args.use_cpu = True
        native, reason = cpu_bf16_support()
        if not native:
            _warn_emulated_once(reason)
    if args.fp16 is None:
        args.fp16 = False
    if args.dataloader_pin_memory is None:  # pinning needs an accelerator; on CPU it only warns
        args.dataloader_pin_memory = torch.cuda.is_available()


@functools.cache
def _log_precision_once(bf16: bool, reason: str) -> None:
    logger.info("plait: %s -> %s", reason, "bf16 autocast" if bf16 else "fp32")


@functools.cache
def _warn_emulated_once(reason: str) -> None:
    # measured (benchmarks/precision.py): DPO 5x slower in bf16 than fp32 on an AVX2-only CPU
    logger.warning("plait: bf16=True on a %s: bf16 is emulated there and runs slower than fp32; "
                   "leave bf16 unset to get fp32", reason)


NONFINITE_POLICIES = ("error", "skip")

#: Help of the checkpointing fields plait adds where this transformers' TrainingArguments lacks them (< 5.20).
CHECKPOINTING_HELP = {
    "activation_checkpointing": "recompute activations in backward instead of keeping them: less memory, slower "
                                "steps (null: on)",
    "activation_checkpointing_kwargs": "keyword arguments for torch's checkpoint (e.g. use_reentrant; "
                                       "null: non-reentrant)",
}


def _optional_text(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{attribute.name}={value!r} must be a non-empty string or None")


def _existing_path(instance, attribute, value) -> None:
    # a bare lower-case name (qwen3, template.qwen3) names a registered training chat template, checked when the
    # tokenizer loads
    template_name = re.fullmatch(r"[a-z0-9_.]+", value or "") and not value.endswith((".jinja", ".j2"))
    if value is not None and not Path(value).expanduser().exists() and not template_name:
        raise ValueError(f"{attribute.name}={value!r} does not exist; give a .jinja file, a tokenizer folder or the "
                         "name of a training chat template (plait list templates)")


@attrs.define
class ModelLoading:
    """How a run loads and prepares its models and tokenizer: fields every method's Config has,
    with TRL 1.16's names and meanings. :func:`method_config` adds them to every Config (a method
    changes a default through its ``defaults=``) and :class:`plait.engine.trainer.PlaitTrainer` applies them.

    * ``trust_remote_code``: run the code a model folder names in its ``auto_map``; passed to every
      ``from_pretrained`` of the run (policy, reference, teacher, value and reward models, tokenizers).
    * ``pad_token`` / ``eos_token``: replace the tokenizer's; the EOS is the completion terminator
      plait appends and generation stops on. Each must be a token of the vocabulary.
    * ``chat_template_path``: a Jinja file, or a tokenizer folder, whose chat template replaces the tokenizer's.
    * ``disable_dropout``: every dropout module of the policy and of the models beside it (reference,
      teacher, value model) gets p = 0.
    * ``router_aux_loss_coef``: weight of a Mixture-of-Experts model's load-balancing loss added to the
      training loss; None takes the model config's own coefficient, 0 turns it off.
    * ``activation_offloading``: keep the activations saved for backward in CPU memory (on an accelerator).
    * ``max_pixels`` (plait's): a vision-language model's pixel budget per image, given to its image
      processor where it has that option (Qwen2-VL's family resizes each image to at most this many
      pixels, so fewer image tokens); refused for a processor without it.
    """

    field_help: ClassVar[dict[str, str]] = {
        "trust_remote_code": "run the code a model folder names in its auto_map (every from_pretrained of the run)",
        "pad_token": "replace the tokenizer's padding token (a token of the vocabulary)",
        "eos_token": "replace the tokenizer's EOS: the completion terminator, where generation stops",
        "chat_template_path": "a Jinja file, tokenizer folder or training template (qwen3) replacing the tokenizer's template",
        "disable_dropout": "set every dropout of the policy and the models beside it to p=0",
        "router_aux_loss_coef": "weight of a Mixture-of-Experts load-balancing loss (null: the model's own; 0: off)",
        "activation_offloading": "keep activations saved for backward in CPU memory (on an accelerator)",
        "max_pixels": "a vision-language model's pixel budget per image (Qwen2-VL's family)",
    }
    trust_remote_code: bool = False
    pad_token: str | None = attrs.field(default=None, validator=_optional_text)
    eos_token: str | None = attrs.field(default=None, validator=_optional_text)
    chat_template_path: str | None = attrs.field(default=None, validator=[_optional_text, _existing_path])
    disable_dropout: bool = False
    router_aux_loss_coef: float | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative))
    activation_offloading: bool = False
    max_pixels: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))


def field_help(cls: type) -> dict[str, str]:
    """One-line descriptions of an attrs class's fields, for ``plait <method> --help``: its ``field_help``
    mapping (a class variable, so the field lines stay short), merged over its bases'."""
    merged: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        merged.update(vars(klass).get("field_help", {}))
    return merged


def _field_spec(default: Any, help: str | None = None) -> dataclasses.Field:
    metadata = {"help": help} if help else None
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return dataclasses.field(default_factory=default.factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def plugin_options(group: str) -> tuple[type, ...]:
    """The options classes plugins publish under the entry-point group ``group`` (sorted by entry name).

    A plugin's options must be fields of a method's Config before the registry exists: a Config class is
    built when its method plugin is imported, while the plugins load. So a plugin that owns config fields
    (a generation backend: ``generation.vllm_colocate`` owns ``vllm_gpu_memory_utilization`` ...) names its
    attrs options class in a second, data-only entry point, read here without loading the registry. One that
    fails to import is skipped with a warning: its fields are missing, and its plugin fails where it loads."""
    import importlib.metadata

    classes = []
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            classes.append(attrs.resolve_types(entry.load()))
        except Exception as err:  # noqa: BLE001 - one broken package must not take every Config with it
            logger.warning("plait: the %s entry point %r (%s) failed to load (%s); its config fields are missing",
                           group, entry.name, entry.value, err)
    return tuple(classes)


def contributed_fields(params: type) -> dict[str, tuple[attrs.Attribute, type]]:
    """Config fields contributed by plugins to a method whose ``params`` declare ``plugin_options_group``:
    ``config_prefix + option`` -> (the option's attrs attribute, its options class). Two classes may share a
    field only with one type and default."""
    fields: dict[str, tuple[attrs.Attribute, type]] = {}
    group = getattr(params, "plugin_options_group", None)
    for options in plugin_options(group) if group else ():
        prefix = getattr(options, "config_prefix", "")
        for attribute in attrs.fields(options):
            name = f"{prefix}{attribute.name}"
            if name in fields and (fields[name][0].type, fields[name][0].default) != (attribute.type, attribute.default):
                raise PlaitError(f"config field {name!r} is declared by {fields[name][1].__qualname__} and by "
                                 f"{options.__qualname__} with different types or defaults; rename one")
            fields.setdefault(name, (attribute, options))
    return fields


def method_config(name: str, params: type, *, doc: str = "", defaults: Mapping[str, Any] = {}, module: str | None = None) -> type:
    """Return the dataclass ``name``: every TrainingArguments field, ``defaults`` overriding its
    defaults, plus the fields of the attrs class ``params`` (validated in ``__post_init__``) and the
    fields plugins contribute to it (:func:`contributed_fields`, validated by their plugin when used).

    The instance's ``.params`` holds the validated attrs object the method's code reads.
    """
    helps = field_help(params)
    # the annotations as types, each read in its own class's module (a Config's own module may lack the names
    # its bases' annotations use, and transformers' HfArgumentParser reads them there)
    types_of = typing.get_type_hints(params)
    fields = [(a.name, types_of.get(a.name, a.type or Any), _field_spec(a.default, helps.get(a.name)))
              for a in attrs.fields(params)]
    own_params = {a.name for a in attrs.fields(params)}
    for field_name, (attribute, options) in contributed_fields(params).items():
        if field_name not in own_params:  # the method's own field wins
            fields.append((field_name, attribute.type or Any, _field_spec(defaults.get(field_name, attribute.default),
                                                                          field_help(options).get(attribute.name))))
    # How models and the tokenizer load (TRL's fields); a method's `defaults` may change a default.
    for attribute in attrs.fields(attrs.resolve_types(ModelLoading)):
        fields.append((attribute.name, attribute.type, _field_spec(defaults.get(attribute.name, attribute.default),
                                                                   field_help(ModelLoading).get(attribute.name))))
    # A chassis field every method shares: the plain (full-logits) log-prob path, for comparison.
    fields.append(("chunked_logprobs", bool, _field_spec(True, "log-probs through a chunked LM head, never the full "
                                                               "[batch, seq, vocab] logits (false: the plain path)")))
    # transformers 5 dropped this field; plait refuses an output_dir holding another run without it
    fields.append(("overwrite_output_dir", bool, _field_spec(False, "train into an output_dir holding another run")))
    # also true or "latest": the newest complete checkpoint in output_dir (plait.engine.run_folder)
    fields.append(("resume_from_checkpoint", str | bool | None, _field_spec(
        None, "a checkpoint folder to resume from, or true/'latest': the newest complete one in output_dir")))
    # What a NaN/inf loss or gradient norm does: stop the run naming the part ("error"), or drop
    # that optimizer step's update and go on ("skip"; the weights stay finite). See PlaitTrainer.
    fields.append(("on_nonfinite_loss", str, _field_spec("error", "a NaN/inf loss or gradient: 'error' stops the "
                                                                  "run, 'skip' drops that optimizer step")))
    # The checkpointing names plait re-declares (plait.data.versions) keep TrainingArguments' help where it has them
    inherited = config_fields(TrainingArguments)
    fields += [(n, annotation, dataclasses.field(default=d, metadata=inherited[n].metadata if n in inherited else
                                                 {"help": CHECKPOINTING_HELP[n]}))
               for n, annotation, d in versions.CONFIG_FIELDS]
    own = {f[0] for f in fields}
    for field_name, value in {"bf16": None, "fp16": None, "dataloader_pin_memory": None, **defaults}.items():
        if field_name not in own:
            factory = (lambda v=value: list(v)) if isinstance(value, list) else None
            metadata = inherited[field_name].metadata  # its help text
            spec = dataclasses.field(default_factory=factory, metadata=metadata) if factory else \
                dataclasses.field(default=value, metadata=metadata)
            annotation = inherited[field_name].type
            fields.append((field_name, annotation | None if value is None else annotation, spec))

    def __post_init__(self) -> None:
        _hardware_defaults(self)
        # On unless the user says otherwise, as in TRL: on SmolLM2 at 512 tokens it costs each method at most
        # 1.21x the step time for 0.53-0.66x the peak memory (benchmarks/gradient_checkpointing.py).
        versions.settle_checkpointing(self, default=True)
        if self.on_nonfinite_loss not in NONFINITE_POLICIES:
            raise PlaitError(f"{name}: on_nonfinite_loss={self.on_nonfinite_loss!r} is not valid; use 'error' (stop "
                             "the run) or 'skip' (skip that optimizer step)")
        values = {a.name: getattr(self, a.name) for a in attrs.fields(params)}
        try:
            ModelLoading(**{a.name: getattr(self, a.name) for a in attrs.fields(ModelLoading)})  # validates them
            self.params = params(**values)
        except (TypeError, ValueError) as err:
            raise PlaitError(f"{name}: {err}") from err
        run_folder.training_numbers(self)
        TrainingArguments.__post_init__(self)
        # read through the old name: TrainingArguments parsed a JSON string there on every version
        kwargs = self.gradient_checkpointing_kwargs
        # with checkpointing on, attention's output is kept through the recompute (plait.engine.checkpointing)
        versions.set_checkpointing_kwargs(self, checkpointing_kwargs(kwargs) if self.activation_checkpointing else kwargs)
        self.resume_from_checkpoint = run_folder.resume_checkpoint(self.resume_from_checkpoint, self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        # what report_to, to_json_string and to_sanitized_dict log: secrets as markers, nested ones too
        return masked({key: serialisable(value) for key, value in TrainingArguments.to_dict(self).items()})

    def __repr__(self) -> str:
        shown = masked({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr})
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    def __getstate__(self) -> dict[str, Any]:
        # training_args.bin (and any pickle or copy) holds no secret; a resumed run reads its tokens from its config
        return masked(self.__dict__)

    cls = dataclasses.make_dataclass(
        name, fields, bases=(TrainingArguments,),
        namespace={"__post_init__": __post_init__, "to_dict": to_dict, "__repr__": __repr__, "__str__": __repr__,
                   "__getstate__": __getstate__}
    )
    cls.__doc__ = doc or params.__doc__
    # so checkpoints (training_args.bin) unpickle: point at the defining module
    cls.__module__ = module or sys._getframe(1).f_globals.get("__name__", __name__)
    cls.params_class = params
    return cls


# ---------------------------------------------------------------------------------------------
# Type checking of plain YAML / command-line values against a field's annotation
# ---------------------------------------------------------------------------------------------


def _accepts(annotation: Any, value: Any) -> bool:
    if annotation in (Any, None) or isinstance(annotation, str):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, str) and value in {m.value for m in annotation}
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, typing.Mapping) or annotation is dict:
        return isinstance(value, dict)
    return True  # richer types: left to the class's own validation


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def check_value(path: str, annotation: Any, value: Any) -> None:
    if not _accepts(annotation, value):
        shown = masked(value, path.rsplit(".", 1)[-1].lstrip("-"))  # a misplaced token is still a token
        raise PlaitError(f"{path}: expected {_type_name(annotation)}, got {shown!r} ({type(value).__name__}); fix the value's type")


def unknown_key_error(path: str, key: str, known) -> PlaitError:
    match = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(m) for m in match)}?" if match else f"; accepted: {', '.join(sorted(known))}"
    return PlaitError(f"{path}: unknown field {key!r}{hint}")


# ---------------------------------------------------------------------------------------------
# The YAML run config
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class DatasetSpec:
    """Arguments of ``datasets.load_dataset``: ``{path: json, data_files: prefs.jsonl, split: train}``."""

    path: str
    name: str | None = None
    data_files: str | list | dict | None = None
    split: str = "train"
    data_dir: str | None = None
    columns: list | None = None  # keep only these columns
    fraction: float | None = None  # share of a mixture (plait.trl.script_args.load_mixture)
    streaming: bool = False


@attrs.frozen
class PluginsSpec:
    """The ``plugins:`` section: what to load (mirrors the PLAIT_* environment switches)."""

    disable: list = attrs.Factory(list)
    autoload: bool = True
    on_import_error: str = attrs.field(default="fail")

    @on_import_error.validator
    def _check(self, attribute, value) -> None:
        if value not in ("fail", "skip"):
            raise PlaitError(f"plugins.on_import_error: {value!r} is not valid; use 'fail' or 'skip'")


@attrs.frozen
class RunConfig:
    """A run named entirely by registry names; see examples/recipes/ for one per method."""

    method: str
    model: str
    dataset: DatasetSpec | list  # a list: a mixture, concatenated (TRL's datasets:)
    eval_dataset: DatasetSpec | None = None
    test_split_size: float | None = None  # hold out this share of the training data for evaluation
    loss: str | list | None = None
    reward_funcs: str | list | None = None
    ref_model: str | None = None
    peft: dict | None = None
    model_init_kwargs: dict | None = None
    training: dict = attrs.Factory(dict)
    plugins: PluginsSpec = attrs.Factory(PluginsSpec)


def _structure(cls: type, data: Any, path: str):
    """Build attrs class ``cls`` from plain data, failing with the field path on any mismatch."""
    # this module's annotations are strings (``from __future__ import annotations``): resolve
    # them, or every type check and nested section below would silently accept anything
    fields = {a.name: a for a in attrs.fields(attrs.resolve_types(cls))}
    if not isinstance(data, Mapping):
        raise PlaitError(
            f"{path}: expected a mapping of {cls.__name__} fields, got {data!r}; "
            f"write it as {{{', '.join(f'{key}: ...' for key in fields)}}}"
        )
    for key in data:
        if key not in fields:
            raise unknown_key_error(path, key, fields)
    values = {}
    for key, attribute in fields.items():
        if key not in data:
            if attribute.default is attrs.NOTHING:
                raise PlaitError(f"{path}.{key}: required field is missing; add `{key}: ...`")
            continue
        value = data[key]
        nested = next((t for t in typing.get_args(attribute.type) or (attribute.type,) if attrs.has(t)), None)
        if nested is not None and isinstance(value, list) and list in typing.get_args(attribute.type):
            value = [_structure(nested, item, f"{path}.{key}[{i}]") for i, item in enumerate(value)]
        elif nested is not None and value is not None:
            value = _structure(nested, value, f"{path}.{key}")
        else:
            check_value(f"{path}.{key}", attribute.type, value)
        values[key] = value
    return cls(**values)


def parse_run_config(data: Any, source: str = "config") -> RunConfig:
    return _structure(RunConfig, data, source)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names one key twice: YAML keeps the last silently, a recipe author meant one."""


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML (YAML 1.1) reads ``learning_rate: 5e-6`` as the string '5e-6'.
    A key given twice in one mapping is an error naming both lines."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` overrides on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if seen is not None:
                    raise DuplicateKeyError(None, None, f"key {key!r} is also on line {seen}; YAML would keep "
                                            "only the last, remove one", key_node.start_mark)
                first[key] = line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def yaml_load(text: str) -> Any:
    """Parse YAML as a recipe author means it: ``1e-5`` is a float, as in YAML 1.2 and Python."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_run_config(path: str | Path, overrides: Mapping[str, Any] = {}) -> RunConfig:
    """Read a YAML recipe; ``overrides`` (from command-line flags) replace fields of ``training``."""
    path = Path(path)
    if not path.is_file():
        raise PlaitError(f"--config {str(path)!r}: no such file; pass the path of a YAML recipe")
    try:
        data = yaml_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise PlaitError(f"{path}:{where} is not valid YAML ({getattr(err, 'problem', err)}); fix the syntax") from err
    data = dict(data) if isinstance(data, Mapping) else data
    if isinstance(data, dict) and overrides:
        data["training"] = {**(data.get("training") or {}), **overrides}
    return parse_run_config(data, source=path.name)


def build_method_config(config_cls: type, values: Mapping[str, Any], path: str = "training"):
    """Instantiate a method's Config from plain values, checking names and types first."""
    fields = config_fields(config_cls)
    for key, value in values.items():
        if key not in fields:
            raise unknown_key_error(path, key, fields)
        check_value(f"{path}.{key}", fields[key].type, value)
    try:
        return config_cls(**values)
    except PlaitError as err:
        raise PlaitError(f"{path}: {err}") from err
    except ValueError as err:  # TrainingArguments' own checks
        message = " ".join(str(err).split())
        raise PlaitError(f"{path}: {message}") from err
