"""Consolidate a sharded ZeRO-3 checkpoint into one fp32 state dict; needs no process group.

    zero_to_fp32 CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization] [--max_shard_size SIZE]
                 [--exclude_frozen_parameters] [--dtype float32|float16|bfloat16] [-d]
                 [--trust_checkpoint]

CHECKPOINT_DIR is the folder given to `engine.save_checkpoint` (it holds `latest` and a
folder per tag; a tag folder itself is accepted too). OUTPUT is either a file name ending
in `.bin`, `.pt`, `.pth` or `.safetensors` (written whole), or a folder, which receives
`pytorch_model.bin` (or `model.safetensors` with `--safe_serialization`), split into
numbered shards plus an index file, Hugging Face style, when larger than `max_shard_size`
(default 5GB).
The same logic runs from Python:

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")  # {name: fp32 tensor}
    model.load_state_dict(state_dict)

Files are memory-mapped and each parameter is put together from its shards once, so the
peak memory is about the size of the fp32 model.

Checkpoint files are unpickled through an allowlist (tensors, plain Python values, upstream
DeepSpeed's classes as plain data): a file that names anything else is refused, naming the
file and the global, and the command exits with status 1 having run nothing from it.
`--trust_checkpoint` (`trust_checkpoint=True`, or `DEEPSPEED_TRUST_CHECKPOINT=1`) loads such
a file anyway: only for checkpoints whose source you trust. See [Note: loading untrusted
checkpoints] in `deepspeed/checkpoint/safe_load.py`.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
import types
from collections import OrderedDict
from typing import Optional, Union

import torch

from deepspeed.checkpoint.atomic_write import atomic_save_to_path, atomic_torch_save, atomic_write_bytes
from deepspeed.checkpoint.errors import CheckpointError
from deepspeed.checkpoint.layout import UPSTREAM_REPLICATED_MODEL_FILE, model_states_name, read_latest
from deepspeed.checkpoint.sharded import ShardedCheckpoint
from deepspeed.utils.logging import logger
from deepspeed.utils.progress import progress

__all__ = [
    "LazyFullTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # a folder's shards; a single output file has no limit unless one is given
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE_UNITS = types.MappingProxyType(_SIZE_UNITS)  # read-only from here on


# ============================================================================ locating files


def _natural_key(path: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The model-states file a tag folder's readers start from (rank 0's, for ZeRO-3)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = UPSTREAM_REPLICATED_MODEL_FILE if zero_stage <= 2 else model_states_name(0)
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _rank_files(checkpoint_dir: str, suffix: str) -> list:
    files = sorted(glob.glob(os.path.join(checkpoint_dir, f"*{suffix}")), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find '*{suffix}' files in directory '{checkpoint_dir}'")
    return files


def get_model_state_files(checkpoint_dir: str) -> list:
    """Every rank's `*_model_states.pt` in a tag folder, in rank order."""
    return _rank_files(checkpoint_dir, "_model_states.pt")


def get_optim_files(checkpoint_dir: str) -> list:
    """Every rank's `*_optim_states.pt` in a tag folder, in rank order."""
    return _rank_files(checkpoint_dir, "_optim_states.pt")


def _tag_dir(checkpoint_dir: str, tag: Optional[str]) -> str:
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Checkpoint folder '{checkpoint_dir}' does not exist")
    if tag is None:
        tag = read_latest(checkpoint_dir)
        if tag is None:
            own_or_stage_3 = os.path.join(checkpoint_dir, model_states_name(0))
            upstream_stage_0_to_2 = os.path.join(checkpoint_dir, UPSTREAM_REPLICATED_MODEL_FILE)
            if os.path.isfile(own_or_stage_3) or os.path.isfile(upstream_stage_0_to_2):
                return checkpoint_dir  # pointed at a tag folder itself
            raise ValueError(
                f"Unable to find 'latest' file at {os.path.join(checkpoint_dir, 'latest')}; pass tag= "
                "(or -t TAG) to name the checkpoint folder"
            )
    path = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


# ============================================================================ consolidating


class LazyFullTensor:
    """One parameter of a checkpoint, put together from its shards only when asked.

    What `get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)` maps names to:
    `shape` and `dtype` (fp32) answer at once; `contiguous()` returns the whole fp32 tensor,
    built from the memory-mapped shard files each time it is called, so a caller that
    converts and drops one parameter at a time holds one parameter in memory, not the model.
    """

    __slots__ = ("_checkpoint", "name", "shape")
    dtype = torch.float32

    def __init__(self, checkpoint: ShardedCheckpoint, name: str) -> None:
        self._checkpoint = checkpoint
        self.name = name
        self.shape = torch.Size(checkpoint.params[name].shape)

    def numel(self) -> int:
        return self.shape.numel()

    def contiguous(self) -> torch.Tensor:
        return self._checkpoint.full_weight(self.name)

    def __repr__(self) -> str:
        return f"LazyFullTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
    *,
    trust_checkpoint: bool = False,
    quiet: bool = False,
) -> OrderedDict:
    """`{name: full fp32 tensor}` of the parameters (tied names included) and buffers.

    `checkpoint_dir` is the folder with `latest`; `tag` picks another tag folder. The keys
    are `module.state_dict()` names of the model the engine wrapped (no `module.` prefix).
    `lazy_mode=True` (upstream's argument, fourth as there): each parameter is a
    `LazyFullTensor` instead, whose `.contiguous()` builds it, for models too large to hold
    whole; buffers are tensors either way. Raises `CheckpointError` naming the file for a
    missing, truncated or mismatched file, and `UnsafeCheckpointError` for a file naming
    globals outside the allowlist unless `trust_checkpoint=True` (keyword-only, so a
    positional call written for upstream cannot switch it on; see the module docstring).
    `quiet=True` draws no progress bars (they are drawn on a terminal only: utils/progress.py).
    """
    ckpt = ShardedCheckpoint.open(_tag_dir(checkpoint_dir, tag), trust_checkpoint, quiet=quiet)
    if lazy_mode:  # tied names share one LazyFullTensor, as they share one tensor otherwise
        return ckpt.fp32_state_dict(exclude_frozen_parameters, weight=lambda name: LazyFullTensor(ckpt, name))

    def bar(metas: list):
        return progress(metas, "Consolidating parameters", unit="param", quiet=quiet)

    return ckpt.fp32_state_dict(exclude_frozen_parameters, progress=bar)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: Optional[str] = None, *, trust_checkpoint: bool = False
):
    """Move `model` to the CPU and load the consolidated fp32 weights into it (non-strict)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, trust_checkpoint=trust_checkpoint
    )
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


# ============================================================================ writing


def parse_size(size: Union[int, str]) -> int:
    """Bytes in `size`: an int, or text such as `"5GB"` (powers of 10) or `"500MiB"` (of 2)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if unit not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r}: expected a byte count such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _total_bytes(state_dict: dict) -> int:
    """Bytes of the distinct tensors of `state_dict` (a tied tensor once)."""
    return sum(_nbytes(t) for t in {id(t): t for t in state_dict.values()}.values())


def _split_by_size(state_dict: dict, limit: int) -> list:
    """Consecutive groups of keys, each under `limit` bytes unless one tensor alone is larger."""
    shards: list = [[]]
    size = 0
    for name, t in state_dict.items():
        if shards[-1] and size + _nbytes(t) > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(t)
    return shards


def _untied(state_dict: dict) -> dict:
    """Safetensors refuses tensors sharing memory: give each tied name its own copy."""
    seen: set = set()
    out = {}
    for name, t in state_dict.items():
        out[name] = t.clone() if id(t) in seen else t.contiguous()
        seen.add(id(t))
    return out


def _write_weights(state_dict: dict, path: str, safe: bool) -> None:
    if not safe:
        atomic_torch_save(state_dict, path)
        return
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            "safe_serialization=True needs the `safetensors` package: pip install safetensors"
        ) from err
    tensors = _untied(state_dict)
    atomic_save_to_path(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def _write_folder(state_dict: dict, output_dir: str, limit: int, safe: bool, quiet: bool = False) -> list:
    os.makedirs(output_dir, exist_ok=True)
    base = SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME
    groups = _split_by_size(state_dict, limit)
    if len(groups) == 1:
        path = os.path.join(output_dir, base)
        _write_weights(state_dict, path, safe)
        return [path]
    stem, ext = os.path.splitext(base)
    weight_map, paths = {}, []
    for i, names in enumerate(progress(groups, "Writing shards", unit="file", quiet=quiet), start=1):
        file_name = f"{stem}-{i:05d}-of-{len(groups):05d}{ext}"
        _write_weights({n: state_dict[n] for n in names}, os.path.join(output_dir, file_name), safe)
        weight_map.update({n: file_name for n in names})
        paths.append(os.path.join(output_dir, file_name))
    index = {"metadata": {"total_size": _total_bytes(state_dict)}, "weight_map": weight_map}
    index_path = os.path.join(output_dir, f"{base}.index.json")
    atomic_write_bytes(index_path, json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
    return paths + [index_path]


_OUTPUT_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_OUTPUT_DTYPES = types.MappingProxyType(_OUTPUT_DTYPES)  # read-only from here on


def output_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """`dtype` as a torch dtype: fp32, fp16 or bf16, given as a torch dtype or a name
    (`"bf16"`, `"bfloat16"`, `"torch.bfloat16"`, ...)."""
    if isinstance(dtype, str):
        resolved = _OUTPUT_DTYPES.get(dtype.lower().removeprefix("torch."))
    else:
        resolved = dtype if dtype in _OUTPUT_DTYPES.values() else None
    if resolved is None:
        raise ValueError(
            f"dtype={dtype!r}: the consolidated weights can be written as float32, float16 or bfloat16 "
            f"(a torch dtype or one of {sorted(_OUTPUT_DTYPES)})"
        )
    return resolved


def _cast_floating(state_dict: dict, dtype: torch.dtype) -> dict:
    """Floating tensors cast to `dtype` (tied names still share one tensor); others as they are."""
    cast: dict = {}
    out = OrderedDict()
    for name, t in state_dict.items():
        if id(t) not in cast:
            cast[id(t)] = t.to(dtype) if t.is_floating_point() else t
        out[name] = cast[id(t)]
    return out


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    dtype: Union[str, torch.dtype] = torch.float32,
    max_shard_size: Union[int, str, None] = None,
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    *,
    trust_checkpoint: bool = False,
    quiet: bool = False,
) -> list:
    """Write the consolidated state dict with floating tensors in `dtype` (see `output_dtype`;
    integer and bool buffers keep theirs); returns the paths written.

    `output_dir` may also be a file name ending in `.bin`, `.pt`, `.pth` or `.safetensors`
    (then it is one file, safetensors if the name ends so; refused when `safe_serialization`
    names another format, or when an explicit `max_shard_size` is smaller than the weights,
    since one file cannot be split). A folder gets `pytorch_model.bin` / `model.safetensors`,
    sharded past `max_shard_size` (None: 5GB). `trust_checkpoint`, `quiet`: see
    `get_fp32_state_dict_from_zero_checkpoint`.
    """
    target = output_dtype(dtype)
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    one_file = str(output_dir).endswith(_FILE_SUFFIXES) and not os.path.isdir(output_dir)
    if one_file and safe_serialization and not str(output_dir).endswith(".safetensors"):
        raise ValueError(
            f"safe_serialization writes safetensors, but the output file {output_dir!r} is named as a "
            "pickle; name it *.safetensors, or give a folder (it gets model.safetensors)"
        )
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters, trust_checkpoint=trust_checkpoint, quiet=quiet
    )
    if target != torch.float32:
        state_dict = _cast_floating(state_dict, target)
    if logger.isEnabledFor(logging.DEBUG):  # the command line's --debug
        for name, t in state_dict.items():
            logger.debug(f"zero_to_fp32: {name} {tuple(t.shape)} {t.dtype}")
    if one_file:
        total = _total_bytes(state_dict)
        if max_shard_size is not None and total > limit:
            raise ValueError(
                f"max_shard_size={max_shard_size!r}: the weights take {total} bytes, and the output "
                f"{output_dir!r} is one file, which cannot be split; give a folder for shards of that size"
            )
        safe = str(output_dir).endswith(".safetensors")
        parent = os.path.dirname(os.path.abspath(output_dir))
        os.makedirs(parent, exist_ok=True)
        _write_weights(state_dict, output_dir, safe)
        return [output_dir]
    if os.path.splitext(str(output_dir))[1] and not os.path.isdir(output_dir):
        logger.warning(
            f"zero_to_fp32: {output_dir} does not end in {'/'.join(_FILE_SUFFIXES)}, so it is taken as a "
            "folder to write the weights into"
        )
    return _write_folder(state_dict, output_dir, limit, safe_serialization, quiet)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: Union[int, str, None] = None,
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    *,
    trust_checkpoint: bool = False,
    quiet: bool = False,
) -> list:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (upstream's argument order)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        torch.float32,
        max_shard_size,
        safe_serialization,
        tag,
        exclude_frozen_parameters,
        trust_checkpoint=trust_checkpoint,
        quiet=quiet,
    )


# ============================================================================ command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Consolidate a sharded ZeRO-3 checkpoint into one fp32 state dict.",
    )
    parser.add_argument("checkpoint_dir", help="the folder given to save_checkpoint (holds 'latest')")
    parser.add_argument(
        "output_dir",
        help="an output file (.bin/.pt/.pth/.safetensors) or a folder for pytorch_model.bin / model.safetensors",
    )
    parser.add_argument(
        "-t", "--tag", default=None, help="the checkpoint tag folder (default: from 'latest')"
    )
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument(
        "--max_shard_size",
        default=None,
        help=f"split a folder's output past this size (default {DEFAULT_MAX_SHARD_SIZE}); "
        "an output file larger than a size given here is refused",
    )
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="write floating tensors as float32 (default), float16 or bfloat16",
    )
    parser.add_argument(
        "-d", "--debug", action="store_true", help="log each consolidated tensor's name, shape and dtype"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars (drawn only on a terminal anyway)"
    )
    parser.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="load files that name Python objects outside the safe allowlist (their unpickling can run "
        "code): only for checkpoints whose source you trust",
    )
    return parser


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    level = logger.level
    if args.debug:
        logger.setLevel(logging.DEBUG)  # back to `level` below: main() may run inside a program
    try:
        paths = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            trust_checkpoint=args.trust_checkpoint,
            quiet=args.quiet,
        )
    except (CheckpointError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"zero_to_fp32: error: {err}", file=sys.stderr)
        return 1
    finally:
        logger.setLevel(level)
    for path in paths:
        print(f"Saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
