"""Built-in environments and tools for multi-turn online RL (``register_environments``)."""
