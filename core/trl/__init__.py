"""TRL 1.16's public surface under TRL's names, on plait's own code: script arguments and parsers,
data utilities and collators, callbacks."""
