"""The training engine: the chassis every method's trainer stands on (transformers' Trainer plus what
plait adds), how models load, the one log-prob path, attention, checkpointing, memory, the loss
objective and the batch types losses read, and a method's Config class."""
