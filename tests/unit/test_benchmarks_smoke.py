"""The benchmarks keep running: each script's `--quick` mode exits 0 and prints its table.

They spawn their own gloo CPU ranks, so they run here as subprocesses (not through
`DistributedTest`). No timing is asserted: figures live in the benchmarks' output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.timeout(150)
def test_bench_gather_quick(tmp_path):
    out = _run("bench_gather.py", "--json", str(tmp_path / "gather.json"))
    assert "start/stop ms" in out and "start_stop/raw" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["10"], ["100"])]
    assert [r[0] for r in rows] == ["1", "10", "100"], out
    report = json.loads((tmp_path / "gather.json").read_text())
    for key in ("P=1", "P=10", "P=100"):
        row = report["gather"][key]
        assert row["start_stop_s"] > 0 and row["with_s"] > 0 and row["raw_allgather_s"] > 0
        assert row["ratio_vs_raw_allgather"] > 0 and row["start_stop_vs_with"] > 0
    assert {"machine", "torch", "date"} <= report.keys()


@pytest.mark.timeout(150)
def test_bench_init_memory_quick(tmp_path):
    out = _run("bench_init_memory.py", "--json", str(tmp_path / "init.json"))
    assert "ideal MB" in out and "ratio" in out
    report = json.loads((tmp_path / "init.json").read_text())
    ratios = report["init"]["peak_rss_ratio_to_ideal"]
    assert sorted(ratios) == ["1", "2"], ratios
    assert all(r > 0 for r in ratios.values())
