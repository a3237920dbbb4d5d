"""Upstream's `deepspeed.utils.torch`: which torch is installed, asked the way client code asks."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch.torch_version import TorchVersion

Version = Union[str, float, int]


def required_torch_version(
    min_version: Optional[Version] = None, max_version: Optional[Version] = None
) -> bool:
    """Whether the installed torch lies in `[min_version, max_version]` (either bound may be
    left out, not both), comparing release numbers: a local tag such as `+cpu` is ignored."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: pass min_version, max_version or both")
    installed = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and installed < str(min_version):
        return False
    return max_version is None or installed <= str(max_version)
