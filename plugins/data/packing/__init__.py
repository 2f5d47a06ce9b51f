"""Packing strategies (``register_packing_strategies``): one module per way of filling sequences."""
