"""Data handling: formats (what a dataset row looks like), collators (rows to batches) and packing."""
