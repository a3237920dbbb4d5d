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


def _run(script: str, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
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
        assert (
            row["swap_floor_s"] > 0
            and row["ratio_vs_swap_floor"] == row["start_stop_s"] / row["swap_floor_s"]
        )
    # The headline ratios are the worst P's.
    assert report["ratio_vs_raw_allgather"] == max(
        r["ratio_vs_raw_allgather"] for r in report["gather"].values()
    )
    assert report["worst_case"]["swap_floor_vs_raw_allgather"] in report["gather"]
    assert {"machine", "torch", "date"} <= report.keys()


@pytest.mark.timeout(150)
def test_bench_gather_layouts_quick():
    out = _run("bench_gather_layouts.py", "--params", "1,10")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["10"])]
    assert len(rows) == 2 and all(len(row) == 1 + 2 * 9 for row in rows), out


@pytest.mark.timeout(150)
def test_bench_sequence_parallel_quick(tmp_path):
    """Ulysses: the all-to-all bytes it counts are the formula's; sp=2 holds fewer activation
    bytes than sp=1, and tiling fewer than no tiling (read back from its JSON)."""
    out = _run("bench_sequence_parallel.py", "--json", str(tmp_path / "sp.json"))
    assert "saved for backward" in out and "a2a/layer fwd" in out, out
    rows = json.loads((tmp_path / "sp.json").read_text())["rows"]
    assert sorted({(r["sp"], r["tiled"]) for r in rows}) == [
        (sp, t) for sp in (1, 2, 4) for t in (False, True)
    ]
    for row in rows:
        assert row["a2a_bytes_per_layer"] == row["a2a_formula_bytes_per_layer"], row
        assert row["a2a_bytes_backward"] == row["a2a_bytes_per_layer"] * 2, (
            row
        )  # 2 layers, as much as forward
    saved = {(r["sp"], r["tiled"]): r["saved_bytes"] for r in rows if r["rank"] == 0}
    assert saved[(2, False)] < saved[(1, False)] and saved[(1, True)] < saved[(1, False)], saved


@pytest.mark.timeout(150)
def test_bench_init_memory_quick(tmp_path):
    out = _run("bench_init_memory.py", "--json", str(tmp_path / "init.json"))
    assert "ideal MB" in out and "ratio" in out
    report = json.loads((tmp_path / "init.json").read_text())
    ratios = report["init"]["peak_rss_ratio_to_ideal"]
    assert sorted(ratios) == ["1", "2"], ratios
    assert all(r > 0 for r in ratios.values())


@pytest.mark.timeout(150)
def test_bench_accelerator_quick(tmp_path):
    """On this machine the accelerator is the CPU: every case runs, and fp32 ones match plain."""
    out = _run("bench_accelerator.py", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "acc.json"))
    assert "| fp32 | z3_off |" in out and "| bf16 | z2 |" in out, out
    report = json.loads((tmp_path / "acc.json").read_text())
    for dtype, cases in report["cases"].items():
        assert set(cases) == {"plain", "z1", "z2", "z3", "z2_off", "z3_off", "z3_leaf"}, cases
        for impl, entry in cases.items():
            assert "error" not in entry, (dtype, impl, entry)
            if impl != "plain":
                assert entry["ratio_vs_plain"] > 0
                assert entry["loss_rel_diff_vs_plain"] < (1e-5 if dtype == "fp32" else 1e-2), (dtype, impl)


REQUIRED_KEYS = (
    "train_step.ours_s",
    "train_step.upstream_deepspeed_s",
    "train_step.fsdp2_s",
    "train_step.ratio_vs_upstream",
    "train_step.ratio_vs_fsdp2",
    "train_step.cases",
    "train_step.ratio_vs_ddp",
    "train_step.ratio_vs_ddp_worst",
    "train_step.stage1_ratio_vs_ddp",
    "train_step.stage2_ratio_vs_ddp",
    "train_step.stage2_ratio_vs_upstream",
    "train_step.stage1_ratio_vs_upstream",
    "gather.ratio_vs_raw_allgather",
    "gather.swap_floor_vs_raw_allgather",
    "gather.ratio_vs_swap_floor",
    "gather.ratio_vs_copy_floor",
    "gather.ratio_vs_fsdp2",
    "gather.start_stop_vs_with",
    "gather.upstream_with_s",
    "gather.cases",
    "init.peak_rss_ratio_to_ideal",
    "init.cases",
    "scaling.cases",
    "scaling.offload",
    "gpt2_small.ours_s",
    "gpt2_small.fsdp2_s",
    "gpt2_small.ratio_vs_upstream",
    "gpt2_small.ratio_vs_fsdp2",
    "gpt2_small.live_bytes_ratio_to_ideal",
    "gpt2_small.params",
    "gpt2_small.scaling",
    "gpt2_small.collectives",
    "sequence_parallel.activation_ratio_sp2",
    "sequence_parallel.activation_ratio_sp2_tiled",
    "sequence_parallel.activation_ratio_sp4",
    "sequence_parallel.a2a_bytes_per_layer",
    "sequence_parallel.a2a_formula_bytes_per_layer",
    "sequence_parallel.lmax",
    "sequence_parallel.lmax_note",
    "machine.cpu_model",
    "machine.cores",
    "machine.loadavg_before",
    "versions.torch",
    "versions.ours",
    "versions.upstream",
    "date",
)


def _lookup(report: dict, dotted: str):
    node = report
    for key in dotted.split("."):
        assert isinstance(node, dict) and key in node, f"latest.json has no {dotted!r}"
        node = node[key]
    return node


@pytest.mark.timeout(450)
def test_run_all_quick(tmp_path):
    # About 18 process groups start (ZeRO-3, -1, -2, offload, FSDP2, DDP at 1 and 2 ranks, the
    # GPT-2 stand-in): about two minutes on 2 cores, more when other jobs load the machine.
    # The hierarchical section runs in its own test below (test_run_all_quick_hierarchical).
    only = "train_step,gather,init,scaling,cpu_adam,agreement,gpt2_small,sequence_parallel"
    out = _run("run_all.py", "--skip-upstream", "--out-dir", str(tmp_path), "--only", only, timeout=420)
    assert "| metric | measured | target | met |" in out
    report = json.loads((tmp_path / "latest.json").read_text())
    values = {key: _lookup(report, key) for key in REQUIRED_KEYS}
    assert values["train_step.ours_s"] > 0 and values["train_step.fsdp2_s"] > 0
    assert values["train_step.upstream_deepspeed_s"] is None  # skipped
    assert "decoder_fp32" in values["train_step.cases"]
    assert sorted(values["gather.cases"]) == ["P=1", "P=10", "P=100"]
    assert sorted(values["gather.upstream_with_s"]) == ["P=1", "P=10", "P=100"]
    assert values["gather.ratio_vs_raw_allgather"] > 0 and values["init.peak_rss_ratio_to_ideal"] > 0
    assert sorted(values["init.cases"]) and sorted(values["scaling.cases"]) == ["1", "2"]
    assert report["scaling"]["cases"]["2"]["ours_state_bytes_per_rank"] > 0
    # ZeRO stages 1 and 2: timed beside DDP (upstream skipped), live bytes in the scaling table.
    assert values["train_step.stage1_ratio_vs_ddp"] > 0 and values["train_step.stage2_ratio_vs_ddp"] > 0
    assert values["train_step.stage2_ratio_vs_upstream"] is None  # skipped
    case = report["scaling"]["cases"]["2"]
    for key in ("ours_stage1_state_bytes_per_rank", "ours_stage2_state_bytes_per_rank"):
        assert case[key] > 0, key
    assert case["ideal_zero12_bytes_per_rank"] == (4 + 12 / 2) * case["params"]
    # Optimizer offload: bytes by device, and no made-up accelerator figure on a CPU-only machine.
    offload = values["scaling.offload"]
    assert sum(offload["live_bytes_by_device"].values()) > 0
    assert sum(offload["optimizer_bytes_by_device"].values()) > 0
    if offload["accelerator"] == "cpu":
        assert offload["optimizer_bytes_on_accelerator"] is None and "CPU-only" in offload["note"]
    # GPT-2 small (--quick: a 2-layer stand-in, no DDP): side by side, ours at 1 and 2 ranks, collectives.
    assert values["gpt2_small.ours_s"] > 0 and values["gpt2_small.fsdp2_s"] > 0
    assert values["gpt2_small.ratio_vs_upstream"] is None  # skipped
    assert sorted(values["gpt2_small.scaling"]) == ["1", "2"]
    assert 0 < values["gpt2_small.live_bytes_ratio_to_ideal"]
    assert all(min(rss) > 0 for rss in report["gpt2_small"]["peak_rss_bytes_by_rank"].values())
    assert values["gpt2_small.collectives"]["ours"]["executed"]  # gloo or shared memory ran something
    assert report["train_step"]["cases"]["decoder_fp32"]["collectives"]["ddp"]["requested"]
    md = (tmp_path / "latest.md").read_text()
    assert "ZeRO stages 1 and 2 beside DDP" in md and "Optimizer offload" in md
    assert "GPT-2 small" in md and "ran (kind: calls, MB)" in md
    # Ulysses (--quick: sp = 1 and 2 only, no L_max search, each null with its reason).
    assert 0 < values["sequence_parallel.activation_ratio_sp2"] < 1
    assert (
        values["sequence_parallel.activation_ratio_sp2_tiled"]
        < values["sequence_parallel.activation_ratio_sp2"]
    )
    assert (
        values["sequence_parallel.activation_ratio_sp4"] is None and values["sequence_parallel.lmax"] is None
    )
    assert "--quick" in values["sequence_parallel.lmax_note"]
    a2a = values["sequence_parallel.a2a_bytes_per_layer"]
    assert a2a == values["sequence_parallel.a2a_formula_bytes_per_layer"] and a2a["2"] > 0
    assert "Ulysses sequence parallelism" in md and "sequence parallel sp=2 activation bytes / sp=1" in md
    assert (tmp_path / "latest.md").read_text().startswith("Benchmarks ")


@pytest.mark.timeout(150)
def test_run_all_quick_hierarchical(tmp_path):
    """The hierarchical section alone (about 30 s): 4 ranks as 2 nodes x 2, one step's bytes per
    layout read back from latest.json and checked against what each layout must move."""
    out = _run(
        "run_all.py", "--skip-upstream", "--out-dir", str(tmp_path), "--only", "hierarchical", timeout=140
    )
    assert "hpZ + qwZ + qgZ" in out, out
    report = json.loads((tmp_path / "latest.json").read_text())
    h = report["hierarchical"]
    assert (h["world_size"], h["ranks_per_node"]) == (4, 2)
    import deepspeed

    assert h["deepspeed_file"] == deepspeed.__file__  # the ranks ran this tree's deepspeed
    rows = h["rows"]
    assert list(rows) == ["plain", "mics", "hpz", "hpz_qwz_qgz"]
    plain, mics, hpz, quant = (rows[k] for k in rows)

    def op(row, name):
        return row["by_op"].get(name, {"cross_bytes": 0, "within_bytes": 0})

    # Plain ZeRO-3: every collective spans the world, so a rank hears 2 ranks across, 1 within.
    assert plain["cross_bytes"] > 0 and plain["cross_bytes"] == 2 * plain["within_bytes"]
    # MiCS (one node a shard group): only the replicas' gradient all-reduce crosses nodes, and
    # it carries as many bytes across as plain's reduce-scatter does.
    assert op(mics, "all_reduce")["cross_bytes"] == mics["cross_bytes"]
    assert mics["cross_bytes"] == op(plain, "reduce_scatter_columns")["cross_bytes"]
    # hpZ: the backward's gathers stay in the node; the reduce-scatter is plain's.
    assert op(hpz, "reduce_scatter_columns") == op(plain, "reduce_scatter_columns")
    assert hpz["cross_bytes"] < plain["cross_bytes"] and hpz["within_bytes"] > plain["within_bytes"]
    # hpZ + qwZ + qgZ: int8 gathers and the two-hop reduce-scatter (an all-to-all).
    assert (
        "reduce_scatter_columns" not in quant["by_op"] and op(quant, "all_to_all_single")["cross_bytes"] > 0
    )
    assert quant["cross_bytes"] < 0.25 * plain["cross_bytes"]
    assert h["cross_ratio_hpz_qwz_qgz"] == quant["cross_bytes"] / plain["cross_bytes"]
    assert all(row["step_s"] > 0 and len(row["step_times_s"]) == 2 for row in rows.values())
    md = (tmp_path / "latest.md").read_text()
    assert "Multi-node ZeRO at 4 ranks as 2 nodes x 2" in md
    assert "hpZ+qwZ+qgZ cross-node bytes / plain ZeRO-3 (2x2)" in md


@pytest.mark.timeout(300)
def test_run_all_quick_aio(tmp_path):
    """The aio section alone (16 MiB; the op's JIT build the first time): each backend usable
    here and dd, read back from latest.json, the bytes checked, the targets in latest.md."""
    out = _run("run_all.py", "--skip-upstream", "--out-dir", str(tmp_path), "--only", "aio", timeout=280)
    assert "| dd_bs1M |" in out and "| thread_pool |" in out, out
    aio = json.loads((tmp_path / "latest.json").read_text())["aio"]
    assert aio["file_bytes"] == 16 * 2**20 and aio["rounds"] == 1
    cases = {"dd_bs1M", "dd_bs16M", "direct_1M", "thread_pool"} | (
        {"io_uring"} if not aio["io_uring_unavailable_reason"] else set()
    )
    assert set(aio["mib_per_s"]) == cases
    assert all(r["read"] > 0 and r["write"] > 0 for r in aio["mib_per_s"].values())
    assert aio["read_ratio_thread_pool"] > 0 and aio["write_ratio_thread_pool"] > 0
    assert aio["read_ratio"] == aio[f"read_ratio_{aio['default_backend']}"]
    # The same-memory reference: the default backend over dd-style requests into its own buffers.
    backend = aio["mib_per_s"][aio["default_backend"]]
    for op in ("read", "write"):
        same = backend[op] / aio["mib_per_s"]["direct_1M"][op]  # from rates rounded to 0.1 MiB/s
        assert aio[f"{op}_vs_same_memory"] == pytest.approx(same, rel=0.01)
    if aio["dir_file_system"] != "tmpfs":
        assert all(aio["engine_o_direct"].values()), aio["engine_o_direct"]
    md = (tmp_path / "latest.md").read_text()
    assert "aio thread-pool read bandwidth / dd O_DIRECT" in md and "| >= 0.8 |" in md
    assert "Async I/O (deepspeed.ops.aio) bandwidth against dd with O_DIRECT" in md


# ----------------------------------------------------------------------------- benchmarks/gpu

GPU_CASES = ["ours", "ours_off", "upstream", "upstream_off", "fsdp2", "fsdp2_off", "plain"]


def _gpu_module(name: str):
    for path in (BENCHMARKS / "gpu", BENCHMARKS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import importlib

    return importlib.import_module(name)


@pytest.mark.timeout(240)
def test_gpu_bench_dry_run(tmp_path):
    """bench_gpu.py --dry-run (what `benchmarks/gpu/run.sh --dry-run` runs) on the CPU: every case
    but upstream's builds and steps once (upstream is recorded as skipped, its python named
    as missing), the largest-model search probes 1 and 2 blocks, and the JSON and markdown it
    writes hold what it printed."""
    missing = tmp_path / "no-venv" / "python"
    cmd = [sys.executable, str(BENCHMARKS / "gpu" / "bench_gpu.py"), "--dry-run", "--out-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*cmd, "--upstream-python", str(missing)], capture_output=True, text=True, timeout=220, env=env
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert not (tmp_path / "gpu-latest.json").exists()  # a dry run never stands in for a GPU run
    assert report["dry_run"] is True and report["device"] == "cpu" and report["cuda"] is None
    assert "partial" not in report  # the section-by-section saves were replaced by the whole
    assert str(missing) in report["upstream"] and "not found" in report["upstream"]
    params = _gpu_module("bench_gpu").decoder_params
    build_model = _gpu_module("_train_workers").build_model
    for model, sizes in _gpu_module("bench_gpu").DRY_MODELS.items():
        cases = report["models"][model]
        assert list(cases) == GPU_CASES, cases.keys()
        for name, entry in cases.items():
            if name.startswith("upstream"):
                assert entry == {"skipped": report["upstream"]}
                continue
            assert "error" not in entry, (model, name, entry)
            assert entry["step_s"] > 0 and entry["peak_bytes"] is None and entry["peak_rss_bytes"] > 0
            assert len(entry["losses"]) == 2 and all(0 < loss < 20 for loss in entry["losses"])
            # What it printed is what it wrote.
            assert f"{model} {name}: {entry['step_s'] * 1e3:.1f} ms/step" in proc.stdout
        want = sum(p.numel() for p in build_model(sizes).parameters())
        assert {e["params"] for e in cases.values() if "params" in e} == {params(sizes)} == {want}
        assert cases["ours"]["optimizer"] == "AdamW" and cases["ours_off"]["optimizer"] == "DeepSpeedCPUAdam"
        ratio = report["ratios"][f"{model}: ours / FSDP2"]
        assert ratio["value"] == pytest.approx(cases["ours"]["step_s"] / cases["fsdp2"]["step_s"])
        assert report["ratios"][f"{model}: ours / upstream"]["met"] is None  # nothing to compare
    largest = report["largest"]
    assert list(largest) == ["ours_off", "upstream_off", "fsdp2_off"]
    assert largest["upstream_off"] == {"skipped": report["upstream"]}
    for name in ("ours_off", "fsdp2_off"):
        assert [p["layers"] for p in largest[name]["probes"]] == [1, 2], largest[name]
        assert largest[name]["layers"] == 2 and all(p["ok"] for p in largest[name]["probes"])
    assert "skipped" in report["zoo"]
    md = (tmp_path / "gpu-dry-run.md").read_text()
    assert md.startswith("# GPU benchmark: DRY RUN") and md in proc.stdout
    for name in GPU_CASES:
        assert f"| {name} |" in md


def test_gpu_bench_largest_search_doubles_then_bisects():
    """The search over blocks: 8 and 16, then halves the gap down to the last that fits."""
    bench_gpu = _gpu_module("bench_gpu")
    opts = bench_gpu.parse_args(["--largest-start", "8", "--largest-max-probes", "6"])
    asked = []

    def probe(layers, limit_s):
        asked.append(layers)
        return {"step_s": 1.0} if layers <= 11 else {"error": "CUDA out of memory", "oom": True}

    spec = dict(bench_gpu.LARGEST, **bench_gpu.ZERO_SIZES)
    found = bench_gpu.search(opts, probe, spec, budget_s=60)
    assert asked == [8, 16, 12, 10, 11]
    assert found["layers"] == 11 and found["failed_at_layers"] == 12 and found["bracket_closed"]
    assert found["params"] == bench_gpu.decoder_params(dict(spec, layers=11))
    # A failure that is not memory at the first size stops the search at once.
    asked.clear()
    found = bench_gpu.search(opts, lambda n, s: asked.append(n) or {"error": "ImportError: x"}, spec, 60)
    assert asked == [8] and found["layers"] == 0 and found["params"] is None
    # Running out of time is no bound: the search stops with the bracket open.
    asked.clear()

    def slow(layers, limit_s):
        asked.append(layers)
        return {"step_s": 1.0} if layers < 16 else {"error": "no result (exit timeout)", "timed_out": True}

    found = bench_gpu.search(opts, slow, spec, 60)
    assert asked == [8, 16] and found["layers"] == 8 and found["failed_at_layers"] is None
    assert not found["bracket_closed"] and found["probes"][-1]["timed_out"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_all_quick_nvme_optimizer(tmp_path):
    """The nvme_optimizer section alone: ZeRO-2 with offload_optimizer nvme beside cpu, both timed."""
    _run("run_all.py", "--skip-upstream", "--out-dir", str(tmp_path), "--only", "nvme_optimizer", timeout=280)
    n = json.loads((tmp_path / "latest.json").read_text())["nvme_optimizer"]
    assert n["ours_stage2_offload_s"] > 0 and n["ours_stage2_nvme_s"] > 0, n["case"]["error_reasons"]
    assert n["nvme_ratio_vs_cpu_offload"] == n["ours_stage2_nvme_s"] / n["ours_stage2_offload_s"]
    # The same losses: the same step, with the state in swap files.
    losses = n["case"]["final_loss"]
    assert losses["ours_z2_nvme"] == losses["ours_z2_off"], losses
    assert "Optimizer offload to NVMe vs CPU" in (tmp_path / "latest.md").read_text()


# ----------------------------------------------------------------------------- capacity


def _bench_capacity():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import bench_capacity

    return bench_capacity


def test_capacity_search_doubles_then_bisects():
    """bench_capacity's search: 4, 8, 16 fit or not, then bisects to the last size that fits;
    an error (not memory) bounds nothing and stops it."""
    bc = _bench_capacity()
    asked = []

    def probe(layers):
        asked.append(layers)
        if layers <= 11:
            return {"layers": layers, "params": layers, "fits": True}
        return {"layers": layers, "params": layers, "fits": False, "failure": "out of memory (killed)"}

    probes = bc.search(probe, 4, 10, float("inf"), lambda r: None)
    assert asked == [4, 8, 16, 12, 10, 11]
    assert bc.largest(probes)["layers"] == 11
    asked.clear()
    probes = bc.search(probe, 4, 3, float("inf"), lambda r: None)  # the probe budget
    assert asked == [4, 8, 16] and bc.largest(probes)["layers"] == 8
    asked.clear()
    probes = bc.search(probe, 32, 10, float("inf"), lambda r: None)  # too big at first: halves
    assert asked == [32, 16, 8, 12, 10, 11]
    asked.clear()
    error = {"fits": False, "failure": "error", "layers": 4, "params": 4}
    assert bc.search(lambda n: asked.append(n) or error, 4, 10, float("inf"), lambda r: None) == [error]
    assert asked == [4]
    # The decoder's parameter count is the model's.
    from _train_workers import build_model

    spec = dict(bc.decoder_spec(64, 2), heads=2)
    assert bc.param_count(64, 2) == sum(p.numel() for p in build_model(spec).parameters())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_all_quick_capacity(tmp_path):
    """The capacity section alone (width 256, 2 layers, a 1.5 GiB cgroup): cpu and nvme offload
    fit, NVMe holds 16 B/param on disk, the capped run's losses equal the reference's, and
    each probe's checkpoint resumes to the same loss inside the cap."""
    reason = _bench_capacity().cgroup_unavailable_reason()
    if reason:
        pytest.skip(f"needs a writable cgroup-v1 memory controller for its cap: {reason}")
    out = _run("run_all.py", "--skip-upstream", "--out-dir", str(tmp_path), "--only", "capacity", timeout=380)
    c = json.loads((tmp_path / "latest.json").read_text())["capacity"]
    assert c["cap_method"] == "cgroup" and c["cap_bytes"] == int(1.5 * 2**30)
    probes = {p["mode"]: p for p in c["probes"]}
    assert set(probes) == {"cpu", "nvme"} and all(p["fits"] for p in probes.values()), out
    for p in probes.values():
        assert 0 < p["group_peak_bytes"] <= c["cap_bytes"] and p["oom_kills"] == 0
        assert len(p["losses"]) == 2 and p["params"] == c["largest_nvme"]["params"]
    assert probes["cpu"]["disk_bytes"] == 0
    # Every partition and the masters + Adam states, fp32, each file rounded up to 4096 bytes.
    assert 16 * probes["nvme"]["params"] <= c["nvme_disk_bytes"] < 16 * probes["nvme"]["params"] * 1.1
    assert probes["nvme"]["losses"] == probes["cpu"]["losses"]  # the same math either way
    for p in probes.values():  # a checkpoint saved, loaded and resumed inside the cap
        assert p["checkpoint"]["equal"] and p["checkpoint"]["bytes"] > 12 * p["params"], p["checkpoint"]
    assert c["reference"]["fits"] and c["losses_equal"]
    assert not [p["cgroup"] for p in c["probes"] + [c["reference"]] if Path(p["cgroup"]).exists()]
    assert "Capacity: the largest decoder trained under a memory cap" in (tmp_path / "latest.md").read_text()
