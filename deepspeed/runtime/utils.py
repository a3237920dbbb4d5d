"""Helpers user scripts import from upstream's `deepspeed.runtime.utils`.

`see_memory_usage` (memory at a point of a training script), `move_to_device` (a nested
batch to a device), `clip_grad_norm_` (clipping over the data-parallel ranks) and
`set_random_seed`. The engine does not use them: it clips inside the optimizer wrapper.
Upstream's partitioning helpers (`partition_uniform`, `partition_balanced`, `prefix_sum_inc`,
`PartitionedTensor`) live in partitioning.py and are re-exported here.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.partitioning import (  # noqa: F401 - upstream's names here
    PartitionedTensor,
    partition_balanced,
    partition_uniform,
    prefix_sum_inc,
)

_GIB = float(1 << 30)


def _host_memory_line() -> str:
    """The host's used memory, from psutil (a dependency of this package)."""
    import psutil

    vm = psutil.virtual_memory()
    used = (vm.total - vm.available) / _GIB
    return f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {vm.percent}%"


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message` and the accelerator's and host's memory use, on rank 0 only.

    As upstream: nothing happens unless `force` (scripts leave the calls in and switch them
    on while hunting a leak). Garbage is collected first, so unreachable tensors do not count;
    the accelerator's peak counters are reset after, so the next call's maxima cover the code
    in between.
    """
    if not force:
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()
    acc = get_accelerator()
    print(message)
    print(
        f"MA {acc.memory_allocated() / _GIB:.2f} GB "
        f"Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB "
        f"CA {acc.memory_reserved() / _GIB:.2f} GB "
        f"Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB "
    )
    print(_host_memory_line())
    acc.reset_peak_memory_stats()


def move_to_device(
    item: Any, device: Union[str, torch.device], criterion_func: Optional[Callable] = None
) -> Any:
    """`item` on `device`: a tensor, or lists, tuples and dicts of them, nested; what is in
    them keeps its structure (a tuple stays a tuple).

    Tensors for which `criterion_func(tensor)` is true move in place, as upstream's do: their
    `.data` is replaced, so every holder of that tensor sees it on `device`, and the same
    object is returned. Other tensors (all of them without a criterion) are copied with
    `.to(device)`. Leaves without a `.to` (numbers, strings, None) are returned as they are.
    """
    if isinstance(item, torch.Tensor):
        if criterion_func is not None and criterion_func(item):
            item.data = item.data.to(device)
            return item
        return item.to(device)
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if callable(getattr(item, "to", None)) else item


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2,
    mpu: Any = None,
) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their total norm is at most `max_norm`.

    torch's `clip_grad_norm_`, made to agree over the data-parallel ranks: each rank's total
    `norm_type`-norm (`inf` for the largest magnitude) is averaged over the data-parallel
    group, so every rank scales by the same coefficient, `min(1, max_norm / (norm + 1e-6))`,
    even where the ranks' gradients differ (before a reduction). Returns that averaged norm.
    Parameters without a gradient are skipped. `mpu` (model parallelism) is not supported by
    this package: passing one raises rather than computing a norm over the wrong ranks.
    """
    if mpu is not None:
        raise ValueError(
            "clip_grad_norm_: mpu (model parallelism) is not supported by this package; pass mpu=None "
            "(the norm is then averaged over the data-parallel group)"
        )
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device(get_accelerator().current_device_name())
    if not grads:
        total = torch.zeros((), dtype=torch.float32, device=device)
    elif norm_type == math.inf:
        total = torch.stack([g.detach().abs().max().float() for g in grads]).max()
    else:
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads])
        total = torch.linalg.vector_norm(norms, norm_type)
    if dist.is_initialized():
        from deepspeed.utils import groups

        group = groups._get_data_parallel_group()
        ranks = dist.get_world_size(group)
        if ranks > 1:
            comm_device = torch.device(get_accelerator().current_device_name())  # nccl takes no CPU tensor
            averaged = (total / ranks).to(comm_device)
            dist.all_reduce(averaged, group=group)
            total = averaged.to(device)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coefficient.to(g.device, g.dtype))
    return total


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator (when numpy is installed) and torch.

    Seeds wider than a generator takes are reduced modulo its range (numpy takes 32 bits,
    torch 64), so any int a test harness passes works.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))
    torch.manual_seed(seed % (1 << 63))
