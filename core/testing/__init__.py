"""Tools for testing plait plugins: hypothesis strategies, contract checks, a pytest plugin.

    from plait.testing import check_loss, check_reward, check_advantage_estimator

    def test_contract():
        check_loss("dpo.my_loss")        # raises ContractViolation naming the property and input

Names are imported on first use, so ``plait.testing.tiny_model`` works without hypothesis.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "contracts": ("ContractViolation", "check_advantage_estimator", "check_callbacks", "check_collator",
                  "check_command", "check_component", "check_data_format", "check_environment",
                  "check_generation_backend", "check_judge", "check_loss", "check_method", "check_packing_strategy",
                  "check_params", "check_reward", "check_rollout_filter", "describe", "encoded_rows",
                  "check_chat_template", "check_turn_advantage_estimator"),
    "strategies": ("BatchKind", "batch_kind", "batches", "pairwise_rewards", "policy_tokens", "preference_logps",
                   "register_batch_kind", "reward_inputs", "rollouts", "take", "token_distributions", "token_logps",
                   "unpaired_logps", "value_tokens"),
    "tiny_model": ("build_tiny_model", "tiny_model_path"),
    "tiny_vlm": ("build_tiny_vlm", "shapes_dataset", "tiny_vlm_path"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
