"""ZeRO-3 leaf modules: a subtree whose parameters are fetched and released as one unit.

[Note: leaf modules]
Some modules decide at run time which children they call: a mixture-of-experts block runs
only the experts its router picked, and different ranks pick different ones. Per-child
gathering would then issue different collectives on different ranks and hang. Marking the
block a *leaf* makes the engine gather every parameter of its subtree when the block's
forward (or backward) starts and release them when it ends; its descendants get no gathers
of their own. Its gradients are likewise reduced as one zero-filled unit, at every stage
(runtime/zero/leaf_grads.py), so the experts a rank did not run do not change which
reductions it makes either. The flag is the module attribute `_z3_leaf`, as upstream. Upstream reads it
once, when the engine is built; ours re-reads it at the start of every forward pass, so a
module marked after `deepspeed.initialize` takes effect from the next pass (mark between
passes, never inside one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:  # torch is imported where it is used: `deepspeed.utils` imports this module eagerly
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


def _check_module(model: nn.Module, caller: str) -> None:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) `model` itself as a leaf module."""
    _check_module(model, "set_z3_leaf_module")
    if flag:
        setattr(model, _FLAG, True)
    elif _FLAG in model.__dict__:
        delattr(model, _FLAG)


def _mark(module: nn.Module, flag: bool) -> None:
    """Flag `module` and record it on its parameters (`z3_leaf_parameter`), or undo both."""
    set_z3_leaf_module(module, flag)
    for p in module.parameters():
        if flag:
            p.ds_z3_leaf_module = module
        elif hasattr(p, "ds_z3_leaf_module"):
            del p.ds_z3_leaf_module


def _matches(module: nn.Module, classes: list) -> bool:
    """Whether `module` is an instance of one of `classes`: a class, or a class named by its
    name (`"MixtralSparseMoeBlock"`) or its module path and name (as upstream matches both)."""
    kind = type(module)
    for cls in classes:
        if isinstance(cls, str):
            if cls in (kind.__name__, f"{kind.__module__}.{kind.__qualname__}"):
                return True
        elif isinstance(module, cls):
            return True
    return False


def _set_flags(model: nn.Module, leaf_module_classes: list, flag: bool, raise_if_not_found: bool) -> list:
    from torch import nn

    _check_module(model, "set_z3_leaf_modules")
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
        _mark(module, flag)
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


def _set_flags_where(
    model: nn.Module, keys: list, matches: Callable, flag: bool, raise_if_not_found: bool, caller: str
) -> tuple:
    """Flag the modules whose `named_modules()` name matches one of `keys`; `(modules, missing keys)`."""
    _check_module(model, caller)
    named = list(model.named_modules())
    marked, seen, missing = [], set(), []
    for key in keys:
        hits = [module for name, module in named if matches(name, key)]
        if not hits:
            missing.append(key)
        for module in hits:
            _mark(module, flag)
            if id(module) not in seen:
                seen.add(id(module))
                marked.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"{caller}: no module of {type(model).__name__} matches {missing}")
    return marked, missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list, flag: bool = True, raise_if_not_found: bool = True
) -> tuple:
    """Mark (`flag=False`: unmark) the modules named exactly as in `model.named_modules()`;
    returns `(marked modules, names that matched none)`."""
    return _set_flags_where(
        model, list(module_names), lambda name, key: name == key, flag, raise_if_not_found,
        "set_z3_leaf_modules_by_name",
    )  # fmt: skip


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: list, flag: bool = True, raise_if_not_found: bool = True
) -> tuple:
    """As `set_z3_leaf_modules_by_name`, for every module whose name ends with one of the suffixes."""
    return _set_flags_where(
        model, list(module_name_suffixes), lambda name, key: name.endswith(key), flag, raise_if_not_found,
        "set_z3_leaf_modules_by_suffix",
    )  # fmt: skip


# [Note: leaves by granularity]
# `zero_optimization.stage3_module_granularity_threshold` (upstream's option) marks fine-grained
# modules as leaves, so a block of many small layers is fetched with one gather instead of
# one per layer. A module's granularity is its subtree's parameter count divided by the
# number of layers in it: each parameterized module with no children counts one layer, each
# module above them one more; a container (ModuleList, Sequential, ...) adds none and is never
# a leaf itself, since it may not run as a unit; a module without parameters, a module with
# no children and a subtree over 1e9 parameters are never leaves. From the root down, the
# first module whose granularity is at most the threshold becomes a leaf (its subtree is not
# searched further), as upstream marks them.
_MAX_LEAF_PARAMETERS = 10**9


def _granularities(root: nn.Module) -> dict:
    """id(module) -> granularity (None: never a leaf), per the note above."""
    from torch import nn

    containers = {getattr(nn, name) for name in nn.modules.container.__all__ if hasattr(nn, name)}
    found: dict = {}

    def numel(p) -> int:
        return int(getattr(p, "ds_numel", None) or p.numel())

    def visit(module: nn.Module) -> tuple:
        children = list(module.children())
        own = sum(numel(p) for p in module.parameters(recurse=False))
        if not children:
            found[id(module)] = None
            return (1 if own else 0), own
        layers, params = 0, own
        for child in children:
            child_layers, child_params = visit(child)
            layers, params = layers + child_layers, params + child_params
        if params == 0 or type(module) in containers:
            found[id(module)] = None
            return layers, params
        layers += 1
        found[id(module)] = params // layers if params <= _MAX_LEAF_PARAMETERS else None
        return layers, params

    visit(root)
    return found


def set_z3_leaf_modules_by_granularity(model: nn.Module, threshold: int) -> tuple:
    """Mark `model`'s fine-grained modules as leaves (see the note); `(marked modules, finest
    granularity found or None)`, the latter telling the caller what threshold would mark one."""
    _check_module(model, "set_z3_leaf_modules_by_granularity")
    found = _granularities(model)
    values = [g for g in found.values() if g is not None]
    marked: list = []

    def mark(module: nn.Module) -> None:
        granularity = found.get(id(module))
        if granularity is not None and granularity <= threshold:
            _mark(module, True)
            marked.append(module)
            return
        for child in module.children():
            mark(child)

    if threshold > 0:
        mark(model)
    return marked, (min(values) if values else None)


def apply_leaf_module_config(model: nn.Module, config) -> list:
    """Mark the leaf modules `zero_optimization.leaf_module` names (`DeepSpeedZeroLeafModuleConfig`):
    its classes, names and name suffixes; returns the marked modules. Entries that match
    nothing are fine for the default classes (HF's MoE blocks, absent from most models) and a
    warning otherwise, naming them, as upstream."""
    from deepspeed.utils.logging import logger

    marked = {id(m): m for m in _set_flags(model, list(config.classes), True, raise_if_not_found=False)}
    unmatched = []
    for keys, setter in (
        (config.names, set_z3_leaf_modules_by_name),
        (config.name_suffixes, set_z3_leaf_modules_by_suffix),
    ):
        if keys:
            modules, missing = setter(model, list(keys), raise_if_not_found=False)
            marked.update((id(m), m) for m in modules)
            unmatched.extend(missing)
    if unmatched:
        logger.warning(f"zero_optimization.leaf_module: no module of the model matches {unmatched}")
    if not marked and not config.is_default():
        logger.warning(
            "zero_optimization.leaf_module matched no module of the model; no leaf module is marked"
        )
    return list(marked.values())
