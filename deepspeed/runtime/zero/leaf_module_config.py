"""`zero_optimization.leaf_module`: which modules the engine marks as ZeRO-3 leaf modules.

Its own module because upstream DeepSpeed's users import the defaults from here
(`deepspeed.runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_CLASSES`). The defaults are
lists, not tuples, because the config fields are lists and callers compare the two with `==`;
treat them as read-only (the config copies them, so a field never aliases a default).
"""

from typing import Any

from pydantic import Field, field_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]

# HF's sparse mixture-of-experts blocks, whose experts run by the router's choice, are leaf
# modules unless the config says otherwise (as upstream's defaults).
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """`zero_optimization.leaf_module`: modules the engine marks as leaf modules at initialize
    (utils/z3_leaf_module.py's note), by class (its name, or module path and name), by name in
    `named_modules()`, or by the end of that name. A single string is taken as a list of one.
    Leaf marks matter at stage 3 (one gather per leaf) and at every stage for gradients
    (a leaf's unused parameters reduce as zeros)."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def is_default(self) -> bool:
        return (
            self.classes == DEFAULT_LEAF_MODULE_CLASSES
            and self.names == DEFAULT_LEAF_MODULE_NAMES
            and self.name_suffixes == DEFAULT_LEAF_MODULE_NAME_SUFFIXES
        )
