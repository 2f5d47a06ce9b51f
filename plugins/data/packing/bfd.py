"""Best-fit decreasing packing; sequences longer than ``max_length`` are truncated (overflow lost).

Documents stay whole, so rows must be collated padding-free (attention restarts per document):
registered with ``padding_free=True``.
"""

from plait import hookimpl

from ._binpack import best_fit_decreasing


def pack_bfd(lengths, max_length):
    return best_fit_decreasing([(i, 0, min(n, max_length)) for i, n in enumerate(lengths) if n > 0], max_length)


@hookimpl
def register_packing_strategies(register):
    register("packing.bfd", pack_bfd, padding_free=True, doc="Best-fit decreasing; overflow beyond max_length is truncated.")
