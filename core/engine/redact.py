"""What a secret is, and how plait writes one: the one rule behind every file and line a run writes.

A value is a secret when its *name* says so: the name ends in ``_token``, ``_key`` or ``_secret``,
is ``token`` or ``secret`` alone, or contains ``password`` (any case: ``hub_token``,
``vllm_server_token``, ``model_init_kwargs: {token: ...}``, ``WANDB_API_KEY``). Names decide, not
values, because a token has no shape one could recognise. The tokenizer's special tokens
(``pad_token``, ``eos_token`` ...) are vocabulary, not credentials, and stay in clear: a run is
reproduced from them.

A secret is written as a marker naming it, ``<HUB_TOKEN>``, as transformers writes its ``*_token``
fields: the reader learns which secret was set, never its value. ``None`` is written as ``None``
(nothing was set, so nothing is hidden).

Writers call this module rather than deciding for themselves: model cards, the config's
``to_dict``/``repr``/pickle (what transformers logs and ``report_to`` receives, and
``training_args.bin``), the launcher's echoed command line, and the rerun check (which compares a
run's recorded config with the new one masked on both sides, so its message holds no secret).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import attrs

SECRET_SUFFIXES = ("_token", "_key", "_secret")
SECRET_NAMES = ("token", "secret")
# a tokenizer's special tokens: named like secrets, read from the vocabulary, needed to reproduce a run
SPECIAL_TOKENS = frozenset(f"{kind}_token" for kind in ("pad", "eos", "bos", "unk", "sep", "cls", "mask"))


def is_secret_name(name: str) -> bool:
    """Whether a value called ``name`` (a config field, a mapping key, an environment variable) is a secret."""
    name = name.lower()
    if name in SPECIAL_TOKENS:
        return False
    return name in SECRET_NAMES or name.endswith(SECRET_SUFFIXES) or "password" in name


def marker(name: str) -> str:
    """What is written in place of the secret called ``name``."""
    return f"<{name.upper()}>"


def masked(value: Any, name: str = "") -> Any:
    """``value`` with every secret in it replaced by its :func:`marker`: the whole value when ``name``
    is a secret's, else each mapping entry (by its key), list or tuple item, and attrs field, as deep
    as they nest. Mappings come back as dicts; attrs objects as copies of their own class (so a
    pickled config keeps its types); anything else unchanged. ``value`` itself is never modified."""
    if name and value is not None and is_secret_name(name):
        return marker(name)
    if isinstance(value, Mapping):
        return {key: masked(item, str(key)) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(masked(item) for item in value)
    if attrs.has(type(value)):
        return _masked_attrs(value)
    return value


def _masked_attrs(obj: Any) -> Any:
    changed = {field.name: masked(getattr(obj, field.name), field.name) for field in attrs.fields(type(obj))}
    changed = {key: item for key, item in changed.items() if item is not getattr(obj, key)}
    if not changed:
        return obj
    # a copy with the fields set directly: evolve() would rerun validators (a path that must exist ...)
    clone = copy.copy(obj)
    for key, item in changed.items():
        object.__setattr__(clone, key, item)  # frozen classes included
    return clone


def masked_argv(argv: list[str]) -> list[str]:
    """A command line as it may be shown: the values of secret flags (``--hub_token X``,
    ``--hub_token=X``, ``--model_init_kwargs.token X``) replaced by their markers."""
    shown: list[str] = []
    secret = ""  # the name of the secret flag whose values follow, if any
    for token in argv:
        if token.startswith("--"):
            flag, eq, _ = token[2:].partition("=")
            name = flag.rsplit(".", 1)[-1]
            hidden = is_secret_name(name)
            shown.append(f"--{flag}={marker(name)}" if eq and hidden else token)
            secret = name if hidden and not eq else ""
        else:
            shown.append(marker(secret) if secret else token)
    return shown
