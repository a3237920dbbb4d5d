"""One process on the accelerator (a GPU under CUDA): each ZeRO stage against plain PyTorch.

    python benchmarks/bench_accelerator.py --json out.json          # GPT-2 small, fp32 and bf16
    python benchmarks/bench_accelerator.py --quick                  # a tiny stand-in, a smoke run

The other benchmarks run CPU ranks on gloo. This one runs where the accelerator is (the CPU
when there is none, which is only good as a smoke run): world size 1 on the accelerator's
backend (nccl under CUDA), so that it shows what the engine costs on a device that computes
fast, where Python overhead and host-device copies weigh more than on the CPU. At world size
1 nothing is sharded; every stage still runs its whole path (hooks, gathers through the
backend, the optimizer on its partition, offload copies).

The model is `_train_workers.Decoder` at GPT-2 small's shape (124M parameters, tied head),
sequence 1024, 8 sequences a micro-step (`--gas N`: N micro-steps a step, the same batch each),
AdamW (lr 1e-3). Implementations, run one after the other
in one process with the same initial weights and batches:
  plain        torch: the model, torch.optim.AdamW; bf16 runs under autocast with fp32 weights
  z1, z2, z3   ours at stage 1, 2, 3 (torch AdamW through `"torch_adam": true`)
  z2_off       ours at stage 2 with `offload_optimizer: {device: cpu}` (DeepSpeedCPUAdam)
  z3_off       ours at stage 3 with the optimizer and the parameters offloaded to the CPU
  z3_leaf      ours at stage 3 with each decoder block a leaf module (`zero_optimization.leaf_module:
               {classes: [Block]}`): one gather and one release per block instead of per layer
Each reports the median step time (synchronized), the peak and the between-step device
memory, and its losses over the first steps, whose largest relative difference from plain's
is the parity figure (fp32: the same kernels, so it should be near rounding; bf16: ours keeps
bf16 weights with fp32 masters, plain autocasts fp32 weights, so they differ by bf16 rounding).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _launch import free_port, leave_distributed  # noqa: E402
from _train_workers import build_model, ds_config  # noqa: E402

GPT2_SMALL = dict(model="decoder", vocab=50257, positions=1024, width=768, layers=12, heads=12, tied=True)
GPT2_SMALL.update(seq=1024, batch=8)
QUICK = dict(GPT2_SMALL, vocab=512, positions=64, width=64, layers=2, heads=2, seq=32, batch=2)
# Stage-3 sizes (elements) as in bench_train_step, scaled to the model: prefetch about one block.
ZERO_SIZES = dict(
    reduce_bucket_size=50_000_000,
    prefetch_bucket_size=10_000_000,
    persistence_threshold=100_000,
    allgather_bucket_size=50_000_000,
)
IMPLS = ("plain", "z1", "z2", "z3", "z2_off", "z3_off", "z3_leaf")
PARITY_STEPS = 3


def _batches(spec: dict, device: torch.device, count: int = 4) -> list:
    gen = torch.Generator().manual_seed(1234)
    shape = (spec["batch"], spec["seq"])
    return [
        tuple(torch.randint(0, spec["vocab"], shape, generator=gen).to(device) for _ in range(2))
        for _ in range(count)
    ]


def _plain(spec: dict, device: torch.device):
    model = build_model(spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = spec["dtype"] == "bf16"

    gas = spec["gas"]

    def step(x, y):
        for _ in range(gas):  # the same batch each micro-step: what is timed is the engine
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            (loss / gas).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, (model, opt)


def _ours(spec: dict, impl: str):
    import deepspeed

    stage = int(impl[1])
    offload = impl.endswith("_off")
    cfg = ds_config(spec, stage=stage, offload=offload)
    cfg["gradient_accumulation_steps"] = spec["gas"]
    if impl.endswith("_leaf"):
        cfg["zero_optimization"]["leaf_module"] = {"classes": ["Block"]}
    if offload and stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=build_model(spec), config=cfg)

    def step(x, y):
        for _ in range(spec["gas"]):  # engine.step() steps the optimizer at the last one
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss

    return step, engine


def _profile(step, batches: list, steps: int) -> str:
    """cProfile of `steps` more steps: the functions with the most own time (where the host
    spends a step beyond launching kernels: Python bookkeeping, waits, host-side copies)."""
    import cProfile
    import io
    import pstats

    from deepspeed.accelerator import get_accelerator

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(*batches[i % len(batches)])
    get_accelerator().synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def measure(
    spec: dict, impl: str, steps: int, warmup: int, device: torch.device, profile_steps: int = 0
) -> dict:
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    accel.empty_cache()
    accel.reset_peak_memory_stats()
    base = accel.memory_allocated()
    built = time.perf_counter()
    step, keep = _plain(spec, device) if impl == "plain" else _ours(spec, impl)
    build_s = time.perf_counter() - built
    batches = _batches(spec, device)
    losses, times = [], []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        accel.synchronize()
        start = time.perf_counter()
        loss = step(x, y)
        accel.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float()))
    accel.synchronize()
    if profile_steps:
        entry_profile = _profile(step, batches, profile_steps)
    entry = {
        "step_ms": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "build_s": build_s,
        "peak_device_bytes": accel.max_memory_allocated() - base,
        "between_steps_device_bytes": accel.memory_allocated() - base,
        "losses": losses[:PARITY_STEPS],
        "last_loss": losses[-1],
    }
    if profile_steps:
        entry["profile"] = entry_profile
    del step, keep
    gc.collect()
    accel.empty_cache()
    return entry


def run(opts) -> dict:
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    # Always a free port of our own: a MASTER_PORT inherited from the caller (a test process
    # whose own group already listens on it) would collide with it.
    os.environ["MASTER_PORT"] = str(free_port())
    accel = get_accelerator()
    dist.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    device = torch.device(accel.current_device_name())
    sizes = QUICK if opts.quick else GPT2_SMALL
    report: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "backend": accel.communication_backend_name(),
        "torch": torch.__version__,
        "spec": sizes,
        "gradient_accumulation_steps": opts.gas,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "cases": {},
    }
    for dtype in opts.dtypes.split(","):
        spec = dict(sizes, **ZERO_SIZES, dtype=dtype, gas=opts.gas)
        cases: dict = {}
        for impl in opts.impls.split(","):
            try:
                profile_steps = opts.profile_steps if f"{dtype}:{impl}" in opts.profile.split(",") else 0
                cases[impl] = measure(spec, impl, opts.steps, opts.warmup, device, profile_steps)
            except Exception as exc:  # one failing case must not hide the others' numbers
                cases[impl] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            shown = {k: v for k, v in cases[impl].items() if k != "profile"}
            print(f"{dtype} {impl}: {json.dumps(shown)}", flush=True)
            if "profile" in cases[impl]:
                print(f"cProfile of {dtype} {impl}, {opts.profile_steps} steps:\n{cases[impl]['profile']}")
        plain = cases.get("plain", {})
        for impl, entry in cases.items():
            if impl == "plain" or "error" in entry or "error" in plain:
                continue
            entry["ratio_vs_plain"] = entry["step_ms"] / plain["step_ms"]
            entry["peak_ratio_vs_plain"] = entry["peak_device_bytes"] / plain["peak_device_bytes"]
            entry["loss_rel_diff_vs_plain"] = max(
                abs(a - b) / abs(b) for a, b in zip(entry["losses"], plain["losses"])
            )
        report["cases"][dtype] = cases
    return report


def table(report: dict) -> str:
    lines = [
        f"{report['device']}, {report['backend']}, torch {report['torch']}, world size 1, "
        f"{report['gradient_accumulation_steps']} micro-step(s) a step, "
        f"median of {report['steps']} steps after {report['warmup']}",
        "",
        "| dtype | impl | step ms | / plain | peak GiB | between steps GiB | loss rel diff vs plain |",
        "|---|---|---|---|---|---|---|",
    ]
    gib = 2**30
    for dtype, cases in report["cases"].items():
        for impl, e in cases.items():
            if "error" in e:
                lines.append(f"| {dtype} | {impl} | error: {e['error'][:80]} | | | | |")
                continue
            lines.append(
                f"| {dtype} | {impl} | {e['step_ms']:.1f} | {e.get('ratio_vs_plain', 1.0):.2f} | "
                f"{e['peak_device_bytes'] / gib:.2f} | {e['between_steps_device_bytes'] / gib:.2f} | "
                f"{e.get('loss_rel_diff_vs_plain', 0.0):.2e} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a tiny stand-in model, a smoke run")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of: " + ", ".join(IMPLS))
    parser.add_argument(
        "--gas", type=int, default=1, help="micro-steps per optimizer step (gradient accumulation)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", default="", help="comma list of dtype:impl to profile, e.g. bf16:z3")
    parser.add_argument("--profile-steps", type=int, default=5)
    opts = parser.parse_args(argv)
    unknown = set(opts.impls.split(",")) - set(IMPLS)
    if unknown:
        parser.error(f"--impls {sorted(unknown)} unknown; choose from {', '.join(IMPLS)}")
    report = run(opts)
    text = table(report)
    print(text)
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1) + "\n")
    leave_distributed()
    failed = [f"{d}/{i}" for d, cases in report["cases"].items() for i, e in cases.items() if "error" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
