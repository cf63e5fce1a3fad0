"""Training: data, trainer, metrics and JSONL logging."""
