"""The checkpoint code reads an engine only through `CheckpointEngine` (deepspeed/checkpoint/interface.py).

Single-process and static: the engine implements every method of the interface, the code in
`deepspeed/checkpoint/` asks an engine for nothing else and never imports the engine, and
upstream's `deepspeed.utils.zero_to_fp32` is the same module as the one in that package.
"""

import ast
import importlib
import inspect
import pathlib

from deepspeed.checkpoint.engine_methods import CheckpointMethods
from deepspeed.checkpoint.interface import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deepspeed" / "checkpoint"
INTERFACE = {n for n, _ in inspect.getmembers(CheckpointEngine, inspect.isfunction) if not n.startswith("_")}


def _attributes_read(path: pathlib.Path, owner: str) -> set:
    """Names read as `<owner>.name` in the file at `path`."""
    tree = ast.parse(path.read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == owner
    }


def test_the_engine_implements_every_interface_method():
    assert INTERFACE, "the interface lists no methods"
    missing = [name for name in sorted(INTERFACE) if not callable(getattr(DeepSpeedEngine, name, None))]
    assert not missing, missing


def test_the_checkpoint_code_asks_an_engine_only_interface_methods():
    for path in sorted(PACKAGE.glob("*.py")):
        extra = _attributes_read(path, "engine") - INTERFACE
        assert not extra, (path.name, sorted(extra))
    own = {name for name, _ in inspect.getmembers(CheckpointMethods, inspect.isfunction)}
    extra = _attributes_read(PACKAGE / "engine_methods.py", "self") - INTERFACE - own
    assert not extra, sorted(extra)


def test_the_checkpoint_code_does_not_import_the_engine():
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("deepspeed.runtime.engine") for n in names), (path.name, node.lineno)


def test_upstreams_zero_to_fp32_path_is_the_same_module():
    upstream = importlib.import_module("deepspeed.utils.zero_to_fp32")
    assert upstream is importlib.import_module("deepspeed.checkpoint.zero_to_fp32")
    assert callable(upstream.get_fp32_state_dict_from_zero_checkpoint) and callable(upstream.main)
