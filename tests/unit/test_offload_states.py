"""engine.offload_states() / reload_states() (RLHF frameworks free the accelerator with them).

On this CPU-only machine the accelerator is the host, so "the memory leaves the accelerator"
is checked as the mechanism: every storage behind a named state is freed (0 bytes) while its
tensors point at separate host buffers and report the host device, and reload puts the same
storages back with bit-identical bytes. On a GPU the same checks read "cuda" before and "cpu"
after, and the freed storages are accelerator memory.
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.offload_states import get_state_devices, state_bytes_by_device, state_tensors
from tests.unit.common import DistributedTest
from tests.unit.test_engine import TinyLM, batches, config, my_slice

KINDS = list(OffloadStateTypeEnum)
# Kept between steps by every stage once a step ran (lp_grads exist between backward and step,
# the reducer's buffers only once a reduction ran).
PERSISTENT = [
    OffloadStateTypeEnum.optim_states,
    OffloadStateTypeEnum.hp_params,
    OffloadStateTypeEnum.lp_params,
]


def build(stage: int, offload_optimizer: bool = False):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 20, "reduce_bucket_size": 300}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = config(zero_optimization=zero, zero_force_ds_cpu_optimizer=False)
    torch.manual_seed(42)
    engine, *_ = deepspeed.initialize(model=TinyLM(), config=cfg)
    return engine


def step(engine, ids, labels, between_backward_and_step=None):
    loss = engine(my_slice(ids), my_slice(labels))
    engine.backward(loss)
    if between_backward_and_step is not None:
        between_backward_and_step(engine)
    engine.step()
    return loss.item()


def snapshot(engine, kinds) -> dict:
    return {k: [t.detach().clone() for t in state_tensors(engine, k)] for k in kinds}


def offload_and_check(engine, kinds) -> list:
    """Offload `kinds`; check each storage was freed and its tensors moved; return the storages."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for k in kinds for t in state_tensors(engine, k)
    }
    storages = [s for s in storages.values() if s.nbytes() > 0]
    before = {k: sum(state_bytes_by_device(engine, k).values()) for k in kinds}
    engine.offload_states(include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    assert storages and all(s.nbytes() == 0 for s in storages), "every storage behind a named state is freed"
    for kind in kinds:
        assert get_state_devices(engine, kind) <= {torch.device("cpu")}, kind
        for t in state_tensors(engine, kind):
            assert all(t.untyped_storage().data_ptr() != s.data_ptr() for s in storages if s.nbytes())
        if before[kind]:  # the bytes now live in host buffers
            assert sum(state_bytes_by_device(engine, kind).values()) >= before[kind], kind
    return storages


def reload_and_check(engine, storages, expected: dict) -> None:
    engine.reload_states(non_blocking=False)
    assert all(s.nbytes() > 0 for s in storages), "the same storages are allocated again"
    for kind, tensors in expected.items():
        got = state_tensors(engine, kind)
        assert len(got) == len(tensors), kind
        for a, b in zip(got, tensors):
            assert a.device == b.device and torch.equal(a, b), f"{kind} differs after reload"


class TestOffloadStates(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage,offload_optimizer", [(1, False), (2, False), (3, False), (3, True)])
    def test_states_leave_and_come_back_bit_identical(self, stage, offload_optimizer):
        """Train, offload everything, reload, train on: the same losses as never offloading; and
        gradients offloaded between backward and step come back exact too."""
        data = batches(4, seed=11)
        plain = build(stage, offload_optimizer)
        want = [step(plain, *batch) for batch in data]

        engine = build(stage, offload_optimizer)
        got = [step(engine, *data[0])]
        expected = snapshot(engine, KINDS)
        storages = offload_and_check(engine, PERSISTENT)
        with pytest.raises(RuntimeError, match="reload_states"):
            engine(my_slice(data[1][0]), my_slice(data[1][1]))
        reload_and_check(engine, storages, expected)

        def grads_round_trip(engine):
            grads = snapshot(engine, [OffloadStateTypeEnum.lp_grads])
            if grads[OffloadStateTypeEnum.lp_grads]:
                moved = offload_and_check(engine, [OffloadStateTypeEnum.lp_grads])
                with pytest.raises(RuntimeError, match="lp_grads"):
                    engine.step()
                reload_and_check(engine, moved, grads)

        got.append(step(engine, *data[1], between_backward_and_step=grads_round_trip))
        engine.offload_states()  # everything, the default, then back
        engine.reload_states()
        got += [step(engine, *batch) for batch in data[2:]]
        assert got == want, f"stage {stage}: {got} != {want}"

    def test_rlhf_pattern_and_misuse(self):
        """Optimizer state and masters off while the model generates (forward is allowed without
        lp_params); bad arguments are refused with the fix named; reload with nothing is a no-op."""
        engine = build(3)
        ids, labels = batches(1, seed=2)[0]
        step(engine, ids, labels)
        engine.reload_states()  # nothing offloaded
        moments = [t.untyped_storage() for t in state_tensors(engine, OffloadStateTypeEnum.optim_states)]
        engine.offload_states(include=[OffloadStateTypeEnum.optim_states, "hp_params"])
        assert moments and all(s.nbytes() == 0 for s in moments)
        # fp32 masters are the model's own shards here: they stay, as the model needs them
        with torch.no_grad():
            engine(my_slice(ids), my_slice(labels))
        with pytest.raises(RuntimeError, match="reload_states"):
            engine.backward(engine(my_slice(ids), my_slice(labels)))
        engine.reload_states()
        # lp_params alone: in fp32 its storage is also the masters', and goes with them (it
        # stayed, freeing nothing, while forward was refused); reload brings both back.
        shards = [p.ds_tensor.untyped_storage() for p in engine.module.parameters()]
        masters = snapshot(engine, [OffloadStateTypeEnum.hp_params])
        engine.offload_states(include=[OffloadStateTypeEnum.lp_params])
        assert all(s.nbytes() == 0 for s in shards), "the model's storage is freed, masters and all"
        with pytest.raises(RuntimeError, match=r"\['lp_params'\] are offloaded"):
            engine(my_slice(ids), my_slice(labels))
        reload_and_check(engine, [], masters)
        with pytest.raises(ValueError, match="not a state kind"):
            engine.offload_states(include=["moments"])
        with pytest.raises(ValueError, match="OffloadDeviceEnum.cpu"):
            engine.offload_states(device=OffloadDeviceEnum.nvme)
        step(engine, ids, labels)
        dist.barrier()
