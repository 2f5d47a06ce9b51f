"""Rollout filters (``register_rollout_filters``): one module per filter; dynamic sampling keeps what they keep."""
