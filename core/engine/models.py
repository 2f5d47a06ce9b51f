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
from typing import Any, Callable, ClassVar, Mapping, TypeVar

import attrs
import torch
from accelerate.utils import DistributedType, is_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel, TrainerCallback

from plait.data import chat, preflight, vision
from plait.data.pretrained import pretrained_kwargs
from plait.engine.autocast import COMPUTE_DTYPES, frozen_linears_in_compute_dtype
from plait.errors import PlaitError
from plait.params import in_range, positive
from plait.paths import cache_dir, keep_within, read_cached, write_atomically

logger = logging.getLogger("plait")
T = TypeVar("T")


def load_model(model: str | PreTrainedModel, init_kwargs: dict | None = None, auto_class=AutoModelForCausalLM,
               field: str = "model", default_dtype: str = "float32") -> PreTrainedModel:
    """A ready model from an id/path (with ``model_init_kwargs``) or a model instance as given.

    Weights load as ``default_dtype`` unless ``init_kwargs`` name a ``dtype`` ("auto": as stored). Models
    that train load as float32 master weights, as TRL's do: most hub checkpoints are stored in bfloat16,
    and AdamW's updates at fine-tuning learning rates fall below bf16's resolution, so bf16 weights would
    silently not change (mixed precision is ``bf16=True``: autocast over float32 weights). Models that
    only score (a teacher, a judge) pass ``"auto"``."""
    if not isinstance(model, str):
        if init_kwargs:
            raise PlaitError(f"model_init_kwargs={init_kwargs!r} only apply when {field} is a path or id; "
                             "load the model with them yourself or pass the path")
        return model
    preflight.model_source(model, field, init_kwargs)
    kwargs = {**pretrained_kwargs(), **(init_kwargs or {})}  # model_init_kwargs may say trust_remote_code itself
    legacy = kwargs.pop("torch_dtype", None)  # transformers 4's name, which TRL-era scripts still pass
    dtype = kwargs.get("dtype") or legacy or default_dtype
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise PlaitError(f"{field}: dtype={dtype!r} is not a torch dtype; use 'float32' (the default for a model that "
                             "trains), 'bfloat16', 'float16' or 'auto' (as the checkpoint stores it)")
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = dtype
    if auto_class is AutoModelForCausalLM and vision.vision_language_source(model):
        from transformers import AutoModelForImageTextToText as auto_class  # a VLM: its causal LM with a vision tower
    try:
        return auto_class.from_pretrained(model, **kwargs)
    except OSError as err:
        raise PlaitError(f"{field}={model!r} could not be loaded ({str(err).splitlines()[0]}); "
                         "pass a local folder with config.json and weights") from err


HALF_DTYPES = (torch.bfloat16, torch.float16)


def warn_if_half_precision_weights(model: torch.nn.Module) -> None:
    """Say loudly when weights that train are bf16/fp16: an optimizer's update of a bf16 weight w is lost
    whenever it is below half of bf16's spacing near w (2^-9 |w| to 2^-8 |w|), most of them at lr 2e-5:
    the run would finish having changed little or nothing. TRL trains such checkpoints as float32 too; this is for a model
    given already loaded in half precision, or ``dtype`` asked for explicitly."""
    half = [(name, p.dtype) for name, p in model.named_parameters() if p.requires_grad and p.dtype in HALF_DTYPES]
    if half:
        trainable = sum(p.requires_grad for p in model.parameters())
        logger.warning("plait: %d of %d trainable weight tensors are %s (e.g. %s): the optimizer's updates at "
                       "fine-tuning learning rates fall below that precision and are lost. Train float32 weights "
                       "(drop dtype from model_init_kwargs, or pass model.float()) with bf16=True for mixed precision.",
                       len(half), trainable, str(half[0][1]).removeprefix("torch."), half[0][0])


def agree_on_tokens(tokenizer, model: PreTrainedModel, *, eos: bool, pad: bool) -> None:
    """Make the model agree with the tokenizer's overridden EOS and/or pad token: its config's
    ids, its generation config's pad id, and the EOS as one more stop token there (any of them
    ends generation)."""
    tokenizer = chat.tokenizer_of(tokenizer)
    config, generation = model.config.get_text_config(), getattr(model, "generation_config", None)
    if pad:
        config.pad_token_id = tokenizer.pad_token_id
        if generation is not None:
            generation.pad_token_id = tokenizer.pad_token_id
    if eos:
        config.eos_token_id = tokenizer.eos_token_id
        stops = None if generation is None else generation.eos_token_id
        stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
        if generation is not None and tokenizer.eos_token_id not in stops:
            generation.eos_token_id = [tokenizer.eos_token_id, *stops]


def disable_dropout(model: torch.nn.Module) -> None:
    """p = 0 in every dropout module: sampling, scoring and the update all see the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0


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


def refuse_adapters_on_adapters(model, peft_config) -> None:
    """A model already wrapped in PEFT trains its own adapter; a peft_config would stack a second (TRL 1.16 refuses it too)."""
    if peft_config is not None and is_peft_model(model):
        raise PlaitError("model is already a PEFT model and peft_config would add adapters on top; merge its "
                         "adapter (merge_and_unload) and pass the base model with peft_config, or drop peft_config")


# Where the decoder layers of common architectures live, for create_reference_model's num_shared_layers.
LAYER_PATTERNS = ("model.layers.{layer}", "transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}")


def create_reference_model(model: torch.nn.Module, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> torch.nn.Module:
    """A frozen copy of ``model`` (eval mode, no gradients) to serve as a reference policy, as TRL's
    helper of that name makes it. With ``num_shared_layers`` = n the reference copies nothing before
    layer n (``pattern`` names layer paths, e.g. ``"model.layers.{layer}"``; common ones are tried
    otherwise): it holds the policy's own parameters there, which are frozen in the policy too, so
    the two models stay identical below layer n and that part is stored once."""
    reference = copy.deepcopy(model)
    if num_shared_layers is not None:
        names = [name for name, _ in model.named_parameters()]
        prefixes = [p.format(layer=num_shared_layers) + "." for p in ([pattern] if pattern else LAYER_PATTERNS)]
        first = next((i for i, name in enumerate(names) if name.startswith(tuple(prefixes))), None)
        if first is None:
            raise PlaitError(f"create_reference_model: num_shared_layers={num_shared_layers} but no parameter of "
                             f"{type(model).__name__} starts with {prefixes}; give pattern= with the layers' path, "
                             "e.g. 'model.layers.{layer}'")
        policy = dict(model.named_parameters())
        copies = dict(reference.named_parameters())
        shared = {id(copies[name]): policy[name] for name in names[:first]}
        for name, param in list(reference.named_parameters(remove_duplicate=False)):  # tied weights too
            if id(param) in shared:
                module, _, attr = name.rpartition(".")
                setattr(reference.get_submodule(module), attr, shared[id(param)])
        for param in shared.values():
            param.requires_grad_(False)
    return reference.requires_grad_(False).eval()


def check_same_vocabulary(model: PreTrainedModel, other: PreTrainedModel, field: str) -> None:
    """Log-probs of one tokenisation are only comparable under the same vocabulary."""
    mine, theirs = model.config.get_text_config().vocab_size, other.config.get_text_config().vocab_size
    if mine != theirs:
        raise PlaitError(f"{field} has vocab_size {theirs} but the policy has {mine}; the reference must share "
                         "the policy's tokenizer (use the same base checkpoint)")


class Reference:
    """The frozen policy a method regularises towards.

    One of four forms, chosen once at construction (:meth:`for_policy`): a separate frozen model
    (a deep copy of the policy by default, or a given ``ref_model``); with ``peft_config`` and no
    ``ref_model``, the policy itself with its adapters disabled (fresh adapters leave the base
    model's outputs unchanged, so that is the initial policy, with no second copy in memory); for
    a policy already wrapped in PEFT, a frozen copy of its active adapter added beside it (the
    initial policy, adapter included, at the cost of one adapter); or none (precomputed
    log-probs, beta = 0).
    """

    def __init__(self, model: PreTrainedModel | None, *, adapters_off: bool = False, adapter: str | None = None,
                 owned: bool = False):
        self.model = model
        self.adapters_off = adapters_off
        self.adapter = adapter  # the frozen adapter's name, in the policy's PEFT model
        self.owned = owned  # plait made the model (a copy, or loaded from a path): no one else holds it
        if model is not None:
            model.eval()
            model.requires_grad_(False)

    @classmethod
    def for_policy(cls, policy: PreTrainedModel, ref_model: str | PreTrainedModel | None = None,
                   init_kwargs: dict | None = None, *, peft_config=None) -> "Reference":
        """Build before the policy is wrapped by ``peft_config``, so a deep copy holds no adapters."""
        if ref_model is not None:
            ref = load_model(ref_model, init_kwargs, field="ref_model")
            check_same_vocabulary(policy, ref, "ref_model")
            return cls(ref, owned=isinstance(ref_model, str))
        if peft_config is not None:
            refuse_adapters_on_adapters(policy, peft_config)
            return cls.adapters_disabled()
        if is_peft_model(policy):
            return cls(None, adapter=_add_frozen_adapter_copy(policy))
        return cls(copy.deepcopy(policy), owned=True)

    @classmethod
    def adapters_disabled(cls) -> "Reference":
        return cls(None, adapters_off=True)

    @classmethod
    def none(cls) -> "Reference":
        return cls(None)

    @property
    def available(self) -> bool:
        return self.model is not None or self.adapters_off or self.adapter is not None

    def __call__(self, policy, compute: Callable[[Any], T]) -> T:
        """Run ``compute(model)`` under the reference, without gradients."""
        with torch.no_grad():
            if self.adapters_off:
                with _adapters_disabled(policy):
                    return compute(policy)
            if self.adapter is not None:
                with _adapter_active(policy, self.adapter):
                    return compute(policy)
            if self.model is None:
                raise PlaitError("no reference model is loaded (beta = 0 or precomputed log-probs)")
            return compute(self.model)

    def prepare(self, accelerator, *, synced: bool) -> None:
        """accelerate's evaluation-mode preparation of a separate reference model. Under mixed precision a
        reference plait made stores its frozen linear layers in autocast's dtype first: accelerate wraps
        the prepared model's forward in its autocast, so every reference forward runs under it wherever it
        is called, and the products are the same bit for bit at half the memory
        (:func:`plait.engine.autocast.frozen_linears_in_compute_dtype`). Not when ``sync_ref_model`` mixes
        the policy into it (``synced``: TR-DPO's mix is in float32), nor under DeepSpeed or FSDP, which
        shard and cast the model themselves."""
        if self.model is None:
            return
        dtype = COMPUTE_DTYPES.get(accelerator.mixed_precision) if accelerator.native_amp else None
        sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        if dtype is not None and self.owned and not synced and not sharded:
            frozen_linears_in_compute_dtype(self.model, dtype)
        self.model = accelerator.prepare_model(self.model, evaluation_mode=True)

    def check_syncable(self, policy, peft_config) -> None:
        """Refuse ``sync_ref_model=True`` where there is no separate reference to mix the policy into."""
        if is_peft_model(policy) or peft_config is not None:
            raise PlaitError("sync_ref_model=True mixes the policy's weights into a separate reference model, but the "
                             "policy has PEFT adapters (its reference is the same weights with adapters off or a "
                             "frozen adapter copy); train without PEFT or set sync_ref_model=False")
        if self.model is None:
            raise PlaitError("sync_ref_model=True but no reference model is loaded (beta = 0 uses none); "
                             "set sync_ref_model=False or beta > 0")

    @torch.no_grad()
    def mix_from(self, policy, alpha: float) -> None:
        """TR-DPO: π_ref ← α·π + (1−α)·π_ref (Gorbatovski et al. 2024, eq. 4)."""
        source = dict(_unwrap(policy).named_parameters())
        for name, param in self.model.named_parameters():
            param.mul_(1 - alpha).add_(source[name].detach().to(param.dtype), alpha=alpha)


@attrs.define(slots=False)  # a mixin: params classes also inherit LossChoice, and two slotted bases cannot mix
class ReferenceSync:
    """TR-DPO's knobs (Gorbatovski et al. 2024), shared by every method with a reference; TRL's
    names and defaults. ``sync_ref_model`` mixes the policy into the reference every
    ``ref_model_sync_steps`` optimizer steps with weight ``ref_model_mixup_alpha``."""

    field_help: ClassVar[dict[str, str]] = {
        "sync_ref_model": "mix the policy into the reference model periodically (TR-DPO)",
        "ref_model_mixup_alpha": "policy weight alpha of each mix: ref = alpha * policy + (1 - alpha) * ref",
        "ref_model_sync_steps": "optimizer steps between two mixes of the policy into the reference",
    }

    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = attrs.field(default=0.6, validator=in_range(0.0, 1.0))
    ref_model_sync_steps: int = attrs.field(default=512, validator=positive)

    def __attrs_post_init__(self) -> None:
        parent = getattr(super(), "__attrs_post_init__", None)
        if parent is not None:
            parent()
        if self.sync_ref_model and getattr(self, "precompute_ref_log_probs", False):
            raise PlaitError("precompute_ref_log_probs=True cannot be combined with sync_ref_model=True (the cached "
                             "reference log-probs would go stale); turn one off")


class SyncReference(TrainerCallback):
    """Every ``ref_model_sync_steps`` optimizer steps, mix the policy into the reference (TR-DPO, eq. 4)."""

    def __init__(self, reference: Reference):
        self.reference = reference

    def on_step_end(self, args, state, control, model=None, **kwargs):
        p = args.params
        if state.global_step % p.ref_model_sync_steps == 0:
            self.reference.mix_from(model, p.ref_model_mixup_alpha)


def _unwrap(model):
    return getattr(model, "module", model)


# The frozen adapter copy's name: TRL 1.16's, so a saved PEFT folder looks the same.
REFERENCE_ADAPTER = "ref"


def _add_frozen_adapter_copy(policy) -> str:
    """Add to a PEFT policy a frozen copy of its active adapter; return the copy's name."""
    active = policy.active_adapter
    if not isinstance(active, str):
        raise PlaitError(f"the policy has several active adapters {active!r}; activate one or pass ref_model")
    if REFERENCE_ADAPTER in policy.peft_config:
        raise PlaitError(f"the policy already has an adapter named {REFERENCE_ADAPTER!r}; rename or delete it, "
                         "or pass ref_model")
    policy.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(policy.peft_config[active]))
    tensors = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
    source, target = f".{active}.", f".{REFERENCE_ADAPTER}."
    with torch.no_grad():
        for name, tensor in tensors.items():
            if target in name:
                tensor.copy_(tensors[name.replace(target, source)])
                tensor.requires_grad_(False)
    return REFERENCE_ADAPTER


@contextlib.contextmanager
def _adapter_active(policy, name: str):
    """``name`` as the policy's only active adapter for the duration; which weights train is left as it was."""
    model = _unwrap(policy)
    previous = model.active_adapter
    trainable = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(previous)
        for param, flag in trainable:
            param.requires_grad_(flag)


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


REF_LOGPS_CACHE_MB = 1024  # the bound of the reference log-prob cache by default; PLAIT_REF_LOGPS_CACHE_MB sets it


def ref_logps_cache_bytes() -> int:
    """The reference log-prob cache's bound in bytes: ``$PLAIT_REF_LOGPS_CACHE_MB`` MiB (0: cache nothing)."""
    given = os.environ.get("PLAIT_REF_LOGPS_CACHE_MB", "").strip()
    try:
        megabytes = float(given) if given else REF_LOGPS_CACHE_MB
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise PlaitError(f"PLAIT_REF_LOGPS_CACHE_MB={given!r} must be a number of MiB >= 0 (0 caches nothing); "
                         f"unset, it is {REF_LOGPS_CACHE_MB}")
    return int(megabytes * 2**20)


def cached_tensors(depends_on: Mapping[str, Any], compute: Callable[[], dict]) -> dict:
    """``compute()`` once per distinct ``depends_on``: everything the numbers are a function of.

    Models count by the content of their weights (:func:`weights_digest`), tokenizers by what they
    save, datasets by their fingerprint, other values by their repr; never by a path, so a model
    replaced in the same folder computes afresh. Kept as a safetensors file in ``ref_logps/`` of
    plait's cache folder (:func:`plait.paths.cache_dir`), written atomically; the folder is kept
    within :func:`ref_logps_cache_bytes` (1 GiB unless set), the least recently used entries
    deleted first. When something has no stable identity (weights offloaded to disk) nothing is cached.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load, save


    parts = {name: _identity(value) for name, value in sorted(depends_on.items())}
    bound = ref_logps_cache_bytes()
    if bound == 0 or any(part is None for part in parts.values()):
        return compute()
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    cache = cache_dir("ref_logps", f"{key}.safetensors")
    stored = read_cached(cache)
    if stored is not None:
        try:
            return load(stored)
        except SafetensorError:  # a damaged entry: computed again and replaced
            pass
    tensors = compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(cache, save(tensors))
    keep_within(cache.parent, bound)
    return tensors
