"""Wrapped packing: concatenate every sequence and cut the stream into ``max_length`` rows.

The classic pre-training layout: no token lost, every row but the last full, documents cut at
row edges. Rows may be collated padded (attention across documents, as it is usually done).
"""

from plait import hookimpl


def pack_wrapped(lengths, max_length):
    bins, current, room = [], [], max_length
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(room, n - start)
            current.append((i, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                bins.append(current)
                current, room = [], max_length
    if current:
        bins.append(current)
    return bins


@hookimpl
def register_packing_strategies(register):
    register("packing.wrapped", pack_wrapped, padding_free=False, doc="Concatenate and cut into max_length rows.")
