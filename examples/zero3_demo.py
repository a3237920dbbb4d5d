"""The main job: ZeRO-3 on CPU processes with gloo, one step further with each capability.

    deepspeed --num_procs 2 examples/zero3_demo.py       (what `make demo` runs)
    python examples/zero3_demo.py                        (one process: the same code, world size 1)

It builds a small transformer with `zero.Init(...).start()` / `stop()`, checks that the
partitioned model equals the same-seed plain model, edits a weight once with
`GatheredParameters(..., modifier_rank=0).start()` / `stop()`, then trains it a few steps
with the stage-3 engine (`deepspeed.initialize`), printing the loss and each rank's bytes
of parameters, gradients and optimizer state. Finally it saves a checkpoint, loads it into a
stage-2 engine whose optimizer state lives on the CPU (`offload_optimizer`), and trains both
engines on, side by side: the losses agree, whatever the stage. The offloaded engine's own
checkpoint then resumes at stage 1 with the optimizer back in place, and at stage 3 with the
parameters and the optimizer state swapped to files on disk (ZeRO-Infinity's NVMe offload,
into a temporary folder here), and all three agree again.

The stage-3 engine's training curve goes to a TensorBoard log and CSV files (the config's
`tensorboard` and `csv_monitor` blocks) under `--log_dir` (default `runs/`), with the loss
averaged over the ranks added by the script itself through `engine.monitor.write_events`;
`tensorboard --logdir runs/zero3_demo` or `python examples/plot_scalars.py runs/zero3_demo
out.png` shows them (docs/observability.md).
"""

import argparse
import shutil
import sys
import tempfile

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    # Parameters under 64 elements stay gathered; the rest are gathered per submodule.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
}
VOCAB, WIDTH, HEADS, LAYERS, SEQ, STEPS = 64, 32, 4, 2, 16, 10
JOB = "zero3_demo"


def monitored(config: dict, log_dir: str) -> dict:
    """`config` with the TensorBoard and CSV monitors on, both writing to `log_dir/zero3_demo/`."""
    where = {"enabled": True, "output_path": log_dir, "job_name": JOB}
    return {**config, "tensorboard": dict(where), "csv_monitor": dict(where)}


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.blocks(self.embed(ids) + self.pos[: ids.shape[1]], mask=causal, is_causal=True))


def rank0_print(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def build(zero3: bool) -> nn.Module:
    torch.manual_seed(0)
    init = deepspeed.zero.Init(config_dict_or_path=CONFIG, enabled=zero3).start()
    model = TinyTransformer()
    init.stop()
    return model


def param_bytes(model: nn.Module) -> tuple:
    """(bytes this rank stores, bytes of the whole model)."""
    local = sum(
        (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in model.parameters()
    )
    full = sum(
        (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * p.element_size() for p in model.parameters()
    )
    return local, full


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the launcher
    parser.add_argument("--log_dir", default="runs", help="where the TensorBoard log and CSV files go")
    args = parser.parse_args()
    deepspeed.init_distributed(verbose=False)
    rank0_print(f"deepspeed {deepspeed.__version__} on {dist.get_world_size()} ranks ({dist.get_backend()})")

    model, reference = build(zero3=True), build(zero3=False)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    rank0_print(f"Init(...).start()/stop(): partitioned model equals the same-seed plain model: {same}")

    for net, zero3 in ((model, True), (reference, False)):  # one body, both runs
        gather = deepspeed.zero.GatheredParameters(net.head.bias, modifier_rank=0, enabled=zero3).start()
        net.head.bias.data.zero_()
        gather.stop()
    with deepspeed.zero.GatheredParameters(model.head.bias):
        rank0_print(
            f"GatheredParameters(...).start()/stop() edit kept: {bool(torch.all(model.head.bias == 0))}"
        )

    if not same:
        raise SystemExit("partitioned model differs from the reference")

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=monitored(CONFIG, args.log_dir))
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())  # each rank its own data
    ids = torch.randint(0, VOCAB, (CONFIG["train_micro_batch_size_per_gpu"], SEQ + 1), generator=generator)
    for step in range(STEPS):  # a fixed batch: the loss falls as the model memorizes it
        rank0_print(f"step {step + 1}/{STEPS}: loss {train_step(engine, ids):.4f}")

    local, full = param_bytes(model)
    # fp32 gradient shards live from the first backward of a step until step() frees them
    grads = sum(m.numel() * 4 for m in optimizer.masters.values())
    states = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim()
    )
    line = (
        f"rank {dist.get_rank()}: parameters {local} of {full} bytes ({local / full:.2f} of the model), "
        f"fp32 gradient shards {grads} bytes, optimizer state {states} bytes\n"
    )
    sys.stdout.write(line)  # one write: the ranks share stdout, and print() writes the newline apart
    sys.stdout.flush()
    continue_at_stage_2(engine, ids)
    engine.destroy()  # closes the monitors: every event is on disk
    log = f"{args.log_dir}/{JOB}"
    rank0_print(f"training curves of the stage-3 engine: TensorBoard log and CSV files in {log}/")
    rank0_print(f"  tensorboard --logdir {log}   or   python examples/plot_scalars.py {log} {JOB}.png")


def train_step(engine, ids) -> float:
    logits = engine(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / dist.get_world_size()
    # A client's own event, beside the engine's (it writes rank 0's loss): written on rank 0 only.
    engine.monitor.write_events([("Demo/mean_loss_over_ranks", mean, engine.global_samples)])
    return mean


def continue_at_stage_2(stage3_engine, ids) -> None:
    """Checkpoint at stage 3, resume at stage 2 with optimizer offload; both train on alike.

    Then the offloaded engine's checkpoint resumes at stage 1 with the optimizer back in
    place (DeepSpeedCPUAdam's state into torch's AdamW), and that one trains on alike too.
    """
    path = [tempfile.mkdtemp(prefix="zero_demo_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # one directory for every rank
    stage3_engine.save_checkpoint(path[0])
    config = {
        **CONFIG,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        # Without torch_adam, an offloaded Adam is DeepSpeedCPUAdam (csrc/adam), as upstream.
        "optimizer": {"type": "AdamW", "params": {"lr": CONFIG["optimizer"]["params"]["lr"]}},
    }
    stage2_engine, *_ = deepspeed.initialize(model=build(zero3=False), config=config)
    stage2_engine.load_checkpoint(path[0])
    for step in range(3):
        a, b = train_step(stage3_engine, ids), train_step(stage2_engine, ids)
        rank0_print(f"resumed step {step + 1}/3: stage 3 loss {a:.4f}, stage 2 + CPU optimizer loss {b:.4f}")
    stage2_engine.save_checkpoint(path[0], tag="offloaded")
    config = {**CONFIG, "zero_optimization": {"stage": 1}}
    stage1_engine, *_ = deepspeed.initialize(model=build(zero3=False), config=config)
    stage1_engine.load_checkpoint(path[0], tag="offloaded")
    nvme_engine = on_nvme(path[0], config["optimizer"])
    nvme_engine.load_checkpoint(path[0], tag="offloaded")
    for step in range(2):
        b, c, d = train_step(stage2_engine, ids), train_step(stage1_engine, ids), train_step(nvme_engine, ids)
        rank0_print(
            f"resumed again {step + 1}/2: stage 2 + CPU optimizer loss {b:.4f}, stage 1 loss {c:.4f}, "
            f"stage 3 + NVMe loss {d:.4f}"
        )
    nvme_engine.destroy()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)


def on_nvme(folder: str, optimizer: dict):
    """A stage-3 engine whose parameter partitions and optimizer state live in swap files under
    `folder` (each rank swaps into a private subfolder, removed when the process ends)."""
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": folder, "max_in_cpu": 10_000},
        "offload_optimizer": {"device": "nvme", "nvme_path": folder},
        "sub_group_size": 20_000,  # the optimizer steps the state a piece at a time
    }
    config = {**CONFIG, "zero_optimization": zero, "optimizer": optimizer}
    engine, *_ = deepspeed.initialize(model=build(zero3=False), config=config)
    return engine


if __name__ == "__main__":
    main()
