"""`deepspeed.runtime.sequence_parallel`: Ulysses sequence parallelism for HF transformers models
(`ulysses_sp`: `UlyssesSPAttentionHF`, `UlyssesSPDataLoaderAdapter`), its process groups as an
mpu (`parallel_state_sp`), and the engine's set-up (`setup`). See docs/sequence_parallel.md."""

from deepspeed import _lazy_attributes

__getattr__ = _lazy_attributes(__name__, globals())
