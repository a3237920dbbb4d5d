"""Ranks that disagree on structure raise the same clear error on every rank, never hang or
return garbage (runtime/agreement.py): models under zero.Init, initialize, GatheredParameters."""

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.agreement import RankMismatchError, check_agreement
from tests.unit.common import DistributedTest

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


class TestRankAgreement(DistributedTest):
    world_size = [2, 4]

    def test_a_rank_dependent_width_under_init_raises_everywhere(self):
        width = 8 + (dist.get_rank() == dist.get_world_size() - 1)  # the last rank read another size
        with pytest.raises(RankMismatchError) as caught:
            with deepspeed.zero.Init():
                nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width))
        text = str(caught.value)
        last = dist.get_world_size() - 1
        assert "zero.Init: the parameters of a Linear" in text and f"rank(s) [{last}]" in text
        assert "weight (9, 4)" in text and "weight (8, 4)" in text
        # Nothing was left half-broadcast: the ranks are still in step.
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 4)
        with deepspeed.zero.GatheredParameters(layer.weight):
            assert layer.weight.shape == (4, 4)

    def test_initialize_with_different_configs_or_parameter_order_raises(self):
        torch.manual_seed(0)
        clip = 1.0 if dist.get_rank() == 0 else 2.0
        with pytest.raises(RankMismatchError, match="gradient_clipping"):
            deepspeed.initialize(model=nn.Linear(3, 3), config={**CONFIG, "gradient_clipping": clip})

        class Swapped(nn.Module):
            def __init__(self, swap):
                super().__init__()
                first, second = ("b", "a") if swap else ("a", "b")
                setattr(self, first, nn.Linear(3, 3))
                setattr(self, second, nn.Linear(3, 5))

        with pytest.raises(RankMismatchError, match="first at entry 1") as caught:
            deepspeed.initialize(model=Swapped(dist.get_rank() == 1), config=CONFIG)
        assert "a.weight" in str(caught.value) or "b.weight" in str(caught.value)
        engine, *_ = deepspeed.initialize(model=nn.Linear(3, 3), config=CONFIG)  # agreeing ranks go on
        assert engine(torch.ones(1, 3)).shape == (1, 3)

    def test_gathered_parameters_with_different_lists_raise_in_sanity_mode(self):
        config = {**CONFIG, "zero_optimization": {"stage": 3, "enable_sanity_checks": True}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            a, b = nn.Linear(3, 3), nn.Linear(3, 3)
        chosen = [a.weight] if dist.get_rank() == 0 else [b.weight]
        with pytest.raises(RankMismatchError, match="GatheredParameters"):
            deepspeed.zero.GatheredParameters(chosen).start()
        with deepspeed.zero.GatheredParameters([b.weight, a.weight]):  # same set, any order: fine
            assert a.weight.shape == (3, 3)

    def test_the_error_names_each_version(self):
        items = ["same", f"rank {dist.get_rank() % 2}"]
        with pytest.raises(RankMismatchError) as caught:
            check_agreement("a test structure", items, fix="Make them equal.")
        text = str(caught.value)
        assert "2 different versions" in text and "entry 1" in text and text.endswith("Make them equal.")
        check_agreement("a test structure", ["same"])  # agreement: returns quietly
