"""`DeepSpeedDataLoader`: each rank reads its own strided share of the data set, per micro-batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Sampler

from deepspeed import comm as dist
from deepspeed.utils.logging import logger


class RankShardSampler(Sampler):
    """Indices `rank, rank + world, ...` of a (per-epoch seeded) permutation; equal counts per rank."""

    def __init__(self, size: int, rank: int, world: int, shuffle: bool = True, seed: int = 0) -> None:
        self.size, self.rank, self.world = size, rank, world
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.per_rank = size // world  # drop the ragged tail so that every rank steps equally

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        return iter(order[self.rank : self.per_rank * self.world : self.world])

    def __len__(self) -> int:
        return self.per_rank


class DeepSpeedDataLoader:
    """Iterates micro-batches of this rank's share; `len()` is the number of micro-batches."""

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        collate_fn: Optional[Any] = None,
        shuffle: bool = True,
        drop_last: bool = False,
        sampler: Optional[Sampler] = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        # By default every rank gets the same number of samples, its own; a caller's sampler
        # (engine.deepspeed_io(data_sampler=...)) decides that itself. drop_last (the config's
        # `dataloader_drop_last`) also drops each rank's last, smaller micro-batch.
        if sampler is None:
            size, world = len(dataset), dist.get_world_size()
            if size < world:
                raise ValueError(
                    f"DeepSpeedDataLoader: the data set has {size} samples, fewer than the {world} ranks; each "
                    "rank needs at least one (pass a data_sampler that repeats samples, or more data)"
                )
            if size % world and dist.get_rank() == 0:
                logger.warning(
                    f"DeepSpeedDataLoader: {size} samples on {world} ranks: each epoch leaves out {size % world} "
                    f"(the end of that epoch's {'shuffled ' if shuffle else ''}order) so that every rank reads "
                    f"{size // world}"
                )
            sampler = RankShardSampler(size, dist.get_rank(), world, shuffle)
        self.sampler = sampler
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.epoch = 0

    # Upstream's attribute names, which tutorial scripts read (`trainloader.batch_size`); each
    # is the inner loader's own setting, so there is one place that holds it.
    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def collate_fn(self) -> Any:
        return self.loader.collate_fn

    @property
    def data_sampler(self) -> Sampler:
        return self.sampler

    @property
    def dataloader_drop_last(self) -> bool:
        return self.loader.drop_last

    @property
    def num_local_io_workers(self) -> int:
        return self.loader.num_workers

    @property
    def pin_memory(self) -> bool:
        return self.loader.pin_memory

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):  # a new order each epoch, the same on every rank
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class RepeatingLoader:
    """Iterate `loader` forever: when it is exhausted, start it again (a new epoch)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)  # an empty loader raises StopIteration here, as it should
