"""Reading a DeepSpeed config (a dict, a JSON or HJSON file, or base64 text) and the batch-size identity.

[Note: HJSON configs]
Upstream reads config files and base64 configs with `hjson`, a superset of JSON: `//`, `#`
and `/* */` comments, trailing commas, quoteless keys and strings. Configs in the wild carry
comments, so text that is not JSON is read as HJSON here too; JSON is tried first, as it is
exact about where plain JSON is broken, and HJSON reads every JSON text as JSON does.

Split from `config.py`, which re-exports both public functions: they need no typed section,
only the raw dict and the world size.
"""

import base64
import binascii
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from deepspeed.runtime.config_utils import DeepSpeedConfigError

__all__ = ["load_config_dict", "resolve_batch_sizes", "resolve_world_size"]


# ----------------------------------------------------------------------------------------
# Loading


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.load keeps the last of two equal keys silently; upstream rejects them, and so do we.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DeepSpeedConfigError(f"duplicate key {key!r} in DeepSpeed config")
        result[key] = value
    return result


class _NotJsonNorHjson(ValueError):
    """Text that parses neither as JSON nor as HJSON; the message gives both parsers' errors."""


def _parse_json_or_hjson(text: str) -> Any:
    """`text` parsed as JSON, else as HJSON (see the note). Raises `_NotJsonNorHjson` when it
    is neither, or `DeepSpeedConfigError` for a duplicate key."""
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:
            raise _NotJsonNorHjson(
                f"{json_error} (`hjson`, which reads configs with comments as upstream does, is not "
                "installed: pip install hjson)"
            ) from None
        try:
            return hjson.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except hjson.HjsonDecodeError as hjson_error:
            raise _NotJsonNorHjson(f"as JSON: {json_error}; as HJSON: {hjson_error}") from None


def _read_json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = _parse_json_or_hjson(f.read())
    except _NotJsonNorHjson as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config file {path!r} is not valid JSON (nor HJSON): {err}"
        ) from None
    except DeepSpeedConfigError as err:
        raise DeepSpeedConfigError(f"DeepSpeed config file {path!r}: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DeepSpeedConfigError(f"cannot read DeepSpeed config file {path!r}: {err}") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            f"DeepSpeed config file {path!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def _decode_base64_json(text: str) -> Optional[dict[str, Any]]:
    """The dict encoded in `text` (the launcher passes configs this way), or None."""
    for altchars in (None, b"-_"):  # standard, then URL-safe alphabet
        try:
            raw = base64.b64decode(text, altchars=altchars, validate=True)
            data = _parse_json_or_hjson(raw.decode("utf-8"))
        except (binascii.Error, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def load_config_dict(config: Any) -> dict[str, Any]:
    """The config as a dict: `config` itself, a JSON file's contents, or decoded base64 JSON."""
    if isinstance(config, dict):
        return config
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isfile(path):
            return _read_json_file(path)
        if isinstance(config, str) and not os.path.exists(path):
            decoded = _decode_base64_json(config)
            if decoded is not None:
                return decoded
        shown = path if len(path) <= 200 else path[:200] + "..."
        kind = "is a directory, not a JSON file" if os.path.isdir(path) else "does not exist"
        raise DeepSpeedConfigError(
            f"DeepSpeed config path {shown!r} {kind} (resolved to {os.path.abspath(path)!r}) "
            "and is not base64-encoded JSON either; pass a dict, a JSON file path or base64 JSON"
        )
    raise DeepSpeedConfigError(
        f"DeepSpeed config must be a dict, a JSON file path or base64 JSON, got {type(config).__name__}"
    )


# ----------------------------------------------------------------------------------------
# Batch sizes


def _divide(total: int, by: int, names: str, given: str) -> int:
    if total % by != 0:
        raise DeepSpeedConfigError(
            f"Invalid DeepSpeed batch sizes ({given}): train_batch_size is not divisible by {names} = {by}"
        )
    return total // by


def resolve_batch_sizes(
    train: Optional[int], micro: Optional[int], gas: Optional[int], world_size: int
) -> tuple[int, int, int]:
    """Fill in the missing ones of (train_batch_size, micro batch, accumulation steps).

    They must satisfy ``train == micro * gas * world_size``. With only one given, the
    accumulation steps default to 1 (and with only `gas`, the micro batch does).
    """
    given = (
        f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
        f"gradient_accumulation_steps={gas}, world_size={world_size}"
    )
    if train is None and micro is None and gas is None:
        raise DeepSpeedConfigError(
            "Invalid DeepSpeed config: set train_batch_size or train_micro_batch_size_per_gpu "
            "(and optionally gradient_accumulation_steps)"
        )
    if train is None:
        micro, gas = micro or 1, gas or 1
        train = micro * gas * world_size
    elif micro is None:
        names = "gradient_accumulation_steps * world_size" if gas else "world_size (no gradient accumulation)"
        gas = gas or 1
        micro = _divide(train, gas * world_size, names, given)
    elif gas is None:
        gas = _divide(train, micro * world_size, "train_micro_batch_size_per_gpu * world_size", given)
    if train != micro * gas * world_size:
        raise DeepSpeedConfigError(
            f"Invalid DeepSpeed batch sizes ({given}): train_batch_size must equal "
            f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size = "
            f"{micro} * {gas} * {world_size} = {micro * gas * world_size}"
        )
    return train, micro, gas


def resolve_world_size(world_size: Optional[int], mpu: Any, mesh_device: Any) -> int:
    """Data-parallel world size: argument, then mpu, then device mesh, then $WORLD_SIZE, then 1.

    Read without torch.distributed: only the comm layer may import it.
    """
    if world_size is None and mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        world_size = mpu.get_data_parallel_world_size()
    if world_size is None and mesh_device is not None:
        names = tuple(getattr(mesh_device, "mesh_dim_names", None) or ())
        if "data_parallel" in names:
            world_size = mesh_device.size(names.index("data_parallel"))
    if world_size is None:
        world_size = os.environ.get("WORLD_SIZE", 1)
    try:
        value = int(world_size)
    except (TypeError, ValueError):
        raise DeepSpeedConfigError(f"world_size must be a positive integer, got {world_size!r}") from None
    if value < 1:
        raise DeepSpeedConfigError(f"world_size must be a positive integer, got {world_size!r}")
    return value
