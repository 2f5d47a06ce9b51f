"""The tokenizer (or a VLM's processor) a run uses: the model's own, or one given, with a Config's
overrides of chat template, EOS and pad token applied."""

from __future__ import annotations

from transformers import AutoProcessor, AutoTokenizer, PreTrainedModel

from plait.errors import PlaitError

from . import chat, preflight, vision
from .pretrained import pretrained_kwargs


def load_tokenizer(model: str | PreTrainedModel, processing_class=None, field: str = "model", *,
                   chat_template_path: str | None = None, eos_token: str | None = None, pad_token: str | None = None):
    """``processing_class``, else the model's own tokenizer, with a Config's overrides applied: the
    chat template of ``chat_template_path`` (a Jinja file or a tokenizer folder), then ``eos_token``
    and ``pad_token``, each a token of its vocabulary."""
    loaded = processing_class is None
    if loaded:
        source = model if isinstance(model, str) else model.config._name_or_path
        preflight.model_source(model, field)  # a bad path is named as such, not as a tokenizer problem
        preflight.tokenizer_files(source, field)
        try:
            # a VLM's processing class is its processor
            auto = AutoProcessor if vision.vision_language_source(source) else AutoTokenizer
            processing_class = auto.from_pretrained(source, **pretrained_kwargs())
        except Exception as err:  # noqa: BLE001 - OSError, ValueError, TypeError, tokenizers' own: all mean "cannot load"
            message = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise PlaitError(f"{field}={source!r}: its tokenizer cannot be loaded ({type(err).__name__}: {message}); "
                             "save one next to the model (tokenizer.save_pretrained(folder)) or pass processing_class") from err
    if chat_template_path is not None:
        chat.load_chat_template(processing_class, chat_template_path)
    tokenizer = chat.tokenizer_of(processing_class)
    for name, token in (("eos_token", eos_token), ("pad_token", pad_token)):
        if token is not None:
            if token not in tokenizer.get_vocab():
                raise PlaitError(f"{name}={token!r} is not a token of the tokenizer's vocabulary; give one of its "
                                 f"tokens (its eos_token is {tokenizer.eos_token!r}, its pad_token {tokenizer.pad_token!r})")
            setattr(tokenizer, name, token)
    if loaded and tokenizer.pad_token is None:  # training collators need a pad id; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return processing_class
