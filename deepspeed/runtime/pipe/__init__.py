"""Pipeline model description and engine; see `module.py` and `engine.py` (one stage)."""

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
