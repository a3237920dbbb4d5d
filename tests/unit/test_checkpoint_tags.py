"""`checkpoint.tag_validation` and the save folder argument, on 2 ranks: a tag that differs
between ranks is saved under rank 0's (Warn says so, Ignore does not) or refused on every
rank (Fail); an empty `save_dir` is a ValueError on every rank, before anything is written."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.checkpoint.errors import CheckpointError
from tests.unit.common import DistributedTest, LogRecords


def _engine(mode: str = None):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        **({"checkpoint": {"tag_validation": mode}} if mode else {}),
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


class TestTagValidation(DistributedTest):
    world_size = 2

    def test_modes(self, tmp_path):
        rank = torch.distributed.get_rank()
        records = LogRecords(logging.WARNING)
        logging.getLogger("DeepSpeed").addHandler(records)
        try:
            for mode in ("Warn", "Ignore", None):  # None: upstream's default, Warn
                root = os.path.join(str(tmp_path), f"ck_{mode}")
                engine = _engine(mode)
                records.messages.clear()
                assert engine.save_checkpoint(root, tag=f"tag-{rank}")
                assert sorted(os.listdir(root)) == ["latest", "tag-0", "zero_to_fp32.py"], mode
                warned = [m for m in records.messages if "differs from rank 0's 'tag-0'" in m]
                assert len(warned) == (rank == 1 and mode != "Ignore"), (mode, records.messages)
                path, _ = _engine(mode).load_checkpoint(root)  # one readable checkpoint
                assert path is not None and os.path.basename(os.path.dirname(path)) == "tag-0", path
                engine.destroy()
        finally:
            logging.getLogger("DeepSpeed").removeHandler(records)
        engine = _engine("Fail")
        root = os.path.join(str(tmp_path), "ck_fail")
        with pytest.raises(
            AssertionError, match=r"rank 1: .*'tag-1' differs from rank 0's 'tag-0'"
        ) as raised:
            engine.save_checkpoint(root, tag=f"tag-{rank}")  # upstream asserts: on every rank here too
        assert isinstance(raised.value, CheckpointError)
        assert not os.path.exists(os.path.join(root, "latest"))
        engine.save_checkpoint(root, tag="same")  # and the same tag saves

    def test_empty_save_dir_is_a_value_error(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        engine = _engine()
        for save_dir in (None, ""):
            with pytest.raises(ValueError, match="pass the folder to save into"):
                engine.save_checkpoint(save_dir)
        assert os.listdir(tmp_path) == []  # nothing written into the working folder
