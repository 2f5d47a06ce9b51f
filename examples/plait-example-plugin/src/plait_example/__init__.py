"""An example third-party plait plugin: one module per component, each with its own entry point."""
