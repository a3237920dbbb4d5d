"""LR schedules against their formulas, written out here independently of the implementation."""

import math

import pytest
import torch

from deepspeed.runtime.lr_schedules import (
    LR_RANGE_TEST,
    ONE_CYCLE,
    VALID_LR_SCHEDULES,
    WARMUP_COSINE_LR,
    WARMUP_DECAY_LR,
    WARMUP_LR,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def make_optimizer(kind="adam", lrs=(0.5,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lrs[0])
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_at(scheduler, iteration):
    """The lr the optimizer holds once the schedule reaches `iteration` by plain step() calls."""
    while scheduler.last_batch_iteration < iteration:
        scheduler.step()
    return scheduler.optimizer.param_groups[0]["lr"]


def test_constants():
    assert WARMUP_LR == "WarmupLR" and WARMUP_DECAY_LR == "WarmupDecayLR"
    assert WARMUP_COSINE_LR == "WarmupCosineLR" and ONE_CYCLE == "OneCycle"
    assert LR_RANGE_TEST == "LRRangeTest"
    assert sorted(VALID_LR_SCHEDULES) == sorted(
        [WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR, ONE_CYCLE, LR_RANGE_TEST]
    )


# --------------------------------------------------------------------------- WarmupLR


def test_warmup_linear():
    opt = make_optimizer()
    s = WarmupLR(opt, warmup_min_lr=0.1, warmup_max_lr=0.3, warmup_num_steps=10, warmup_type="linear")
    # Construction already writes the iteration -1 lr: the minimum, not the optimizer's 0.5.
    assert s.last_batch_iteration == -1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert s.get_last_lr() == pytest.approx([0.1])
    assert lr_at(s, 0) == pytest.approx(0.1)
    assert lr_at(s, 3) == pytest.approx(0.1 + 0.2 * 3 / 10)
    assert lr_at(s, 5) == pytest.approx(0.2)  # the midpoint
    assert lr_at(s, 10) == pytest.approx(0.3)
    assert lr_at(s, 1000) == pytest.approx(0.3)  # holds after warmup
    assert s.get_last_lr() == pytest.approx([0.3])


def test_warmup_log():
    opt = make_optimizer()
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=100)
    assert s.warmup_type == "log"
    for it in (0, 1, 9, 50, 99):
        assert lr_at(s, it) == pytest.approx(math.log(it + 1) / math.log(100))
    assert lr_at(s, 99) == pytest.approx(1.0)
    assert lr_at(s, 150) == pytest.approx(1.0)


def test_warmup_num_steps_clamped_to_two():
    s = WarmupLR(
        make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0, warmup_type="linear"
    )
    assert s.warmup_num_steps == 2
    assert lr_at(s, 1) == pytest.approx(0.5)
    assert lr_at(s, 2) == pytest.approx(1.0)


def test_warmup_per_group_values():
    opt = make_optimizer(lrs=(0.5, 0.5))
    s = WarmupLR(
        opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=4, warmup_type="linear"
    )
    s.step()
    s.step()  # iteration 1
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.25, 0.2])
    with pytest.raises(ValueError, match="2 param groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


# --------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay():
    opt = make_optimizer()
    total, warm = 110, 10
    s = WarmupDecayLR(
        opt, total, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=warm, warmup_type="linear"
    )
    assert lr_at(s, 5) == pytest.approx(0.5)
    assert lr_at(s, warm) == pytest.approx(1.0)
    assert lr_at(s, 60) == pytest.approx((total - 60) / (total - warm))  # halfway down
    assert lr_at(s, total) == pytest.approx(0.0)
    assert lr_at(s, total + 50) == pytest.approx(0.0)


def test_warmup_decay_ends_at_min_lr():
    s = WarmupDecayLR(make_optimizer(), 20, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)
    assert lr_at(s, 20) == pytest.approx(0.01)


def test_short_total_warns_and_trains(capfd, caplog):
    """HF Trainer writes total_num_steps < warmup_num_steps whenever warmup_steps exceeds the
    run; upstream warns and trains, and the schedules stay defined: warmup all the way, then
    the floor."""
    decay = WarmupDecayLR(
        make_optimizer(), 5, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear"
    )
    assert [lr_at(decay, it) for it in (4, 9, 10, 12)] == pytest.approx([0.4, 0.9, 0.0, 0.0])
    cosine = WarmupCosineLR(
        make_optimizer(lrs=(1.0,)), 5, warmup_num_steps=10, cos_min_ratio=0.1, warmup_type="linear"
    )
    assert [lr_at(cosine, it) for it in (4, 10, 12)] == pytest.approx([0.4, 0.1, 0.1])
    logged = capfd.readouterr().out + caplog.text  # the logger's stream handler, or pytest's capture
    assert logged.count("total_num_steps=5 is less than warmup_num_steps=10") == 2, logged


# --------------------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine():
    opt = make_optimizer(lrs=(0.2, 0.04))
    total, warm, floor, start = 50, 10, 0.1, 0.2
    s = WarmupCosineLR(
        opt, total, warmup_min_ratio=start, warmup_num_steps=warm, cos_min_ratio=floor, warmup_type="linear"
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # iteration -1
    assert lr_at(s, 0) == pytest.approx(0.2 * start)
    assert lr_at(s, 5) == pytest.approx(0.2 * (start + (1 - start) * 5 / warm))
    for it in (warm, 20, 30, total - 1):
        k = it - warm + 1
        ratio = floor + (1 - floor) * (1 + math.cos(math.pi * k / (total - warm))) / 2
        lr_at(s, it)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2 * ratio, 0.04 * ratio])
    # The endpoint is cos_min_ratio of each base lr, and it holds afterwards.
    assert s.get_last_lr() == pytest.approx([0.2 * floor, 0.04 * floor])
    assert lr_at(s, total + 30) == pytest.approx(0.2 * floor)


def test_warmup_cosine_log_warmup():
    s = WarmupCosineLR(make_optimizer(lrs=(1.0,)), 100, warmup_num_steps=20)
    assert lr_at(s, 7) == pytest.approx(math.log(8) / math.log(20))


def test_warmup_cosine_bad_ratio():
    with pytest.raises(ValueError, match="cos_min_ratio"):
        WarmupCosineLR(make_optimizer(), 100, warmup_num_steps=10, cos_min_ratio=1.5)


# --------------------------------------------------------------------------- OneCycle


def test_one_cycle_lr_and_momentum():
    opt = make_optimizer("adam")
    lo, hi, first, second = 0.01, 0.1, 10, 20
    s = OneCycle(opt, lo, hi, cycle_first_step_size=first, cycle_second_step_size=second)
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.8, 0.99))
    # Rising: after n step() calls the lr is n / first of the way up; the peak is the first-th.
    for n in (1, 5, first):
        lr_at(s, n - 1)
        frac = n / first
        assert opt.param_groups[0]["lr"] == pytest.approx(lo + (hi - lo) * frac)
        assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 - (0.9 - 0.8) * frac)
    assert opt.param_groups[0]["lr"] == pytest.approx(hi)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.8)  # momentum moves inversely
    # Falling over `second` steps back to the minimum.
    n = first + 5
    lr_at(s, n - 1)
    assert opt.param_groups[0]["lr"] == pytest.approx(hi - (hi - lo) * 5 / second)
    lr_at(s, first + second - 1)
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_one_cycle_decay():
    opt = make_optimizer("adam")
    s = OneCycle(
        opt, 0.01, 0.1, decay_lr_rate=0.5, cycle_first_step_size=4, decay_step_size=2, decay_mom_rate=0.01
    )
    # The cycle is 8 iterations (0..7); the decay counts from iteration 8 as d = 1.
    for it in (8, 9, 13):
        d = it - 8 + 1
        lr_at(s, it)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / (1 + 0.5 * d / 2))
        assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 * (1 + 0.01 * d / 2))


def test_one_cycle_no_decay_holds_minimum():
    s = OneCycle(make_optimizer("adam"), 0.01, 0.1, cycle_first_step_size=4)
    assert lr_at(s, 100) == pytest.approx(0.01)


def test_one_cycle_stairs():
    opt = make_optimizer("adam")
    s = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=8, cycle_first_stair_count=2, cycle_momentum=False)
    # Two stairs in each 8-step half: flat at 0 then 0.5 on the way up, peak at 1.
    ups = [lr_at(s, n - 1) for n in range(1, 9)]
    assert ups == pytest.approx([0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1.0])
    downs = [lr_at(s, n - 1) for n in range(9, 17)]
    assert downs == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0])


def test_one_cycle_without_betas_disables_momentum():
    opt = make_optimizer("sgd")
    s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4)
    assert not s.cycle_momentum and s.get_mom() is None
    s.step()
    assert "betas" not in opt.param_groups[0]


def test_one_cycle_bad_values():
    with pytest.raises(ValueError, match="cycle_min_lr=0.2 is greater than cycle_max_lr=0.1"):
        OneCycle(make_optimizer(), 0.2, 0.1)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(make_optimizer(), 0.01, 0.1, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_min_mom"):
        OneCycle(make_optimizer(), 0.01, 0.1, cycle_min_mom=0.95, cycle_max_mom=0.9)


# --------------------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous():
    opt = make_optimizer()
    s = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for it in (0, 4, 19):
        assert lr_at(s, it) == pytest.approx(0.01 * (1 + 2.0 * (it + 1) / 10))


def test_lr_range_test_staircase():
    s = LRRangeTest(make_optimizer(), 0.01, 10, 1.0, lr_range_test_staircase=True)
    assert lr_at(s, 8) == pytest.approx(0.01)  # 9 / 10 floors to 0
    assert lr_at(s, 9) == pytest.approx(0.02)
    assert lr_at(s, 25) == pytest.approx(0.03)


# --------------------------------------------------------------------------- common behaviour

SCHEDULE_CASES = [
    (WARMUP_LR, {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
    (WARMUP_DECAY_LR, {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
    (WARMUP_COSINE_LR, {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    (
        ONE_CYCLE,
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "decay_step_size": 2},
    ),
    (LR_RANGE_TEST, {"lr_range_test_step_size": 3}),
]


@pytest.mark.parametrize("name,params", SCHEDULE_CASES, ids=[c[0] for c in SCHEDULE_CASES])
def test_state_dict_resumes_identically(name, params):
    opt_a = make_optimizer("adam")
    a = build_lr_scheduler(name, opt_a, params)
    for _ in range(6):
        a.step()
    state = a.state_dict()
    assert state == {"last_batch_iteration": 5}

    # A resumed run builds a fresh optimizer and schedule, then loads the state.
    opt_b = make_optimizer("adam")
    b = build_lr_scheduler(name, opt_b, params)
    b.load_state_dict(state)
    assert b.last_batch_iteration == 5
    assert b.get_last_lr() == pytest.approx(a.get_last_lr())
    for _ in range(20):
        a.step()
        b.step()
        assert b.get_last_lr() == pytest.approx(a.get_last_lr())
        assert opt_b.param_groups[0]["lr"] == pytest.approx(opt_a.param_groups[0]["lr"])
        assert opt_b.param_groups[0]["betas"] == pytest.approx(opt_a.param_groups[0]["betas"])


def test_explicit_iteration_and_upstream_alias():
    s = WarmupLR(make_optimizer(), 0.0, 1.0, warmup_num_steps=10, warmup_type="linear")
    s.step(4)
    assert s.get_last_lr() == pytest.approx([0.4])
    s.step(last_batch_iteration=6)
    assert s.get_last_lr() == pytest.approx([0.6])
    s.step(batch_iteration=2)  # OneCycle / LRRangeTest spelling
    assert s.get_last_lr() == pytest.approx([0.2])
    with pytest.raises(TypeError, match="pass one"):
        s.step(3, batch_iteration=4)


def test_resume_constructor_leaves_optimizer_alone():
    opt = make_optimizer(lrs=(0.5,))
    s = WarmupLR(opt, 0.0, 1.0, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=3)
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="call step"):
        s.get_last_lr()
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)


def test_duck_typed_optimizer_and_wrapper():
    class Groups:
        def __init__(self):
            self.param_groups = [{"lr": 1.0}, {"lr": 1.0}]

    duck = Groups()
    WarmupLR(duck, warmup_min_lr=0.25, warmup_max_lr=0.25).step()
    assert [g["lr"] for g in duck.param_groups] == [0.25, 0.25]

    class Wrapper:  # DeepSpeed's fp16 / ZeRO optimizers hold the torch one in `.optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    inner = make_optimizer()
    s = WarmupLR(Wrapper(inner), warmup_min_lr=0.125, warmup_max_lr=1.0)
    assert s.optimizer is inner and inner.param_groups[0]["lr"] == 0.125

    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


def test_tensor_lr_is_updated_in_place():
    opt = make_optimizer()
    lr = torch.tensor(0.5)
    opt.param_groups[0]["lr"] = lr
    WarmupLR(opt, warmup_min_lr=0.25, warmup_max_lr=1.0)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.25


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"warmup_num_steps": -1}, "warmup_num_steps must be >= 0, got -1"),
        ({"warmup_num_steps": 2.5}, "whole number"),
        ({"warmup_min_lr": 0.2, "warmup_max_lr": 0.1}, "warmup_min_lr=0.2 is greater than warmup_max_lr=0.1"),
        ({"warmup_min_lr": -0.1}, "warmup_min_lr must be >= 0"),
        ({"warmup_type": "cubic"}, "'cubic' is not one of"),
        ({"warmup_max_lr": "auto"}, "'auto'"),
        ({"last_batch_iteration": -2}, "last_batch_iteration"),
    ],
)
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupLR(make_optimizer(), **kwargs)


def test_build_lr_scheduler():
    s = build_lr_scheduler(
        "WarmupDecayLR", make_optimizer(), {"total_num_steps": 100, "warmup_num_steps": 10}
    )
    assert isinstance(s, WarmupDecayLR) and s.total_num_steps == 100
    assert isinstance(build_lr_scheduler("WarmupLR", make_optimizer(), {}), WarmupLR)
    assert isinstance(build_lr_scheduler("WarmupLR", make_optimizer(), None), WarmupLR)


def test_build_lr_scheduler_errors():
    with pytest.raises(ValueError, match="'CosineLR'") as info:
        build_lr_scheduler("CosineLR", make_optimizer(), {})
    assert all(name in str(info.value) for name in VALID_LR_SCHEDULES)

    with pytest.raises(ValueError, match="'warmup_steps'") as info:
        build_lr_scheduler("WarmupLR", make_optimizer(), {"warmup_steps": 10})
    assert "warmup_num_steps" in str(info.value)  # the allowed keys are listed

    with pytest.raises(ValueError, match="total_num_steps"):
        build_lr_scheduler("WarmupCosineLR", make_optimizer(), {"warmup_num_steps": 10})


# --------------------------------------------------------------------------- command-line arguments


def test_tuning_arguments_build_the_schedule_a_script_names(monkeypatch):
    """bing_bert-style scripts: the flags `add_tuning_arguments` adds become a "scheduler"
    block that `build_lr_scheduler` takes; each schedule copies only its own flags."""
    import argparse

    from deepspeed.runtime import lr_schedules as ls

    parser = ls.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--lr_schedule",
            "WarmupLR",
            "--warmup_max_lr",
            "0.02",
            "--warmup_num_steps",
            "4",
            "--cycle_max_lr",
            "9",
        ]
    )
    config, error = ls.get_config_from_args(args)
    assert error is None
    assert config == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 4, "warmup_type": "log"},
    }
    assert ls.get_lr_from_config(config) == (0.02, "")
    scheduler = build_lr_scheduler(config["type"], make_optimizer(), config["params"])
    assert lr_at(scheduler, 3) == pytest.approx(0.02) and lr_at(scheduler, 10) == pytest.approx(0.02)

    args = parser.parse_args(["--lr_schedule", "LRRangeTest", "--lr_range_test_staircase"])
    config, _ = ls.get_config_from_args(args)
    assert config["params"]["lr_range_test_staircase"] is True and ls.get_lr_from_config(config) == (
        0.001,
        "",
    )
    args = parser.parse_args(["--lr_schedule", "WarmupCosineLR", "--cos_min_ratio", "0.5"])
    config, _ = ls.get_config_from_args(args)
    assert set(config["params"]) == {"warmup_num_steps", "warmup_type", "warmup_min_ratio", "cos_min_ratio"}
    assert ls.get_lr_from_config(config)[0] is None and "ratio" in ls.get_lr_from_config(config)[1]

    assert ls.get_config_from_args(parser.parse_args([])) == (
        None,
        "--lr_schedule not specified on command line",
    )
    config, error = ls.get_config_from_args(parser.parse_args(["--lr_schedule", "Cosine"]))
    assert config is None and "Cosine is not supported LR schedule" in error
    assert ls.get_lr_from_config({"params": {}})[0] is None

    params: dict = {}
    ls.override_params(parser.parse_args(["--cycle_min_lr", "0.3"]), params)  # every schedule's flags
    assert params["cycle_min_lr"] == 0.3 and params["warmup_max_lr"] == 0.001 and "lr_schedule" not in params

    monkeypatch.setattr("sys.argv", ["train.py", "--lr_schedule", "OneCycle", "--epochs", "3"])
    known, unknown = ls.parse_arguments()
    assert known.lr_schedule == "OneCycle" and unknown == ["--epochs", "3"]
