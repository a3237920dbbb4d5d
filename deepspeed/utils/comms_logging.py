"""The communication logger: what `deepspeed.comm` records of each collective, and its summary.

[Note: the communication logger]
`deepspeed.comm` owns one `CommsLogger` (`deepspeed.comm.comms_logger`). While it is
`enabled`, every collective of the facade asks it whether to time the call (`prof_all`, or
the call's `log_name` listed in `prof_ops`, or the call's own `prof=True`); a timed call
synchronizes the accelerator before it starts and after it completes (for an `async_op`
call: after `wait()`), and the logger records its latency, message size and bandwidths. While
it is off, a collective pays one attribute check and nothing else.

Message sizes follow upstream's convention, the bytes of the call's input tensor:
all-gathers record one rank's input (the output is `world` times that), reduce-scatters the
whole input (`world` times the output), all-reduces, broadcasts and reduces their tensor, a
barrier 0. Bandwidths follow nccl-tests (doc/PERFORMANCE.md): `algbw = S / t` with `S` the
bytes of the whole collective (an all-gather's full output, a reduce-scatter's full input),
and `busbw = algbw * 2(n-1)/n` for all-reduce, `algbw * (n-1)/n` for all-gather,
reduce-scatter and all-to-all, `algbw` for broadcast, reduce and barrier; `n` is the size of
the call's group. Upstream reports an all-reduce's algbw as `2S / t`; here it is `S / t`, as
nccl-tests define it, and its busbw is the same figure as upstream's.

Only the outermost collective of a call is recorded: one that is built from others (an
all-gather into columns that falls back to `all_gather_into_tensor`, the gather of a channel
set-up) counts once, under its own name.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from typing import Any, Callable, Optional

from deepspeed.utils.logging import print_dist

# Op name -> the factor from the recorded message size to the bytes of the whole collective,
# and busbw's factor of algbw as a function of the group size n.
_ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_into_columns")
_SCATTERS = (
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_columns",
    "all_to_all_single",
    "all_to_all",
)
_ROOTED = ("broadcast", "reduce", "barrier")

HEADER = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)
STRAGGLER_HEADER = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total comm lat(ms)",
    "Total straggler(ms)",
    "Avg comm lat(ms)",
    "Avg straggler(ms)",
)
_FACADE = ("deepspeed.comm.comm", "deepspeed.comm.passthrough", __name__)  # frames `_caller` skips
COLUMN = 20  # characters per column of the printed tables
TRIM = 0.1  # the fraction cut from each end of a sorted list before averaging it


def convert_size(size_bytes: int) -> str:
    """`size_bytes` in the largest binary unit that keeps it at least 1, to two decimals ("6.0 MB")."""
    if size_bytes <= 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    power = min(int(math.log(size_bytes, 1024)), len(units) - 1)
    return f"{round(size_bytes / 1024**power, 2)} {units[power]}"


def calc_bw_log(comm_op: str, size: int, duration_ms: float, world: int) -> tuple:
    """`(algbw, busbw)` in Gbps of `comm_op` moving a recorded `size` bytes in `duration_ms` among
    `world` ranks (the conventions in [Note: the communication logger])."""
    if duration_ms <= 0 or size <= 0:
        return 0.0, 0.0
    total = size * world if comm_op in _ALL_GATHERS else size
    algbw = total * 8 / (duration_ms * 1e6)  # bytes per ms -> gigabits per second
    if comm_op == "all_reduce":
        return algbw, algbw * 2 * (world - 1) / world
    if comm_op in _ALL_GATHERS or comm_op in _SCATTERS:
        return algbw, algbw * (world - 1) / world
    return algbw, algbw  # broadcast, reduce, barrier and anything rooted


def trim_mean(values: list, fraction: float = TRIM) -> float:
    """The mean of `values` without the `fraction` smallest and largest of them (outliers)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


class CommsLogger:
    """The records of timed collectives and the settings that choose them (`configure`).

    `comms_dict` keeps upstream's layout, `{record_name: {msg_size: [count, [latency_ms],
    [algbw], [busbw]]}}`; `totals` adds, per op (the collective's own name, whatever its
    `log_name`), `[count, bytes, latency_ms]`, which `deepspeed.comm.comms_totals` reads.

    `timing` is what each collective checks: true while the logger is `enabled`, or while
    someone asked for the per-op totals alone (`count_totals(True)`: an engine with
    `wall_clock_breakdown`, which reports its all-gather and reduce-scatter milliseconds
    per step); then every collective is timed and only `totals` grow, nothing is printed
    and `log_summary` has no records. The requests are counted, so one engine's
    `destroy()` (its `count_totals(False)`) stops the timing only when no other asks.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.totals_only = False  # some count_totals(True) is still unmatched
        self.totals_requests = 0  # count_totals(True) calls less count_totals(False) calls
        self.timing = False  # enabled, totals_only or counting_nodes: the collectives' one check
        self.counting_nodes = False  # deepspeed.comm.node_traffic counts (no timing, no records)
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list = []
        self.debug = False
        self.idle = True  # False while a timed collective runs: the ones inside it are not recorded
        self.comms_dict: dict = {}
        self.totals: dict = {}

    def reset(self) -> None:
        """Upstream's defaults and no records (what `process_state.reset()` runs)."""
        self.__init__()

    def configure(self, section: Any = None, **settings: Any) -> None:
        """Take every setting of `section` (a `CommsLoggerConfig`, deepspeed/comm/config.py, or
        upstream's `DeepSpeedCommsConfig` holding one) when given, then each of `settings`
        (enabled, prof_all, prof_ops, verbose, debug) that is not None."""
        if hasattr(section, "comms_logger_enabled"):  # upstream's argument, `DeepSpeedConfig.comms_config`
            section = section.comms_logger if section.comms_logger_enabled else None
        names = ("enabled", "verbose", "prof_all", "prof_ops", "debug")
        unknown = set(settings) - set(names)
        if unknown:
            raise TypeError(
                f"comms logger settings {sorted(unknown)} do not exist; the settings are {list(names)}"
            )
        for name in names:
            value = settings.get(name)
            if value is None and section is not None:
                value = getattr(section, name)
            if value is not None:
                setattr(self, name, list(value) if name == "prof_ops" else bool(value))
        self._retime()

    def _retime(self) -> None:
        self.timing = self.enabled or self.totals_only or self.counting_nodes

    def count_totals(self, on: bool) -> None:
        """Time every collective for `totals` even while the logger is off (see the class doc):
        `True` adds a request, `False` withdraws one."""
        if not on and self.totals_requests == 0:
            raise ValueError(
                "count_totals(False) without a count_totals(True) still in force; call it once per "
                "count_totals(True) (an engine with wall_clock_breakdown does both: at initialize, at destroy)"
            )
        self.totals_requests += 1 if on else -1
        self.totals_only = self.totals_requests > 0
        self._retime()

    def count_nodes(self, on: bool) -> None:
        """Route every collective through the logger's entry for the node-traffic counter
        ([Note: counting cross-node bytes] in deepspeed/comm/node_traffic.py); alone, this
        times and records nothing."""
        self.counting_nodes = bool(on)
        self._retime()

    # Upstream's switches: all ops, or ops by name, from here on.
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def selects(self, log_name: str, prof: bool) -> bool:
        return prof or self.prof_all or log_name in self.prof_ops

    def timed(
        self,
        fn: Callable,
        args: tuple,
        op: str,
        log_name: str,
        prof: bool,
        msg_size: int,
        world: int,
        async_op: bool = False,
    ) -> Any:
        """Run `fn(*args)` (a collective returning a `CommHandle`, or None) and record it when selected.

        An `async_op` call is recorded when its handle is waited on (`CommHandle.after_wait`):
        the latency then runs from the issue to the end of the wait. `msg_size`: the bytes
        to record ([Note: the communication logger]); `world`: the size of the call's group.
        """
        recording = self.enabled and self.selects(log_name, prof)
        if not (recording or self.totals_only):
            self.idle = False
            try:
                return fn(*args)
            finally:
                self.idle = True
        record_name = f"{log_name} | [Caller Func: {_caller()}]" if self.debug else log_name
        from deepspeed.accelerator import get_accelerator

        synchronize = get_accelerator().synchronize
        synchronize()
        start = time.perf_counter()
        self.idle = False
        try:
            handle = fn(*args)
        finally:
            self.idle = True

        def finish() -> None:
            synchronize()
            latency_ms = (time.perf_counter() - start) * 1000.0
            if recording:
                self.append(op, record_name, latency_ms, msg_size, world)
            else:
                self.add_total(op, latency_ms, msg_size)

        if async_op and handle is not None:
            handle.after_wait(finish)  # now, when it is already complete
        else:
            finish()
        return handle

    def append(self, op: str, record_name: str, latency_ms: float, msg_size: int, world: int) -> None:
        """Record one collective `op` (its record under `record_name`) of `msg_size` bytes."""
        algbw, busbw = calc_bw_log(op, msg_size, latency_ms, world)
        row = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        row[0] += 1
        row[1].append(latency_ms)
        row[2].append(algbw)
        row[3].append(busbw)
        self.add_total(op, latency_ms, msg_size)
        if self.verbose:  # printed on rank 0, as the summary is (the package logger hides INFO by default)
            print_dist(
                f"comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_size)} "
                f"| algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )

    def add_total(self, op: str, latency_ms: float, msg_size: int) -> None:
        total = self.totals.setdefault(op, [0, 0, 0.0])
        total[0] += 1
        total[1] += msg_size
        total[2] += latency_ms

    # ------------------------------------------------------------------ reading the records

    def get_raw_data(self) -> dict:
        return {
            name: {size: [r[0], *map(list, r[1:])] for size, r in rows.items()}
            for name, rows in self.comms_dict.items()
        }

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        """Drop the records `log_summary` reads; `totals` keep counting (marks taken stay valid)."""
        self.comms_dict.clear()

    def get_operation_names(self) -> list:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(row[0] for rows in self.comms_dict.values() for row in rows.values())

    def get_operation_summary(self, operation_name: str) -> Optional[dict]:
        rows = self.comms_dict.get(operation_name)
        return None if rows is None else {size: _summary_row(size, rows[size]) for size in sorted(rows)}

    def summary(self) -> dict:
        """`{record_name: {msg_size: figures}}`, the figures `log_summary` prints."""
        return {name: self.get_operation_summary(name) for name in self.comms_dict}

    def latencies(self) -> list:
        """Every recorded latency, by record name, then message size (the same order on every rank)."""
        rows = self.comms_dict
        return [lat for name in sorted(rows) for size in sorted(rows[name]) for lat in rows[name][size][1]]

    def straggler(self, min_latencies: list) -> dict:
        """`{record_name: {msg_size: figures}}` of the straggler effect, given `min_latencies`:
        `latencies()` with each entry replaced by its minimum over the ranks."""
        result, at = {}, 0
        for name in sorted(self.comms_dict):
            rows = self.comms_dict[name]
            result[name] = {}
            for size in sorted(rows):
                own = rows[size][1]
                mins = min_latencies[at : at + len(own)]
                at += len(own)
                waits = [mine - least for mine, least in zip(own, mins)]
                result[name][size] = {
                    "count": rows[size][0],
                    "total_comm_lat_ms": sum(mins),
                    "total_straggler_ms": sum(waits),
                    "avg_comm_lat_ms": trim_mean(mins),
                    "avg_straggler_ms": trim_mean(waits),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
        return result


def _caller() -> str:
    """The name of the innermost function outside the collectives' facade and this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _FACADE:
        frame = frame.f_back
    return "<unknown>" if frame is None else frame.f_code.co_name


def _summary_row(size: int, row: list) -> dict:
    return {
        "count": row[0],
        "total_latency_ms": sum(row[1]),
        "avg_latency_ms": trim_mean(row[1]),
        "tput_avg_gbps": trim_mean(row[2]),
        "busbw_avg_gbps": trim_mean(row[3]),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


def _line(cells: tuple) -> str:
    return "".join(f"{cell:<{COLUMN}}" for cell in cells).rstrip()


def format_summary(summary: dict) -> str:
    """The table `log_summary` prints: a header, then per record its name and one line per size."""
    lines = [_line(HEADER)]
    for name, rows in summary.items():
        lines.append(name)
        for f in rows.values():
            figures = (f["total_latency_ms"], f["avg_latency_ms"], f["tput_avg_gbps"], f["busbw_avg_gbps"])
            lines.append(_line(("", f["msg_size_str"], f["count"], *(f"{x:.2f}" for x in figures))))
    return "\n".join(lines)


def format_straggler(straggler: dict) -> str:
    lines = ["_" * 31, "Breakdown with straggler effect", "-" * 31, _line(STRAGGLER_HEADER)]
    for name, rows in straggler.items():
        lines.append(name)
        for f in rows.values():
            keys = ("total_comm_lat_ms", "total_straggler_ms", "avg_comm_lat_ms", "avg_straggler_ms")
            lines.append(_line(("", f["msg_size_str"], f["count"], *(f"{f[k]:.2f}" for k in keys))))
    return "\n".join(lines)


def result_dict(summary: dict, straggler: Optional[dict], world: int, rank: int) -> dict:
    """What `log_summary(return_dict=True)` returns (upstream's keys)."""
    return {
        "summary": summary,
        "straggler_analysis": straggler,
        "metadata": {"world_size": world, "rank": rank, "timestamp": datetime.datetime.now().isoformat()},
    }


def totals_since(now: dict, mark: Optional[dict]) -> dict:
    """`now` (a `comms_totals()` answer) less `mark` (an earlier one), op by op."""
    if not mark:
        return now
    result = {}
    for op, figures in now.items():
        before = mark.get(op, {"count": 0, "bytes": 0, "latency_ms": 0.0})
        diff = {key: figures[key] - before[key] for key in figures}
        if diff["count"]:
            result[op] = diff
    return result
