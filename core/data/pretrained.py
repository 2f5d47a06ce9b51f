"""What every ``from_pretrained`` plait calls passes: whether a model folder's own code may run.

A Config's ``trust_remote_code`` holds for the policy, the reference, a teacher, value and reward
models and their tokenizers alike, so it is set once per run (:func:`remote_code`) and read by every
load (:func:`pretrained_kwargs`), instead of threaded through each call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

_TRUST_REMOTE_CODE = contextvars.ContextVar("plait_trust_remote_code", default=False)


@contextlib.contextmanager
def remote_code(trusted: bool):
    """While open, every model, config and tokenizer plait loads by path or id runs the code its
    folder names (``auto_map``) only if ``trusted``: a Config's ``trust_remote_code``, in force for
    the policy, the reference, a teacher, value and reward models and their tokenizers alike."""
    token = _TRUST_REMOTE_CODE.set(bool(trusted))
    try:
        yield
    finally:
        _TRUST_REMOTE_CODE.reset(token)


def pretrained_kwargs() -> dict[str, Any]:
    """What every ``from_pretrained`` plait calls passes (see :func:`remote_code`)."""
    return {"trust_remote_code": _TRUST_REMOTE_CODE.get()}
