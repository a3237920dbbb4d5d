"""run_all.py's outputs: the machine record, the Markdown tables and the 4-panel plot.

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
# (label, how to read the measured value, target, lower-is-better bound)
TARGETS = (
    ("train step ours / upstream (decoder fp32)", ("train_step", "ratio_vs_upstream"), 0.8),
    ("train step ours / FSDP2 (decoder fp32)", ("train_step", "ratio_vs_fsdp2"), 1.0),
    ("gather start/stop / raw all-gather (P=100)", ("gather", "ratio_vs_raw_allgather"), 1.1),
    ("gather start/stop / with (P=100)", ("gather", "start_stop_vs_with"), 1.02),
    ("init peak RSS / ideal (max over ws, ranks)", ("init", "peak_rss_ratio_to_ideal"), 1.1),
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
    for label, path, bound in TARGETS:
        value = _get(report, path)
        met = "n/a" if value is None else ("yes" if value <= bound else "**no**")
        lines.append(f"| {label} | {_fmt(value, '.2f')} | <= {bound} | {met} |")
    return "\n".join(lines)


def train_table(train: dict) -> str:
    head = "| case | " + " | ".join(f"{p} s" for p, _ in PEERS) + " | ours/upstream | ours/FSDP2 |"
    lines = [head, "|" + "---|" * (len(PEERS) + 3)]
    for name, case in train["cases"].items():
        cells = [_fmt(case[key]) for _, key in PEERS]
        cells += [_fmt(case["ratio_vs_upstream"], ".2f"), _fmt(case["ratio_vs_fsdp2"], ".2f")]
        lines.append(f"| {name.replace('_', ', ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gather_table(gather: dict) -> str:
    lines = [
        "| P | MB | start/stop ms | with ms | raw all-gather ms | upstream with ms | start_stop/raw | ours/upstream with |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in gather["cases"].values():
        up = row["upstream_with_s"]
        lines.append(
            f"| {row['params']} | {row['bytes'] / MB:.1f} | {row['start_stop_s'] * 1e3:.3f} | "
            f"{row['with_s'] * 1e3:.3f} | {row['raw_allgather_s'] * 1e3:.3f} | "
            f"{_fmt(up and up * 1e3)} | {row['ratio_vs_raw_allgather']:.2f} | "
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
        "| world size | ours s | FSDP2 s | ours MB/rank | FSDP2 MB/rank | ideal 16 B/param / N, MB |",
        "|---|---|---|---|---|---|",
    ]
    for ws, case in cases.items():
        ours_mb = case["ours_state_bytes_per_rank"]
        fsdp_mb = case["fsdp2_state_bytes_per_rank"]
        lines.append(
            f"| {ws} | {_fmt(case['ours_s'])} | {_fmt(case['fsdp2_s'])} | {_fmt(ours_mb and ours_mb / MB, '.1f')} | "
            f"{_fmt(fsdp_mb and fsdp_mb / MB, '.1f')} | {case['ideal_zero3_bytes_per_rank'] / MB:.1f} |"
        )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m, v = report["machine"], report["versions"]
    upstream = v["upstream"]["deepspeed"] if v.get("upstream") else "skipped"
    parts = [
        f"Benchmarks {report['date']}: {m['cpu_model']}, {m['cores']} cores, load average "
        f"{m['loadavg_before'][0]} -> {m['loadavg_after'][0]}; torch {v['torch']}, ours {v['ours']}, "
        f"upstream DeepSpeed {upstream}; total {report['wall_s']:.0f} s{' (--quick)' if report['quick'] else ''}.",
        targets_table(report),
    ]
    sections = (
        ("train_step", "Train step, 2 ranks, median s per step", train_table),
        ("gather", "GatheredParameters, 2 ranks, median ms", gather_table),
        ("init", "Peak RSS under Init (default malloc)", init_table),
        (
            "scaling",
            "Scaling, decoder fp32: step s and live tensor MB per rank",
            lambda s: scaling_table(s["cases"]),
        ),
    )
    for key, title, fn in sections:
        if report.get(key):
            parts.append(f"**{title}**\n\n{fn(report[key])}")
    return "\n\n".join(parts) + "\n"


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
    width = 0.8 / len(PEERS)
    for i, (peer, key) in enumerate(PEERS):
        values = [train["cases"][n][key] or 0.0 for n in names]
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
    for key, label, color in (("ours_s", "ours step s", "C0"), ("fsdp2_s", "FSDP2 step s", "C1")):
        values = [cases[str(ws)][key] or float("nan") for ws in sizes]
        ax.plot(sizes, values, marker="o", color=color, label=label)
    ax.set_xlabel("world size")
    ax.set_ylabel("median s / step")
    ax.set_xticks(sizes)
    right = ax.twinx()
    for key, label, color in (
        ("ours_state_bytes_per_rank", "ours MB/rank", "C0"),
        ("fsdp2_state_bytes_per_rank", "FSDP2 MB/rank", "C1"),
    ):
        values = [(cases[str(ws)][key] or float("nan")) / MB for ws in sizes]
        right.plot(sizes, values, linestyle="--", marker="s", color=color, label=label)
    ideal = [cases[str(ws)]["ideal_zero3_bytes_per_rank"] / MB for ws in sizes]
    right.plot(sizes, ideal, ":", color="grey", label="16 B/param / N")
    right.set_ylabel("live tensor MB per rank")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    ax.set_title("scaling, decoder fp32")


def plot(report: dict, path: Path) -> bool:
    """The 4 panels into `path`; False (and a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r requirements/requirements-bench.txt): no plot")
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels = (
        ("train_step", _plot_train),
        ("gather", _plot_gather),
        ("init", _plot_init),
        ("scaling", _plot_scaling),
    )
    for ax, (key, draw) in zip(axes.flat, panels):
        if report.get(key):
            draw(ax, report[key])
        else:
            ax.set_title(f"{key}: not run")
    fig.suptitle(
        f"ZeRO-3 benchmarks {report['date']} ({report['machine']['cpu_model']}, {report['machine']['cores']} cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
