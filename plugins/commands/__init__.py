"""``plait`` subcommands that are no method's and no backend's (``register_commands``)."""
