"""The ZeRO optimizer of every stage: fp32 master shards, sharded steps, global-norm clipping, loss scaling.

Stage 3 shards partitioned parameters; stages 0-2 shard full ones (stage_1_and_2.py). With
`offload_optimizer`, the masters, their gradients and the optimizer state live on the CPU.

[Note: master shards]
Each trainable ZeRO parameter gets an fp32 master copy of this rank's shard, an
`nn.Parameter` of `partition_size` elements whose `.grad` is the fp32 gradient shard the
`GradientReducer` accumulates into (allocated by the first gradient of a step and freed
after the step, as `zero_grad(set_to_none=True)` does in torch). The wrapped torch optimizer sees only masters, so its
state (Adam moments) is sharded too. After a step the masters are cast back into the
parameters' shards; parameters that stay gathered are then re-gathered.

[Note: whose param groups train]
As upstream: a client optimizer *instance* decides what trains. Its param groups, with their
own lr, weight decay and other hyperparameters, are the groups; `model_parameters` is then
ignored. It keeps its identity (and any scheduler built on it): each group's `params` are
swapped in place from the model's (partitioned) parameters to their masters, and its state
is reset. A callable optimizer, or the config's `optimizer` block, is built on the groups of
`model_parameters` (default: every parameter of the module). Frozen parameters
(`requires_grad=False`) get no master. A trainable parameter that no group holds gets no
master either: the engine frees its gradient once computed (a kept, full `.grad` would grow
every step) and warns at initialize, naming it.

[Note: offloaded gradients land asynchronously]
With `offload_optimizer` on a GPU the masters live in pinned host memory and each reduced
gradient slice arrives on the device. Its first slice of a step is cast and scaled there and
copied down with `non_blocking=True` into a pinned fp32 buffer kept per master across steps
(a pinned allocation per parameter per step cost more than the copy). The copies queue
behind backward on the current stream, so they overlap the rest of backward instead of
stalling it once per parameter, as a blocking `.to("cpu")` did (on an H200 that was 274 of a
466 ms GPT-2-small step). Nothing on the host may read those buffers before they landed:
the reducer calls `settle_gradients()` when the last bucket of a backward is accumulated,
which waits for the device once. A later slice for a master that already has a gradient
(the next micro-step of gradient accumulation) lands the same way in a second pinned buffer,
also kept, and `settle_gradients()` adds it to the gradient once it landed; a third slice
for the same master before that settles the first two.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import loss_scaler_for
from deepspeed.runtime.zero import param_swap
from deepspeed.runtime.zero.lifecycle import ZeroParamState
from deepspeed.runtime.zero.parameter import is_zero_param
from deepspeed.runtime.zero.utils import ZeROOffloadOptimizerError
from deepspeed.utils.logging import log_dist

# Keys of the config's optimizer params that choose the optimizer rather than configure it:
# upstream reads and removes them before building one. Every other key goes to the optimizer's
# constructor, as upstream passes it (torch's `fused` and `foreach` take effect; a key the
# optimizer does not take is its TypeError, naming the key).
_SELECTOR_KEYS = ("torch_adam", "adam_w_mode")


def copy_cast(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target.copy_(source)` where `source` may live on the host in another dtype (an offloaded
    fp32 master written back into a bf16 shard on the GPU): moved first in its own dtype, a
    direct copy from pinned memory, then cast on the target's device. A blocking `copy_`
    across devices and dtypes casts on the host instead, into pageable memory, and copies
    from there."""
    if source.device != target.device and source.dtype != target.dtype:
        source = source.to(target.device)
    target.copy_(source)


def build_config_optimizer(
    name: str, params: dict, groups: list, offload: bool = False
) -> torch.optim.Optimizer:
    """A torch optimizer from the config's `optimizer` block (`type` Adam, AdamW, SGD, Adagrad, Lion,
    or any other torch.optim class by its name, as upstream looks them up).

    With optimizer offload, Adam and AdamW step on the CPU with `DeepSpeedCPUAdam` (as
    upstream), unless the block asks for `torch_adam`, Adagrad with `DeepSpeedCPUAdagrad` and
    Lion with `DeepSpeedCPULion` (`FusedLion` without offload, as upstream). torch's Adam and
    AdamW run their fused kernel (`fused=True`) where it takes the masters, unless the block
    names `fused` or `foreach`.
    """
    kwargs = {k: v for k, v in (params or {}).items() if k not in _SELECTOR_KEYS}
    written, name = name or "", (name or "").lower()
    torch_adam = bool((params or {}).get("torch_adam", False))
    if name in ("adam", "adamw") and not torch_adam:
        # Upstream builds its FusedAdam (or DeepSpeedCPUAdam) here, not torch's: their weight
        # decay defaults to 0, where torch's AdamW's is 0.01. torch's class stands in with
        # FusedAdam's defaults, which are otherwise torch's (lr, betas, eps).
        kwargs.setdefault("weight_decay", 0.0)
    if offload and name in ("adam", "adamw") and not torch_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        adam_w = name == "adamw" or (params or {}).get("adam_w_mode", True)
        return DeepSpeedCPUAdam(groups, adamw_mode=adam_w, **kwargs)
    if name in ("adam", "adamw"):
        # Upstream's Adam defaults to decoupled weight decay (adam_w_mode=True), i.e. AdamW.
        adam_w = name == "adamw" or (params or {}).get("adam_w_mode", True)
        if "fused" not in kwargs and "foreach" not in kwargs and _fused_kernels_take(groups):
            # torch's one-pass kernel: the same update as its default per-tensor loop (about
            # ten passes over memory per tensor on the CPU), 2.6x faster on 1.85M fp32
            # elements here; upstream's FusedAdam is a fused kernel too. A block that names
            # `fused` or `foreach` keeps its choice.
            kwargs["fused"] = True
        return (torch.optim.AdamW if adam_w else torch.optim.Adam)(groups, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(groups, **kwargs)
    if name in ("cpuadam", "deepspeedcpuadam"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, **kwargs)
    if name == "cpuadagrad" or (name == "adagrad" and offload):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(groups, **kwargs)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, **kwargs)
    if name in ("lion", "fusedlion", "cpulion"):
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion if offload or name == "cpulion" else FusedLion)(groups, **kwargs)
    # Any other name is a torch.optim class, spelled as torch spells it (upstream looks it up so).
    torch_class = getattr(torch.optim, written, None)
    if isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer):
        return torch_class(groups, **kwargs)
    raise ValueError(
        f"optimizer.type={written!r} is not supported; use Adam, AdamW, SGD, Adagrad, Lion, CPUAdam, CPUAdagrad, "
        "CPULion or a torch.optim class by its name (RMSprop, NAdam, ...), or pass a torch optimizer to "
        "deepspeed.initialize(optimizer=...)"
    )


def _fused_kernels_take(groups: list) -> bool:
    """Whether torch's fused optimizer kernels take every tensor of `groups` (floating point,
    dense, on a device they support)."""
    try:  # torch's own list; a torch without it gets the per-tensor loop
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    devices = _get_fused_kernels_supported_devices()
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(
        isinstance(p, torch.Tensor) and p.is_floating_point() and not p.is_sparse and p.device.type in devices
        for p in tensors
    )


def _is_ds_cpu_optimizer(client: Any) -> bool:
    """Whether `client` is one of the CPU optimizers that offload steps with (as upstream checks)."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion

    return isinstance(client, (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion))


def is_optimizer_instance(obj: Any) -> bool:
    """A built optimizer (its groups decide what trains), as opposed to a callable that builds one."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    return hasattr(obj, "param_groups") and hasattr(obj, "step") and not callable(obj)


def _zero_state_of(param: nn.Parameter) -> Optional[ZeroParamState]:
    return param._zero_state if is_zero_param(param) else None


def _param_groups(module: nn.Module, model_parameters: Any) -> list:
    """Groups as dicts with `params` lists, from `model_parameters` or the module's parameters."""
    source = list(model_parameters) if model_parameters is not None else list(module.parameters())
    if source and isinstance(source[0], dict):
        return [dict(g, params=list(g["params"])) for g in source]
    return [{"params": source}]


# [Note: the same gradients on every rank]
# Gradients are reduced in buckets in the order autograd finishes them, and parameters are
# gathered (stage 3) as modules run, so every rank must use the same parameters in each
# pass: the collectives carry no names. A parameter used on one rank only breaks that. When
# the buckets then differ in size the collective fails (gloo names a "collective mismatch");
# when they happen to be the same size (two same-shaped branches, one per rank) each rank
# silently adds its gradients to the other's. So `accumulate_grad` folds each reduced slice's
# parameter into `h`, a hash of the order in which this rank's reductions arrived since the
# last step (every micro-step's: with accumulation, two ranks may end up with gradients for
# the same parameters after reducing them in swapped buckets). Each step's norm all-reduce
# also sums `h` and its square: the ranks agree exactly when world * sum(h^2) == sum(h)^2
# (equality in Cauchy-Schwarz), which every rank computes from the same sums, so all of them
# refuse the step together. `h` stays below 2^20, so the float64 sums are exact.
_SIGNATURE_MODULUS = 1 << 20


def _id_hash(ds_id: int) -> int:
    return (ds_id * 2654435761 + 12345) % _SIGNATURE_MODULUS  # Knuth's multiplicative hash


class UnusedParametersError(RuntimeError, AssertionError):
    """A step found trainable parameters without a gradient under `ignore_unused_parameters:
    false`. Also an AssertionError, which is what upstream raises there and what its users catch."""


def skips_nonfinite_steps(config: Any) -> bool:
    """Whether a step whose gradients hold inf or nan is skipped, as upstream 0.19 does: at
    every stage and precision (fp16 also backs its loss scale off), except bf16 with
    `bf16.check_grad_overflow: false` at stages 1-2, which applies it (upstream's stage 3 and
    its stage-0 bf16 optimizer skip on an invalid norm whatever that key says)."""
    opted_out = config.bfloat16_enabled and not config.bfloat16_check_grad_overflow
    return not (opted_out and config.zero_optimization_stage in (1, 2))


class ZeroStage3Optimizer(ZeROOptimizer):
    """Steps fp32 master shards; `param_groups` and `state` are the wrapped optimizer's."""

    def __init__(
        self,
        module: nn.Module,
        config: Any,
        client_optimizer: Any = None,
        model_parameters: Any = None,
        master_device: Optional[torch.device] = None,
        state_of: Callable[[nn.Parameter], Any] = None,
        pin_masters: bool = False,
        *,
        before_step: Optional[Callable[[], None]] = None,
        after_step: Optional[Callable[[], None]] = None,
        before_zero_grad: Optional[Callable[[], None]] = None,
        leaf_grads: Any = None,
        parameter_offload: Any = None,
        swap: Any = None,
        replica_group: Any = None,
    ) -> None:
        self.config = config
        self._module = module  # for parameter names in errors
        self.offload = master_device is not None  # masters, their grads and the state off the device
        # The engine's: settle live gathers first, refresh full or gathered tensors after (see step()).
        self.before_step = before_step
        self.after_step = after_step
        # The engine's: drops what its hooks took from a backward outside engine.backward.
        self.before_zero_grad = before_zero_grad
        # The engine's leaf-module units, whose unused parameters a step must skip
        # (leaf_grads.py's note); None: there are none to ask about.
        self.leaf_grads = leaf_grads
        # MiCS: the ranks holding the same shards in the other replicas; the step's checks of
        # which gradients each rank produced span them too (`_global_norm_of_scaled_grads`).
        self.replica_group = replica_group
        # Stage 3: the engine's ParameterCoordinator, under upstream's name for the object that
        # owns the module hooks (hooks.py's note on the hooks under upstream's names); None below stage 3.
        self.parameter_offload = parameter_offload
        self.pin_masters = pin_masters
        # `offload_optimizer` with device "nvme": masters and state live in swap files
        # (nvme_optimizer.py's note); None keeps them in memory.
        self.swap_config = swap
        self.swapper = None
        # ds_id -> pinned fp32 buffer an offloaded master's gradient lands in, kept across steps,
        # and whether copies into them may still be in flight (see the note above).
        self._host_grads: dict = {}
        self._host_grads_in_flight = False
        # ds_id -> pinned fp32 buffer a later slice lands in (gradient accumulation), and the
        # (gradient, landed slice) pairs settle_gradients() adds once they landed.
        self._host_staging: dict = {}
        self._pending_adds: dict = {}
        # param -> the object that owns its shard: a ZeroParamState (stage 3, the default) or
        # a ReplicatedShard (stages 0-2, see stage_1_and_2.py); None for no shard.
        self.state_of = state_of or _zero_state_of
        self.group = None
        self._stepping_client = False  # True while step() steps it (`_refuse_direct_steps`)
        self._reduced_order = 0  # a hash of the reductions since the last step (see the note above)
        self.masters: dict = {}  # ds_id -> fp32 master nn.Parameter [partition_size]
        self._master_versions: dict = {}  # ds_id -> the shard_version the master reflects
        self.states: list = []  # trainable ZeroParamStates, in parameter order
        if is_optimizer_instance(client_optimizer):
            source = client_optimizer.param_groups  # [Note: whose param groups train]
        else:
            source = _param_groups(module, model_parameters)
        groups = self._master_groups(module, source, master_device)
        self.optimizer = self._wrap_optimizer(client_optimizer, groups)
        if swap is not None:
            self.swapper = self._build_swapper(swap)
        # Stage 3 partitions swapped to NVMe (every parameter's, frozen ones too): their write
        # errors join the step's agreement (param_swap.py's [Note: a failed write]).
        self.param_swappers = param_swap.swappers_of(
            [p._zero_state for p in module.parameters() if is_zero_param(p)]
            if parameter_offload is not None
            else []
        )
        self.loss_scaler = loss_scaler_for(config)
        self.overflow = False
        self.skips_nonfinite_steps = skips_nonfinite_steps(config)
        self.clip = float(config.gradient_clipping or 0.0)
        self._global_grad_norm: Optional[float] = None

    # ------------------------------------------------------------------ set-up

    def _master_groups(self, module: nn.Module, groups: list, master_device: Optional[torch.device]) -> list:
        ours = {id(p) for p in module.parameters()}
        seen: set = set()
        out = []
        for index, group in enumerate(groups):
            masters = []
            for p in group["params"]:
                state = self.state_of(p) if id(p) in ours else None
                if state is None and (id(p) not in ours or p.requires_grad):
                    raise ValueError(
                        f"optimizer param group {index} holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the model passed to deepspeed.initialize; build the optimizer on the "
                        "model's parameters"
                    )
                if not p.requires_grad or state.ds_id in seen:
                    continue
                seen.add(state.ds_id)
                masters.append(self._make_master(state, master_device))
            out.append(dict(group, params=masters))
        return out

    def _make_master(self, state: ZeroParamState, device: Optional[torch.device]) -> nn.Parameter:
        target = torch.device(device) if device is not None else state.shard.device
        if (
            state.shard.dtype == torch.float32
            and state.shard.device == target
            and state.swapper is None
            and self.swap_config is None
        ):
            # fp32 training: the shard already is this rank's fp32 slice; the master shares it
            # (4 bytes per parameter less) and the write-back after a step has nothing to copy.
            # A partition swapped to NVMe is not always in memory: its master is a copy.
            master = nn.Parameter(state.shard.detach())
        elif self.swap_config is not None:
            # NVMe: the swapper writes each master's first values (the shard's) to its file one
            # sub-group at a time (`_build_swapper`), so set-up never holds every master at once:
            # 4 bytes per parameter, more than a model that needs NVMe has room for.
            master = nn.Parameter(torch.full((1,), float("nan")).expand(state.partition_size))
        else:
            data = state.shard.detach().to(target, torch.float32, copy=True)
            if self.pin_masters and self.swap_config is None:  # a swapped master lives in pool buffers
                data = get_accelerator().pin_memory(data)
            master = nn.Parameter(data)
        master.grad = None  # allocated by the first reduced gradient, freed after each step
        self.masters[state.ds_id] = master
        self._master_versions[state.ds_id] = state.shard_version
        self.states.append(state)
        self.group = state.group
        return master

    def _build_swapper(self, offload: Any) -> Any:
        """Move the masters (and any state) into swap files; every rank raises if any failed."""
        from deepspeed.runtime.swap_tensor.swap_store import AioSettings
        from deepspeed.runtime.zero.nvme_optimizer import OptimizerSwapper, agree_on_setup

        masters = [m for group in self.optimizer.param_groups for m in group["params"]]
        shard_of = {id(self.masters[s.ds_id]): s for s in self.states}
        aio = AioSettings.from_block(self.config.typed_config.aio)
        rank = dist.get_rank() if dist.is_initialized() else 0
        sub_group = self.config.zero_config.sub_group_size
        return agree_on_setup(
            "zero_optimization.offload_optimizer (device 'nvme') set-up",
            lambda: OptimizerSwapper(
                self.optimizer,
                masters,
                offload,
                sub_group,
                aio,
                f"optimizer_rank{rank}",
                initial_value=lambda master: shard_of[id(master)].shard.detach(),
            ),
        )

    def resident(self) -> Any:
        """A context in which every master and optimizer state tensor is in host memory: a
        no-op, unless they are swapped to NVMe (nvme_optimizer.py's [Note: a swapped-out tensor])."""
        return contextlib.nullcontext() if self.swapper is None else self.swapper.resident()

    def _wrap_optimizer(self, client: Any, groups: list) -> torch.optim.Optimizer:
        if client is None:
            return build_config_optimizer(
                self.config.optimizer_name, self.config.optimizer_params, groups, self.offload
            )
        if self.offload and self.config.zero_force_ds_cpu_optimizer and not _is_ds_cpu_optimizer(client):
            raise ZeROOffloadOptimizerError(
                f"zero_optimization.offload_optimizer steps on the CPU, but the client optimizer is "
                f"{type(client).__name__}; pass deepspeed.ops.adam.DeepSpeedCPUAdam or "
                "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad or deepspeed.ops.lion.DeepSpeedCPULion (or use the config's "
                "optimizer block), or set zero_force_ds_cpu_optimizer: false to step it on the CPU anyway"
            )
        if not is_optimizer_instance(client):
            if not callable(client):
                raise TypeError(
                    f"deepspeed.initialize: optimizer must be a torch optimizer or a callable that builds "
                    f"one from param groups, got {type(client).__name__}"
                )
            return client(groups)  # upstream accepts a callable that builds the optimizer
        # The groups were read from the client itself: swap in the masters, in place.
        for target, group in zip(client.param_groups, groups):
            target["params"] = group["params"]
        client.state.clear()
        self._refuse_direct_steps(client)
        return client

    def _refuse_direct_steps(self, client: torch.optim.Optimizer) -> None:
        """Make `client.step()` raise unless this wrapper is stepping it.

        The script still holds the optimizer it passed to `initialize`, and a tutorial-style
        loop calls `optimizer.step()` on it. Its param groups now hold this rank's fp32
        master shards: such a step would move each rank's shards apart from the weights
        (nothing unscaled, clipped or written back), silently. The guard is a bound method on
        the instance, so torch's LR schedulers can still wrap `step` (they read `__func__`).
        """
        real_step = client.step
        wrapper = self

        def guarded_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not wrapper._stepping_client:
                raise RuntimeError(
                    f"the {type(optimizer).__name__} passed to deepspeed.initialize was stepped directly: under "
                    "ZeRO its param groups hold this rank's fp32 master shards, so the model would not change "
                    "and the ranks would drift apart; call engine.step() (or step the optimizer initialize "
                    "returned), which unscales, clips, steps and writes the new weights back on every rank"
                )
            return real_step(*args, **kwargs)

        # A torch LR scheduler made before initialize marked the step it wrapped; the mark
        # (read through the bound method) keeps it from warning that step was overridden.
        if getattr(real_step, "_wrapped_by_lr_sched", False):
            guarded_step._wrapped_by_lr_sched = True
        client.step = types.MethodType(guarded_step, client)

    # ------------------------------------------------------------------ what the engine calls

    def drop_grad_shard(self, state: ZeroParamState) -> None:
        """Forget `state`'s fp32 gradient shard (stage 0 replaces it at each reduction)."""
        self.masters[state.ds_id].grad = None

    def accumulate_grad(self, state: ZeroParamState, reduced: torch.Tensor, alpha: float) -> None:
        """Add `alpha * reduced` (this rank's reduced slice) to `state`'s fp32 gradient shard.

        The first slice of a step becomes the shard itself when it already is an fp32 tensor
        where the master lives (a view into the reducer's receive buffer, which holds nothing
        else): no zero-filled allocation, no add. Pinned masters (optimizer offload) always
        get a pinned copy, so the host-to-device traffic stays on pinned pages.
        """
        # [Note: the same gradients on every rank]: the order of reductions, as a rolling hash.
        self._reduced_order = (self._reduced_order * 1_000_003 + _id_hash(state.ds_id)) % _SIGNATURE_MODULUS
        master = self.masters[state.ds_id]
        if self.pin_masters:
            self._land_on_host(state.ds_id, master, reduced, alpha)
            return
        if master.grad is None:
            if reduced.dtype == torch.float32 and reduced.device == master.device:
                master.grad = reduced.mul_(alpha) if alpha != 1.0 else reduced
                return
            grad = torch.empty_like(master)
            torch.mul(reduced.to(device=grad.device, dtype=torch.float32), alpha, out=grad)
            master.grad = grad
            return
        master.grad.add_(reduced.to(device=master.device, dtype=torch.float32), alpha=alpha)

    def _land_on_host(self, ds_id: int, master: nn.Parameter, reduced: torch.Tensor, alpha: float) -> None:
        """An offloaded master's gradient slice: scaled where it was reduced, then copied without
        blocking into a pinned buffer, the gradient itself for the first slice of a step, else a
        staging buffer added at the next settle ([Note: offloaded gradients land asynchronously])."""
        if master.grad is None:
            buffers = self._host_grads
        else:
            if ds_id in self._pending_adds:
                self.settle_gradients()  # its staging buffer is about to be reused
            buffers = self._host_staging
        buffer = buffers.get(ds_id)
        if buffer is None or buffer.shape != master.shape:
            buffer = buffers[ds_id] = get_accelerator().pin_memory(torch.empty_like(master))
        scaled = reduced.to(torch.float32)  # the reducer's view, which this may keep or change
        if alpha != 1.0:
            scaled = scaled.mul_(alpha)
        buffer.copy_(scaled, non_blocking=True)
        if master.grad is None:
            master.grad = buffer
        else:
            self._pending_adds[ds_id] = (master.grad, buffer)
        self._host_grads_in_flight = True

    def settle_gradients(self) -> None:
        """Wait until every gradient slice copied to the host without blocking has landed, then
        add the staged ones (the reducer calls this at the end of each backward's reduction)."""
        if not self._host_grads_in_flight:
            return
        get_accelerator().synchronize()
        self._host_grads_in_flight = False
        for grad, landed in self._pending_adds.values():
            grad.add_(landed)
        self._pending_adds.clear()

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # Upstream's optimizer attributes that callers read, answered from this wrapper.

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    @property
    def clip_grad(self) -> float:
        return self.clip

    @property
    def dp_process_group(self) -> Any:
        """The group the masters are partitioned over (None: the world)."""
        return self.group

    @property
    def partition_count(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def cpu_offload(self) -> bool:
        """Whether the masters and the optimizer state live on the CPU (`offload_optimizer`)."""
        return self.offload

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient so far: free (or zero) the reduced fp32 shards, which between
        steps would cost 4 bytes/parameter, and the parameters' own `.grad`, where stages 0-1
        accumulate whole gradients until the boundary (and where one left before `initialize`
        would otherwise join the first step), as upstream's zero_grad does. Gradients a
        backward outside engine.backward left with the engine (another model's backward that
        reached these parameters, as a GAN's generator loss does) are discarded too."""
        if self.before_zero_grad is not None:
            self.before_zero_grad()
        self._reduced_order = 0
        if self.leaf_grads is not None:
            self.leaf_grads.present.clear()
        for state in self.states:
            if getattr(state, "accumulated", None) is not None:  # stages 0-1: an fp32 sum of micro-steps
                state.accumulated = None
        for tensor in [*self.masters.values(), *(state.param for state in self.states)]:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.zero_()

    def untrained(self, module: nn.Module) -> list:
        """Names of `module`'s trainable parameters that no optimizer group holds."""
        return [
            n
            for n, p in module.named_parameters()
            if p.requires_grad and self.state_of(p).ds_id not in self.masters
        ]

    def _grads(self) -> list:
        return [m.grad for m in self.masters.values() if m.grad is not None]

    @property
    def averaged_gradients(self) -> dict:
        """Upstream's name for the reduced gradient shards: `{group index: [shards]}`, the
        values of `get_fp32_grad_partitions()` in the group's order."""
        return {g: list(grads.values()) for g, grads in self.get_fp32_grad_partitions().items()}

    def flat_master_copies(self) -> list:
        """Per optimizer param group, this rank's fp32 master shards back to back in one 1D
        tensor (each shard's padding included), a copy: upstream keeps its masters in such
        flat buffers and exposes them (`fp32_partitioned_groups_flat` at stage 3,
        `single_partition_of_fp32_groups` below), which callers read to compare or inspect
        the masters. Here masters are per parameter; change them through `load_state_dict` or
        `deepspeed.utils.safe_set_local_fp32_param`, not through these copies."""
        out = []
        with self.resident():
            for group in self.optimizer.param_groups:
                masters = [m.detach().reshape(-1) for m in group["params"]]
                out.append(torch.cat(masters) if masters else torch.empty(0, dtype=torch.float32))
        return out

    def get_fp32_grad_partitions(self) -> dict:
        """`{group index: {index in the group: this rank's fp32 gradient shard}}` for every
        master that has a gradient since the last step or zero_grad (upstream's name). A shard
        covers the rank's partition, the padding at the end of the last rank's being zeros;
        under fp16 it is still multiplied by the loss scale (a step divides it out)."""
        self.settle_gradients()  # offloaded slices still landing would be missed otherwise
        out: dict = {}
        for g, group in enumerate(self.optimizer.param_groups):
            grads = {i: m.grad for i, m in enumerate(group["params"]) if m.grad is not None}
            if grads:
                out[g] = grads
        return out

    def _global_norm_of_scaled_grads(self) -> float:
        """The L2 norm over every rank's gradient shards (inf or nan when any overflowed).

        One fused per-tensor norm and one all-reduce, on the communication device (an NCCL
        group rejects a CPU tensor; masters may live on the CPU); padding elements are zeros.
        The same all-reduce checks that every rank has gradients for the same parameters
        (see [Note: the same gradients on every rank]).
        """
        grads = self._grads()
        comm_device = torch.device(get_accelerator().current_device_name())
        signature = self._reduced_order
        # Which leaf-module parameters got a real gradient here (leaf_grads.py's note) ride along.
        presence = self.leaf_grads.presence() if self.leaf_grads is not None else []
        local = torch.tensor(
            [0.0, signature, signature * signature, *presence], dtype=torch.float64, device=comm_device
        )
        if grads:
            norms = torch._foreach_norm(grads)
            # Summed where the gradients live, then moved: one copy per device, not one per gradient.
            by_device: dict = {}
            for norm in norms:
                by_device.setdefault(norm.device, []).append(norm)
            for same_device in by_device.values():
                local[0] += torch.stack(same_device).double().pow(2).sum().to(comm_device)
        dist.all_reduce(local, group=self.group)
        ranks = dist.get_world_size(self.group)
        if self.replica_group is not None and presence:
            # MiCS: the norm is one replica's (the shard group's sum: every replica holds the
            # same averaged gradients), but which leaf parameters got a gradient is the whole
            # world's: an expert used only in another replica still trained, and every replica
            # must step it alike. (Without leaves, the step needs no collective across replicas.)
            dist.all_reduce(local[1:], group=self.replica_group)
            ranks *= dist.get_world_size(self.replica_group)
        norm_sq, signatures, squares, *used = local.tolist()
        for ds_id in self.leaf_grads.unused(used) if presence else []:
            self.masters[ds_id].grad = None  # zero-filled on every rank: no rank used it
        if squares * ranks != signatures * signatures:
            raise RuntimeError(
                "ZeRO step: the ranks reduced gradients of different parameters in this step (a parameter "
                "used on some ranks only: a data-dependent branch, a routed expert, a modality-specific "
                "head); every rank summed what it was sent with gradients of other parameters, so the step "
                "is refused. Every rank must produce gradients for the same parameters in each backward: "
                "make each rank use every trainable parameter (for a skipped branch, add 0.0 * "
                "branch(h).sum() to the loss), or freeze the parameters it does not train"
            )
        return math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf")

    def _refuse_unused_parameters(self) -> None:
        """`ignore_unused_parameters: false`: a trainable parameter that got no gradient since
        the last step is an error, as upstream's. The norm's all-reduce has just checked that
        every rank reduced the same parameters, so every rank raises here, none hangs."""
        unused = [state for state in self.states if self.masters[state.ds_id].grad is None]
        if not unused:
            return
        names = {id(p): n for n, p in self._module.named_parameters()}
        shown = ", ".join(names.get(id(state.param), f"ds_id {state.ds_id}") for state in unused[:5])
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise UnusedParametersError(
            f"ZeRO step: {len(unused)} trainable parameters got no gradient since the last step ({shown}{more}) "
            "and zero_optimization.ignore_unused_parameters is false; use them in the forward, freeze them "
            "(requires_grad=False), or set ignore_unused_parameters to true (the default), which leaves them "
            "untouched by the step as torch does"
        )

    def step(self) -> bool:
        """Unscale, check overflow, clip, step, and write masters back. False if skipped.

        The engine's `before_step` / `after_step` run around it (live gathers settled first,
        full or gathered tensors refreshed after), so a client that calls this directly
        (Lightning's Fabric does) leaves the model as consistent as `engine.step()` does.
        """
        if self.before_step is not None:
            self.before_step()
        scale = self.loss_scaler.loss_scale
        scaled_norm = self._global_norm_of_scaled_grads()
        if not self.config.zero_config.ignore_unused_parameters:
            self._refuse_unused_parameters()
        self.overflow = self.skips_nonfinite_steps and not math.isfinite(scaled_norm)
        if self.overflow:
            self.loss_scaler.update_scale(True)  # fp16's dynamic scale backs off (and logs it)
            self._global_grad_norm = float("inf")  # as upstream reports a skipped step's norm
            if not self.loss_scaler.dynamic:
                log_dist(
                    f"step skipped: the gradients hold inf or nan (global norm {scaled_norm}); the weights, "
                    "optimizer state and learning-rate schedule are unchanged",
                    ranks=[0],
                    level=logging.WARNING,
                )
            return False
        norm = scaled_norm / scale
        self._global_grad_norm = norm
        factor = 1.0 / scale
        if self.clip > 0 and norm > self.clip:
            factor *= self.clip / (norm + 1e-6)
        grads = self._grads() if factor != 1.0 else []
        if grads:  # none: no backward ran since the last step (fp16's unscale has nothing to do)
            torch._foreach_mul_(grads, factor)
        error = None
        self._stepping_client = True  # the client optimizer's guard (`_refuse_direct_steps`) lets it step
        try:
            if self.swapper is None:
                self.refresh_edited_masters()
                self.optimizer.step()
                self._write_back_masters()
            else:
                error = self.swapper.step(self._step_sub_group)
        finally:
            self._stepping_client = False
        self._agree_on_swapping(error)
        if self.after_step is not None:
            self.after_step()
        self.loss_scaler.update_scale(False)
        return True

    def _agree_on_swapping(self, error: Optional[Exception]) -> None:
        """Anything on NVMe: raise this step's swap errors on every rank (nvme_optimizer.agree_on_step)."""
        from deepspeed.runtime.zero.nvme_optimizer import agree_on_step

        if self.swapper is None and not self.param_swappers:
            return  # the same on every rank: the same model and config
        param_errors = [e for e in (s.take_io_error() for s in self.param_swappers) if e is not None]
        agree_on_step(error or next(iter(param_errors), None))

    def _step_sub_group(self, masters: list) -> None:
        """NVMe: one sub-group's step, its masters and state read in (nvme_optimizer.py)."""
        from deepspeed.runtime.zero.nvme_optimizer import step_only

        ids = {id(m) for m in masters}
        states = [s for s in self.states if id(self.masters[s.ds_id]) in ids]
        self.refresh_edited_masters(states)
        step_only(self.optimizer, masters)
        self._write_back_masters(states)

    @torch.no_grad()
    def refresh_edited_masters(self, states: Optional[list] = None) -> None:
        """Copy shards edited since the last step or load into their masters (local, no collective).

        A `GatheredParameters(modifier_rank=...)` edit lands in the shard; a bf16/fp16 master
        (a separate copy) would still hold the old value. Every reader of the masters calls
        this first: `step()`, and `save_checkpoint` (whose files zero_to_fp32 reads).
        """
        if states is None and self.swapper is not None and not self.swapper.is_resident:
            # Swapped masters are refreshed group by group as each steps (and inside resident()).
            return
        for state in self.states if states is None else states:
            if state.shard_version != self._master_versions[state.ds_id]:
                master = self.masters[state.ds_id]
                if master.data_ptr() != state.shard.data_ptr():
                    master.data.copy_(state.shard)
                self._master_versions[state.ds_id] = state.shard_version

    def mark_master_current(self, state: ZeroParamState) -> None:
        """`state`'s master and shard were just set together (a load): no edit is pending."""
        self._master_versions[state.ds_id] = state.shard_version

    @torch.no_grad()
    def _write_back_masters(self, states: Optional[list] = None) -> None:
        for state in self.states if states is None else states:
            master = self.masters[state.ds_id]
            if state.swapper is not None:  # written out when evicted; never read just to overwrite
                state.swapper.overwrite(state, master.data)
            elif master.data_ptr() != state.shard.data_ptr():  # not shared (see _make_master)
                copy_cast(state.shard, master.data)

    def get_global_grad_norm(self) -> Union[torch.Tensor, float, None]:
        """The last step's gradient norm before clipping, as upstream returns it: a 0-dim fp32
        tensor (code written for upstream calls `.item()` or `torch.isfinite` on it), the float
        `inf` after a step skipped on overflow, None before the first step."""
        norm = self._global_grad_norm
        if norm is None or math.isinf(norm):
            return norm
        return torch.tensor(norm, dtype=torch.float32)

    def state_dict(self) -> dict:
        inner = self.optimizer.state_dict()
        if self.swapper is not None:  # copies, in scratch files (nvme_optimizer.py's checkpoint note)
            inner["state"] = self.swapper.copy_state(inner["state"])
        return {
            "optimizer": inner,
            "loss_scaler": self.loss_scaler.state_dict(),
            "overflow": self.overflow,
        }

    def load_state_dict(self, sd: dict) -> None:
        with self.resident():
            self.optimizer.load_state_dict(sd["optimizer"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.overflow = sd.get("overflow", False)
