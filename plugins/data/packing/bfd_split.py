"""Best-fit decreasing packing that splits long sequences into ``max_length`` fragments (no token lost)."""

from plait import hookimpl

from ._binpack import best_fit_decreasing


def pack_bfd_split(lengths, max_length):
    pieces = [(i, start, min(start + max_length, n)) for i, n in enumerate(lengths) for start in range(0, n, max_length)]
    return best_fit_decreasing(pieces, max_length)


@hookimpl
def register_packing_strategies(register):
    register("packing.bfd_split", pack_bfd_split, padding_free=True, doc="Best-fit decreasing; long sequences split into fragments.")
