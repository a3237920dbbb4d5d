"""run_all.py's outputs: the machine record, the Markdown tables and the 6-panel plot.

Every function takes the report dict run_all.py builds (sections may be None when a
section was not run) and tolerates nulls (upstream skipped, a peer that failed).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

MB = 2**20
PEERS = (("ours", "ours_s"), ("upstream", "upstream_deepspeed_s"), ("fsdp2", "fsdp2_s"))
PEERS += (("ddp", "ddp_s"), ("single", "single_s"))
# ZeRO stages 1 and 2: ours and upstream's same stage, timed beside DDP.
STAGE_PEERS = (("ours Z1", "ours_stage1_s"), ("upstream Z1", "upstream_stage1_s"))
STAGE_PEERS += (("ours Z2", "ours_stage2_s"), ("upstream Z2", "upstream_stage2_s"))
# (label, how to read the measured value, target[, "ge"]): the value must be <= the target,
# or >= it where the entry ends in "ge".
TARGETS = (
    ("train step ours / upstream (decoder fp32)", ("train_step", "ratio_vs_upstream"), 0.8),
    ("train step ours / FSDP2 (decoder fp32)", ("train_step", "ratio_vs_fsdp2"), 1.0),
    ("train step ZeRO-3 ours / DDP (decoder fp32)", ("train_step", "ratio_vs_ddp"), 1.1),
    ("train step ZeRO-3 ours / DDP (worst case)", ("train_step", "ratio_vs_ddp_worst"), 1.25),
    ("train step ZeRO-1 ours / DDP (decoder fp32)", ("train_step", "stage1_ratio_vs_ddp"), 1.05),
    ("train step ZeRO-2 ours / DDP (decoder fp32)", ("train_step", "stage2_ratio_vs_ddp"), 1.05),
    (
        "train step ZeRO-1 ours / upstream ZeRO-1 (decoder fp32)",
        ("train_step", "stage1_ratio_vs_upstream"),
        0.8,
    ),
    (
        "train step ZeRO-2 ours / upstream ZeRO-2 (decoder fp32)",
        ("train_step", "stage2_ratio_vs_upstream"),
        0.8,
    ),
    ("train step ZeRO-1 ours / DDP (worst case)", ("train_step", "stage1_ratio_vs_ddp_worst"), 1.05),
    ("train step ZeRO-2 ours / DDP (worst case)", ("train_step", "stage2_ratio_vs_ddp_worst"), 1.05),
    (
        "train step ZeRO-1 ours / upstream ZeRO-1 (worst case)",
        ("train_step", "stage1_ratio_vs_upstream_worst"),
        0.8,
    ),
    (
        "train step ZeRO-2 ours / upstream ZeRO-2 (worst case)",
        ("train_step", "stage2_ratio_vs_upstream_worst"),
        0.8,
    ),
    ("gather start/stop / raw all-gather (worst P)", ("gather", "ratio_vs_raw_allgather"), 1.15),
    ("gather start/stop / with (P=100)", ("gather", "start_stop_vs_with"), 1.02),
    ("gather start/stop / raw + copy-out floor (worst P)", ("gather", "ratio_vs_copy_floor"), 1.1),
    ("gather start/stop / FSDP2 unshard+reshard (worst P)", ("gather", "ratio_vs_fsdp2"), 0.6),
    ("init peak RSS / ideal (max over ws, ranks)", ("init", "peak_rss_ratio_to_ideal"), 1.1),
    ("CPU Adam ours / memory floor (8M fp32, 2 threads)", ("cpu_adam", "ratio_vs_floor"), 1.15),
    ("CPU Adam ours / torch fused AdamW (8M fp32, 2 threads)", ("cpu_adam", "ratio_vs_torch_fused"), 0.9),
    (
        "CPU Adam ours / upstream DeepSpeedCPUAdam (8M fp32, 2 threads)",
        ("cpu_adam", "ratio_vs_upstream"),
        1.0,
    ),
    ("GPT-2 small ours / upstream (124M fp32, 2 ranks)", ("gpt2_small", "ratio_vs_upstream"), 0.8),
    ("GPT-2 small ours / FSDP2 (124M fp32, 2 ranks)", ("gpt2_small", "ratio_vs_fsdp2"), 1.0),
    (
        "GPT-2 small live bytes / 16 B per param / N (worst of ws 1, 2, 4)",
        ("gpt2_small", "live_bytes_ratio_to_ideal"),
        1.1,
    ),
    # Ulysses: about 1/sp of sp=1's activation bytes per rank (1/sp + 10%), issue 42.
    ("sequence parallel sp=2 activation bytes / sp=1", ("sequence_parallel", "activation_ratio_sp2"), 0.55),
    ("sequence parallel sp=4 activation bytes / sp=1", ("sequence_parallel", "activation_ratio_sp4"), 0.275),
    # ZeRO++ at 4 ranks as 2 nodes x 2 (issue 43): the paper's 4x less cross-node traffic, and
    # no slower than plain ZeRO-3 (on one machine: the cost of the extra work; no link is slow).
    ("hpZ+qwZ+qgZ cross-node bytes / plain ZeRO-3 (2x2)", ("hierarchical", "cross_ratio_hpz_qwz_qgz"), 0.25),
    ("hpZ+qwZ+qgZ step time / plain ZeRO-3 (fake 2x2)", ("hierarchical", "step_ratio_hpz_qwz_qgz"), 1.0),
    # deepspeed.ops.aio against the disk's own bandwidth (dd, O_DIRECT), issue 44.
    ("aio io_uring read bandwidth / dd O_DIRECT", ("aio", "read_ratio_io_uring"), 0.8, "ge"),
    ("aio io_uring write bandwidth / dd O_DIRECT", ("aio", "write_ratio_io_uring"), 0.8, "ge"),
    ("aio thread-pool read bandwidth / dd O_DIRECT", ("aio", "read_ratio_thread_pool"), 0.8, "ge"),
    ("aio thread-pool write bandwidth / dd O_DIRECT", ("aio", "write_ratio_thread_pool"), 0.8, "ge"),
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(load_before: tuple) -> dict:
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def _fmt(value, spec: str = ".3f") -> str:
    return "null" if value is None else format(value, spec)


def _get(report: dict, path: tuple):
    node = report
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def targets_table(report: dict) -> str:
    lines = ["| metric | measured | target | met |", "|---|---|---|---|"]
    for label, path, bound, *sense in TARGETS:
        value = _get(report, path)
        higher = sense == ["ge"]
        ok = value is not None and (value >= bound if higher else value <= bound)
        met = "n/a" if value is None else ("yes" if ok else "**no**")
        lines.append(f"| {label} | {_fmt(value, '.2f')} | {'>=' if higher else '<='} {bound} | {met} |")
    return "\n".join(lines)


def train_table(train: dict) -> str:
    head = "| case | " + " | ".join(f"{p} s" for p, _ in PEERS) + " | ours/upstream | ours/FSDP2 |"
    lines = [head, "|" + "---|" * (len(PEERS) + 3)]
    for name, case in train["cases"].items():
        cells = [_fmt(case[key]) for _, key in PEERS]
        cells += [_fmt(case["ratio_vs_upstream"], ".2f"), _fmt(case["ratio_vs_fsdp2"], ".2f")]
        lines.append(f"| {name.replace('_', ', ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stage_table(train: dict) -> str:
    """ZeRO stages 1 and 2, ours and upstream, beside DDP (wall ratios, then CPU-time ratios)."""
    head = "| case | DDP s | " + " | ".join(f"{p} s" for p, _ in STAGE_PEERS)
    head += " | Z1/DDP | Z2/DDP | Z1/upstream Z1 | Z2/upstream Z2 | CPU Z1/DDP | CPU Z2/DDP |"
    lines = [head, "|" + "---|" * (len(STAGE_PEERS) + 8)]
    notes = []
    for name, case in train["cases"].items():
        cells = [_fmt(case["ddp_s"])] + [_fmt(case.get(key)) for _, key in STAGE_PEERS]
        cells += [_fmt(case.get(k), ".2f") for k in STAGE_RATIO_KEYS]
        cells += [_fmt(case.get("cpu_" + k), ".2f") for k in STAGE_RATIO_KEYS[:2]]
        lines.append(f"| {name.replace('_', ', ')} | " + " | ".join(cells) + " |")
        for impl, reason in (case.get("error_reasons") or {}).items():
            notes.append(f"- {name.replace('_', ', ')}: {impl} could not run: `{reason}`")
    return "\n".join(lines + ([""] + notes if notes else []))


STAGE_RATIO_KEYS = (
    "stage1_ratio_vs_ddp",
    "stage2_ratio_vs_ddp",
    "stage1_ratio_vs_upstream",
    "stage2_ratio_vs_upstream",
)


def gather_table(gather: dict) -> str:
    lines = [
        "| P | MB | start/stop ms | with ms | raw all-gather ms | raw + copy-out floor ms | raw + swap floor ms | "
        "FSDP2 ms | upstream with ms | start_stop/raw | swap floor/raw | start_stop/swap floor | "
        "start_stop/floor | start_stop/FSDP2 | ours/upstream with |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in gather["cases"].values():
        up, floor, fsdp2 = row["upstream_with_s"], row.get("copy_floor_s"), row.get("fsdp2_s")
        swap = row.get("swap_floor_s")
        lines.append(
            f"| {row['params']} | {row['bytes'] / MB:.1f} | {row['start_stop_s'] * 1e3:.3f} | "
            f"{row['with_s'] * 1e3:.3f} | {row['raw_allgather_s'] * 1e3:.3f} | "
            f"{_fmt(floor and floor * 1e3)} | {_fmt(swap and swap * 1e3)} | {_fmt(fsdp2 and fsdp2 * 1e3)} | "
            f"{_fmt(up and up * 1e3)} | {row['ratio_vs_raw_allgather']:.2f} | "
            f"{_fmt(row.get('swap_floor_vs_raw_allgather'), '.2f')} | {_fmt(row.get('ratio_vs_swap_floor'), '.2f')} | "
            f"{_fmt(row.get('ratio_vs_copy_floor'), '.2f')} | {_fmt(row.get('ratio_vs_fsdp2'), '.2f')} | "
            f"{_fmt(row['ratio_vs_upstream_with'], '.2f')} |"
        )
    return "\n".join(lines)


def init_table(init: dict) -> str:
    lines = ["| world size | peak MB (max rank) | ideal MB | ratio |", "|---|---|---|---|"]
    for ws, run in init["cases"].items():
        peak = max(r["peak_growth_bytes"] for r in run["ranks"])
        lines.append(
            f"| {ws} | {peak / MB:.1f} | {run['ideal_bytes'] / MB:.1f} | {run['peak_rss_ratio_to_ideal']:.3f} |"
        )
    return "\n".join(lines)


def scaling_table(cases: dict) -> str:
    lines = [
        "| world size | ours Z3 s | FSDP2 s | ours Z1 s | ours Z2 s | ours Z3 MB/rank | FSDP2 MB/rank "
        "| ideal 16 B/param / N, MB | ours Z1 MB/rank | ours Z2 MB/rank | ideal 4 + 12/N B/param, MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mb(value) -> str:
        return _fmt(value and value / MB, ".1f")

    for ws, case in cases.items():
        lines.append(
            f"| {ws} | {_fmt(case['ours_s'])} | {_fmt(case['fsdp2_s'])} | {_fmt(case.get('ours_stage1_s'))} | "
            f"{_fmt(case.get('ours_stage2_s'))} | {mb(case['ours_state_bytes_per_rank'])} | "
            f"{mb(case['fsdp2_state_bytes_per_rank'])} | {case['ideal_zero3_bytes_per_rank'] / MB:.1f} | "
            f"{mb(case.get('ours_stage1_state_bytes_per_rank'))} | {mb(case.get('ours_stage2_state_bytes_per_rank'))} | "
            f"{mb(case.get('ideal_zero12_bytes_per_rank'))} |"
        )
    return "\n".join(lines)


GPT2_PEERS = (
    ("ours", "ours_s"),
    ("upstream", "upstream_deepspeed_s"),
    ("fsdp2", "fsdp2_s"),
    ("ddp", "ddp_s"),
)


def gpt2_table(gpt2: dict) -> str:
    """GPT-2 small side by side at 2 ranks: step time, live bytes and peak RSS per rank."""
    lines = [
        "| implementation | median s | p25..p75 s | CPU s (both ranks) | live MB per rank | peak RSS MB per rank "
        "| loss after warm-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for impl, key in GPT2_PEERS:
        spread = (gpt2.get("p25_p75_s") or {}).get(impl)
        live = (gpt2.get("live_bytes_by_rank") or {}).get(impl)
        rss = (gpt2.get("peak_rss_bytes_by_rank") or {}).get(impl)
        loss = (gpt2.get("loss_after_warmup") or {}).get(impl)
        cells = [
            _fmt(gpt2.get(key)),
            f"{spread[0]:.3f}..{spread[1]:.3f}" if spread else "null",
            _fmt((gpt2.get("cpu_s") or {}).get(impl)),
            " / ".join(f"{b / MB:.0f}" for b in live) if live else "null",
            " / ".join(f"{b / MB:.0f}" for b in rss) if rss else "null",
            _fmt(loss, ".4f"),
        ]
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    beside = gpt2.get("ours_s_beside") or {}
    ratios = [
        f"ours / {peer} {_fmt(gpt2.get('ratio_vs_' + peer), '.2f')} (ours {_fmt(beside.get(peer))} s in those rounds)"
        for peer in ("upstream", "fsdp2", "ddp")
        if peer in beside
    ]
    lines.append("")
    lines.append(
        "Ours alternates with each peer in turn; " + ", ".join(ratios) + f" (below 1: ours is faster); "
        f"{gpt2.get('params') or 0:,} parameters; load average {gpt2['loadavg_1m']['before']} -> "
        f"{gpt2['loadavg_1m']['after']}"
    )
    for impl, reason in (gpt2.get("error_reasons") or {}).items():
        lines.append(f"- {impl} could not run: `{reason}`")
    return "\n".join(lines)


def gpt2_scaling_table(gpt2: dict) -> str:
    """Ours at each world size: step time, live bytes per rank and the 16 B/param / N ideal."""
    lines = [
        "| world size | ours s | live MB per rank (each rank) | ideal 16 B/param / N, MB | live / ideal | peak RSS MB (max rank) |",
        "|---|---|---|---|---|---|",
    ]
    for ws, case in gpt2["scaling"].items():
        live = case.get("live_bytes_by_rank")
        rss = case.get("peak_rss_bytes_by_rank")
        lines.append(
            f"| {ws} | {_fmt(case['ours_s'])} | {' / '.join(f'{b / MB:.0f}' for b in live) if live else 'null'} | "
            f"{_fmt(case['ideal_bytes_per_rank'] and case['ideal_bytes_per_rank'] / MB, '.0f')} | "
            f"{_fmt(case['live_bytes_ratio_to_ideal'])} | {_fmt(rss and max(rss) / MB, '.0f')} |"
        )
    return "\n".join(lines)


def collectives_table(entry: dict) -> str:
    """One step's collectives on rank 0, per implementation: what it asked for, what ran.

    `entry["collectives"]` maps an implementation to `{"requested": {c10d op: calls},
    "executed": {gloo or shm kind: {"calls", "bytes"}}}` (_train_workers.count_collectives).
    """
    lines = ["| implementation | asked for (c10d op x calls) | ran (kind: calls, MB) |", "|---|---|---|"]
    for impl, counts in (entry.get("collectives") or {}).items():
        asked = ", ".join(
            f"{op.removeprefix('c10d::')} x{n}" for op, n in sorted(counts["requested"].items())
        )
        ran = ", ".join(
            f"{kind}: {row['calls']}, {row['bytes'] / MB:.1f}"
            for kind, row in sorted(counts["executed"].items())
        )
        lines.append(f"| {impl} | {asked or 'none'} | {ran or 'none'} |")
    lines += ["", COLLECTIVES_NOTE]
    return "\n".join(lines)


COLLECTIVES_NOTE = (
    "One untimed step on rank 0, through the torch profiler. *Asked for*: the c10d ops the library "
    "called. *Ran*: `gloo:` kinds are what gloo executed for them, with the MB of tensor it was handed "
    "(all_gather: this rank's input; all_reduce: the whole buffer; all_to_all: the whole input). On gloo a "
    "reduce-scatter runs as an all-reduce of the whole input, so a library asking for reduce-scatter "
    "and one asking for all-reduce move the same bytes there. `shm:` kinds are ours through the group's "
    "shared-memory segment (deepspeed/comm/shm.py), which bypasses torch.distributed (so nothing is "
    "asked of c10d), with the MB each call produced on this rank. DDP, FSDP2 and upstream run on gloo's "
    "sockets: the difference is a transport choice as much as engine overhead."
)


def _by_device(values) -> str:
    if not values:
        return "null"
    return ", ".join(f"{device} {n / MB:.1f} MB" for device, n in sorted(values.items()))


def offload_text(off: dict) -> str:
    """ZeRO-2 + offload_optimizer: live and optimizer bytes by device (rank 0), and what they show."""
    on_accel = off["optimizer_bytes_on_accelerator"]
    return "\n".join(
        [
            f"- world size {off['world_size']}, accelerator `{off['accelerator']}`; step {_fmt(off.get('step_s'))} s",
            f"- live tensor bytes by device, with offload: {_by_device(off['live_bytes_by_device'])}; "
            f"plain ZeRO-2: {_by_device(off.get('plain_stage2_live_bytes_by_device'))}",
            f"- optimizer (masters, their grads, Adam state) by device, with offload: "
            f"{_by_device(off['optimizer_bytes_by_device'])}; plain ZeRO-2: "
            f"{_by_device(off.get('plain_stage2_optimizer_bytes_by_device'))}",
            f"- optimizer bytes on the accelerator: "
            f"{'not measurable here' if on_accel is None else f'{on_accel / MB:.1f} MB'} ({off['note']})",
        ]
    )


def agreement_table(agreement: dict) -> str:
    """bench_agreement's figures: collectives the checks add, and Init / step time on vs off."""
    rows = [
        ("agreement collectives per train step", agreement["agreement_collectives_per_step"]),
        (
            "agreement collectives per Init + initialize",
            agreement["agreement_collectives_per_init_and_initialize"],
        ),
        ("Init s, checks on / off", f"{agreement['init_on_s']} / {agreement['init_off_s']}"),
        ("train step s, checks on / off", f"{agreement['step_on_s']} / {agreement['step_off_s']}"),
    ]
    return "| what | measured |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def cpu_adam_table(cpu_adam: dict) -> str:
    """bench_cpu_adam's table (median ms per step), with its kernel and load average."""
    import bench_cpu_adam  # the benchmarks folder is on sys.path when run_all runs

    note = f"kernel {cpu_adam['isa']}, prefetch {cpu_adam.get('prefetch', 0)} elements ahead, load average {cpu_adam['load_average'][0]} -> {cpu_adam['load_average'][1]}"
    return bench_cpu_adam.format_table(cpu_adam) + f"\n\n{note}"


def sequence_parallel_table(sp: dict) -> str:
    """Activation bytes per rank over sp=1's, all-to-all bytes against the formula, L_max."""
    lines = [
        "| sp | activation bytes / sp=1 | tiled / sp=1 untiled | 1/sp | all-to-all B per layer (fwd) | formula |",
        "|---|---|---|---|---|---|",
    ]
    for n in (1, 2, 4):
        plain = sp.get(f"activation_ratio_sp{n}")
        if plain is None:
            continue
        a2a = (sp.get("a2a_bytes_per_layer") or {}).get(str(n), 0)
        formula = (sp.get("a2a_formula_bytes_per_layer") or {}).get(str(n), 0)
        lines.append(
            f"| {n} | {plain:.3f} | {_fmt(sp.get(f'activation_ratio_sp{n}_tiled'))} | {1 / n:.3f} | {a2a:,} | {formula:,} |"
        )
    shape = sp["shape"]
    lines += [
        "",
        f"Llama-shaped (hidden {shape['hidden']}, {shape['heads']} heads, {shape['kv_heads']} kv heads, "
        f"{shape['layers']} layers, vocabulary {shape['vocab']}), one {sp['length']}-token sequence, fp32, sdpa; "
        "bytes saved for backward, the largest rank; tiled: TiledMLP and TiledFusedLogitsLoss. All-to-all "
        f"bytes equal the formula: {sp['a2a_matches_formula']}; backward sends as much: "
        f"{sp['a2a_backward_equals_forward']}.",
    ]
    lmax, cap = sp.get("lmax"), sp.get("lmax_cap_bytes")
    if not lmax:
        lines += ["", f"Longest sequence under a memory cap: null ({sp.get('lmax_note')})."]
        return "\n".join(lines)
    lines += [
        "",
        f"Longest sequence trained, {cap / MB:.0f} MiB cap per rank:",
        "",
        "| mode | ranks | L_max | first length over the cap |",
        "|---|---|---|---|",
    ]
    for name, row in lmax.items():
        first = row["first_over_cap"] or (
            "not reached (time budget)" if row.get("stopped_by_time_budget") else "none (length limit)"
        )
        lines.append(f"| {name.replace('_', ', ')} | {row['sp']} | {row['lmax']} | {first} |")
    lines += ["", f"How it is measured: {sp['lmax_note']}."]
    return "\n".join(lines)


def hierarchical_table(h: dict) -> str:
    """Cross-node and within-node bytes of one step and the median step time per layout."""
    import bench_hierarchical

    return bench_hierarchical.format_table(h)


def aio_table(aio: dict) -> str:
    """bench_aio's table: MiB/s per case and each over dd's (O_DIRECT)."""
    import bench_aio

    return bench_aio.format_table(aio)


def markdown(report: dict) -> str:
    m, v = report["machine"], report["versions"]
    upstream = v["upstream"]["deepspeed"] if v.get("upstream") else "skipped"
    parts = [
        f"Benchmarks {report['date']}: {m['cpu_model']}, {m['cores']} cores, load average "
        f"{m['loadavg_before'][0]} -> {m['loadavg_after'][0]}; torch {v['torch']}, ours {v['ours']}, "
        f"upstream DeepSpeed {upstream}; total {report['wall_s']:.0f} s{' (--quick)' if report['quick'] else ''}.",
        targets_table(report),
    ]
    by_date: dict = {}
    for name, date in (report.get("section_dates") or {}).items():
        by_date.setdefault(date, []).append(name)
    if len(by_date) > 1:  # some sections kept from earlier runs (`run_all.py --update`)
        parts[0] += (
            " Sections by when they were measured: "
            + "; ".join(
                f"{', '.join(names)} at {date}" for date, names in sorted(by_date.items(), reverse=True)
            )
            + "."
        )
    sections = (
        ("train_step", "Train step, 2 ranks, median s per step", train_table),
        (
            "train_step",
            "ZeRO stages 1 and 2 beside DDP (same rounds), 2 ranks, median s per step",
            stage_table,
        ),
        ("gather", "GatheredParameters, 2 ranks, median ms", gather_table),
        ("init", "Peak RSS under Init (default malloc)", init_table),
        (
            "scaling",
            "Scaling, decoder fp32: step s and live tensor MB per rank",
            lambda s: scaling_table(s["cases"]),
        ),
        (
            "scaling",
            "Optimizer offload (ZeRO-2 + offload_optimizer cpu), rank 0",
            lambda s: offload_text(s["offload"]),
        ),
        ("cpu_adam", "CPU Adam step, median ms (one param; bf16 = bf16 param, fp32 states)", cpu_adam_table),
        ("agreement", "Rank-agreement checks, on vs off (2 ranks)", agreement_table),
        (
            "train_step",
            "Collectives in one train step, gloo or shared memory (decoder fp32, rank 0)",
            lambda t: collectives_table(t["cases"].get("decoder_fp32") or {}),
        ),
        ("gpt2_small", "GPT-2 small (fp32), 2 ranks side by side, alternating rounds", gpt2_table),
        ("gpt2_small", "GPT-2 small, ours (ZeRO-3) at world sizes 1, 2, 4", gpt2_scaling_table),
        ("gpt2_small", "GPT-2 small, collectives in one step (rank 0)", collectives_table),
        (
            "sequence_parallel",
            "Ulysses sequence parallelism: activation bytes, all-to-all bytes, L_max",
            sequence_parallel_table,
        ),
        (
            "hierarchical",
            "Multi-node ZeRO at 4 ranks as 2 nodes x 2: cross-node bytes and step time",
            hierarchical_table,
        ),
        ("aio", "Async I/O (deepspeed.ops.aio) bandwidth against dd with O_DIRECT", aio_table),
    )
    sections += (
        (
            "nvme_optimizer",
            "Optimizer offload to NVMe vs CPU (decoder fp32, ZeRO-2, 2 ranks, same rounds)",
            nvme_optimizer_text,
        ),
        (
            "capacity",
            "Capacity: the largest decoder trained under a memory cap (ZeRO-3, fp32, 1 rank)",
            capacity_text,
        ),
    )
    for key, title, fn in sections:
        if key == "scaling" and "offload" in title and not (report.get("scaling") or {}).get("offload"):
            continue
        if report.get(key):
            parts.append(f"**{title}**\n\n{fn(report[key])}")
    return "\n\n".join(parts) + "\n"


def nvme_optimizer_text(n: dict) -> str:
    def seconds(value):
        return "null" if value is None else f"{value:.3f} s"

    ratio = n.get("nvme_ratio_vs_cpu_offload")
    shown = "null" if ratio is None else f"{ratio:.2f}x"
    load = (n.get("case") or {}).get("loadavg_1m") or {}
    return (
        f"offload_optimizer cpu {seconds(n.get('ours_stage2_offload_s'))}, nvme "
        f"{seconds(n.get('ours_stage2_nvme_s'))} per step: nvme / cpu = {shown} (sub_group_size "
        f"{n.get('sub_group_size')}, pipeline_read and pipeline_write on, swap files under "
        f"{n.get('swap_folder')}; load average {load.get('before')} -> {load.get('after')})"
    )


def capacity_text(c: dict) -> str:
    """bench_capacity's probes, the largest fit per mode, and the NVMe state over the cap."""
    import bench_capacity

    lines = [bench_capacity.summarize(c), ""]
    for mode in ("cpu", "nvme"):
        best = c.get(f"largest_{mode}")
        if f"largest_{mode}" in c:
            lines.append(
                f"- largest {mode}: " + ("none fit" if best is None else f"{best['params']:,} parameters")
            )
    if c.get("nvme_state_bytes_formula"):
        lines.append(
            f"- nvme: 16 B/param = {c['nvme_state_bytes_formula'] / 1e9:.2f} GB of fp32 state, "
            f"{c['nvme_state_over_cap']:.2f}x the cap; {c['nvme_disk_bytes'] / 1e9:.2f} GB on disk; "
            f"losses equal to the reference run's: {c.get('losses_equal')}"
        )
    machine = c.get("machine") or {}
    lines.append(
        f"- cap: {c.get('cap_bytes')} bytes by {c.get('cap_method')}; load {machine.get('load_start')} -> {machine.get('load_end')}"
    )
    return "\n".join(lines)


def write_all(report: dict, out_dir: Path) -> None:
    """latest.json, latest.md (also printed) and latest.png (skipped without matplotlib)."""
    png = out_dir / "latest.png"
    report["plot"] = str(png) if plot(report, png) else None
    (out_dir / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out_dir / "latest.md").write_text(text)
    print("\n" + text)
    print(
        f"wrote {out_dir / 'latest.json'}, {out_dir / 'latest.md'}" + (f", {png}" if report["plot"] else "")
    )


# ----------------------------------------------------------------------------- the plot


def _plot_train(ax, train: dict) -> None:
    names = list(train["cases"])
    peers = PEERS + STAGE_PEERS
    width = 0.8 / len(peers)
    for i, (peer, key) in enumerate(peers):
        values = [train["cases"][n].get(key) or 0.0 for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=peer)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], [n.replace("_", "\n") for n in names])
    ax.set_ylabel("median s / step")
    ax.set_title("train step, 2 ranks")
    ax.legend(fontsize=7)


def _plot_gather(ax, gather: dict) -> None:
    rows = list(gather["cases"].values())
    counts = [r["params"] for r in rows]
    for key, label in (
        ("start_stop_s", "start/stop"),
        ("with_s", "with"),
        ("raw_allgather_s", "raw all-gather"),
        ("copy_floor_s", "raw + copy-out floor"),
        ("swap_floor_s", "raw + .data swap floor"),
        ("fsdp2_s", "FSDP2 unshard+reshard"),
        ("upstream_with_s", "upstream with"),
    ):
        points = [(c, r[key] * 1e3) for c, r in zip(counts, rows) if r.get(key)]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("parameters P")
    ax.set_ylabel("median ms")
    ax.set_title("GatheredParameters, 2 ranks")
    ax.legend(fontsize=7)


def _plot_init(ax, init: dict) -> None:
    sizes = list(init["cases"])
    peaks = [max(r["peak_growth_bytes"] for r in init["cases"][ws]["ranks"]) / MB for ws in sizes]
    ideals = [init["cases"][ws]["ideal_bytes"] / MB for ws in sizes]
    xs = range(len(sizes))
    ax.bar([x - 0.2 for x in xs], peaks, 0.4, label="peak RSS growth (max rank)")
    ax.bar([x + 0.2 for x in xs], ideals, 0.4, label="ideal S/N + L")
    ax.set_xticks(list(xs), [f"N={ws}" for ws in sizes])
    ax.set_ylabel("MB")
    ax.set_title("peak RSS under zero.Init")
    ax.legend(fontsize=7)


def _plot_scaling(ax, scaling: dict) -> None:
    cases = scaling["cases"]
    sizes = [int(ws) for ws in cases]
    for key, label, color in (
        ("ours_s", "ours Z3 step s", "C0"),
        ("fsdp2_s", "FSDP2 step s", "C1"),
        ("ours_stage1_s", "ours Z1 step s", "C2"),
        ("ours_stage2_s", "ours Z2 step s", "C3"),
    ):
        values = [cases[str(ws)].get(key) or float("nan") for ws in sizes]
        ax.plot(sizes, values, marker="o", color=color, label=label)
    ax.set_xlabel("world size")
    ax.set_ylabel("median s / step")
    ax.set_xticks(sizes)
    right = ax.twinx()
    for key, label, color in (
        ("ours_state_bytes_per_rank", "ours Z3 MB/rank", "C0"),
        ("fsdp2_state_bytes_per_rank", "FSDP2 MB/rank", "C1"),
        ("ours_stage1_state_bytes_per_rank", "ours Z1 MB/rank", "C2"),
        ("ours_stage2_state_bytes_per_rank", "ours Z2 MB/rank", "C3"),
    ):
        values = [(cases[str(ws)].get(key) or float("nan")) / MB for ws in sizes]
        right.plot(sizes, values, linestyle="--", marker="s", color=color, label=label)
    ideal = [cases[str(ws)]["ideal_zero3_bytes_per_rank"] / MB for ws in sizes]
    right.plot(sizes, ideal, ":", color="grey", label="16 B/param / N")
    ideal12 = [(cases[str(ws)].get("ideal_zero12_bytes_per_rank") or float("nan")) / MB for ws in sizes]
    right.plot(sizes, ideal12, "-.", color="grey", label="4 + 12/N B/param")
    right.set_ylabel("live tensor MB per rank")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    ax.set_title("scaling, decoder fp32")


def _plot_gpt2(ax, gpt2: dict) -> None:
    """Median step time of the four at 2 ranks."""
    names = [impl for impl, _ in GPT2_PEERS]
    ax.bar(names, [gpt2.get(key) or 0.0 for _, key in GPT2_PEERS], color=["C0", "C1", "C2", "C3"])
    ax.set_ylabel("median s / step")
    ax.set_title(f"GPT-2 small ({(gpt2.get('params') or 0) / 1e6:.3g}M params, fp32), 2 ranks")


def _plot_gpt2_scaling(ax, gpt2: dict) -> None:
    """Ours' live MB per rank against 16 B/param / N, and its step time, by world size."""
    cases = gpt2["scaling"]
    sizes = [int(ws) for ws in cases]
    live = [(cases[str(ws)].get("live_bytes_per_rank") or float("nan")) / MB for ws in sizes]
    ideal = [(cases[str(ws)].get("ideal_bytes_per_rank") or float("nan")) / MB for ws in sizes]
    ax.plot(sizes, live, marker="s", linestyle="--", color="C0", label="ours live MB / rank")
    ax.plot(sizes, ideal, ":", color="grey", label="16 B/param / N")
    ax.set_xlabel("world size")
    ax.set_ylabel("MB per rank")
    ax.set_xticks(sizes)
    right = ax.twinx()
    steps = [cases[str(ws)].get("ours_s") or float("nan") for ws in sizes]
    right.plot(sizes, steps, marker="o", color="C1", label="ours step s")
    right.set_ylabel("median s / step")
    lines, more = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    ax.set_title("GPT-2 small, ours ZeRO-3 by world size")


def plot(report: dict, path: Path) -> bool:
    """The 6 panels into `path`; False (and a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r requirements/requirements-bench.txt): no plot")
        return False
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    panels = (
        ("train_step", _plot_train),
        ("gather", _plot_gather),
        ("init", _plot_init),
        ("scaling", _plot_scaling),
        ("gpt2_small", _plot_gpt2),
        ("gpt2_small", _plot_gpt2_scaling),
    )
    for ax, (key, draw) in zip(axes.flat, panels):
        if report.get(key):
            draw(ax, report[key])
        else:
            ax.set_title(f"{key}: not run")
    fig.suptitle(
        f"ZeRO benchmarks {report['date']} ({report['machine']['cpu_model']}, {report['machine']['cores']} cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
