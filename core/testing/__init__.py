"""Tools for testing plait plugins: hypothesis strategies, contract checks, a pytest plugin."""
