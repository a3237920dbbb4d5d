"""Ulysses sequence parallelism: activation bytes per rank, all-to-all bytes per layer, L_max (issue 42).

    .venv/bin/python benchmarks/bench_sequence_parallel.py [--length 4096] [--json sp.json] [--quick]
                                                           [--cap-mib 256] [--skip-lmax]

A Llama-shaped model (fp32, sdpa) runs one forward and backward on one sequence of `--length`
tokens at sp = 1, 2 and 4 (sp = 1 and 2 in one 2-rank gloo run, sp = 4 in a 4-rank one), without and with tiling (every MLP through
`TiledMLP`, the logits and loss through `TiledFusedLogitsLoss`). Per rank it reports:

- `saved_bytes`: the bytes of the distinct tensors autograd saved for backward during the
  forward (counted by `torch.autograd.graph.saved_tensors_hooks`, one count per storage, the
  parameters left out): the
  activation memory held from forward to backward, next to the sp = 1 figure over sp (the
  target of issue 42: about 1/sp, and far less with tiling);
- `a2a_bytes_per_layer`: the bytes this rank sends to other ranks through
  `deepspeed.comm.all_to_all_single` in one layer's forward (counted by wrapping it), next to
  the formula `(2 q_heads + 2 kv_heads') * b * (s / sp) * head_dim * 4 bytes * (sp - 1) / sp`:
  q, k, v go out head-sharded and the output comes back, each rank keeping 1/sp of every
  tensor (kv_heads' = max(kv_heads, sp): kv heads fewer than sp are repeated first).
  Backward sends as much again.

With tiling, backward recomputes one slice at a time: that slice's intermediates come on top of
the saved bytes while it runs. Nothing here is timed.

`lmax`: the longest sequence one ZeRO-3 training step (AdamW, fp32, the same model) trains at
sp = 1 (one rank) and sp = 2 (two ranks), without and with tiling, while no rank's RSS grows
more than `--cap-mib` (256 MiB) during the step (LMAX_NOTE says how; about 90 s). `--quick`
skips it.

Measured (this machine, default sizes: hidden 256, 8 heads, 4 kv heads, 2 layers, MLP 1024,
vocabulary 16384, 4096 tokens), the largest rank's saved bytes over sp=1's without tiling:
sp=2 0.509, sp=4 0.254; with tiling sp=1 0.182, sp=2 0.100, sp=4 0.050. All-to-all bytes per
layer equal the formula (3,145,728 B at sp=2, 2,359,296 B at sp=4), and backward sends as much.
L_max within 256 MiB per rank: sp=1 512, sp=1 tiled 1536, sp=2 1280, sp=2 tiled 4608 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _launch  # noqa: E402 - the benchmarks folder is not a package

SHAPE = dict(hidden=256, heads=8, kv_heads=4, layers=2, intermediate=1024, vocab=16384)
QUICK_SHAPE = dict(hidden=64, heads=4, kv_heads=2, layers=2, intermediate=128, vocab=1024)
SLICE = 512  # tokens per slice of the tiled helpers


def build(shape: dict):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=1 << 20,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def local_shards(tokens: int) -> int:
    """Slices of at most SLICE tokens for the tiled helpers."""
    return max(1, -(-tokens // SLICE))


def tile(model) -> None:
    """Every MLP through TiledMLP; the head moved to `tiled_head` for TiledFusedLogitsLoss."""
    import torch

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: TiledMLP.apply(mlp_forward, mlp, x, local_shards(x.shape[1]), None)
    model.tiled_head, model.lm_head = model.lm_head, torch.nn.Identity()


def loss_of(model, out, shift_labels, tiled: bool):
    import torch.nn.functional as F

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def loss_fn(head, x, y):
        return F.cross_entropy(head(x).flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    if tiled:
        mask = shift_labels != -100
        shards = local_shards(out.shape[1])
        return TiledFusedLogitsLoss.apply(
            loss_fn, model.tiled_head, out, shift_labels, mask, shards, None, "mean"
        )
    return F.cross_entropy(out.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=-100)


def measure(rank: int, sp: int, shape: dict, length: int, tiled: bool) -> dict:
    """One forward and backward at sequence parallelism `sp` (this rank's shard)."""
    import torch

    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        prepare_sp_batch,
        shard_sp_batch,
    )

    model = build(shape)
    if sp > 1:
        UlyssesSPAttentionHF.register_with_transformers(model, sequence_parallel_size=sp)
    if tiled:
        tile(model)
    ids = torch.randint(0, shape["vocab"], (1, length), generator=torch.Generator().manual_seed(1))
    batch = shard_sp_batch(prepare_sp_batch({"input_ids": ids, "labels": ids}, sp), rank % sp, sp)

    sent = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size() * (sp - 1) // sp)
        return original(output, input, *args, **kwargs)

    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # activations only: a saved parameter is no activation
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    dist.all_to_all_single = counting
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = loss_of(model, out, batch["shift_labels"], tiled)
        forward_sent = sum(sent)
        loss.backward()
    finally:
        dist.all_to_all_single = original
    b, s = 1, batch["input_ids"].shape[1]
    head_dim = shape["hidden"] // shape["heads"]
    kv = max(shape["kv_heads"], sp) if sp > 1 else shape["kv_heads"]
    formula = (2 * shape["heads"] + 2 * kv) * b * s * head_dim * 4 * (sp - 1) // sp
    return {
        "sp": sp,
        "tiled": tiled,
        "rank": rank % sp,
        "saved_bytes": sum(storages.values()),
        "a2a_bytes_per_layer": forward_sent // shape["layers"],
        "a2a_formula_bytes_per_layer": formula,
        "a2a_bytes_backward": sum(sent) - forward_sent,
        "loss": loss.item(),
    }


def group_worker(rank: int, world: int, shape: dict, length: int, cases: list) -> list:
    """`cases`: (sp, tiled) pairs, sp 1 or `world`; sp = 1 runs on rank 0 only (no collective)."""
    return [measure(rank, sp, shape, length, tiled) for sp, tiled in cases if sp > 1 or rank == 0]


def activation_rows(shape: dict, length: int, sps=(1, 2, 4)) -> list:
    """Every (sp, tiled) case's rows, one per sp rank: sp = 1 and 2 share one 2-rank run."""
    rows = []
    for world in sorted({max(sp, 2) for sp in sps}):
        cases = [(sp, tiled) for sp in sps if max(sp, 2) == world for tiled in (False, True)]
        for rank_rows in _launch.run_ranks(group_worker, world_size=world, args=(shape, length, cases)):
            rows += rank_rows
    return rows


def summary(rows: list, layers: int) -> dict:
    """The largest rank's saved bytes per case over sp = 1 untiled's, and the all-to-all bytes."""

    def worst(sp: int, tiled: bool):
        mine = [r["saved_bytes"] for r in rows if r["sp"] == sp and r["tiled"] == tiled]
        return max(mine) if mine else None

    base = worst(1, False)
    sps = sorted({r["sp"] for r in rows})
    ratios = {}
    for sp in sps:
        for tiled in (False, True):
            value = worst(sp, tiled)
            ratios[f"sp{sp}{'_tiled' if tiled else ''}"] = value / base if value is not None else None
    a2a = {str(r["sp"]): r["a2a_bytes_per_layer"] for r in rows if r["sp"] > 1 and r["rank"] == 0}
    formula = {str(r["sp"]): r["a2a_formula_bytes_per_layer"] for r in rows if r["sp"] > 1 and r["rank"] == 0}
    return {
        "activation_ratio": ratios,
        "a2a_bytes_per_layer": a2a,
        "a2a_formula_bytes_per_layer": formula,
        "a2a_matches_formula": all(
            r["a2a_bytes_per_layer"] == r["a2a_formula_bytes_per_layer"] for r in rows
        ),
        "a2a_backward_equals_forward": all(
            r["a2a_bytes_backward"] == r["a2a_bytes_per_layer"] * layers for r in rows
        ),
    }


def format_table(rows: list, shape: dict, length: int) -> str:
    base = {t: max(r["saved_bytes"] for r in rows if r["sp"] == 1 and r["tiled"] == t) for t in (False, True)}
    lines = [
        f"Llama {shape}, one sequence of {length} tokens, fp32, sdpa; bytes per rank (the largest rank)",
        "| sp | tiled | saved for backward | x sp=1 untiled | x sp=1 same tiling | 1/sp | a2a/layer fwd "
        "| formula | a2a/layer bwd |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tiled in (False, True):
        for sp in sorted({r["sp"] for r in rows}):
            mine = [r for r in rows if r["sp"] == sp and r["tiled"] == tiled]
            top = max(mine, key=lambda r: r["saved_bytes"])
            lines.append(
                f"| {sp} | {'yes' if tiled else 'no'} | {top['saved_bytes'] / 2**20:.1f} MiB "
                f"| {top['saved_bytes'] / base[False]:.3f} | {top['saved_bytes'] / base[tiled]:.3f} | {1 / sp:.3f} "
                f"| {top['a2a_bytes_per_layer']:,} B | {top['a2a_formula_bytes_per_layer']:,} B "
                f"| {top['a2a_bytes_backward'] // shape['layers']:,} B |"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- longest sequence


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset VmHWM (the peak RSS) to the current RSS: Linux's clear_refs value 5."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _engine(shape: dict, sp: int, tiled: bool):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = build(shape)
    mpu = (
        UlyssesSPAttentionHF.register_with_transformers(model, sequence_parallel_size=sp) if sp > 1 else None
    )
    if tiled:
        tile(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    return engine


def _train_step(engine, shape: dict, sp: int, rank: int, length: int, tiled: bool) -> float:
    import torch

    from deepspeed.runtime.sequence_parallel.ulysses_sp import prepare_sp_batch, shard_sp_batch
    from deepspeed.sequence.layer import token_weighted_loss

    ids = torch.randint(0, shape["vocab"], (1, length), generator=torch.Generator().manual_seed(length))
    batch = shard_sp_batch(prepare_sp_batch({"input_ids": ids, "labels": ids}, sp), rank, sp)
    out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = loss_of(engine.module, out, batch["shift_labels"], tiled)
    if sp > 1:
        from deepspeed.utils import groups

        loss = token_weighted_loss(loss, batch["shift_labels"], groups._get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    return loss.item()


def lmax_worker(rank: int, world: int, shape: dict, tiled: bool, cap_bytes: int, plan: dict) -> dict:
    """The longest sequence whose training step (ZeRO-3, AdamW) grows no rank's RSS past `cap_bytes`.

    Doubling from plan["start"], then plan["bisect"] halvings of the bracket (to multiples of
    plan["granule"]), until plan["budget_s"] runs out. Every rank probes the same lengths: a
    probe fits when the largest rank's peak growth (VmHWM over the RSS before the step) is
    within the cap."""
    import gc
    import time

    import deepspeed.comm as dist

    max_over_ranks = _launch.max_over_ranks
    sp = world
    engine = _engine(shape, sp, tiled)
    _train_step(engine, shape, sp, rank, plan["granule"], tiled)  # optimizer state allocated
    began = time.monotonic()
    probes = []

    def fits(length: int) -> bool:
        gc.collect()
        _reset_peak()
        base = _rss_kib("VmRSS")
        t0 = time.monotonic()
        _train_step(engine, shape, sp, rank, length, tiled)
        growth = (_rss_kib("VmHWM") - base) * 1024
        peak = int(max_over_ranks([growth])[0])
        probes.append(
            {"length": length, "peak_growth_bytes": peak, "step_s": round(time.monotonic() - t0, 2)}
        )
        return peak <= cap_bytes

    def out_of_time() -> bool:  # the same answer on every rank
        return max_over_ranks([time.monotonic() - began])[0] > plan["budget_s"]

    ok, bad, length, timed_out = 0, None, plan["start"], False
    while bad is None and length <= plan["limit"] and not (timed_out := out_of_time()):
        if fits(length):
            ok, length = length, length * 2
        else:
            bad = length
    for _ in range(plan["bisect"] if bad is not None else 0):
        mid = (ok + bad) // 2 // plan["granule"] * plan["granule"]
        if mid <= ok or (timed_out := out_of_time()):
            break
        if fits(mid):
            ok = mid
        else:
            bad = mid
    dist.barrier()
    return {
        "sp": sp,
        "tiled": tiled,
        "lmax": ok or None,
        "first_over_cap": bad,
        "hit_length_limit": bad is None and length > plan["limit"],
        "stopped_by_time_budget": timed_out,
        "probes": probes,
        "wall_s": round(time.monotonic() - began, 1),
    }


LMAX_ENV = {  # every tensor of 64 KiB or more mmapped and unmapped when freed: RSS follows the live bytes
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "65536",
    "MALLOC_ARENA_MAX": "2",
}


def longest_sequences(
    shape: dict, cap_bytes: int, plan: dict, modes=((1, False), (1, True), (2, False), (2, True))
):
    """L_max per (sp, tiled) mode: one run of `sp` ranks each."""
    results = {}
    for sp, tiled in modes:
        rows = _launch.run_ranks(
            lmax_worker, world_size=sp, args=(shape, tiled, cap_bytes, plan), env=LMAX_ENV
        )
        results[f"sp{sp}{'_tiled' if tiled else ''}"] = rows[0]
    return results


def format_lmax(lmax: dict, cap_bytes: int) -> str:
    lines = [
        f"Longest sequence trained (one ZeRO-3 AdamW step, fp32) with every rank's RSS growth within {cap_bytes / 2**20:.0f} MiB",
        "| mode | ranks | L_max | first length over the cap | probes (length: peak growth MiB, step s) |",
        "|---|---|---|---|---|",
    ]
    for name, r in lmax.items():
        probes = ", ".join(
            f"{p['length']}: {p['peak_growth_bytes'] / 2**20:.0f}, {p['step_s']}" for p in r["probes"]
        )
        first = r["first_over_cap"] or (
            "not reached (time budget)" if r["stopped_by_time_budget"] else "none (length limit)"
        )
        lines.append(f"| {name} | {r['sp']} | {r['lmax']} | {first} | {probes} |")
    return "\n".join(lines)


LMAX_CAP_BYTES = 256 * 2**20
LMAX_NOTE = (
    "the cap bounds each rank's peak RSS growth during one training step (ZeRO-3, AdamW, fp32) over the RSS "
    "before it (model shards and optimizer state already allocated), read from VmHWM after resetting it "
    "(/proc/self/clear_refs), with glibc told to mmap and unmap every allocation of 64 KiB or more; a length "
    "'fails' when the largest rank's growth exceeds the cap (no allocation is made to fail); lengths double "
    "from 1024, then 3 bisections to multiples of 256"
)
LMAX_PLAN = {"start": 1024, "limit": 1 << 17, "bisect": 3, "granule": 256, "budget_s": 90.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cap-mib", type=int, default=LMAX_CAP_BYTES // 2**20, help="L_max's RSS cap per rank"
    )
    parser.add_argument("--skip-lmax", action="store_true", help="no longest-sequence search")
    args = parser.parse_args()
    shape = QUICK_SHAPE if args.quick else SHAPE
    length = 512 if args.quick else args.length
    rows = activation_rows(shape, length)
    print(format_table(rows, shape, length))
    report = {"shape": shape, "length": length, "rows": rows, **summary(rows, shape["layers"])}
    if not (args.quick or args.skip_lmax):
        cap = args.cap_mib * 2**20
        report["lmax"] = longest_sequences(SHAPE, cap, LMAX_PLAN)
        report["lmax_cap_bytes"] = cap
        print(format_lmax(report["lmax"], cap))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
