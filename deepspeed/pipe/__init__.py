"""`deepspeed.pipe`: the pipeline-parallel model description (one stage only here)."""

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
