"""The training runtime. Submodules load on first attribute access (see `deepspeed/__init__.py`)."""

from deepspeed import _lazy_attributes

__getattr__ = _lazy_attributes(__name__, globals())
