"""A GPT-2-small-sized decoder (124M parameters) on CPU ranks: ours vs upstream vs FSDP2 vs DDP.

    python benchmarks/bench_gpt2_small.py                  # ~6 min on 2 cores, up to ~13 GiB of RAM
    python benchmarks/bench_gpt2_small.py --quick          # a 2-layer width-64 stand-in, a smoke run
    python benchmarks/bench_gpt2_small.py --json gpt2.json --skip-upstream

The model is `_train_workers.Decoder` with GPT-2 small's shape, built from these numbers (no
download): vocab 50257, 1024 position rows, 12 blocks of width 768 with 12 heads, biases
on every linear layer, LayerNorms, and the LM head tied to the token embedding, as in GPT-2:
124,439,808 parameters. fp32, AdamW(lr=1e-3), sequence 128, one sequence per rank.

Two parts, each reusing bench_train_step's worker groups and alternating rounds:
  side by side   2 ranks: ours (ZeRO-3) in alternating rounds with, in turn, upstream
                 DeepSpeed 0.19.8 (ZeRO-3, the same config), FSDP2 and DDP: median step time, then each
                 group's live tensor bytes per rank between steps, peak RSS per rank, and
                 the collectives of one step (rank 0, by kind, through the torch profiler)
  scaling        ours alone at world sizes 1 and 4 (2 comes from the side-by-side run), one
                 turn of `--solo-steps` timed steps: step time and live tensor bytes per
                 rank against 16 bytes per parameter / N (the fp32 parameter shard, its
                 gradient shard and AdamW's two moments)

Ours' group stays up while the peers take turns beside it, one at a time (at most two
groups alive, about 13 GiB; all four at once took about 20 GiB): each ratio comes from the
rounds ours and that peer shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_train_step  # noqa: E402 - the benchmarks folder is not a package
from _launch import machine_info  # noqa: E402

# GPT-2 small (124,439,808 parameters with the tied head); a short sequence keeps a step
# to a few seconds on one core per rank.
GPT2_SMALL = dict(model="decoder", vocab=50257, positions=1024, width=768, layers=12, heads=12, tied=True)
GPT2_SMALL.update(seq=128, batch=1)
# --quick: the same layout, tiny (a smoke run is dominated by process start-up).
QUICK = dict(GPT2_SMALL, vocab=1024, positions=64, width=64, layers=2, heads=2, seq=32)
PEERS = ("ours", "upstream", "fsdp2", "ddp")
IDEAL_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's exp_avg and exp_avg_sq


def spec_for(opts) -> dict:
    sizes = QUICK if opts.quick else GPT2_SMALL
    return dict(sizes, **bench_train_step.ZERO_SIZES, dtype="fp32", warmup=opts.warmup, threads=1)


def _train_args(opts, impls: list, world_size: int) -> argparse.Namespace:
    targs = bench_train_step.parse_args(["--impls", ",".join(impls), "--world-size", str(world_size)])
    targs.upstream_python = opts.upstream_python
    targs.rounds, targs.steps, targs.warmup = opts.rounds, opts.steps, opts.warmup
    if len(impls) == 1:  # nothing to alternate with: one turn of as many timed steps
        targs.rounds, targs.steps = 1, opts.solo_steps
    return targs


def _probe(groups: dict, failed: dict) -> tuple:
    """Each live group's memory report and one step's collectives (after its timed steps)."""
    memory, collectives = {}, {}
    for impl, group in groups.items():
        if impl in failed:
            continue
        try:
            memory[impl] = group.command({"cmd": "memory"}, timeout_s=300)
            collectives[impl] = group.command({"cmd": "collectives"}, timeout_s=300)["collectives"]
        except RuntimeError as exc:
            failed[impl] = str(exc)
            print(f"  {impl} failed; reported as null:\n{exc}", file=sys.stderr, flush=True)
    return memory, collectives


def _close(groups: dict) -> None:
    for group in groups.values():
        group.close()


def side_by_side(opts, log_dir: Path) -> dict:
    """Ours against each peer in turn, in alternating rounds; ours stays up, peers come and go.

    [Note: one peer at a time] Four groups of a 124M model alive at once took about 20 GiB
    on the 24 GiB development machine (every rank peaks at 2.5 to 3.3 GiB RSS), too close
    to the limit on a shared machine. So ours' group starts once and alternates with one
    peer group at a time (at most two groups, about 13 GiB); each ratio comes from the
    rounds ours and that peer shared, and ours' step time is the median over all its steps.
    """
    peers = [i for i in PEERS[1:] if not (opts.skip_upstream and i == "upstream")]
    if opts.quick:  # a smoke run: the sharded peers are enough (DDP reported null)
        peers = [i for i in peers if i != "ddp"]
    targs = _train_args(opts, ["ours", *peers], 2)
    peers = [i for i in bench_train_step.chosen_impls(targs) if i != "ours"]
    print(f"\n== gpt2_small side by side, 2 ranks: ours with each of {', '.join(peers)} in turn", flush=True)
    spec = spec_for(opts)
    ours, infos, errors = bench_train_step.start_groups(["ours"], spec, targs, log_dir)
    times, cpu, faults, losses = {}, {}, {}, {}
    memory, collectives, pair_ratios, pair_ours_s = {}, {}, {}, {}
    try:
        for peer in peers if ours else []:
            group, info, failed = bench_train_step.start_groups([peer], spec, targs, log_dir)
            infos.update(info)
            errors.update(failed)
            try:
                t, c, f, loss, failed = bench_train_step.run_rounds(
                    {**ours, **group}, targs.rounds, targs.steps
                )
                found = _probe(group, failed)
            finally:
                _close(group)
            errors.update(failed)
            for impl in t:
                times.setdefault(impl, []).extend(t[impl])
                cpu.setdefault(impl, []).extend(c[impl])
                faults.setdefault(impl, []).extend(f[impl])
            losses.update(loss)
            memory.update(found[0])
            collectives.update(found[1])
            if t.get("ours") and t.get(peer):
                pair_ours_s[peer] = statistics.median(t["ours"])
                pair_ratios[peer] = pair_ours_s[peer] / statistics.median(t[peer])
            if "ours" in errors:
                break
        found = _probe(ours, errors)
        memory.update(found[0])
        collectives.update(found[1])
    finally:
        _close(ours)
    return _side_by_side_entry(
        times, cpu, faults, losses, infos, errors, memory, collectives, pair_ratios, pair_ours_s
    )


def _side_by_side_entry(
    times, cpu, faults, losses, infos, errors, memory, collectives, pair_ratios, pair_ours_s
):
    entry = bench_train_step.summarize(times, cpu, faults, losses, infos, errors)
    out = {key: entry[key] for key in ("ours_s", "upstream_deepspeed_s", "fsdp2_s", "ddp_s")}
    out.update(
        # Each ratio from the rounds ours shared with that peer (see the note in side_by_side).
        ratio_vs_upstream=pair_ratios.get("upstream"),
        ratio_vs_fsdp2=pair_ratios.get("fsdp2"),
        ratio_vs_ddp=pair_ratios.get("ddp"),
        ours_s_beside=pair_ours_s,
        cpu_s=entry["cpu_s"],
        minor_faults_per_step=entry["minor_faults_per_step"],
        p25_p75_s=entry["p25_p75_s"],
        timed_steps={i: n for i, n in entry["timed_steps"].items() if n},
        # Ours runs more steps than any one peer, so final losses differ by design; after the
        # same warm-up steps from the same weights and batches they should agree.
        loss_after_warmup={impl: infos[impl]["loss"] for impl in PEERS if impl in infos},
        final_loss=entry["final_loss"],
        params=entry["params"],
        live_bytes_by_rank={impl: memory[impl]["state_bytes"] for impl in PEERS if impl in memory},
        peak_rss_bytes_by_rank={impl: memory[impl]["peak_rss_bytes"] for impl in PEERS if impl in memory},
        # Ours' shared-memory transport buffers, left out of the live bytes (_train_workers).
        shm_segment_bytes={impl: memory[impl].get("shm_segment_bytes") for impl in PEERS if impl in memory},
        collectives={impl: collectives[impl] for impl in PEERS if impl in collectives},
        error_reasons=entry["error_reasons"],
    )
    return out


def _measure_alone(world_size: int, opts, log_dir: Path) -> tuple:
    """Ours alone at `world_size`: one turn of timed steps, then memory."""
    targs = _train_args(opts, ["ours"], world_size)
    groups, infos, errors = bench_train_step.start_groups(["ours"], spec_for(opts), targs, log_dir)
    try:
        times, cpu, faults, losses, failed = bench_train_step.run_rounds(groups, targs.rounds, targs.steps)
        errors.update(failed)
        memory, _ = _probe(groups, errors)
    finally:
        _close(groups)
    return bench_train_step.summarize(times, cpu, faults, losses, infos, errors), memory


def scaling_case(world_size: int, opts, log_dir: Path, measured=None) -> dict:
    """Ours at one world size: step time and live bytes per rank against 16 B/param / N."""
    if measured is None:
        print(f"\n== gpt2_small scaling: ours at world size {world_size}", flush=True)
        entry, memory = _measure_alone(world_size, opts, log_dir)
        step_s, params = entry["ours_s"], entry["params"]
        mem = memory.get("ours")
    else:  # the side-by-side run at this world size
        step_s, params = measured["ours_s"], measured["params"]
        live = measured["live_bytes_by_rank"].get("ours")
        mem = live and {"state_bytes": live, "peak_rss_bytes": measured["peak_rss_bytes_by_rank"]["ours"]}
    ideal = IDEAL_BYTES_PER_PARAM * params / world_size if params else None
    live_max = max(mem["state_bytes"]) if mem else None
    return {
        "world_size": world_size,
        "ours_s": step_s,
        "live_bytes_per_rank": live_max,  # the largest rank's
        "live_bytes_by_rank": mem and mem["state_bytes"],
        "peak_rss_bytes_by_rank": mem and mem["peak_rss_bytes"],
        "ideal_bytes_per_rank": ideal,
        "live_bytes_ratio_to_ideal": live_max / ideal if live_max and ideal else None,
    }


def run(opts, log_dir: Path) -> dict:
    """The gpt2_small section of run_all.py (and this script's JSON)."""
    began = time.monotonic()
    load_before = round(os.getloadavg()[0], 2)
    bench_train_step.EXTENSIONS_DIR.mkdir(parents=True, exist_ok=True)
    out = side_by_side(opts, log_dir)
    cases = {}
    for world_size in opts.world_sizes:
        measured = out if world_size == 2 else None
        cases[str(world_size)] = scaling_case(world_size, opts, log_dir, measured)
    ratios = [c["live_bytes_ratio_to_ideal"] for c in cases.values() if c["live_bytes_ratio_to_ideal"]]
    out.update(
        live_bytes_ratio_to_ideal=max(ratios) if ratios else None,
        ideal_bytes_per_param=IDEAL_BYTES_PER_PARAM,
        scaling=cases,
        spec=spec_for(opts),
        rounds=opts.rounds,
        steps_per_round=opts.steps,
        loadavg_1m={"before": load_before, "after": round(os.getloadavg()[0], 2)},
        wall_s=round(time.monotonic() - began, 1),
    )
    print("\n" + format_tables(out))
    return out


def format_tables(section: dict) -> str:
    """The side-by-side table, the scaling table and the collectives table (Markdown)."""
    import _report

    return "\n\n".join(
        [_report.gpt2_table(section), _report.gpt2_scaling_table(section), _report.collectives_table(section)]
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a tiny stand-in model, 1 round: a smoke run")
    parser.add_argument("--skip-upstream", action="store_true", help="leave out upstream DeepSpeed (null)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (side by side and scaling)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per group per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--solo-steps", type=int, default=3, help="timed steps of ours alone (scaling)")
    parser.add_argument(
        "--world-sizes", default="1,2,4", help="ours alone at these (2: the side-by-side run)"
    )
    parser.add_argument("--upstream-python", type=Path, default=bench_train_step.UPSTREAM_PYTHON)
    opts = parser.parse_args(argv)
    opts.world_sizes = [int(w) for w in opts.world_sizes.split(",") if w]
    if opts.quick:
        opts.rounds, opts.steps, opts.warmup, opts.solo_steps = 1, 1, 1, 1
        opts.world_sizes = [w for w in opts.world_sizes if w <= 2]
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_gpt2_") as tmp:
        section = run(opts, Path(tmp))
    results = {
        "gpt2_small": section,
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
