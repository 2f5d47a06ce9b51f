"""The model card: the README.md that ``save_model`` writes beside the weights.

TRL's trainers write a card into the output folder so that ``push_to_hub`` uploads one: YAML
metadata the Hub reads (base model, library, tags, datasets, license), then a description. plait
writes its own after every final save, at each checkpoint (into ``output_dir``, as TRL does) and
from ``create_model_card``/``push_to_hub``. Besides the method, its paper and the base model, it
records what a plait run needs in order to be reproduced: the losses with their weights and
parameters, the method's settings that differ from its defaults, and the plait version with every
installed plugin distribution (a run's behaviour depends on which plugins were installed).
Secrets among them (``vllm_server_token``, ``model_init_kwargs.token`` ...) show as their
markers (:mod:`plait.engine.redact`): the card is what ``push_to_hub`` publishes.

The file is written atomically (a temporary file renamed into place), so an interrupted or
failed write leaves the previous card, or none, never half of one.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import os
import platform
import sys
from collections import Counter
from typing import Any, Iterable

import attrs
import yaml

from plait.errors import PlaitError
from plait.paths import write_atomically

from .config import contributed_fields
from .redact import masked

CARD_FILE = "README.md"
FRAMEWORKS = ("transformers", "torch", "datasets", "tokenizers", "accelerate", "peft")
# TrainingArguments fields every card lists: what sets the size and pace of the updates
TRAINING_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "num_train_epochs", "max_steps",
                   "per_device_train_batch_size", "gradient_accumulation_steps", "optim", "weight_decay",
                   "max_grad_norm", "seed", "bf16", "fp16", "gradient_checkpointing")
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow", ".tsv")


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class CardDetails:
    """What the user told ``create_model_card``/``push_to_hub`` (TRL's and transformers' arguments)
    and the command line's recipe told the trainer; kept for every later card of the run."""

    model_name: str | None = None
    datasets: tuple[str, ...] = attrs.field(default=(), converter=_names)
    tags: tuple[str, ...] = attrs.field(default=(), converter=_names)
    license: str | None = None
    language: tuple[str, ...] = attrs.field(default=(), converter=_names)
    base_model: str | None = None  # transformers' finetuned_from: overrides the model's own name
    tasks: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def updated(self, *, model_name: str | None = None, dataset_name: str | Iterable[str] | None = None,
                tags: str | Iterable[str] | None = None, language: str | Iterable[str] | None = None,
                license: str | None = None, finetuned_from: str | None = None,
                tasks: str | Iterable[str] | None = None, dataset_tags: str | Iterable[str] | None = None,
                dataset: str | Iterable[str] | None = None, dataset_args: Any = None) -> CardDetails:
        """These details with what ``create_model_card`` was given (not None) in place of the kept
        values. TRL names the datasets ``dataset_name``; transformers ``dataset_tags`` (Hub ids) and
        ``dataset`` (display names): all three are the card's datasets. ``dataset_args`` (a dataset
        config for the Hub's evaluation results) has no place on plait's card and is ignored."""
        datasets = list(dict.fromkeys([*_names(dataset_name), *_names(dataset_tags), *_names(dataset)]))
        given = {"model_name": model_name, "tags": tags, "language": language, "license": license,
                 "base_model": finetuned_from, "tasks": tasks, "datasets": datasets or None}
        return attrs.evolve(self, **{name: value for name, value in given.items() if value is not None})


def hub_name(name: str | None) -> str | None:
    """``name`` if it can be a Hugging Face Hub repository id, else None (a local folder or file
    would be refused by the Hub in the card's metadata; the card's text still names it)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.exists(name) or name.lower().endswith(DATA_FILE_SUFFIXES):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def dataset_label(spec: Any) -> str:
    """How a recipe's dataset (a :class:`plait.engine.config.DatasetSpec`) is named on the card: its Hub
    name (``org/name``, with ``:config``), or the local files a packaged loader read."""
    if spec.data_files is None and spec.data_dir is None:
        return spec.path if spec.name is None else f"{spec.path}:{spec.name}"
    files = spec.data_files if spec.data_files is not None else spec.data_dir
    if isinstance(files, dict):
        files = [name for value in files.values() for name in _names(value)]
    # a recipe's paths are joined to its folder (recipes/../data/x.jsonl): the card names the file plainly
    return ", ".join(os.path.normpath(name) if isinstance(name, str) and "://" not in name else str(name)
                     for name in _names(files) if name is not None)


def base_model_license(name: str | None) -> str | None:
    """The license in the base model's own card: its folder's README.md, or the Hub card already
    in the local Hugging Face cache (nothing is downloaded)."""
    from huggingface_hub import metadata_load, try_to_load_from_cache

    if not name:
        return None
    if os.path.isdir(name):
        readme = os.path.join(name, CARD_FILE)
    elif hub_name(name):
        readme = try_to_load_from_cache(name, CARD_FILE)
    else:
        return None
    if not isinstance(readme, str) or not os.path.isfile(readme):
        return None
    try:
        return (metadata_load(readme) or {}).get("license")
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None  # an unreadable card says nothing about the license


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_paragraph(text: str | None) -> str:
    paragraph = (text or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):  # TrainingArguments turns optim, lr_scheduler_type ... into enums
        value = value.value
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def card_facts(trainer, details: CardDetails) -> dict[str, Any]:
    """Everything the card says, read from a :class:`plait.engine.trainer.PlaitTrainer` and ``details``."""
    from plait import __version__

    args, policy = trainer.args, trainer._policy
    method = trainer.plugins.registries["methods"].get(f"method.{trainer.method}")
    trainer_module = sys.modules.get(method.obj.trainer.__module__)
    name_or_path = details.base_model or getattr(policy.config, "_name_or_path", None) or None
    datasets = details.datasets or tuple(trainer.card_datasets)
    world_size = max(args.world_size, 1)
    training = {field: getattr(args, field) for field in TRAINING_FIELDS}
    if training["max_steps"] is None or training["max_steps"] <= 0:
        del training["max_steps"]
    training["total_train_batch_size"] = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                                          * world_size)
    training["num_processes"] = world_size
    params_class = getattr(type(args), "params_class", None)
    changed = {}
    # the method's own fields and those its plugins contribute (a backend's vllm_*), against the Config's defaults
    own = {a.name for a in attrs.fields(params_class)} | set(contributed_fields(params_class)) if params_class else set()
    for field in (f for f in dataclasses.fields(args) if f.name in own):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if getattr(args, field.name) != default:
            changed[field.name] = getattr(args, field.name)
    losses = [
        {"name": term.name, "weight": term.weight, "origin": term.origin, "summary": term.component.summary,
         "params": attrs.asdict(term.params, recurse=False) if attrs.has(type(term.params)) else {}}
        for objective in trainer._objectives() for term in objective.terms
    ]
    plugin_counts = Counter((info.distribution, info.version) for info in trainer.plugins.distributions())
    last_loss = next((entry.get("loss", entry.get("train_loss")) for entry in reversed(trainer.state.log_history)
                      if "loss" in entry or "train_loss" in entry), None)
    is_peft = hasattr(policy, "peft_config")
    # the card is published (push_to_hub): a secret among the settings or a loss's parameters shows as its marker
    return masked({
        "model_name": details.model_name or os.path.basename(os.path.abspath(args.output_dir)),
        # what loads the model: its Hub repository, else its folder as the user named it (the base name alone
        # loads it from nowhere, or from the Hub)
        "repo": trainer.hub_model_id or args.hub_model_id or os.path.normpath(args.output_dir),
        "base_model": name_or_path,
        "base_model_hub": hub_name(name_or_path),
        "license": details.license or base_model_license(name_or_path),
        "language": list(details.language),
        # (label, Hub id or None): ``org/name:config`` links to the Hub's ``org/name``
        "datasets": [(label, hub_name(label.split(":")[0])) for label in datasets],
        "tags": list(dict.fromkeys(["generated_from_trainer", "plait", trainer.method, *details.tags])),
        "tasks": list(details.tasks),
        "library_name": "peft" if is_peft else "transformers",
        "auto_class": trainer.auto_model_class.__name__,
        "method": trainer.method,
        "method_origin": f"{method.distribution} {method.version}",
        "method_summary": method.summary,
        "method_about": _first_paragraph(getattr(trainer_module, "__doc__", None)),
        "training": training,
        "method_settings": changed,
        "losses": losses,
        "steps": trainer.state.global_step,
        "train_loss": last_loss,
        "plait_version": __version__,
        "frameworks": {"python": platform.python_version(),
                       **{name: version for name in FRAMEWORKS if (version := _version(name)) is not None}},
        "plugin_distributions": [{"distribution": dist, "version": ver, "plugins": n}
                                 for (dist, ver), n in sorted(plugin_counts.items())],
    })


def render_card(facts: dict[str, Any]) -> str:
    """The README.md text: YAML front matter the Hub reads, then the description."""
    metadata: dict[str, Any] = {}
    if facts["base_model_hub"]:
        metadata["base_model"] = facts["base_model_hub"]
    metadata["library_name"] = facts["library_name"]
    metadata["model_name"] = facts["model_name"]
    if facts["license"]:
        metadata["license"] = facts["license"]
    if facts["language"]:
        metadata["language"] = facts["language"]
    hub_datasets = list(dict.fromkeys(hub for _, hub in facts["datasets"] if hub))
    if hub_datasets:
        metadata["datasets"] = hub_datasets
    if len(facts["tasks"]) == 1:
        metadata["pipeline_tag"] = facts["tasks"][0]
    metadata["tags"] = facts["tags"]
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).rstrip("\n"), "---", "",
             f"# {facts['model_name']}", ""]

    base = facts["base_model"]
    if facts["base_model_hub"]:
        base = f"[{base}](https://huggingface.co/{base})"
    elif base:
        base = f"`{base}`"
    data = ", ".join(f"[{label}](https://huggingface.co/datasets/{hub})" if hub else f"`{label}`"
                     for label, hub in facts["datasets"])
    lines.append(f"This model is a fine-tuned version of {base or 'a model'}"
                 + (f" on {data}" if data else "") + f", trained with plait's `{facts['method']}` method.")
    lines += ["", "## Method", "",
              f"`{facts['method']}` ({facts['method_origin']}): {facts['method_summary'].rstrip('.')}."]
    if facts["method_about"]:
        lines += ["", facts["method_about"]]

    lines += ["", "## Training hyperparameters", ""]
    lines += [f"- {name}: {_value(value)}" for name, value in facts["training"].items()]
    if facts["method_settings"]:
        lines += ["", "Method settings changed from their defaults:", ""]
        lines += [f"- {name}: {_value(value)}" for name, value in facts["method_settings"].items()]
    if facts["losses"]:
        lines += ["", "### Losses", "", "| loss | weight | parameters | from | what it is |", "|---|---|---|---|---|"]
        for loss in facts["losses"]:
            params = ", ".join(f"{k}={_value(v)}" for k, v in loss["params"].items()) or "-"
            lines.append(f"| `{loss['name']}` | {_value(loss['weight'])} | {_cell(params)} | {_cell(loss['origin'])} "
                         f"| {_cell(loss['summary'])} |")

    lines += ["", "## Training results", "", f"- optimizer steps: {facts['steps']}"]
    if facts["train_loss"] is not None:
        lines.append(f"- last logged training loss: {_value(facts['train_loss'])}")

    load = f"{facts['auto_class']}.from_pretrained({facts['repo']!r})"
    if facts["library_name"] == "peft":
        lines += ["", "## Use", "", "The folder holds PEFT adapter weights for the base model:", "", "```python",
                  f"from peft import PeftModel\nfrom transformers import {facts['auto_class']}", "",
                  f"model = PeftModel.from_pretrained({facts['auto_class']}.from_pretrained({facts['base_model']!r}), "
                  f"{facts['repo']!r})", "```"]
    else:
        lines += ["", "## Use", "", "```python", f"from transformers import {facts['auto_class']}", "",
                  f"model = {load}", "```"]

    lines += ["", "## Framework versions", "", f"- plait: {facts['plait_version']}"]
    lines += [f"- {name}: {version}" for name, version in facts["frameworks"].items()]
    lines += ["", "### Installed plait plugin distributions", "", "| distribution | version | plugins |", "|---|---|---|"]
    lines += [f"| {p['distribution']} | {p['version']} | {p['plugins']} |" for p in facts["plugin_distributions"]]
    return "\n".join(lines) + "\n"


def write_model_card(trainer, output_dir: str) -> str:
    """Write the card of ``trainer``'s run into ``output_dir`` and return its path."""
    path = os.path.join(output_dir, CARD_FILE)
    text = render_card(card_facts(trainer, trainer.card_details))
    os.makedirs(output_dir, exist_ok=True)
    try:
        write_atomically(path, text)  # readers see the old card or the new one; the umask holds
    except (OSError, UnicodeError) as err:
        raise PlaitError(f"could not write the model card {path}: {err}; the weights beside it are saved") from err
    return path
