"""A policy's weights as a generation backend receives them: Hugging Face names, PEFT adapters
merged in, each tensor whole (gathered first where training shards it). The vLLM backends push
them to an engine; async GRPO's rollout worker receives them the same way."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


@contextlib.contextmanager
def policy_parameters(model) -> Iterator[list[tuple[str, Any]]]:
    """The policy's parameters under Hugging Face names, PEFT adapters merged in.

    ``model`` may be wrapped (DDP, accelerate) or a PEFT model. Plain LoRA layers are merged out
    of place (base weight + each active adapter's delta, computed when the weight is read), so the
    frozen base weights are never touched: an in-place merge and unmerge would leave rounding
    drift in them after every push. Other adapters (DoRA, other tuners) are merged in place for
    the duration and unmerged after. Tied parameters appear once.
    """
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    if not (hasattr(model, "peft_config") and hasattr(model, "merge_adapter")):
        yield list(model.named_parameters())
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    out_of_place = all(_plain_lora(m) for m in layers.values())
    if not out_of_place:
        model.merge_adapter()
    try:
        prefix = getattr(model.base_model, "prefix", "lora_")
        named = []
        for name, param in model.named_parameters():
            if prefix in name or "original_module" in name:
                continue  # adapter weights, and the frozen copy of a modules_to_save module
            owner = name.removesuffix(".base_layer.weight")
            if out_of_place and owner != name and owner in layers:
                param = LoraMerged(layers[owner])
            named.append((_base_name(name), param))
        yield named
    finally:
        if not out_of_place:
            model.unmerge_adapter()


def _plain_lora(module) -> bool:
    """A LoRA layer whose merge is base + delta (no DoRA or other variant, no LoRA bias)."""
    from peft.tuners.lora import LoraLayer

    return (isinstance(module, LoraLayer) and not module.merged
            and not any(a in module.lora_variant or module.lora_bias.get(a, False) for a in module.active_adapters))


class LoraMerged:
    """The weight of a LoRA layer's base layer with its active adapters' deltas added (when read)."""

    def __init__(self, layer):
        self.layer, self.base = layer, layer.get_base_layer().weight
        self.shape, self.dtype = self.base.shape, self.base.dtype

    def element_size(self) -> int:
        return self.base.element_size()

    def value(self) -> torch.Tensor:
        weight = self.base.detach()
        if self.layer.disable_adapters:
            return weight
        for adapter in self.layer.active_adapters:
            if adapter in self.layer.lora_A or adapter in self.layer.lora_embedding_A:
                weight = weight + self.layer.get_delta_weight(adapter).detach().to(weight.dtype)
        return weight


def _base_name(name: str) -> str:
    """A PEFT parameter name as the base model has it."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


@contextlib.contextmanager
def full_tensor(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """The whole of a parameter, gathered first when training shards it (FSDP2 DTensor, ZeRO-3)."""
    if isinstance(param, LoraMerged):
        with torch.no_grad():
            yield param.value()
    elif hasattr(param, "full_tensor"):  # DTensor (FSDP2, tensor parallel)
        yield param.full_tensor().detach()
    elif hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3: every rank takes part in the gather
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            yield param.data
    else:
        yield param.detach()


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def materialised(named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) one at a time; a gathered tensor lives until the consumer asks for the next."""
    for name, param in named:
        with full_tensor(param) as tensor:
            yield name, tensor


# ---------------------------------------------------------------------------------------------
# The adapter alone: what an engine serving LoRA adapters (vLLM's enable_lora) needs each sync
# ---------------------------------------------------------------------------------------------


def lora_unservable(model) -> str | None:
    """Why the policy cannot reach an engine as its LoRA adapter alone, or None when it can.

    It can when it is a PEFT model with one active plain LoRA adapter on linear layers: no DoRA
    or other variant, no LoRA bias, no embedding adapters and no ``modules_to_save`` (full
    trained copies of modules, which only a merged push carries)."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    if not (hasattr(model, "peft_config") and hasattr(model, "merge_adapter")):  # a PeftModel
        return "the policy has no PEFT adapter"
    adapters = list(model.active_adapters)
    config = model.peft_config[adapters[0]]
    if len(adapters) != 1 or getattr(config, "peft_type", None) != "LORA":
        return f"the policy's active adapters {adapters} are not one LoRA adapter"
    if getattr(config, "use_dora", False) or getattr(config, "bias", "none") != "none":
        return "the adapter uses DoRA or trains biases"
    if getattr(config, "modules_to_save", None):
        return f"the adapter trains whole modules too (modules_to_save={config.modules_to_save})"
    from peft.tuners.lora import LoraLayer

    if any(m.lora_embedding_A for m in model.modules() if isinstance(m, LoraLayer)):
        return "the adapter targets embedding layers"
    return None


def lora_rank(model) -> int:
    """The largest rank of the policy's active LoRA adapter (``r`` and its ``rank_pattern``)."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    config = model.peft_config[model.active_adapters[0]]
    return max([config.r, *(config.rank_pattern or {}).values()])


@contextlib.contextmanager
def base_parameters(model) -> Iterator[list[tuple[str, Any]]]:
    """The frozen base model's parameters under Hugging Face names, adapters left out (not merged)."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    prefix = getattr(model.base_model, "prefix", "lora_")
    yield [(_base_name(name), param) for name, param in model.named_parameters()
           if prefix not in name and "original_module" not in name]


def adapter_parameters(model) -> list[tuple[str, Any]]:
    """The active LoRA adapter's parameters under the names PEFT saves them with
    (``base_model.model.<module>.lora_A.weight``): what ``adapter_model.safetensors`` holds."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    adapter = model.active_adapters[0]
    marker = f".{adapter}."
    return [(name.replace(marker, "."), param) for name, param in model.named_parameters()
            if ".lora_" in name and marker in name]


def save_adapter(model, folder: str) -> int:
    """Write the active LoRA adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors)
    that vLLM loads with ``LoRARequest``; sharded tensors are gathered one at a time. Returns the
    bytes of tensor data written."""
    import os

    from accelerate.utils import extract_model_from_parallel
    from safetensors.torch import save_file

    unwrapped = extract_model_from_parallel(model)
    os.makedirs(folder, exist_ok=True)
    unwrapped.peft_config[unwrapped.active_adapters[0]].save_pretrained(folder)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone()
               for name, tensor in materialised(adapter_parameters(unwrapped))}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def payload_bytes(named: Sequence[tuple[str, Any]]) -> int:
    """Bytes of tensor data in (name, parameter) pairs, at their whole (unsharded) shapes."""
    return sum(int(torch.Size(full_shape(param)).numel()) * param.element_size() for _, param in named)
