"""plait's built-in reward plugins, and TRL 1.16's ``trl.rewards`` functions under TRL's names.

``from plait.rewards import accuracy_reward, get_soft_overlong_punishment, ...`` gives plain
callables with TRL's signatures; each is a configuration of the registered plugin beside it
(``reward.accuracy``, ``reward.soft_overlong``, ...), and each is also registered under its TRL
name, so ``reward_funcs: [accuracy_reward, think_format_reward]`` works in a recipe.

The names are imported on first use: ``plait list`` reads this package without importing torch.
"""

from importlib import import_module

# TRL's name -> the plugin module that defines it
TRL_NAMES = {
    "accuracy_reward": "accuracy",
    "get_cosine_scaled_reward": "cosine_scaled",
    "get_repetition_penalty_reward": "repetition",
    "get_soft_overlong_punishment": "soft_overlong",
    "reasoning_accuracy_reward": "reasoning_accuracy",
    "think_format_reward": "think_format",
}

__all__ = sorted(TRL_NAMES)


def __getattr__(name: str):
    if name in TRL_NAMES:
        return getattr(import_module(f".{TRL_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'plait.rewards' has no attribute {name!r}")
