"""TRL's ``trl.experimental.<name>`` import paths, so ``s/trl/plait/`` ports a script's experimental imports too.

``from plait.experimental.orpo import ORPOConfig, ORPOTrainer`` gives the classes ``plait.ORPOConfig`` names:
each path below is a module of this one's (registered in ``sys.modules`` when ``plait.experimental`` is first
imported) whose names resolve, on first use, through ``plait``'s method registry, as every top-level method
name does. Only the paths of methods plait implements are here; TRL's other experimental trainers are not.
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


def _module(path: str, names: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{path}", f"TRL's ``trl.experimental.{path}``: {', '.join(names)}.")

    def resolve(name: str):
        if name not in names:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}; it has {', '.join(names)}")
        import plait

        return getattr(plait, name)

    module.__getattr__ = resolve  # PEP 562: resolved when first used, so importing the path loads nothing
    module.__all__ = list(names)
    return module


for _path, _names in PATHS.items():
    sys.modules[f"{__name__}.{_path}"] = globals()[_path] = _module(_path, _names)
