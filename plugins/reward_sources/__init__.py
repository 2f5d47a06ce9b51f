"""Reward sources (``resolve_reward``): what a ``reward_funcs`` entry may be besides a registered name."""
