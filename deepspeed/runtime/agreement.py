"""Ranks that must hold the same structure check that they do, before a collective sized by it.

[Note: why agreement is checked]
A collective whose sizes come from user code (a layer width read from a per-rank file, a
different parameter list per rank, a config that differs) does not fail cleanly when the
ranks disagree: gloo aborts the rank that sent the larger buffer while the others go on with
garbage, and NCCL hangs. So before such a collective each rank reduces what must agree to a
64-bit fingerprint, and one all-gather of the fingerprints (`world_size` int64s) tells every
rank whether all agree. Only when they do not are the full descriptions exchanged, to name
what differs, on which ranks, and the first differing entry; every rank then raises the same
`RankMismatchError`, so a mistake on one rank is an error everywhere, never a hang.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import torch

from deepspeed import comm as dist


class RankMismatchError(RuntimeError):
    """Ranks disagree on something that must be the same on all of them (see the note)."""


def fingerprint(items: list) -> int:
    """A 63-bit digest of `items` (strings), the same in every process (unlike `hash()`)."""
    digest = hashlib.blake2b("\n".join(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits a signed int64


def check_agreement(what: str, items: list, group: Any = None, fix: str = "") -> None:
    """Raise `RankMismatchError` on every rank unless all ranks of `group` pass equal `items`.

    `what` names the structure ("zero.Init: parameters of Linear"); `items` describe it, one
    string each, in an order that must also agree (first difference is reported by index);
    `fix` tells the user what to do.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    mine = torch.tensor([fingerprint(items)], dtype=torch.int64, device=device)
    everyone = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    if bool(torch.all(everyone == everyone[0])):
        return
    described: list = [None] * world
    dist.all_gather_object(described, list(items), group=group)  # the slow path: names the difference
    raise RankMismatchError(_explain(what, described, fix))


def _explain(what: str, described: list, fix: str) -> str:
    groups: dict = {}
    for rank, items in enumerate(described):
        groups.setdefault(tuple(items), []).append(rank)
    reference = described[0]
    lines = [f"{what}: the ranks disagree ({len(groups)} different versions)."]
    for items, ranks in groups.items():
        if list(items) == reference:
            continue
        index = _first_difference(reference, list(items))
        ours = reference[index] if index < len(reference) else "<nothing>"
        theirs = items[index] if index < len(items) else "<nothing>"
        lines.append(f"rank(s) {ranks} differ from rank 0 first at entry {index}: {theirs!r} vs {ours!r}")
    if fix:
        lines.append(fix)
    return " ".join(lines)


def _first_difference(a: list, b: list) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def describe_parameters(named: list, shape_of: Optional[Any] = None) -> list:
    """One `name shape dtype` string per `(name, parameter)`: what ranks must agree on."""
    shape_of = shape_of or (lambda p: tuple(p.shape))
    return [f"{name} {tuple(shape_of(p))} {p.dtype}" for name, p in named]


# Config keys a rank may set for itself: where its swap files go (one NVMe drive per GPU,
# `nvme_path: /mnt/nvme<LOCAL_RANK>`, is the usual layout); every other key must agree.
RANK_LOCAL_CONFIG_KEYS = (
    ("zero_optimization", "offload_optimizer", "nvme_path"),
    ("zero_optimization", "offload_param", "nvme_path"),
)


def describe_config(param_dict: dict) -> str:
    """The config as one string the ranks must agree on: sorted JSON, without the keys in
    `RANK_LOCAL_CONFIG_KEYS` (objects in it by their type's name)."""
    for path in RANK_LOCAL_CONFIG_KEYS:
        param_dict = _without(param_dict, path)
    return "config " + json.dumps(param_dict, sort_keys=True, default=lambda o: type(o).__name__)


def _without(block: Any, path: tuple) -> Any:
    """`block` with the key at `path` removed, copying only the dicts along the path."""
    head, rest = path[0], path[1:]
    if not isinstance(block, dict) or head not in block:
        return block
    if not rest:
        return {k: v for k, v in block.items() if k != head}
    return {**block, head: _without(block[head], rest)}
