"""Static and dynamic loss scaling: growth, backoff, hysteresis, the floor, detection, state."""

import pytest
import torch

from deepspeed.runtime.fp16.loss_scaler import (
    CreateLossScaler,
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    has_inf_or_nan,
)


def run(scaler, outcomes):
    """Feed a sequence of overflow flags ('x' overflow, '.' clean); return the scales after each."""
    scales = []
    for flag in outcomes:
        scaler.update_scale(flag == "x")
        scales.append(scaler.loss_scale)
    return scales


def test_static_scaler():
    s = LossScaler(scale=128)
    assert s.loss_scale == 128 and not s.dynamic
    s.update_scale(True)
    assert s.loss_scale == 128
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    s.backward((p * 3).sum())
    assert torch.equal(p.grad, torch.full((2,), 3.0 * 128))
    p.grad = torch.tensor([float("inf"), 0.0])
    assert s.has_overflow([p]) is False  # static scaling never skips a step
    assert s.state_dict() == {"cur_scale": 128}
    with pytest.raises(ValueError, match="positive"):
        LossScaler(scale=0)


def test_scale_gradient_hook():
    s = LossScaler(scale=4)
    grads = s.scale_gradient(None, (torch.ones(2), None), ())
    assert torch.equal(grads[0], torch.full((2,), 4.0)) and grads[1] is None


# Scale trajectories of DeepSpeed 0.19.8's DynamicLossScaler (generated with it, in the
# upstream benchmark environment): keyword arguments, overflow flags, the scale after each
# update_scale() and the hysteresis left at the end.
UPSTREAM_TRAJECTORIES = [
    (dict(init_scale=2**16, scale_window=2), "xx.....x....",
     [32768, 16384, 16384, 16384, 32768, 32768, 65536, 32768, 32768, 32768, 65536, 65536], 1),
    (dict(init_scale=16, scale_window=3), "........", [16, 16, 16, 32, 32, 32, 64, 64], 1),
    (dict(init_scale=16, scale_window=3), ".x.......", [16, 8, 8, 8, 8, 16, 16, 16, 32], 1),
    (dict(init_scale=64, scale_window=2, delayed_shift=2), "xx....x.x..x",
     [64, 32, 32, 32, 64, 64, 64, 64, 32, 32, 32, 16], 1),
    (dict(init_scale=64, scale_window=2, delayed_shift=2, consecutive_hysteresis=True), "x.x.xx....x.",
     [64, 64, 64, 64, 64, 32, 32, 32, 64, 64, 64, 64], 2),
    (dict(init_scale=64, scale_window=100, delayed_shift=3), "xxxx", [64, 64, 32, 16], 1),
    (dict(init_scale=4, scale_window=1, min_scale=2, raise_error_at_min_scale=False), "xxx..x.",
     [2, 2, 2, 2, 4, 2, 2], 1),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, flags, scales, hysteresis_left", UPSTREAM_TRAJECTORIES)
def test_dynamic_scale_follows_upstream(kwargs, flags, scales, hysteresis_left):
    s = DynamicLossScaler(**kwargs)
    assert s.dynamic and s.loss_scale == kwargs["init_scale"]
    assert run(s, flags) == scales
    assert s.cur_hysteresis == hysteresis_left
    assert s.cur_iter == len(flags) and s.last_overflow_iter == flags.rfind("x")


def test_positional_arguments_in_upstream_order():
    # DeepSpeed 0.19: (init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, ...)
    s = DynamicLossScaler(64, 3, 2, 4, True)
    assert (s.cur_scale, s.scale_window, s.min_scale, s.delayed_shift) == (64, 3, 2, 4)
    assert s.consecutive_hysteresis and s.scale_factor == 2.0


def test_custom_scale_factor():
    s = DynamicLossScaler(init_scale=81, scale_factor=3.0, scale_window=2)
    assert run(s, "x...") == [27, 27, 27, 81]


def test_min_scale_floor_and_error():
    s = DynamicLossScaler(init_scale=3, min_scale=2, scale_window=100)
    assert run(s, "x") == [2]  # 1.5 is floored to min_scale
    with pytest.raises(LossScaleAtMinimumError, match="minimum") as info:
        s.update_scale(True)
    assert isinstance(info.value, RuntimeError) and "raise_error_at_min_scale" in str(info.value)


def test_min_scale_without_error_stays():
    s = DynamicLossScaler(init_scale=4, min_scale=2, scale_window=100, raise_error_at_min_scale=False)
    assert run(s, "xxx") == [2, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_inf_nan_detection(dtype):
    finite = torch.tensor([1.0, -2.0, 3.0], dtype=dtype)
    assert not has_inf_or_nan(finite) and not DynamicLossScaler._has_inf_or_nan(finite)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = finite.clone()
        t[1] = bad
        assert has_inf_or_nan(t) and DynamicLossScaler._has_inf_or_nan(t)
    assert not has_inf_or_nan(torch.empty(0, dtype=dtype))


def test_opposite_infs_are_detected():
    assert has_inf_or_nan(torch.tensor([float("inf"), float("-inf")]))


def test_has_overflow_serial():
    s = DynamicLossScaler()
    a, c = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    a.grad = torch.ones(2)
    # c has no grad and is skipped.
    assert not s.has_overflow_serial([a, b, c])
    b.grad = torch.tensor([0.0, float("nan")], dtype=torch.float16)
    assert s.has_overflow_serial([a, b, c]) and s.has_overflow([a, b, c])


def test_backward_scales_loss():
    s = DynamicLossScaler(init_scale=2**10)
    p = torch.nn.Parameter(torch.tensor([1.0]))
    s.backward((p * 2).sum())
    assert p.grad.item() == 2.0 * 2**10


def test_state_round_trip():
    pattern = "..x.x....x......"
    a = DynamicLossScaler(init_scale=2**8, scale_window=3, delayed_shift=2)
    run(a, pattern)
    b = DynamicLossScaler(init_scale=2**8, scale_window=3, delayed_shift=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert run(b, pattern) == run(a, pattern)
    with pytest.raises(ValueError, match="last_overflow_iter"):
        b.load_state_dict({"cur_scale": 1.0, "cur_iter": 3})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"scale_factor": 1.0}, "scale_factor"),
        ({"scale_window": 0}, "scale_window"),
        ({"min_scale": 0}, "min_scale"),
        ({"delayed_shift": 0}, "delayed_shift"),
        ({"init_scale": 0.5, "min_scale": 1}, "below min_scale"),
        ({"init_scale": -1}, "positive"),
    ],
)
def test_bad_dynamic_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_create_loss_scaler():
    args = {
        "init_scale": 2**16,
        "scale_window": 500,
        "delayed_shift": 2,
        "consecutive_hysteresis": True,
        "min_scale": 4,
    }
    s = CreateLossScaler(torch.half, static_loss_scale=1, dynamic_scaling=True, dynamic_loss_args=args)
    assert isinstance(s, DynamicLossScaler)
    assert (s.loss_scale, s.scale_window, s.delayed_shift, s.consecutive_hysteresis, s.min_scale) == (
        2**16,
        500,
        2,
        True,
        4,
    )
    s = CreateLossScaler(torch.half, static_loss_scale=1, dynamic_scaling=True, dynamic_loss_args=None)
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 2**32

    s = CreateLossScaler(torch.half, static_loss_scale=256, dynamic_scaling=False, dynamic_loss_args=None)
    assert isinstance(s, LossScaler) and s.loss_scale == 256
    for dtype in (torch.bfloat16, torch.float32):
        s = CreateLossScaler(dtype, static_loss_scale=256, dynamic_scaling=True, dynamic_loss_args=args)
        assert isinstance(s, LossScaler) and s.loss_scale == 1.0

    with pytest.raises(ValueError, match="'scale_windows'") as info:
        CreateLossScaler(torch.half, 1, True, {"scale_windows": 10})
    assert "scale_window" in str(info.value)


def test_a_saved_scale_of_another_kind_leaves_the_configured_scaler():
    """Only a dynamic scaler's running state resumes; a fixed scale (or none) is the config's,
    so a run whose fp16 settings changed since the save trains as it is configured now."""
    dynamic = DynamicLossScaler(init_scale=2**16, scale_window=2)
    for overflow in (True, False, False, False):
        dynamic.update_scale(overflow)
    saved_dynamic = dynamic.state_dict()
    saved_fixed = LossScaler(scale=128).state_dict()
    unscaled = LossScaler().state_dict()  # what an fp32 or bf16 run saves

    resumed = DynamicLossScaler(init_scale=2**16, scale_window=2)
    resumed.load_state_dict(saved_dynamic)
    assert resumed.state_dict() == saved_dynamic and resumed.loss_scale == 2**16
    upstream_fixed = {"cur_scale": 128.0, "dynamic": False}  # upstream's pickled LossScaler
    for saved in (saved_fixed, unscaled, upstream_fixed):
        fresh = DynamicLossScaler(init_scale=2**10)
        fresh.load_state_dict(saved)
        assert fresh.state_dict() == DynamicLossScaler(init_scale=2**10).state_dict()
    for saved in (saved_dynamic, unscaled):
        fixed = LossScaler(scale=128)
        fixed.load_state_dict(saved)
        assert fixed.loss_scale == 128
    no_scaling = LossScaler()
    no_scaling.load_state_dict(saved_dynamic)  # an fp16 checkpoint into an fp32 or bf16 run
    assert no_scaling.loss_scale == 1
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"cur_iter": 3})
    with pytest.raises(ValueError, match="missing"):
        LossScaler().load_state_dict({"cur_iter": 3})
