"""Layer rules checked by a test, not by memory (STYLE 4), and the packaging contract."""

import ast
import importlib.metadata
import pathlib
import subprocess
import sys

from packaging.version import Version

import deepspeed

PACKAGE = pathlib.Path(deepspeed.__file__).parent


def _python_files():
    return sorted(PACKAGE.rglob("*.py"))


def _used_modules(path: pathlib.Path):
    """Dotted names the code imports or reads as `torch.x` attributes (docstrings don't count)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
        ):
            yield f"torch.{node.attr}"


def _offenders(prefix: str, allowed_dir: str):
    found = []
    for path in _python_files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(allowed_dir):
            continue
        if any(m == prefix or m.startswith(prefix + ".") for m in _used_modules(path)):
            found.append(rel)
    return found


def test_only_comm_imports_torch_distributed():
    assert _offenders("torch.distributed", "comm/") == []


def test_only_accelerator_touches_torch_cuda():
    assert _offenders("torch.cuda", "accelerator/") == []


def test_distribution_version():
    installed = importlib.metadata.version("deepspeed")
    assert installed == deepspeed.__version__
    assert Version(installed) >= Version("0.19")


def test_import_is_light():
    code = "import sys, deepspeed; print(sorted(m for m in sys.modules if m.startswith('deepspeed')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['deepspeed', 'deepspeed.version']"


def test_client_import_paths():
    from deepspeed.comm import get_rank, init_distributed, is_initialized  # noqa: F401
    from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
        ZeroParamStatus,
        _orig_torch_arange,
        zero_wrapper_for_fp_tensor_constructor,
    )
    from deepspeed.utils import groups, logger  # noqa: F401
    from deepspeed.zero import GatheredParameters, Init, register_external_parameter  # noqa: F401

    assert deepspeed.accelerator.get_accelerator().current_device_name() in ("cpu", "cuda:0")
