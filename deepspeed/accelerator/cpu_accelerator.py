"""The CPU accelerator: gloo, synchronous execution, host memory read through psutil.

[Note: CPU memory statistics]
There is no device allocator on the CPU, so "allocated", "reserved" and "cached" all report
this process's resident set size. The peak is the largest RSS this object has observed
(every memory query samples it) since the last reset, not the kernel's lifetime high-water
mark, so that `reset_peak_memory_stats()` means the same as on a GPU.

This module deliberately never refers to the GPU runtime module of torch: it must work on a
torch build without one, and a layering test greps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
from typing import Any, Callable, Optional

import psutil
import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

# Environment variables a launcher sets to the number of ranks on this node, in the order read.
LOCAL_SIZE_ENVS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE")


class CPUStream:
    """A stream stand-in: work on the CPU is already ordered, so every method is a no-op."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Optional[CPUEvent] = None) -> CPUEvent:
        event = CPUEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self) -> CPUStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None


class CPUEvent:
    """An event stand-in; `record()` notes the host time so `elapsed_time` is meaningful."""

    _recorded_at: Optional[float]  # time.perf_counter() of the last record(), None before

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._recorded_at = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CPUEvent) -> float:
        """Milliseconds between this event's record() and `end_event`'s."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events to be recorded first; call record() on each")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _local_size_from_env() -> int:
    for name in LOCAL_SIZE_ENVS:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} must be an integer") from None
    return 1


@functools.lru_cache(maxsize=1)
def _glibc_malloc_trim():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (macOS, musl): nothing to trim


class CPU_Accelerator(DeepSpeedAccelerator):
    """Runs everything on the host; one "device" per local rank, all of them `cpu`."""

    _device_index: Optional[int]  # set by set_device(); else LOCAL_RANK
    _peak_rss: int  # bytes, the largest RSS sampled since the last reset

    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self._device_index = None
        self._process = psutil.Process()
        self._peak_rss = 0

    # ------------------------------------------------------------------ device
    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cpu"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        self._device_index = int(device_index)

    def current_device(self) -> int:
        if self._device_index is not None:
            return self._device_index
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """The number of local ranks (`LOCAL_SIZE` / `LOCAL_WORLD_SIZE`), else 1."""
        return _local_size_from_env()

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # ------------------------------------------------------------------ RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # ------------------------------------------------------------------ streams and events
    @property
    def Stream(self) -> type:
        return CPUStream

    def stream(self, stream: Any):
        return contextlib.nullcontext(stream)

    def current_stream(self, device_index: Optional[int] = None) -> CPUStream:
        return CPUStream()

    def default_stream(self, device_index: Optional[int] = None) -> CPUStream:
        return CPUStream()

    @property
    def Event(self) -> type:
        return CPUEvent

    # ------------------------------------------------------------------ memory (see the note above)
    def _sample_rss(self) -> int:
        rss = self._process.memory_info().rss
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def empty_cache(self) -> None:
        """Hand freed heap memory back to the OS (glibc `malloc_trim`); a no-op elsewhere.

        glibc keeps freed blocks below long-lived ones on its heap, so building a model
        layer by layer under zero.Init can hold on to several freed full layers; trimming
        after each large release keeps the peak near shards plus one layer.
        """
        trim = _glibc_malloc_trim()
        if trim is not None:
            trim(0)

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return self._sample_rss()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        self._sample_rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: Optional[int] = None) -> int:
        return self._sample_rss()

    def max_memory_cached(self, device_index: Optional[int] = None) -> int:
        return self.max_memory_allocated(device_index)

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        current = self._sample_rss()
        peak = self._peak_rss
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
        }

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        self._peak_rss = 0
        self._sample_rss()

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return self._sample_rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return self.max_memory_allocated(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: Optional[int] = None) -> int:
        return int(psutil.virtual_memory().available)

    # ------------------------------------------------------------------ profiling and misc
    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        callback()  # nothing to initialize lazily on the host

    # ------------------------------------------------------------------ dtypes
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether this CPU computes fp16 natively (oneDNN's check: AVX512-FP16 or AMX-FP16), as
        upstream answers; clients pick bf16 over fp16 on its answer. fp16 training still runs
        elsewhere (torch emulates the ops), only slowly."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def is_triton_supported(self) -> bool:
        return False

    # ------------------------------------------------------------------ tensors
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # page-locking needs a GPU runtime; host memory is used as it is

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    # ------------------------------------------------------------------ graphs (none on the CPU)
    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None):
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    # ------------------------------------------------------------------ launcher environment
    def visible_devices_envs(self) -> list[str]:
        return []

    def export_envs(self) -> list[str]:
        return ["OMP", "MKL", "KMP"]

    # ------------------------------------------------------------------ legacy tensor types
    @property
    def BFloat16Tensor(self) -> type:
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> type:
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> type:
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> type:
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> type:
        return torch.HalfTensor

    @property
    def IntTensor(self) -> type:
        return torch.IntTensor

    @property
    def LongTensor(self) -> type:
        return torch.LongTensor
