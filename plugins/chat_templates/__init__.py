"""Built-in training chat templates (``register_chat_templates``): one module per model family."""
