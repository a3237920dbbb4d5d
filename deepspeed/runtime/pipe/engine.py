"""`PipelineEngine`: what `deepspeed.initialize` returns for a `PipelineModule` (one stage).

Scripts written for upstream's pipeline engine (DeepSpeedExamples' pipeline_parallelism,
GPT-NeoX, Megatron-DeepSpeed, all of which also run with one pipeline stage) never call
forward/backward/step themselves: they call `engine.train_batch()` once per optimizer step
and `engine.eval_batch(data_iter)` to evaluate. With one stage there is no schedule to run:
`train_batch` is the plain accumulation loop, `gradient_accumulation_steps` micro-batches of
forward, `loss_fn(outputs, labels)`, `backward` and `step`, the last one at the boundary,
so every ZeRO stage and offload works as with any module (upstream's pipeline engine refuses
ZeRO stages 2 and 3). The data contract is upstream's: each micro-batch is `(inputs, labels)`,
`inputs` a tensor or a tuple of tensors handed to the module as they come, `labels` handed to
the module's `loss_fn` (without a `loss_fn`, the module's output is the loss).

Given `training_data`, the engine reads it in order (no shuffling, each rank its strided
share, as upstream's pipeline loader does) and forever (`RepeatingLoader`), so `train_batch()`
with no argument always has data. The engine's own `forward` stays callable (upstream raises);
`backward` and `step` called by hand still work, and `train_batch` places its step at its own
last micro-batch whatever they counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data.distributed import DistributedSampler

from deepspeed import comm as dist
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import PipelineParallelGrid


class PipelineEngine(DeepSpeedEngine):
    """Upstream's pipeline-engine interface over one stage: `train_batch` and `eval_batch`."""

    def __init__(self, *args: Any, has_bool_tensors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, PipelineModule):
            raise TypeError(
                f"PipelineEngine: model must be a PipelineModule, got {type(self.module).__name__}"
            )
        topology = self.module.topology()
        if topology.world_size() != dist.get_world_size():
            raise ValueError(
                f"PipelineModule: its topology spans {topology.world_size()} ranks but {dist.get_world_size()} "
                f"processes run; build it for this job (PipeDataParallelTopology(num_pp=1, "
                f"num_dp={dist.get_world_size()}))"
            )
        # upstream's engine.grid: the topology's process groups (built here, where every rank is)
        self.grid = PipelineParallelGrid(topology)
        self.module._grid = self.grid
        self.has_bool_tensors = has_bool_tensors  # how stages exchange masks: no exchange with one stage
        self.has_attention_mask = False  # likewise (set_has_attention_mask)
        self.log_batch_step_id = -1
        self.eval_return_logits = False  # upstream's flags for the last eval_batch call
        self.outputs: Any = None
        self.num_stages = 1
        self.stage_id = 0
        self.prev_stage, self.next_stage = -1, 1
        self.is_pipe_parallel = False
        self.is_data_parallel = self.dp_world_size > 1
        self.is_model_parallel = False
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.batch_fn = None
        self.data_iterator: Optional[Iterator] = (
            iter(self.training_dataloader) if self.training_dataloader is not None else None
        )
        # What the last train_batch computed (upstream's attributes): this rank's mean loss over
        # the micro-batches, that averaged over the data-parallel ranks, and the module's
        # additional losses averaged the same way.
        self.total_loss: Any = None
        self.dp_group_loss: Optional[torch.Tensor] = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.agg_additional_losses: Optional[dict] = None
        self._batch_seconds = 0.0  # time inside train_batch since the last progress line

    def _build_dataloader(self, training_data: Any, collate_fn: Any) -> Any:
        if training_data is None:
            return None
        # torch's sampler, as upstream's pipeline loader: in order, and a ragged tail padded from
        # the start (every rank the same number of samples; the last micro-batch may be short)
        sampler = DistributedSampler(
            training_data,
            num_replicas=self.dp_world_size,
            rank=dist.get_rank(self.data_parallel_group),
            shuffle=False,
        )
        return RepeatingLoader(self.deepspeed_io(training_data, data_sampler=sampler, collate_fn=collate_fn))

    # ------------------------------------------------------------------ data

    def set_dataloader(self, loader: Any) -> None:
        """Read training batches from `loader` from now on (from its start)."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Read training batches from `iterator` from now on."""
        self.training_dataloader = None
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Any) -> None:
        """Apply `fn` to every batch read, before it is split into inputs and labels."""
        self.batch_fn = fn

    def _next_batch(self, iterator: Optional[Iterator], caller: str) -> tuple:
        if iterator is None:
            raise ValueError(
                f"engine.{caller}: no data to read; pass data_iter=iter(loader), or training_data= to "
                "deepspeed.initialize (read in order, repeating)"
            )
        batch = next(iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) not in (1, 2):
            raise ValueError(
                f"engine.{caller}: a batch must be (inputs, labels) (or (inputs,) for a module whose output is "
                f"the loss); got {type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
            )
        inputs = _to_device(batch[0], self.device, detach=True, what=f"engine.{caller}: inputs")
        labels = (
            _to_device(batch[1], self.device, detach=False, what=f"engine.{caller}: labels")
            if len(batch) > 1
            else None
        )
        return inputs, labels

    # ------------------------------------------------------------------ batches

    def _loss_of(self, outputs: Any, labels: Any, compute_loss: bool, caller: str) -> Any:
        loss_fn = self.module.loss_fn
        if not compute_loss or loss_fn is None:
            return outputs
        if labels is None:
            raise ValueError(
                f"engine.{caller}: the module has a loss_fn but the batch has no labels; yield (inputs, labels)"
            )
        return loss_fn(outputs, labels)

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """Train on the next `gradient_accumulation_steps` micro-batches and take one optimizer step.

        Reads from `data_iter` (kept for later calls) or the iterator set before. Returns the
        mean loss of the micro-batches, averaged over the data-parallel ranks.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        started = time.perf_counter()
        self.module.train()
        total: Optional[torch.Tensor] = None
        extras: Optional[dict] = None
        saved_override = self._boundary_override
        try:
            for micro in range(self.micro_batches):
                inputs, labels = self._next_batch(self.data_iterator, "train_batch()")
                # the step lands on this batch's last micro-batch, whatever was counted before
                self.set_gradient_accumulation_boundary(micro == self.micro_batches - 1)
                loss = self._loss_of(self(inputs), labels, True, "train_batch()")
                if not (torch.is_tensor(loss) and loss.numel() == 1):
                    raise ValueError(
                        "engine.train_batch(): the loss must be a one-element tensor (what loss_fn returns, or "
                        f"the module's output without a loss_fn); got {_describe(loss)}"
                    )
                self.backward(loss)
                self.step()
                total = loss.detach().clone() if total is None else total + loss.detach()
                extras = _add_losses(extras, self.module.get_additional_losses())
        except BaseException:
            # A batch that ended early (its iterator ran out, a forward raised) must not leave
            # its micro-batches' gradients to be stepped with the next batch's.
            self.zero_grad()
            raise
        finally:
            self._boundary_override = saved_override
        self.total_loss = total
        with torch.no_grad():
            self.dp_group_loss = total / self.micro_batches
            self.agg_train_loss = self._average_over_ranks(self.dp_group_loss)
            self.agg_additional_losses = (
                None
                if extras is None
                else {name: self._average_over_ranks(v / self.micro_batches) for name, v in extras.items()}
            )
        self._batch_seconds += time.perf_counter() - started
        self._print_progress()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: Optional[str] = "avg",
        bcast_loss: bool = True,
        num_micro_batches: Optional[int] = None,
    ) -> Any:
        """Evaluate `num_micro_batches` (default: the accumulation steps) micro-batches of
        `data_iter` without gradients; the module stays in eval mode afterwards, as upstream's.

        Returns the mean over the micro-batches of the loss (or of the outputs, with
        `compute_loss=False`), averaged over the data-parallel ranks; `reduce_output=None`
        returns the list of per-micro-batch values instead. `return_logits=True` also returns
        the last micro-batch's outputs: `(value, outputs)`.
        """
        del bcast_loss  # upstream broadcasts the last stage's loss to the others: one stage here
        if reduce_output not in (None, "avg"):
            raise ValueError(
                f"engine.eval_batch(reduce_output={reduce_output!r}): supported are 'avg' and None"
            )
        count = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        if count < 1:
            raise ValueError(f"engine.eval_batch(num_micro_batches={num_micro_batches}): must be >= 1")
        self.module.eval()
        values, outputs = [], None
        with torch.no_grad():
            for _ in range(count):
                inputs, labels = self._next_batch(data_iter, "eval_batch()")
                outputs = self(inputs)
                values.append(_detached(self._loss_of(outputs, labels, compute_loss, "eval_batch()")))
        if reduce_output is None:
            result: Any = values
        else:
            mean = _mean(values)
            result = (
                self._average_over_ranks(mean)
                if torch.is_tensor(mean)
                else [self._average_over_ranks(v) for v in mean]
            )
            if compute_loss and torch.is_tensor(result):
                result = result.float()  # upstream's loss arrives as fp32 through its broadcast
        if self.global_rank == 0 and self.monitor.enabled and compute_loss and torch.is_tensor(result):
            self.monitor.write_events(
                [("Train/Samples/eval_loss", result.mean().item(), self.global_samples)]
            )
        self.eval_return_logits, self.outputs = (
            return_logits,
            None,
        )  # upstream hands the outputs back, then drops them
        return (result, outputs) if return_logits else result

    def _average_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        if self.is_data_parallel:
            dist.all_reduce(value, group=self.data_parallel_group)
            value /= self.dp_world_size
        return value

    def _print_progress(self) -> None:
        """Upstream's per-`steps_per_print` line on rank 0: `steps: N loss: L ...`."""
        every = self.steps_per_print()
        if not every or self.global_steps % every or self.global_rank != 0:
            return
        line = f"steps: {self.global_steps} loss: {self.agg_train_loss.item():0.4f} "
        for name, value in (self.agg_additional_losses or {}).items():
            line += f"{name}: {value.item():0.4f} "
        iter_time = max(
            self._batch_seconds / every, 1e-9
        )  # seconds inside train_batch per batch since the last line
        self._batch_seconds = 0.0
        line += f"iter time (s): {iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}"
        print(line, flush=True)

    # ------------------------------------------------------------------ upstream's queries

    def is_first_stage(self) -> bool:
        return True

    def is_last_stage(self) -> bool:
        return True

    def get_pipeline_parallel_rank(self) -> int:
        return 0

    def set_has_attention_mask(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask({value!r}): expected a bool")
        self.has_attention_mask = value

    def reset_activation_shape(self) -> None:
        """Upstream re-sizes the buffers stages exchange activations through; one stage has none."""

    def set_train_batch_size(self, train_batch_size: int) -> None:
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()


def _to_device(value: Any, device: torch.device, detach: bool, what: str) -> Any:
    if torch.is_tensor(value):
        moved = value.to(device)
        return moved.detach() if detach else moved
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, device, detach, what) for v in value)
    raise TypeError(f"{what} must be a tensor or a tuple of tensors; got {_describe(value)}")


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _detached(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return [v.detach() for v in value]
    raise TypeError(
        f"engine.eval_batch(): the module's output must be a tensor or a tuple of tensors; got {_describe(value)}"
    )


def _mean(values: list) -> Any:
    if torch.is_tensor(values[0]):
        return sum(values[1:], values[0].clone()) / len(values)
    return [sum(column[1:], column[0].clone()) / len(values) for column in zip(*values)]


def _add_losses(total: Optional[dict], losses: Optional[dict]) -> Optional[dict]:
    if losses is None:
        return total
    if total is None:
        return {name: v.detach().clone() for name, v in losses.items()}
    return {name: total[name] + losses[name].detach() for name in total}
