"""Helpers for writing checkpoints with `torch.save`."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """A copy of `item` whose tensors are fresh, compact copies on `device`.

    `torch.save` writes a tensor's whole storage, so saving a view (a parameter cut out of a
    flat buffer, a slice of a gathered output) would write the large storage behind it.
    Dicts (their type kept: `OrderedDict`, `defaultdict`), lists, tuples and namedtuples are
    walked recursively; anything else is returned as it is.
    """
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        out = copy.copy(item)  # keeps the dict subclass and, for a defaultdict, its factory
        for key, value in item.items():
            out[key] = clone_tensors_for_torch_save(value, device)
        return out
    if isinstance(item, (list, tuple)):
        values = [clone_tensors_for_torch_save(v, device) for v in item]
        if isinstance(item, tuple) and hasattr(item, "_fields"):
            return type(item)(*values)  # a namedtuple
        return type(item)(values)
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The path of the model-states file of model-parallel rank `mp_rank_str` ("00") in a tag
    folder: `<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`, upstream's name for the file
    a stage 0-2 save writes (one for the whole module)."""
    if not isinstance(mp_rank_str, str) or not mp_rank_str.isdigit():
        raise ValueError(f"mp_rank_str must be a string of digits such as '00', got {mp_rank_str!r}")
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")
