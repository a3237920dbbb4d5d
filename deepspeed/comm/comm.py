"""The collectives facade: the only module in `deepspeed/` that imports torch.distributed.

Every collective is a plain function that takes its buffers and group as arguments and
returns a `CommHandle` (already complete when `async_op=False`). ZeRO code calls them through
the `deepspeed.comm` module attribute, so a test can count or patch them in one place.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` (a FutureWarning
on every call) in favour of `all_gather_single` / `reduce_scatter_single`; we keep
DeepSpeed's names for callers and call the newer functions where torch has them.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
import weakref
from typing import Any, Optional

import torch
import torch.distributed as _dist

from deepspeed import process_state
from deepspeed.comm import env_discovery, hierarchical, node_traffic, shm
from deepspeed.comm.handle import AllWorks as _AllWorks
from deepspeed.comm.handle import CommHandle
from deepspeed.comm.handle import handle_of as _handle
from deepspeed.utils.comms_logging import CommsLogger
from deepspeed.utils.logging import logger

ReduceOp = _dist.ReduceOp
ProcessGroup = _dist.ProcessGroup

# Minutes a collective may wait for a peer before it fails (a dead rank becomes an error).
DEFAULT_TIMEOUT_MINUTES = 30
TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"

_ALL_GATHER_SINGLE = getattr(_dist, "all_gather_single", None) or _dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(_dist, "reduce_scatter_single", None) or _dist.reduce_scatter_tensor
# From this many output bytes up, an all-gather on gloo is one broadcast per rank
# ([Note: all-gather on gloo]); below it the native all-gather's single round trip wins.
GLOO_BROADCAST_MIN_BYTES = 256 * 1024

# Times and records collectives while enabled ([Note: the communication logger] in
# utils/comms_logging.py); `log_summary` and the other readers are in comms_api.py.
comms_logger = CommsLogger()
process_state.register("deepspeed.comm.comm.comms_logger", comms_logger, comms_logger.reset)


def _timed(fn: Any, args: tuple, log_name: str, prof: bool, group: Any, nbytes: int, async_op: bool) -> Any:
    """`fn(*args)` through the logger (a collective calls it first while the logger is enabled)."""
    if node_traffic.COUNTER.on:  # [Note: counting cross-node bytes]
        ranks = get_all_ranks_from_group(group)
        node_traffic.COUNTER.count(fn.__name__, args, ranks, get_rank(), nbytes, hierarchical.plan_for(group))
    return comms_logger.timed(fn, args, fn.__name__, log_name, prof, nbytes, get_world_size(group), async_op)


def configure(
    deepspeed_config: Optional[Any] = None,
    enabled: Optional[bool] = None,
    prof_all: Optional[bool] = None,
    prof_ops: Optional[list] = None,
    verbose: Optional[bool] = None,
    debug: Optional[bool] = None,
) -> None:
    """Set the communication logger (upstream's signature): every setting of the `comms_logger`
    section of `deepspeed_config` (a `DeepSpeedConfig` or its dict) when it has one, then each
    argument that is not None. The engine calls it with its config."""
    from deepspeed.comm.config import comms_logger_section

    section = None if deepspeed_config is None else comms_logger_section(deepspeed_config)
    given = {
        "enabled": enabled,
        "prof_all": prof_all,
        "prof_ops": prof_ops,
        "verbose": verbose,
        "debug": debug,
    }
    comms_logger.configure(section, **given)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------- set-up


def default_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
    try:
        minutes = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of minutes; set it to e.g. 30") from None
    if minutes <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of minutes")
    return datetime.timedelta(minutes=minutes)


def _env_int(name: str, given: int) -> Optional[int]:
    if given is not None and given >= 0:
        return given
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _default_backend() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def init_distributed(
    dist_backend: Optional[str] = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Optional[datetime.timedelta] = None,
    init_method: Optional[str] = None,
    dist_init_required: Optional[bool] = None,
    config: Optional[Any] = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the default process group, or do nothing when torch.distributed already is initialized.

    Rank and world size come from the arguments, else `RANK` / `WORLD_SIZE`; a process with
    neither is treated as a single-process job (rank 0 of 1) so plain scripts run unchanged.
    `MASTER_ADDR` / `MASTER_PORT` default to 127.0.0.1 and `distributed_port` (for a single
    process, a free port if that one is busy). `timeout` defaults to `DEEPSPEED_TIMEOUT`
    minutes (30), after which a missing peer is an error.
    With `auto_mpi_discovery` (the default) and no RANK / WORLD_SIZE, a process started by
    mpirun or srun takes them from the MPI / Slurm variables (`env_discovery.py`).
    """
    if config is not None:
        configure(deepspeed_config=config)  # upstream reads only its comms_logger section
    if dist_init_required is False:
        return
    if _dist.is_initialized():
        _destroy_before_teardown()  # whoever made it (accelerate, Lightning) may not destroy it
        return  # the caller (or a launcher) already set torch.distributed up: wrap it as it is
    from deepspeed.launcher.launch import follow_launcher

    follow_launcher()  # a rank of our launcher ends with it, even one killed outright
    if auto_mpi_discovery and rank < 0 and world_size < 0 and not {"RANK", "WORLD_SIZE"} & set(os.environ):
        found = env_discovery.apply()
        if found is not None and verbose:
            logger.info(
                f"init_distributed: rank {found.rank} of {found.world_size} from {found.source} variables"
            )
    rank_value = _env_int("RANK", rank)
    world_value = _env_int("WORLD_SIZE", world_size)
    if rank_value is None and world_value is None:
        rank_value, world_value = 0, 1
    elif rank_value is None or world_value is None:
        raise ValueError(
            f"init_distributed: got RANK={rank_value} and WORLD_SIZE={world_value}; set both "
            "(a launcher such as `deepspeed` or `torchrun` does) or neither for a single process"
        )
    if not 0 <= rank_value < world_value:
        raise ValueError(f"init_distributed: RANK={rank_value} is outside [0, WORLD_SIZE={world_value})")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world_value == 1 and "MASTER_PORT" not in os.environ:  # no peer to agree on a port with
        from deepspeed.launcher.launch import lone_rendezvous_port

        distributed_port = lone_rendezvous_port(distributed_port)
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    # Launchers set LOCAL_RANK; a hand-started single-node job gets its global rank.
    os.environ.setdefault("LOCAL_RANK", str(rank_value))
    backend = dist_backend or _default_backend()
    if backend == "nccl":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_device(get_local_rank())
    if verbose:
        logger.info(f"init_distributed: backend={backend} rank={rank_value} world_size={world_value}")
    _dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=rank_value,
        world_size=world_value,
        timeout=timeout or default_timeout(),
    )
    _destroy_before_teardown()


# Holds True once `_destroy_at_exit` is registered with atexit, which cannot be taken back.
_EXIT_HOOK = process_state.register("deepspeed.comm.comm._EXIT_HOOK", [])
# How long `_destroy_at_exit` leaves gloo's worker threads to release finished collectives
# (they need the GIL for microseconds; the margin is for a descheduled thread on a busy host).
_GLOO_RELEASE_S = 0.05


def _destroy_before_teardown() -> None:
    """Register `_destroy_at_exit` once, for the group this process trains with."""
    if not _EXIT_HOOK:
        atexit.register(_destroy_at_exit)
        _EXIT_HOOK.append(True)


def _destroy_at_exit() -> None:
    """Destroy the default group, if the program did not, before the interpreter tears down.

    A gloo group left to be destroyed during interpreter teardown can abort the process
    ("terminate called without an active exception", pytorch/pytorch#190489) after a run
    that otherwise succeeded. That holds for a group a client made (accelerate's
    PartialState, Lightning) as much as for one `init_distributed` made, so both register
    this. Destroying is local (no collective), so it cannot hang on a peer that already
    exited; a program that destroyed the group itself makes it a no-op.

    Before that, a short sleep. gloo's worker thread lets go of a finished collective after
    the caller's `wait()` returned, and letting go takes the GIL (the work holds Python
    tensors). One still waiting for the GIL when the interpreter starts finalizing calls
    `pthread_exit` in a C++ frame, which aborts the process the same way: a core dump of such
    an abort had gloo's `runLoop` in `~AsyncAllreduceWork`, in `take_gil`, while the main
    thread was in `Py_FinalizeEx`; the program's last gloo all-reduce had returned 1 ms before
    it ended, and 3 of 18 such runs aborted. Sleeping releases the GIL, so the release runs
    now, while the interpreter can still take it.
    """
    if _dist.is_available() and _dist.is_initialized():
        if "gloo" in str(_dist.get_backend()):
            time.sleep(_GLOO_RELEASE_S)
        destroy_process_group()  # ours: the channels go too


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    if group is None:
        _SHM_CHANNELS.clear()
        _dist.destroy_process_group()
    else:
        _SHM_CHANNELS.pop(group, None)
        _dist.destroy_process_group(group)


def _require_initialized(call: str) -> None:
    """Raise unless the default group exists, as upstream does.

    Answering rank 0 / world size 1 before `init_distributed` would be a silent lie under a
    launcher: every process would take the `rank == 0` branch (write the checkpoint, download
    the data) while believing itself alone.
    """
    if not is_initialized():
        raise RuntimeError(
            f"deepspeed.comm.{call}() was called before the process group exists; call "
            "deepspeed.init_distributed() (or deepspeed.initialize, which calls it) first, or check "
            "deepspeed.comm.is_initialized() before asking"
        )


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in `group`; raises before `init_distributed` (see `_require_initialized`)."""
    _require_initialized("get_rank")
    return _dist.get_rank(group)


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """The size of `group`; raises before `init_distributed` (see `_require_initialized`)."""
    _require_initialized("get_world_size")
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> ProcessGroup:
    return _dist.group.WORLD


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    return _dist.get_backend(group)


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    if group is None or group is _dist.group.WORLD:
        return group_rank
    return _dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Optional[ProcessGroup] = None) -> list:
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def new_group(ranks: Optional[list] = None, **kwargs: Any) -> ProcessGroup:
    return _dist.new_group(ranks=ranks, **kwargs)


# ----------------------------------------------------------------------------- shared memory

# Each gloo group's shared-memory channel, None where it cannot have one ([Note: shared-memory
# collectives] in shm.py). Keyed weakly by the group object (the default group for None): a
# strong key kept a group that a client destroyed with torch's own destroy_process_group
# alive, and with it gloo's threads, which then met interpreter teardown and aborted the
# process ("terminate called without an active exception"). A destroyed group that someone
# still references keeps its entry until the next channel is made, which drops it.
# Each entry lives and dies with its group (`destroy_process_group` drops them all).
_SHM_CHANNELS: weakref.WeakKeyDictionary = process_state.register(
    "deepspeed.comm.comm._SHM_CHANNELS", weakref.WeakKeyDictionary()
)


def _outside(group: Any) -> bool:
    """Whether this rank is not in `group` (torch hands it an int placeholder): torch's own call
    then warns and returns, as it should, with no channel, plan or size of ours involved."""
    return group is not None and not isinstance(group, ProcessGroup)


def _shm_channel(group: Optional[ProcessGroup], *tensors: torch.Tensor) -> Optional[shm.ShmChannel]:
    """The group's shared-memory channel when `tensors` can use it, else None (use the backend).

    Made on the group's first eligible collective, which every rank reaches in the same
    order, so making it (three small gloo collectives) is itself collective.
    """
    for t in tensors:  # `is_cpu`: no device object made, on a path every gather takes
        if not t.is_cpu or not t.is_contiguous():
            return None
    if _outside(group):
        return None
    key = _dist.group.WORLD if group is None else group
    channel = _SHM_CHANNELS.get(key, False)
    if channel is not False:
        return channel
    # A rank outside `group` keeps torch's own answer to a call it should not make.
    if get_rank(group) < 0 or get_backend(group) != "gloo" or get_world_size(group) == 1:
        _SHM_CHANNELS[key] = None
        return None
    _drop_stale_channels()
    channel = _SHM_CHANNELS[key] = _make_shm_channel(group)
    return channel


def _make_shm_channel(group: Optional[ProcessGroup]) -> Optional[shm.ShmChannel]:
    """All or none of the group's ranks use a channel: first they agree that each can, then
    rank 0 makes the segment, every rank maps it and checks rank 0's token, and they agree
    again. The first agreement comes before any file exists, so a peer that never arrives
    (it raised, or died) leaves nothing behind in /dev/shm."""
    world, rank = get_world_size(group), get_rank(group)
    answers: list = [None] * world
    _dist.all_gather_object(
        answers,
        (shm.unsupported_reason(world), os.getpid(), shm.pid_namespace(), shm.env_error()),
        group=group,
    )
    for other, (_, _, _, error) in enumerate(answers):
        if error is not None:  # every rank raises, not only the misconfigured one (which would leave a hang)
            raise ValueError(f"rank {other}: {error}")
    reasons = [r for r, _, _, _ in answers if r is not None]
    if reasons:
        return _stay_on_gloo(world, rank, reasons[0])
    made = [None, None, shm.SLOT_BYTES]  # path, token (or rank 0's error), slot bytes
    if rank == 0:
        try:
            made[:2] = shm.create_segment(world, shm.SLOT_BYTES)
        except OSError as exc:
            made[1] = f"cannot reserve {shm.segment_bytes(world, shm.SLOT_BYTES) >> 20} MB in /dev/shm: {exc}"
    try:
        _dist.broadcast_object_list(made, src=get_global_rank(group, 0), group=group)
        path, token, slot_bytes = made
        channel, reason = None, token if path is None else None  # rank 0's error, when it made none
        if path is not None:
            try:
                channel = shm.ShmChannel(
                    path, token, world, rank, default_timeout().total_seconds(), slot_bytes
                )
            except (OSError, ValueError) as exc:
                reason = str(exc)
        mapped: list = [None] * world
        _dist.all_gather_object(mapped, reason, group=group)
    finally:
        # Every rank has mapped it (or failed to, or a peer never came): the name is no longer
        # needed, and a segment left in /dev/shm would hold its memory until reboot.
        if rank == 0 and made[0] is not None:
            os.unlink(made[0])
    reasons = [r for r in mapped if r is not None]
    if reasons:
        return _stay_on_gloo(world, rank, reasons[0])
    if len({ns for _, _, ns, _ in answers}) == 1:
        channel.check_liveness_of([pid for _, pid, _, _ in answers])
    return channel


def _stay_on_gloo(world: int, rank: int, reason: str) -> None:
    if rank == 0:
        logger.info(f"collectives of a {world}-rank gloo group use gloo, not shared memory: {reason}")
    return None


def _drop_stale_channels() -> None:
    """Forget channels of groups torch no longer knows (destroyed without our facade)."""
    known = getattr(getattr(_dist.distributed_c10d, "_world", None), "pg_map", None)
    if known is None:
        return
    for group in [g for g in _SHM_CHANNELS if g not in known]:
        del _SHM_CHANNELS[group]


def shm_segments() -> dict:
    """`data_ptr -> bytes` of every shared-memory segment this process maps (a fixed-size
    transport buffer per group, like a backend's own buffers; benchmarks report it apart)."""
    storages = [c.segment.untyped_storage() for c in _SHM_CHANNELS.values() if c is not None]
    return {s.data_ptr(): s.nbytes() for s in storages}


def shm_counts() -> dict:
    """Collectives run through shared memory so far, by kind: `{kind: [calls, output bytes]}`."""
    total: dict = {}
    for channel in _SHM_CHANNELS.values():
        for kind, (calls, nbytes) in (channel.counts if channel is not None else {}).items():
            row = total.setdefault(kind, [0, 0])
            row[0] += calls
            row[1] += nbytes
    return total


# ----------------------------------------------------------------------------- collectives


def barrier(
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "barrier",
) -> CommHandle:
    if comms_logger.timing and comms_logger.idle:
        return _timed(barrier, (group, async_op), log_name, prof, group, 0, async_op)
    channel = _shm_channel(group)
    if channel is not None:
        channel.barrier()
        return CommHandle()
    return _handle(_dist.barrier(group=group, async_op=async_op), async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
) -> CommHandle:
    """Broadcast from global rank `src` (DeepSpeed and torch both take a global rank here)."""
    if comms_logger.timing and comms_logger.idle:
        return _timed(
            broadcast, (tensor, src, group, async_op), log_name, prof, group, _nbytes(tensor), async_op
        )
    channel = _shm_channel(group, tensor)
    if channel is not None:
        channel.broadcast(tensor, src if group is None else _dist.get_group_rank(group, src))
        return CommHandle()
    return _handle(_dist.broadcast(tensor, src, group=group, async_op=async_op), async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
) -> CommHandle:
    if comms_logger.timing and comms_logger.idle:
        return _timed(
            all_reduce, (tensor, op, group, async_op), log_name, prof, group, _nbytes(tensor), async_op
        )
    if op == ReduceOp.SUM and tensor.dtype in shm.SUMMABLE:
        channel = _shm_channel(group, tensor)
        if channel is not None:
            channel.all_reduce_sum(tensor)
            return CommHandle()
    return _handle(_dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
) -> CommHandle:
    if comms_logger.timing and comms_logger.idle:
        return _timed(
            reduce, (tensor, dst, op, group, async_op), log_name, prof, group, _nbytes(tensor), async_op
        )
    return _handle(_dist.reduce(tensor, dst, op=op, group=group, async_op=async_op), async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Optional[list] = None,
    input_split_sizes: Optional[list] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
) -> CommHandle:
    """Rank r sends the i-th slice of `tensor` (along dim 0) to rank i and receives rank i's
    r-th slice into the i-th slice of `output`; equal slices unless split sizes are given.
    gloo, nccl and the CPU backends all have it natively in torch 2.13 (Ulysses' sequence
    parallelism and gloo's reduce-scatter use it). The communication logger records it."""
    if comms_logger.timing and comms_logger.idle:
        args = (output, tensor, output_split_sizes, input_split_sizes, group, async_op)
        return _timed(all_to_all_single, args, log_name, prof, group, _nbytes(tensor), async_op)
    if shm.equal_slices(output, tensor, output_split_sizes, input_split_sizes, get_world_size(group)):
        channel = _shm_channel(group, output, tensor)
        if channel is not None:
            channel.all_to_all(output, tensor)
            return CommHandle()
    work = _dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )
    return _handle(work, async_op)


def all_gather(
    tensor_list: list,
    tensor: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
) -> CommHandle:
    if comms_logger.timing and comms_logger.idle:
        args = (tensor_list, tensor, group, async_op)
        return _timed(all_gather, args, log_name, prof, group, _nbytes(tensor), async_op)
    return _handle(_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op), async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
) -> CommHandle:
    """Concatenate every rank's `tensor` (equal sizes) into `output_tensor`, in rank order.

    [Note: all-gather on gloo]
    gloo's all-gather is much slower on CPU than one broadcast per rank of the same bytes
    (2 ranks, 25 MB out: 18.9 ms against 11.4 ms; 4 ranks: 45 ms against 34 ms; measured
    side by side by benchmarks/bench_collectives.py), so on gloo, from
    `GLOO_BROADCAST_MIN_BYTES` up, each rank copies its input into its own chunk of the output
    and every chunk is broadcast from its owner, all issued at once. The result is the same
    bytes in the same places; nccl keeps its native all-gather.
    """
    if comms_logger.timing and comms_logger.idle:
        args = (output_tensor, tensor, group, async_op)
        return _timed(all_gather_into_tensor, args, log_name, prof, group, _nbytes(tensor), async_op)
    if _outside(group):
        return _handle(_ALL_GATHER_SINGLE(output_tensor, tensor, group=group, async_op=async_op), async_op)
    two_hop = hierarchical.plan_for(group)  # [Note: the two-hop all-gather]
    if two_hop is None and output_tensor.dtype == tensor.dtype:
        channel = _shm_channel(group, output_tensor, tensor)
        if channel is not None:  # the channel knows the group's size: no torch.distributed call
            _check_gather_sizes(output_tensor, tensor, channel.world)
            channel.all_gather(output_tensor, tensor)
            return CommHandle()
    world, rank = get_world_size(group), get_rank(group)
    _check_gather_sizes(output_tensor, tensor, world)
    if two_hop is not None:
        two_hop.all_gather(output_tensor, tensor)
        return CommHandle()
    nbytes = output_tensor.numel() * output_tensor.element_size()
    on_gloo = get_backend(group) == "gloo"
    if not on_gloo or nbytes < GLOO_BROADCAST_MIN_BYTES:
        if on_gloo and shm.overlaps(tensor, output_tensor):
            tensor = tensor.clone()  # gloo copies the input into the output: no aliasing
        work = _ALL_GATHER_SINGLE(output_tensor, tensor, group=group, async_op=async_op)
        return _handle(work, async_op)
    chunks = output_tensor.view(-1).chunk(world)
    mine = chunks[rank]
    if mine.data_ptr() != tensor.data_ptr():
        mine.copy_(tensor.view(-1))
    # Global source ranks: `group_src=` exists only from torch 2.6, and we support 2.1 up.
    owners = range(world) if group is None else [_dist.get_global_rank(group, i) for i in range(world)]
    works = [_dist.broadcast(c, src=src, group=group, async_op=True) for src, c in zip(owners, chunks)]
    handle = CommHandle(_AllWorks(works))
    if not async_op:
        handle.wait()
    return handle


def _check_gather_sizes(output_tensor: torch.Tensor, input_tensor: torch.Tensor, world: int) -> None:
    if output_tensor.numel() != world * input_tensor.numel():
        raise ValueError(
            f"all_gather_into_tensor: output has {output_tensor.numel()} elements, which is not "
            f"{world} ranks x the input's {input_tensor.numel()}"
        )


def completes_on_issue(group: Optional[ProcessGroup], tensor: torch.Tensor) -> bool:
    """Whether a collective of `tensor` on `group` is finished when its call returns (shared
    memory), so issuing it early overlaps nothing and it may write straight to final places."""
    return _shm_channel(group, tensor) is not None


def all_gather_into_columns(
    outputs: list,
    sizes: list,
    input_tensor: Optional[torch.Tensor],
    group: Optional[ProcessGroup] = None,
    scratch: Optional[torch.Tensor] = None,
    prof: bool = False,
    log_name: str = "all_gather_into_columns",
    plans: Optional[list] = None,
) -> None:
    """One all-gather whose rank-major result `[world, n]` is split by columns into `outputs`.

    `outputs[i]` is `[world, sizes[i]]` (any strides) and the sizes sum to `n`: row r of
    `outputs[i]` gets rank r's columns `[offset_i, offset_i + sizes[i])` of the result. Each
    rank's contribution is `input_tensor` (`n` elements), or, when that is None, what row
    `rank` of the outputs already holds (in place: that row is read, never written; stages 1
    and 2 after a step, whose updated slices lie in the parameters). Through shared memory
    the columns go straight from the slots to `outputs`; otherwise through an all-gather into
    `scratch` (1D, at least `world * n` elements: the caller's reused memory) or, without one,
    a fresh buffer. The logger records one rank's contribution (`n` elements). `plans`:
    `shm.BlockPlan`s that together hold `outputs` in order, each a run of them back to back
    in one flat tensor; through shared memory the pieces then move on the write side and
    each run is read back in contiguous copies ([Note: the block layout of a gather]).
    """
    if comms_logger.timing and comms_logger.idle:
        nbytes = sum(sizes) * (outputs[0] if input_tensor is None else input_tensor).element_size()
        args = (outputs, sizes, input_tensor, group, scratch, False, log_name, plans)
        return _timed(all_gather_into_columns, args, log_name, prof, group, nbytes, False)
    world, n = get_world_size(group), sum(sizes)
    if len(sizes) != len(outputs) or (input_tensor is not None and input_tensor.numel() != n):
        have = "in place" if input_tensor is None else f"the input's {input_tensor.numel()} elements"
        raise ValueError(
            f"all_gather_into_columns: sizes {sizes} do not split {len(outputs)} outputs ({have})"
        )
    in_place = input_tensor is None
    if in_place and world == 1:
        return  # the one row is already this rank's
    two_hop = hierarchical.plan_for(group)  # [Note: the two-hop all-gather]
    if two_hop is not None:
        mine = torch.cat([out[get_rank(group)] for out in outputs]) if in_place else input_tensor
        gathered = torch.empty(world, n, dtype=mine.dtype, device=mine.device)
        two_hop.all_gather(gathered, mine)
        torch.split_with_sizes_copy(gathered, sizes, dim=1, out=outputs)
        return
    if in_place:
        channel = _shm_channel(group) if all(out.is_cpu for out in outputs) else None
    else:
        channel = _shm_channel(group, input_tensor)
    if channel is not None:
        if plans is not None and not in_place:
            channel.all_gather_blocks(plans, input_tensor.view(-1))
        else:
            channel.all_gather_columns(outputs, sizes, input_tensor)
        return
    sample = outputs[0] if in_place else input_tensor
    if scratch is None:
        scratch = torch.empty(world * n, dtype=sample.dtype, device=sample.device)
    gathered = scratch.view(-1)[: world * n].view(world, n)
    rank = get_rank(group)
    if in_place:  # this rank's rows side by side in its own row of the result: the input
        torch.cat([out[rank] for out in outputs], out=gathered[rank])
        input_tensor = gathered[rank]
    all_gather_into_tensor(gathered.view(-1), input_tensor, group=group)
    shm.copy_columns(gathered, sizes, outputs, [r for r in range(world) if r != rank] if in_place else None)


def reduce_scatter_columns(
    output_tensor: torch.Tensor,
    blocks: list,
    group: Optional[ProcessGroup] = None,
    prescale: float = 1.0,
    prof: bool = False,
    log_name: str = "reduce_scatter_columns",
) -> None:
    """`reduce_scatter_tensor` (a sum) of the input that `blocks` form side by side, for a
    group whose collectives complete on issue (see `completes_on_issue`).

    `blocks[i]` is `[world, n_i]` (row r: what goes to rank r), `output_tensor` has `sum(n_i)`
    elements, and each rank's contribution is multiplied by `prescale` before the sum. The
    blocks go straight into this rank's shared-memory slot, with no send buffer. The logger
    records the whole input (`world` times the output).
    """
    if comms_logger.timing and comms_logger.idle:
        nbytes = get_world_size(group) * _nbytes(output_tensor)
        args = (output_tensor, blocks, group, prescale)
        return _timed(reduce_scatter_columns, args, log_name, prof, group, nbytes, False)
    sizes = [b.shape[1] for b in blocks]
    if sum(sizes) != output_tensor.numel() or any(b.shape[0] != get_world_size(group) for b in blocks):
        raise ValueError(
            f"reduce_scatter_columns: blocks of shapes {[tuple(b.shape) for b in blocks]} do not form the "
            f"[{get_world_size(group)}, {output_tensor.numel()}] input"
        )
    channel = _shm_channel(group, output_tensor)
    if channel is None:
        raise RuntimeError(
            "reduce_scatter_columns: this group's collectives do not complete on issue; "
            "pack the blocks and call reduce_scatter_tensor"
        )
    channel.reduce_scatter_columns(output_tensor, blocks, sizes, prescale)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    input_reusable: bool = False,
    scratch: Optional[torch.Tensor] = None,
) -> CommHandle:
    """Reduce `tensor` over ranks; rank r keeps the r-th equal slice in `output_tensor`.

    [Note: reduce-scatter on gloo]
    gloo's reduce-scatter is much slower on CPU than moving the same bytes with an
    all-to-all and summing locally (25 MB in, 2 ranks: 44 ms native, 27 ms as an all-reduce
    that keeps its slice, 17 ms as an all-to-all plus sum; 4 ranks: 90, 72 and 37 ms;
    benchmarks/bench_collectives.py, side by side). So on gloo a sum is an
    `all_to_all_single` (rank r receives every rank's r-th slice, rank-major) followed by an
    add of the received rows in rank order; an all-to-all sends each byte once, where an
    all-reduce sends it twice. Other ops all-reduce and keep the slice. `scratch`: a 1D
    buffer of at least `tensor.numel()` elements to receive into (the caller's reused
    memory: a fresh multi-MB buffer costs page faults on the CPU); None allocates one.
    `input_reusable=True`: the all-reduce path may reduce in the caller's buffer (the caller
    discards it after). nccl keeps its native reduce-scatter.
    """
    if comms_logger.timing and comms_logger.idle:
        args = (output_tensor, tensor, op, group, async_op, prof, log_name, input_reusable, scratch)
        return _timed(reduce_scatter_tensor, args, log_name, prof, group, _nbytes(tensor), async_op)
    if _outside(group) or get_backend(group) != "gloo":
        work = _REDUCE_SCATTER_SINGLE(output_tensor, tensor, op=op, group=group, async_op=async_op)
        return _handle(work, async_op)
    world, rank, n = get_world_size(group), get_rank(group), output_tensor.numel()
    if tensor.numel() != world * n:
        raise ValueError(
            f"reduce_scatter_tensor: input has {tensor.numel()} elements, which is not {world} ranks "
            f"x the output's {n}"
        )
    same_dtype = output_tensor.dtype == tensor.dtype
    if op == ReduceOp.SUM and same_dtype and tensor.dtype in shm.SUMMABLE:
        channel = _shm_channel(group, output_tensor, tensor)
        if channel is not None:
            channel.reduce_scatter_sum(output_tensor, tensor)
            return CommHandle()
    if op == ReduceOp.SUM:
        if scratch is None:
            scratch = torch.empty(world * n, dtype=tensor.dtype, device=tensor.device)
        received = scratch.view(-1)[: world * n]
        work = _dist.all_to_all_single(received, tensor.reshape(-1), group=group, async_op=async_op)
        rows = received.view(world, n)  # row r: rank r's slice for this rank

        def finish() -> None:  # add the rows in rank order: the same sum however the ranks ran
            out = output_tensor.view(-1)
            if world == 1:
                out.copy_(rows[0])
                return
            torch.add(rows[0], rows[1], out=out)
            for row in rows[2:]:
                out.add_(row)

    else:
        buffer = tensor if input_reusable else tensor.clone()
        work = _dist.all_reduce(buffer, op=op, group=group, async_op=async_op)

        def finish() -> None:  # the reduction is done: keep this rank's slice
            output_tensor.view(-1).copy_(buffer.view(-1)[rank * n : (rank + 1) * n])

    if async_op:
        return CommHandle(work, on_complete=finish)
    finish()
    return CommHandle()
