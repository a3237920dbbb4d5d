"""`deepspeed.initialize`: build a `DeepSpeedEngine` (a `PipelineEngine` for a `PipelineModule`)
with upstream's signature and return values."""

from __future__ import annotations

from typing import Any, Optional

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
from deepspeed.utils.logging import logger


def _pick_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize: pass config or config_params, not both")
    chosen = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    legacy = getattr(args, "deepscale_config", None) if args is not None else None
    if legacy is not None:
        if from_args is not None:
            raise ValueError(
                f"deepspeed.initialize: args.deepspeed_config={from_args!r} and the deprecated "
                f"args.deepscale_config={legacy!r} are both set; keep --deepspeed_config"
            )
        logger.warning("--deepscale_config is deprecated; use --deepspeed_config (read as such)")
        from_args = legacy
    if chosen is not None and from_args is not None:
        raise ValueError(
            f"deepspeed.initialize: a config was passed and args.deepspeed_config={from_args!r} is set; keep one"
        )
    chosen = chosen if chosen is not None else from_args
    if chosen is None:
        raise ValueError(
            "deepspeed.initialize: no config; pass config={...} (a dict or a JSON path) or set args.deepspeed_config"
        )
    return chosen


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple:
    """Returns `(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)`.

    An active `zero.Init` is paused while the engine is built, so the engine's own modules
    are not partitioned.
    """
    if mesh_param is not None:
        raise ValueError(
            f"deepspeed.initialize(mesh_param={mesh_param!r}): device meshes (sequence / tensor parallel "
            "groups) are not supported; omit mesh_param"
        )
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    chosen = _pick_config(args, config, config_params)
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError(
            "deepspeed.initialize(dist_init_required=False): torch.distributed is not initialized; "
            "initialize it first (deepspeed.init_distributed() or torch.distributed.init_process_group) "
            "or leave dist_init_required unset"
        )
    dist.init_distributed(
        distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False
    )
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    engine_class = PipelineEngine if isinstance(model, PipelineModule) else DeepSpeedEngine
    shutdown_init_context()
    try:
        engine = engine_class(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            collate_fn=collate_fn,
            config=chosen,
        )
    finally:
        restore_init_context()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
