"""Crash-safe writes: a file appears under its name complete, or not at all.

[Note: crash-safe writes]
Each file is written under a temporary name in its final directory, flushed, fsync'd, and
then `os.replace`d onto its name: under its real name a file is complete or absent. The
engine replaces `latest` the same way, and only after every rank has reported its files
written. A save interrupted at any point therefore leaves `latest` naming the previous
complete tag. Overwriting one tag in place can mix files of two saves if interrupted; the
`save_id` check on load refuses such a mix instead of loading it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Callable

import torch


def fsync_dir(directory: str) -> None:
    """Make a rename inside `directory` durable (best effort: not every OS can open a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save_to_path(path: str, save: Callable[[str], None]) -> None:
    """Run `save(tmp)` for a temporary name beside `path`, fsync it, then rename it onto `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Crash-safe write through `write(binary_file)` (see [Note: crash-safe writes])."""

    def save(tmp: str) -> None:
        with open(tmp, "xb") as f:
            write(f)

    atomic_save_to_path(path, save)


def atomic_torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj, path)`, crash-safe (see [Note: crash-safe writes])."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
