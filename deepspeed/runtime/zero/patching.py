"""All of ZeRO-3's monkey-patching, in one place, and every patch undoes itself.

While a `zero.Init` is active, four kinds of patch are in force:
- every `nn.Module` subclass's own `__init__` is wrapped, so that when the most-derived
  `__init__` of a module returns, a hook converts that module's own parameters;
  `nn.Module.__init_subclass__` wraps classes defined while the patch is in force;
- `nn.Module.apply` is replaced by a hook (Init gathers each module around the function),
  unless the innermost Init's config says ``override_module_apply: false``;
- `nn.Module.to_empty` runs the same hook as a finished `__init__` on every submodule once
  it returns: a module built on the meta device (`torch.nn.utils.skip_init`) has no values
  to partition until then, and is partitioned there, as one built in place would be;
- tensor factories (`torch.empty`, `zeros`, ...) are replaced by wrapped originals that
  default the device and cast floating results to the Init dtype.

`ModulePatches.install()` / `remove()` own the first three, `bind_factories()` /
`unbind_factories()` the fourth; `remove_all()` undoes everything and is what `Init` calls on
every exit path. The originals are module constants (`_orig_torch_empty`, ...), which
`partition_parameters` re-exports under the names HF transformers reads.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable, Optional

import torch
from torch import nn

from deepspeed import process_state

FACTORY_NAMES = ("empty", "zeros", "ones", "full", "arange", "eye", "randn", "tensor")

# The originals, captured once at import (before any Init can have patched them).
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_orig_torch_tensor = torch.tensor
ORIGINAL_FACTORIES = types.MappingProxyType(
    {name: globals()[f"_orig_torch_{name}"] for name in FACTORY_NAMES}
)
_orig_module_apply = nn.Module.apply
_orig_module_to_empty = nn.Module.to_empty


def _local_device_name() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable, target_fp_dtype: torch.dtype, target_device: Optional[torch.device] = None
) -> Callable:
    """Wrap a tensor factory: default to `target_device`, cast floating results to the Init dtype.

    Integer and boolean results keep their dtype. `partition_parameters` looks this up by name
    each time an Init starts, so a client may swap it (HF transformers does, and reads
    `target_device` from the keyword arguments it receives). `target_device=None`: the local
    accelerator device at call time.
    """

    @functools.wraps(fn)
    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else _local_device_name()
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def _all_module_subclasses() -> list:
    found, stack = {}, [nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if id(sub) not in found:
                found[id(sub)] = sub
                stack.append(sub)
    return list(found.values())


class ModulePatches:
    """Wraps module `__init__`s, `Module.apply` and `Module.to_empty` while installed; `remove()` restores them all."""

    installed: bool
    _originals: dict  # class -> its own original __init__
    _depth: dict  # id(module) -> how many wrapped __init__ frames of it are running

    def __init__(self) -> None:
        self.installed = False
        self._originals = {}
        self._depth = {}
        self._on_built: Optional[Callable] = None
        self._had_init_subclass = False
        self._orig_init_subclass = None

    def install(self, on_module_built: Callable, apply_hook: Optional[Callable]) -> None:
        """Patch every module class; `on_module_built(module)` runs after its outermost __init__.

        `apply_hook` replaces `nn.Module.apply`; None leaves it alone (see `set_apply_hook`).
        """
        assert not self.installed, "module patches are already installed"
        self._on_built = on_module_built
        self.installed = True  # set first: remove() must undo a half-done install
        for cls in _all_module_subclasses():
            self._wrap_class(cls)
        self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        self._orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        patches = self

        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patches._wrap_class(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        nn.Module.to_empty = self._make_to_empty()
        self.set_apply_hook(apply_hook)

    def set_apply_hook(self, apply_hook: Optional[Callable]) -> None:
        """Replace `nn.Module.apply` by `apply_hook`, or restore torch's when it is None."""
        assert self.installed, "set_apply_hook() needs the module patches installed"
        nn.Module.apply = apply_hook if apply_hook is not None else _orig_module_apply

    def _wrap_class(self, cls: type) -> None:
        if cls in self._originals:
            return
        own_init = cls.__dict__.get("__init__")
        if own_init is None:
            # Inherits __init__. From a module class, that one is wrapped already; from a
            # non-module mixin (`class M(Mixin, nn.Module)`), wrap it here or M is missed.
            provider = next(k for k in cls.__mro__ if "__init__" in k.__dict__)
            if issubclass(provider, nn.Module) or provider is object:
                return
            own_init = provider.__dict__["__init__"]
            self._originals[cls] = None  # None: delete our attribute on removal
        else:
            self._originals[cls] = own_init
        cls.__init__ = self._make_wrapper(own_init)

    def _make_wrapper(self, original: Callable) -> Callable:
        patches = self

        @functools.wraps(original)
        def wrapped_init(module, *args, **kwargs):
            key = id(module)
            outermost = key not in patches._depth
            patches._depth[key] = patches._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                patches._depth[key] -= 1
                if patches._depth[key] == 0:
                    del patches._depth[key]
            if outermost and patches._on_built is not None:
                patches._on_built(module)

        return wrapped_init

    def _make_to_empty(self) -> Callable:
        patches = self

        @functools.wraps(_orig_module_to_empty)
        def to_empty(module, *args, **kwargs):
            result = _orig_module_to_empty(module, *args, **kwargs)
            if patches._on_built is not None:
                for sub in module.modules():  # the hook converts only what is not converted yet
                    patches._on_built(sub)
            return result

        return to_empty

    def remove(self) -> None:
        if not self.installed:
            return
        for cls, original in self._originals.items():
            if original is None:
                del cls.__init__
            else:
                cls.__init__ = original
        self._originals.clear()
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._orig_init_subclass
        elif "__init_subclass__" in nn.Module.__dict__:
            del nn.Module.__init_subclass__
        nn.Module.apply = _orig_module_apply
        nn.Module.to_empty = _orig_module_to_empty
        self._on_built = None
        self.installed = False


def _accepts_keyword(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class FactoryPatches:
    """Replaces `torch.<factory>` by wrapped originals; `unbind()` puts the originals back."""

    bound_dtype: Optional[torch.dtype]

    def __init__(self) -> None:
        self.bound_dtype = None

    def bind(self, wrapper: Callable, dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        """(Re)bind every factory to `wrapper(original, dtype, target_device=device)`.

        Always wraps the originals. A client wrapper that takes no `target_device` keyword
        (an older two-argument signature) is called as `wrapper(original, dtype)`.
        """
        takes_device = device is not None and _accepts_keyword(wrapper, "target_device")
        for name, original in ORIGINAL_FACTORIES.items():
            bound = (
                wrapper(original, dtype, target_device=device) if takes_device else wrapper(original, dtype)
            )
            setattr(torch, name, bound)
        self.bound_dtype = dtype

    def unbind(self) -> None:
        for name, original in ORIGINAL_FACTORIES.items():
            setattr(torch, name, original)
        self.bound_dtype = None


class Patches:
    """The one owner of all patch state (STYLE 6); `remove_all()` doubles as the test reset."""

    def __init__(self) -> None:
        self.modules = ModulePatches()
        self.factories = FactoryPatches()

    def remove_all(self) -> None:
        try:
            self.modules.remove()
        finally:
            self.factories.unbind()


PATCHES = Patches()
process_state.register("deepspeed.runtime.zero.patching.PATCHES", PATCHES, PATCHES.remove_all)


def originals_in_place() -> bool:
    """True when no ZeRO patch is in force (used by tests and `live_contexts` debugging)."""
    factories_ok = all(getattr(torch, n) is f for n, f in ORIGINAL_FACTORIES.items())
    modules_ok = nn.Module.apply is _orig_module_apply and nn.Module.to_empty is _orig_module_to_empty
    return factories_ok and modules_ok and not PATCHES.modules.installed
