"""Best-fit decreasing bin packing over token slices (shared by packing plugins; not a plugin)."""

from __future__ import annotations

import bisect

Piece = tuple[int, int, int]  # (example index, start, end)


def best_fit_decreasing(pieces: list[Piece], capacity: int) -> list[list[Piece]]:
    """Place the longest pieces first, each into the open bin it fills most tightly.

    Any-fit packing leaves at most one bin half empty or worse, so it never needs more than
    twice the optimum; in practice (Johnson 1973: ≤ 11/9·OPT + 6/9) it is within a few percent.
    """
    order = sorted(pieces, key=lambda p: (-(p[2] - p[1]), p[0], p[1]))
    bins: list[list[Piece]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for piece in order:
        size = piece[2] - piece[1]
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            remaining, index = free.pop(slot)
        else:
            remaining, index = capacity, len(bins)
            bins.append([])
        bins[index].append(piece)
        bisect.insort(free, (remaining - size, index))
    return bins
