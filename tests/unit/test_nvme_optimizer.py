"""`offload_optimizer.device: "nvme"`: the same training as CPU offload, with the state in swap files.

Parity is exact: the NVMe run steps the same CPU optimizer over the same masters, one
sub-group at a time, so losses, parameters and optimizer state must equal CPU offload's bit
for bit, at stages 1, 2 and 3, with and without pipelining, over several sub-groups, with
gradient accumulation and clipping. Checkpoints move between NVMe and CPU runs both ways.
"""

import gc
import resource
import signal
import types
import weakref
from pathlib import Path

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
import deepspeed.runtime.agreement
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.swap_tensor.swap_store import AioSettings, SwapSpaceError, SwapStore
from deepspeed.runtime.zero.nvme_optimizer import (
    OptimizerSwapper,
    minimum_buffer_count,
    state_kinds,
    step_only,
)
from tests.unit.common import DistributedTest
from tests.unit.test_engine import TinyLM, batches, config, my_slice

GAS = 2


def build(
    stage, device, nvme_path=None, sub_group_size=300, pipeline=(False, False), buffer_count=9, **extra
):
    off = {"device": device}
    if device == "nvme":
        off.update(pipeline_read=pipeline[0], pipeline_write=pipeline[1], buffer_count=buffer_count)
        if nvme_path is not None:
            off["nvme_path"] = str(nvme_path)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300}
    zero.update(offload_optimizer=off, sub_group_size=sub_group_size)
    cfg = config(gas=GAS, clip=0.05, zero_optimization=zero)
    cfg["optimizer"]["params"].pop("torch_adam")  # DeepSpeedCPUAdam, as offload runs Adam
    cfg.update(extra)
    torch.manual_seed(42)
    engine, *_ = deepspeed.initialize(model=TinyLM(), config=cfg)
    return engine


def train(engine, data):
    losses = []
    for ids, labels in data:
        for micro in range(GAS):
            loss = engine(my_slice(ids, micro, GAS), my_slice(labels, micro, GAS))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def shards(engine):
    """This rank's training-dtype shard of every parameter (stage 3) or the whole parameters."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]


def adam_state(engine):
    with engine.optimizer.resident():
        state = engine.optimizer.optimizer.state
        return [
            (state[m]["exp_avg"].clone(), state[m]["exp_avg_sq"].clone(), m.detach().clone())
            for m in engine.optimizer.masters.values()
        ]


def assert_same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, tuple):
            assert all(torch.equal(u, v) for u, v in zip(x, y)), f"{what}: entry {i} differs"
        else:
            assert torch.equal(x, y), f"{what}: entry {i} differs"


def swap_folder(tmp_path) -> Path:
    # One nvme_path for every rank (the config must agree): each process swaps into its own
    # host-pid folder under it.
    return tmp_path / "nvme"


# (stage, (pipeline_read, pipeline_write)): each stage once and each pipelining in the default
# run; the rest of the grid behind the slow marker.
CASES = [(1, (False, False)), (2, (True, False)), (3, (True, True))]
MORE_CASES = [(1, (True, True)), (2, (False, True)), (3, (False, False))]


def check_parity(tmp_path, cases):
    data, more = batches(2), batches(1, seed=1)
    for stage, pipeline in cases:
        reference = build(stage, "cpu")
        expected = (train(reference, data), shards(reference), adam_state(reference))
        reference.offload_states()
        reference.reload_states()
        expected_after = train(reference, more)
        folder = swap_folder(tmp_path) / f"s{stage}"
        folder.mkdir(parents=True, exist_ok=True)
        engine = build(stage, "nvme", folder, pipeline=pipeline)
        swapper = engine.optimizer.swapper
        assert len(swapper.groups) >= 3, "sub_group_size 300 cuts the masters into several groups"
        got = train(engine, data)
        case = f"stage {stage}, pipeline {pipeline}"
        assert got == expected[0], f"{case}: losses {got} vs {expected[0]}"
        assert_same(shards(engine), expected[1], f"{case}: parameters")
        assert_same(adam_state(engine), expected[2], f"{case}: masters and Adam state")
        # Between steps no master or state tensor holds memory: each is a swapped sentinel.
        for master in engine.optimizer.masters.values():
            assert swapper.holds(master) and torch.isnan(master[:1]).all()
            state = engine.optimizer.optimizer.state[master].values()
            assert all(swapper.holds(t) for t in state if torch.is_tensor(t) and t.dim() > 0)
        assert swapper.pool.free == len(swapper.pool._buffers), "every buffer is back in the pool"
        # offload_states has nothing of the swapped states to move; the rest moves and returns.
        engine.offload_states()
        engine.reload_states()
        assert train(engine, more) == expected_after, f"{case}: after offload_states / reload_states"
        check_fragment_setter(engine, stage)
        mine = swapper.store.folder.parent
        assert mine.parent == folder / "zero_swap" and list(mine.rglob("group*.swp"))
        swapper.close()
        assert not mine.exists(), "closing removes the scratch files"


def check_fragment_setter(engine, stage):
    """`safe_set_full_fp32_param` writes the swapped master, the training-dtype shard (and at
    stages 1-2 the whole replicated parameter) through resident(); `safe_get_full_fp32_param`
    reads it back. At stages 1-2 the setter's re-gather of the replicated parameter once raised
    AttributeError ('ReplicatedShard' object has no attribute 'qwz')."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    swapper = engine.optimizer.swapper
    for i, param in enumerate(engine.module.parameters()):
        shape = param.ds_shape if stage == 3 else param.shape
        value = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) / 1024 + i
        safe_set_full_fp32_param(param, value)
        assert torch.equal(safe_get_full_fp32_param(param), value), f"stage {stage}: parameter {i}"
        if stage == 3:
            mine = value.reshape(-1)[dist.get_rank() * param.ds_tensor.numel() :][: param.ds_tensor.numel()]
            assert torch.equal(param.ds_tensor[: mine.numel()], mine), f"stage {stage}: shard {i}"
        else:
            assert torch.equal(param.data, value), f"stage {stage}: replicated parameter {i}"
    assert all(swapper.holds(m) for m in engine.optimizer.masters.values())


class TestNvmeOptimizerParity(DistributedTest):
    world_size = 2

    def test_stages_and_pipelines(self, tmp_path):
        check_parity(tmp_path, CASES)

    def test_other_torch_optimizer_and_bf16(self, tmp_path):
        # SGD with momentum: its per-element state (momentum_buffer) is learnt by the probe and swapped.
        data = batches(2)
        runs = []
        for device in ("cpu", "nvme"):
            folder = swap_folder(tmp_path) / device
            folder.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(42)
            model = TinyLM()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            off = {"device": device, "nvme_path": str(folder), "buffer_count": 2}
            cfg = config(gas=GAS, clip=0.05, zero_force_ds_cpu_optimizer=False, bf16={"enabled": True})
            cfg["aio"] = {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2}
            cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": off, "sub_group_size": 500}
            del cfg["optimizer"]
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            runs.append((train(engine, data), shards(engine)))
            if device == "nvme":
                swapper = engine.optimizer.swapper
                assert list(swapper.kinds) == ["fp32_master", "momentum_buffer"]
                for handle in (swapper.store._reads, swapper.store._writes):  # the aio block, acted on
                    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_thread_count()) == (
                        262144,
                        4,
                        2,
                    )
        assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 2 * GAS
        assert runs[0][0] != [] and runs[0][0][0] != runs[0][0][-1]
        assert_same(runs[0][1], runs[1][1], "bf16 SGD parameters")


@pytest.mark.slow
class TestNvmeOptimizerParityGrid(DistributedTest):
    world_size = 2

    def test_other_pipelines(self, tmp_path):
        check_parity(tmp_path, MORE_CASES)


class TestNvmeCheckpoints(DistributedTest):
    world_size = 2

    def test_nvme_to_cpu_to_nvme(self, tmp_path):
        for stage in (2, 3):
            round_trip(tmp_path / f"stage{stage}", stage)


def _mapped_from(tensor, marker: str) -> bool:
    """Whether `tensor`'s memory lies in a mapping of a file whose name holds `marker`."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return len(fields) > 5 and marker in fields[5]
    return False


class streamed:
    """A save or load of `engine` in which reading every swapped tensor into memory raises: a
    checkpoint of swapped state goes a group at a time, its copies in scratch files."""

    def __init__(self, engine):
        self.swapper, self.copies = engine.optimizer.swapper, []

    def __enter__(self):
        def refuse():
            raise AssertionError("a checkpoint read every swapped tensor into memory (resident())")

        made = self.swapper.store.scratch_tensor

        def recording(numel, dtype):
            tensor = made(numel, dtype)
            self.copies.append(_mapped_from(tensor, "scratch-"))
            return tensor

        self.swapper.resident, self.swapper.store.scratch_tensor = refuse, recording
        return self

    def __exit__(self, *exc):
        del self.swapper.resident, self.swapper.store.scratch_tensor


def round_trip(tmp_path, stage):
    data = batches(3)
    reference = build(stage, "cpu")
    expected = train(reference, data)
    ckpt = tmp_path / "ckpt"
    nvme = swap_folder(tmp_path)
    (nvme / "a").mkdir(parents=True, exist_ok=True)
    first = build(stage, "nvme", nvme / "a")
    # Upstream's queries: the step runs on the CPU, though the state is not in CPU memory.
    assert first.zero_use_cpu_optimizer() and not first.zero_cpu_offload()
    losses = train(first, data[:1])
    with streamed(first) as save:
        first.save_checkpoint(str(ckpt), tag="one")
    assert save.copies and all(save.copies), "the flat copies are not file-backed"
    assert not list(ckpt.rglob("*.swp")), "swap files are scratch, never part of a checkpoint"
    assert all(first.optimizer.swapper.holds(m) for m in first.optimizer.masters.values())
    second = build(stage, "cpu")
    second.load_checkpoint(str(ckpt), tag="one")
    losses += train(second, data[1:2])
    second.save_checkpoint(str(ckpt), tag="two")
    (nvme / "b").mkdir(exist_ok=True)
    third = build(stage, "nvme", nvme / "b", pipeline=(True, False))
    with streamed(third):
        third.load_checkpoint(str(ckpt), tag="two")
    assert all(third.optimizer.swapper.holds(m) for m in third.optimizer.masters.values())
    losses += train(third, data[2:])
    assert losses == expected, f"{losses} vs {expected}"
    assert_same(adam_state(third), adam_state(reference), "masters and Adam state after the round trip")
    # The fragment helpers read and write the swapped state (through resident()).
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
    )

    for ref, param in zip(reference.module.parameters(), third.module.parameters()):
        assert torch.equal(safe_get_full_fp32_param(param), safe_get_full_fp32_param(ref))
        got = safe_get_full_optimizer_state(param, "exp_avg_sq")
        assert torch.equal(got, safe_get_full_optimizer_state(ref, "exp_avg_sq"))
    assert all(third.optimizer.swapper.holds(m) for m in third.optimizer.masters.values())
    # The optimizer's own state_dict is a copy, the swapped tensors' in scratch files, taken
    # without reading the whole state in; it equals CPU offload's and stays as it was.
    with streamed(third) as copies:
        sd = third.optimizer.state_dict()["optimizer"]["state"]
    assert copies.copies and all(copies.copies)
    expected_sd = reference.optimizer.state_dict()["optimizer"]["state"]
    assert sd.keys() == expected_sd.keys()
    for key, per in sd.items():
        for name, value in per.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected_sd[key][name])), (key, name)
    kept = {key: per["exp_avg"].clone() for key, per in sd.items()}
    train(third, data[:1])
    assert all(torch.equal(sd[key]["exp_avg"], kept[key]) for key in kept), "the copy moved with a step"


class TestNvmeSetupFailures(DistributedTest):
    world_size = 2

    def test_setup_never_holds_every_master(self, tmp_path, monkeypatch):
        """The masters' first values go to their files one sub-group at a time, read from the
        shards: before that, no master holds memory (4 bytes per parameter at once would be
        more than a model that needs NVMe has room for)."""
        import deepspeed.runtime.zero.nvme_optimizer as nvme

        seen = []
        original = nvme.OptimizerSwapper.__init__

        def checking(swapper, optimizer, masters, *args, **kwargs):
            seen.append(all(m.stride() == (0,) for m in masters))
            original(swapper, optimizer, masters, *args, **kwargs)

        monkeypatch.setattr(nvme.OptimizerSwapper, "__init__", checking)
        data = batches(2, seed=3)
        swap_folder(tmp_path).mkdir(exist_ok=True)
        for stage in (2, 3):
            nvme_losses = train(build(stage, "nvme", swap_folder(tmp_path)), data)
            assert nvme_losses == train(build(stage, "cpu"), data)  # the first values were the shards'
        assert seen == [True, True]

    def test_full_disk_on_one_rank_fails_every_rank(self, tmp_path):
        # A real limit, not a patched one: rank 1 may write no file larger than 1 KiB
        # (RLIMIT_FSIZE), so reserving its swap files fails in posix_fallocate with EFBIG.
        folder = swap_folder(tmp_path)
        folder.mkdir(exist_ok=True)
        old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if dist.get_rank() == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, old_limit[1]))
        try:
            with pytest.raises((SwapSpaceError, RuntimeError)) as err:
                build(1, "nvme", folder, sub_group_size=10**9)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        if dist.get_rank() == 1:
            assert isinstance(err.value, SwapSpaceError)
            assert "needs" in str(err.value) and "bytes" in str(err.value) and str(folder) in str(err.value)
        else:
            assert "failed on 1 of 2 rank(s): rank 1: SwapSpaceError" in str(err.value)
        dist.barrier()  # both ranks have cleaned up
        assert not list(folder.rglob("*.swp")), "a failed set-up leaves no swap file on any rank"

    def test_io_error_in_a_step_on_one_rank_fails_every_rank(self, tmp_path):
        import errno

        folder = swap_folder(tmp_path)
        folder.mkdir(exist_ok=True)
        engine = build(2, "nvme", folder, pipeline=(True, True))
        if dist.get_rank() == 1:

            def broken(*args, **kwargs):
                raise OSError(errno.EIO, "Input/output error (injected)")

            engine.optimizer.swapper.store.write = broken
        ids, labels = batches(1)[0]
        for micro in range(GAS):
            engine.backward(engine(my_slice(ids, micro, GAS), my_slice(labels, micro, GAS)))
            if micro < GAS - 1:
                engine.step()
        with pytest.raises((OSError, RuntimeError)) as err:
            engine.step()
        if dist.get_rank() == 1:
            assert "injected" in str(err.value)
        else:
            assert "failed in this step on 1 other rank(s)" in str(err.value)
        assert engine.optimizer.swapper.pool.free == len(engine.optimizer.swapper.pool._buffers)

    def test_config_errors(self, tmp_path):
        folder = swap_folder(tmp_path)
        folder.mkdir(exist_ok=True)
        with pytest.raises(
            ValueError, match=r"buffer_count=4 is too few.*need at least 9; raise buffer_count to 9"
        ):
            build(1, "nvme", folder, pipeline=(True, True), buffer_count=4)
        with pytest.raises(ValueError, match=r"offload_optimizer.device='nvme' needs nvme_path"):
            build(1, "nvme", None)
        with pytest.raises(DeepSpeedConfigError, match=r"aio.single_submit='yes' must be true or false"):
            build(1, "nvme", folder, aio={"single_submit": "yes"})

    def test_each_rank_may_swap_to_its_own_drive(self, tmp_path):
        """nvme_path may differ by rank (one drive per GPU); the rest of the config must agree."""
        mine = tmp_path / f"nvme{dist.get_rank()}"
        mine.mkdir()
        engine = build(2, "nvme", mine)
        train(engine, batches(1))
        assert engine.optimizer.swapper.store.folder.parent.parent == mine / "zero_swap"
        engine.optimizer.swapper.close()
        with pytest.raises(deepspeed.runtime.agreement.RankMismatchError, match="sub_group_size"):
            build(2, "nvme", mine, sub_group_size=300 + dist.get_rank())


def test_aio_block_values_are_checked_by_key():
    assert AioSettings.from_block({"intra_op_parallelism": 3}).thread_count == 3
    assert AioSettings.from_block({"thread_count": 2}).thread_count == 2  # the older name
    assert AioSettings.from_block({"thread_count": 2, "intra_op_parallelism": 2}).thread_count == 2
    assert AioSettings.from_block(None) == AioSettings()
    bad = [
        ({"queue_depth": 1.5}, r"aio.queue_depth=1.5 must be a whole number >= 1"),
        ({"block_size": 0}, r"aio.block_size=0 must be a whole number >= 1"),
        ({"intra_op_parallelism": True}, r"aio.intra_op_parallelism=True must be a whole number"),
        ({"overlap_events": 1}, r"aio.overlap_events=1 must be true or false"),
        ({"thread_count": 1, "intra_op_parallelism": 4}, r"intra_op_parallelism=4 and aio.thread_count=1"),
    ]
    for block, message in bad:
        with pytest.raises(DeepSpeedConfigError, match=message):
            AioSettings.from_block(block)


def test_a_swap_folder_that_cannot_be_made_names_nvme_path(tmp_path):
    (tmp_path / "zero_swap").write_text("a file where the swap folder goes")
    with pytest.raises(FileExistsError, match=r"nvme_path '.*': cannot create the swap folder 'zero_swap'"):
        SwapStore(tmp_path, "optimizer", AioSettings())


def test_buffer_minimum_and_kinds():
    assert minimum_buffer_count(3, False, False) == 3
    assert minimum_buffer_count(3, True, False) == 6
    assert minimum_buffer_count(3, True, True) == 9
    p = torch.nn.Parameter(torch.zeros(4))
    assert [k for k, _ in state_kinds(torch.optim.AdamW([p]))] == ["exp_avg", "exp_avg_sq"]
    assert [k for k, _ in state_kinds(torch.optim.SGD([p], lr=0.1, momentum=0.9))] == ["momentum_buffer"]
    assert state_kinds(torch.optim.SGD([p], lr=0.1)) == []


def test_disk_too_small_is_named_with_the_total(tmp_path, monkeypatch):
    import shutil

    store = SwapStore(tmp_path, "optimizer", AioSettings())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10_000))
    with pytest.raises(SwapSpaceError, match=r"needs 12288 more bytes under .* but the disk has 10000 free"):
        store.reserve_many({"a": 4096, "b": 4096, "c": 1})
    assert not list(tmp_path.rglob("*.swp")), "nothing is reserved when the whole amount does not fit"
    store.close()


class ViewMomentumSGD(torch.optim.Optimizer):
    """Momentum SGD whose momentum buffer is a view into a larger tensor (as huge_page_zeros
    once returned Adam's states); `bases` has a weak reference to each such tensor."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.bases = []

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    base = torch.zeros(p.numel() + 16)
                    self.bases.append(weakref.ref(base))
                    state["momentum"] = base[16:].view(p.shape)
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


@pytest.mark.parametrize("pipeline", [(False, False), (True, True)])
def test_a_swapped_out_state_keeps_no_memory_even_as_a_view(tmp_path, pipeline):
    """After a step every state tensor the optimizer made is free: a view's base (its whole
    first-step buffer) must not outlive the swap-out, or NVMe offload holds the state twice."""
    masters = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 700, 1500)]
    plain = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    opt, ref = ViewMomentumSGD(masters), ViewMomentumSGD(plain)
    assert [k for k, _ in state_kinds(opt)] == ["momentum"]
    offload = types.SimpleNamespace(
        nvme_path=str(tmp_path), pipeline_read=pipeline[0], pipeline_write=pipeline[1], buffer_count=6
    )
    swapper = OptimizerSwapper(opt, masters, offload, 1200, AioSettings(), "optimizer")
    try:
        for step in range(3):
            for m, p in zip(masters, plain):
                m.grad = p.grad = torch.full_like(p, 0.01 * (step + 1))
            assert swapper.step(lambda group: step_only(opt, group)) is None
            ref.step()
            gc.collect()
            assert len(opt.bases) == 3 and all(base() is None for base in opt.bases), (
                "a state's old buffer is alive"
            )
            assert all(swapper.holds(opt.state[m]["momentum"]) for m in masters)
        with swapper.resident():
            for m, p in zip(masters, plain):
                assert torch.equal(m.detach(), p.detach())
                assert torch.equal(opt.state[m]["momentum"], ref.state[p]["momentum"])
    finally:
        swapper.close()


def test_scratch_tensor_is_a_reserved_unlinked_file(tmp_path, monkeypatch):
    import errno
    import os

    store = SwapStore(tmp_path, "optimizer", AioSettings())
    try:
        t = store.scratch_tensor(3000, torch.float32)
        t.copy_(torch.arange(3000.0))
        assert _mapped_from(t, "scratch-") and t.sum().item() == sum(range(3000))
        assert not list(store.folder.iterdir()), "the scratch file is unlinked at once"

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(SwapSpaceError, match=r"needs 4000 more bytes under"):
            store.scratch_tensor(1000, torch.float32)
        assert not list(store.folder.iterdir())
    finally:
        store.close()
