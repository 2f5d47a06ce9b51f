"""plait's built-in reward plugins, and TRL 1.16's ``trl.rewards`` functions under TRL's names.

``from plait.rewards import accuracy_reward, get_soft_overlong_punishment, ...`` gives plain
callables with TRL's signatures; each is a configuration of the registered plugin beside it
(``reward.accuracy``, ``reward.soft_overlong``, ...), and each is also registered under its TRL
name, so ``reward_funcs: [accuracy_reward, think_format_reward]`` works in a recipe.
"""

from .accuracy import accuracy_reward
from .cosine_scaled import get_cosine_scaled_reward
from .reasoning_accuracy import reasoning_accuracy_reward
from .repetition import get_repetition_penalty_reward
from .soft_overlong import get_soft_overlong_punishment
from .think_format import think_format_reward

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
