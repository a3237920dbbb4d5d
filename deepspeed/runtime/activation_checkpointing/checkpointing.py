"""`deepspeed.checkpointing`: upstream's activation-checkpointing API over `torch.utils.checkpoint`.

`configure(...)` records the settings (from arguments or the config's `activation_checkpointing`
block); `checkpoint(function, *args)` runs `function` without keeping its activations and
recomputes them in backward, restoring the RNG state so dropout draws the same masks.

[Note: which options act]
- `partition_activations`: upstream splits saved activations across the *model-parallel*
  ranks. With no `mpu` (or a model-parallel group of one rank) there is nothing to split,
  upstream included, so it is accepted and has no effect; with a model-parallel group of more
  than one rank it is refused: we do not implement model parallelism.
- `contiguous_memory_optimization` / `contiguous_checkpointing` and `number_checkpoints`:
  upstream lays partitioned activations out in one buffer; with nothing partitioned (above)
  they change nothing, upstream included, and are accepted.
- `cpu_checkpointing` / `checkpoint_in_cpu`: acts. The tensors a checkpointed region saves
  (its inputs) are kept in host memory until backward (`torch.autograd.graph.save_on_cpu`).
- `synchronize_checkpoint_boundary` / `synchronize`: acts. The device is synchronized
  before and after each checkpointed forward and recomputation.
- `profile`: acts. Each checkpointed forward's wall time is logged (rank 0, info level).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

from deepspeed import process_state
from deepspeed.utils.logging import logger

_RNG_TRACKER_NAME = "model-parallel-rng"
_MODEL_PARALLEL_RNG_TRACKER_NAME = _RNG_TRACKER_NAME  # upstream's name (GPT-NeoX's mpu reads it)
# Upstream offsets the model-parallel seed so it never equals the data-parallel one.
_MODEL_PARALLEL_SEED_OFFSET = 2718


class _Settings:
    """What `configure` recorded; one owner (STYLE 6), reset by `reset()` and by tests."""

    def __init__(self) -> None:
        self.configured = False
        self.mpu: Any = None
        self.partition_activations = False
        self.contiguous_checkpointing = False
        self.num_checkpoints: Optional[int] = None
        self.checkpoint_in_cpu = False
        self.synchronize = False
        self.profile = False


SETTINGS = _Settings()


def _model_parallel_size(mpu: Any) -> int:
    if mpu is None:
        return 1
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


# The keys of the config's `activation_checkpointing` block that `configure` reads (the
# config refuses others, see runtime/config.py); each acts or has no effect, as the note says.
CONFIG_KEYS = (
    "partition_activations",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "cpu_checkpointing",
    "synchronize_checkpoint_boundary",
    "profile",
)


def _from_config(deepspeed_config: Any) -> dict:
    """The `activation_checkpointing` block of a config dict, JSON path or DeepSpeedConfig."""
    if deepspeed_config is None:
        return {}
    if hasattr(deepspeed_config, "_param_dict"):
        cfg = deepspeed_config._param_dict
    elif isinstance(deepspeed_config, dict):
        cfg = deepspeed_config
    else:  # a file path (JSON or HJSON) or base64, read as initialize reads it
        from deepspeed.runtime.config_loading import load_config_dict

        cfg = load_config_dict(deepspeed_config)
    return dict(cfg.get("activation_checkpointing") or {})


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """Record the checkpointing settings; explicit arguments override the config's block.

    `None` means "not given" (Lightning passes `config.get(...)` for each). See the module
    note for what each option does here.
    """
    block = _from_config(deepspeed_config)
    unknown = sorted(set(block) - set(CONFIG_KEYS))
    if unknown:  # as initialize refuses them in the same block
        raise ValueError(
            f"deepspeed.checkpointing.configure: unknown key(s) {unknown} in the config's activation_checkpointing "
            f"block; valid keys: {', '.join(CONFIG_KEYS)}"
        )
    chosen = {
        "partition_activations": block.get("partition_activations", False),
        "contiguous_checkpointing": block.get("contiguous_memory_optimization", False),
        "num_checkpoints": block.get("number_checkpoints"),
        "checkpoint_in_cpu": block.get("cpu_checkpointing", False),
        "synchronize": block.get("synchronize_checkpoint_boundary", False),
        "profile": block.get("profile", False),
    }
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    chosen.update({k: v for k, v in given.items() if v is not None})
    if chosen["partition_activations"] and _model_parallel_size(mpu_) > 1:
        raise ValueError(
            f"deepspeed.checkpointing.configure: partition_activations=True with a model-parallel group of "
            f"{_model_parallel_size(mpu_)} ranks is not supported (this package implements no model "
            "parallelism); pass partition_activations=False"
        )
    if chosen["num_checkpoints"] is not None and int(chosen["num_checkpoints"]) < 0:
        raise ValueError(
            f"deepspeed.checkpointing.configure: num_checkpoints={chosen['num_checkpoints']} must be >= 0"
        )
    SETTINGS.mpu = mpu_
    SETTINGS.partition_activations = bool(chosen["partition_activations"])
    SETTINGS.contiguous_checkpointing = bool(chosen["contiguous_checkpointing"])
    SETTINGS.num_checkpoints = chosen["num_checkpoints"]
    SETTINGS.checkpoint_in_cpu = bool(chosen["checkpoint_in_cpu"])
    SETTINGS.synchronize = bool(chosen["synchronize"])
    SETTINGS.profile = bool(chosen["profile"])
    SETTINGS.configured = True


def is_configured() -> bool:
    """True once `configure` ran (and until `reset`)."""
    return SETTINGS.configured


def reset() -> None:
    """Forget the settings of `configure`, as if it never ran."""
    SETTINGS.__init__()


process_state.register("deepspeed.runtime.activation_checkpointing.checkpointing.SETTINGS", SETTINGS, reset)


def set_num_layers(nlayers: int) -> None:
    """Upstream sets the number of checkpointed layers for contiguous buffers; recorded only."""
    SETTINGS.num_checkpoints = int(nlayers)


def _synchronize() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def _region(function: Callable) -> Callable:
    """`function`, synchronized around its forward and its recomputation when configured."""
    if not SETTINGS.synchronize:
        return function

    def synchronized(*args, **kwargs):
        _synchronize()
        try:
            return function(*args, **kwargs)
        finally:
            _synchronize()

    return synchronized


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward.

    Non-reentrant `torch.utils.checkpoint`: parameters get gradients even when no input
    requires one. The recomputation draws the same random numbers as the forward: torch
    restores the default RNG, and the tracker's streams (`get_cuda_rng_tracker()`, which
    model-parallel dropout forks into) are put back as they were when the forward began
    (see `_tracker_contexts`).
    """
    start = time.perf_counter() if SETTINGS.profile else 0.0
    context = _cpu_context() if SETTINGS.checkpoint_in_cpu else contextlib.nullcontext()
    with context:
        out = torch.utils.checkpoint.checkpoint(
            _region(function), *args, use_reentrant=False, context_fn=_tracker_contexts, **kwargs
        )
    if SETTINGS.profile:
        from deepspeed import comm as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            name = getattr(function, "__qualname__", type(function).__name__)
            logger.info(
                f"activation checkpoint forward of {name}: {(time.perf_counter() - start) * 1e3:.2f} ms"
            )
    return out


def _tracker_contexts() -> tuple:
    """`(forward context, recomputation context)` for `torch.utils.checkpoint`'s `context_fn`,
    called as the forward begins: the recomputation runs with the tracker's streams as they
    were then, and the streams the backward has reached come back after it. (A `fork()` in
    the forward advances its stream; recomputing from there would draw other dropout masks.)"""
    at_forward = _RNG_TRACKER.get_states()

    @contextlib.contextmanager
    def recompute():
        current = _RNG_TRACKER.get_states()
        _RNG_TRACKER.set_states(at_forward)
        try:
            yield
        finally:
            _RNG_TRACKER.set_states(current)

    return contextlib.nullcontext(), recompute()


def _cpu_context():
    from deepspeed.accelerator import get_accelerator

    pin = get_accelerator().device_name() != "cpu"
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Upstream's name for the non-reentrant variant; ours always is."""
    return checkpoint(function, *args, **kwargs)


# ============================================================================ RNG tracker


class RNGStatesTracker:
    """Named RNG states that a region can `fork` into and return from (upstream's CUDA RNG tracker).

    Model-parallel code draws dropout masks for sharded tensors from a separate stream, so
    each shard differs; `fork(name)` swaps that stream in and back out.
    """

    def __init__(self) -> None:
        self.states: dict = {}
        self.seeds: set = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict:
        return dict(self.states)

    def set_states(self, states: dict) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(
                f"RNG tracker: seed {seed} is already tracked; use a different seed for {name!r}"
            )
        if name in self.states:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists")
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        self.seeds.add(seed)
        saved = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _RNG_TRACKER_NAME):
        if name not in self.states:
            raise ValueError(
                f"RNG tracker: no state named {name!r}; add it first (model_parallel_cuda_manual_seed)"
            )
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(saved)


_RNG_TRACKER = RNGStatesTracker()
process_state.register(
    "deepspeed.runtime.activation_checkpointing.checkpointing._RNG_TRACKER", _RNG_TRACKER, _RNG_TRACKER.reset
)


# Upstream's names for the tracker's class and instance, which Megatron-style mpu code imports.
CudaRNGStatesTracker = RNGStatesTracker
_CUDA_RNG_STATE_TRACKER = _RNG_TRACKER


def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1) -> None:
    """Upstream's helper: make `new_state` the default RNG state of `device` (an index, a
    name or a torch.device; -1: the current device)."""
    from deepspeed.accelerator import get_accelerator

    index = device if isinstance(device, int) and device >= 0 else None
    if isinstance(device, (str, torch.device)):
        index = torch.device(device).index
    get_accelerator().set_rng_state(new_state, index)


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's RNG tracker (named as upstream; it uses the current accelerator's RNG)."""
    return _RNG_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` and the tracked model-parallel stream with an offset one.

    With no model parallelism here, the model-parallel rank is 0: every rank gets the same
    model-parallel seed, `seed + 2718`, as upstream computes for rank 0.
    """
    from deepspeed.accelerator import get_accelerator

    mp_rank = 0
    if SETTINGS.mpu is not None and hasattr(SETTINGS.mpu, "get_model_parallel_rank"):
        mp_rank = int(SETTINGS.mpu.get_model_parallel_rank())
    _RNG_TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _RNG_TRACKER.add(_RNG_TRACKER_NAME, seed + _MODEL_PARALLEL_SEED_OFFSET + mp_rank)
