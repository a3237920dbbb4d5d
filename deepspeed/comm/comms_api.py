"""Reading the communication logger: `log_summary` (upstream's table) and the records as data.

The logger itself, and what it records, is described in [Note: the communication logger]
(deepspeed/utils/comms_logging.py); `deepspeed.comm.configure` switches it on.
"""

from __future__ import annotations

from typing import Optional

import torch

from deepspeed.comm import comm, node_traffic
from deepspeed.utils import comms_logging

SUMMARY_BARRIER = "log_summary_barrier"  # upstream's log name for the barriers around a summary


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict]:
    """Print (rank 0) the table of every record so far, and return its figures when `return_dict`.

    Collective: every rank must call it. Like upstream, it waits for every rank (a barrier
    logged as "log_summary_barrier") before and after. The dict has upstream's layout:
    `{"summary": {record_name: {msg_size: {"count", "total_latency_ms", "avg_latency_ms",
    "tput_avg_gbps", "busbw_avg_gbps", "msg_size_bytes", "msg_size_str"}}}, "straggler_analysis":
    None or {record_name: {msg_size: {"count", "total_comm_lat_ms", "total_straggler_ms",
    "avg_comm_lat_ms", "avg_straggler_ms", ...}}}, "metadata": {"world_size", "rank",
    "timestamp"}}`, with the figures the table prints (before their rounding to 2 decimals).

    `show_straggler`: each latency's minimum over the ranks comes from one all-reduce (MIN)
    of all of them; a rank's straggler effect is its latency less that minimum, the time it
    waited for the slowest rank to arrive. Every rank must hold the same records; a
    two-number all-reduce first checks that each holds as many latencies (else it raises,
    rather than hang in a mismatched all-reduce). Neither all-reduce is recorded.
    """
    logger = comm.comms_logger
    comm.barrier(log_name=SUMMARY_BARRIER)
    rank, world = comm.get_rank(), comm.get_world_size()
    summary = logger.summary()
    straggler = None
    if show_straggler:
        logger.idle = False  # its own all-reduces are not records
        try:
            straggler = _straggler(logger)
        finally:
            logger.idle = True
    if rank == 0:
        table = comms_logging.format_summary(summary)
        if straggler is not None:
            table += "\n" + comms_logging.format_straggler(straggler)
        print(table, flush=True)
    comm.barrier(log_name=SUMMARY_BARRIER)
    return comms_logging.result_dict(summary, straggler, world, rank) if return_dict else None


def _straggler(logger: comms_logging.CommsLogger) -> dict:
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name() if comm.get_backend() == "nccl" else "cpu"
    own = logger.latencies()
    counts = torch.tensor([len(own), -len(own)], dtype=torch.float64, device=device)
    comm.all_reduce(counts, op=comm.ReduceOp.MAX)
    if counts[0].item() != len(own) or -counts[1].item() != len(own):
        raise RuntimeError(
            f"log_summary(show_straggler=True): this rank holds {len(own)} latencies and another "
            f"between {int(-counts[1].item())} and {int(counts[0].item())}; every rank must record the same "
            "collectives (the same comms_logger settings, reset_log() on every rank)"
        )
    least = torch.tensor(own, dtype=torch.float64, device=device)
    comm.all_reduce(least, op=comm.ReduceOp.MIN)
    return logger.straggler(least.tolist())


def reset_log() -> None:
    """Drop the records `log_summary` reads (on this rank): a summary per epoch or interval."""
    comm.comms_logger.reset_data()


def has_comm_data() -> bool:
    """Whether any collective was recorded since the last `reset_log()`."""
    return comm.comms_logger.has_data()


def get_comm_operation_count() -> int:
    """How many collectives were recorded since the last `reset_log()`."""
    return comm.comms_logger.get_total_operations()


def get_logged_comm_ops() -> list:
    """The record names (log names) recorded since the last `reset_log()`."""
    return comm.comms_logger.get_operation_names()


def count_totals(on: bool = True) -> None:
    """Time every collective for `comms_totals` even while the logger is off (no records, no
    printing): what an engine with `wall_clock_breakdown` asks for, to report its all-gather
    and reduce-scatter milliseconds per step. Each timed collective synchronizes the
    accelerator around itself, as the timers of `wall_clock_breakdown` do. `on=False`
    withdraws one earlier `True`; the timing stops when none is left."""
    comm.comms_logger.count_totals(on)


def comms_totals(since: Optional[dict] = None) -> dict:
    """Per collective (its own name, e.g. "all_gather_into_tensor", whatever its `log_name`):
    `{"count", "bytes", "latency_ms"}` recorded since the process started, or since `since`,
    an earlier answer of this function (a mark). `reset_log()` does not clear these; only
    the ops recorded since the mark appear. Cheap: no collective, no copy of the records.

        mark = deepspeed.comm.comms_totals()
        engine.step()
        gather_ms = sum(v["latency_ms"] for op, v in deepspeed.comm.comms_totals(mark).items()
                        if op.startswith("all_gather"))
    """
    now = {
        op: {"count": c, "bytes": b, "latency_ms": ms} for op, (c, b, ms) in comm.comms_logger.totals.items()
    }
    return comms_logging.totals_since(now, since)


def count_node_traffic(nodes: Optional[tuple]) -> None:
    """Count, from now on and in a fresh tally, the bytes each collective brings to this rank
    from other nodes and from its own ([Note: counting cross-node bytes] in
    comm/node_traffic.py). `nodes`: the node index of every global rank, e.g.
    `deepspeed.utils.groups.node_layout()`; None stops counting. Read with `node_traffic_totals`."""
    if nodes is not None and len(nodes) != comm.get_world_size():
        raise ValueError(
            f"count_node_traffic: {len(nodes)} node indices for a world of {comm.get_world_size()} ranks; "
            "pass one per global rank (deepspeed.utils.groups.node_layout())"
        )
    node_traffic.COUNTER.nodes = None if nodes is None else tuple(nodes)
    node_traffic.COUNTER.tally = {}
    comm.comms_logger.count_nodes(nodes is not None)


def node_traffic_totals() -> dict:
    """Per collective, `{"count", "cross_bytes", "within_bytes"}` this rank received since
    `count_node_traffic` started."""
    return node_traffic.totals()
