"""The training runtime. Submodules load on first attribute access (see `deepspeed/__init__.py`)."""

import importlib
import importlib.util


def __getattr__(name):
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
