"""Data before it reaches a trainer: format detection and tokenisation, chat templates, images for
vision-language models, tokenizers, and the preflight checks of every input a user names."""
