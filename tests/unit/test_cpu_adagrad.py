"""`DeepSpeedCPUAdagrad` against torch.optim.Adagrad (see the class's module note)."""

import copy

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

HYPER = [
    {},
    {"weight_decay": 0.1},
    {"lr_decay": 0.05, "initial_accumulator_value": 0.2},
    {"maximize": True, "eps": 1e-6, "weight_decay": 0.01},
]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (7, 130, 1)]


def _train(optimizer, params, steps=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize("hyper", HYPER, ids=lambda h: ",".join(h) or "defaults")
def test_matches_torch_adagrad(hyper):
    ours, ref = _params(), _params()
    _train(DeepSpeedCPUAdagrad(ours, lr=0.05, **hyper), ours)
    _train(torch.optim.Adagrad(ref, lr=0.05, foreach=False, **hyper), ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_adagrad_groups_as_accelerate_passes_them():
    """accelerate builds it from a torch Adagrad's param groups, plus lr, weight_decay and adamw_mode=False."""
    ours, ref = _params(), _params()
    torch_opt = torch.optim.Adagrad(
        ours, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.3, weight_decay=0.01
    )
    swapped = DeepSpeedCPUAdagrad(torch_opt.param_groups, lr=0.05, weight_decay=0.01, adamw_mode=False)
    _train(swapped, ours)
    _train(
        torch.optim.Adagrad(ref, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.3, weight_decay=0.01), ref
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_low_precision_params_step_in_fp32():
    ours, ref = (
        _params(torch.bfloat16),
        [p.detach().float().requires_grad_() for p in _params(torch.bfloat16)],
    )
    optimizer = DeepSpeedCPUAdagrad(ours, lr=0.05)
    reference = torch.optim.Adagrad(ref, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=gen).to(torch.bfloat16)
            a.grad, b.grad = grad, grad.float()
        optimizer.step()
        reference.step()
        for b in ref:
            b.data.copy_(b.data.to(torch.bfloat16).float())  # the parameter is stored in bf16
    assert all(optimizer.state[p]["exp_avg_sq"].dtype == torch.float32 for p in ours)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b, rtol=0, atol=0)


def test_state_dict_round_trip_and_from_torch_adagrad():
    # Each state dict is deep-copied, as torch.save/load would: torch's own load keeps the
    # given tensors, which would otherwise be shared with the live optimizer that saved them.
    params = _params()
    torch_opt = torch.optim.Adagrad(params, lr=0.05, weight_decay=0.1)
    _train(torch_opt, params, steps=3)
    resumed = [p.detach().clone().requires_grad_() for p in params]
    ours = DeepSpeedCPUAdagrad(resumed, lr=0.05, weight_decay=0.1)
    saved = copy.deepcopy(torch_opt.state_dict())
    ours.load_state_dict(saved)  # torch's `sum` becomes `exp_avg_sq`
    assert "sum" in saved["state"][0] and "exp_avg_sq" not in saved["state"][0]  # the caller's dict is kept
    _train(torch_opt, params, steps=2, seed=2)
    _train(ours, resumed, steps=2, seed=2)
    for a, b in zip(resumed, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    again = [p.detach().clone().requires_grad_() for p in resumed]
    reloaded = DeepSpeedCPUAdagrad(again, lr=0.05, weight_decay=0.1)
    reloaded.load_state_dict(copy.deepcopy(ours.state_dict()))
    _train(ours, resumed, steps=1, seed=3)
    _train(reloaded, again, steps=1, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(resumed, again))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"adamw_mode": True}, "adamw_mode=True"),
        ({"amsgrad": True}, "amsgrad"),
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"lr_decay": -0.1}, "lr_decay must be >= 0"),
    ],
)
def test_refusals_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedCPUAdagrad(_params(), **kwargs)


def test_accelerator_parameter_names_the_fix():
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))
    param.grad = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="offload_optimizer"):
        DeepSpeedCPUAdagrad([param]).step()


@pytest.mark.parametrize("hyper", [{}, {"lr_decay": 0.1, "initial_accumulator_value": 0.5, "maximize": True}])
def test_sparse_embedding_gradients_match_torch_adagrad(hyper):
    """An `nn.Embedding(sparse=True)` steps only the rows its gradient holds, bit for bit as torch's."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Embedding(50, 8, sparse=True), torch.nn.Embedding(50, 8, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    opts = [
        DeepSpeedCPUAdagrad(ours.parameters(), lr=0.1, **hyper),
        torch.optim.Adagrad(theirs.parameters(), lr=0.1, **hyper),
    ]
    untouched = ours.weight.detach().clone()
    for _ in range(4):
        rows = torch.randint(0, 25, (12,))  # rows 25.. never appear: they must not move
        for emb, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            emb(rows).pow(2).sum().backward()
            opt.step()
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(ours.weight[25:], untouched[25:])


def test_sparse_gradient_with_weight_decay_names_the_fix():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = DeepSpeedCPUAdagrad(emb.parameters(), weight_decay=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"weight_decay=0.1 .*sparse=False"):
        opt.step()
