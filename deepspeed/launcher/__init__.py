"""The `deepspeed` launcher: `runner` parses the command line and picks the mode, `hostfile`
selects hosts and devices, `multinode_runner` builds the pdsh / ssh / MPI / Slurm command
lines, and `launch` starts and supervises one node's ranks (docs/launcher.md).

The launcher runs each rank as a plain subprocess and stays out of the comm layer; the ranks
set up their process group themselves (`deepspeed.comm`).
"""

import importlib
import importlib.util


def __getattr__(name):
    # Submodules resolve on attribute access after a bare `import deepspeed` (see deepspeed/__init__.py).
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
