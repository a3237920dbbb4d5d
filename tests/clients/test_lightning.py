"""Lightning 2.6 on our ZeRO stages, 2 CPU ranks: Trainer fit / save / resume / convert, Fabric save / load.

Each run picks its strategy by the name Lightning registers (`deepspeed_stage_2`,
`deepspeed_stage_3_offload`, ...), the way users do; the `_offload` ones step
`DeepSpeedCPUAdam`, as Lightning's docs ask. Lightning writes every NVMe tuning key
(`nvme_path: /local_nvme`, buffer sizes) into those strategies' offload blocks even with
device cpu, which must parse; `test_registered_strategy_configs_parse` checks every
registered config without starting processes.

Lightning's DeepSpeed strategies refuse the CPU with two checks of their own, both CUDA-only:
`DeepSpeedStrategy.setup_environment` raises unless the accelerator is a `CUDAAccelerator`,
and `_validate_device_index_selection` raises unless the devices carry the indices 0..N-1
(CPU devices have none). `_bypass_lightning_cuda_checks` replaces exactly those two (in
`lightning.pytorch.strategies.deepspeed` and `lightning.fabric.strategies.deepspeed`) and
nothing else; on a GPU machine the same script runs without the bypass.

Lightning does not spawn processes when LOCAL_RANK is set (it then assumes a launcher made
them), so the test runs this file as a script under our own `deepspeed` launcher on 2 ranks,
on a free port. One run does everything in sequence, since Lightning's start-up dominates:

  trainer  an uninterrupted 6-step fit saves at step 4 (the end of epoch 0) from `on_train_batch_end`
           with `trainer.save_checkpoint` (a sharded folder), as `ModelCheckpoint` does; a fresh
           model resumes from it to step 6 (`fit(ckpt_path=...)`), and its losses equal the
           uninterrupted run's; rank 0 converts the folder with Lightning's
           `convert_zero_checkpoint_to_fp32_state_dict` and finds the weights at the save and
           Lightning's own state (global_step, epoch) in the file.
  fabric   `Fabric(strategy=<the same name>)` trains 2 steps, `fabric.save`s model,
           optimizer and a counter; a fresh model and optimizer `fabric.load` them and the
           next step's loss equals the uninterrupted run's.

Each rank writes what it found to OUT/rank{r}.json; the tests read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.clients

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAVE_STEP = 4
TOTAL_STEPS = 6
FABRIC_STEPS = 3

# Names in Lightning's strategy registry; Trainer and Fabric register the same ones.
STRATEGIES = [
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3_offload",
]


@pytest.mark.parametrize(
    "module, registry",
    [
        ("lightning.pytorch.strategies", "StrategyRegistry"),
        ("lightning.fabric.strategies", "STRATEGY_REGISTRY"),
    ],
)
def test_registered_strategy_configs_parse(module, registry):
    """Every DeepSpeed config Lightning registers parses; the `_nvme` ones as NVMe offload of
    Lightning's path (nothing touches the disk until an engine is built)."""
    import importlib

    from deepspeed.runtime.config import DeepSpeedConfig

    strategies = getattr(importlib.import_module(module), registry)
    names = [name for name in strategies.available_strategies() if name.startswith("deepspeed")]
    assert set(STRATEGIES) < set(names)
    for name in names:
        config = dict(strategies.get(name).config, train_micro_batch_size_per_gpu=1)
        zero = DeepSpeedConfig(config).zero_config
        offloads = [zero.offload_param, zero.offload_optimizer]
        devices = {block.device for block in offloads if block is not None}
        if name.endswith("_nvme"):
            assert devices == {"nvme"}, (name, devices)
            assert all(str(block.nvme_path) == "/local_nvme" for block in offloads), name
        else:
            assert "nvme" not in devices, (name, devices)


@pytest.fixture(scope="module", params=STRATEGIES)
def lightning_run(request, tmp_path_factory) -> list:
    """Run this file as a script on 2 ranks under our launcher; each rank's findings."""
    from tests.unit.common import get_free_port

    strategy = request.param
    out = tmp_path_factory.mktemp(strategy)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_procs", "2"]
    cmd += [
        "--master_port",
        str(get_free_port()),
        "--no_local_rank",
        os.path.abspath(__file__),
        strategy,
        str(out),
    ]
    done = subprocess.run(cmd, env=env, cwd=str(out), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-8000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_trainer_fit_save_resume_convert(lightning_run):
    for r, res in enumerate(lightning_run):
        trainer = res["trainer"]
        # Resumed at the saved step with the saved weights, then the uninterrupted run's losses.
        assert trainer["resumed_from_step"] == SAVE_STEP, r
        assert trainer["resumed_weights_equal_saved"], r
        assert trainer["resumed_adam_steps"] == [float(SAVE_STEP)], r  # the optimizer state came back
        assert trainer["resumed_losses"][0] == pytest.approx(
            trainer["straight_losses"][SAVE_STEP], rel=1e-6
        ), r
    convert = lightning_run[0]["convert"]
    assert convert["global_step"] == SAVE_STEP and convert["epoch"] == convert["epoch_at_save"]
    assert convert["weights_equal_saved"] and convert["keys_equal_state_dict"]


def test_trainer_engine_runs_the_named_strategy(lightning_run, request):
    strategy = request.node.callspec.params["lightning_run"]
    stage = int(strategy.split("_")[2])
    offload = strategy.endswith("_offload")
    for res in lightning_run:
        # offload_optimizer with every `_offload` name; offload_param only with stage 3's.
        assert res["trainer"]["engine_stage"] == stage
        assert res["trainer"]["engine_offloads"] == [offload, offload and stage == 3]


def test_trainer_resume_continues_like_the_uninterrupted_run(lightning_run):
    for r, res in enumerate(lightning_run):
        trainer = res["trainer"]
        assert trainer["resumed_losses"] == pytest.approx(trainer["straight_losses"][SAVE_STEP:], rel=1e-5), r


def test_fabric_save_load(lightning_run):
    for r, res in enumerate(lightning_run):
        fabric = res["fabric"]
        assert fabric["loaded_step"] == FABRIC_STEPS - 1, r
        assert fabric["loaded_weights_equal_saved"], r
        assert fabric["loss_after_load"] == pytest.approx(fabric["straight_losses"][-1], rel=1e-5), r


# ============================================================================ the script


def _bypass_lightning_cuda_checks() -> None:
    """Replace Lightning's two CUDA-only checks of its DeepSpeed strategies (see the module note)."""
    import lightning.fabric.strategies.deepspeed as fabric_ds
    import lightning.pytorch.strategies.deepspeed as trainer_ds
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies.ddp import DDPStrategy as TrainerDDP

    def no_index_check(parallel_devices) -> None:  # check 2: CPU devices have no index
        return None

    trainer_ds._validate_device_index_selection = no_index_check
    fabric_ds._validate_device_index_selection = no_index_check
    # Check 1: `setup_environment` refuses any accelerator but CUDAAccelerator; keep the rest.
    trainer_ds.DeepSpeedStrategy.setup_environment = lambda self: TrainerDDP.setup_environment(self)
    fabric_ds.DeepSpeedStrategy.setup_environment = lambda self: FabricDDP.setup_environment(self)


def _data():
    import torch

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 6, generator=gen)
    return x, (x @ torch.randn(6, 3, generator=gen)).tanh()


def _module_class():
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
            self.losses: list = []
            self.start_weights = None
            self.start_step = None
            self.start_adam_steps = None
            self.engine_stage = None
            self.engine_offloads = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layers(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_start(self) -> None:
            self.start_weights = _gathered(self.layers)
            self.start_step = self.trainer.global_step
            engine = self.trainer.strategy.deepspeed_engine
            self.engine_stage = engine.zero_optimization_stage()
            param_block = engine.zero_offload_param()  # None when the config has no such block
            self.engine_offloads = [
                engine.zero_cpu_offload(),
                param_block is not None and param_block.device == "cpu",
            ]
            opt = self.trainer.strategy.deepspeed_engine.optimizer.optimizer
            self.start_adam_steps = sorted({float(v["step"]) for v in opt.state.values() if "step" in v})

        def configure_optimizers(self):
            return _adamw(self.parameters(), lr=0.05, weight_decay=0.01)

    return Tiny


def _adamw(params, **kwargs):
    """torch's AdamW, or DeepSpeedCPUAdam (AdamW mode) under a `_offload` strategy, as Lightning's docs ask."""
    import torch

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    offload = os.environ["LIGHTNING_STRATEGY"].endswith("_offload")
    return (
        DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
        if offload
        else torch.optim.AdamW(params, **kwargs)
    )


def _gathered(module) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.data.detach().clone() for n, p in module.named_parameters()}


def _equal(a: dict, b: dict, prefix: str = "") -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _trainer(strategy: str, max_steps: int, root: str, callbacks: tuple = ()):
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


def _loader():
    import torch

    x, y = _data()
    # Lightning adds a DistributedSampler, shuffling as for every training loader (seeded, reshuffled
    # each epoch): 16 samples a rank, one epoch = SAVE_STEP steps, so the save falls on an epoch
    # boundary and the resumed run must start epoch 1 with its first batch, as the straight run did.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _run_trainer(strategy: str, out: str, rank: int) -> tuple:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    tiny = _module_class()
    ckpt = os.path.join(out, "trainer.ckpt")
    at_save: dict = {}

    class SaveAtStep(pl.Callback):
        """Save from `on_train_batch_end`, the hook `ModelCheckpoint(every_n_train_steps=...)` uses.

        Not `trainer.save_checkpoint` after a `fit` that `max_steps` stopped at an epoch's end:
        Lightning resumes such a checkpoint wrongly whatever the strategy (its loop keeps the
        finished epoch's batch count, so the resumed fit runs one batch of the next epoch, then
        starts another; Lightning-AI/pytorch-lightning#19617, the same with plain DDP).
        """

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == SAVE_STEP:
                trainer.save_checkpoint(ckpt)
                at_save.update(weights=_gathered(pl_module.layers), epoch=trainer.current_epoch)

    straight = tiny()
    _trainer(strategy, TOTAL_STEPS, out, callbacks=(SaveAtStep(),)).fit(straight, train_dataloaders=_loader())
    saved, epoch_at_save = at_save["weights"], at_save["epoch"]

    resumed = tiny()
    trainer = _trainer(strategy, TOTAL_STEPS, out)
    trainer.fit(resumed, train_dataloaders=_loader(), ckpt_path=ckpt)
    result = {
        "resumed_from_step": resumed.start_step,
        "resumed_losses": resumed.losses,
        "straight_losses": straight.losses,
        "resumed_weights_equal_saved": _equal(resumed.start_weights, saved),
        "resumed_adam_steps": resumed.start_adam_steps,
        "engine_stage": resumed.engine_stage,
        "engine_offloads": resumed.engine_offloads,
    }
    convert = None
    if rank == 0:
        out_file = os.path.join(out, "converted.pt")
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out_file)
        converted = torch.load(out_file, weights_only=False)
        weights = {k[len("layers.") :]: v for k, v in converted["state_dict"].items()}
        convert = {
            "global_step": converted.get("global_step"),
            "epoch": converted.get("epoch"),
            "epoch_at_save": epoch_at_save,
            "weights_equal_saved": _equal(weights, saved),
            "keys_equal_state_dict": sorted(converted["state_dict"]) == sorted(tiny().state_dict()),
        }
    return result, convert


def _run_fabric(strategy: str, out: str) -> dict:
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    x, y = _data()
    path = os.path.join(out, "fabric.ckpt")

    def setup():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        optimizer = _adamw(model.parameters(), lr=0.05)
        return fabric.setup(model, optimizer)

    def step(model, optimizer, i: int) -> float:
        loss = torch.nn.functional.mse_loss(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4])
        fabric.backward(loss, model=model)  # two engines live: name the one to step
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    model, optimizer = setup()
    straight = [step(model, optimizer, i) for i in range(FABRIC_STEPS - 1)]
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": FABRIC_STEPS - 1})
    saved = _gathered(model)
    straight.append(step(model, optimizer, FABRIC_STEPS - 1))

    model, optimizer = setup()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    loaded = _gathered(model)
    return {
        "loaded_step": state["step"],
        "loaded_weights_equal_saved": _equal(loaded, saved),
        "straight_losses": straight,
        "loss_after_load": step(model, optimizer, FABRIC_STEPS - 1),
    }


def _script(strategy: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["LIGHTNING_STRATEGY"] = strategy
    if not torch.cuda.is_available():
        _bypass_lightning_cuda_checks()
    rank = int(os.environ["RANK"])
    trainer, convert = _run_trainer(strategy, out, rank)
    fabric = _run_fabric(strategy, out)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"trainer": trainer, "convert": convert, "fabric": fabric}, f)


if __name__ == "__main__":
    _script(sys.argv[1], sys.argv[2])
