"""Judges (``register_judges``): which of two completions of a prompt is better, for online DPO.

A judge is ``judge(prompts, completion_pairs) -> list[int]``: 0 or 1 for the preferred completion
of each pair, -1 for a tie. Each is registered as a factory ``factory(params, plugins)`` with its
attrs params, so a recipe names it (``judge: {name: rules, rewards: [...]}``). A judge that scores
each completion on its own (``judge.reward_model``, ``judge.rules``) also has
``scores(prompts, completions, ...) -> Tensor [N]``; a method may then shape the scores
(online DPO's ``missing_eos_penalty``) before comparing them.
"""
