"""plait's error type: one line that names the field, the value and the fix."""


class PlaitError(ValueError):
    """A user-facing configuration or input error, raised before expensive work starts."""


class PluginLoadError(PlaitError):
    """A plugin failed to import or register; the original exception is chained."""
