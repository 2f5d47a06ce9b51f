"""Collators (``register_collators``): one module per way of turning tokenised rows into a batch."""
