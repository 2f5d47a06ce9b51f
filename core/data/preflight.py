"""Pre-flight checks: every input a user owns, refused in one line before any weights load.

One function per input (models, tokenizers, data files, a dataset's first rows). ``plait <method>
--config r.yaml --check`` runs them all through :func:`plait.recipes.run.check_inputs`, and so does
every run before it trains; the Python API reaches them where it needs them: :func:`model_source`
from :func:`plait.engine.models.load_model` and :func:`plait.data.tokenizer.load_tokenizer`. The run
folder's checks (``output_dir``, resume, training numbers) are :mod:`plait.engine.run_folder`'s. Each
failure is a :class:`~plait.errors.PlaitError` naming the field, the value and the fix; none of these
checks reads model weights, and a name that looks like a local path is never looked up on the hub.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import glob
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from plait.errors import PlaitError

from .pretrained import pretrained_kwargs

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.gguf", "*.pt", "*.pth")
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Names read as paths, never as hub ids: ./ ../ .name, absolute, ~home, and runs/, where plait's recipes
# write their models (a hub account named "runs" is out of reach by its short name; download it instead)
LOCAL_PREFIXES = (".", "/", "~", "runs/")
HEAD_ROWS = 8  # the rows --check reads of each dataset


def looks_local(name: str) -> bool:
    """``name`` is meant as a path: it starts like one, or its first segment is a folder of the working directory."""
    return name.startswith(LOCAL_PREFIXES) or ("/" in name and os.path.isdir(name.split("/", 1)[0]))


def missing_path(field: str, name: str, kind: str) -> PlaitError:
    """The one-line error of a path that looks local and is not there (no hub is asked)."""
    first = name.split("/", 1)[0]
    why = f"; it is read as a path because ./{first} is a folder here" \
        if not name.startswith(LOCAL_PREFIXES) and os.path.isdir(first) else ""
    return PlaitError(f"{field}={name!r}: no such {kind} (a local path, not a hub id; working directory "
                      f"{os.getcwd()}){why}; fix the path (a recipe's ./ and ../ paths are relative to the recipe "
                      "file, others to the working directory)")


def hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


# ---------------------------------------------------------------------------------------------
# Models and tokenizers
# ---------------------------------------------------------------------------------------------


def checkpoint_step(name: str) -> int:
    """The step of a ``checkpoint-N`` folder's name."""
    return int(CHECKPOINT.match(name).group(1))


def model_source(model: Any, field: str = "model", init_kwargs: dict | None = None) -> str:
    """A local model folder holds a readable config.json and weights; a name that looks like a path
    (:func:`looks_local`) is one, refused at once when missing; a hub id is in the cache when the hub
    is offline. Model instances pass as given. Returns where the model comes from, in words."""
    if not isinstance(model, str):
        return "a model instance"
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        raise PlaitError(f"{field}={model!r} is a file; pass the folder that holds config.json and the weights "
                         "(a run's output_dir, or a folder written by save_pretrained)")
    if os.path.isdir(path):
        return _model_folder(path, model, field, init_kwargs or {})
    if looks_local(model) or not HUB_ID.match(model):
        raise missing_path(field, model, "folder")
    if not hub_offline():
        return "hub id (downloaded by the run)"  # from_pretrained downloads it
    from huggingface_hub import try_to_load_from_cache

    hub = init_kwargs or {}
    cached = try_to_load_from_cache(model, "config.json", cache_dir=hub.get("cache_dir"), revision=hub.get("revision"))
    if not isinstance(cached, str):
        raise PlaitError(f"{field}={model!r}: not a local folder, and no hub model of that name in the local cache "
                         f"(HF_HUB_OFFLINE=1 forbids downloading); pass a local folder, or unset HF_HUB_OFFLINE and "
                         f"download it once with 'hf download {model}'")
    _config_json(Path(cached), model, field)
    return "hub id, in the local cache"


def _model_folder(path: str, model: str, field: str, init_kwargs: dict) -> str:
    folder = Path(path)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        return "local PEFT adapter folder"  # transformers loads its base model through peft
    if not (folder / "config.json").is_file():
        checkpoints = sorted((p.name for p in folder.iterdir() if CHECKPOINT.match(p.name)), key=checkpoint_step)
        hint = f"; did you mean its {checkpoints[-1]}?" if checkpoints else \
            "; pass a folder written by save_pretrained (config.json and weights), or a hub id"
        raise PlaitError(f"{field}={model!r} is a folder without a model (no config.json){hint}")
    _config_json(folder / "config.json", model, field)
    if init_kwargs.get("gguf_file") is None and not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise PlaitError(f"{field}={model!r} has config.json but no weights (*.safetensors or pytorch_model.bin); "
                         "copy the weight files into it, or pass the folder that has them")
    return "local folder"


def _config_json(config: Path, model: str, field: str) -> None:
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise PlaitError(f"{field}={model!r}: {config} is not UTF-8 (byte {err.start}); restore the file from "
                         "the original model") from err
    except json.JSONDecodeError as err:
        raise PlaitError(f"{field}={model!r}: {config} is not valid JSON (line {err.lineno}, column {err.colno}: "
                         f"{err.msg}); restore the file from the original model") from err
    if not isinstance(data, dict):
        raise PlaitError(f"{field}={model!r}: {config} holds a JSON {type(data).__name__}, not an object; "
                         "restore the file from the original model")
    from transformers import AutoConfig
    trusted = pretrained_kwargs()["trust_remote_code"]
    try:
        AutoConfig.from_pretrained(str(config.parent), **pretrained_kwargs())
    except Exception as err:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError, TypeError here
        fix = "set trust_remote_code=True if you trust the code its auto_map names" if "auto_map" in data and not trusted \
            else "fix model_type and the fields it names"
        raise PlaitError(f"{field}={model!r}: {config} is not a config transformers can read "
                         f"({type(err).__name__}: {_first_line(err)}); {fix}") from err


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def tokenizer_files(model: Any, field: str = "model") -> None:
    """A local model folder carries tokenizer files (a run's output_dir does: the trainer saves them)."""
    if isinstance(model, str) and os.path.isdir(os.path.expanduser(model)):
        folder = Path(os.path.expanduser(model))
        if not any((folder / name).is_file() for name in TOKENIZER_FILES) and \
                not (folder / "adapter_config.json").is_file():
            raise PlaitError(f"{field}={model!r} has no tokenizer files (tokenizer.json or tokenizer_config.json); "
                             "save the tokenizer there (tokenizer.save_pretrained(folder)) or pass processing_class")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}


def data_files(spec: Any, field: str = "dataset") -> None:
    """Each local data file is non-empty UTF-8 (JSON lines that parse, as objects), and the
    requested split selects at least one row. ``spec`` is a :class:`plait.engine.config.DatasetSpec`."""
    files = spec.data_files
    by_split = files if isinstance(files, dict) else {"train": files}
    rows: dict[str, int | None] = {}
    for split, names in by_split.items():
        total: int | None = 0
        for name in names if isinstance(names, list) else [names]:
            count = _file_rows(name, spec.path, f"{field}.data_files") if _is_local_file(name) else None
            total = None if total is None or count is None else total + count
        rows[split] = total
    if files is None or not rows:
        return
    _split_rows(spec.split, rows, field)


def _is_local_file(name: Any) -> bool:
    return isinstance(name, str) and "://" not in name and not glob.has_magic(name) and os.path.isfile(name)


def _file_rows(name: str, builder: str | None, field: str) -> int | None:
    """Rows in one file (None when only the dataset builder can tell), after checking its bytes."""
    if os.path.getsize(name) == 0:
        raise PlaitError(f"{field}: {name!r} is empty (0 bytes); add rows to it or fix the path")
    builder = builder if builder in BUILDERS.values() else BUILDERS.get(Path(name).suffix.lower())
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(name).metadata.num_rows
        except Exception as err:  # noqa: BLE001 - pyarrow's ArrowInvalid and OSError
            raise PlaitError(f"{field}: {name!r} is not a readable parquet file ({_first_line(err)}); "
                             "rewrite it, or fix the path") from err
    if builder not in ("json", "csv", "text"):
        return None
    if builder == "json" and not name.lower().endswith(".jsonl") and _first_character(name) == "[":
        return _json_array_rows(name, field)
    lines = _utf8_lines(name, field)
    if builder == "text":
        return sum(1 for _ in lines)
    if builder == "csv":
        return max(0, sum(1 for _ in csv.reader(line for _, line in lines)) - 1)  # less the header row
    count = 0
    for number, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlaitError(f"{field}: {name}, line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                             "fix or delete that line") from err
        if not isinstance(row, dict):
            raise PlaitError(f"{field}: {name}, line {number} is {_a(row)}, not an object "
                             "({\"column\": value, ...}); fix or delete that line")
        count += 1
    return count


def _a(value: Any) -> str:
    """'a JSON list', 'an int' ...: what a row that should be an object is instead."""
    kind = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")
    return f"a JSON {kind}"


def _first_character(name: str) -> str:
    with open(name, "rb") as handle:
        head = handle.read(4096).lstrip(codecs.BOM_UTF8).lstrip()
    return head[:1].decode("latin-1")


def _utf8_lines(name: str, field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line; a non-UTF-8 byte is an error naming line and offset."""
    offset = 0
    with open(name, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise PlaitError(f"{field}: {name}, line {number} (byte {offset + err.start}) is not UTF-8 "
                                 f"({raw[err.start:err.start + 4]!r}); re-save the file as UTF-8") from err
            offset += len(raw)
            yield number, text


def _json_array_rows(name: str, field: str) -> int:
    text = "".join(line for _, line in _utf8_lines(name, field))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlaitError(f"{field}: {name}, line {err.lineno} is not valid JSON ({err.msg} at column {err.colno}); "
                         "fix the file") from err
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise PlaitError(f"{field}: {name}, item {index} of the JSON array is {_a(row)}, not an "
                             "object ({\"column\": value, ...}); fix or delete it")
    return len(data)


def _split_rows(split: str, rows: dict[str, int | None], field: str) -> None:
    import datasets

    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({k: v or 0 for k, v in rows.items()})
    except (ValueError, AssertionError) as err:
        raise PlaitError(f"{field}.split={split!r} does not name a split of data_files (it has: {', '.join(rows)}); "
                         "use one of those, e.g. train or train[:100]") from err
    if any(rows[part.splitname] is None for part in parts):
        return  # a file whose rows only the dataset builder can count
    if sum(part.to - part.from_ for part in parts) == 0:
        sizes = ", ".join(f"{k}: {v} rows" for k, v in rows.items())
        raise PlaitError(f"{field}.split={split!r} selects no rows ({sizes}); add rows to the data files or "
                         "widen the split")


# ---------------------------------------------------------------------------------------------
# Datasets: reachable, and their first rows of a shape the method takes
# ---------------------------------------------------------------------------------------------


def dataset_label(spec: Any) -> str:
    """What a user named: the data files, or the dataset's path or hub id."""
    named = spec.data_files if spec.data_files is not None else spec.path
    return os.path.normpath(named) if isinstance(named, str) and "://" not in named else str(named)


def dataset_source(spec: Any, field: str = "dataset") -> str:
    """Where a dataset comes from, in words; a dataset path that looks local (:func:`looks_local`)
    and is missing is refused at once, without asking the hub. Data files are :func:`data_files`'."""
    if spec.data_files is not None:
        return "data files"
    if os.path.exists(os.path.expanduser(spec.path)):
        return "local folder" if os.path.isdir(os.path.expanduser(spec.path)) else "local file"
    if looks_local(spec.path) or not HUB_ID.match(spec.path):
        raise missing_path(field, spec.path, "file or folder")
    return "hub dataset, in the local datasets cache" if hub_offline() else "hub dataset"


def dataset_head(spec: Any, field: str = "dataset", rows: int = HEAD_ROWS):
    """The first ``rows`` rows of a dataset as the run loads it (``datasets.load_dataset`` with the
    spec's path, name, data_dir, data_files and split, then its ``columns``), as a ``datasets.Dataset``.

    A local or cached dataset is loaded as the run loads it (its Arrow cache is the run's); a hub
    dataset, online, is streamed, so only its first rows are downloaded. Offline, a hub dataset
    missing from the local datasets cache is one line naming it and the fix.
    """
    import datasets

    source = dataset_source(spec, field)
    where = {"data_dir": spec.data_dir, "data_files": spec.data_files}
    try:
        with _without_progress_bars():
            if source == "hub dataset":  # online: stream, so --check does not download all of it
                stream = datasets.load_dataset(spec.path, spec.name, split=re.split(r"[\[+]", spec.split)[0],
                                               streaming=True, **where)
                head = datasets.Dataset.from_list(list(itertools.islice(stream, rows)), features=stream.features)
            else:
                loaded = datasets.load_dataset(spec.path, spec.name, split=spec.split, **where)
                head = loaded.select(range(min(rows, len(loaded))))
    except Exception as err:  # noqa: BLE001 - datasets raises ConnectionError, FileNotFoundError, ValueError ...
        raise _unloadable(spec, field, source, err) from err
    if spec.columns is not None:
        absent = [c for c in spec.columns if c not in head.column_names]
        if absent:
            raise PlaitError(f"{field}.columns: {dataset_label(spec)!r} has no column(s) {absent} (it has "
                             f"{sorted(head.column_names)}); fix columns")
        head = head.select_columns(spec.columns)
    if len(head) == 0:
        raise PlaitError(f"{field}.split={spec.split!r} selects no rows of {dataset_label(spec)!r}; add rows or widen "
                         "the split")
    return head


def _unloadable(spec: Any, field: str, source: str, err: Exception) -> PlaitError:
    from datasets.exceptions import DatasetNotFoundError

    name = dataset_label(spec)
    local = f"data/{name.split('/')[-1]}"
    if source.startswith("hub") and hub_offline() and isinstance(err, ConnectionError):
        return PlaitError(f"{field}={name!r}: not a local file or folder, and not in the local datasets cache "
                          "(HF_HUB_OFFLINE=1 forbids downloading); pass a local file or folder (with HF_HUB_OFFLINE "
                          f"unset, 'hf download {name} --repo-type dataset --local-dir {local}' makes one), or unset "
                          "HF_HUB_OFFLINE so the run downloads it")
    if isinstance(err, DatasetNotFoundError):
        return PlaitError(f"{field}={name!r}: no such dataset on the hub, or it is gated or private "
                          f"({_first_line(err)}); fix the name, log in with 'hf auth login', or pass a local file")
    return PlaitError(f"{field}={name!r} cannot be loaded ({type(err).__name__}: {_first_line(err)}); fix {field}'s "
                      "path, name, data_files or split")


@contextlib.contextmanager
def _without_progress_bars():
    """datasets' progress bars off for a check's few rows, then as they were."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def mixture_head(heads: list, field: str = "dataset"):
    """A mixture's first rows, concatenated as the run concatenates its datasets (``datasets`` fills a
    column one part lacks with None, which the method's prepare then refuses; it refuses columns of
    different types itself)."""
    import datasets

    if len(heads) == 1:
        return heads[0]
    try:
        return datasets.concatenate_datasets(heads)
    except ValueError as err:
        columns = "; ".join(f"{field}[{i}]: {sorted(h.column_names)}" for i, h in enumerate(heads))
        raise PlaitError(f"{field}: the mixture's datasets cannot be concatenated ({columns}); give each the same "
                         "columns (select them with columns: [...])") from err


def dataset_format(prepare: Callable[[Any], Any], head: Any, field: str, name: str) -> str:
    """The format a method's own ``prepare(rows)`` decides for a dataset's first rows, in words.

    ``prepare`` runs under :func:`plait.data.prepare.deciding_format`, so it stops where
    ``prepare_dataset`` has recognised the rows' format for the method's task (before tokenising):
    the run and the check take the same decision. A refusal is one line naming the dataset, its
    columns, and the shapes the method accepts. A ``prepare`` that needs what only a trainer's
    ``__init__`` sets (a loaded model) fails otherwise: the rows are then reported as not checked.
    """
    from .prepare import FormatDecided, deciding_format

    columns = list(head.column_names)
    try:
        with deciding_format(), _without_progress_bars():
            prepare(head)
    except FormatDecided as decided:
        return f"{decided.format_name} for task {decided.task!r}"
    except PlaitError as err:
        text = str(err)
        shown = "" if str(sorted(columns)) in text or str(columns) in text else f" (columns {sorted(columns)})"
        raise PlaitError(f"{field}={name!r}{shown}: {text}") from err
    except Exception as err:  # noqa: BLE001 - a method's prepare without its model: the run will tell
        return f"not checked ({type(err).__name__} in the method's prepare without a model: {_first_line(err)})"
    return "the method's own reading of its rows"
