"""`deepspeed.OnDevice`: where and in which dtype a module's tensors are created."""

import pytest
import torch
from torch import nn

import deepspeed


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Embedding(10, 4))


def test_module_built_on_meta_in_the_dtype():
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = _model()
        index = torch.zeros(3, dtype=torch.int64)
        named = torch.full((2,), 1.0, dtype=torch.float32, device="cpu")
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in model.parameters())
    assert index.device.type == "meta" and index.dtype == torch.int64  # not floating: dtype kept
    assert named.device.type == "cpu" and named.dtype == torch.float16  # a named device wins, dtype cast
    after = torch.empty(2)
    assert after.device.type == "cpu" and after.dtype == torch.get_default_dtype()


def test_real_device_keeps_values_and_other_factories_alone():
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="cpu"):
        ones = torch.ones(3)
        noise = torch.randn(3)  # upstream leaves other factories alone too
    assert ones.dtype == torch.bfloat16 and ones.tolist() == [1.0, 1.0, 1.0]
    assert noise.dtype == torch.float32


def test_disabled_is_a_no_op_and_the_mode_ends_on_error():
    with deepspeed.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.zeros(1).device.type == "cpu"
    with pytest.raises(KeyError):
        with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
            raise KeyError("model init failed")
    assert torch.zeros(1).device.type == "cpu" and torch.zeros(1).dtype == torch.float32


def test_refusals():
    with pytest.raises(ValueError, match="floating-point"):
        deepspeed.OnDevice(dtype=torch.int8)
    with pytest.raises(RuntimeError):
        deepspeed.OnDevice(dtype=torch.float16, device="no-such-device")
    context = deepspeed.OnDevice(dtype=torch.float16)
    with context:
        with pytest.raises(RuntimeError, match="already active"):
            context.__enter__()
