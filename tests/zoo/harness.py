"""Parity harness: one model trained under ZeRO-3 on the ranks and as DDP-style plain PyTorch.

The reference runs in every rank's process: for each optimizer step it runs each rank's
micro-batch separately through one plain model (loss / (world size * accumulation steps),
so the gradients are DDP's averaged ones), keeps one copy of the buffers per rank (each
rank's BatchNorm sees only its own micro-batches), then steps a torch optimizer. The
engine side feeds this rank its micro-batches through `engine(...)`, `engine.backward`,
`engine.step`. `compare` checks this rank's loss at every micro-step (rtol 1e-5), the
gathered final parameters (atol 5e-5) and this rank's buffers, and appends one line per
rank to the results file (`DS_ZOO_RESULTS`, default `<tmp>/ds_zoo_results.tsv`).

Both sides run on the accelerator's device (the CPU here, a GPU under CUDA): batches are made
on the CPU from one seed and moved by `on_device`, and comparisons are made on CPU copies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5
SEED = 1234
DATA_SEED = 99


def device() -> torch.device:
    """Where both sides train: this rank's accelerator device."""
    return torch.device(get_accelerator().current_device_name())


def on_device(batch: Any) -> Any:
    """A batch (tensors in tuples, lists or dicts) moved to `device()`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device())
    if isinstance(batch, (tuple, list)):
        return type(batch)(on_device(item) for item in batch)
    if isinstance(batch, dict):
        return {key: on_device(value) for key, value in batch.items()}
    return batch


def results_path() -> str:
    return os.environ.get("DS_ZOO_RESULTS", os.path.join(tempfile.gettempdir(), "ds_zoo_results.tsv"))


def record(case: str, status: str, **numbers: Any) -> None:
    fields = [case, f"rank{dist.get_rank()}", status]
    fields += [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()]
    with open(results_path(), "a") as f:
        f.write("\t".join(fields) + "\n")


@contextlib.contextmanager
def recorded(case: str):
    """Record an exception's first line under `case` before it propagates."""
    try:
        yield
    except Exception as exc:
        if not getattr(exc, "_zoo_recorded", False):
            lines = str(exc).strip().splitlines() or [""]
            where = traceback.extract_tb(exc.__traceback__)[-1]
            record(case, "ERROR", error=f"{type(exc).__name__}: {lines[0][:200]}", at=f"{where.name}")
        raise


def zero_config(micro: int, gas: int = 1, stage: int = 3, **extra: Any) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # the references do not clip; the default (upstream's) clips at 1.0
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 500,
        },
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@dataclass
class Case:
    """One zoo case. `optimizer`: None trains with the config's SGD (lr, momentum 0.9) on every
    parameter; else a factory `model -> torch optimizer`, applied to both copies and passed to
    `deepspeed.initialize(optimizer=...)`. `between(model, step)` runs after each optimizer
    step on the reference and on `engine.module`, and returns a tensor to compare (or None)."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple]
    loss_fn: Callable[[Any, tuple], torch.Tensor]
    steps: int = 3
    gas: int = 1
    lr: float = 0.1
    clip: float = 0.0
    optimizer: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None
    under_init: bool = False
    bf16: bool = False
    between: Optional[Callable[[nn.Module, int], Optional[torch.Tensor]]] = None
    config_extra: dict = field(default_factory=dict)
    stage: int = 3  # the ZeRO stage; stages 1-2 keep full parameters (never under_init)
    offload: bool = False  # offload_optimizer to the CPU (masters, gradients and state)

    def __post_init__(self) -> None:
        if self.stage != 3:
            self.name = f"{self.name}@stage{self.stage}"
        if self.offload:
            self.name = f"{self.name}+offload"

    def micro_batches(self, ws: int) -> list:
        """Global data: `[step][micro][rank]` micro-batches, identical on every rank."""
        gen = torch.Generator().manual_seed(DATA_SEED)
        return [
            [[self.make_batch(gen) for _ in range(ws)] for _ in range(self.gas)] for _ in range(self.steps)
        ]

    def config(self) -> dict:
        micro = len(self.make_batch(torch.Generator().manual_seed(0))[0])
        extra = dict(self.config_extra)
        if self.optimizer is None:
            extra["optimizer"] = {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9}}
        if self.clip:
            extra["gradient_clipping"] = self.clip
        if self.bf16:
            extra["bf16"] = {"enabled": True}
        if self.offload:
            # A torch SGD / client optimizer steps the CPU masters (upstream asks for this opt-in).
            extra["zero_optimization"] = {"offload_optimizer": {"device": "cpu"}}
            extra["zero_force_ds_cpu_optimizer"] = False
        return zero_config(micro, self.gas, self.stage, **extra)

    def reference_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer(model)
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)


@dataclass
class Run:
    model: nn.Module  # the reference model, or engine.module
    losses: list  # this rank's loss per (step, micro)
    buffers: dict  # this rank's buffers at the end
    outputs: list = field(default_factory=list)  # what `between` returned, per step
    grad_norms: list = field(default_factory=list)
    engine: Any = None


def _buffers(model: nn.Module) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _load_buffers(model: nn.Module, saved: dict) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(saved[n])


def _autocast(enabled: bool):
    return torch.autocast(device().type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def build(case: Case, zero: bool) -> nn.Module:
    torch.manual_seed(SEED)
    if not case.under_init:
        return case.build()
    if zero:
        with deepspeed.zero.Init(config_dict_or_path=case.config()):
            return case.build()
    # zero.Init creates tensors on the accelerator, as upstream's does, so the initial values
    # come from that device's generator: the reference is built there too.
    with device():
        return case.build()


def _global_norm(params) -> float:
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def run_reference(case: Case, data: list, model: Optional[nn.Module] = None) -> Run:
    """DDP-style plain PyTorch on `device()`; bf16 cases run under autocast."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = (model if model is not None else build(case, zero=False)).to(device())
    opt = case.reference_optimizer(model)
    per_rank = [_buffers(model) for _ in range(ws)]
    losses, outputs, norms = [], [], []
    for step in data:
        opt.zero_grad(set_to_none=True)
        for micro in step:
            for r, batch in enumerate(micro):
                _load_buffers(model, per_rank[r])
                with _autocast(case.bf16):
                    loss = case.loss_fn(model, on_device(batch))
                (loss.float() / (ws * case.gas)).backward()
                per_rank[r] = _buffers(model)
                if r == rank:
                    losses.append(loss.item())
        trainable = [p for p in model.parameters() if p.grad is not None]
        norms.append(_global_norm(trainable))
        if case.clip:
            torch.nn.utils.clip_grad_norm_(trainable, case.clip)
        opt.step()
        if case.between is not None:
            _load_buffers(model, per_rank[rank])
            with _autocast(case.bf16):
                outputs.append(case.between(model, len(outputs)))
    return Run(model, losses, per_rank[rank], outputs, norms)


def initialize(case: Case, model: nn.Module):
    kwargs = {}
    if case.optimizer is not None:
        kwargs["optimizer"] = case.optimizer(model)
    engine, _, _, _ = deepspeed.initialize(model=model, config=case.config(), **kwargs)
    return engine


def run_engine(case: Case, data: list, engine: Any = None) -> Run:
    rank = dist.get_rank()
    engine = engine if engine is not None else initialize(case, build(case, zero=True))
    losses, outputs, norms = [], [], []
    for step in data:
        for micro in step:
            loss = case.loss_fn(engine, on_device(micro[rank]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        if case.between is not None:
            outputs.append(case.between(engine.module, len(outputs)))
    return Run(engine.module, losses, _buffers(engine.module), outputs, norms, engine)


def gathered(model: nn.Module) -> dict:
    """`{name: fp32 copy on the CPU}` of every parameter, gathered from the shards."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> tuple:
    """(largest |a - b| over all entries, the name where it is)."""
    worst, where = 0.0, ""
    for name in a:
        d = (a[name].float().cpu() - b[name].float().cpu()).abs().max().item() if a[name].numel() else 0.0
        if d > worst or d != d:  # keep NaN
            worst, where = d, name
    return worst, where


def compare(
    case: Case,
    got: Run,
    ref: Run,
    loss_rtol: float = LOSS_RTOL,
    param_atol: float = PARAM_ATOL,
    output_atol: float = PARAM_ATOL,
    check_buffers: bool = True,
) -> dict:
    """Check loss per micro-step, final parameters, buffers and `between` outputs; record the numbers."""
    eng_params, ref_params = (
        gathered(got.model),
        {n: p.detach().float() for n, p in ref.model.named_parameters()},
    )
    problems = []
    if set(eng_params) != set(ref_params):
        problems.append(f"parameter names differ: {sorted(set(eng_params) ^ set(ref_params))}")
    common = {n: eng_params[n] for n in eng_params if n in ref_params}
    param_diff, param_where = max_abs_diff(common, ref_params)
    got_l, ref_l = (
        torch.tensor(got.losses, dtype=torch.float64),
        torch.tensor(ref.losses, dtype=torch.float64),
    )
    if got_l.shape != ref_l.shape:
        problems.append(f"{len(got.losses)} engine losses vs {len(ref.losses)} reference losses")
        loss_abs = loss_rel = float("nan")
    else:
        loss_abs = (got_l - ref_l).abs().max().item()
        loss_rel = ((got_l - ref_l).abs() / ref_l.abs().clamp_min(1e-12)).max().item()
    buf_diff, buf_where = 0.0, ""
    if check_buffers and got.buffers:
        buf_diff, buf_where = max_abs_diff(got.buffers, ref.buffers)
    out_diff = 0.0
    for a, b in zip(got.outputs, ref.outputs):
        if a is not None:
            out_diff = max(out_diff, (a.float().cpu() - b.float().cpu()).abs().max().item())
    numbers = dict(loss_abs=loss_abs, loss_rel=loss_rel, param=param_diff, buffer=buf_diff, output=out_diff)
    if not loss_rel <= loss_rtol:
        problems.append(
            f"loss rel diff {loss_rel:.3g} > {loss_rtol:g} (engine {got.losses}, ref {ref.losses})"
        )
    if not param_diff <= param_atol:
        problems.append(f"param diff {param_diff:.3g} > {param_atol:g} at {param_where}")
    if not buf_diff <= param_atol:
        problems.append(f"buffer diff {buf_diff:.3g} > {param_atol:g} at {buf_where}")
    if not out_diff <= output_atol:
        problems.append(f"between-step output diff {out_diff:.3g} > {output_atol:g}")
    record(case.name, "FAIL" if problems else "ok", **numbers)
    if problems:
        err = AssertionError(f"{case.name} rank {dist.get_rank()}: " + "; ".join(problems))
        err._zoo_recorded = True
        raise err
    return numbers


def check_parity(case: Case, **tolerances: Any) -> tuple:
    """The whole case: reference, engine, compare. Returns (engine run, reference run)."""
    with recorded(case.name):
        data = case.micro_batches(dist.get_world_size())
        ref = run_reference(case, data)
        got = run_engine(case, data)
        compare(case, got, ref, **tolerances)
        return got, ref
