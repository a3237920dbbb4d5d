"""Hostfiles and resource selection: which hosts, and which device slots on each, a job runs on.

    # a hostfile: one `hostname slots=N` line per machine
    worker-0 slots=4
    worker-1 slots=4   # trailing comments are fine

A *resource pool* is an ordered `{host: [slot, ...]}`; the order is the hostfile's and decides
the node ranks (the first host is node 0 and, by default, the master). `--include` /
`--exclude` take `host[:slot,slot]@host...` specs; `--num_nodes` keeps the first N hosts and
`--num_gpus` the first N slots of each. Every error names the offending line or spec.

Nothing here imports torch: the `deepspeed` command must stay quick to start.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Optional

ResourcePool = dict[str, list[int]]  # host -> device slots, in hostfile order

NODE_SEP = "@"
SLOT_SEP = ","
SLOTS_START = ":"


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> dict[str, int]:
    """`{host: slots}` from hostfile text; raises ValueError naming the bad line."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path}, line {number} ({raw.strip()!r})"
        words = line.split()
        if len(words) not in (2, 3) or not words[1].startswith("slots="):
            raise ValueError(f"{where}: expected 'hostname slots=N' (optionally 'max_slots=M', Open MPI's)")
        host, slots = words[0], words[1][len("slots=") :]
        if not slots.isdigit() or int(slots) == 0:
            raise ValueError(f"{where}: slots must be a positive integer, got {slots!r}")
        if len(words) == 3:
            # Open MPI's bound on oversubscription: ranks never exceed `slots` here, so it only
            # has to allow them.
            most = words[2][len("max_slots=") :] if words[2].startswith("max_slots=") else None
            if most is None or not most.isdigit() or int(most) < int(slots):
                raise ValueError(f"{where}: expected 'max_slots=M' with M >= slots, got {words[2]!r}")
        if host in hosts:
            raise ValueError(f"{where}: host {host!r} is already listed on an earlier line")
        hosts[host] = int(slots)
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts; expected lines like 'worker-0 slots=4'")
    return hosts


def read_hostfile(path: str) -> Optional[dict[str, int]]:
    """`{host: slots}` from a hostfile, or None when there is no such file (a local job)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return parse_hostfile_text(f.read(), path)


def parse_filter(spec: str, flag: str) -> dict[str, Optional[list[int]]]:
    """`'w0:0,2@w1'` -> `{'w0': [0, 2], 'w1': None}` (None: the whole host)."""
    chosen: dict[str, Optional[list[int]]] = {}
    for entry in spec.split(NODE_SEP):
        host, sep, slots = entry.strip().partition(SLOTS_START)
        if not host:
            raise ValueError(f"{flag} {spec!r}: empty host name; expected 'host[:slot,slot]@host...'")
        try:
            ids = [int(s) for s in slots.split(SLOT_SEP)] if sep else None
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: slots of {host!r} must be comma-separated integers") from None
        previous = chosen.get(host, [])
        # A host named twice: the union, and a bare name (every slot) wins.
        chosen[host] = None if ids is None or (host in chosen and previous is None) else previous + ids
    return chosen


def _check_known(pool: ResourcePool, chosen: dict[str, Optional[list[int]]], flag: str, spec: str) -> None:
    for host, ids in chosen.items():
        if host not in pool:
            raise ValueError(f"{flag} {spec!r}: host {host!r} is not in the hostfile (hosts: {list(pool)})")
        unknown = sorted(set(ids or ()) - set(pool[host]))
        if unknown:
            raise ValueError(f"{flag} {spec!r}: {host!r} has no slots {unknown}; it has {pool[host]}")


def filter_pool(pool: ResourcePool, include: str = "", exclude: str = "") -> ResourcePool:
    """The pool restricted by `--include` or reduced by `--exclude` (not both)."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; use one")
    if not include and not exclude:
        return {host: list(slots) for host, slots in pool.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen = parse_filter(spec, flag)
    _check_known(pool, chosen, flag, spec)
    result: ResourcePool = {}
    for host, slots in pool.items():  # keep the hostfile's order
        if include:
            if host in chosen:
                ids = chosen[host]
                result[host] = list(slots) if ids is None else sorted(set(ids))
        else:
            ids = chosen.get(host, [])
            kept = [] if ids is None else [s for s in slots if s not in ids]
            if kept:
                result[host] = kept
    if not result:
        raise ValueError(f"{flag} {spec!r} leaves no devices to run on")
    return result


def limit_pool(pool: ResourcePool, num_nodes: int = -1, num_gpus: int = -1) -> ResourcePool:
    """The first `num_nodes` hosts and the first `num_gpus` slots of each (-1: all)."""
    if num_nodes == 0 or num_nodes < -1:
        raise ValueError(f"--num_nodes must be a positive number of nodes, got {num_nodes}")
    if num_gpus == 0 or num_gpus < -1:
        raise ValueError(f"--num_gpus/--num_procs must be a positive number of ranks, got {num_gpus}")
    hosts = list(pool)
    if num_nodes > len(hosts):
        raise ValueError(f"--num_nodes={num_nodes}, but the hostfile lists {len(hosts)} hosts {hosts}")
    if num_nodes > 0:
        hosts = hosts[:num_nodes]
    short = {host: len(pool[host]) for host in hosts if len(pool[host]) < num_gpus}
    if short:
        raise ValueError(f"--num_gpus/--num_procs={num_gpus}, but these hosts have fewer slots: {short}")
    return {host: pool[host][:num_gpus] if num_gpus > 0 else list(pool[host]) for host in hosts}


def encode_world_info(pool: ResourcePool) -> str:
    """The pool as the URL-safe base64 JSON that `deepspeed.launcher.launch --world_info` takes."""
    return base64.urlsafe_b64encode(json.dumps(pool).encode()).decode()


def decode_world_info(text: str) -> ResourcePool:
    try:
        world = json.loads(base64.urlsafe_b64decode(text.encode()))
    except ValueError as err:
        raise ValueError(f"--world_info is not base64-encoded JSON: {err}") from None
    ok = isinstance(world, dict) and all(
        isinstance(v, list) and all(isinstance(s, int) for s in v) for v in world.values()
    )
    if not ok or not world:
        raise ValueError(f"--world_info must encode {{host: [slot, ...]}}, got {world!r}")
    return world
