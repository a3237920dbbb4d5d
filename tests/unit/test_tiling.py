"""`deepspeed.zero.TiledLinear`: the same layer as `torch.nn.Linear`, in tiles (tiling.py's note)."""

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias
from tests.unit.common import DistributedTest


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (2, 3), (3, 2), (7, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_linear(in_splits, out_splits, bias):
    torch.manual_seed(0)
    linear = nn.Linear(7, 5, bias=bias)
    tiled = TiledLinear(7, 5, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear)
    x = torch.randn(4, 3, 7)
    torch.testing.assert_close(tiled(x), linear(x), rtol=1e-6, atol=1e-6)
    widths = [[t.weight.shape for t in row] for row in tiled.linears]
    assert len(widths) == out_splits and all(len(row) == in_splits for row in widths)
    # Only the last tile of each output row has a bias; parts are as even as they go, first ones wider.
    assert [t.bias is not None for t in tiled.linears[0]] == [
        bias and i == in_splits - 1 for i in range(in_splits)
    ]
    assert [b - a for a, b in zip(tiled.in_parts, tiled.in_parts[1:])] == sorted(
        [7 // in_splits + (1 if i < 7 % in_splits else 0) for i in range(in_splits)], reverse=True
    )


def test_split_input_and_split_output():
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    tiled = TiledLinear(
        6,
        4,
        in_splits=2,
        out_splits=2,
        input_is_already_split=True,
        combine_out_splits=False,
        init_linear=linear,
    )
    x = torch.randn(3, 6)
    parts = tiled([x[:, :3], x[:, 3:]])
    assert isinstance(parts, list) and len(parts) == 2
    torch.testing.assert_close(torch.cat(parts, dim=-1), linear(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="3 input parts"):
        tiled([x[:, :2], x[:, 2:4], x[:, 4:]])


class _SkipBiasAdd(nn.Linear):
    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


def test_return_bias_tiles():
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(
        6, 4, in_splits=3, out_splits=2, linear_cls=_SkipBiasAdd, init_linear=linear
    )
    x = torch.randn(5, 6)
    out, bias = tiled(x)
    torch.testing.assert_close(out + bias, linear(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias, linear.bias)
    with pytest.raises(TypeError, match=r"\(output, bias\)"):
        TiledLinearReturnBias(6, 4, in_splits=2)(x)


def test_refusals_name_the_value():
    with pytest.raises(RuntimeError, match="in_splits=0"):
        TiledLinear(4, 4, in_splits=0)
    with pytest.raises(RuntimeError, match="out_splits=5"):
        TiledLinear(4, 4, out_splits=5)
    with pytest.raises(ValueError, match=r"shape \(4, 4\)"):
        TiledLinear(4, 4).copy_params_from(nn.Linear(3, 4))
    with pytest.raises(ValueError, match="bias"):
        TiledLinear(4, 4, bias=False).copy_params_from(nn.Linear(4, 4))
    assert deepspeed.zero.TiledLinear is TiledLinear


class TestTiledUnderZero3(DistributedTest):
    world_size = 2

    def test_trains_like_the_linear_it_tiles(self):
        """Built under zero.Init from a plain Linear (copy_params_from gathers each tile), then
        trained at stage 3 on per-rank slices: the same as the plain Linear on the whole batch."""
        torch.manual_seed(0)
        linear = nn.Linear(10, 6)
        reference = nn.Linear(10, 6)
        reference.load_state_dict(linear.state_dict())
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.0,  # the reference does not clip (the default clips at 1.0)
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        with deepspeed.zero.Init(config_dict_or_path=config):
            tiled = TiledLinear(10, 6, in_splits=3, out_splits=2, init_linear=linear)
        assert all(p.ds_tensor.numel() < p.ds_numel for p in tiled.parameters())
        engine, *_ = deepspeed.initialize(model=tiled, config=config)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        rank = dist.get_rank()
        for _ in range(3):
            x, y = torch.randn(4, 10, generator=gen), torch.randn(4, 6, generator=gen)
            loss = (engine(x[2 * rank : 2 * rank + 2]) - y[2 * rank : 2 * rank + 2]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            ((reference(x) - y).pow(2).mean()).backward()
            opt.step()
        full = nn.Linear(10, 6)
        with deepspeed.zero.GatheredParameters(list(tiled.parameters())):
            weight = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in tiled.linears], dim=0)
            bias = torch.cat([row[-1].bias for row in tiled.linears])
            full.weight.data.copy_(weight)
            full.bias.data.copy_(bias)
        torch.testing.assert_close(full.weight, reference.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(full.bias, reference.bias, rtol=0, atol=1e-6)
