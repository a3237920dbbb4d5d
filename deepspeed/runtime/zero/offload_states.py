"""`engine.offload_states()` / `engine.reload_states()`: free the accelerator between training phases.

RLHF frameworks (OpenRLHF, verl, TRL's colocated vLLM) train and generate on the same
accelerator: between the two they move the training engine's states to host memory and
back. The kinds are upstream's `OffloadStateTypeEnum`:

- `optim_states`: the wrapped optimizer's state tensors (Adam's moments);
- `hp_params`: the fp32 master shards the optimizer steps;
- `lp_params`: the model's own parameter storage (stage 3: every shard and what is gathered
  for good, the persistent parameters; stages 0-2: the full parameters);
- `lp_grads`: gradients kept between backward and step (the masters' reduced shards, and
  whole gradients at stages 0-1);
- `contiguous_grad_buffer`: the reducer's send and scratch buffers, kept for reuse.

[Note: offloading moves storages, not tensors]
One storage is often seen through several tensors: a shard is a view of a flat buffer its
siblings share, an fp32 master is the shard itself when training in fp32, and the optimizer's
state dict refers to the same objects. Moving tensor by tensor would split such aliases and
leave the device bytes alive through the views nobody moved. So each storage behind a named
state is copied once into one host buffer (pinned when asked and the accelerator can pin),
every named tensor is re-pointed (`set_`) at the same offset in that buffer, so it reports the
host device and keeps its values, and the device storage is resized to zero bytes, which
returns its memory at once. Reload resizes that same storage back, copies the bytes in and
re-points the tensors, so every alias, named or not, sees bit-identical values again; a view
nobody named that is read while offloaded fails on its empty storage instead of reading
stale values. The reducer's buffers hold nothing between steps: they are dropped, and the
next reduction allocates them again.

[Note: a state shared with one that stays]
Training in fp32 with the masters on the accelerator, an fp32 master shard is the parameter's
shard itself (optimizer.py, `_make_master`): the same bytes are both `hp_params` and
`lp_params`. Offloading only `hp_params` then leaves that storage where it is, since the
model still needs it (RLHF generates with the model while the optimizer's states are off);
it costs no memory of its own. Offloading `lp_params` takes such a storage along, masters and
all: without the model nothing can use the masters (no forward, so no gradient and no step),
and leaving it would free nothing while forward is refused.

On a CPU-only machine the accelerator is the host, so "off the accelerator" means: the
original storages are freed (zero bytes), and the states live in separate host buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

ALL_STATES = tuple(OffloadStateTypeEnum)


def _optimizer_parts(engine: Any) -> tuple:
    """(the ZeRO optimizer or None, the torch optimizer that owns the state dict or None)."""
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", optimizer)
    zero = optimizer if hasattr(optimizer, "masters") else None
    return zero, inner if isinstance(inner, torch.optim.Optimizer) else None


def state_tensors(engine: Any, kind: OffloadStateTypeEnum) -> list:
    """Every tensor that holds engine state of `kind`, each tensor object once."""
    zero, inner = _optimizer_parts(engine)
    found: list = []
    if kind is OffloadStateTypeEnum.optim_states and inner is not None:
        for per_param in inner.state.values():
            found += [v for v in per_param.values() if torch.is_tensor(v)]
    elif kind is OffloadStateTypeEnum.hp_params and zero is not None:
        found += list(zero.masters.values())
    elif kind is OffloadStateTypeEnum.lp_params:
        found += list(engine.module.parameters())
        for state in getattr(engine, "zero_states", None) or getattr(zero, "states", []):
            found += [state.shard_base] if state.stored is not None else [state.shard, state.shard_base]
    elif kind is OffloadStateTypeEnum.lp_grads:
        masters = list(zero.masters.values()) if zero is not None else []
        found += [t.grad for t in masters + list(engine.module.parameters()) if t.grad is not None]
    elif kind is OffloadStateTypeEnum.contiguous_grad_buffer:
        reducer = getattr(engine, "reducer", None)
        found += list(getattr(reducer, "_spare", []))
    swapper = getattr(zero, "swapper", None)
    if swapper is not None:  # NVMe: a swapped-out tensor holds no memory to move (nvme_optimizer.py)
        found = [t for t in found if t is None or not swapper.holds(t)]
    unique = {id(t): t for t in found if t is not None}
    return list(unique.values())


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> set:
    """The devices the tensors of `state` are on now (upstream's helper of the same name)."""
    return {t.device for t in state_tensors(model, OffloadStateTypeEnum(state))}


def state_bytes_by_device(engine: Any, kind: OffloadStateTypeEnum) -> dict:
    """Bytes the storages behind `kind` hold, by device, each storage counted once."""
    seen: dict = {}
    for t in state_tensors(engine, kind):
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    out: dict = {}
    for (device, _, _), nbytes in seen.items():
        out[device] = out.get(device, 0) + nbytes
    return out


class _MovedStorage:
    """One device storage whose bytes live in `host` while offloaded (see the note)."""

    __slots__ = ("storage", "host", "views")

    def __init__(self, storage: torch.UntypedStorage, host: torch.Tensor, views: list) -> None:
        self.storage = storage  # the device storage, resized to 0 bytes until reload
        self.host = host  # 1D uint8 host copy of its bytes
        self.views = views  # (tensor, storage_offset, size, stride) of every named tensor on it


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _repoint(views: list, storage: torch.UntypedStorage) -> None:
    with torch.no_grad():
        for tensor, offset, size, stride in views:
            tensor.set_(storage, offset, size, stride)


class StateOffloader:
    """The engine's record of what `offload_states` moved, which `reload_states` puts back."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.moved: list = []  # _MovedStorage, in the order they were offloaded
        self.kinds: set = set()  # the OffloadStateTypeEnum kinds offloaded now

    def offload(
        self,
        include: Optional[Iterable] = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        kinds = self._parse(include, device)
        accelerator = get_accelerator()
        moved_ids = {id(t) for record in self.moved for t, *_ in record.views}
        # What stays on the accelerator keeps the storages it shares; the masters go with the
        # model's storage (see [Note: a state shared with one that stays]).
        stays = [k for k in ALL_STATES if k not in kinds]
        if OffloadStateTypeEnum.lp_params in kinds:
            stays = [k for k in stays if k is not OffloadStateTypeEnum.hp_params]
        kept = self._storages_of(stays)
        by_storage: dict = {}
        for kind in kinds:
            if kind is OffloadStateTypeEnum.contiguous_grad_buffer:
                self._drop_reducer_buffers()
                continue
            for t in state_tensors(self.engine, kind):
                storage = t.untyped_storage()
                if id(t) in moved_ids or storage.nbytes() == 0 or not accelerator.on_accelerator(t):
                    continue
                if storage.data_ptr() in kept:
                    continue  # also a state that stays (see [Note: a state shared with one that stays])
                entry = by_storage.setdefault(storage.data_ptr(), (storage, []))
                entry[1].append((t, t.storage_offset(), t.size(), t.stride()))
        records = []
        for storage, views in by_storage.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu")
            if pin_memory:
                host = accelerator.pin_memory(host)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking)
            records.append(_MovedStorage(storage, host, views))
        if records:
            accelerator.synchronize()  # the copies must land before the device bytes are freed
        for record in records:
            _repoint(record.views, record.host.untyped_storage())
            record.storage.resize_(0)
        self.moved += records
        self.kinds |= set(kinds)

    def reload(self, non_blocking: bool = False) -> None:
        """Put back everything `offload` moved; nothing offloaded: nothing to do."""
        for record in self.moved:
            record.storage.resize_(record.host.numel())
            _bytes_of(record.storage).copy_(record.host, non_blocking=non_blocking)
            _repoint(record.views, record.storage)
        if self.moved and not non_blocking:
            get_accelerator().synchronize()
        self.moved = []
        self.kinds = set()

    def refuse_while_offloaded(self, what: str, kinds: Iterable = ALL_STATES) -> None:
        """Training on offloaded states would read empty storages: say what to call first."""
        offloaded = sorted(k.value for k in self.kinds.intersection(kinds))
        if offloaded:
            raise RuntimeError(
                f"engine.{what} was called while {offloaded} are offloaded by engine.offload_states(); "
                "call engine.reload_states() first"
            )

    def _storages_of(self, kinds: Iterable) -> set:
        return {
            t.untyped_storage().data_ptr()
            for kind in kinds
            if kind is not OffloadStateTypeEnum.contiguous_grad_buffer
            for t in state_tensors(self.engine, kind)
        }

    def _parse(self, include: Optional[Iterable], device: Any) -> list:
        if OffloadDeviceEnum(device) is not OffloadDeviceEnum.cpu:
            raise ValueError(f"offload_states(device={device!r}): only OffloadDeviceEnum.cpu is supported")
        if include is None:
            return list(ALL_STATES)
        kinds = []
        for item in include:
            try:
                kinds.append(OffloadStateTypeEnum(item))
            except ValueError:
                raise ValueError(
                    f"offload_states(include=...): {item!r} is not a state kind; use members of "
                    f"OffloadStateTypeEnum: {[k.value for k in ALL_STATES]}"
                ) from None
        return kinds

    def _drop_reducer_buffers(self) -> None:
        reducer = getattr(self.engine, "reducer", None)
        if reducer is None:
            return  # stage 0 without a reducer: no buffer to drop
        if reducer._in_flight or reducer._pending:
            raise RuntimeError(
                "offload_states(contiguous_grad_buffer) was called while gradient reductions are pending; "
                "call it after engine.step()"
            )
        reducer._spare.clear()  # scratch only: the next reduction allocates them again
