"""accelerate on our ZeRO-3 (and ZeRO-1), 2 CPU ranks: training with accumulation, state dicts, checkpoints.

A tiny MLP trains for two epochs of two optimizer steps each (gradient accumulation 2)
through `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))`; every step's loss,
averaged over ranks and micro-steps, and the final weights match a plain PyTorch AdamW run
on the same 16-sample global batches. `save_state` after the first epoch and `load_state`
after the second replay the second epoch with identical losses and weights. With
`offload_optimizer_device="cpu"` the same holds, using DeepSpeedCPUAdam as upstream requires
for a client optimizer under ZeRO-Offload; and with a torch Adagrad, which accelerate itself
swaps for `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad` under offload (passing the torch
optimizer's param groups, whose lr_decay and initial_accumulator_value must be honoured).
"""

import copy

import pytest
import torch

from tests.clients import helpers
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

MICRO_BATCH = 4
ACCUMULATION = 2
SAMPLES = 32  # one epoch: 4 micro-steps per rank on 2 ranks, 2 optimizer steps
LR = 1e-2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_data() -> tuple:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen)


def torch_optimizer(kind: str, params):
    if kind == "adagrad":
        return torch.optim.Adagrad(
            params, lr=LR, lr_decay=0.05, initial_accumulator_value=0.1, weight_decay=0.01
        )
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def reference_run(model: torch.nn.Module, epochs: int, kind: str = "adamw") -> tuple:
    """The plain torch optimizer on each optimizer step's global batch (16 consecutive samples)."""
    x, y = make_data()
    opt = torch_optimizer(kind, model.parameters())
    losses = []
    per_step = MICRO_BATCH * ACCUMULATION * 2
    for _ in range(epochs):
        for start in range(0, SAMPLES, per_step):
            loss = torch.nn.functional.mse_loss(
                model(x[start : start + per_step]), y[start : start + per_step]
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_accelerator(offload, stage=3):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    helpers.reset_clients()
    plugin = DeepSpeedPlugin(
        zero_stage=stage,
        gradient_accumulation_steps=ACCUMULATION,
        offload_optimizer_device=offload,
        zero3_save_16bit_model=True,
    )
    return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def run_epoch(accelerator, model, optimizer, loader) -> list:
    """One epoch; returns each optimizer step's loss averaged over micro-steps and ranks."""
    losses, pending = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        pending.append(loss.detach())
        if accelerator.sync_gradients:
            losses.append(accelerator.gather(torch.stack(pending).mean()).mean().item())
            pending = []
    return losses


class TestAccelerate(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize(
        "stage, offload, kind",
        [
            (3, "none", "adamw"),
            (3, "cpu", "adamw"),
            (1, "none", "adamw"),
            (3, "cpu", "adagrad"),
            (2, "cpu", "adagrad"),
        ],
        ids=["no_offload", "offload_cpu", "stage1", "offload_adagrad", "stage2_offload_adagrad"],
    )
    def test_train_state_dict_save_load(self, stage, offload, kind, tmp_path):
        from safetensors.torch import load_file

        import deepspeed

        accelerator = make_accelerator(offload, stage)
        model = make_model()
        ref_losses, ref_weights = reference_run(copy.deepcopy(model), epochs=2, kind=kind)
        if offload == "cpu" and kind == "adamw":
            optimizer = deepspeed.ops.adam.DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0)
        else:
            optimizer = torch_optimizer(kind, model.parameters())
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(*make_data()), batch_size=MICRO_BATCH
        )
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if offload == "cpu":
            block = model.zero_offload_optimizer()
            assert block is not None and "cpu" in str(block.device), (
                f"offload_optimizer not in effect: {block}"
            )
            expected = {"adamw": "DeepSpeedCPUAdam", "adagrad": "DeepSpeedCPUAdagrad"}[kind]
            assert type(model.optimizer.optimizer).__name__ == expected
        assert all(hasattr(p, "ds_id") for p in model.module.parameters()) == (stage == 3), (
            "ZeRO-3 did not manage every parameter, or a lower stage partitioned them"
        )
        # Below stage 2, accelerate.accumulate() enters the engine's no_sync() on the micro-steps
        # that do not sync: they must not reduce, and the syncing one reduces their sum.
        no_sync_entries = []
        engine_no_sync = model.no_sync
        model.no_sync = lambda: (no_sync_entries.append(1), engine_no_sync())[1]

        first = run_epoch(accelerator, model, optimizer, loader)
        assert len(no_sync_entries) == (2 if stage < 2 else 0), no_sync_entries
        state_dir = tmp_path / "state"
        accelerator.save_state(str(state_dir))
        second = run_epoch(accelerator, model, optimizer, loader)
        torch.testing.assert_close(first + second, ref_losses, rtol=1e-5, atol=1e-6)

        weights = helpers.full_params(model.module)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            helpers.assert_same_tensors(state_dict, weights, "get_state_dict")

        model_dir = tmp_path / "model"
        accelerator.save_model(model, str(model_dir))
        accelerator.wait_for_everyone()
        helpers.assert_same_tensors(load_file(str(model_dir / "model.safetensors")), weights, "save_model")

        accelerator.load_state(str(state_dir))
        replayed = run_epoch(accelerator, model, optimizer, loader)
        assert replayed == second, f"replayed {replayed}, first time {second}"
        helpers.assert_same_tensors(helpers.full_params(model.module), weights, "weights after replay")
        accelerator.free_memory()
        helpers.reset_clients()
