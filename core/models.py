"""Loading policies, tokenizers and adapters; the reference policy every KL-regularised method shares."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
from accelerate.utils import is_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import preflight
from .errors import PlaitError

logger = logging.getLogger("plait")
T = TypeVar("T")


def load_model(model: str | PreTrainedModel, init_kwargs: dict | None = None, auto_class=AutoModelForCausalLM,
               field: str = "model") -> PreTrainedModel:
    """A ready model from an id/path (with ``model_init_kwargs``) or a model instance as given."""
    if not isinstance(model, str):
        if init_kwargs:
            raise PlaitError(f"model_init_kwargs={init_kwargs!r} only apply when {field} is a path or id; "
                             "load the model with them yourself or pass the path")
        return model
    preflight.model_source(model, field, init_kwargs)
    kwargs = dict(init_kwargs or {})
    dtype = kwargs.get("dtype", kwargs.pop("torch_dtype", None))
    if isinstance(dtype, str) and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    try:
        return auto_class.from_pretrained(model, **kwargs)
    except OSError as err:
        raise PlaitError(f"{field}={model!r} could not be loaded ({str(err).splitlines()[0]}); "
                         "pass a local folder with config.json and weights") from err


def load_tokenizer(model: str | PreTrainedModel, processing_class=None, field: str = "model"):
    if processing_class is not None:
        return processing_class
    source = model if isinstance(model, str) else model.config._name_or_path
    preflight.model_source(model, field)  # a bad path is named as such, not as a tokenizer problem
    preflight.tokenizer_files(source, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, TypeError, tokenizers' own: all mean "cannot load"
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise PlaitError(f"{field}={source!r}: its tokenizer cannot be loaded ({type(err).__name__}: {message}); "
                         "save one next to the model (tokenizer.save_pretrained(folder)) or pass processing_class") from err
    if tokenizer.pad_token is None:  # training collators need a pad id; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def wrap_peft(model: PreTrainedModel, peft_config, gradient_checkpointing: bool = False):
    """Wrap in LoRA (QLoRA when the model was loaded quantised) when a peft_config is given."""
    if peft_config is None:
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # so checkpointed blocks see a grad-requiring input
    return get_peft_model(model, peft_config)


def check_same_vocabulary(model: PreTrainedModel, other: PreTrainedModel, field: str) -> None:
    """Log-probs of one tokenisation are only comparable under the same vocabulary."""
    mine, theirs = model.config.get_text_config().vocab_size, other.config.get_text_config().vocab_size
    if mine != theirs:
        raise PlaitError(f"{field} has vocab_size {theirs} but the policy has {mine}; the reference must share "
                         "the policy's tokenizer (use the same base checkpoint)")


class Reference:
    """The frozen policy a method regularises towards.

    Three forms, chosen once at construction: a separate frozen model (a deep copy of the policy
    by default, or a given ``ref_model``); with PEFT and no ``ref_model``, the policy itself with
    its adapters disabled (no second copy in memory); or none (precomputed log-probs, beta = 0).
    """

    def __init__(self, model: PreTrainedModel | None, *, adapters_off: bool = False):
        self.model = model
        self.adapters_off = adapters_off
        if model is not None:
            model.eval()
            model.requires_grad_(False)

    @classmethod
    def for_policy(cls, policy: PreTrainedModel, ref_model: str | PreTrainedModel | None = None,
                   init_kwargs: dict | None = None) -> "Reference":
        """Build before the policy is wrapped by PEFT, so the deep copy holds no adapters."""
        if ref_model is not None:
            ref = load_model(ref_model, init_kwargs, field="ref_model")
            check_same_vocabulary(policy, ref, "ref_model")
            return cls(ref)
        return cls(copy.deepcopy(policy))

    @classmethod
    def adapters_disabled(cls) -> "Reference":
        return cls(None, adapters_off=True)

    @classmethod
    def none(cls) -> "Reference":
        return cls(None)

    @property
    def available(self) -> bool:
        return self.model is not None or self.adapters_off

    def __call__(self, policy, compute: Callable[[Any], T]) -> T:
        """Run ``compute(model)`` under the reference, without gradients."""
        with torch.no_grad():
            if self.adapters_off:
                with _adapters_disabled(policy):
                    return compute(policy)
            if self.model is None:
                raise PlaitError("no reference model is loaded (beta = 0 or precomputed log-probs)")
            return compute(self.model)

    @torch.no_grad()
    def mix_from(self, policy, alpha: float) -> None:
        """TR-DPO: π_ref ← α·π + (1−α)·π_ref (Gorbatovski et al. 2024, eq. 4)."""
        source = dict(_unwrap(policy).named_parameters())
        for name, param in self.model.named_parameters():
            param.mul_(1 - alpha).add_(source[name].detach().to(param.dtype), alpha=alpha)


def _unwrap(model):
    return getattr(model, "module", model)


@contextlib.contextmanager
def _adapters_disabled(policy):
    model = _unwrap(policy)
    if not is_peft_model(model):
        raise PlaitError("the reference is 'the policy with adapters disabled' but the policy has no adapters")
    with model.disable_adapter():
        yield


def weights_digest(model: torch.nn.Module) -> str | None:
    """sha256 of what a model computes with: its class, its config (less the path it was loaded
    from) and the bytes of every parameter and buffer as they are in memory, so dtype,
    quantisation and in-place edits count and the folder it came from does not. None when some
    weights are not in memory (offloaded to disk)."""
    model = _unwrap(model)
    digest = hashlib.sha256(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        digest.update(json.dumps(values, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.device.type == "meta":
            return None
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def tokenizer_digest(processing_class) -> str:
    """sha256 of a tokenizer (or processor) as it saves itself: vocabulary, merges, special
    tokens, chat template, padding and truncation sides."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        processing_class.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                digest.update(path.relative_to(folder).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _identity(value: Any) -> str | None:
    """A stable text for one thing cached numbers depend on; None when there is none."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    if isinstance(value, torch.nn.Module):
        return weights_digest(value)
    if isinstance(value, (PreTrainedTokenizerBase, ProcessorMixin)):
        return tokenizer_digest(value)
    if isinstance(value, Dataset):  # datasets' fingerprint follows the data and every transform applied
        return f"{value._fingerprint}|{len(value)}"
    return repr(value)


def cached_tensors(depends_on: Mapping[str, Any], compute: Callable[[], dict]) -> dict:
    """``compute()`` once per distinct ``depends_on``: everything the numbers are a function of.

    Models count by the content of their weights (:func:`weights_digest`), tokenizers by what they
    save, datasets by their fingerprint, other values by their repr; never by a path, so a model
    replaced in the same folder computes afresh. Kept as a safetensors file under ``$PLAIT_CACHE``
    (default ~/.cache/plait), written atomically. When something has no stable identity (weights
    offloaded to disk) nothing is cached.
    """
    from safetensors.torch import load_file, save_file

    parts = {name: _identity(value) for name, value in sorted(depends_on.items())}
    if any(part is None for part in parts.values()):
        return compute()
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("PLAIT_CACHE", Path.home() / ".cache" / "plait")) / "ref_logps" / f"{key}.safetensors"
    if cache.exists():
        return load_file(cache)
    tensors = compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, tmp)
    os.replace(tmp, cache)
    return tensors
