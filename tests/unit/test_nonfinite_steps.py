"""A step whose gradients hold inf or nan is skipped as upstream 0.19 skips it: at every stage
and precision, except bf16 with `bf16.check_grad_overflow: false` at stages 1-2 (applied).
One rank's input holds an inf at the second step; the other rank's gradients are finite, so
the skip must be agreed over the ranks (the global norm) for the replicas to stay equal."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from tests.unit.common import DistributedTest

# (name, config changes, whether the step with an inf gradient is skipped)
CASES = [
    ("bf16 stage 1 (check_grad_overflow defaults to true)", {"bf16": {"enabled": True}, "stage": 1}, True),
    ("bf16 stage 3 offload", {"bf16": {"enabled": True}, "stage": 3, "offload": True}, True),
    ("bf16 stage 2, opted out", {"bf16": {"enabled": True, "check_grad_overflow": False}, "stage": 2}, False),
    ("bf16 stage 3, opted out", {"bf16": {"enabled": True, "check_grad_overflow": False}, "stage": 3}, True),
    ("bf16 stage 0, opted out", {"bf16": {"enabled": True, "check_grad_overflow": False}, "stage": 0}, True),
    ("fp32 stage 2", {"stage": 2}, True),
    ("fp32 stage 3", {"stage": 3}, True),
]


def _engine(case: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    zero = {"stage": case["stage"]}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
        },
        "zero_optimization": zero,
        **({"bf16": case["bf16"]} if "bf16" in case else {}),
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def _weights(model: nn.Module) -> list:
    return [safe_get_full_fp32_param(p).clone() for p in model.parameters()]


class TestNonFiniteSteps(DistributedTest):
    world_size = 2

    def test_skip_follows_upstream(self):
        rank = torch.distributed.get_rank()
        for name, case, skipped in CASES:
            engine, model = _engine(case)
            dtype = torch.bfloat16 if "bf16" in case else torch.float32
            for step in range(3):
                x = torch.ones(2, 4, dtype=dtype)
                if step == 1 and rank == 1:
                    x[0, 0] = float("inf")
                before, lr = _weights(model), engine.get_lr()
                engine.backward(engine(x).float().mean())
                engine.step()
                after = _weights(model)
                if step != 1:
                    assert engine.was_step_applied(), name
                    assert all(torch.isfinite(w).all() for w in after) or not skipped, name  # NaN stays
                elif skipped:
                    assert not engine.was_step_applied() and engine.skipped_steps == 1, name
                    assert engine.get_global_grad_norm() == float("inf"), name
                    assert all(torch.equal(a, b) for a, b in zip(before, after)), name
                    assert engine.get_lr() == lr, name  # the schedule does not advance either
                else:
                    assert engine.was_step_applied() and engine.skipped_steps == 0, name
                    assert not all(torch.isfinite(w).all() for w in after), name
            if skipped:
                assert engine.global_steps == 3 and math.isfinite(engine.get_global_grad_norm()), name
            engine.destroy()


def test_check_grad_overflow_is_upstreams_key():
    from deepspeed.runtime.precision_config import get_bfloat16_config

    assert get_bfloat16_config({"bf16": {"enabled": True}}).check_grad_overflow is True
    assert (
        get_bfloat16_config({"bf16": {"enabled": True, "check_grad_overflow": False}}).check_grad_overflow
        is False
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_opting_out_is_per_stage(stage):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.optimizer import skips_nonfinite_steps

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    opted_out = DeepSpeedConfig(
        {**base, "bf16": {"enabled": True, "check_grad_overflow": False}}, world_size=1
    )
    assert not skips_nonfinite_steps(opted_out)
    assert skips_nonfinite_steps(DeepSpeedConfig({**base, "fp16": {"enabled": True}}, world_size=1))
