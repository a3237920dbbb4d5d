"""ZeRO-3 leaf modules: a subtree whose parameters are fetched and released as one unit.

[Note: leaf modules]
Some modules decide at run time which children they call: a mixture-of-experts block runs
only the experts its router picked, and different ranks pick different ones. Per-child
gathering would then issue different collectives on different ranks and hang. Marking the
block a *leaf* makes the engine gather every parameter of its subtree when the block's
forward (or backward) starts and release them when it ends; its descendants get no gathers
of their own. The flag is the module attribute `_z3_leaf`, as upstream. Upstream reads it
once, when the engine is built; ours re-reads it at the start of every forward pass, so a
module marked after `deepspeed.initialize` takes effect from the next pass (mark between
passes, never inside one).
"""

from __future__ import annotations

from typing import Union

from torch import nn

_FLAG = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is marked as a ZeRO-3 leaf module."""
    return bool(getattr(model, _FLAG, False))


def z3_leaf_parameter(param) -> bool:
    """Whether `param` belongs to a leaf module (set on parameters as modules are marked)."""
    return bool(getattr(param, "ds_z3_leaf_module", None))


def get_z3_leaf_modules(model: nn.Module) -> list:
    """Every module of `model` (itself included) that is marked as a leaf, in `modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) `model` itself as a leaf module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_z3_leaf_module: model must be an nn.Module, got {type(model).__name__}")
    if flag:
        setattr(model, _FLAG, True)
    elif _FLAG in model.__dict__:
        delattr(model, _FLAG)


def _matches(module: nn.Module, classes: list) -> bool:
    for cls in classes:
        if isinstance(cls, str):
            if type(module).__name__ == cls:
                return True
        elif isinstance(module, cls):
            return True
    return False


def _set_flags(model: nn.Module, leaf_module_classes: list, flag: bool, raise_if_not_found: bool) -> list:
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_z3_leaf_modules: model must be an nn.Module, got {type(model).__name__}")
    classes = list(leaf_module_classes)
    for cls in classes:
        if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
            raise TypeError(
                f"leaf_module_classes entries must be nn.Module subclasses or class names, got {cls!r}"
            )
    matched = [m for m in model.modules() if _matches(m, classes)]
    if not matched and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of {type(model).__name__} is an instance of {names}")
    for module in matched:
        set_z3_leaf_module(module, flag)
        for p in module.parameters():
            if flag:
                p.ds_z3_leaf_module = module
            elif hasattr(p, "ds_z3_leaf_module"):
                del p.ds_z3_leaf_module
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[Union[type, str]], raise_if_not_found: bool = True
) -> list:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` (classes,
    or class names as strings) as a leaf; returns the marked modules. See the module note."""
    return _set_flags(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[Union[type, str]], raise_if_not_found: bool = True
) -> list:
    """Undo `set_z3_leaf_modules` for these classes; returns the unmarked modules."""
    return _set_flags(model, leaf_module_classes, False, raise_if_not_found)
