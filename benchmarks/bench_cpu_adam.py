"""CPU Adam step: ours, torch AdamW (foreach, fused), upstream DeepSpeed, and the memory floor.

    python benchmarks/bench_cpu_adam.py                          # 1M, 8M and 64M params, ~3 min
    python benchmarks/bench_cpu_adam.py --sizes 8M --threads 2   # the headline case alone

One parameter of N elements, AdamW (lr 1e-3, weight decay 0.01), fp32 optimizer states,
1 and 2 threads (torch.set_num_threads; upstream's process sets the same). Per case:

  ours           DeepSpeedCPUAdam.step() with the native op (one pass per step)
  torch_foreach  torch.optim.AdamW(foreach=True).step()
  torch_fused    torch.optim.AdamW(fused=True).step()
  upstream       upstream DeepSpeed 0.19.8's DeepSpeedCPUAdam.step(), in its own venv
                 (_cpu_adam_upstream.py, driven over a pipe so its steps alternate with ours)
  floor          the best of four streaming kernels over the same bytes as our step, with
                 the same threads: the op's bandwidth_probe, p += g, m += g, v += g (4 reads,
                 3 writes per element, all loads before the stores, nothing else), shared
                 out in spans as our step is (floor_spans), in one contiguous stretch per
                 thread as STREAM does (floor_contiguous), and that with non-temporal stores
                 (floor_nt), and in spans with a software prefetch 512 elements ahead on
                 every stream, as our step's loop runs on Intel CPUs (floor_spans_pf). Each
                 runs twice: with all four tensors in ordinary 4 KiB pages,
                 and (the `_thp` twins) with the two states in 2 MiB transparent huge pages
                 and param and grad in 4 KiB pages, the page policy of our step (below).
                 Each is timed in the rounds like the others; the floor is the lowest of
                 their medians, and `floor_variants_gb_s` gives each one's rate.

Pages: DeepSpeedCPUAdam allocates exp_avg and exp_avg_sq with
deepspeed.runtime.huge_pages.huge_page_zeros (2 MiB aligned, MADV_HUGEPAGE); param and grad
are the caller's (here plain torch tensors, 4 KiB pages while THP is in `madvise` mode).
torch's AdamW and upstream keep their own (default) allocations. Each case reports, in
`thp_mib`, how much of the memory each side allocated the kernel really backed with huge
pages (AnonHugePages of /proc/self/smaps_rollup before and after its setup and first step).

dtype fp32: fp32 param and grad (28 bytes per param per step). dtype bf16: bf16 param and
grad, fp32 states, updated in place (22 bytes; ours, upstream and the floor). torch has no
fp32 states for bf16 params, so its bf16 rows step an fp32 master (fp32 grad) and copy it
to the bf16 param with copy_ (34 bytes): what a torch user runs for the same result.

Each round times `reps` steps of every implementation in turn, in a fresh order; the
figure is the median over rounds. Ratios are time ratios (below 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from deepspeed.ops.adam.cpu_adam import PREFETCH  # noqa: E402
from deepspeed.ops.op_builder import ALL_OPS  # noqa: E402
from deepspeed.runtime.huge_pages import anon_huge_page_bytes, huge_page_zeros  # noqa: E402

UPSTREAM_PYTHON = HERE / ".venv-upstream" / "bin" / "python"
UPSTREAM_SERVER = HERE / "_cpu_adam_upstream.py"
EXTENSIONS_DIR = HERE / ".cache" / "torch_extensions"
IMPLS = ("ours", "torch_foreach", "torch_fused", "upstream", "floor")
FLOOR_PREFETCH = 512  # elements, the distance the step's loop prefetches on Intel CPUs
FLOOR_VARIANTS = {  # name: bandwidth_probe's (nontemporal, contiguous, prefetch), states in huge pages
    "floor_spans": (False, False, 0, False),
    "floor_contiguous": (False, True, 0, False),
    "floor_nt": (True, True, 0, False),
    "floor_spans_pf": (False, False, FLOOR_PREFETCH, False),
    "floor_spans_thp": (False, False, 0, True),
    "floor_contiguous_thp": (False, True, 0, True),
    "floor_nt_thp": (True, True, 0, True),
    "floor_spans_pf_thp": (False, False, FLOOR_PREFETCH, True),
}
HEADLINE = "8M_fp32_2t"
# The op's distance as it loads (its vendor rule), where each case's own measurement starts.
DEFAULT_PREFETCH = ALL_OPS["cpu_adam"].load().prefetch() if ALL_OPS["cpu_adam"].try_load() else 0
# [Note: settling around upstream's turn]
# Two processes share the 2 cores: ours (with torch and the floor) and upstream's. After a
# parallel region, libgomp's worker threads spin (GOMP_SPINCOUNT, milliseconds) before they
# sleep, so the process that runs next shares its cores with the other's spinning threads.
# Run back to back, ours and upstream each lost 15-35% on 8M fp32 at 2 threads: ours 7.2 ms
# instead of 6.0, upstream 7.2-8.4 ms instead of 4.6-5.7. A pause before and after upstream's
# turn (untimed) lets the other side's threads park first. The rounds also used to rotate one
# fixed order, in which ours always ran right after upstream's turn; each round now runs the
# implementations in a fresh order, so no one always follows upstream.
SETTLE_S = 0.02
LR, WEIGHT_DECAY = 1e-3, 0.01


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def _uniform(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.rand(n).sub_(0.5).to(dtype)


class Upstream:
    """upstream's DeepSpeedCPUAdam in a child process; `time()` runs steps there and waits."""

    def __init__(self, python: Path, timeout_s: float = 900.0) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
        EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [str(python), str(UPSTREAM_SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(HERE),
            env=env,
        )

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-3000:]
            raise RuntimeError(f"upstream cpu_adam server exited (code {self.proc.poll()}):\n{err}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _ours(n: int, dtype: str) -> Callable[[], None]:
    """Ours as a fresh process has it after its first steps: from the op's default distance,
    the steps that choose the prefetch distance run here, untimed, as each case's own
    ([Note: the prefetch distance, measured where it runs])."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    param = torch.nn.Parameter(_uniform(n, dt))
    param.grad = _uniform(n, dt)
    opt = DeepSpeedCPUAdam([param], lr=LR, weight_decay=WEIGHT_DECAY)
    if not opt.uses_native:
        raise RuntimeError("the cpu_adam op did not load; this benchmark measures the native op")
    ALL_OPS["cpu_adam"].load().set_prefetch(DEFAULT_PREFETCH)
    PREFETCH.reset()
    for _ in range(1 + 2 * PREFETCH.TRIALS):
        opt.step()
    return opt.step


def _torch(n: int, dtype: str, **kwargs) -> Callable[[], None]:
    master = torch.nn.Parameter(_uniform(n))
    master.grad = _uniform(n)
    opt = torch.optim.AdamW([master], lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
    if dtype == "fp32":
        return opt.step
    model = torch.empty(n, dtype=torch.bfloat16)

    def step() -> None:
        opt.step()
        with torch.no_grad():
            model.copy_(master)

    return step


def _floors(n: int, dtype: str) -> dict[str, Callable[[], Callable[[], None]]]:
    """The floor's variants (makers of), each over its own tensors of the step's types.

    Own tensors, not shared: at 1M parameters a step's bytes fit in L3, and a variant run
    right after another on the same tensors would find them there while every other
    implementation starts from memory.
    """
    op = ALL_OPS["cpu_adam"].load()
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32

    def variant(nontemporal: bool, contiguous: bool, prefetch: int, huge_states: bool) -> Callable[[], None]:
        states = (_uniform(n), _uniform(n))
        if huge_states:  # as DeepSpeedCPUAdam allocates its states
            states = tuple(huge_page_zeros(n).copy_(state) for state in states)
        tensors = (_uniform(n, dt), _uniform(n, dt), *states)
        return lambda: op.bandwidth_probe(
            *tensors, nontemporal=nontemporal, contiguous=contiguous, prefetch=prefetch
        )

    return {name: (lambda flags=flags: variant(*flags)) for name, flags in FLOOR_VARIANTS.items()}


def _timed(fn: Callable[[], None], reps: int) -> float:
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def bytes_per_param(impl: str, dtype: str) -> int:
    if dtype == "fp32":
        return 28
    return 34 if impl.startswith("torch") else 22


def measure_case(
    n: int, dtype: str, threads: int, rounds: int, reps: int, upstream: Optional[Upstream]
) -> dict:
    torch.set_num_threads(threads)
    makers: dict[str, Callable[[], Callable[[], None]]] = {
        "ours": lambda: _ours(n, dtype),
        "torch_foreach": lambda: _torch(n, dtype, foreach=True),
        "torch_fused": lambda: _torch(n, dtype, fused=True),
        **_floors(n, dtype),
    }
    steps: dict[str, Callable[[], None]] = {}
    thp_mib: dict[str, Optional[int]] = {}  # MiB each side's setup and first step got in huge pages
    for name, make in makers.items():
        before = anon_huge_page_bytes()
        steps[name] = make()
        steps[name]()  # warm-up: states allocated, pages touched
        after = anon_huge_page_bytes()
        thp_mib[name] = None if before is None else round((after - before) / 2**20)
    if upstream is not None:
        upstream.ask({"cmd": "setup", "n": n, "dtype": dtype, "threads": threads})
        steps["upstream"] = lambda: None  # timed in its process, below
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        # A fresh order each round (seeded by the round): in a rotation each implementation
        # always follows the same one, and ours always followed upstream's turn.
        for name in random.Random(r).sample(names, len(names)):
            if name == "upstream":  # see [Note: settling around upstream's turn]
                time.sleep(SETTLE_S)
                times[name].append(upstream.ask({"cmd": "time", "reps": reps})["s"])
                time.sleep(SETTLE_S)
            else:
                times[name].append(_timed(steps[name], reps))
    del steps
    case = summarize(n, dtype, threads, {name: statistics.median(ts) for name, ts in times.items()})
    case["thp_mib"] = thp_mib
    case["prefetch"] = PREFETCH.result  # what ours' first steps chose, and what they measured
    return case


def summarize(n: int, dtype: str, threads: int, median_s: dict) -> dict:
    variants = {name: median_s[name] for name in FLOOR_VARIANTS if name in median_s}
    if variants:
        median_s = {**median_s, "floor": min(variants.values())}
    ms = {impl: (1e3 * median_s[impl] if impl in median_s else None) for impl in IMPLS}
    ours = ms["ours"]

    def ratio(other: Optional[float]) -> Optional[float]:
        return round(ours / other, 3) if other else None

    floor_bytes = bytes_per_param("floor", dtype) * n
    return {
        "params": n,
        "dtype": dtype,
        "threads": threads,
        **{f"{impl}_ms": (round(v, 3) if v is not None else None) for impl, v in ms.items()},
        "ours_mparam_s": round(n / ours / 1e3, 1),
        "floor_gb_s": round(floor_bytes / ms["floor"] / 1e6, 1),
        "floor_variants_gb_s": {name: round(floor_bytes / t / 1e9, 1) for name, t in variants.items()},
        "ours_gb_s": round(bytes_per_param("ours", dtype) * n / ours / 1e6, 1),
        "ratio_vs_floor": ratio(ms["floor"]),
        "ratio_vs_torch_fused": ratio(ms["torch_fused"]),
        "ratio_vs_torch_foreach": ratio(ms["torch_foreach"]),
        "ratio_vs_upstream": ratio(ms["upstream"]),
    }


def case_key(n: int, dtype: str, threads: int) -> str:
    return f"{n // 2**20}M_{dtype}_{threads}t" if n >= 2**20 else f"{n}_{dtype}_{threads}t"


def run(
    sizes: list[int],
    dtypes: list[str],
    threads: list[int],
    rounds: int = 7,
    reps: int = 3,
    upstream_python: Optional[Path] = UPSTREAM_PYTHON,
) -> dict:
    """Every case; headline ratios from 8M fp32 at 2 threads (when measured)."""
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    upstream = None
    if upstream_python is not None:
        if upstream_python.exists():
            upstream = Upstream(upstream_python)
        else:
            print(f"cpu_adam: {upstream_python} is missing (bash benchmarks/setup_upstream.sh); null")
    saved_threads = torch.get_num_threads()
    cases = {}
    try:
        for n in sizes:
            for dtype in dtypes:
                for t in threads:
                    try:
                        case = measure_case(n, dtype, t, rounds, reps, upstream)
                    except RuntimeError as exc:  # upstream failed: measure the rest without it
                        if upstream is None:
                            raise
                        print(f"cpu_adam: upstream failed, reported as null: {exc}", file=sys.stderr)
                        upstream.close()
                        upstream = None
                        case = measure_case(n, dtype, t, rounds, reps, None)
                    cases[case_key(n, dtype, t)] = case
                    print(format_row(case), flush=True)
    finally:
        torch.set_num_threads(saved_threads)
        if upstream is not None:
            upstream.close()
    head = cases.get(HEADLINE, {})
    op = ALL_OPS["cpu_adam"].load()
    return {
        "ratio_vs_floor": head.get("ratio_vs_floor"),
        "ratio_vs_torch_fused": head.get("ratio_vs_torch_fused"),
        "ratio_vs_upstream": head.get("ratio_vs_upstream"),
        "headline_case": HEADLINE,
        "isa": op.isa(),
        "prefetch": op.prefetch(),
        "rounds": rounds,
        "reps": reps,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cases": cases,
        "wall_s": round(time.monotonic() - began, 1),
    }


COLUMNS = ("ours", "torch_foreach", "torch_fused", "upstream", "floor")


def _fmt(value: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_header() -> str:
    head = "| case | " + " | ".join(f"{c} ms" for c in COLUMNS)
    return head + " | vs floor | vs fused | vs upstream |\n|" + "---|" * (len(COLUMNS) + 4)


def format_row(case: dict) -> str:
    key = case_key(case["params"], case["dtype"], case["threads"])
    cells = [_fmt(case[f"{c}_ms"]) for c in COLUMNS]
    ratios = [_fmt(case[k]) for k in ("ratio_vs_floor", "ratio_vs_torch_fused", "ratio_vs_upstream")]
    return f"| {key} | " + " | ".join(cells + ratios) + " |"


def format_pages(result: dict) -> str:
    """Which pages each side used: MiB its setup and first step got in huge pages, per case."""
    cells = []
    for key, case in result["cases"].items():
        thp = case.get("thp_mib") or {}
        rates = case["floor_variants_gb_s"]
        best = max(rates, key=rates.get)
        cells.append(f"{key} ours {_fmt(thp.get('ours'), 'd')}, floor ({best}) {_fmt(thp.get(best), 'd')}")
    return (
        "Pages: ours' exp_avg / exp_avg_sq come from huge_page_zeros (2 MiB THP), param and grad "
        "are plain tensors (4 KiB pages); the floor is the best of its variants in 4 KiB pages "
        "and `_thp` twins with the states in huge pages; torch and upstream use their default "
        "allocations. MiB in huge pages after setup: " + "; ".join(cells)
    )


def format_table(result: dict) -> str:
    rows = [format_row(case) for case in result["cases"].values()]
    return "\n".join([format_header(), *rows, "", format_pages(result)])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,8M,64M", help="comma list of parameter counts (K/M suffixes)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; each times every implementation")
    parser.add_argument("--reps", type=int, default=3, help="steps per implementation per round")
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--upstream-python", type=Path, default=UPSTREAM_PYTHON)
    parser.add_argument("--json", type=Path, help="also write the result here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    op = ALL_OPS["cpu_adam"].load()
    print(
        f"load average {os.getloadavg()[0]:.2f}; kernel {op.isa()}, prefetch {op.prefetch()} elements ahead"
    )
    print(format_header(), flush=True)
    result = run(
        [parse_size(s) for s in args.sizes.split(",")],
        args.dtypes.split(","),
        [int(t) for t in args.threads.split(",")],
        args.rounds,
        args.reps,
        None if args.skip_upstream else args.upstream_python,
    )
    print(
        f"headline {HEADLINE}: "
        + ", ".join(
            f"{k} {result[k]}" for k in ("ratio_vs_floor", "ratio_vs_torch_fused", "ratio_vs_upstream")
        )
    )
    print(format_pages(result))
    for key, case in result["cases"].items():
        print(f"{key} floor GB/s by variant: {case['floor_variants_gb_s']}")
    print(f"load average before/after: {result['load_average']}; {result['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
