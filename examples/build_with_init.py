"""Build a model under `zero.Init`, written once for ZeRO-3 and plain runs.

    python examples/build_with_init.py                  # plain model only
    python examples/build_with_init.py --zero3          # ZeRO-3 on one process
    deepspeed --num_procs 2 examples/build_with_init.py --zero3

The same `build()` runs with ZeRO-3 on and off; with it on, each module's parameters are
partitioned as soon as the module is built. The script then compares the gathered ZeRO-3
model (parameters and a forward pass) with a plain model built from the same seed.
"""

import argparse
import os
import sys

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
VOCAB, HIDDEN, LAYERS = 51, 9, 2  # odd sizes: shards get padding


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
            )
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        # As HF's post_init(): under zero.Init, apply() gathers each module around the
        # function and keeps rank 0's result.
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(zero3: bool, seed: int = 0) -> TinyLM:
    """The model-construction code, written once: `enabled=` decides whether ZeRO-3 is on."""
    torch.manual_seed(seed)
    init = deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, enabled=zero3).start()
    model = TinyLM()
    init.stop()
    return model


def full_state(model: nn.Module) -> dict:
    """Every parameter's full value; gathers them when they are partitioned."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def rank_and_world() -> tuple:
    """(rank, world size); (0, 1) in a plain run, the only case with no process group.

    Under a launcher `main()` joins the group first and `--zero3` makes `zero.Init` create
    one, so a missing group here means this process really is alone.
    """
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero3", action="store_true", help="partition parameters with ZeRO-3")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # started by a launcher: join the group before any rank is asked
        deepspeed.init_distributed(verbose=False)

    reference = build(zero3=False)
    model = build(zero3=args.zero3)
    rank, world = rank_and_world()
    tag = f"[rank {rank}/{world}]"

    if args.zero3:
        head = model.head.weight
        print(
            f"{tag} head.weight: ds_shape={tuple(head.ds_shape)}, data.shape={tuple(head.data.shape)}, "
            f"this rank holds {head.ds_tensor.numel()} of {head.ds_numel} elements "
            f"(padding {head.padding_size()})"
        )

    want, got = full_state(reference), full_state(model)
    same_params = all(torch.equal(got[name], want[name]) for name in want)
    ids = torch.arange(10).view(2, 5) % VOCAB
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        same_output = torch.equal(model(ids), reference(ids))
    no_leaks = deepspeed.zero.live_contexts() == []

    ok = same_params and same_output and no_leaks
    mode = "ZeRO-3" if args.zero3 else "plain (no ZeRO)"
    print(
        f"{tag} check: {mode} model equals the plain model: {'OK' if ok else 'MISMATCH'} "
        f"(parameters {same_params}, forward {same_output}, no live contexts {no_leaks})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
