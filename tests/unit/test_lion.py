"""`FusedLion` and `DeepSpeedCPULion` against Lion's update written out in float64."""

import copy

import pytest
import torch

from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

HYPER = [{}, {"weight_decay": 0.1}, {"betas": (0.8, 0.95), "weight_decay": 0.3, "lr": 0.02}]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (7, 130, 1)]


def _grads(steps, shapes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(steps)]


def _reference(params, grads, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
    """Lion in float64, one formula per line of the paper."""
    beta1, beta2 = betas
    values = [p.detach().double().clone() for p in params]
    momenta = [torch.zeros_like(v) for v in values]
    for step in grads:
        for value, momentum, grad in zip(values, momenta, step):
            grad = grad.double()
            direction = torch.sign(beta1 * momentum + (1 - beta1) * grad)
            value.mul_(1 - lr * weight_decay).sub_(lr * direction)
            momentum.copy_(beta2 * momentum + (1 - beta2) * grad)
    return values


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
@pytest.mark.parametrize("hyper", HYPER, ids=lambda h: ",".join(h) or "defaults")
def test_matches_the_update_in_float64(cls, hyper):
    params = _params()
    grads = _grads(4, [p.shape for p in params])
    optimizer = cls(params, **hyper)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()
    for got, want in zip(params, _reference(_params(), grads, **hyper)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert all(optimizer.state[p]["step"] == 4 for p in params)


def test_a_zero_direction_does_not_move_the_parameter():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = FusedLion([param], lr=0.1)
    param.grad = torch.tensor([0.0, 1.0])
    optimizer.step()
    assert param.tolist() == [1.0, pytest.approx(1.9)]


def test_low_precision_params_keep_fp32_momentum():
    params = _params(torch.bfloat16)
    grads = _grads(3, [p.shape for p in params])
    optimizer = DeepSpeedCPULion(params, lr=0.01, weight_decay=0.1)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.to(torch.bfloat16)
        optimizer.step()
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float32 for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)


def test_state_dict_round_trip():
    params = _params()
    optimizer = FusedLion(params, lr=0.01, weight_decay=0.1)
    grads = _grads(5, [p.shape for p in params])
    for step in grads[:3]:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()
    resumed = [p.detach().clone().requires_grad_() for p in params]
    again = FusedLion(resumed, lr=0.01, weight_decay=0.1)
    again.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for step in grads[3:]:
        for a, b, g in zip(params, resumed, step):
            a.grad, b.grad = g.clone(), g.clone()
        optimizer.step()
        again.step()
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def test_zero_grad_follows_set_grad_none():
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    FusedLion([param], set_grad_none=False).zero_grad()
    assert param.grad is not None and param.grad.eq(0).all()
    FusedLion([param]).zero_grad()
    assert param.grad is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (1.0, 0.9)}, "betas"),
    ],
)
def test_refusals_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedCPULion(_params(), **kwargs)


def test_cpu_lion_refuses_accelerator_parameters_with_the_fix():
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))
    param.grad = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="offload_optimizer"):
        DeepSpeedCPULion([param]).step()


def test_config_builds_fused_lion_or_cpu_lion_under_offload():
    from deepspeed.runtime.zero.stage3 import build_config_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    for name, offload, cls in (
        ("Lion", False, FusedLion),
        ("Lion", True, DeepSpeedCPULion),
        ("FusedLion", False, FusedLion),
        ("CPULion", False, DeepSpeedCPULion),
    ):
        opt = build_config_optimizer(name, {"lr": 0.05, "weight_decay": 0.2}, groups, offload=offload)
        assert type(opt) is cls and opt.defaults["weight_decay"] == 0.2, name
