"""The rest of upstream's `deepspeed.comm`: calls that need no path of their own here.

comm.py gives the collectives ZeRO runs (through shared memory on one host, gloo's slow
paths replaced) their own implementations. What code written for upstream's
`deepspeed.comm` also calls (point-to-point, gather and scatter, list-form all-to-all and
reduce-scatter, the object collectives, the capability probes and old aliases) goes to
`torch.distributed` as it is. `send`, `recv`, `gather`, `scatter`, `all_to_all` and
`reduce_scatter` go through the communication logger when it is on (with `prof` and
`log_name`, as comm.py's collectives); the aliases log as the collective they call; the
asynchronous point-to-point calls, the object collectives and `monitored_barrier` are not
logged. Each collective returns a `CommHandle` (complete unless `async_op`), `recv` the
sender's rank, `isend`/`irecv` a handle to wait on. `debug` is upstream's caller name for
its log records: accepted and unused, since the logger finds the caller itself (it skips
this module's frames, utils/comms_logging.py).
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as _dist

from deepspeed.comm import comm
from deepspeed.comm.comm import CommHandle, ProcessGroup, ReduceOp
from deepspeed.comm.handle import AllWorks  # waits on CommHandles as on torch Works
from deepspeed.comm.handle import handle_of as _handle


def _logged() -> bool:
    """Whether the logger is timing calls now (then the call goes through `comm._timed`)."""
    return comm.comms_logger.timing and comm.comms_logger.idle


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors or [] if t is not None)


# ----------------------------------------------------------------------------- point to point


def send(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:  # fmt: skip
    if _logged():
        return comm._timed(send, (tensor, dst, group, tag), log_name, prof, group, _bytes(tensor), False)
    _dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
         prof: bool = False, log_name: str = "recv", debug: Any = None) -> int:  # fmt: skip
    """Receive into `tensor`; returns the sender's rank (any sender when `src` is None)."""
    if _logged():
        return comm._timed(recv, (tensor, src, group, tag), log_name, prof, group, _bytes(tensor), False)
    return _dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> CommHandle:  # fmt: skip
    return CommHandle(_dist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
          prof: bool = False, log_name: str = "irecv", debug: Any = None) -> CommHandle:  # fmt: skip
    return CommHandle(_dist.irecv(tensor, src, group=group, tag=tag))


def batch_isend_irecv(p2p_op_list: list, prof: bool = False, log_name: str = "batch_isend_irecv",
                      debug: Any = None) -> list:  # fmt: skip
    """torch's `P2POp` list issued together; one handle per operation."""
    return [CommHandle(work) for work in _dist.batch_isend_irecv(p2p_op_list)]


# ----------------------------------------------------------------------------- gather, scatter, lists


def gather(tensor: torch.Tensor, gather_list: Optional[list] = None, dst: int = 0,
           group: Optional[ProcessGroup] = None, async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: Any = None) -> CommHandle:  # fmt: skip
    if _logged():
        args = (tensor, gather_list, dst, group, async_op)
        return comm._timed(gather, args, log_name, prof, group, _bytes(tensor), async_op)
    return _handle(_dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op), async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list] = None, src: int = 0,
            group: Optional[ProcessGroup] = None, async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: Any = None) -> CommHandle:  # fmt: skip
    if _logged():
        args = (tensor, scatter_list, src, group, async_op)
        return comm._timed(scatter, args, log_name, prof, group, _bytes(tensor), async_op)
    return _handle(_dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op), async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group: Optional[ProcessGroup] = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_to_all",
               debug: Any = None) -> CommHandle:  # fmt: skip
    if _logged():
        args = (output_tensor_list, input_tensor_list, group, async_op)
        return comm._timed(all_to_all, args, log_name, prof, group, _bytes(input_tensor_list), async_op)
    work = _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    return _handle(work, async_op)


def reduce_scatter(output: torch.Tensor, input_list: list, op: ReduceOp = ReduceOp.SUM,
                   group: Optional[ProcessGroup] = None, async_op: bool = False, prof: bool = False,
                   log_name: str = "reduce_scatter", debug: Any = None) -> CommHandle:  # fmt: skip
    """`output` gets the reduction over ranks of each rank's `input_list[rank]` (the list form)."""
    if _logged():
        args = (output, input_list, op, group, async_op)
        return comm._timed(reduce_scatter, args, log_name, prof, group, _bytes(input_list), async_op)
    return _handle(_dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op), async_op)


def broadcast_object_list(object_list: list, src: int = 0, group: Optional[ProcessGroup] = None,
                          device: Optional[torch.device] = None, prof: bool = False,
                          log_name: str = "broadcast_object_list", debug: Any = None) -> None:  # fmt: skip
    _dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list: list, obj: Any, group: Optional[ProcessGroup] = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> None:  # fmt: skip
    _dist.all_gather_object(object_list, obj, group=group)


def monitored_barrier(group: Optional[ProcessGroup] = None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = True, prof: bool = False, log_name: str = "monitored_barrier",
                      debug: Any = None) -> None:  # fmt: skip
    """A barrier that names the missing ranks on timeout (every missing one by default; gloo
    only: other backends take a plain barrier)."""
    if comm.get_backend(group) == "gloo":
        _dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    else:
        _dist.barrier(group=group)


# ----------------------------------------------------------------------------- upstream's aliases


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Optional[ProcessGroup] = None,
                 async_op: bool = False, debug: Any = None) -> CommHandle:  # fmt: skip
    return comm.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                      group: Optional[ProcessGroup] = None, async_op: bool = False, prof: bool = False,
                      debug: Any = None) -> CommHandle:  # fmt: skip
    return comm.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)


def inference_all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
                         async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
                         debug: Any = None) -> CommHandle:  # fmt: skip
    """Upstream's low-latency all-reduce for inference; the same all-reduce here."""
    return comm.all_reduce(tensor, op=op, group=group, async_op=async_op, prof=prof, log_name=log_name)


def all_reduce_coalesced(tensors: list, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
                         async_op: bool = False) -> CommHandle:  # fmt: skip
    """All-reduce several tensors in one collective: packed into one flat buffer per dtype,
    reduced, and copied back (each tensor in place)."""
    pending = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        pending.append((same, flat, comm.all_reduce(flat, op=op, group=group, async_op=async_op)))

    def unpack() -> None:
        for same, flat, _ in pending:
            for t, piece in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(piece.view_as(t))

    if not async_op:
        unpack()
        return CommHandle()
    handle = CommHandle(AllWorks([h for _, _, h in pending]))
    handle.after_wait(unpack)
    return handle


def all_gather_coalesced(output_tensors: list, input_tensors: list, group: Optional[ProcessGroup] = None,
                         async_op: bool = False) -> CommHandle:  # fmt: skip
    """`all_gather_into_tensor` of each pair `(output_tensors[i], input_tensors[i])`."""
    handles = [
        comm.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
        for out, inp in zip(output_tensors, input_tensors)
    ]
    return CommHandle(AllWorks(handles)) if async_op else CommHandle()


# ----------------------------------------------------------------------------- capability probes


def has_all_gather_into_tensor() -> bool:
    return True  # comm.all_gather_into_tensor works on every backend


def has_reduce_scatter_tensor() -> bool:
    return True  # comm.reduce_scatter_tensor works on every backend


def has_all_reduce_coalesced() -> bool:
    return True  # all_reduce_coalesced above packs the tensors itself


def has_coalescing_manager() -> bool:
    """Whether torch offers `_coalescing_manager` (upstream asks before batching collectives)."""
    return hasattr(_dist.distributed_c10d, "_coalescing_manager")
