"""Upstream DeepSpeed's DeepSpeedCPUAdam as a timing server for bench_cpu_adam.py.

Run with the upstream venv's python. Reads one JSON command per line on stdin and answers
one JSON line on stdout, so the parent can alternate upstream's steps with its own:

    {"cmd": "setup", "n": 8388608, "dtype": "fp32", "threads": 2}   -> {"ok": true}
    {"cmd": "time", "reps": 3}                                       -> {"s": seconds per step}
    {"cmd": "quit"}

A bf16 case holds a bf16 parameter and grad with fp32 optimizer states (upstream's default).
The first setup JIT-compiles upstream's cpu_adam op into $TORCH_EXTENSIONS_DIR.
"""

import json
import sys
import time

import torch


def setup(n: int, dtype: str, threads: int):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(threads)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    param = torch.nn.Parameter(torch.rand(n).sub_(0.5).to(dt))
    param.grad = torch.rand(n).sub_(0.5).to(dt)
    opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    opt.step()  # warm-up: states allocated, pages touched
    return opt


def main() -> int:
    opt = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            opt = None
            opt = setup(cmd["n"], cmd["dtype"], cmd["threads"])
            reply = {"ok": True}
        elif cmd["cmd"] == "time":
            began = time.perf_counter()
            for _ in range(cmd["reps"]):
                opt.step()
            reply = {"s": (time.perf_counter() - began) / cmd["reps"]}
        else:
            return 0
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
