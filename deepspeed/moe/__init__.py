"""`deepspeed.moe`: mixture-of-experts layers (local experts only: `ep_size=1`)."""

from deepspeed import _lazy_attributes

__getattr__ = _lazy_attributes(__name__, globals())
