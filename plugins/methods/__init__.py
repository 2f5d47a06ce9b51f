"""Training methods (``register_methods``): one module per method, its config and its trainer."""
