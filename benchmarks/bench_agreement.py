"""What the rank-agreement checks cost (runtime/agreement.py): zero.Init and a train step,
with the checks on and off, side by side in one run on 2 gloo CPU ranks.

    python benchmarks/bench_agreement.py [--layers 24] [--width 256] [--rounds 7]

Init runs one agreement collective per module that has parameters; `initialize` one for the
whole model; a train step none (GatheredParameters checks only with enable_sanity_checks).
"Off" replaces the check with a no-op in this process only. Prints JSON with the medians and
`init_ratio_on_vs_off` / `step_ratio_on_vs_off` (1.0 = free).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import run_ranks  # noqa: E402


def _model(layers: int, width: int):
    from torch import nn

    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 8))


CALLS = {"count": 0}


def _set_checks(on: bool) -> None:
    """Checks on (counted) or off, where Init and initialize look them up."""
    import deepspeed.runtime.agreement as agreement
    import deepspeed.runtime.engine as engine
    import deepspeed.runtime.zero.partition_parameters as pp

    def counted(*args, **kwargs):
        CALLS["count"] += 1
        return agreement.check_agreement(*args, **kwargs)

    check = counted if on else (lambda *a, **k: None)
    pp.check_agreement = check
    engine.check_agreement = check


def worker(rank: int, world_size: int, layers: int, width: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    import deepspeed
    import deepspeed.comm as dist

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    times: dict = {"init_on": [], "init_off": [], "step_on": [], "step_off": []}
    x, y = torch.randn(4, width), torch.randn(4, 8)
    for _ in range(rounds):
        for on in (True, False):  # alternating: drift on the shared machine hits both alike
            _set_checks(on)
            dist.barrier()
            start = time.perf_counter()
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = _model(layers, width)
            dist.barrier()
            times["init_on" if on else "init_off"].append(time.perf_counter() - start)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            before_steps = CALLS["count"]
            for step in range(3):
                dist.barrier()
                start = time.perf_counter()
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
                if step > 0:  # the first step records the prefetch trace
                    times["step_on" if on else "step_off"].append(time.perf_counter() - start)
            checks_in_steps = CALLS["count"] - before_steps
    _set_checks(True)
    return {
        **{k: statistics.median(v) for k, v in times.items()},
        "checks_per_round": CALLS["count"] / rounds,
        "checks_in_steps": checks_in_steps,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    per_rank = run_ranks(worker, world_size=2, args=(args.layers, args.width, args.rounds))
    medians = {k: max(r[k] for r in per_rank) for k in ("init_on", "init_off", "step_on", "step_off")}
    result = {
        **{f"{k}_s": round(v, 5) for k, v in medians.items()},
        "init_ratio_on_vs_off": round(medians["init_on"] / medians["init_off"], 3),
        "step_ratio_on_vs_off": round(medians["step_on"] / medians["step_off"], 3),
        "agreement_collectives_per_init_and_initialize": per_rank[0]["checks_per_round"],
        "agreement_collectives_per_step": per_rank[0]["checks_in_steps"] / 3,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
