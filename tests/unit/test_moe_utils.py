"""`deepspeed.moe.utils`: which parameters are experts', and the optimizer groups built from them."""

import pytest
import torch
from torch import nn

from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = MoE(4, nn.Linear(4, 4), num_experts=3, k=1)
        self.head = nn.Linear(4, 1, bias=False)


def test_expert_parameters_are_marked_and_found():
    net = Net()
    experts = [p for p in net.moe.deepspeed_moe.experts.parameters()]
    assert all(is_moe_param(p) for p in experts) and len(experts) == 6
    assert not is_moe_param(net.inp.weight) and not is_moe_param(net.moe.deepspeed_moe.gate.wg.weight)
    assert has_moe_layers(net) == (True, 3) and has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    shared, expert = split_params_into_shared_and_expert_params(list(net.parameters()))
    assert expert == experts and len(shared) + len(expert) == len(list(net.parameters()))
    net.inp.weight.grad = torch.ones_like(net.inp.weight)
    experts[0].grad = torch.ones_like(experts[0])
    grads = split_params_grads_into_shared_and_expert_params(list(net.parameters()))
    assert [g.shape for g in grads[0]] == [net.inp.weight.shape] and grads[1][0] is experts[0].grad


def test_groups_split_keep_their_settings_and_cap_sizes():
    net = Net()
    decay = {"params": [p for p in net.parameters() if p.dim() == 2], "name": "decay", "weight_decay": 0.1}
    plain = {"params": [p for p in net.parameters() if p.dim() == 1], "name": "plain", "weight_decay": 0.0}
    groups = split_params_into_different_moe_groups_for_optimizer((decay, plain))
    assert [(g["name"], g.get("moe", False), g["weight_decay"]) for g in groups] == [
        ("decay", False, 0.1),
        ("plain", False, 0.0),
        ("ep_size_1", True, 0.1),
        ("ep_size_1", True, 0.0),
    ]
    assert not any(is_moe_param(p) for g in groups[:2] for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(net.parameters()))
    assert is_moe_param_group(groups[2]) and not is_moe_param_group(groups[0])
    capped = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters())}, 20)
    assert [len(g["params"]) for g in capped if g.get("moe")] == [2, 2, 2]  # 16 weights + 4 biases per expert
    assert len(configure_moe_param_groups(net.parameters())) == 2
    torch.optim.AdamW(groups)  # torch takes the extra keys
    with pytest.raises(ValueError, match="must be a dict"):
        split_params_into_different_moe_groups_for_optimizer("params")


def test_upstream_facts_of_the_moe_api():
    """What code written for upstream's MoE sees (a new-user trial against upstream 0.19.8):
    int64 exp_counts, upstream's keywords, the first layer's expert count, Megatron-style
    experts returning (output, bias), the residual mlp being the module given, and
    drop_tokens=False sizing the buffers by the largest load only."""
    from deepspeed.moe.sharded_moe import top1gating, top2gating

    torch.manual_seed(0)
    logits = torch.randn(16, 4)
    for gating, kwargs in (
        (top1gating, {"use_rts": False}),
        (top2gating, {"top2_2nd_expert_sampling": False}),
    ):
        l_aux, combine, dispatch, counts = gating(logits, 2.0, 0, drop_tokens=False, ep_group=None, **kwargs)
        assert counts.dtype == torch.int64 and combine.shape[2] == int(counts.max())
        assert dispatch.sum() == counts.sum()  # nothing dropped

    class Stacked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = MoE(4, nn.Linear(4, 4), num_experts=2, k=1)
            self.b = MoE(4, nn.Linear(4, 4), num_experts=4, k=1)

    assert has_moe_layers(Stacked()) == (True, 2)

    class WithBias(nn.Linear):
        def forward(self, x):
            return super().forward(x), self.bias

    expert = WithBias(4, 4)
    layer = MoE(4, expert, num_experts=2, k=1, use_residual=True)
    assert layer.mlp is expert
    out, _, _ = layer(torch.randn(2, 3, 4))
    assert out.shape == (2, 3, 4)
