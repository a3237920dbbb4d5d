"""deepspeed.ops.aio's read and write bandwidth, each backend, against the disk's own (dd, O_DIRECT).

    python benchmarks/bench_aio.py                    # 512 MiB, 3 rounds, ~30 s on a virtio disk
    python benchmarks/bench_aio.py --size-mb 1024 --dir /mnt/nvme --json aio.json
    python benchmarks/bench_aio.py --quick            # 16 MiB, 1 round: a smoke run

The disk's own bandwidth is what `dd` gets with O_DIRECT on a file of the same size in the
same directory: `dd if=/dev/zero of=F bs=B count=N oflag=direct conv=fsync` for writes and
`dd if=F of=/dev/null bs=B iflag=direct` for reads, at B = 1 MiB (our block size) and
16 MiB (one large request the kernel splits into many in flight); the faster of the two is
the disk's figure. fio is not needed. O_DIRECT on both sides means the page cache holds
none of the file, so no cache needs dropping (which takes root).

The engine writes a page-aligned buffer (new_cpu_locked_tensor, so its ops are O_DIRECT;
at 2 MiB and more it is in transparent huge pages, see py_aio.cpp)
with sync_pwrite and then fsyncs the file, and reads it back with sync_pread; each backend
with its own handle: io_uring with one lane of `--queue-depth` requests in flight, the
thread pool with `--pool-threads` workers (one request in flight each). Every write
starts from a deleted file, as dd's does. Each round runs every case once, in a fresh
order; a case's figure is the median over rounds. Ratios are engine / dd bandwidth (above
1: the engine is faster); the target is >= 0.8 for reads and writes.

dd moves every request through one reused buffer of bs bytes, which stays in cache; the
engine moves the file into (out of) memory of the file's size. Where the disk is a copy
made by the host (a virtio disk backed by the host's page cache), that difference alone
shows. So a third reference, `direct_1M`, does what dd does (one 1 MiB O_DIRECT request at a
time, then an fsync for writes) from and into the engine's own buffers, in Python
(`os.pwritev` / `os.preadv`); `read_vs_same_memory` and `write_vs_same_memory` are the
default backend over it. The targets stay against dd.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from deepspeed.ops.op_builder import ALL_OPS  # noqa: E402

MIB = 2**20
BLOCK = MIB
DD_BLOCKS = (MIB, 16 * MIB)
TARGET = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512, help="file size in MiB (a multiple of 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a folder here)")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--pool-threads", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 round")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.size_mb, opts.rounds = 16, 1
    if opts.size_mb <= 0 or opts.size_mb % 16:
        parser.error(f"--size-mb must be a positive multiple of 16, got {opts.size_mb}")
    return opts


def _dd(args: list) -> float:
    began = time.perf_counter()
    proc = subprocess.run(["dd", *args, "status=none"], capture_output=True, text=True)
    took = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(
            f"dd {' '.join(args)} failed: {proc.stderr.strip()} (O_DIRECT needs a disk-backed file "
            "system, not tmpfs: pass --dir)"
        )
    return took


def dd_write(path: Path, nbytes: int, bs: int) -> float:
    path.unlink(missing_ok=True)
    return _dd(
        ["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={nbytes // bs}", "oflag=direct", "conv=fsync"]
    )


def dd_read(path: Path, bs: int) -> float:
    return _dd([f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"])


def direct_write(buf: torch.Tensor, path: Path) -> float:
    """dd's write (1 MiB O_DIRECT requests, one at a time, then fsync) from `buf`'s memory."""
    path.unlink(missing_ok=True)
    view, nbytes = memoryview(buf.numpy()), buf.numel()
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        for at in range(0, nbytes, BLOCK):
            if os.pwritev(fd, [view[at : at + BLOCK]], at) != min(BLOCK, nbytes - at):
                raise RuntimeError(f"direct_1M: a short write at byte {at} of {path}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - began


def direct_read(buf: torch.Tensor, path: Path) -> float:
    """dd's read (1 MiB O_DIRECT requests, one at a time) into `buf`'s memory."""
    view, nbytes = memoryview(buf.numpy()), buf.numel()
    began = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for at in range(0, nbytes, BLOCK):
            if os.preadv(fd, [view[at : at + BLOCK]], at) != min(BLOCK, nbytes - at):
                raise RuntimeError(f"direct_1M: a short read at byte {at} of {path}")
    finally:
        os.close(fd)
    return time.perf_counter() - began


def engine_write(handle, buf, path: Path) -> float:
    path.unlink(missing_ok=True)
    began = time.perf_counter()
    handle.sync_pwrite(buf, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - began


def engine_read(handle, buf, path: Path) -> float:
    began = time.perf_counter()
    handle.sync_pread(buf, str(path))
    return time.perf_counter() - began


def _handles(aio, opts) -> dict:
    """One handle per backend usable here (io_uring is left out, with the reason, where it is not)."""
    handles = {
        "thread_pool": aio.aio_handle(
            BLOCK, opts.queue_depth, False, True, opts.pool_threads, backend="thread_pool"
        )
    }
    if not aio.io_uring_unavailable_reason:
        handles["io_uring"] = aio.aio_handle(BLOCK, opts.queue_depth, False, True, 1, backend="io_uring")
    return handles


def _file_system(folder: Path) -> str:
    """The type of the mount holding `folder` (the longest mount point above it)."""
    path, best = str(folder.resolve()), ("", "unknown")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                point, kind = fields[1], fields[2]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, kind)
    except OSError:
        pass
    return best[1]


def measure(opts, folder: Path) -> dict:
    aio = ALL_OPS["async_io"].load()
    nbytes = opts.size_mb * MIB
    handles = _handles(aio, opts)
    buf = next(iter(handles.values())).new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    back = next(iter(handles.values())).new_cpu_locked_tensor(nbytes, buf)
    cases: dict = {f"dd_bs{bs // MIB}M": bs for bs in DD_BLOCKS}
    cases["direct_1M"] = None
    cases.update({name: h for name, h in handles.items()})
    seconds: dict = {name: {"write": [], "read": []} for name in cases}
    rng = random.Random(0)
    for _ in range(opts.rounds):
        order = list(cases)
        rng.shuffle(order)
        for name in order:  # each case writes its own file, then reads it back
            path = folder / f"{name}.bin"
            if name.startswith("dd_"):
                seconds[name]["write"].append(dd_write(path, nbytes, cases[name]))
                seconds[name]["read"].append(dd_read(path, cases[name]))
            elif name == "direct_1M":
                seconds[name]["write"].append(direct_write(buf, path))
                back.zero_()
                seconds[name]["read"].append(direct_read(back, path))
                if not torch.equal(back, buf):
                    raise RuntimeError(f"{name}: the bytes read back differ from those written")
            else:
                seconds[name]["write"].append(engine_write(cases[name], buf, path))
                back.zero_()
                seconds[name]["read"].append(engine_read(cases[name], back, path))
                if not torch.equal(back, buf):
                    raise RuntimeError(f"{name}: the bytes read back differ from those written")
            path.unlink()
    return _summary(seconds, nbytes, handles, aio, opts, folder)


def _summary(seconds: dict, nbytes: int, handles: dict, aio, opts, folder: Path) -> dict:
    rate = {
        name: {op: nbytes / statistics.median(ts) / MIB for op, ts in by_op.items()}
        for name, by_op in seconds.items()
    }
    disk = {op: max(rate[f"dd_bs{bs // MIB}M"][op] for bs in DD_BLOCKS) for op in ("read", "write")}
    out = {
        "file_bytes": nbytes,
        "rounds": opts.rounds,
        "dir_file_system": _file_system(folder),
        "mib_per_s": {name: {op: round(v, 1) for op, v in r.items()} for name, r in rate.items()},
        "disk_mib_per_s": {op: round(v, 1) for op, v in disk.items()},
        "seconds": seconds,
        "settings": {
            "block_size": BLOCK,
            "queue_depth": opts.queue_depth,
            "io_uring_lanes": 1,
            "pool_threads": opts.pool_threads,
        },
        "engine_o_direct": {name: h.io_stats()["buffered_ops"] == 0 for name, h in handles.items()},
        "default_backend": aio.backend,
        "io_uring_unavailable_reason": aio.io_uring_unavailable_reason,
    }
    for name in ("io_uring", "thread_pool"):
        for op in ("read", "write"):
            out[f"{op}_ratio_{name}"] = round(rate[name][op] / disk[op], 3) if name in rate else None
    out["read_ratio"] = out[f"read_ratio_{aio.backend}"]  # the backend a default handle gets here
    out["write_ratio"] = out[f"write_ratio_{aio.backend}"]
    for op in ("read", "write"):  # against dd's requests from and into the same memory (see the docstring)
        out[f"{op}_vs_same_memory"] = round(rate[aio.backend][op] / rate["direct_1M"][op], 3)
    return out


def format_table(result: dict) -> str:
    rows = result["mib_per_s"]
    disk = result["disk_mib_per_s"]
    lines = ["| case | write MiB/s | read MiB/s | write / dd | read / dd |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['write']:.0f} | {r['read']:.0f} | {r['write'] / disk['write']:.2f} | "
            f"{r['read'] / disk['read']:.2f} |"
        )
    s = result["settings"]
    same = ""
    if "read_vs_same_memory" in result:  # absent from runs before the reference existed
        same = (
            f"; direct_1M: dd's 1 MiB requests from and into the engine's buffers (default backend / "
            f"direct_1M: read {result['read_vs_same_memory']:.2f}, write {result['write_vs_same_memory']:.2f})"
        )
    lines += [
        "",
        f"{result['file_bytes'] // MIB} MiB file on {result['dir_file_system']}, median of {result['rounds']} "
        f"round(s); dd: the faster of bs=1M and bs=16M, O_DIRECT{same}; engine: block {s['block_size'] // MIB} MiB, "
        f"io_uring 1 lane x {s['queue_depth']} in flight, thread pool {s['pool_threads']} threads, O_DIRECT: "
        f"{result['engine_o_direct']}; default backend here: {result['default_backend']}"
        + (f" ({result['io_uring_unavailable_reason']})" if result["io_uring_unavailable_reason"] else "")
        + f"; load average {result['loadavg_1m'][0]} -> {result['loadavg_1m'][1]}",
    ]
    return "\n".join(lines)


def run(opts) -> dict:
    """Measures in a fresh folder under --dir (removed after); returns the figures."""
    if shutil.which("dd") is None:
        raise SystemExit("bench_aio: dd is not on PATH (coreutils)")
    parent = opts.dir or HERE
    load_before = os.getloadavg()[0]
    folder = Path(tempfile.mkdtemp(prefix="bench_aio_", dir=parent))
    try:
        result = measure(opts, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(format_table(result), flush=True)
    return result


def main(argv=None) -> int:
    opts = parse_args(argv)
    result = run(opts)
    if opts.json:
        import platform

        record = {"aio": result, "machine": platform.platform(), "torch": torch.__version__}
        record["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        opts.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
