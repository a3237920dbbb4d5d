"""`deepspeed.sequence`: Ulysses sequence parallelism's attention layer (`layer.DistributedAttention`)."""

from deepspeed import _lazy_attributes

__getattr__ = _lazy_attributes(__name__, globals())
