"""One or more benchmark cases in one process, on one rank: ours, upstream, FSDP2 or plain torch.

    python benchmarks/gpu/_case.py --cases '[{"impl": "ours", "offload": true, "spec": {...}}]'

Run by bench_gpu.py under the interpreter and PYTHONPATH of the implementation: ours' tree,
or upstream DeepSpeed's own install (`import deepspeed` resolves to whichever is on the
path), so this file imports only torch and benchmarks/_train_workers.py (the shared models,
batches and DeepSpeed config, which import nothing of the project). The device is CUDA
device 0 where CUDA is available (backend nccl), else the CPU (gloo): the dry run. World
size 1. Each case prints one line `@@gpu@@ {...}`: median step time, peak device memory
(`torch.cuda.max_memory_allocated`, during the build and the steps, and during the timed
steps alone), the parameter count and the losses, or `error` (with `oom` when the device
ran out of memory). The real run gives each case its own process, so that one case's
memory (and a failure) cannot touch the next; the dry run runs several in one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from _train_workers import _plain_step, build_model, ds_config, make_batches, peak_rss_bytes  # noqa: E402

MARK = "@@gpu@@"
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")


def join_group() -> None:
    """The default process group of one rank (nccl on CUDA, gloo on the CPU), once per process."""
    if tdist.is_initialized():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if CUDA:
        torch.cuda.set_device(DEVICE)
        tdist.init_process_group("nccl", rank=0, world_size=1, device_id=DEVICE)
    else:
        tdist.init_process_group("gloo", rank=0, world_size=1)


def deepspeed_config(spec: dict, offload: bool) -> dict:
    """bench_train_step's stage-3 config, bf16; with `offload` the optimizer and the parameters on
    the CPU (pinned). On CUDA without offload Adam is each library's own default (upstream:
    FusedAdam, JIT-built; ours: torch's fused AdamW); on the CPU torch's (no JIT build in a dry run)."""
    cfg = ds_config(spec, stage=3, offload=offload)
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif CUDA:
        cfg["optimizer"]["params"] = {"lr": 1e-3}
    return cfg


def setup_deepspeed(spec: dict, offload: bool):
    import deepspeed

    cfg = deepspeed_config(spec, offload)
    if spec.get("zero_init"):  # the largest-model probes: built partitioned, on the CPU when offloaded
        remote = "cpu" if offload else None
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=remote, pin_memory=CUDA and offload):
            model = build_model(spec)
    else:
        model = build_model(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    info = {"library": f"deepspeed {deepspeed.__version__}", "optimizer": _optimizer_name(engine)}
    return step, engine, info


def _optimizer_name(engine) -> str:
    """The torch optimizer under the ZeRO wrapper (FusedAdam, DeepSpeedCPUAdam, AdamW, ...)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return type(inner).__name__


def _adamw(params) -> torch.optim.Optimizer:
    # Upstream's FusedAdam defaults: no weight decay; torch's one-pass kernel on either device.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)


def _torch_step(model, opt, autocast: bool):
    return _plain_step(model, opt, autocast, DEVICE.type)


def setup_fsdp2(spec: dict, offload: bool):
    """fully_shard per block and at the root, bf16 compute and reduce (fp32 masters); with
    `offload` a CPUOffloadPolicy (parameters, gradients and the optimizer step on the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build_model(spec)
    if not offload:
        model = model.to(DEVICE)
    kwargs: dict = {"mesh": init_device_mesh(DEVICE.type, (1,))}
    kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=CUDA)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = _adamw(model.parameters())
    info = {"library": f"torch {torch.__version__}", "optimizer": "AdamW(fused)"}
    return _torch_step(model, opt, autocast=False), (model, opt), info


def setup_plain(spec: dict, offload: bool):
    """The model on the device, fp32 weights under bf16 autocast, torch's fused AdamW."""
    if offload:
        raise ValueError("plain torch has no CPU offload; ask for impl 'plain' without offload")
    model = build_model(spec).to(DEVICE)
    opt = _adamw(model.parameters())
    info = {"library": f"torch {torch.__version__}", "optimizer": "AdamW(fused)"}
    return _torch_step(model, opt, autocast=True), (model, opt), info


SETUPS = {"ours": setup_deepspeed, "upstream": setup_deepspeed, "fsdp2": setup_fsdp2, "plain": setup_plain}


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _peak() -> int | None:
    return torch.cuda.max_memory_allocated() if CUDA else None


def _timed_steps(step, batches: list, warmup: int, steps: int) -> tuple:
    """Step times after `warmup` steps, every loss, and the peak before the timed steps (the
    build and the warm-up; the peak is then reset, so `_peak()` after is the timed steps')."""
    times, losses, peak_before = [], [], _peak()
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        if i == warmup and CUDA:
            peak_before = _peak()
            torch.cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        loss = step(x, y)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float()))
    return times, losses, peak_before


def run_case(case: dict) -> dict:
    """Build the case's model and engine, run `warmup` then `steps` timed steps; the figures."""
    spec, offload = case["spec"], bool(case.get("offload", False))
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if CUDA else 0
    began = time.perf_counter()
    step, keep, info = SETUPS[case["impl"]](spec, offload)
    build_s = time.perf_counter() - began
    batches = [(x.to(DEVICE), y.to(DEVICE)) for x, y in make_batches(spec, rank=0)]
    times, losses, peak_before = _timed_steps(
        step, batches, int(case.get("warmup", 1)), int(case.get("steps", 1))
    )
    entry = {
        **info,
        "step_s": statistics.median(times) if times else None,
        "step_s_min": min(times) if times else None,
        "build_s": build_s,
        "peak_bytes": None if not CUDA else max(peak_before, _peak()) - base,
        "peak_steps_bytes": None if not CUDA else _peak() - base,
        "peak_rss_bytes": peak_rss_bytes(),
        "losses": losses,
    }
    del step, keep
    return entry


def _error(exc: BaseException) -> dict:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower()
    return {"error": text[-800:], "oom": oom, "traceback": traceback.format_exc()[-3000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="JSON list of {impl, offload, spec, warmup, steps}")
    cases = json.loads(parser.parse_args(argv).cases)
    join_group()
    for case in cases:
        try:
            entry = run_case(case)
        except Exception as exc:  # one failing case must not hide the others' figures
            entry = _error(exc)
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        print(MARK, json.dumps({"id": case["id"], **entry}), flush=True)
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
