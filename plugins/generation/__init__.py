"""Generation backends (``register_generation_backends``) for online methods, and ``plait vllm-serve``."""
