"""TRL's ``trl.experimental.<name>`` import paths, so ``s/trl/plait/`` ports a script's experimental imports too.

``from plait.experimental.orpo import ORPOConfig, ORPOTrainer`` gives the classes ``plait.ORPOConfig`` names:
each path below is a module of this one's (registered in ``sys.modules`` when ``plait.experimental`` is first
imported) whose names resolve, on first use, through ``plait``'s method registry, as every top-level method
name does. Only the paths of methods plait implements are here; TRL's other experimental trainers are not.

TRL's other module paths that scripts and TRL's own tests import names from (``trl.trainer.sft_trainer``,
``trl.models``, :data:`TRL_PATHS`) are registered the same way under ``plait`` when ``plait`` is imported.
"""

from __future__ import annotations

import sys
import types

# TRL 1.16's experimental module -> the names it exports (each one a top-level name of plait)
PATHS = {
    "orpo": ("ORPOConfig", "ORPOTrainer"),
    "cpo": ("CPOConfig", "CPOTrainer"),
    "gkd": ("GKDConfig", "GKDTrainer"),
    "online_dpo": ("OnlineDPOConfig", "OnlineDPOTrainer"),
    "kto": ("KTOConfig", "KTOTrainer"),
    "distillation": ("DistillationConfig", "DistillationTrainer"),
    "async_grpo": ("AsyncGRPOConfig", "AsyncGRPOTrainer"),
}


# TRL 1.16's module paths outside trl.experimental -> the names of each that plait has (top-level names of plait)
TRL_PATHS = {
    "trainer.sft_trainer": ("SFTConfig", "SFTTrainer", "DataCollatorForLanguageModeling",
                            "DataCollatorForVisionLanguageModeling"),
    "trainer.dpo_trainer": ("DPOConfig", "DPOTrainer", "DataCollatorForPreference", "DataCollatorForVisionPreference"),
    "trainer.kto_trainer": ("KTOConfig", "KTOTrainer", "DataCollatorForUnpairedPreference",
                            "DataCollatorForVisionUnpairedPreference"),
    "trainer.reward_trainer": ("RewardConfig", "RewardTrainer", "DataCollatorForPreference"),
    "trainer.grpo_trainer": ("GRPOConfig", "GRPOTrainer"),
    "trainer.rloo_trainer": ("RLOOConfig", "RLOOTrainer"),
    "models": ("create_reference_model", "prepare_deepspeed"),
}


def _module(path: str, names: tuple[str, ...], package: str = __name__) -> types.ModuleType:
    trl = f"trl{package.removeprefix('plait')}.{path}"
    module = types.ModuleType(f"{package}.{path}", f"TRL's ``{trl}``: {', '.join(names)}.")

    def resolve(name: str):
        if name not in names:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}; it has {', '.join(names)}")
        return getattr(sys.modules["plait"], name)  # imported before any of its paths: plait imports this module

    module.__getattr__ = resolve  # PEP 562: resolved when first used, so importing the path loads nothing
    module.__all__ = list(names)
    return module


for _path, _names in PATHS.items():
    sys.modules[f"{__name__}.{_path}"] = globals()[_path] = _module(_path, _names)


def register_trl_paths(package: str = "plait") -> None:
    """Put :data:`TRL_PATHS` in ``sys.modules`` under ``package`` (``plait.trainer.sft_trainer``, ``plait.models``),
    each parent a module holding its children, so ``from plait.trainer.dpo_trainer import DPOTrainer`` works."""
    for path, names in TRL_PATHS.items():
        parent, _, leaf = f"{package}.{path}".rpartition(".")
        if parent not in sys.modules:  # plait.trainer: a package of paths only
            sys.modules[parent] = types.ModuleType(parent, f"TRL's ``trl{parent.removeprefix(package)}`` paths.")
            setattr(sys.modules[package], parent.rpartition(".")[2], sys.modules[parent])
        sys.modules[f"{parent}.{leaf}"] = child = _module(path, names, package)
        setattr(sys.modules[parent], leaf, child)
