"""TRL 1.16's model helpers (``trl.models``) under TRL's names, on plait's own code: ``prepare_deepspeed``."""

from __future__ import annotations

import copy
from typing import Any

from plait.errors import PlaitError


def prepare_deepspeed(model: Any, accelerator: Any):
    """A frozen model beside the policy (a reference, a teacher, a reward model) as a DeepSpeed engine for
    evaluation, in a run the accelerator launched with DeepSpeed (TRL's helper): the run's DeepSpeed config without
    what only training reads (``optimizer``, ``scheduler``, optimizer offload). Under ZeRO-3 the model is sharded
    as the policy is, its communication buckets sized from its hidden size h (reduce h², prefetch 0.9·h²,
    parameters under 10·h kept whole); under any other stage each process holds all of it (stage 0)."""
    try:
        import deepspeed
    except ImportError:
        raise PlaitError("prepare_deepspeed needs DeepSpeed: pip install deepspeed") from None
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        raise PlaitError("prepare_deepspeed: the accelerator runs without DeepSpeed; launch with a DeepSpeed config, "
                         "or place the model with accelerator.prepare_model(model, evaluation_mode=True)")
    config = copy.deepcopy(plugin.deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("stage") == 3:
        sizes = getattr(model.config, "hidden_sizes", None)
        hidden = max(sizes) if sizes else getattr(model.config, "hidden_size", None)
        if hidden is not None:
            zero.update(reduce_bucket_size=hidden * hidden, stage3_prefetch_bucket_size=0.9 * hidden * hidden,
                        stage3_param_persistence_threshold=10 * hidden)
    else:
        zero["stage"] = 0
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
