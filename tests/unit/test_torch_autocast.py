"""The `torch_autocast` config section ([Note: torch_autocast] in runtime/torch_autocast.py):
the forward under torch.autocast, the listed modules' gradients reduced in the autocast
dtype, float16's dynamic loss scale, and an autocast the caller opened around the forward."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME, get_comm_dtype
from deepspeed.utils.logging import logger
from tests.unit.common import DistributedTest, LogRecords

LR, STEPS, ROWS = 0.1, 3, 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _config(stage, **autocast):
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16", **autocast},
    }


def _data(world):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(world, ROWS, 6, generator=gen), torch.randn(world, ROWS, 3, generator=gen))
        for _ in range(STEPS)
    ]


def _reference(world):
    """Plain PyTorch: each rank's forward under autocast, its gradients averaged over the ranks
    as the engine reduces them: the Linear layers' in bf16 (each rank's share rounded, then the
    sum), the LayerNorm's in fp32."""
    model = _model()
    safe = {id(p) for m in model.modules() if type(m) is nn.Linear for p in m.parameters(recurse=False)}
    for xs, ys in _data(world):
        shares = []
        for rank in range(world):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xs[rank])
            F.mse_loss(out.float(), ys[rank]).backward()
            shares.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                if id(p) in safe:
                    grad = sum(share[i].bfloat16() * (1.0 / world) for share in shares).float()
                else:
                    grad = sum(share[i] * (1.0 / world) for share in shares)
                p.sub_(LR * grad)
    return [p.detach() for p in model.parameters()]


class TestTorchAutocast(DistributedTest):
    world_size = [1, 2]

    def test_trains_as_autocast_with_the_linears_reduced_in_bf16(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        expected = _reference(world)
        for stage in (0, 1, 2, 3):
            engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
            marked = {n: get_comm_dtype(p) for n, p in engine.module.named_parameters()}
            assert marked == {
                "0.weight": torch.bfloat16,
                "0.bias": torch.bfloat16,
                "1.weight": torch.float32,
                "1.bias": torch.float32,
                "2.weight": torch.bfloat16,
                "2.bias": torch.bfloat16,
            }
            assert not hasattr(engine.module[1].weight, PARAM_COMM_DTYPE_ATTR_NAME)
            for xs, ys in _data(world):
                out = engine(xs[rank])
                assert out.dtype == torch.bfloat16  # the forward ran under autocast
                engine.backward(F.mse_loss(out.float(), ys[rank]))
                engine.step()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                got = [p.detach().clone() for p in engine.module.parameters()]
            for a, b in zip(got, expected):
                assert a.dtype == torch.float32
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"stage {stage}")

    def test_float16_scales_the_loss_and_skips_overflowing_steps(self):
        engine, *_ = deepspeed.initialize(model=_model(), config=_config(2, dtype="float16"))
        assert engine.optimizer.loss_scale == 2.0**16  # torch.amp.GradScaler's start
        x = torch.randn(ROWS, 6)
        loss = engine(x).float().pow(2).mean()
        assert torch.equal(engine.scale(loss), loss.float() * 2.0**16)
        engine.backward(loss * 1e6)  # scaled gradients overflow float16: the step is skipped
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.step()
        assert engine.skipped_steps == 1 and engine.optimizer.loss_scale == 2.0**15
        assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        assert engine.skipped_steps == 1 and engine.global_steps == 2


class TestAutocastAroundTheForward(DistributedTest):
    world_size = [1]

    def test_an_outer_autocast_is_replaced_inside_the_forward(self):
        plain, *_ = deepspeed.initialize(model=_model(), config={**_config(1), "torch_autocast": {}})
        fp16, *_ = deepspeed.initialize(model=_model(), config=_config(1, dtype="float16"))
        x = torch.randn(ROWS, 6)
        records = LogRecords(logging.WARNING)
        logger.addHandler(records)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert plain(x).dtype == torch.float32  # the section is off: no autocast inside
                assert plain(x).dtype == torch.float32
                assert fp16(x).dtype == torch.float16  # the section's dtype wins
        finally:
            logger.removeHandler(records)
        assert len([m for m in records.messages if "torch_autocast section is off" in m]) == 1  # said once


def _parse(section, **extra):
    return DeepSpeedConfig({"train_batch_size": 1, "torch_autocast": section, **extra}, world_size=1)


def test_config_values_are_checked_by_name():
    assert _parse({"enabled": True, "dtype": "torch.float16"}).torch_autocast_dtype == torch.float16
    with pytest.raises(ValueError, match=r"torch_autocast.dtype='int8': use 'bfloat16' or 'float16'"):
        _parse({"enabled": True, "dtype": "int8"})


def test_unknown_safe_module_and_quantized_weights_are_refused():
    from deepspeed.runtime.torch_autocast import init_autocast_params

    class Engine:  # what init_autocast_params reads off an engine
        module = _model()
        _config = _parse({"enabled": True})

    with pytest.raises(ValueError, match=r"'torch.nn.Linearr' names no class"):
        init_autocast_params(Engine, torch.bfloat16, ["torch.nn.Linearr"])
    Engine._config = _parse({"enabled": True}, zero_optimization={"stage": 3, "zero_quantized_weights": True})
    with pytest.raises(ValueError, match="zero_quantized_weights"):
        init_autocast_params(Engine, torch.bfloat16, None)
