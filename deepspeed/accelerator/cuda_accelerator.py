"""The CUDA accelerator: nccl, asynchronous streams, the caching allocator's statistics.

Together with `real_accelerator.py` this is the only code in `deepspeed/` that touches
`torch.cuda`; everything else asks `get_accelerator()`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


def cuda_is_available() -> bool:
    return torch.cuda.is_available()


class CUDA_Accelerator(DeepSpeedAccelerator):
    """One device per local rank, `cuda:<local_rank>`."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl"

    # ------------------------------------------------------------------ device
    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    # ------------------------------------------------------------------ RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.cuda.set_rng_state(new_state, self.device_name(device_index))

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device_name(device_index))

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ------------------------------------------------------------------ streams and events
    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    def stream(self, stream: Any):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    # ------------------------------------------------------------------ memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        # torch's own reset_max_memory_allocated is deprecated and resets every peak anyway.
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: Optional[int] = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        free, _total = torch.cuda.mem_get_info(index)
        return free

    # ------------------------------------------------------------------ profiling and misc
    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        torch.cuda._lazy_call(callback)

    # ------------------------------------------------------------------ dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        major, _minor = torch.cuda.get_device_capability()
        return major >= 6

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_triton_supported(self) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        return major >= 8

    # ------------------------------------------------------------------ tensors
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    # ------------------------------------------------------------------ graphs
    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ------------------------------------------------------------------ launcher environment
    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    # ------------------------------------------------------------------ legacy tensor types
    @property
    def BFloat16Tensor(self) -> type:
        return torch.cuda.BFloat16Tensor

    @property
    def ByteTensor(self) -> type:
        return torch.cuda.ByteTensor

    @property
    def DoubleTensor(self) -> type:
        return torch.cuda.DoubleTensor

    @property
    def FloatTensor(self) -> type:
        return torch.cuda.FloatTensor

    @property
    def HalfTensor(self) -> type:
        return torch.cuda.HalfTensor

    @property
    def IntTensor(self) -> type:
        return torch.cuda.IntTensor

    @property
    def LongTensor(self) -> type:
        return torch.cuda.LongTensor
