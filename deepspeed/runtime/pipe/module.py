"""`PipelineModule` and `LayerSpec`: upstream's pipeline model description, for one stage.

Upstream splits a list of layers across pipeline stages, each built only on the ranks that
run it, and trains them with its pipeline engine. With one stage there is nothing to split:
a `PipelineModule` is the sequential model of its layers, and `deepspeed.initialize` returns
a `PipelineEngine` (engine.py) whose `train_batch()` / `eval_batch()` run it like any module
(every rank holds all layers; ZeRO-3 partitions them across the data-parallel ranks). More
than one stage needs pipeline parallelism, which this package does not implement:
`num_stages > 1` (or a topology with a pipeline axis > 1, or a model axis > 1) raises, naming it.

Layers are given as `LayerSpec(cls, *args, **kwargs)` (built here, so a model built under
`zero.Init` is partitioned as it is made), as built `nn.Module`s, or as plain callables
(`lambda x: x.view(...)`), applied in order. `TiedLayerSpec(key, ...)` entries with the same
key share one module (e.g. input embedding and output head).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


class PipelineError(Exception):
    """Upstream's error for misuse of the pipeline engine."""


class LayerSpec:
    """A deferred `typename(*module_args, **module_kwargs)`, built by the PipelineModule."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__}, args={self.module_args}, kwargs={self.module_kwargs})"

    def build(self, log: bool = False) -> nn.Module:
        del log
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose module is shared by every TiedLayerSpec with the same `key`.

    `forward_fn(module, x)`, when given, replaces `module(x)` at this position (an output
    head reusing the embedding's weight). `tied_weight_attr` names the shared weights.
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Optional[Callable] = None,
        tied_weight_attr: Any = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


def _pipeline_size(topology: Any) -> int:
    if topology is None:
        return 1
    if hasattr(topology, "get_dim"):
        return int(topology.get_dim("pipe"))
    return int(getattr(topology, "num_stages", 1))


def _model_parallel_size(topology: Any) -> int:
    return max(1, int(topology.get_dim("model"))) if hasattr(topology, "get_dim") else 1


class PipelineModule(nn.Module):
    """A sequential model built from layer specs; one pipeline stage (see the module docstring)."""

    def __init__(
        self,
        layers: Any,
        num_stages: Optional[int] = None,
        topology: Any = None,
        loss_fn: Optional[Callable] = None,
        seed_layers: bool = False,
        seed_fn: Optional[Callable] = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Optional[Callable] = None,
        checkpointable_layers: Optional[list] = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        del dynamic_shape  # how stages exchange activations of changing shapes: none to exchange
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: pass num_stages=1 (or a topology); got neither")
        stages = int(num_stages) if num_stages is not None else _pipeline_size(topology)
        if stages != 1 or _pipeline_size(topology) != 1:
            name = "num_stages" if num_stages is not None and int(num_stages) != 1 else "topology"
            raise ValueError(
                f"PipelineModule: {name} asks for {max(stages, _pipeline_size(topology))} pipeline stages; "
                "pipeline parallelism is not implemented here, only num_stages=1 (a sequential model)"
            )
        if _model_parallel_size(topology) != 1:
            raise ValueError(
                f"PipelineModule: the topology has {_model_parallel_size(topology)} model-parallel ranks; "
                "tensor parallelism inside a PipelineModule is not implemented here: use a topology "
                "with one model-parallel rank (PipeDataParallelTopology(num_pp=1, num_dp=world_size))"
            )
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"PipelineModule: activation_checkpoint_interval={activation_checkpoint_interval} must be >= 0"
            )
        self.num_stages = 1
        self.stage_id = 0
        self.micro_offset = 0  # forwards so far: seed_layers' per-forward seeds (see _run_layers)
        self._topology = topology
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        if activation_checkpoint_func is None:
            from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

            activation_checkpoint_func = checkpoint  # non-reentrant: see forward()
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = list(layers)
        self.parts = self._partition(partition_method)
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: list = []
        self._build()

    def _partition(self, method: str) -> list:
        """Upstream's partition methods, checked; with one stage every layer is in it. As
        upstream, "parameters" first builds each LayerSpec once to count its parameters, and
        that draws from the random generators: doing the same keeps a seeded script's initial
        weights equal to upstream's."""
        method = str(method).lower()
        if method not in ("uniform", "parameters") and not method.startswith("type:"):
            raise ValueError(
                f"PipelineModule(partition_method={method!r}): supported are 'parameters', 'uniform' and 'type:NAME'"
            )
        if method == "parameters":
            for layer in self._layer_specs:
                if isinstance(layer, LayerSpec):
                    layer.build()  # counted, then dropped (upstream's _count_layer_params)
        return [0, len(self._layer_specs)]

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            from deepspeed.runtime.utils import set_random_seed

            set_random_seed(seed)

    def _build(self) -> None:
        for index, layer in enumerate(self._layer_specs):
            if self.seed_layers:
                self._seed(self.base_seed + index)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                tied = self.tied_modules[layer.key]
                if layer.forward_fn is None:
                    self.forward_funcs.append(tied)
                else:
                    self.forward_funcs.append(_TiedCall(layer.forward_fn, tied))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                self.forward_funcs.append(layer)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise TypeError(
                    f"PipelineModule: layer {index} is a {type(layer).__name__}; pass LayerSpecs, modules or callables"
                )

    def _is_checkpointable(self, funcs: list) -> bool:
        if self.checkpointable_layers is not None:
            return all(
                type(f).__name__ in self.checkpointable_layers for f in funcs if isinstance(f, nn.Module)
            )
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def forward(self, forward_input: Any) -> Any:
        # seed_layers: each layer of each forward runs under its own seed, base_seed x (forwards
        # so far + 1) + its index, as upstream; a checkpointed chunk's recomputation seeds alike.
        self.micro_offset += 1
        offset = self.micro_offset + 1
        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return _Chunk(self, 0, count, offset)(forward_input)
        # Non-reentrant checkpointing (the default function): each chunk's parameters get
        # their gradients whether or not its inputs require grad, as without checkpointing.
        x = forward_input
        for start in range(0, count, interval):
            stop = min(start + interval, count)
            run = _Chunk(self, start, stop, offset)
            inputs = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:stop]):
                x = self.activation_checkpoint_func(run, *inputs)
            else:
                x = run(*inputs)
        return x

    def mpu(self) -> Any:
        """The engine's PipelineParallelGrid (None before deepspeed.initialize builds it)."""
        return getattr(self, "_grid", None)

    def num_pipeline_stages(self) -> int:
        return 1

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer `layer_idx`: the only one."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(
                f"stage_owner({layer_idx}): the module has layers 0..{len(self._layer_specs) - 1}"
            )
        return 0

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"set_checkpoint_interval({interval}): must be >= 0")
        self.activation_checkpoint_interval = int(interval)

    def topology(self) -> Any:
        """The topology given, else one stage with every rank on the data axis."""
        if self._topology is None:
            from deepspeed import comm as dist
            from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

            world = dist.get_world_size() if dist.is_initialized() else 1
            self._topology = PipeDataParallelTopology(num_pp=1, num_dp=world)
        return self._topology

    def get_additional_losses(self) -> Optional[dict]:
        """Override to return `{name: scalar tensor}` computed in the last forward (an auxiliary
        loss to report beside the main one); the pipeline engine averages each like the loss."""
        return None

    def partitions(self) -> list:
        """Layer boundaries per stage: one stage holding every layer."""
        return [0, len(self.forward_funcs)]


class _TiedCall:
    """`forward_fn(module, x)` at a tied layer's position."""

    def __init__(self, forward_fn: Callable, module: nn.Module) -> None:
        self.forward_fn = forward_fn
        self.module = module

    def __call__(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)


class _Chunk:
    """Layers `start` to `stop` run in order, as one (possibly checkpointed) function."""

    def __init__(self, module: PipelineModule, start: int, stop: int, offset: int) -> None:
        self.module, self.start, self.stop, self.offset = module, start, stop, offset

    def __call__(self, *inputs: Any) -> Any:
        module = self.module
        x = inputs[0] if len(inputs) == 1 else inputs
        for index in range(self.start, self.stop):
            if module.seed_layers:
                module._seed(module.base_seed * self.offset + index)
            x = module.forward_funcs[index](x)
        return x
