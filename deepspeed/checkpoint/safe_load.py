"""The one loader of checkpoint files: `torch.load(weights_only=True)` through an allowlist.


[Note: loading untrusted checkpoints]
A checkpoint file is a pickle, and unpickling calls whatever the pickle names: a planted
`*_states.pt` that names `os.system` runs a command the moment a plain `torch.load` opens it.
Every checkpoint file this package reads therefore goes through one function,
`load_checkpoint_file`: `torch.load(weights_only=True)`, whose restricted unpickler builds
only allowlisted globals, with this allowlist:
  - torch's own weights_only set: tensors and storages, dict / OrderedDict / list / tuple /
    set, numbers, strings, bytes, `torch.dtype`, `torch.Size`, `torch.device`. Our own files
    hold nothing else (the loss scaler, the stage, parameter metadata are plain dicts);
  - upstream DeepSpeed's pickled classes, under their names but as the plain-data stand-ins
    of `upstream.UPSTREAM_GLOBALS` (see [Note: upstream's pickled classes]);
  - `CLIENT_STATE_GLOBALS`: `argparse.Namespace` and POSIX paths, value types client state
    often holds (training arguments, hyperparameters) whose rebuilding runs no code of the file;
  - whatever the user allowlisted with `torch.serialization.add_safe_globals`.
The file's pickle is first scanned without running it (`torch.serialization.
get_unsafe_globals_in_checkpoint`), so a refusal (`UnsafeCheckpointError`) names the file and
every refused global at once; the restricted unpickler stays the guard either way.
Client state (`save_checkpoint(client_state=...)`) sits at the top level of the model-states
file, as upstream puts it (Lightning's converter reads it there). A save whose client state
holds a type outside the allowlist still succeeds but warns, naming the types: loading it
needs an explicit opt-in, `trust_checkpoint=True` (`load_checkpoint`, the zero_to_fp32 API),
`--trust_checkpoint` (zero_to_fp32 command line) or `DEEPSPEED_TRUST_CHECKPOINT=1` (for
clients such as Lightning that call `load_checkpoint` themselves). Opted in, the globals the
scan found are imported and allowlisted for that one load: the file is trusted, so the
classes and functions it names run (a `subprocess.call` too). It still goes through torch's
restricted unpickler, which reads only the pickle instructions `torch.save` writes and refuses
the modules torch blocks outright (`os`, `posix`, `nt`, `sys`) even then; the classes it
builds objects of without the file naming them (numpy's dtypes) are allowed with what names
them (`_classes_built_unnamed`). Upstream's class paths still map to the stand-ins.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import importlib
import os
import pathlib
import pickle
from typing import Any

import torch

from deepspeed.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from deepspeed.checkpoint.upstream import UPSTREAM_GLOBALS, to_plain

TRUST_ENV = "DEEPSPEED_TRUST_CHECKPOINT"  # "1": load checkpoints that name non-allowlisted globals
# Plain value types client state often holds; rebuilding them runs no code of the file.
CLIENT_STATE_GLOBALS = (argparse.Namespace, pathlib.PurePosixPath, pathlib.PosixPath)


def trust_from_env() -> bool:
    """`DEEPSPEED_TRUST_CHECKPOINT` set to 1 / true / yes / on."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _allowlist() -> list:
    """What `load_checkpoint_file` adds to torch's weights_only set (see the note)."""
    standins = [(standin, name) for name, standin in UPSTREAM_GLOBALS.items()]
    return standins + list(CLIENT_STATE_GLOBALS)


def refused_globals(path: str) -> list:
    """The globals `path`'s pickle names that the loader refuses, found without running it.

    Raises `pickle.UnpicklingError` for a pickle instruction the restricted unpickler does
    not read (torch.save never writes one), `ValueError` / `EOFError` / `RuntimeError` for a
    file that is not a complete `torch.save` archive.
    """
    with torch.serialization.safe_globals(_allowlist()):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def _classes_built_unnamed(refused: list) -> list:
    """Classes a trusted file's objects can have without its pickle naming them.

    The restricted unpickler builds state only into instances of allowlisted classes, and
    the scan sees only the names the pickle holds. A numpy array or scalar names
    `numpy.dtype`, whose call returns an instance of a subclass (`numpy.dtypes.Int64DType`)
    the file never names; without these, a trusted load of client state holding
    `np.arange(3)` or `np.random.get_state()` was refused after all.
    """
    if not any(name.startswith("numpy") for name in refused):
        return []
    import numpy

    dtypes = getattr(numpy, "dtypes", None)  # numpy >= 1.25; older dtypes are numpy.dtype itself
    if dtypes is None:
        return []
    return [cls for cls in vars(dtypes).values() if isinstance(cls, type) and issubclass(cls, numpy.dtype)]


def _refusal(path: str, refused: list) -> UnsafeCheckpointError:
    names = ", ".join(refused[:8]) + (f" and {len(refused) - 8} more" if len(refused) > 8 else "")
    return UnsafeCheckpointError(
        f"{path}: refused to load: it names {names}, outside the checkpoint loader's allowlist "
        "(unpickling such a name can run code; nothing from this file was run). If you trust where "
        "this checkpoint came from, opt in with load_checkpoint(..., trust_checkpoint=True), "
        f"zero_to_fp32 --trust_checkpoint (trust_checkpoint=True in Python) or {TRUST_ENV}=1, or "
        "allowlist just these types with torch.serialization.add_safe_globals([...]); see "
        "'Loading untrusted checkpoints' in docs/checkpoints.md"
    )


def _resolve_global(qualified: str) -> tuple:
    """`(object, qualified)` for a global a trusted file names: its module is imported.

    Pickle protocol 2 (torch.save's) writes Python 2 names for some objects (`subprocess` as
    `commands`); they are mapped back the way `pickle` itself does on load.
    """
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module, attrs = ".".join(parts[:cut]), parts[cut:]
        if len(attrs) == 1 and (module, attrs[0]) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, attrs[0])]
            attrs = name.split(".")
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj, qualified
    raise ImportError(f"cannot import {qualified}, which the (trusted) checkpoint names")


def _torch_reason(err: BaseException) -> str:
    """The restricted unpickler's own reason, without torch's advice to drop weights_only."""
    text = str(err)
    for marker in ("WeightsUnpickler error:", "from a trusted source."):
        if marker in text:
            text = text.split(marker, 1)[1]
    return " ".join(text.split())[:400]


def load_checkpoint_file(path: str, trust: bool = False) -> Any:
    """Unpickle one checkpoint file through the allowlist, memory-mapped on the CPU.

    The only way this package reads checkpoint data (see [Note: loading untrusted
    checkpoints]). Raises `UnsafeCheckpointError` naming the file and the refused globals
    unless `trust` or `DEEPSPEED_TRUST_CHECKPOINT=1`; upstream's pickled classes come back as
    plain data either way.
    """
    trusted = trust or trust_from_env()
    allow = _allowlist()
    try:
        refused = refused_globals(path)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: its pickle holds an instruction the restricted unpickler does not "
            f"read ({_torch_reason(err)}); torch.save does not write it, so the file was not written by "
            "DeepSpeed or was altered; nothing from it was run"
        ) from None
    except (ValueError, EOFError, RuntimeError, OSError):
        refused = []  # not a complete torch.save archive: torch.load below says what is wrong
    if refused and not trusted:
        raise _refusal(path, refused)
    allow += [_resolve_global(name) for name in refused] + _classes_built_unnamed(refused)
    try:
        with torch.serialization.safe_globals(allow):
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        # Also when trusted: torch blocks the modules os, posix, nt and sys outright.
        raise UnsafeCheckpointError(
            f"{path}: refused to load: torch's restricted unpickler stopped at {_torch_reason(err)!r}; "
            "nothing the file names past that point was run"
        ) from None
    return to_plain(obj)


def load_file(path: str, what: str, trust: bool = False) -> Any:
    """`load_checkpoint_file`, or raise `CheckpointError` naming the file and `what` it is."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); the checkpoint is incomplete")
    try:
        return load_checkpoint_file(path, trust)
    except CheckpointError:
        raise
    except ImportError as err:
        raise CheckpointError(f"{path}: cannot read the {what}: {err}") from err
    except Exception as err:  # torch raises RuntimeError, EOFError, ...
        raise CheckpointError(
            f"{path}: cannot read the {what}: the file is truncated or corrupt ({type(err).__name__}: {err})"
        ) from err
