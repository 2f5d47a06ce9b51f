"""f-divergence transforms s = f(r) of a log-ratio r = log π − log π_ref, for DPO.

Wang et al. 2024, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse
Divergence Constraints" (f-DPO): swapping DPO's reverse-KL regulariser for another
f-divergence replaces each log-ratio r by f'(u) at u = π/π_ref = e^r, which DPO-style losses
then compare as a margin Δ = s_c − s_r.

    reverse_kl        s = r                          f(u) = u·log u
    forward_kl        s = 1 − e^{−r}                 f(u) = −log u
    js_divergence     s = log 2 + log σ(r)           f(u) = u·log u − (u + 1)·log((u + 1)/2)
    alpha_divergence  s = (e^{(α−1)r} − 1)/(α−1)     (α → 1 recovers reverse KL; α = 0 is forward KL)

Each s is f'(u) shifted so that s = 0 at r = 0 (a policy equal to its reference scores zero under
every divergence), as in TRL 1.16. The shifts cancel in a margin; they matter only to losses
that divide each score by its completion length (``ipo``, ``sigmoid_norm``). The f-DPO
derivation leaves a β·log Z(x) term that cancels only in a chosen − rejected difference, so a
loss registers ``f_divergence=True`` when it is built on that difference (or reads no log-ratio)
and a method refuses a non-default divergence for any other loss.

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

from plait.errors import PlaitError


def reverse_kl(r: Tensor) -> Tensor:
    return r


def alpha_divergence(r: Tensor, alpha: float = 0.5) -> Tensor:
    if abs(alpha - 1.0) < 1e-6:  # expm1((α−1)r)/(α−1) = r + O(α−1): the limit is reverse KL
        return r
    # Clamp the exponent so |s| ≤ max/4 in r's dtype: fp16 overflows at exp(11.1), and margins
    # and β·Δ must stay finite too. Saturated entries get zero gradient, as any clamp does.
    bound = math.log(torch.finfo(r.dtype).max * abs(alpha - 1.0) / 4.0)
    return torch.expm1(((alpha - 1.0) * r).clamp(max=bound)) / (alpha - 1.0)


def forward_kl(r: Tensor) -> Tensor:
    return alpha_divergence(r, alpha=0.0)  # 1 − exp(−r), with the same overflow guard


def js_divergence(r: Tensor) -> Tensor:
    return math.log(2.0) + F.logsigmoid(r)


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
