"""The typed inputs losses consume: log-probs, never logits, never a model.

A loss declares the batch class it reads with ``consumes=`` when it registers; a method
builds that batch once per step from the one log-prob path (:mod:`plait.engine.logprobs`) and hands
the same object to every loss it composes.
"""

from __future__ import annotations

from typing import Callable

import attrs
from torch import Tensor


def _identity(x: Tensor) -> Tensor:
    return x


def _frozen(x: Tensor | None) -> Tensor | None:
    """Reference and sampling-time log-probs are constants: no loss may send gradient into them."""
    return None if x is None else x.detach()


@attrs.frozen
class PreferenceLogps:
    """Summed completion log-probs for B preference pairs; every tensor has shape ``[B]``.

    ``divergence`` is the f-divergence transform s = f(r) the method applies to each
    log-ratio r = log π − log π_ref before losses form a margin (reverse KL: s = r).
    ``unweighted_chosen_logps`` is Σ_t log π(y_c,t) with every token counted once, given by a
    method that weights tokens in ``chosen_logps`` (LD-DPO); None when they are the same.
    ``chosen_sequence_logps`` is Σ_t log π over every predicted token of the chosen row, prompt
    included, and ``chosen_sequence_lengths`` their count, for a loss that trains on the whole
    sequence (ORPO's NLL as its authors and TRL 1.16 compute it); None when the method gives none.
    A reference-free method (ORPO, CPO) gives zeros as the reference log-probs.
    """

    chosen_logps: Tensor
    rejected_logps: Tensor
    ref_chosen_logps: Tensor = attrs.field(converter=_frozen)
    ref_rejected_logps: Tensor = attrs.field(converter=_frozen)
    chosen_lengths: Tensor
    rejected_lengths: Tensor
    divergence: Callable[[Tensor], Tensor] = _identity
    unweighted_chosen_logps: Tensor | None = None
    chosen_sequence_logps: Tensor | None = None
    chosen_sequence_lengths: Tensor | None = None

    @property
    def plain_chosen_logps(self) -> Tensor:
        """Σ_t log π(y_c,t), every token counted once (whatever weights ``chosen_logps`` carries)."""
        return self.chosen_logps if self.unweighted_chosen_logps is None else self.unweighted_chosen_logps

    @property
    def chosen_logratios(self) -> Tensor:
        """r_c = log π(y_c|x) − log π_ref(y_c|x)."""
        return self.chosen_logps - self.ref_chosen_logps

    @property
    def rejected_logratios(self) -> Tensor:
        return self.rejected_logps - self.ref_rejected_logps

    @property
    def chosen_scores(self) -> Tensor:
        """s_c = f(r_c)."""
        return self.divergence(self.chosen_logratios)

    @property
    def rejected_scores(self) -> Tensor:
        return self.divergence(self.rejected_logratios)

    @property
    def margin(self) -> Tensor:
        """Δ = s_c − s_r."""
        return self.chosen_scores - self.rejected_scores

    @property
    def batch_size(self) -> int:
        return self.chosen_logps.shape[0]

    def reward_metrics(self, beta: float) -> dict[str, Tensor]:
        """The preference families' default metrics: DPO's implicit rewards β·r (Rafailov et al. 2023,
        §5), β·log π for a reference-free method (whose reference log-probs are zeros)."""
        return preference_metrics((beta * self.chosen_logratios, beta * self.rejected_logratios),
                                  (self.chosen_logps, self.rejected_logps))


def preference_metrics(rewards: tuple[Tensor, Tensor], logps: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """What TRL logs for preference pairs, per pair (the objective averages): rewards/{chosen, rejected,
    margins, accuracies} from each side's reward, logps/{chosen, rejected} from its log-probs."""
    (chosen, rejected), (logps_chosen, logps_rejected) = rewards, logps
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
            "rewards/accuracies": (chosen > rejected).float(),
            "logps/chosen": logps_chosen, "logps/rejected": logps_rejected}


def logit_metrics(logit_mean: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """logits/{chosen, rejected}: the mean logit over the completion tokens of 2B rows [chosen…; rejected…]
    (``logit_mean`` ``[2B, T]``, each position's mean over the vocabulary): the model's, not a loss's."""
    (chosen, rejected), (mask_chosen, mask_rejected) = logit_mean.chunk(2), mask.chunk(2)
    return {"logits/chosen": masked_mean(chosen, mask_chosen), "logits/rejected": masked_mean(rejected, mask_rejected)}


@attrs.frozen
class UnpairedLogps:
    """Summed completion log-probs for B unpaired examples (KTO); tensors of shape ``[B]``.

    ``desirable`` is a bool mask; ``kl_logratio`` is the detached batch estimate z of the
    policy/reference KL on mismatched (prompt, completion) pairs, a 0-dim tensor.
    """

    logps: Tensor
    ref_logps: Tensor = attrs.field(converter=_frozen)
    desirable: Tensor
    kl_logratio: Tensor = attrs.field(converter=_frozen)

    @property
    def logratios(self) -> Tensor:
        return self.logps - self.ref_logps

    @property
    def batch_size(self) -> int:
        return self.logps.shape[0]

    def reward_metrics(self, beta: float) -> dict[str, Tensor]:
        """KTO's default metrics, each over its class (NaN where the batch holds none of it, and so for
        rewards/margins unless it holds both): rewards/* of β·r, logps/*, and the reference point kl."""
        rewards, desirable = beta * self.logratios, self.desirable
        chosen, rejected = _mean_or_nan(rewards[desirable]), _mean_or_nan(rewards[~desirable])
        return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                "logps/chosen": _mean_or_nan(self.logps[desirable]),
                "logps/rejected": _mean_or_nan(self.logps[~desirable]), "kl": self.kl_logratio}


def _mean_or_nan(values: Tensor) -> Tensor:
    return values.mean() if values.numel() else values.new_tensor(float("nan"))


@attrs.frozen
class TokenLogps:
    """Per-token log-probs of the target tokens, ``[B, T]``, with the loss mask ``[B, T]``."""

    logps: Tensor
    mask: Tensor

    @property
    def batch_size(self) -> int:
        return self.logps.shape[0]


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


@attrs.frozen
class Rollout:
    """Scores of N completions for an advantage estimator.

    Rows are grouped by prompt: ``group_size`` consecutive rows share one prompt. ``rewards``
    is ``[N, K]``, one column per reward function, NaN where a function returned None;
    ``weights`` is ``[K]``. Token-level estimators (GAE) also get per-token ``token_rewards``,
    ``values`` and ``mask``, each ``[N, T]``.

    Multi-turn rollouts carry their turns for turn-level estimators: ``turn_index`` ``[N, T]`` (long)
    is the model turn (0, 1, ...) each completion token belongs to, −1 for tokens outside every
    model turn (inserted by an environment, padding); ``turn_rewards`` ``[N, M]`` the per-turn
    reward an environment gave each model turn, NaN where it gave none. Row i has K_i turns: one
    past the last turn that holds a token or a reward (at least 1). None for single-turn rollouts.
    """

    rewards: Tensor
    weights: Tensor
    group_size: int
    token_rewards: Tensor | None = None
    values: Tensor | None = None
    mask: Tensor | None = None
    turn_rewards: Tensor | None = None
    turn_index: Tensor | None = None

    @property
    def total_reward(self) -> Tensor:
        """R = Σ_k w_k·r_k ignoring None (NaN) entries; NaN where every reward is None."""
        weighted = self.rewards * self.weights
        total = weighted.nansum(dim=1)
        return total.masked_fill(self.rewards.isnan().all(dim=1), float("nan"))

    @property
    def num_groups(self) -> int:
        return self.rewards.shape[0] // self.group_size


def _zeros_like_chosen(instance: "PairwiseRewards") -> Tensor:
    return instance.chosen_rewards.new_zeros(instance.chosen_rewards.shape)


@attrs.frozen
class PairwiseRewards:
    """Scalar rewards of B preference pairs from a reward model; every tensor has shape ``[B]``.

    ``margin`` is the optional per-pair margin column of the data (zeros when absent).
    """

    chosen_rewards: Tensor
    rejected_rewards: Tensor
    margin: Tensor = attrs.field(default=attrs.Factory(_zeros_like_chosen, takes_self=True))

    @property
    def batch_size(self) -> int:
        return self.chosen_rewards.shape[0]

    def reward_metrics(self) -> dict[str, Tensor]:
        """A reward model's default metrics per pair: accuracy (chosen scored above rejected), the
        score margin, and each side's score."""
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        return {"accuracy": (chosen > rejected).float(), "margin": chosen - rejected,
                "rewards/chosen": chosen, "rewards/rejected": rejected}


@attrs.frozen
class PolicyTokens:
    """Per-token log-probs of B sampled completions for a policy-gradient loss (GRPO, RLOO).

    ``logps`` ``[B, T]`` are the current policy's (with gradient), ``old_logps`` the sampling
    policy's (detached; equal to ``logps.detach()`` when the batch is used once, on-policy),
    ``ref_logps`` the reference's (None when beta = 0: no reference exists). ``advantages`` is
    ``[B]`` (one per sequence) or ``[B, T]``; ``mask`` ``[B, T]`` marks completion tokens that
    count. ``importance_weights`` ``[B, T]`` multiply the per-token policy term (the correction
    for a sampler whose log-probs differ from the trainer's, e.g. a bf16 vLLM engine) or None.

    Normalisers a loss may need: ``num_items_in_batch``, the active-token count a token-sum is
    divided by (the generation batch's tokens per process, scaled to one optimizer step; None:
    this batch's own ``mask.sum()``), ``gradient_accumulation_steps`` (micro-batches summed into
    one optimizer step) and ``max_completion_length`` (None: T).

    ``entropy`` ``[B, T]`` is the entropy of the (tempered) next-token distribution that sampled
    each token, from the same forward as ``logps`` and with gradient (None: not computed).
    ``sampling_logps`` ``[B, T]`` are the log-probs the sampler itself reported (a vLLM engine;
    NaN where it could not score a token), None when the backend reports none. ``gather`` joins a
    1-D tensor's values from every process (the identity in one process), for a statistic over
    the whole micro-batch of all processes, such as an entropy quantile.
    ``tool_mask`` ``[B, T]`` marks tokens a tool or an environment inserted into a multi-turn
    completion (context for later turns, never sampled by the policy): they are outside ``mask``,
    so no loss reads them; None for single-turn rollouts.
    """

    logps: Tensor
    old_logps: Tensor = attrs.field(converter=_frozen)
    advantages: Tensor
    mask: Tensor
    ref_logps: Tensor | None = attrs.field(default=None, converter=_frozen)
    importance_weights: Tensor | None = None
    num_items_in_batch: Tensor | float | None = None
    gradient_accumulation_steps: int = 1
    max_completion_length: int | None = None
    entropy: Tensor | None = None
    sampling_logps: Tensor | None = attrs.field(default=None, converter=_frozen)
    gather: Callable[[Tensor], Tensor] = _identity
    tool_mask: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.logps.shape[0]

    @property
    def token_advantages(self) -> Tensor:
        """Advantages broadcastable against ``[B, T]``: ``[B, 1]`` for sequence advantages."""
        return self.advantages.unsqueeze(-1) if self.advantages.dim() == 1 else self.advantages

    @property
    def lengths(self) -> Tensor:
        """|y_i|: counted completion tokens per row, ``[B]`` (float)."""
        return self.mask.to(self.logps.dtype).sum(-1)


def gather_ragged(accelerator, values: Tensor) -> Tensor:
    """Every process's values of the 1-D tensor ``values`` (lengths may differ), concatenated.

    Pads each process's tensor with NaN to the longest, gathers, and drops the padding, so the
    values must be finite (entropies are). One process: ``values`` itself, without a collective.
    """
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
    everyone = accelerator.gather(padded)
    return everyone[~everyone.isnan()]


@attrs.frozen
class TokenDistributions:
    """Two models' next-token distributions at N positions, for a distillation loss.

    ``logps`` ``[N, V]`` is the student's log-softmax at the method's temperature (with
    gradient); ``teacher_logps`` ``[N, V]`` is the teacher's at the same temperature, a
    constant. Rows are token positions, not sequences: the method hands a loss one chunk of
    positions at a time (see :func:`plait.engine.logprobs.compare_distributions`), so a loss returns one
    value per row, ``[N]``, and never sees the whole ``[B, T, V]``.
    """

    logps: Tensor
    teacher_logps: Tensor = attrs.field(converter=_frozen)

    @property
    def batch_size(self) -> int:
        return self.logps.shape[0]


@attrs.frozen
class ValueTokens:
    """Per-token value estimates of B sampled completions for a critic loss (PPO); ``[B, T]`` each.

    ``values`` are the value model's current estimates (with gradient), ``old_values`` its
    estimates when the rollout was scored, ``returns`` the targets R = A + V_old; ``mask`` marks
    the completion tokens that count.
    """

    values: Tensor
    old_values: Tensor = attrs.field(converter=_frozen)
    returns: Tensor = attrs.field(converter=_frozen)
    mask: Tensor

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]
