"""Activation checkpointing (`deepspeed.checkpointing` is an alias of `.checkpointing`)."""
