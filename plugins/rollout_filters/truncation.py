"""filter.truncation: drop groups with too many completions cut at ``max_completion_length``.

A truncated completion is scored on text that never ended, so its reward says little about the
answer (DAPO §3.4 masks such samples; plait's ``mask_truncated_completions`` leaves each one out of
the loss, one completion at a time). This filter acts on whole groups: it keeps a group when the
share of its completions that ran out of tokens is at most ``max_fraction`` (0: none may) and, with
``max_length``, when no completion is longer than that many tokens.
"""

import attrs

from plait import hookimpl
from plait.online.filtering import RolloutGroup
from plait.params import in_range, int_at_least


@attrs.frozen
class TruncationParams:
    max_fraction: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    max_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))


def truncation(group: RolloutGroup, p: TruncationParams) -> bool:
    if p.max_length is not None and int(group.lengths.max()) > p.max_length:
        return False
    return float(group.truncated.float().mean()) <= p.max_fraction


@hookimpl
def register_rollout_filters(register):
    register("filter.truncation", truncation, params=TruncationParams,
             doc="drop groups with more truncated (or longer) completions than allowed")
