"""The accelerator: selection through DS_ACCELERATOR, the singleton, and the CPU methods."""

import inspect

import pytest
import torch

import deepspeed.accelerator as accelerator_pkg
from deepspeed.accelerator import (
    DeepSpeedAccelerator,
    cpu_accelerator,
    cuda_accelerator,
    get_accelerator,
    reset_accelerator,
    set_accelerator,
)
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator


@pytest.fixture(autouse=True)
def fresh_accelerator(monkeypatch):
    """Each test selects from scratch and leaves the next one a fresh choice."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    reset_accelerator()
    yield
    reset_accelerator()


@pytest.fixture
def cpu():
    return CPU_Accelerator()


def no_cuda(monkeypatch):
    monkeypatch.setattr(cuda_accelerator, "cuda_is_available", lambda: False)


# ----------------------------------------------------------------------------- selection


def test_env_selects_cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert isinstance(acc, CPU_Accelerator)
    assert acc._name == "cpu"


def test_auto_detect_without_cuda_is_cpu(monkeypatch):
    no_cuda(monkeypatch)
    assert isinstance(get_accelerator(), CPU_Accelerator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_detect_with_cuda_is_cuda():
    assert isinstance(get_accelerator(), CUDA_Accelerator)


def test_invalid_env_value_names_value_and_choices(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='tpu'.*'cpu', 'cuda'"):
        get_accelerator()


def test_cuda_requested_but_unavailable(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    no_cuda(monkeypatch)
    with pytest.raises(RuntimeError, match="DS_ACCELERATOR=cuda was requested but CUDA is not available"):
        get_accelerator()


def test_empty_env_value_means_detect(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "")
    no_cuda(monkeypatch)
    assert isinstance(get_accelerator(), CPU_Accelerator)


def test_singleton_set_and_reset(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    first = get_accelerator()
    assert get_accelerator() is first

    class MyAccelerator(CPU_Accelerator):
        pass

    mine = MyAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    reset_accelerator()
    assert get_accelerator() is not mine
    assert accelerator_pkg.is_current_accelerator_supported()


def test_set_accelerator_rejects_other_objects():
    with pytest.raises(TypeError, match="DeepSpeedAccelerator instance, got str"):
        set_accelerator("cpu")


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        DeepSpeedAccelerator()


# ----------------------------------------------------------------------------- the CPU accelerator


def test_cpu_module_never_touches_cuda():
    source = inspect.getsource(cpu_accelerator)
    assert "torch.cuda" not in source
    assert "cuda" not in source.lower()


def test_cpu_device_methods(cpu, monkeypatch):
    assert cpu.current_device_name() == "cpu"
    assert cpu.device_name() == cpu.device_name(3) == "cpu"
    assert cpu.device(1) == torch.device("cpu")
    assert cpu.communication_backend_name() == cpu._communication_backend_name == "gloo"
    assert cpu.is_available()
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    cpu.synchronize()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cpu.current_device() == 1
    cpu.set_device(0)
    assert cpu.current_device() == 0


def test_cpu_device_count_reads_local_size(cpu, monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert cpu.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_SIZE='four'"):
        cpu.device_count()


def test_cpu_dtypes(cpu):
    assert cpu.is_bf16_supported()
    native_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # upstream's criterion
    assert cpu.is_fp16_supported() is native_fp16
    assert (torch.float16 in cpu.supported_dtypes()) is native_fp16
    assert torch.bfloat16 in cpu.supported_dtypes() and torch.float32 in cpu.supported_dtypes()
    assert not cpu.is_triton_supported()
    assert cpu.amp() is torch.amp


def test_cpu_rng(cpu):
    cpu.manual_seed(123)
    assert cpu.initial_seed() == 123
    state = cpu.get_rng_state()
    first = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    cpu.manual_seed_all(7)
    assert cpu.default_generator(0).initial_seed() == 7
    assert cpu.random() is torch.random


def test_cpu_streams_and_events_are_usable_no_ops(cpu):
    stream = cpu.Stream()
    with cpu.stream(stream):
        x = torch.ones(2) * 2
    with stream:
        pass
    stream.wait_stream(cpu.current_stream())
    stream.synchronize()
    assert stream.query() and cpu.default_stream().query()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    end.record(stream)
    end.wait()
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="recorded"):
        cpu.Event().elapsed_time(end)
    assert isinstance(stream.record_event(), cpu.Event)
    assert torch.equal(x, torch.full((2,), 2.0))


def test_cpu_memory_stats_are_ints(cpu):
    for method in ("memory_allocated", "max_memory_allocated", "memory_cached", "max_memory_cached"):
        value = getattr(cpu, method)()
        assert isinstance(value, int) and value > 0, method
    assert cpu.memory_reserved() > 0 and cpu.max_memory_reserved() >= cpu.memory_reserved() // 2
    assert cpu.max_memory_allocated() >= cpu.memory_allocated() // 2
    cpu.reset_peak_memory_stats()
    cpu.reset_max_memory_allocated()
    cpu.reset_max_memory_cached()
    stats = cpu.memory_stats()
    assert all(isinstance(v, int) for v in stats.values())
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    assert cpu.total_memory() >= cpu.available_memory() > 0
    cpu.empty_cache()


def test_cpu_peak_tracks_growth_since_reset(cpu):
    cpu.reset_peak_memory_stats()
    before = cpu.max_memory_allocated()
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
    assert cpu.max_memory_allocated() > before
    del big


def test_cpu_tensor_helpers(cpu):
    t = torch.zeros(4)
    assert cpu.pin_memory(t) is t
    assert cpu.pin_memory(t, align_bytes=64) is t
    assert not cpu.is_pinned(t)
    assert cpu.on_accelerator(t)
    assert cpu.FloatTensor is torch.FloatTensor and cpu.BFloat16Tensor is torch.BFloat16Tensor


def test_cpu_misc(cpu):
    cpu.range_push("region")
    cpu.range_pop()
    calls = []
    cpu.lazy_call(lambda: calls.append(1))
    assert calls == [1]
    assert cpu.get_compile_backend() == "inductor"
    assert cpu.op_builder_dir() == "deepspeed.ops.op_builder"
    assert cpu.visible_devices_envs() == []
    env = {}
    cpu.set_visible_devices_envs(env, [0, 1])
    assert env == {}
    assert isinstance(cpu.export_envs(), list)
    with cpu.capture_to_graph(cpu.create_graph()):
        pass
    with pytest.raises(ValueError, match="compile backend 'no-such-backend'"):
        cpu.set_compile_backend("no-such-backend")


# ----------------------------------------------------------------------------- CUDA without a GPU


def test_cuda_accelerator_names_need_no_gpu():
    acc = CUDA_Accelerator()
    assert acc.communication_backend_name() == "nccl"
    assert acc.device_name() == "cuda" and acc.device_name(2) == "cuda:2"
    assert acc.device(1) == torch.device("cuda", 1)
    assert not acc.is_synchronized_device() and not acc.use_host_timers()
    assert acc.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env = {}
    acc.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_accelerator_on_a_gpu():
    acc = CUDA_Accelerator()
    acc.set_device(0)
    assert acc.current_device_name() == "cuda:0"
    assert acc.device_count() >= 1
    x = torch.ones(1024, device=acc.current_device_name())
    stream = acc.Stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    with acc.stream(stream):
        start.record()
        y = x * 2
        end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0.0
    assert torch.equal(y.cpu(), torch.full((1024,), 2.0))
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() >= acc.available_memory() > 0
    pinned = acc.pin_memory(torch.zeros(8))
    assert acc.is_pinned(pinned) and acc.on_accelerator(x) and not acc.on_accelerator(pinned)
