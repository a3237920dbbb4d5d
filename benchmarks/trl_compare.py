"""TRL / PEFT workflows on our package next to upstream DeepSpeed 0.19.8: the first steps' losses.

    python benchmarks/trl_compare.py                 # every case, ours and upstream, a table
    python benchmarks/trl_compare.py --only ours sft:3

Each case runs `tests/clients/trl_workflows.py` under torchrun on 2 CPU ranks (gloo), once
with our package and once in upstream's venv (`benchmarks/.venv-upstream`, made by
setup_upstream.sh, plus trl==1.16.0 peft==0.21.2 accelerate==1.16.0 datasets). Upstream
imports the workflows from a temporary folder that links only `tests/`, so its own
`deepspeed` is the one imported. Upstream needs DS_ACCELERATOR=cpu and its own
TORCH_EXTENSIONS_DIR; HF's AdamW is the optimizer on both sides (no optimizer block).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# setup_upstream.sh's venv; UPSTREAM_PYTHON names another (a git worktree has none of its own)
UPSTREAM_PY = os.environ.get(
    "UPSTREAM_PYTHON", os.path.join(ROOT, "benchmarks", ".venv-upstream", "bin", "python")
)
CASES = [
    "sft:3",
    "sft:2:offload",
    "sft_gc:3",
    "dpo:3",
    "dpo_precompute:3",
    "dpo:2:offload",
    "grpo:3",
    "grpo_nogather:3",
    "grpo:2",
    "reward:3",
    "reward:2:offload",
    "peft_lora:3",
]


def parse_case(case: str) -> dict:
    parts = case.split(":")
    return {"workflow": parts[0], "stage": int(parts[1]), "offload": "offload" in parts[2:]}


def worker(case: str, out_path: str) -> None:
    """One rank of one case: run the workflow in the folder of `out_path` (shared by the
    ranks, as a training run's output_dir is), rank 0 writes the result as JSON."""
    from tests.clients import trl_workflows

    spec = parse_case(case)
    run_dir = os.path.join(os.path.dirname(out_path), "run")
    result = trl_workflows.WORKFLOWS[spec["workflow"]](run_dir, spec["stage"], spec["offload"])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump({k: result[k] for k in ("losses", "rewards") if k in result}, f)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(side: str, case: str, timeout_s: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        if side == "ours":
            python, env["PYTHONPATH"] = sys.executable, ROOT
        else:  # upstream: only our tests/ on the path, never our deepspeed/
            os.symlink(os.path.join(ROOT, "tests"), os.path.join(tmp, "tests"))
            python, env["PYTHONPATH"] = UPSTREAM_PY, tmp
            env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR="/tmp/torch_ext_up")
        out = os.path.join(tmp, "result.json")
        port = str(free_port())
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
        cmd += [os.path.abspath(__file__), "--worker", case, "--out", out]
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s}s"}
        if proc.returncode != 0 or not os.path.exists(out):
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank0]:") and "Error" in ln]
            lines = lines or [ln for ln in proc.stderr.splitlines() if "Error" in ln]
            return {"error": (lines[-1] if lines else proc.stderr[-300:]).strip()}
        with open(out) as f:
            return json.load(f)


def format_result(result: dict) -> str:
    text = " ".join(f"{x:.6f}" for x in result["losses"])
    if "rewards" in result:  # GRPO's loss is 0 at these steps; its rewards show the policy
        text += " (reward " + " ".join(f"{x:.4f}" for x in result["rewards"]) + ")"
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=CASES)
    parser.add_argument("--only", choices=["ours", "upstream"])
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    sides = [args.only] if args.only else ["ours", "upstream"]
    if "upstream" in sides and not os.path.exists(UPSTREAM_PY):
        parser.error(
            f"no upstream venv at {UPSTREAM_PY}: run benchmarks/setup_upstream.sh or set UPSTREAM_PYTHON"
        )
    print("| case | " + " | ".join(sides) + " |")
    print("|---" * (len(sides) + 1) + "|")
    for case in args.cases:
        cells = []
        for side in sides:
            result = launch(side, case, args.timeout)
            cells.append(result.get("error") or format_result(result))
        print(f"| {case} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
