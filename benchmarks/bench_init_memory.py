"""Peak RSS per rank while a model is built under `deepspeed.zero.Init`, at world sizes 1, 2, 4.

    python benchmarks/bench_init_memory.py                       # S = 400 MB fp32, width 2048
    python benchmarks/bench_init_memory.py --size-mb 800 --json out.json
    python benchmarks/bench_init_memory.py --quick               # seconds; the smoke test

The model is a stack of `nn.Linear(d, d)` layers totalling about S bytes of fp32 parameters,
so the largest layer L = (d*d + d) * 4 bytes is known. With N ranks, the best a build can do
is to hold its S/N bytes of shards plus one full layer while that layer is being
partitioned: ideal = S/N + L. Each world size is one spawned group of gloo CPU ranks.

Per rank, the baseline is the resident set after torch, deepspeed and `init_distributed` and a
warm-up build of a tiny model under Init (first-use imports and caches are not parameters);
the peak is the kernel's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`
just before the build) and, as a cross-check, the largest RSS seen by a thread sampling
`/proc/self/statm` every millisecond. Reported: peak growth = peak - baseline, the ideal,
their ratio, and the growth still resident after the build (shards plus what malloc kept).

glibc malloc decides when freed memory goes back to the kernel (its mmap and trim
thresholds move with the allocation pattern), which moves RSS. Each world size is therefore
run under every `--malloc` setting: `default` (no MALLOC_* variable set in the children) and
`mmap64k` (MALLOC_MMAP_THRESHOLD_=65536 and MALLOC_TRIM_THRESHOLD_=0: every large block is
its own mapping, returned on free). The table says which one each row used.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _launch  # noqa: E402 - the benchmarks folder is not a package

MB = 2**20
MALLOC_SETTINGS = {
    "default": {},
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
}


# ----------------------------------------------------------------------------- memory probes


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") <= _status_kb("VmRSS") + 64


class RssSampler:
    """A thread recording the largest RSS seen in `/proc/self/statm`, every `interval_s`."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.peak_bytes = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._rss())


# ----------------------------------------------------------------------------- the rank side


def layer_plan(size_bytes: int, width: int) -> tuple:
    """`(layers, layer_bytes)`: how many Linear(width, width) layers make about `size_bytes`."""
    layer_bytes = (width * width + width) * 4
    return max(1, round(size_bytes / layer_bytes)), layer_bytes


def build_stack(width: int, layers: int):
    from torch import nn

    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def rank_worker(rank: int, world_size: int, cfg: dict) -> dict:
    """Build the stack under Init and report this rank's memory figures (bytes)."""
    import deepspeed

    # Warm-up: the first Init and the first Linear import and cache code (and allocate
    # interpreter memory) once per process; that is no cost of the parameters.
    with deepspeed.zero.Init():
        warm = build_stack(8, 2)
    del warm
    gc.collect()
    hwm_ok = reset_high_water_mark()
    baseline = _status_kb("VmRSS") * 1024
    with RssSampler() as sampler:
        with deepspeed.zero.Init():
            model = build_stack(cfg["width"], cfg["layers"])
    peak_hwm = _status_kb("VmHWM") * 1024 if hwm_ok else 0
    # VmHWM can lag the live counters by a few pages; the larger of the two is the peak.
    peak = max(peak_hwm, sampler.peak_bytes)
    shard_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    if any(p.data.numel() for p in model.parameters()):
        raise RuntimeError(f"[rank {rank}] parameters are still gathered after the build")
    return {
        "rank": rank,
        "baseline_bytes": baseline,
        "peak_growth_bytes": peak - baseline,
        "hwm_peak_growth_bytes": peak_hwm - baseline if hwm_ok else None,
        "sampled_peak_growth_bytes": sampler.peak_bytes - baseline,
        "retained_growth_bytes": _status_kb("VmRSS") * 1024 - baseline,
        "shard_bytes": shard_bytes,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }


# ----------------------------------------------------------------------------- the parent side


def run_world(world_size: int, malloc: str, cfg: dict) -> dict:
    env = dict(MALLOC_SETTINGS[malloc])
    ranks = _launch.run_ranks(rank_worker, world_size, args=(cfg,), env=env, child_env_unset=_malloc_keys())
    ideal = cfg["size_bytes"] / world_size + cfg["layer_bytes"]
    for r in ranks:
        r["ideal_bytes"] = ideal
        r["peak_rss_ratio_to_ideal"] = r["peak_growth_bytes"] / ideal
    return {
        "world_size": world_size,
        "malloc": malloc,
        "malloc_env": env,
        "ideal_bytes": ideal,
        "peak_rss_ratio_to_ideal": max(r["peak_rss_ratio_to_ideal"] for r in ranks),
        "ranks": ranks,
    }


def _malloc_keys() -> list:
    keys = {k for setting in MALLOC_SETTINGS.values() for k in setting}
    return sorted(keys | {k for k in os.environ if k.startswith("MALLOC_")})


def format_table(runs: list, cfg: dict) -> str:
    lines = [
        f"Peak RSS growth while building {cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) under "
        f"zero.Init: S = {cfg['size_bytes'] / MB:.1f} MB fp32, largest layer L = {cfg['layer_bytes'] / MB:.2f} MB, "
        "ideal = S/N + L",
        f"{'N':>2} {'malloc':>8} {'rank':>4} {'peak MB':>9} {'ideal MB':>9} {'ratio':>6} "
        f"{'VmHWM MB':>9} {'sampled MB':>10} {'retained MB':>11} {'shards MB':>9}",
    ]
    for run in runs:
        for r in run["ranks"]:
            hwm = "n/a" if r["hwm_peak_growth_bytes"] is None else f"{r['hwm_peak_growth_bytes'] / MB:.1f}"
            lines.append(
                f"{run['world_size']:>2} {run['malloc']:>8} {r['rank']:>4} {r['peak_growth_bytes'] / MB:>9.1f} "
                f"{r['ideal_bytes'] / MB:>9.1f} {r['peak_rss_ratio_to_ideal']:>6.3f} {hwm:>9} "
                f"{r['sampled_peak_growth_bytes'] / MB:>10.1f} {r['retained_growth_bytes'] / MB:>11.1f} "
                f"{r['shard_bytes'] / MB:>9.1f}"
            )
    lines.append(
        "malloc settings: " + "; ".join(f"{k}: {v or 'no MALLOC_* set'}" for k, v in MALLOC_SETTINGS.items())
    )
    return "\n".join(lines)


def json_report(runs: list, cfg: dict) -> dict:
    by_malloc: dict = {}
    for run in runs:
        by_malloc.setdefault(run["malloc"], {})[f"world_size={run['world_size']}"] = run
    headline = runs[0]["malloc"]  # the first --malloc setting (default: glibc's own)
    return {
        "init": {
            "peak_rss_ratio_to_ideal": {
                str(run["world_size"]): run["peak_rss_ratio_to_ideal"]
                for run in runs
                if run["malloc"] == headline
            },
            "headline_malloc": headline,
            "size_bytes": cfg["size_bytes"],
            "largest_layer_bytes": cfg["layer_bytes"],
            "layers": cfg["layers"],
            "width": cfg["width"],
            "by_malloc": by_malloc,
        },
        "malloc_settings": MALLOC_SETTINGS,
        "machine": _launch.machine_info(),
        "torch": _launch.machine_info()["torch"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=400.0, help="fp32 MB of parameters (S)")
    parser.add_argument("--width", type=int, default=2048, help="d of each Linear(d, d)")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated; one spawned group each")
    parser.add_argument(
        "--malloc", default="default,mmap64k", help=f"comma-separated of {sorted(MALLOC_SETTINGS)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, default malloc only (smoke test)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.width, args.world_sizes, args.malloc = 8.0, 256, "1,2", "default"
    unknown = [m for m in args.malloc.split(",") if m not in MALLOC_SETTINGS]
    if unknown:
        parser.error(f"--malloc {unknown} unknown; choose from {sorted(MALLOC_SETTINGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    layers, layer_bytes = layer_plan(int(args.size_mb * MB), args.width)
    cfg = {
        "width": args.width,
        "layers": layers,
        "layer_bytes": layer_bytes,
        "size_bytes": layers * layer_bytes,
    }
    runs = [
        run_world(int(n), malloc, cfg)
        for malloc in args.malloc.split(",")
        for n in args.world_sizes.split(",")
    ]
    print(format_table(runs, cfg))
    if args.json:
        args.json.write_text(json.dumps(json_report(runs, cfg), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
