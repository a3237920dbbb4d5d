"""NVMe parameter swapping (issue 44 items 2, 4 and 5; runtime/zero/param_swap.py).

Every 2-rank case runs in one pooled group. Parity is exact: a run with `offload_param`
"nvme" does the same arithmetic as one with "cpu" (only where each partition lives
between uses differs), so losses and parameters must be bitwise equal. The buffers are
small (`buffer_size` is the largest partition, `max_in_cpu` about a quarter of a rank's
elements) and the prefetch bucket tiny, so most partitions are written out and read back
several times a step, and reads are issued ahead along the trace.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import namedtuple
from pathlib import Path
from unittest import mock

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.swap_tensor.swap_store import SwapSpaceError
from deepspeed.runtime.zero import param_swap
from deepspeed.runtime.zero.config import get_zero_config
from tests.unit.common import DistributedTest
from tests.zoo import models as zm
from tests.zoo.harness import Case, build, check_parity, gathered, initialize, run_engine

LARGEST = 1040  # TokenMLP's largest partition at 2 ranks: MLPBlock.up, (2 * 32 + 1) * 32 / 2
MAX_IN_CPU = 1500  # of about 6,400 partition elements per rank


def _swapping(path, **knobs) -> dict:
    block = {"device": "nvme", "nvme_path": str(path), "buffer_count": 3, "buffer_size": LARGEST}
    return {**block, "max_in_cpu": MAX_IN_CPU, **knobs}


def _edit_then_swap_out(model, step):
    """After the first step: rank 0 halves the head (kept by every rank), everything is
    swapped out, and the head is read back from the files."""
    if step != 0:
        return None
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                model.head.weight.mul_(0.5)
    states = [p._zero_state for p in model.parameters()]
    for swapper in param_swap.swappers_of(states):
        swapper.swap_out_all()
        assert swapper.resident_elems == 0 and all(s.resident is None for s in states)
    return gathered(model)["head.weight"]


def _case(name: str, offload_param: dict, offload_optimizer: bool = False, **kwargs) -> Case:
    zero = {"offload_param": offload_param, "stage3_prefetch_bucket_size": 600}
    extra = {"zero_optimization": zero}
    if offload_optimizer:  # the config's SGD steps CPU masters, in both runs
        zero["offload_optimizer"] = {"device": "cpu"}
        extra["zero_force_ds_cpu_optimizer"] = False
    kwargs.setdefault("gas", 2)
    kwargs.setdefault("clip", 0.05)
    return Case(
        name,
        zm.TokenMLP,
        zm.token_batch,
        zm.lm_loss,
        config_extra=extra,
        between=_edit_then_swap_out,
        **kwargs,
    )


def _swapper_of(model):
    found = param_swap.swappers_of([p._zero_state for p in model.parameters()])
    assert len(found) == 1
    return found[0]


def _swapper(engine):
    return _swapper_of(engine.module)


def _assert_same(a, b) -> None:
    assert a.losses == b.losses
    for x, y in zip(a.outputs, b.outputs):
        assert (x is None and y is None) or torch.equal(x, y)
    pa, pb = gathered(a.model), gathered(b.model)
    assert all(torch.equal(pa[n], pb[n]) for n in pa), [n for n in pa if not torch.equal(pa[n], pb[n])]


def _parity(tmp: Path) -> None:
    cases = [
        ({}, {}),
        ({"under_init": True}, {}),  # zero.Init(config_dict_or_path=...) reads the nvme block
        ({"offload_optimizer": True}, {}),
        ({"bf16": True}, {}),  # fp32 partitions re-typed to bf16: files re-reserved
    ]
    for kwargs, knobs in cases:
        data = _case("cpu", {"device": "cpu"}, **kwargs).micro_batches(2)
        ref = run_engine(_case("cpu", {"device": "cpu"}, **kwargs), data)
        got = run_engine(_case("nvme", _swapping(tmp, **knobs), **kwargs), data)
        _assert_same(got, ref)
        swapper = _swapper(got.engine)
        stats = swapper.stats
        assert stats["writes"] > 0 and stats["reads"] > 0 and stats["read_ahead"] > 0, (kwargs, stats)
        assert swapper.resident_elems <= MAX_IN_CPU
        assert swapper.pool.nbytes <= LARGEST * 4 + 4095  # sized to the largest partition
        assert swapper.disk_bytes() > 0
        got.engine.destroy()
        ref.engine.destroy()


def _checkpoints(tmp: Path) -> None:
    """NVMe -> no NVMe -> NVMe: every load gives the saved parameters, and training goes on
    exactly as without the round trip. Swap files never land in the checkpoint folder."""
    nvme_case, plain_case = (
        _case("nvme", _swapping(tmp), clip=0.0),
        _case("plain", {"device": "none"}, clip=0.0),
    )
    data = nvme_case.micro_batches(2)  # 3 steps
    first = run_engine(nvme_case, data[:2])
    first.engine.save_checkpoint(str(tmp / "ckpt"), tag="nvme")
    middle = initialize(plain_case, build(plain_case, zero=True))
    middle.load_checkpoint(str(tmp / "ckpt"), tag="nvme")
    want = gathered(first.model)
    assert all(torch.equal(want[n], t) for n, t in gathered(middle.module).items())
    middle.save_checkpoint(str(tmp / "ckpt"), tag="plain")
    last = initialize(nvme_case, build(nvme_case, zero=True))
    last.load_checkpoint(str(tmp / "ckpt"), tag="plain")
    assert all(torch.equal(want[n], t) for n, t in gathered(last.module).items())
    assert _swapper(last).stats["writes"] > 0  # the loaded partitions went to the files
    on, off = run_engine(nvme_case, data[2:], engine=last), run_engine(plain_case, data[2:], engine=middle)
    cont = run_engine(nvme_case, data[2:], engine=first.engine)
    assert on.losses == off.losses == cont.losses
    _assert_same(on, off)
    assert not list((tmp / "ckpt").rglob("*.swp"))
    for engine in (first.engine, middle, last):
        engine.destroy()


def _failures(tmp: Path) -> None:
    """A full disk or an unwritable folder on rank 1 only: both ranks raise at set-up, none hangs."""
    rank = dist.get_rank()
    case = _case("nvme", _swapping(tmp))
    full = namedtuple("usage", "total used free")(1 << 30, (1 << 30) - 1024, 1024)
    with mock.patch.object(shutil, "disk_usage", return_value=full) if rank == 1 else _nothing():
        with pytest.raises(SwapSpaceError) as err:
            initialize(case, build(case, zero=True))
    if rank == 1:
        assert "zero_swap" in str(err.value) and "needs 4096 more bytes" in str(err.value), err.value
        assert "1024 free" in str(err.value)
    else:
        assert "on rank 1" in str(err.value) and "zero_swap" in str(err.value), err.value

    denied = mock.patch.object(os, "access", return_value=False) if rank == 1 else _nothing()
    with denied, pytest.raises((PermissionError, RuntimeError), match="is not writable"):
        initialize(case, build(case, zero=True))

    small = _case("nvme", _swapping(tmp, buffer_size=LARGEST - 1))
    with pytest.raises(ValueError, match=rf"buffer_size={LARGEST - 1} .* at least {LARGEST}"):
        initialize(small, build(small, zero=True))


def _init_remote_nvme(tmp: Path) -> None:
    """zero.Init(remote_device="nvme") takes the folder and knobs from the config's block (here
    with device "cpu", as Lightning writes it) and writes partitions out as modules are built."""
    block = {"device": "cpu", "nvme_path": str(tmp), "buffer_size": LARGEST, "max_in_cpu": 0}
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": block}}
    torch.manual_seed(3)
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=config):
        swapped = zm.TokenMLP()
    torch.manual_seed(3)
    with deepspeed.zero.Init(remote_device="cpu", config_dict_or_path=config):
        resident = zm.TokenMLP()
    states = [p._zero_state for p in swapped.parameters()]
    assert all(isinstance(s, param_swap.SwappedParamState) for s in states)
    swapper = _swapper_of(swapped)
    assert swapper.resident_elems <= LARGEST and swapper.stats["writes"] >= len(states) - 1
    want = gathered(resident)
    assert all(torch.equal(want[n], t) for n, t in gathered(swapped).items())


def _write_failure(tmp: Path) -> None:
    """A partition's write failing mid-step on rank 1 only (when issued, or when waited for):
    every rank raises at the step (rank 1 its own error), none hangs, and no value is lost:
    the parameters equal a CPU-offload run's after the same step."""
    import errno

    rank = dist.get_rank()

    def broken(swapper, waiting):
        def fail(*args, **kwargs):
            if waiting:  # the writes land, then their files are spoilt (NaN) as a failed write leaves them
                type(swapper.store).wait_writes(swapper.store)
                for ds_id in swapper.writing:
                    path = swapper.store.path(f"param_{ds_id}")
                    with open(path, "r+b") as f:
                        f.write(b"\xff" * os.path.getsize(path))
            raise OSError(errno.EIO, "Input/output error (injected)")

        return fail

    for where in ("write", "wait_writes"):
        case = dataclasses.replace(_case("nvme", _swapping(tmp)), between=None)
        plain = dataclasses.replace(_case("cpu", {"device": "cpu"}), between=None)
        data = case.micro_batches(2)[:1]
        want = gathered(run_engine(plain, data).model)
        engine = initialize(case, build(case, zero=True))
        swapper = _swapper(engine)
        if rank == 1:
            setattr(swapper.store, where, broken(swapper, where == "wait_writes"))
        with pytest.raises((OSError, RuntimeError)) as err:
            run_engine(case, data, engine=engine)
        if rank == 1:
            assert "injected" in str(err.value), (where, err.value)
            assert swapper.io_error is None  # taken by the step's agreement
            delattr(swapper.store, where)  # the instance attribute hid the method
        else:
            assert "failed in this step on 1 other rank(s)" in str(err.value), (where, err.value)
        got = gathered(engine.module)
        assert all(torch.equal(want[n], got[n]) for n in want), where
        engine.destroy()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class TestParamSwapTwoRanks(DistributedTest):
    world_size = 2
    timeout_s = 300.0

    def test_parity_checkpoints_and_failures(self, tmp_path):
        tmp = tmp_path  # one path in every rank's config; each rank swaps into a folder of its own
        _parity(tmp)
        _checkpoints(tmp)
        _init_remote_nvme(tmp)
        _failures(tmp)
        _write_failure(tmp)

    def test_zoo_llama_against_pytorch(self, tmp_path):
        """A zoo model at stage 3 with parameters swapped to NVMe trains as plain PyTorch does."""
        offload = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4, "max_in_cpu": 2000}
        extra = {"zero_optimization": {"offload_param": offload, "stage3_prefetch_bucket_size": 2000}}
        got, _ = check_parity(
            Case("llama_nvme_param", zm.llama, zm.token_batch, zm.hf_causal_loss, config_extra=extra)
        )
        assert _swapper(got.engine).stats["writes"] > 0
        got.engine.destroy()


def test_config_needs_nvme_path_and_init_needs_the_block():
    with pytest.raises(
        DeepSpeedConfigError, match=r"offload_param\.device='nvme' needs .*offload_param\.nvme_path"
    ):
        get_zero_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(
        ValueError, match=r"remote_device='nvme' needs zero_optimization\.offload_param\.nvme_path"
    ):
        deepspeed.zero.Init(remote_device="nvme")
