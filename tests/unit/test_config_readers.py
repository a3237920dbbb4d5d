"""Upstream's config readers and constants (`deepspeed.runtime.config.get_*`,
`deepspeed.runtime.constants`), and the `log_level` key acted on at initialize."""

from __future__ import annotations

import logging

import pytest
import torch

import deepspeed
from deepspeed.runtime import constants
from deepspeed.runtime.config import DeepSpeedConfig, get_gradient_clipping, get_log_level
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.utils import logger, set_log_level_from_string
from deepspeed.utils.logging import _reset_level, get_log_level_from_string, should_log_le
from tests.unit.common import DistributedTest


def test_readers_give_upstreams_defaults():
    assert get_gradient_clipping({}) == constants.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is None and constants.LOG_LEVEL_DEFAULT is None
    assert get_log_level({"log_level": "ERROR"}) == "ERROR"
    assert constants.TRAIN_BATCH_SIZE == "train_batch_size" and constants.STEPS_PER_PRINT_DEFAULT == 10
    # read off the typed config: each default is what a config without the key gets
    plain = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    assert plain.gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert plain.steps_per_print == constants.STEPS_PER_PRINT_DEFAULT


def test_log_level_strings():
    assert get_log_level_from_string("Error") == logging.ERROR
    with pytest.raises(ValueError, match="'loud' is not one of"):
        get_log_level_from_string("loud")
    with pytest.raises(DeepSpeedConfigError, match="loud"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "log_level": "loud"}, world_size=1)
    try:
        set_log_level_from_string("debug")
        assert logger.level == logging.DEBUG and all(h.level == logging.DEBUG for h in logger.handlers)
        assert should_log_le("info")
        set_log_level_from_string("error")
        assert not should_log_le("warning")
    finally:
        _reset_level()
    assert all(h.level == logging.NOTSET for h in logger.handlers)


class TestLogLevelKey(DistributedTest):
    world_size = 1

    def test_initialize_sets_the_logger(self):
        model = torch.nn.Linear(2, 2)
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        try:
            logger.setLevel(logging.DEBUG)
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config={**config, "log_level": "ERROR"}
            )
            assert engine.log_level() == "ERROR" and logger.getEffectiveLevel() == logging.ERROR
            logger.setLevel(logging.WARNING)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            assert (
                engine.log_level() is None and logger.getEffectiveLevel() == logging.WARNING
            )  # left as it was
        finally:
            _reset_level()
