"""Per-process state has one owner ([Note: what is per process] in deepspeed/process_state.py)."""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import importlib
import pathlib
import threading
import types
import weakref

import pytest

import deepspeed
from deepspeed import process_state

PACKAGE_ROOT = pathlib.Path(deepspeed.__file__).parent

# Types whose instances change in place: a module-level one is per-process state.
MUTABLE_TYPES = (
    dict,
    list,
    set,
    bytearray,
    collections.deque,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
    threading.local,
)

# Module-level names whose mutable type is upstream DeepSpeed's public API (client code may
# read them as lists or dicts, and some appear in error messages); nothing here writes them.
UPSTREAM_TABLES = {
    "deepspeed.ops.op_builder.ALL_OPS",
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "deepspeed.runtime.lr_schedules.VALID_WARMUP_TYPES",
    "deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape",
    "deepspeed.runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_CLASSES",
    "deepspeed.runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_NAMES",
    "deepspeed.runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
}


def _module_names() -> list:
    names = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = ("deepspeed",) + path.relative_to(PACKAGE_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _assigned_names(statements: list) -> list:
    """Names a module binds with `=` / `: T =` at its top level (under `if` / `try` too)."""
    names = []
    for node in statements:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for field in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, field):
                names += _assigned_names(getattr(node, field))
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                names += _assigned_names(handler.body)
    return names


def _is_state(value: object) -> bool:
    """A container that changes in place, or an instance of one of our classes that holds
    attributes (a holder; one with none is a token, such as an owner of holds)."""
    if isinstance(value, MUTABLE_TYPES):
        return True
    if isinstance(value, (type, types.ModuleType, types.FunctionType, enum.Enum, BaseException)):
        return False
    has_fields = bool(getattr(value, "__dict__", None)) or bool(getattr(type(value), "__slots__", ()))
    return type(value).__module__.startswith("deepspeed.") and has_fields


def test_every_module_level_state_is_registered_or_a_constant():
    scanned = [n for n in _module_names() if n != process_state.__name__]
    modules = [importlib.import_module(name) for name in scanned]  # each registers at import
    registered = {id(entry.obj) for entry in process_state.owned()}
    unowned = []
    for name, module in zip(scanned, modules):
        source = pathlib.Path(module.__file__).read_text()
        for attr in sorted(set(_assigned_names(ast.parse(source).body))):
            value = getattr(module, attr, None)
            qualified = f"{name}.{attr}"
            if attr == "__all__" or qualified in UPSTREAM_TABLES or id(value) in registered:
                continue
            if _is_state(value):
                unowned.append(f"{qualified} ({type(value).__name__})")
    assert not unowned, (
        "module-level state that deepspeed.process_state does not list; register it there "
        "(process_state.register(name, obj, reset)) or make it a constant (tuple, frozenset, "
        f"types.MappingProxyType): {unowned}"
    )


def test_reset_puts_registered_state_back():
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.config_utils import CONFIG_WARNINGS
    from deepspeed.runtime.zero.parameter import ACCESS_HOOK
    from deepspeed.utils.logging import logger

    before = logger.level
    try:
        logger.setLevel("CRITICAL")
        CONFIG_WARNINGS.warn("process_state test warning")
        checkpointing.configure(None, partition_activations=True)
        ACCESS_HOOK.push(print)  # as a forward that raised before popping its hook leaves it
        process_state.reset()
        assert logger.level == before
        assert "process_state test warning" not in CONFIG_WARNINGS._seen
        assert not checkpointing.is_configured()
        assert ACCESS_HOOK.hook is None and not ACCESS_HOOK._stack
    finally:
        logger.setLevel(before)
        checkpointing.reset()


def test_owned_lists_each_entry_once_with_its_reset():
    entries = process_state.owned()
    names = [entry.name for entry in entries]
    assert len(names) == len(set(names))
    patches = next(e for e in entries if e.name == "deepspeed.runtime.zero.patching.PATCHES")
    from deepspeed.runtime.zero.patching import PATCHES

    assert patches.obj is PATCHES and patches.reset == PATCHES.remove_all
    with pytest.raises(dataclasses.FrozenInstanceError):
        patches.name = "renamed"
