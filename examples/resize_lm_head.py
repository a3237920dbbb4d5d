"""Resize an LM head as HF transformers does, the gathered block written once.

    python examples/resize_lm_head.py                   # plain run
    python examples/resize_lm_head.py --zero3           # ZeRO-3 on one process
    deepspeed --num_procs 2 examples/resize_lm_head.py --zero3

`resize_lm_head()` is the same code with ZeRO-3 on and off: the old and new heads are
gathered by `GatheredParameters(..., enabled=zero3).start()` and released by `stop()`,
where rank 0's copy is broadcast and every rank keeps its slice. The script compares the
ZeRO-3 result with a plain run from the same seed.
"""

import argparse
import os
import sys

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
HIDDEN, OLD_VOCAB, NEW_VOCAB = 8, 13, 17


def build_head(zero3: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    init = deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, enabled=zero3).start()
    head = nn.Linear(HIDDEN, OLD_VOCAB, bias=True)
    init.stop()
    return head


def resize_lm_head(old: nn.Linear, new_num_tokens: int, zero3: bool) -> nn.Linear:
    """A new head with `new_num_tokens` rows; the rows both heads share are copied from `old`."""
    # A partitioned weight's data is empty; ds_shape is its real shape.
    old_num_tokens, hidden = getattr(old.weight, "ds_shape", old.weight.shape)
    init = deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, enabled=zero3).start()
    new = nn.Linear(hidden, new_num_tokens, bias=old.bias is not None)
    init.stop()

    n = min(old_num_tokens, new_num_tokens)
    params = [old.weight, old.bias, new.weight, new.bias]  # a None bias is dropped
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3).start()
    new.weight.data[:n, :] = old.weight.data[:n, :]
    if new.bias is not None:
        new.bias.data[:n] = old.bias.data[:n]
    gather.stop()
    return new


def full(*params: torch.Tensor) -> list:
    """Full copies of `params`; gathers them when they are partitioned."""
    with deepspeed.zero.GatheredParameters(list(params)):
        return [p.detach().clone() for p in params]


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

    plain_old = build_head(zero3=False)
    plain_new = resize_lm_head(plain_old, NEW_VOCAB, zero3=False)

    old = build_head(zero3=args.zero3)
    new = resize_lm_head(old, NEW_VOCAB, zero3=args.zero3)
    rank, world = rank_and_world()
    tag = f"[rank {rank}/{world}]"

    if args.zero3:
        print(
            f"{tag} new head: ds_shape={tuple(new.weight.ds_shape)}, data.shape={tuple(new.weight.data.shape)}, "
            f"this rank's shard {new.weight.ds_tensor.numel()} elements (padding {new.weight.padding_size()})"
        )
    got = full(new.weight, new.bias, old.weight)
    want = [plain_new.weight, plain_new.bias, plain_old.weight]
    same = all(torch.equal(g, w.detach()) for g, w in zip(got, want))
    copied = torch.equal(got[0][:OLD_VOCAB], got[2])  # the shared rows came from the old head

    ok = same and copied
    mode = "ZeRO-3" if args.zero3 else "plain (no ZeRO)"
    print(
        f"{tag} check: {mode} resized head equals the plain result: {'OK' if ok else 'MISMATCH'} "
        f"(equal {same}, rows copied {copied})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
