"""Ulysses sequence parallelism: activation bytes per rank and all-to-all bytes per layer (issue 42).

    .venv/bin/python benchmarks/bench_sequence_parallel.py [--length 4096] [--json sp.json] [--quick]

A Llama-shaped model (fp32, sdpa) runs one forward and backward on one sequence of `--length`
tokens at sp = 1, 2 and 4 (sp ranks each, gloo), without and with tiling (every MLP through
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
the saved bytes while it runs. Nothing here is timed. The longest sequence trainable under a
memory cap is not measured yet.

Measured (this machine, default sizes: hidden 256, 8 heads, 4 kv heads, 2 layers, MLP 1024,
vocabulary 16384, 4096 tokens), the largest rank's saved bytes over sp=1's without tiling:
sp=2 0.509, sp=4 0.254; with tiling sp=1 0.182, sp=2 0.100, sp=4 0.050. All-to-all bytes per
layer equal the formula (3,145,728 B at sp=2, 2,359,296 B at sp=4), and backward sends as much.
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


def tile(model, shards: int) -> None:
    """Every MLP through TiledMLP; the head moved to `tiled_head` for TiledFusedLogitsLoss."""
    import torch

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: TiledMLP.apply(mlp_forward, mlp, x, shards, None)
    model.tiled_head, model.lm_head = model.lm_head, torch.nn.Identity()


def loss_of(model, out, shift_labels, tiled: bool, shards: int):
    import torch.nn.functional as F

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def loss_fn(head, x, y):
        return F.cross_entropy(head(x).flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    if tiled:
        mask = shift_labels != -100
        return TiledFusedLogitsLoss.apply(
            loss_fn, model.tiled_head, out, shift_labels, mask, shards, None, "mean"
        )
    return F.cross_entropy(out.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=-100)


def worker(rank: int, world: int, shape: dict, length: int, tiled: bool) -> dict:
    import torch

    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        prepare_sp_batch,
        shard_sp_batch,
    )

    model = build(shape)
    if world > 1:
        UlyssesSPAttentionHF.register_with_transformers(model, sequence_parallel_size=world)
    shards = max(1, length // world // 512)
    if tiled:
        tile(model, shards)
    ids = torch.randint(0, shape["vocab"], (1, length), generator=torch.Generator().manual_seed(1))
    batch = shard_sp_batch(prepare_sp_batch({"input_ids": ids, "labels": ids}, world), rank, world)

    sent = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size() * (world - 1) // world)
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
            loss = loss_of(model, out, batch["shift_labels"], tiled, shards)
        forward_sent = sum(sent)
        loss.backward()
    finally:
        dist.all_to_all_single = original
    b, s = 1, batch["input_ids"].shape[1]
    head_dim = shape["hidden"] // shape["heads"]
    kv = max(shape["kv_heads"], world) if world > 1 else shape["kv_heads"]
    formula = (2 * shape["heads"] + 2 * kv) * b * s * head_dim * 4 * (world - 1) // world
    return {
        "sp": world,
        "tiled": tiled,
        "rank": rank,
        "saved_bytes": sum(storages.values()),
        "a2a_bytes_per_layer": forward_sent // shape["layers"],
        "a2a_formula_bytes_per_layer": formula,
        "a2a_bytes_backward": sum(sent) - forward_sent,
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = QUICK_SHAPE if args.quick else SHAPE
    length = 512 if args.quick else args.length
    rows = []
    for tiled in (False, True):
        for sp in (1, 2, 4):
            rows += _launch.run_ranks(worker, world_size=sp, args=(shape, length, tiled))
    base = {t: max(r["saved_bytes"] for r in rows if r["sp"] == 1 and r["tiled"] == t) for t in (False, True)}
    untiled_base = base[False]
    print(f"Llama {shape}, one sequence of {length} tokens, fp32, sdpa; bytes per rank (the largest rank)")
    print(
        "| sp | tiled | saved for backward | x sp=1 untiled | x sp=1 same tiling | 1/sp | a2a/layer fwd | formula | a2a/layer bwd |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for tiled in (False, True):
        for sp in (1, 2, 4):
            mine = [r for r in rows if r["sp"] == sp and r["tiled"] == tiled]
            worst = max(mine, key=lambda r: r["saved_bytes"])
            print(
                f"| {sp} | {'yes' if tiled else 'no'} | {worst['saved_bytes'] / 2**20:.1f} MiB "
                f"| {worst['saved_bytes'] / untiled_base:.3f} | {worst['saved_bytes'] / base[tiled]:.3f} | {1 / sp:.3f} "
                f"| {worst['a2a_bytes_per_layer']:,} B | {worst['a2a_formula_bytes_per_layer']:,} B "
                f"| {worst['a2a_bytes_backward'] // shape['layers']:,} B |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "length": length, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
