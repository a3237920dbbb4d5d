"""`OnDevice`: build a module's tensors on one device and in one floating dtype (upstream's API).

    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()          # every parameter a float16 meta tensor: no memory

While it is active, `torch.empty`, `torch.zeros`, `torch.ones` and `torch.full` (what
`nn.Module` constructors allocate through) create their tensor on `device` unless the call
names one, and a floating-point result is cast to `dtype`, even where the call named another
floating dtype: the behaviour upstream's class documents and clients rely on. Other factories
(`randn`, `arange`) are left alone, as upstream leaves them. It is a `TorchFunctionMode`, so
nothing in `torch` is patched and the mode ends with the block even when it raises;
`enabled=False` makes it a no-op.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = frozenset([torch.empty, torch.zeros, torch.ones, torch.full])


class _OnDeviceMode(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype, device: Union[str, torch.device]) -> None:
        super().__init__()
        self.dtype = dtype
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        tensor = func(*args, **kwargs)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor


class OnDevice:
    """Create tensors on `device`, floating ones in `dtype` (see the module note)."""

    def __init__(
        self, dtype: torch.dtype, device: Union[str, torch.device] = "meta", enabled: bool = True
    ) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"OnDevice: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)  # a bad device string fails here, not inside the model
        self.enabled = enabled
        self._mode: Any = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            if self._mode is not None:
                raise RuntimeError("OnDevice: this context is already active; use a new OnDevice to nest")
            self._mode = _OnDeviceMode(self.dtype, self.device)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)
