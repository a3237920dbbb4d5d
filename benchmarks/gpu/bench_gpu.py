"""One GPU, one rank: ours (ZeRO-3, with and without CPU offload) vs upstream DeepSpeed vs FSDP2 vs torch.

    bash benchmarks/gpu/run.sh                      # the real run (installs, then runs this)
    python benchmarks/gpu/bench_gpu.py --dry-run    # on the CPU: tiny models, one step each

For GPT-2 small (124M, tied head, sequence 1024, 8 sequences a step) and a 1.3B decoder
(GPT-3 XL's shape: width 2048, 24 blocks, 16 heads; sequence 1024, 4 sequences), bf16, it
times the step (median, synchronized) and reads the peak device memory
(`torch.cuda.max_memory_allocated`) of:
  ours / upstream   ZeRO stage 3, bench_train_step's config; `_off`: offload_optimizer and
                    offload_param to the CPU (pinned), DeepSpeedCPUAdam
  fsdp2             fully_shard per block and at the root, bf16 compute; `_off`: CPUOffloadPolicy
  plain             the model on the GPU, bf16 autocast, torch's fused AdamW
then, for each implementation with CPU offload, the largest decoder (width 4096, 32 heads,
sequence 1024, 1 sequence) that trains one step: blocks doubled from `--largest-start`, then
bisected, within `--largest-budget-s`; and the model zoo (tests/zoo) on CUDA
(DS_ACCELERATOR=cuda, one rank). Each case runs in its own process (_case.py) under its
implementation's interpreter and path: ours from this tree, upstream from its own install.
Writes `gpu-latest.{json,md}` (`--dry-run`: `gpu-dry-run.*`, marked so) in `--out-dir`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import _gpu_report  # noqa: E402
from _launch import free_port  # noqa: E402
from bench_accelerator import GPT2_SMALL, QUICK, ZERO_SIZES  # noqa: E402

MARK = "@@gpu@@"
DECODER_1P3B = dict(GPT2_SMALL, width=2048, layers=24, heads=16, batch=4)
# The largest-model search: blocks of width 4096 (about 201M parameters each), one sequence.
LARGEST = dict(GPT2_SMALL, width=4096, heads=32, layers=1, batch=1)
MODELS = {"gpt2_small": GPT2_SMALL, "decoder_1.3b": DECODER_1P3B}
DRY_MODELS = {"gpt2_small": QUICK, "decoder_1.3b": dict(QUICK, width=96, heads=4, layers=3)}
DRY_LARGEST = dict(QUICK, width=32, heads=2, layers=1, batch=1)
# (name, impl, offload); upstream's cases run under its interpreter.
CASES = (
    ("ours", "ours", False),
    ("ours_off", "ours", True),
    ("upstream", "upstream", False),
    ("upstream_off", "upstream", True),
    ("fsdp2", "fsdp2", False),
    ("fsdp2_off", "fsdp2", True),
    ("plain", "plain", False),
)
OFFLOADED = ("ours_off", "upstream_off", "fsdp2_off")


def decoder_params(spec: dict) -> int:
    """_train_workers.Decoder's parameter count (GPT-2 small: 124,439,808), without building it."""
    d, v = spec["width"], spec["vocab"]
    block = 12 * d * d + 13 * d  # qkv, proj, fc, out with biases; two LayerNorms
    head = 0 if spec.get("tied") else v * d
    return v * d + (spec.get("positions") or spec["seq"]) * d + spec["layers"] * block + 2 * d + head


class Interpreters:
    """The python and environment each implementation's cases run under."""

    def __init__(self, opts) -> None:
        self.opts = opts
        self.skip_upstream = upstream_skip_reason(opts)

    def env(self, impl: str) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
        env["DS_ACCELERATOR"] = "cpu" if self.opts.dry_run else "cuda"
        if impl == "upstream":  # its own install only: never this tree's deepspeed
            env["PYTHONPATH"] = os.pathsep.join(self.opts.upstream_path)
            env["TORCH_EXTENSIONS_DIR"] = str(
                self.opts.torch_extensions_dir or BENCH / ".cache" / "torch_extensions"
            )
        else:
            if self.opts.torch_extensions_dir:
                env["TORCH_EXTENSIONS_DIR"] = str(self.opts.torch_extensions_dir)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *self.opts.ours_path])
        return env

    def python(self, impl: str) -> str:
        return str(self.opts.upstream_python) if impl == "upstream" else self.opts.ours_python


def upstream_skip_reason(opts) -> str:
    if opts.skip_upstream:
        return "skipped: --skip-upstream"
    if not Path(opts.upstream_python).exists() and "/" in str(opts.upstream_python):
        return f"skipped: {opts.upstream_python} not found (bash benchmarks/setup_upstream.sh makes it)"
    return ""


def run_batch(interp: Interpreters, impl: str, cases: list, timeout_s: float) -> dict:
    """Run `cases` (all of `impl`'s interpreter) in one _case.py process; entries by case id."""
    cmd = [interp.python(impl), str(HERE / "_case.py"), "--cases", json.dumps(cases)]
    began = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=interp.env(impl), capture_output=True, text=True, timeout=max(timeout_s, 1)
        )
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = _text(exc.stdout), _text(exc.stderr), f"timeout after {timeout_s:.0f} s"
    found = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            entry = json.loads(line[len(MARK) :])
            found[entry.pop("id")] = entry
    tail = "\n".join((out + "\n" + err).strip().splitlines()[-15:])
    for case in cases:
        if case["id"] not in found:
            found[case["id"]] = {"error": f"no result (exit {code}): {tail[-600:]}", "oom": _oom(tail)}
            found[case["id"]]["timed_out"] = isinstance(code, str)
        found[case["id"]]["wall_s"] = round(time.monotonic() - began, 2)
    return found


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _oom(text: str) -> bool:
    """A process that died of memory: CUDA's message, or killed by the kernel (SIGKILL, -9)."""
    return "out of memory" in text.lower() or "exit -9" in text


class Clock:
    """The run's budget: each case gets what is left, up to its own limit."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def measure_models(opts, interp: Interpreters, clock: Clock) -> dict:
    """Every (model, case): step time and peak memory. One process per case (per interpreter in a dry run)."""
    models = {
        m: s for m, s in (DRY_MODELS if opts.dry_run else MODELS).items() if not opts.only or m in opts.only
    }
    todo, results = [], {m: {} for m in models}
    for model, sizes in models.items():
        spec = dict(sizes, **ZERO_SIZES, dtype="bf16")
        for name, impl, offload in CASES:
            if impl == "upstream" and interp.skip_upstream:
                results[model][name] = {"skipped": interp.skip_upstream}
                continue
            big = model != "gpt2_small"
            warmup, steps = (1, 1) if opts.dry_run else ((1, 3) if offload and big else (2, opts.steps))
            case = {"id": f"{model}:{name}", "impl": impl, "offload": offload, "spec": spec}
            todo.append(dict(case, warmup=warmup, steps=steps))
    for key, entry in run_cases(opts, interp, todo, clock, limit_s=opts.case_timeout_s).items():
        model, name = key.split(":")
        entry["params"] = decoder_params(dict(models[model], **ZERO_SIZES))
        results[model][name] = entry
    return {m: {name: cases[name] for name, _, _ in CASES} for m, cases in results.items()}


def run_cases(opts, interp: Interpreters, todo: list, clock: Clock, limit_s: float) -> dict:
    """The dry run batches cases by interpreter (one start each); the real run isolates each."""
    out: dict = {}
    groups = [[c] for c in todo]
    if opts.dry_run:
        by_python: dict = {}
        for c in todo:
            by_python.setdefault("upstream" if c["impl"] == "upstream" else "ours", []).append(c)
        groups = list(by_python.values())
    for group in groups:
        if clock.left() < 5:
            out.update({c["id"]: {"skipped": "budget spent (--budget-s)"} for c in group})
            continue
        found = run_batch(interp, group[0]["impl"], group, min(limit_s * len(group), clock.left()))
        for key, entry in found.items():  # as each finishes: a run cut short still shows them
            print(f"{key.replace(':', ' ')}: {_gpu_report.one_line(entry)}", flush=True)
        out.update(found)
    return out


def largest_trainable(opts, interp: Interpreters, clock: Clock) -> dict:
    """Per offloaded implementation: the most blocks that train one step, doubled then bisected.

    The real run starts a process per probe, each given what is left of this implementation's
    share of `clock` (`--largest-budget-s` and what the models left unused); the dry run runs blocks 1 and 2 of each in one process per
    interpreter first (a process start costs more than a tiny step), then searches over those.
    """
    # zero_init: ours and upstream build the probes under zero.Init (on the CPU), as a user
    # would a model too big to build whole; FSDP2 builds on the CPU and shards there.
    spec = dict(DRY_LARGEST if opts.dry_run else LARGEST, **ZERO_SIZES, dtype="bf16", zero_init=True)
    impls = {case: impl for case, impl, _ in CASES}
    names = [n for n in OFFLOADED if not (impls[n] == "upstream" and interp.skip_upstream)]
    found = {n: {"skipped": interp.skip_upstream} for n in OFFLOADED if n not in names}
    known: dict = {}
    if opts.dry_run:
        todo = [_probe_case(n, impls[n], spec, layers) for n in names for layers in (1, 2)]
        known = run_cases(opts, interp, todo, clock, limit_s=opts.case_timeout_s)
    for i, name in enumerate(names):
        share = clock.left() / (len(names) - i)

        def probe(layers: int, limit_s: float, name=name) -> dict:
            case = _probe_case(name, impls[name], spec, layers)
            if case["id"] in known:
                return known[case["id"]]
            return run_batch(interp, case["impl"], [case], limit_s)[case["id"]]

        found[name] = search(opts, probe, spec, share)
        print(f"largest {name}: {json.dumps({k: v for k, v in found[name].items() if k != 'probes'})}")
    return {n: found[n] for n in OFFLOADED}


def _probe_case(name: str, impl: str, spec: dict, layers: int) -> dict:
    spec = dict(spec, layers=layers)
    return {"id": f"{name}:L{layers}", "impl": impl, "offload": True, "spec": spec, "warmup": 0, "steps": 1}


def search(opts, probe, spec: dict, budget_s: float) -> dict:
    """Blocks `start`, 2x, 4x, ... until one fails, then halve the gap, while the budget lasts.

    `probe(layers, limit_s)` trains one step of that many blocks and returns _case.py's entry.
    """
    clock = Clock(budget_s)
    ok, bad, probes = 0, None, []
    layers = 1 if opts.dry_run else opts.largest_start
    limit = 2 if opts.dry_run else opts.largest_max_probes
    while len(probes) < limit and clock.left() > 5:
        entry = probe(layers, clock.left())
        good = "error" not in entry and "skipped" not in entry
        params = decoder_params(dict(spec, layers=layers))
        probes.append({"layers": layers, "params": params, "ok": good, **_brief(entry)})
        print(f"  probe {layers} blocks ({params:,} parameters): {_gpu_report.one_line(entry)}", flush=True)
        if entry.get("timed_out"):
            break  # out of time, not out of memory: no bound learnt, the bracket stays open
        ok, bad = (max(ok, layers), bad) if good else (ok, layers if bad is None else min(bad, layers))
        if not good and not entry.get("oom") and ok == 0:
            break  # a failure that is not memory at the smallest size: report it, stop
        layers = layers * 2 if bad is None else (ok + bad) // 2
        if bad is not None and layers <= ok:
            break
    params = decoder_params(dict(spec, layers=ok)) if ok else None
    closed = bad is not None and bad == ok + 1
    return {
        "layers": ok,
        "params": params,
        "failed_at_layers": bad,
        "bracket_closed": closed,
        "probes": probes,
    }


def _brief(entry: dict) -> dict:
    keys = ("step_s", "peak_bytes", "peak_rss_bytes", "error", "oom", "timed_out", "wall_s")
    return {k: (v[:300] if isinstance(v, str) else v) for k, v in entry.items() if k in keys}


def run_zoo(opts, interp: Interpreters, clock: Clock) -> dict:
    """tests/zoo on CUDA (one rank on one GPU), under ours' interpreter and path."""
    if opts.dry_run:
        return {"skipped": "dry run: the zoo runs on the CPU with `pytest tests/zoo`"}
    if opts.skip_zoo:
        return {"skipped": "--skip-zoo"}
    limit = min(opts.zoo_timeout_s, clock.left())
    cmd = [
        opts.ours_python,
        "-m",
        "pytest",
        "tests/zoo",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout=300",
    ]
    began = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=interp.env("ours"), capture_output=True, text=True, timeout=max(limit, 1)
        )
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = _text(exc.stdout) + _text(exc.stderr), f"timeout after {limit:.0f} s"
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    counts = (
        {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary[-1])}
        if summary
        else {}
    )
    return {
        "exit": code,
        "summary": summary[-1] if summary else "",
        "counts": counts,
        "wall_s": round(time.monotonic() - began, 1),
        "tail": "\n".join(out.splitlines()[-25:]),
    }


def device_info(opts) -> dict:
    """The device the cases ran on, read by ours' interpreter (the driver need not import torch)."""
    code = (
        "import json, torch; c = torch.cuda.is_available(); "
        "print(json.dumps({'device': torch.cuda.get_device_name(0) if c else 'cpu', 'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'device_memory_bytes': torch.cuda.get_device_properties(0).total_memory if c else None}))"
    )
    out = subprocess.run([opts.ours_python, "-c", code], capture_output=True, text=True, check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    info.update(host=platform.node(), cpu_count=os.cpu_count(), python=platform.python_version())
    return info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, one step each; gpu-dry-run.*")
    p.add_argument("--out-dir", type=Path, default=BENCH / "results")
    p.add_argument("--only", default="", help="comma list of models (gpt2_small, decoder_1.3b) to measure")
    p.add_argument("--steps", type=int, default=5, help="timed steps a case (offloaded 1.3B: 3)")
    p.add_argument("--budget-s", type=float, default=450, help="the whole run's wall-clock budget")
    p.add_argument("--case-timeout-s", type=float, default=150)
    p.add_argument("--largest-budget-s", type=float, default=90, help="for all three searches")
    p.add_argument("--largest-start", type=int, default=8, help="blocks of the first probe (201M each)")
    p.add_argument("--largest-max-probes", type=int, default=5)
    p.add_argument("--skip-largest", action="store_true")
    p.add_argument("--zoo-timeout-s", type=float, default=90)
    p.add_argument("--skip-models", action="store_true", help="only the largest-model search and the zoo")
    p.add_argument("--skip-zoo", action="store_true")
    p.add_argument("--skip-upstream", action="store_true")
    p.add_argument("--ours-python", default=sys.executable)
    p.add_argument("--ours-path", action="append", default=[], help="extra PYTHONPATH entries for ours")
    p.add_argument("--upstream-python", default=str(BENCH / ".venv-upstream" / "bin" / "python"))
    p.add_argument("--upstream-path", action="append", default=[], help="PYTHONPATH for upstream")
    p.add_argument(
        "--torch-extensions-dir",
        type=Path,
        help="JIT builds of both (default: ours torch's default, upstream benchmarks/.cache/torch_extensions)",
    )
    opts = p.parse_args(argv)
    opts.only = [m for m in opts.only.split(",") if m]
    unknown = set(opts.only) - set(MODELS)
    if unknown:
        p.error(f"--only {sorted(unknown)}: choose from {', '.join(MODELS)}")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    interp = Interpreters(opts)
    began = time.monotonic()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": opts.dry_run,
        **device_info(opts),
        "upstream": interp.skip_upstream or "deepspeed 0.19.8",
    }
    # [Note: the budget] The models get what the largest-model search and the zoo leave, so a
    # slow case cannot squeeze them out; what the models leave unused goes on to them.
    later = (0 if opts.skip_largest else opts.largest_budget_s) + (0 if opts.skip_zoo else opts.zoo_timeout_s)
    models = {} if opts.skip_models else measure_models(opts, interp, Clock(opts.budget_s - later))
    report["models"] = models
    _gpu_report.write(dict(report, partial="models only so far"), opts.out_dir)  # kept if cut short
    clock = Clock(opts.budget_s - (time.monotonic() - began))
    if opts.skip_largest:
        report["largest"] = {"skipped": "--skip-largest"}
    else:
        zoo_reserve = 0 if opts.skip_zoo or opts.dry_run else opts.zoo_timeout_s
        report["largest"] = largest_trainable(opts, interp, Clock(clock.left() - zoo_reserve))
        _gpu_report.write(dict(report, partial="no zoo yet"), opts.out_dir)
    report["zoo"] = run_zoo(opts, interp, clock)
    report["ratios"] = _gpu_report.ratios(report)
    report["wall_s"] = round(time.monotonic() - began, 1)
    paths = _gpu_report.write(report, opts.out_dir)
    print(_gpu_report.markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
