"""Built-in lifecycle plugins that attach transformers ``TrainerCallback``s to every run."""
