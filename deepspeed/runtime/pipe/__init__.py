"""Pipeline model description; see `module.py` (one stage: a sequential model)."""

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
