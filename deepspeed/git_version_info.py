"""Build facts upstream's tests and tools read: version, git revision, native ops, torch.

`git_hash` / `git_branch` come from a `git_version_info_installed.py` written at install
time when one exists, else from the `.git` directory of the checkout this package is
imported from (read as files: no subprocess), else "unknown".

`installed_ops[name]`: the op is built and loads without compiling (ours compile on first
use, just in time, and cache the result; nothing is prebuilt into the wheel).
`compatible_ops[name]`: it can be built here (a compiler, ninja and its sources exist).
Both, and `torch_info`, are computed on first access: asking the builders costs an import
of `torch.utils.cpp_extension`, which `import deepspeed` must not pay.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

from deepspeed.version import __version__

version = __version__

_UNKNOWN = "unknown"


def _git_dir() -> Optional[Path]:
    for parent in Path(__file__).resolve().parents:
        candidate = parent / ".git"
        if candidate.is_dir():
            return candidate
        if candidate.is_file():  # a worktree: "gitdir: <path>"
            text = candidate.read_text().strip()
            if text.startswith("gitdir:"):
                return (parent / text.split(":", 1)[1].strip()).resolve()
    return None


def _ref_hash(git_dir: Path, ref: str) -> Optional[str]:
    for base in (git_dir, _common_dir(git_dir)):
        loose = base / ref
        if loose.is_file():
            return loose.read_text().strip()
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref) and not line.startswith(("#", "^")):
                    return line.split(" ", 1)[0]
    return None


def _common_dir(git_dir: Path) -> Path:
    common = git_dir / "commondir"
    return (git_dir / common.read_text().strip()).resolve() if common.is_file() else git_dir


def _from_checkout() -> tuple:
    """`(short hash, branch)` of the checkout holding this file, or unknowns."""
    try:
        git_dir = _git_dir()
        if git_dir is None:
            return _UNKNOWN, _UNKNOWN
        head = (git_dir / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            ref = head.split(":", 1)[1].strip()
            full = _ref_hash(git_dir, ref)
            branch = ref.rsplit("refs/heads/", 1)[-1]
        else:
            full, branch = head, _UNKNOWN  # a detached HEAD
        return (full[:7] if full else _UNKNOWN), branch
    except OSError:
        return _UNKNOWN, _UNKNOWN


def _revision() -> tuple:
    try:
        installed = importlib.import_module("deepspeed.git_version_info_installed")
        return installed.git_hash, installed.git_branch
    except ImportError:
        return _from_checkout()


git_hash, git_branch = _revision()

_LAZY_NAMES = ("installed_ops", "compatible_ops", "torch_info", "accelerator_name")


def _ops_facts() -> tuple:
    from deepspeed.ops.op_builder import ALL_OPS

    installed = {name: builder.is_built() for name, builder in ALL_OPS.items()}
    compatible = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
    return installed, compatible


def _torch_info() -> dict:
    import torch

    from deepspeed.accelerator import get_accelerator

    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return {
        "version": major_minor,
        "bf16_support": bool(get_accelerator().is_bf16_supported()),
        "cuda_version": torch.version.cuda or "0.0",
        "nccl_version": "0.0",
        "hip_version": getattr(torch.version, "hip", None) or "0.0",
    }


def __getattr__(name):
    if name in ("installed_ops", "compatible_ops"):
        installed, compatible = _ops_facts()
        globals().update(installed_ops=installed, compatible_ops=compatible)
        return globals()[name]
    if name == "torch_info":
        value = _torch_info()
    elif name == "accelerator_name":
        from deepspeed.accelerator import get_accelerator

        value = get_accelerator()._name
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
