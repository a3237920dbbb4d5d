"""`deepspeed.moe`: mixture-of-experts layers (local experts only: `ep_size=1`)."""

import importlib
import importlib.util


def __getattr__(name):
    # Submodules resolve on attribute access after a bare `import deepspeed` (see deepspeed/__init__.py).
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
