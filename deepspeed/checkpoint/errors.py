"""The errors checkpoint code raises; every message names the file and the problem."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """A save or load call's argument is unusable (an empty `save_dir`); a ValueError too, as
    upstream raises one there."""


class CheckpointTagMismatch(CheckpointError, AssertionError):
    """`save_checkpoint` got different tags on different ranks under `checkpoint.tag_validation`
    "Fail"; an AssertionError too, as upstream's check is an assert."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names globals outside the loader's allowlist; nothing of it was run.

    See [Note: loading untrusted checkpoints]. The message names the file, the globals and
    how to opt in.
    """
