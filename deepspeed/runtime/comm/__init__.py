"""Collectives over lists of tensors (upstream's `deepspeed.runtime.comm` package)."""
