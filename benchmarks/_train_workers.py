"""One rank of one implementation for bench_train_step.py, run as its own process.

    python benchmarks/_train_workers.py --impl ours --rank 0 --world-size 2 --spec '{...}'

The same file runs under our venv (impl ours, fsdp2, ddp, single) and under upstream's
(impl upstream): `import deepspeed` resolves to whichever the interpreter has installed, so
this file imports nothing from the project. Rank and rendezvous come from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set by the controller.

Protocol: after building the model and `warmup` untimed steps the worker prints one line
`@@train@@ {"event": "ready", ...}` and then reads JSON commands from stdin, one a line:
`{"cmd": "run", "steps": N}` times N steps and prints `@@train@@ {"event": "times", ...}`
(rank 0 only; each step's wall time is the max over ranks, its CPU time the sum over ranks
of the process CPU time, all threads, which other jobs on the machine barely change); `{"cmd": "profile", "steps": N}`
does the same under cProfile (and `_train_profile`'s timers when started with
`--instrument`); `{"cmd": "memory"}` reports every rank's live tensor bytes between steps
(`live_tensor_bytes`) and peak RSS, and rank 0's live bytes split by device, in all and for
the optimizer's own tensors (masters, their gradients, its state); `{"cmd": "collectives"}`
runs one step under the torch profiler and reports rank 0's collectives by kind (calls, and
bytes gloo moved); `{"cmd": "quit"}` ends it. Implementations
`ours_z1` / `upstream_z1` / `ours_z2` / `upstream_z2` run ZeRO stage 1 or 2 with the same
config, `ours_z2_off` stage 2 with `offload_optimizer: {device: cpu}`, `ours_z2_nvme` the same with
`device: nvme`. Other stdout lines (library logs) are ignored by
the controller. Idle groups block on stdin, so they take no CPU from the group being timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from _launch import leave_distributed
from torch import nn

MARK = "@@train@@"

# ----------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    """A GPT: token and position embeddings, blocks, final norm, LM head.

    `positions` rows of position embedding (default `seq`); `tied`: the LM head shares the
    token embedding's weight (GPT-2's layout, one parameter seen by both modules).
    """

    def __init__(
        self,
        vocab: int,
        seq: int,
        width: int,
        layers: int,
        heads: int,
        positions: int = 0,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(positions or seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:  # GPT-2's embedding init (std 0.02): N(0, 1) rows would make huge logits through the head
            nn.init.normal_(self.tok.weight, std=0.02)
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class MLP(nn.Module):
    """`layers` square Linear+GELU layers and a regression loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x.float(), target)


def build_model(spec: dict) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights for every implementation
    if spec["model"] == "decoder":
        sizes = [spec[k] for k in ("vocab", "seq", "width", "layers", "heads")]
        return Decoder(*sizes, positions=spec.get("positions", 0), tied=spec.get("tied", False))
    if spec["model"] == "mlp":
        return MLP(spec["width"], spec["layers"])
    raise ValueError(f"spec model={spec['model']!r}; use 'decoder' or 'mlp'")


def blocks_of(model: nn.Module) -> list:
    return list(model.blocks if isinstance(model, Decoder) else model.layers)


def make_batches(spec: dict, rank: int, count: int = 4) -> list:
    """`count` fixed batches for this rank (the same on every implementation), cycled through."""
    gen = torch.Generator().manual_seed(1234 + rank)
    batches = []
    for _ in range(count):
        if spec["model"] == "decoder":
            shape = (spec["batch"], spec["seq"])
            x = torch.randint(0, spec["vocab"], shape, generator=gen)
            y = torch.randint(0, spec["vocab"], shape, generator=gen)
        else:
            x = torch.randn(spec["batch"], spec["width"], generator=gen)
            y = torch.randn(spec["batch"], spec["width"], generator=gen)
        batches.append((x, y))
    return batches


# ----------------------------------------------------------------------------- implementations


def ds_config(spec: dict, stage: int = 3, offload: Any = False) -> dict:
    """The one config both ours and upstream DeepSpeed get (upstream key names).

    Stage 3 gets the stage-3 sizes; stages 1 and 2 the same `reduce_bucket_size` and
    `allgather_bucket_size` (elements). `offload` puts the optimizer on the CPU
    (`offload_optimizer: {device: cpu}`), which steps with DeepSpeedCPUAdam as upstream requires;
    `offload="nvme"` keeps its masters and state in swap files under `spec["nvme_path"]`,
    stepped in sub-groups of `spec["sub_group_size"]` elements with both pipelines on.
    """
    zero = {
        "stage": stage,
        "reduce_bucket_size": spec["reduce_bucket_size"],
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=spec["prefetch_bucket_size"],
            stage3_param_persistence_threshold=spec["persistence_threshold"],
            stage3_max_live_parameters=int(1e9),
            stage3_max_reuse_distance=int(spec.get("max_reuse_distance", 1e9)),
        )
    else:
        zero["allgather_bucket_size"] = spec.get("allgather_bucket_size", spec["reduce_bucket_size"])
    adam = {"lr": 1e-3, "torch_adam": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        adam = {"lr": 1e-3}  # DeepSpeedCPUAdam
    if offload == "nvme":
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": spec["nvme_path"],
            "pipeline_read": True,
            "pipeline_write": True,
            "buffer_count": 9,  # Adam: masters + 2 states, x 3 sub-groups in flight
        }
        zero["sub_group_size"] = spec["sub_group_size"]
    cfg = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


ENGINE: list = []  # the DeepSpeed engine of this process, for the memory report


def setup_deepspeed(model: nn.Module, spec: dict, stage: int = 3, offload: Any = False):
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(spec, stage, offload))
    ENGINE.append(engine)
    # DeepSpeed engines do not cast inputs: a bf16 model takes bf16 activations.
    input_dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32

    def step(x, y):
        if x.is_floating_point():
            x = x.to(input_dtype)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    info = {"deepspeed_version": deepspeed.__version__, "deepspeed_file": deepspeed.__file__}
    info["zero_stage"] = stage
    info["offload_optimizer"] = offload
    return step, info


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, autocast: bool, device_type: str = "cpu"):
    """One torch training step (bf16 autocast on `device_type` when `autocast`); also the GPU
    benchmark's step for FSDP2 and plain PyTorch (benchmarks/gpu/_case.py)."""

    def step(x, y):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_fsdp2(model: nn.Module, spec: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    kwargs: dict = {"mesh": mesh}
    if spec["dtype"] == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in blocks_of(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _plain_step(model, opt, autocast=False), {}


def setup_ddp(model: nn.Module, spec: dict):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    return _plain_step(ddp, opt, autocast=spec["dtype"] == "bf16"), {}


def setup_single(model: nn.Module, spec: dict):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _plain_step(model, opt, autocast=spec["dtype"] == "bf16"), {}


SETUPS = {
    "ours": setup_deepspeed,
    "upstream": setup_deepspeed,
    # ZeRO stages 1 and 2 (same config otherwise); "_off": offload_optimizer to the CPU.
    "ours_z1": functools.partial(setup_deepspeed, stage=1),
    "upstream_z1": functools.partial(setup_deepspeed, stage=1),
    "ours_z2": functools.partial(setup_deepspeed, stage=2),
    "upstream_z2": functools.partial(setup_deepspeed, stage=2),
    "ours_z2_off": functools.partial(setup_deepspeed, stage=2, offload=True),
    "ours_z2_nvme": functools.partial(setup_deepspeed, stage=2, offload="nvme"),
    "fsdp2": setup_fsdp2,
    "ddp": setup_ddp,
    "single": setup_single,
}


# ----------------------------------------------------------------------------- timing


class Runner:
    """Runs timed steps over the fixed batches; every rank calls `run` together."""

    def __init__(self, step, batches: list, distributed: bool) -> None:
        self.step = step
        self.batches = batches
        self.distributed = distributed
        self.done = 0
        self.last_loss = math.nan
        self.last_cpu: list = []
        self.last_faults: list = []

    def run(self, steps: int) -> list:
        """Wall seconds per step (max over ranks); CPU seconds and minor page faults (each summed
        over ranks) in `last_cpu` and `last_faults`."""
        times, cpu, faults = [], [], []
        for _ in range(steps):
            x, y = self.batches[self.done % len(self.batches)]
            if self.distributed:
                tdist.barrier()
            start, start_cpu, start_faults = time.perf_counter(), time.process_time(), _minor_faults()
            loss = self.step(x, y)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)  # every thread of this process
            faults.append(_minor_faults() - start_faults)
            self.done += 1
            self.last_loss = float(loss.detach().float())
        if self.distributed:  # a step takes as long as its slowest rank, and costs all ranks' CPU
            t = torch.tensor(times, dtype=torch.float64)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            c = torch.tensor([cpu, faults], dtype=torch.float64)
            tdist.all_reduce(c, op=tdist.ReduceOp.SUM)
            times, (cpu, faults) = t.tolist(), c.tolist()
        self.last_cpu, self.last_faults = cpu, faults
        return times


def _minor_faults() -> int:
    """This process's minor page faults so far: each is a fresh page the kernel zero-filled
    (memory the allocator had given back and the step wanted again), 2-4 us each on our VM."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def emit(rank: int, payload: dict) -> None:
    if rank == 0:
        print(MARK, json.dumps(payload), flush=True)


def _top_functions(stats: dict, column: int, count: int = 60) -> list:
    rows = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:count]
    return [
        {"func": f"{os.path.basename(f)}:{line}:{name}", "ncalls": nc, "tottime": tt, "cumtime": ct}
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


def profile_steps(runner: Runner, steps: int, rank: int, instrument, use_cprofile: bool) -> dict:
    """Time `steps` steps; on rank 0 with the instrument's timers (if any), optionally cProfile."""
    import cProfile
    import pstats

    if rank != 0:
        return {"times": runner.run(steps)}
    if instrument is not None:
        instrument.reset()
    prof = cProfile.Profile() if use_cprofile else None
    if prof is not None:
        prof.enable()
    times = runner.run(steps)
    out: dict = {"times": times}
    if prof is not None:
        prof.disable()
        stats = pstats.Stats(prof).stats
        out["cprofile_top"] = _top_functions(stats, column=3)  # by cumulative time
        out["cprofile_top_self"] = _top_functions(stats, column=2)  # by time in the function itself
    if instrument is not None:
        out["timers"] = instrument.report(steps)
        out["timers_missing"] = instrument.missing
    return out


def _shm_segments() -> dict:
    """Our comm's shared-memory segments (`data_ptr -> bytes`; none in other implementations)."""
    facade = sys.modules.get("deepspeed.comm.comm")
    segments = getattr(facade, "shm_segments", None)
    return segments() if segments is not None else {}


def _live_storages() -> dict:
    """`data_ptr -> (nbytes, device type)` of every distinct tensor storage alive (through `gc`),
    but for our comm's shared-memory segments: a fixed-size transport buffer per process
    group, not training state (gloo's and NCCL's own buffers are not tensors, so they are not
    counted for anyone); `memory_report` gives their size apart."""
    import gc
    import warnings

    seen: dict = {}
    segments = _shm_segments()
    with warnings.catch_warnings():  # isinstance() on some module proxies warns of deprecations
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
            if storage.device.type != "meta" and storage.nbytes() and storage.data_ptr() not in segments:
                seen[(storage.device.type, storage.data_ptr())] = (storage.nbytes(), storage.device.type)
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a wrapper or fake tensor without storage of its own
    return seen


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (found through `gc`).

    Called between steps, this is what a rank keeps for training: its parameters (or their
    shards), gradients it keeps, optimizer state, flat buffers, plus the few small batches.
    Storages are counted once however many views share them; wrapper tensors without a
    storage of their own (DTensor) are skipped, their local shard is counted.
    """
    return sum(n for n, _ in _live_storages().values())


def live_bytes_by_device() -> dict:
    """`live_tensor_bytes()` split by the device type the storages live on."""
    out: dict = {}
    for n, device in _live_storages().values():
        out[device] = out.get(device, 0) + n
    return out


def optimizer_bytes_by_device() -> dict:
    """The optimizer's own tensors (the masters it steps, their gradients, its state) by device.

    Read from the DeepSpeed engine's optimizer (its `param_groups` hold the fp32 masters, its
    `state` the moments); empty for the torch baselines. Each tensor counts its own elements,
    not its whole storage: at stages 1-2 an fp32 master is a slice of its parameter.
    """
    if not ENGINE:
        return {}
    opt = ENGINE[0].optimizer
    tensors = []
    for group in opt.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad] if p.grad is not None else [p]
    for per_param in opt.state.values():
        tensors += [t for t in per_param.values() if isinstance(t, torch.Tensor)]
    seen: dict = {}
    for t in tensors:
        seen[(t.device.type, t.data_ptr())] = (t.numel() * t.element_size(), t.device.type)
    out: dict = {}
    for n, device in seen.values():
        out[device] = out.get(device, 0) + n
    return out


def _accelerator_name() -> str:
    """The accelerator DeepSpeed runs on here (`cpu` on a CPU-only machine), or "" without DeepSpeed."""
    if not ENGINE:
        return ""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM, where Linux has it.

    Not `ru_maxrss`: Linux carries it across fork and exec, so a worker started by a parent
    that had grown large (run_all after the 64M CPU Adam section) reports the parent's peak.
    VmHWM belongs to the process's own address space, which exec makes new.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_report(distributed: bool) -> dict:
    """Every rank's live tensor bytes, in all and by device, and its optimizer's bytes by device.

    A collective when distributed (the totals); the by-device figures are rank 0's, carried
    in the JSON as they are (devices can differ in name between implementations).
    """
    local = torch.tensor([float(live_tensor_bytes()), float(peak_rss_bytes())], dtype=torch.float64)
    extra = {
        "live_by_device": live_bytes_by_device(),
        "optimizer_by_device": optimizer_bytes_by_device(),
        "accelerator": _accelerator_name(),
        "shm_segment_bytes": sum(_shm_segments().values()),
    }
    rows = [local]
    if distributed:
        rows = [torch.zeros_like(local) for _ in range(tdist.get_world_size())]
        tdist.all_gather(rows, local)
    return {
        "state_bytes": [int(t[0].item()) for t in rows],
        # The process's peak resident set since it started (model build included).
        "peak_rss_bytes": [int(t[1].item()) for t in rows],
        **extra,
    }


# Bytes per element of the dtype names the profiler records.
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}
_DTYPE_BYTES.update({"bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2})


def _shm_counts() -> dict:
    """Our facade's shared-memory collectives so far (none in other implementations)."""
    facade = sys.modules.get("deepspeed.comm.comm")
    counts = getattr(facade, "shm_counts", None)
    return counts() if counts is not None else {}


def count_collectives(runner: Runner) -> dict:
    """One step under the torch profiler: the collectives this rank asked for and what gloo ran.

    [Note: two names for one collective] A call such as `reduce_scatter_tensor` goes through
    a `c10d::` dispatcher op (what the library asked for) and then the backend runs its own
    algorithm, recorded as `gloo:<kind>` with the tensor it moved (on gloo in torch 2.13,
    `c10d::_reduce_scatter_base_` runs as `gloo:all_reduce` of the whole input). Both are
    counted: `requested` calls by op, `executed` calls and bytes by gloo kind. This sees
    every path (deepspeed.comm, FSDP2's functions, DDP's C++ reducer) without patching any.
    Our collectives that ran through shared memory (comm/shm.py) bypass torch.distributed;
    the facade's own counters add them to `executed` as `shm:<kind>`, with the bytes each
    call produced on this rank.
    """
    from torch.profiler import ProfilerActivity, profile

    x, y = runner.batches[runner.done % len(runner.batches)]
    if runner.distributed:
        tdist.barrier()
    shm_before = _shm_counts()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        runner.last_loss = float(runner.step(x, y).detach().float())
    runner.done += 1
    requested: dict = {}
    executed: dict = {}
    for kind, (calls, nbytes) in _shm_counts().items():
        before = shm_before.get(kind, (0, 0))
        if calls > before[0]:
            executed[f"shm:{kind}"] = {"calls": calls - before[0], "bytes": nbytes - before[1]}
    for event in prof.events():
        if event.name.startswith("c10d::"):
            requested[event.name] = requested.get(event.name, 0) + 1
        elif event.name.startswith("gloo:"):
            row = executed.setdefault(event.name, {"calls": 0, "bytes": 0})
            row["calls"] += 1
            for shape, dtype in zip(event.input_shapes, event.input_dtypes):
                row["bytes"] += math.prod(shape) * _DTYPE_BYTES.get(dtype, 0) if shape else 0
    return {"requested": requested, "executed": executed}


def serve(runner: Runner, rank: int, instrument) -> None:
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        if cmd["cmd"] == "run":
            payload = {
                "times": runner.run(int(cmd["steps"])),
                "cpu": runner.last_cpu,
                "faults": runner.last_faults,
            }
        elif cmd["cmd"] == "profile":
            use_cprofile = bool(cmd.get("cprofile", False))
            payload = profile_steps(runner, int(cmd["steps"]), rank, instrument, use_cprofile)
        elif cmd["cmd"] == "memory":
            payload = memory_report(runner.distributed)
        elif cmd["cmd"] == "collectives":
            payload = {"collectives": count_collectives(runner)}
        else:
            raise ValueError(f"unknown command {cmd!r}")
        emit(rank, {"event": "times", "loss": runner.last_loss, **payload})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=sorted(SETUPS), required=True)
    parser.add_argument("--spec", required=True, help="JSON: model, sizes, dtype, bucket sizes, warmup")
    parser.add_argument("--instrument", action="store_true", help="install _train_profile's timers (ours)")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(int(spec.get("threads", 1)))
    distributed = args.impl != "single"
    rank = int(os.environ.get("RANK", "0"))
    if distributed:
        tdist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    instrument = None
    if args.instrument:
        import _train_profile

        instrument = _train_profile.install()
    model = build_model(spec)
    n_params = sum(p.numel() for p in model.parameters())
    step, info = SETUPS[args.impl](model, spec)
    torch.set_num_threads(int(spec.get("threads", 1)))  # a library may have changed it
    runner = Runner(step, make_batches(spec, rank), distributed)
    runner.run(int(spec["warmup"]))
    info.update(params=n_params, threads=torch.get_num_threads(), torch_version=torch.__version__)
    emit(rank, {"event": "ready", "loss": runner.last_loss, **info})
    serve(runner, rank, instrument)
    leave_distributed()


if __name__ == "__main__":
    main()
