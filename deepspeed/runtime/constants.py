"""Upstream's `deepspeed.runtime.constants`: each top-level config key's name and default.

Scripts and upstream's tests compare against these (`GRADIENT_CLIPPING_DEFAULT`,
`LOG_LEVEL_DEFAULT`). They are read off the typed config (`DeepSpeedRootConfig`), the one
place the keys and their defaults are defined, so they cannot drift from what the engine
does: for a key `gradient_clipping`, `GRADIENT_CLIPPING == "gradient_clipping"` and
`GRADIENT_CLIPPING_DEFAULT` is its default (None where the key has no fixed default).
Blocks (`zero_optimization`, `fp16`, ...) have their name only; their keys' defaults live
in their own config classes.
"""

from __future__ import annotations

from pydantic import BaseModel

from deepspeed.runtime.config import DeepSpeedRootConfig


def _constants() -> dict:
    names: dict = {}
    for key, field in DeepSpeedRootConfig.model_fields.items():
        names[key.upper()] = key
        annotation = field.annotation
        is_block = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if not is_block and not field.is_required() and field.default_factory is None:
            names[f"{key.upper()}_DEFAULT"] = field.default
    return names


globals().update(_constants())
__all__ = sorted(_constants())
