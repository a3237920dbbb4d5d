"""`wall_clock_breakdown` and `deepspeed.utils.timer`: named timers around forward, backward and step."""

import contextlib
import io
import re
import time

import pytest

import deepspeed.comm as dist
from deepspeed.utils import timer as ds_timer
from deepspeed.utils.timer import SynchronizedWallClockTimer
from tests.unit.common import DistributedTest
from tests.unit.test_engine import batches, engine_run

MICRO = ["fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep"]
GLOBAL = ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"]


def test_timer_accumulates_resets_and_refuses_misuse(capsys):
    timers = SynchronizedWallClockTimer()
    t = timers("work")
    assert timers("work") is t and timers.get_timers() == {"work": t}
    for _ in range(2):
        t.start()
        time.sleep(0.01)
        t.stop(record=True)
    assert 18.0 <= t.elapsed(reset=False) < 1000.0
    assert 9.0 / 1000 <= t.mean() < 0.5
    with pytest.raises(RuntimeError, match="'work' was stopped without being started"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="'work' was started twice"):
        t.start()
    assert t.elapsed(reset=True) >= 18.0  # a running timer counts up to now, then carries on
    assert t.started and t.elapsed(reset=False) < 18.0
    t.stop()
    timers.log(["work", "absent"], normalizer=2.0)
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"time \(ms\) \| work: \d+\.\d\d", line), line
    assert t.elapsed() == 0.0  # log reset it
    with pytest.raises(ValueError, match="normalizer=0"):
        timers.log(["work"], normalizer=0)
    timers.log(["work"], memory_breakdown=True)
    line = capsys.readouterr().out.strip()
    names = ["mem_allocated", "max_mem_allocated", "cache_allocated", "max_cache_allocated"]
    assert re.fullmatch(
        r"time \(ms\) \| work: \d+\.\d\d" + "".join(rf" \| {n}: \d+\.\d{{4}} GB" for n in names), line
    )


class TestWallClockBreakdown(DistributedTest):
    world_size = [1, 2]

    def test_engine_logs_each_region_without_changing_training(self):
        """With the switch on, every step() prints the micro-step timers on rank 0 (and the
        step's at each boundary); the losses are those of a run without it."""
        data = batches(2, seed=44)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            engine, losses = engine_run(data, gas=2, wall_clock_breakdown=True)
        _, plain = engine_run(data, gas=2)
        assert losses == plain
        lines = [line for line in out.getvalue().splitlines() if line.startswith("time (ms)")]
        if dist.get_rank() != 0:
            assert lines == []
        else:
            micro = [line for line in lines if "fwd_microstep" in line]
            whole = [line for line in lines if "| fwd:" in line]
            assert len(micro) == 4 and len(whole) == 2, lines  # 2 steps x 2 micro-steps; 2 boundaries
            assert all(all(f"{name}: " in line for name in MICRO) for line in micro), micro
            assert all(all(f"| {name}: " in line for name in GLOBAL) for line in whole), whole
        readings = engine.get_wall_clock_timers()
        assert set(readings) == set(MICRO + GLOBAL)
        assert all(value >= 0.0 for value in readings.values())
        # The step's timers hold both micro-steps: at least the last micro-step's share.
        assert readings["fwd"] >= readings["fwd_microstep"] > 0.0
        assert readings["bwd"] >= readings["bwd_inner"]
        assert engine.wall_clock_breakdown()
        off, _ = engine_run(data[:1])
        assert off.get_wall_clock_timers() == {} and off.timers.get_timers() == {}

    def test_memory_breakdown_reports_around_each_call(self):
        """`memory_breakdown: true`: rank 0 prints the memory before and after forward,
        backward and step (see_memory_usage's lines), in that order."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            engine_run(batches(1, seed=45), memory_breakdown=True)
        where = [line for line in out.getvalue().splitlines() if line.startswith("Engine ")]
        calls = ["forward", "backward", "step"]
        expected = [f"Engine {edge} {call}" for call in calls for edge in ("before", "after")]
        assert where == (expected if dist.get_rank() == 0 else []), where
        if dist.get_rank() == 0:
            assert out.getvalue().count("CPU Virtual Memory:") == len(expected)


def test_timer_names_are_upstreams():
    assert (
        ds_timer.FORWARD_GLOBAL_TIMER,
        ds_timer.BACKWARD_REDUCE_MICRO_TIMER,
        ds_timer.STEP_GLOBAL_TIMER,
    ) == (
        "fwd",
        "bwd_allreduce_microstep",
        "step",
    )
