"""The communication logger (issue 41 item 2): `comms_logger` config, `deepspeed.comm.configure`,
what each collective records, `log_summary` and the totals API ([Note: the communication
logger] in deepspeed/utils/comms_logging.py)."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils import comms_logging
from tests.unit.common import DistributedTest

GATHERS = ("all_gather_into_tensor", "all_gather_into_columns")  # the ZeRO-3 gather's two paths
SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_columns")  # the gradient reducer's two paths


def _zero3_config(**logger):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # every parameter is gathered for its module
            "stage3_prefetch_bucket_size": 0,  # no prefetch: one gather per module and pass
            "reduce_bucket_size": 10**8,  # every gradient in one reduce-scatter
        },
        "comms_logger": {"enabled": True, **logger},
    }


def _sizes_by_op(records: dict, ops: tuple) -> dict:
    """`{msg_size: count}` over the records of `ops` (record names are op names here)."""
    found: dict = {}
    for name in ops:
        for size, row in records.get(name, {}).items():
            found[size] = found.get(size, 0) + row[0]
    return found


def _captured_summary(**kwargs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = dist.log_summary(**kwargs)
    return out.getvalue(), result


def _check_table_matches(table: str, result: dict) -> None:
    """Every figure of the returned dict is in the printed table, as printed (2 decimals)."""
    lines = table.splitlines()
    assert lines[0].split() == [
        "Comm.",
        "Op",
        "Message",
        "Size",
        "Count",
        "Total",
        "Latency(ms)",
        "Avg",
        "Latency(ms)",
        "tput_avg",
        "(Gbps)",
        "busbw_avg",
        "(Gbps)",
    ]
    expected = [lines[0]]
    for name, rows in result["summary"].items():
        expected.append(name)
        for size, f in rows.items():
            assert f["msg_size_bytes"] == size
            cells = [f["msg_size_str"], str(f["count"])]
            cells += [
                f"{f[k]:.2f}"
                for k in ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps")
            ]
            expected.append(" " * 20 + "".join(f"{c:<20}" for c in cells).rstrip())
    assert lines == expected


class TestCommsLogging(DistributedTest):
    world_size = 2

    def test_zero3_step_records_each_gather_and_reduce_scatter_once(self):
        torch.manual_seed(0)
        # Two modules: one with two parameters (a coalesced bucket), one with a single
        # parameter (gathered straight into its full tensor, an async all-gather).
        model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4, bias=False))
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_zero3_config()
        )
        assert dist.comms_logger.enabled  # the engine applied its config
        world, rank = dist.get_world_size(), dist.get_rank()
        dist.reset_log()
        mark = dist.comms_totals()

        x = torch.randn(2, 6, device=engine.device)
        engine.backward(engine(x).sum())
        engine.step()

        # What the schedule implies: each module's parameters are gathered once in forward and
        # once in backward, each rank giving its shard (ceil(numel / world) elements, fp32);
        # all gradients are reduce-scattered in one call whose input is world x the shards.
        shards = [
            sum(math.ceil(p.ds_numel / world) for p in m.parameters(recurse=False))
            for m in model.modules()
            if list(m.parameters(recurse=False))
        ]
        records = dist.comms_logger.get_raw_data()
        gathers = _sizes_by_op(records, GATHERS)
        assert gathers == {4 * shards[0]: 2, 4 * shards[1]: 2} == {140: 2, 80: 2}
        assert _sizes_by_op(records, SCATTERS) == {world * 4 * sum(shards): 1} == {440: 1}
        totals = dist.comms_totals(mark)
        assert sum(totals[op]["count"] for op in GATHERS if op in totals) == 4
        assert sum(totals[op]["bytes"] for op in GATHERS if op in totals) == 2 * (140 + 80)
        assert sum(totals[op]["bytes"] for op in SCATTERS if op in totals) == 440
        for op, figures in totals.items():  # the totals are the records' sums
            rows = records[op].values()
            assert figures["count"] == sum(r[0] for r in rows)
            assert figures["latency_ms"] == pytest.approx(sum(sum(r[1]) for r in rows))

        table, result = _captured_summary(return_dict=True)
        assert result["metadata"]["world_size"] == world and result["metadata"]["rank"] == rank
        summary = result["summary"]
        assert summary["log_summary_barrier"][0]["count"] == 1  # the barrier before the table
        for name in records:
            for size, row in records[name].items():
                assert summary[name][size]["count"] == row[0]
                assert summary[name][size]["total_latency_ms"] == pytest.approx(sum(row[1]))
        if rank == 0:
            _check_table_matches(table, result)
        else:
            assert table == ""

        _, result = _captured_summary(show_straggler=True, return_dict=True)
        for name, rows in result["straggler_analysis"].items():
            for size, f in rows.items():
                own = result["summary"][name][size]["total_latency_ms"]
                assert f["total_straggler_ms"] >= 0 and f["total_comm_lat_ms"] <= own + 1e-9
                assert f["total_comm_lat_ms"] + f["total_straggler_ms"] == pytest.approx(own)

        # Disabled: nothing is recorded, the totals stay.
        dist.configure(enabled=False)
        dist.reset_log()
        before = dist.comms_totals()
        engine.backward(engine(x).sum())
        engine.step()
        assert not dist.has_comm_data() and dist.get_comm_operation_count() == 0
        assert dist.comms_totals() == before and dist.comms_totals(before) == {}

    def test_selection_async_debug_and_verbose(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        device = torch.device(get_accelerator().current_device_name())
        t = torch.ones(3, device=device)
        # prof_all false: only the listed log names, and calls with prof=True.
        dist.configure(enabled=True, prof_all=False, prof_ops=["all_reduce", "my_barrier"])
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.broadcast(t, 0, prof=True)
        dist.barrier(log_name="my_barrier")
        dist.all_gather_into_tensor(torch.empty(3 * world, device=device), t)
        assert dist.get_logged_comm_ops() == ["all_reduce", "broadcast", "my_barrier"]
        records = dist.comms_logger.get_raw_data()
        assert {name: {s: r[0] for s, r in rows.items()} for name, rows in records.items()} == {
            "all_reduce": {12: 1},
            "broadcast": {12: 1},
            "my_barrier": {0: 1},
        }
        assert torch.equal(t.cpu(), torch.full((3,), float(world)))

        # An async collective is recorded when waited on, with its result complete.
        dist.configure(prof_all=True)
        dist.reset_log()
        data = torch.arange(2.0 * world, device=device) + rank
        out = torch.empty(2, device=device)
        handle = dist.reduce_scatter_tensor(out, data, op=dist.ReduceOp.MAX, async_op=True)
        assert dist.get_comm_operation_count() == 0  # issued, not yet waited on
        handle.wait()
        assert dist.get_logged_comm_ops() == ["reduce_scatter_tensor"]
        assert dist.comms_logger.get_raw_data()["reduce_scatter_tensor"][8 * world][0] == 1
        assert torch.equal(out.cpu(), torch.arange(2.0) + 2 * rank + world - 1)

        # A collective built from another (the all-gather into columns off shared memory) is
        # recorded once, under its own name, with one rank's contribution as its size.
        dist.reset_log()
        outputs = [torch.empty(world, 2, device=device), torch.empty(world, 1, device=device)]
        dist.all_gather_into_columns(outputs, [2, 1], torch.full((3,), float(rank), device=device))
        assert dist.get_logged_comm_ops() == ["all_gather_into_columns"]
        assert list(dist.comms_logger.get_raw_data()["all_gather_into_columns"]) == [12]
        assert dist.get_comm_operation_count() == 1
        assert torch.equal(outputs[1].cpu().view(-1), torch.arange(float(world)))

        # debug: the caller's name joins the record name; verbose: one log line per op.
        dist.configure(debug=True, verbose=True)
        dist.reset_log()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            _named_caller(t)
        assert dist.get_logged_comm_ops() == ["all_reduce | [Caller Func: _named_caller]"]
        lines = out.getvalue().splitlines()
        if rank == 0:
            assert len(lines) == 1, lines
            _, latency, algbw, busbw = dist.comms_logger.get_raw_data()[dist.get_logged_comm_ops()[0]][12]
            assert lines[0] == (
                f"comm op: all_reduce | [Caller Func: _named_caller] | time (ms): {latency[0]:.2f} | msg size: "
                f"12.0 B | algbw (Gbps): {algbw[0]:.2f} | busbw (Gbps): {busbw[0]:.2f}"
            )
        else:
            assert lines == []
        # The calls passed to torch.distributed (comm/passthrough.py) are recorded the same way.
        dist.configure(verbose=False)
        dist.reset_log()
        _named_gatherer(t)
        assert dist.get_logged_comm_ops() == ["gather | [Caller Func: _named_gatherer]"]


def _named_caller(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def _named_gatherer(t: torch.Tensor) -> None:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(t, everyone, dst=0)


# ------------------------------------------------------------------------------ single process


def test_bandwidths_follow_nccl_tests():
    # 1 GB in 8 ms is 1 Gbit/ms = 1000 Gbps of algbw for a collective whose whole size is 1 GB.
    size, ms, n = 10**9, 8.0, 4
    assert comms_logging.calc_bw_log("all_reduce", size, ms, n) == pytest.approx((1000, 1000 * 2 * 3 / 4))
    # An all-gather records one rank's input: the collective moves n times that.
    assert comms_logging.calc_bw_log("all_gather_into_tensor", size, ms, n) == pytest.approx((4000, 3000))
    assert comms_logging.calc_bw_log("all_gather_into_columns", size, ms, n) == pytest.approx((4000, 3000))
    # A reduce-scatter records its whole input.
    assert comms_logging.calc_bw_log("reduce_scatter_tensor", size, ms, n) == pytest.approx((1000, 750))
    assert comms_logging.calc_bw_log("broadcast", size, ms, n) == pytest.approx((1000, 1000))
    assert comms_logging.calc_bw_log("barrier", 0, ms, n) == (0.0, 0.0)
    assert [comms_logging.convert_size(b) for b in (0, 12, 2048, 6 * 2**20, 711838106)] == [
        "0B",
        "12.0 B",
        "2.0 KB",
        "6.0 MB",
        "678.86 MB",
    ]
    assert comms_logging.trim_mean([100.0] + [1.0] * 8 + [-50.0]) == 1.0  # a tenth cut from each end


def test_records_totals_and_marks_without_ranks():
    log = comms_logging.CommsLogger()
    log.configure(enabled=True)
    log.append("all_reduce", "all_reduce", 2.0, 400, 2)
    log.append("all_reduce", "grads", 4.0, 400, 2)
    log.append("all_reduce", "all_reduce", 1.0, 8, 2)
    assert log.get_raw_data()["all_reduce"][400][:2] == [1, [2.0]]
    assert log.get_operation_summary("grads")[400]["avg_latency_ms"] == 4.0
    assert log.get_total_operations() == 3
    mark = {"all_reduce": {"count": 1, "bytes": 400, "latency_ms": 2.0}}
    now = {"all_reduce": {"count": 3, "bytes": 808, "latency_ms": 7.0}}
    assert comms_logging.totals_since(now, mark) == {
        "all_reduce": {"count": 2, "bytes": 408, "latency_ms": 5.0}
    }
    log.reset_data()
    assert not log.has_data() and log.totals["all_reduce"] == [3, 808, 7.0]  # totals keep counting
    with pytest.raises(TypeError, match="prof_opps"):
        log.configure(prof_opps=["all_reduce"])
    upstream_style = DeepSpeedConfig(
        {"train_batch_size": 1, "comms_logger": {"prof_all": False}}
    ).comms_config
    log.configure(upstream_style)  # upstream passes `DeepSpeedConfig.comms_config`
    assert (log.enabled, log.prof_all) == (False, False)
    log.reset()
    assert (log.enabled, log.prof_all, log.prof_ops, log.totals) == (False, True, [], {})


def test_totals_timing_is_requested_and_withdrawn():
    """Two engines with wall_clock_breakdown each ask for the totals; one's destroy() must not
    stop the other's, and the last withdrawal stops the timing every collective pays."""
    log = comms_logging.CommsLogger()
    log.count_totals(True)
    log.count_totals(True)
    log.count_totals(False)
    assert log.timing and log.totals_only
    log.count_totals(False)
    assert not log.timing and not log.totals_only
    with pytest.raises(ValueError, match=r"count_totals\(False\) without a count_totals\(True\)"):
        log.count_totals(False)
