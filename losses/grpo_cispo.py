"""CISPO: REINFORCE with a truncated, detached importance weight; no token is ever clipped out.

MiniMax 2025, "MiniMax-M1", eq. 4; ScaleRL (Khatri et al. 2025). Per token:

    L_t = −sg(min(ρ, ε_high))·A·log π        (sg: stop-gradient)

PPO's clip zeroes the gradient of tokens whose ratio left the trust region (often the rare
"fork" tokens); CISPO keeps every token's gradient and only bounds its weight. ``epsilon_high``
is the cap (ScaleRL uses 5.0). Normalised as ``dapo``. Returns a scalar.
"""

import torch

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, generation_token_mean, log_ratio, regularise


def grpo_cispo(batch: PolicyTokens, p: ClipParams):
    weight = torch.clamp(torch.exp(log_ratio(batch, p.importance_sampling_level)), max=p.eps_high).detach()
    per_token = -weight * batch.token_advantages * batch.logps
    return generation_token_mean(regularise(per_token, batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.cispo", grpo_cispo, params=ClipParams, consumes=PolicyTokens, output="scalar")
