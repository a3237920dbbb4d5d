"""The interface every accelerator implements: devices, RNG, streams, memory, dtypes, env.

Method names follow DeepSpeed's accelerator interface so that client code written against
upstream (`get_accelerator().current_device_name()`, `.pin_memory(t)`, ...) keeps working.
A few methods that do not depend on the device (`random`, `amp`, op builders, the compile
backend) are implemented here once.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, Callable, Optional

import torch


class DeepSpeedAccelerator(abc.ABC):
    """Abstract base of `CPU_Accelerator` and `CUDA_Accelerator`."""

    _name: str  # "cpu" / "cuda"
    _communication_backend_name: str  # "gloo" / "nccl"
    _compile_backend: str

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, backend={self._communication_backend_name!r})"

    # ------------------------------------------------------------------ device
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (no streams to wait on)."""

    # On a synchronized device the host clock times kernels, data dependencies resolve in
    # program order, and memory pressure is the host's: one answer for all three.
    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    @abc.abstractmethod
    def device_name(self, device_index: Optional[int] = None) -> str: ...

    @abc.abstractmethod
    def device(self, device_index: Optional[int] = None) -> torch.device: ...

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def current_device_name(self) -> str: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self, device_index: Optional[int] = None) -> None: ...

    @abc.abstractmethod
    def is_available(self) -> bool: ...

    # ------------------------------------------------------------------ RNG
    def random(self):
        return torch.random

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None: ...

    @abc.abstractmethod
    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None: ...

    @abc.abstractmethod
    def initial_seed(self) -> int: ...

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator: ...

    # ------------------------------------------------------------------ streams and events
    @property
    @abc.abstractmethod
    def Stream(self) -> type: ...

    @abc.abstractmethod
    def stream(self, stream: Any): ...

    @abc.abstractmethod
    def current_stream(self, device_index: Optional[int] = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device_index: Optional[int] = None) -> Any: ...

    @property
    @abc.abstractmethod
    def Event(self) -> type: ...

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def memory_allocated(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None: ...

    @abc.abstractmethod
    def memory_cached(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def max_memory_cached(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None: ...

    @abc.abstractmethod
    def memory_stats(self, device_index: Optional[int] = None) -> dict: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None: ...

    @abc.abstractmethod
    def memory_reserved(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def total_memory(self, device_index: Optional[int] = None) -> int: ...

    @abc.abstractmethod
    def available_memory(self, device_index: Optional[int] = None) -> int: ...

    # ------------------------------------------------------------------ profiling and misc
    @abc.abstractmethod
    def range_push(self, msg: str) -> None: ...

    @abc.abstractmethod
    def range_pop(self) -> None: ...

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> None: ...

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    # ------------------------------------------------------------------ dtypes
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    @abc.abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]: ...

    @abc.abstractmethod
    def is_triton_supported(self) -> bool: ...

    def amp(self):
        """The autocast module (`torch.amp`), or None on a torch without it."""
        return getattr(torch, "amp", None)

    # ------------------------------------------------------------------ tensors
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor: ...

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool: ...

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool: ...

    # ------------------------------------------------------------------ graphs
    @abc.abstractmethod
    def create_graph(self) -> Any: ...

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None): ...

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None: ...

    # ------------------------------------------------------------------ launcher environment
    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        """Write `local_accelerator_ids` into every visible-devices variable of `current_env`."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = value

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a multi-node launcher should forward."""

    # ------------------------------------------------------------------ compile and op builders
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        import torch._dynamo  # heavy: only when a backend is chosen

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"compile backend {backend!r} is not known to torch; choose one of {known}")
        self._compile_backend = backend

    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    def _op_builder_class(self, class_name: str):
        try:
            module = importlib.import_module(self.op_builder_dir())
        except ImportError:
            return None
        return getattr(module, class_name, None)

    def create_op_builder(self, class_name: str):
        """An instance of the named op builder, or None when this build has none."""
        builder = self._op_builder_class(class_name)
        return None if builder is None else builder()

    def get_op_builder(self, class_name: str):
        """The named op builder class, or None when this build has none."""
        return self._op_builder_class(class_name)

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension
