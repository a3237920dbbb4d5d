"""The GPU benchmark's ratios, targets and markdown (bench_gpu.py writes gpu-latest.{json,md})."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30
# (label, numerator case, denominator case, bound, "le" or "ge"): issue 45's GPU targets.
STEP_TARGETS = (
    ("ours / upstream", "ours", "upstream", 0.9, "le"),
    ("ours / upstream, CPU offload", "ours_off", "upstream_off", 0.9, "le"),
    ("ours / FSDP2", "ours", "fsdp2", 1.0, "le"),
    ("ours / FSDP2, CPU offload", "ours_off", "fsdp2_off", None, "le"),
    ("ours / plain torch", "ours", "plain", None, "le"),
)
LARGEST_TARGETS = (
    ("largest with CPU offload, ours / upstream (params)", "upstream_off", 1.0, "ge"),
    ("largest with CPU offload, ours / FSDP2 (params)", "fsdp2_off", None, "ge"),
)


def _step(entry: dict | None):
    return (entry or {}).get("step_s")


def _div(a, b):
    return a / b if a is not None and b else None


def ratios(report: dict) -> dict:
    """Step-time ratios per model, largest-model ratios, each with its bound and whether it holds."""
    out: dict = {}
    for model, cases in report.get("models", {}).items():
        for label, num, den, bound, sense in STEP_TARGETS:
            value = _div(_step(cases.get(num)), _step(cases.get(den)))
            out[f"{model}: {label}"] = _row(value, bound, sense)
    largest = report.get("largest", {})
    ours = (largest.get("ours_off") or {}).get("params")
    for label, other, bound, sense in LARGEST_TARGETS:
        out[label] = _row(_div(ours, (largest.get(other) or {}).get("params")), bound, sense)
    return out


def _row(value, bound, sense: str) -> dict:
    met = None
    if value is not None and bound is not None:
        met = value <= bound if sense == "le" else value >= bound
    return {"value": value, "bound": bound, "sense": sense, "met": met}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def one_line(entry: dict) -> str:
    if "skipped" in entry:
        return entry["skipped"]
    if "error" in entry:
        return ("OOM: " if entry.get("oom") else "error: ") + entry["error"].strip().splitlines()[-1][:200]
    peak, losses = entry.get("peak_bytes"), entry.get("losses") or [None]
    return (
        f"{_fmt(entry.get('step_s') and entry['step_s'] * 1e3, '.1f')} ms/step, "
        f"peak {_fmt(peak and peak / GIB, '.2f')} GiB, built in {_fmt(entry.get('build_s'), '.1f')} s, "
        f"loss {_fmt(losses[0], '.3f')} -> {_fmt(losses[-1], '.3f')}"
    )


def _targets_md(report: dict) -> list:
    lines = ["| ratio | measured | target | met |", "|---|---|---|---|"]
    for label, row in report.get("ratios", {}).items():
        bound = (
            "-" if row["bound"] is None else ("<= " if row["sense"] == "le" else ">= ") + str(row["bound"])
        )
        met = {None: "n/a" if row["bound"] is not None else "-", True: "yes", False: "**no**"}[row["met"]]
        lines.append(f"| {label} | {_fmt(row['value'], '.2f')} | {bound} | {met} |")
    return lines


def _models_md(report: dict) -> list:
    lines = []
    for model, cases in report.get("models", {}).items():
        params = next((e["params"] for e in cases.values() if "params" in e), None)
        lines += ["", f"**{model}** ({_fmt(params, ',')} parameters, bf16)", ""]
        lines += ["| case | step ms | peak GiB | peak in timed steps GiB | build s | optimizer | note |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for name, e in cases.items():
            if "step_s" not in e:
                lines.append(f"| {name} | - | - | - | - | - | {one_line(e)[:160]} |")
                continue
            peak, steps = e.get("peak_bytes"), e.get("peak_steps_bytes")
            lines.append(
                f"| {name} | {e['step_s'] * 1e3:.1f} | {_fmt(peak and peak / GIB, '.2f')} | "
                f"{_fmt(steps and steps / GIB, '.2f')} | {e['build_s']:.1f} | {e.get('optimizer', '-')} | "
                f"loss {e['losses'][0]:.3f} -> {e['losses'][-1]:.3f} |"
            )
    return lines


def _largest_md(report: dict) -> list:
    largest = report.get("largest", {})
    if "skipped" in largest:
        return ["", f"Largest trainable model: {largest['skipped']}"]
    lines = [
        "",
        "Largest decoder that trains one step with CPU offload (blocks of width 4096 in the real run):",
    ]
    lines += [
        "",
        "| case | blocks | parameters | first failing blocks | bracket closed | probes |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in largest.items():
        if "skipped" in e:
            lines.append(f"| {name} | - | - | - | - | {e['skipped']} |")
            continue
        probes = ", ".join(f"{p['layers']}{_probe_note(p)}" for p in e["probes"])
        lines.append(
            f"| {name} | {e['layers']} | {_fmt(e['params'], ',')} | {_fmt(e['failed_at_layers'], 'd')} | "
            f"{'yes' if e['bracket_closed'] else 'no'} | {probes} |"
        )
    return lines


def _probe_note(probe: dict) -> str:
    if probe["ok"]:
        return ""
    return " (OOM)" if probe.get("oom") else " (timed out)" if probe.get("timed_out") else " (failed)"


def markdown(report: dict) -> str:
    kind = (
        "DRY RUN on the CPU (tiny models, one step each; no figure means anything)"
        if report["dry_run"]
        else "GPU run"
    )
    if report.get("partial"):
        kind += f" (cut short: {report['partial']})"
    head = [
        f"# GPU benchmark: {kind}",
        "",
        f"{report['device']} ({_fmt(report.get('device_memory_bytes') and report['device_memory_bytes'] / GIB, '.0f')} GiB), "
        f"torch {report['torch']} (CUDA {report.get('cuda')}), 1 rank, {report['date']}; "
        f"upstream: {report['upstream']}; {report.get('wall_s', '-')} s in all",
        "",
    ]
    zoo = report.get("zoo", {})
    zoo_line = zoo.get("skipped") or f"exit {zoo.get('exit')}: {zoo.get('summary')} ({zoo.get('wall_s')} s)"
    return "\n".join(
        head
        + _targets_md(report)
        + _models_md(report)
        + _largest_md(report)
        + ["", f"Zoo on CUDA: {zoo_line}", ""]
    )


def write(report: dict, out_dir: Path) -> list:
    """`gpu-latest.{json,md}`, or `gpu-dry-run.*` for a dry run, in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu-dry-run" if report["dry_run"] else "gpu-latest"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    return paths
