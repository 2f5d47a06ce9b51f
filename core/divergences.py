"""f-divergence transforms s = f(r) of a log-ratio r = log π − log π_ref, for DPO.

Wang et al. 2024, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse
Divergence Constraints" (f-DPO): swapping DPO's reverse-KL regulariser for another
f-divergence replaces each log-ratio r by f'(π/π_ref) up to constants, which DPO-style
losses then compare as a margin Δ = s_c − s_r.

    reverse_kl        s = r                      (plain DPO)
    forward_kl        s = −exp(−r)               (mass-covering)
    js_divergence     s = log σ(r)
    alpha_divergence  s = exp((α−1)·r)/(α−1)     (α → 1 recovers reverse KL; α = 0 is forward KL)

A method picks one with :func:`f_divergence` and stores it in ``PreferenceLogps.divergence``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import PlaitError


def reverse_kl(r: Tensor) -> Tensor:
    return r


def alpha_divergence(r: Tensor, alpha: float = 0.5) -> Tensor:
    if abs(alpha - 1.0) < 1e-6:  # exp((α−1)r)/(α−1) = 1/(α−1) + r + O(α−1): the limit is reverse KL
        return r
    # Clamp the exponent so |s| ≤ max/4 in r's dtype: fp16 overflows at exp(11.1), and margins
    # and β·Δ must stay finite too. Saturated entries get zero gradient, as any clamp does.
    bound = math.log(torch.finfo(r.dtype).max * abs(alpha - 1.0) / 4.0)
    return torch.exp(((alpha - 1.0) * r).clamp(max=bound)) / (alpha - 1.0)


def forward_kl(r: Tensor) -> Tensor:
    return alpha_divergence(r, alpha=0.0)  # −exp(−r), with the same overflow guard


def js_divergence(r: Tensor) -> Tensor:
    return F.logsigmoid(r)


DIVERGENCES: dict[str, Callable[..., Tensor]] = {
    "reverse_kl": reverse_kl,
    "forward_kl": forward_kl,
    "js_divergence": js_divergence,
    "alpha_divergence": alpha_divergence,
}


def f_divergence(name: str, alpha: float = 0.5) -> Callable[[Tensor], Tensor]:
    """The transform called ``name``; ``alpha`` binds to transforms that take a coefficient."""
    transform = DIVERGENCES.get(name)
    if transform is None:
        match = difflib.get_close_matches(str(name), list(DIVERGENCES), n=1, cutoff=0.6)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise PlaitError(
            f"f_divergence_type={name!r} is not known{hint}; use one of {', '.join(sorted(DIVERGENCES))}"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise PlaitError(f"f_alpha_divergence_coef={alpha!r} must be a finite number, e.g. 0.5")
    if "alpha" in inspect.signature(transform).parameters:
        return functools.partial(transform, alpha=float(alpha))
    return transform
