"""Upstream entry points of separate DeepSpeed products that this package does not provide.

They exist so that a client reaching them gets an error that says what is missing, not an
`AttributeError` that looks like a broken install.
"""

from __future__ import annotations

from typing import Any, NoReturn


def _not_provided(name: str, product: str) -> NoReturn:
    raise NotImplementedError(
        f"deepspeed.{name} belongs to DeepSpeed's {product}, a separate product that this package (a "
        "ZeRO training implementation) does not provide; install upstream DeepSpeed for it, or use "
        "deepspeed.initialize with a ZeRO config"
    )


def init_inference(model: Any = None, config: Any = None, **kwargs: Any) -> NoReturn:
    """Upstream's DeepSpeed-Inference engine: not provided here (raises)."""
    _not_provided("init_inference", "inference engine (DeepSpeed-Inference, kernel injection)")


def tp_model_init(model: Any = None, tp_size: Any = None, dtype: Any = None, **kwargs: Any) -> NoReturn:
    """Upstream's automatic tensor parallelism for training: not provided here (raises)."""
    _not_provided("tp_model_init", "automatic tensor parallelism (AutoTP)")
