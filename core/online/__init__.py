"""Online learning from the policy's own samples: the rollout chassis (sample, score, estimate,
record), its buffer and sampler, reward scoring, importance sampling, the generation-backend
interface, and multi-turn agents with their tools."""
