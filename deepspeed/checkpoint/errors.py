"""The errors checkpoint code raises; every message names the file and the problem."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names globals outside the loader's allowlist; nothing of it was run.

    See [Note: loading untrusted checkpoints]. The message names the file, the globals and
    how to opt in.
    """
