"""plait: post-training for language models as a registry of pluggy plugins.

The top-level names of method plugins (``plait.DPOConfig``, ``plait.DPOTrainer``, and those of
any installed third-party method) are looked up in the method registry on first access.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from plait.engine.memory import align_large_cpu_buffers

from .errors import PlaitError, PluginLoadError
from .experimental import register_trl_paths
from .hookspecs import hookimpl
from .manager import default_plugins, make_plugins
from .method import Method

align_large_cpu_buffers()  # none of the above imports torch: this comes before its first CPU tensor, when it reads the switch

try:
    __version__ = _version("plait")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0.0.0"

register_trl_paths(__name__)  # plait.trainer.sft_trainer, plait.models ...: TRL's module paths, resolved on use

__all__ = ["Method", "PlaitError", "PluginLoadError", "__version__", "default_plugins", "hookimpl", "make_plugins"]


SCRIPT_ARGS = ("ModelConfig", "ScriptArguments", "DatasetConfig", "DatasetMixtureConfig", "PlaitParser", "TrlParser",
               "get_peft_config", "get_quantization_config", "get_kbit_device_map", "get_dataset")
# TRL's data utilities and collators (plait.trl.data_utils) and callbacks (plait.trl.callbacks), by TRL's names
DATA_UTILS = ("apply_chat_template", "maybe_apply_chat_template", "extract_prompt", "maybe_extract_prompt",
              "unpair_preference_dataset", "maybe_unpair_preference_dataset", "is_conversational", "pack_dataset",
              "truncate_dataset", "clone_chat_template", "is_conversational_from_value", "maybe_convert_to_chatml",
              "prepare_multimodal_messages", "DataCollatorForLanguageModeling", "DataCollatorForVisionLanguageModeling",
              "DataCollatorForPreference", "DataCollatorForUnpairedPreference", "DataCollatorForVisionPreference",
              "DataCollatorForVisionUnpairedPreference")
CALLBACKS = ("LogCompletionsCallback", "SyncRefModelCallback", "RichProgressCallback", "BEMACallback",
             "MergeConfig", "MergeModelCallback")
MODELS = ("prepare_deepspeed",)  # TRL's model helpers (plait.trl.models)


def __getattr__(name: str):
    if name == "create_reference_model":
        from plait.engine.models import create_reference_model

        return create_reference_model
    if name in SCRIPT_ARGS:  # TRL's script helpers; imported on first use (they import transformers)
        from .trl import script_args

        return getattr(script_args, name)
    if name in DATA_UTILS or name in CALLBACKS or name in MODELS:  # imported on first use, as the script helpers
        from importlib import import_module

        module = ".trl.data_utils" if name in DATA_UTILS else ".trl.callbacks" if name in CALLBACKS else ".trl.models"
        return getattr(import_module(module, __name__), name)
    # DPOConfig, DPOTrainer, ... come from whichever plugin registered the method.
    if name[:1].isupper():
        for component in default_plugins().methods:
            for cls in (component.obj.config, component.obj.trainer):
                if cls.__name__ == name:
                    return cls
            if name in component.obj.exports:
                return component.obj.exports[name]
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
