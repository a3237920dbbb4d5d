"""MiCS (issue 43 items 1, 2 and 6): shard groups of `mics_shard_size` ranks, replicated across.

Every case trains the zoo's TokenMLP and checks it against plain PyTorch (the zoo harness:
DDP-style averaged gradients) and against plain ZeRO-3 on the same ranks, at the zoo's fp32
tolerances, with gradient accumulation and clipping; where the shards live, what each gather
moves (the communication logger) and checkpoints across layouts are read back.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import layout
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils import groups
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.unit.common import DistributedTest
from tests.unit.test_node_traffic import traffic_config
from tests.zoo import models as zm
from tests.zoo.harness import (
    LOSS_RTOL,
    PARAM_ATOL,
    Case,
    build,
    check_parity,
    gathered,
    initialize,
    max_abs_diff,
    run_engine,
)

GATHERS = ("all_gather_into_tensor", "all_gather_into_columns")
SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_columns")
# Plain, accumulation, clipping (below every step's norm), and a model built under zero.Init.
VARIANTS = ({}, {"gas": 2}, {"clip": 0.05}, {"under_init": True, "gas": 2, "clip": 0.05})


def mics_case(name: str, shard, hierarchical: bool = False, **kwargs) -> Case:
    zero = {"mics_shard_size": shard, "mics_hierarchical_params_gather": hierarchical}
    extra = {"zero_optimization": zero} if shard else {}
    tag = (f"mics{shard}" + ("h" if hierarchical else "")) if shard else "zero3"
    return Case(f"{name}_{tag}", zm.TokenMLP, zm.token_batch, zm.lm_loss, config_extra=extra, **kwargs)


def _check_shards(engine, shard: int) -> None:
    """Each parameter is cut over this rank's shard group, and its replicas hold the same shard."""
    mics = groups.initialize_mics(shard)
    assert mics.shard_ranks == tuple(
        range(dist.get_rank() // shard * shard, (dist.get_rank() // shard + 1) * shard)
    )
    for name, p in engine.module.named_parameters():
        state = p._zero_state
        assert state.world_size == shard, name
        assert state.partition_size == math.ceil(p.ds_numel / shard), name
        assert dist.get_all_ranks_from_group(state.group) == list(mics.shard_ranks), name
        master = engine.optimizer.masters[state.ds_id].detach()
        copies = [torch.empty_like(master) for _ in range(mics.replicas)]
        dist.all_gather(copies, master, group=mics.replica_group)
        assert all(torch.equal(c, master) for c in copies), f"{name}: replicas differ"


def _diffs(a, b) -> tuple:
    """(max relative loss difference, max parameter difference) between two runs."""
    la, lb = torch.tensor(a.losses, dtype=torch.float64), torch.tensor(b.losses, dtype=torch.float64)
    loss_rel = ((la - lb).abs() / lb.abs().clamp_min(1e-12)).max().item()
    return loss_rel, max_abs_diff(gathered(a.model), gathered(b.model))[0]


def _parity_grid(shards: tuple) -> None:
    """Each variant under MiCS matches plain PyTorch and plain ZeRO-3; prints the worst figures."""
    worst = {"loss_rel_vs_zero3": 0.0, "param_vs_zero3": 0.0}
    for shard in shards:
        for i, kwargs in enumerate(VARIANTS):
            case = mics_case(f"v{i}", shard, **kwargs)
            got, ref = check_parity(case)  # plain PyTorch, at the zoo's tolerances
            _check_shards(got.engine, shard)
            plain = run_engine(mics_case(f"v{i}", None, **kwargs), case.micro_batches(dist.get_world_size()))
            loss_rel, param = _diffs(got, plain)
            assert loss_rel <= LOSS_RTOL and param <= PARAM_ATOL, (case.name, loss_rel, param)
            worst["loss_rel_vs_zero3"] = max(worst["loss_rel_vs_zero3"], loss_rel)
            worst["param_vs_zero3"] = max(worst["param_vs_zero3"], param)
            if case.clip:
                assert min(ref.grad_norms) > case.clip  # clipping acted at every step
                got_norms = torch.tensor([float(n) for n in got.grad_norms])
                torch.testing.assert_close(got_norms, torch.tensor(ref.grad_norms), rtol=1e-4, atol=0)
    if dist.get_rank() == 0:
        print(f"MiCS shards {shards} at {dist.get_world_size()} ranks, worst vs plain ZeRO-3: {worst}")


def _two_hop_parity(shard: int, nodes: int, per_node: int) -> None:
    """With mics_hierarchical_params_gather a shard group spanning nodes gathers in two hops:
    training matches plain PyTorch, and MiCS's one-hop gathers bit for bit."""
    for i, kwargs in enumerate(VARIANTS[2:]):
        case = mics_case(f"h{i}", shard, hierarchical=True, **kwargs)
        plan = groups.initialize_mics(shard, True).two_hop
        hops = plan.hops
        got, _ = check_parity(case)
        assert (plan.nodes, plan.per_node) == (nodes, per_node)
        assert plan.hops > hops  # the gathers went through the two hops
        one_hop = run_engine(mics_case(f"h{i}", shard, **kwargs), case.micro_batches(dist.get_world_size()))
        assert _diffs(got, one_hop) == (0.0, 0.0)
    if dist.get_rank() == 0:
        print(
            f"two-hop gathers ({nodes} nodes x {per_node}): {plan.hops} gathers, equal to one-hop bit for bit"
        )


def _sizes(records: dict, ops: tuple) -> dict:
    found: dict = {}
    for name in ops:
        for size, row in records.get(name, {}).items():
            found[size] = found.get(size, 0) + row[0]
    return found


def _check_comm_sizes(shard: int) -> None:
    """Each all-gather moves this rank's shard of `numel / shard`; the reduce-scatter's input is
    `shard` shards; the replicas' all-reduce carries one shard of every gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4, bias=False))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={**traffic_config(shard), "comms_logger": {"enabled": True}},
    )
    dist.reset_log()
    x = torch.randn(2, 6, device=engine.device)
    engine.backward(engine(x).sum())
    engine.step()
    records = dist.comms_logger.get_raw_data()
    shards = [math.ceil(60 / shard) + math.ceil(10 / shard), math.ceil(40 / shard)]  # elements per module
    gathers = _sizes(records, GATHERS)
    # Each module gathered once in forward, once in backward (shard 1: a group of one rank,
    # whose "gather" is this rank's whole parameter).
    assert gathers == {4 * shards[0]: 2, 4 * shards[1]: 2}, gathers
    assert _sizes(records, SCATTERS) == {shard * 4 * sum(shards): 1}
    replicas = dist.get_world_size() // shard
    if replicas > 1:
        assert records["all_reduce"][4 * sum(shards)][0] == 1, records["all_reduce"]
    dist.configure(enabled=False)
    if dist.get_rank() == 0:
        print(
            f"MiCS shard {shard}: bytes per all-gather {sorted(gathers)}; all_reduce sizes {sorted(records['all_reduce'])}"
        )


def _checkpoint_round_trip(tmp, shard: int) -> None:
    """MiCS -> plain ZeRO-3 -> MiCS, one save each way, against an uninterrupted plain run."""
    ws = dist.get_world_size()
    mics, plain = (
        mics_case("ckpt", shard, steps=4, gas=2, clip=0.05),
        mics_case("ckpt", None, steps=4, gas=2, clip=0.05),
    )
    data = mics.micro_batches(ws)
    straight = run_engine(plain, data)
    first = run_engine(mics, data[:2])
    first.engine.save_checkpoint(tmp, tag="mics")
    saved = sorted(f for f in os.listdir(os.path.join(tmp, "mics")) if f.endswith("model_states.pt"))
    assert saved == sorted(layout.model_states_name(r) for r in range(shard)), saved  # the first replica's
    middle_engine = initialize(plain, build(plain, zero=True))
    middle_engine.load_checkpoint(tmp, tag="mics")
    middle = run_engine(plain, data[2:3], middle_engine)
    middle_engine.save_checkpoint(tmp, tag="zero3")
    last_engine = initialize(mics, build(mics, zero=True))
    last_engine.load_checkpoint(tmp, tag="zero3")
    last = run_engine(mics, data[3:], last_engine)
    losses = torch.tensor(first.losses + middle.losses + last.losses, dtype=torch.float64)
    want = torch.tensor(straight.losses, dtype=torch.float64)
    loss_rel = ((losses - want).abs() / want.abs()).max().item()
    param = max_abs_diff(gathered(last.model), gathered(straight.model))[0]
    assert loss_rel <= LOSS_RTOL and param <= PARAM_ATOL, (loss_rel, param)
    assert last_engine.global_steps == 4
    if dist.get_rank() == 0:
        print(f"MiCS {shard} checkpoint round trip at {ws} ranks: loss rel {loss_rel:.3g}, param {param:.3g}")


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _other_settings(tmp) -> None:
    """AdamW (sharded optimizer state), persistent parameters, CPU optimizer offload and bf16
    under MiCS match plain ZeRO-3; the fp32 and 16-bit exports of a MiCS run are the model."""
    ws = dist.get_world_size()
    persistent = {"zero_optimization": {"stage3_param_persistence_threshold": 10**6}}
    offload = {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
    }
    export16 = {"zero_optimization": {"gather_16bit_weights_on_model_save": True}}
    for name, kwargs, extra, tol in (
        ("adamw_persistent", {"optimizer": adamw, "gas": 2}, persistent, (LOSS_RTOL, PARAM_ATOL)),
        ("offload", {"clip": 0.05}, offload, (LOSS_RTOL, PARAM_ATOL)),
        ("bf16", {"bf16": True}, export16, (5e-4, 5e-3)),  # the zoo's bf16 tolerances
    ):
        runs = []
        for shard in (1, None):
            case = mics_case(name, shard, **kwargs)
            for key, value in extra.items():
                base = case.config_extra.get(key, {})
                case.config_extra[key] = {**base, **value} if isinstance(value, dict) else value
            runs.append(run_engine(case, case.micro_batches(ws)))
        loss_rel, param = _diffs(*runs)
        assert loss_rel <= tol[0] and param <= tol[1], (name, loss_rel, param)
        if dist.get_rank() == 0:
            print(f"MiCS 1 vs plain ZeRO-3, {name}: loss rel {loss_rel:.3g}, param {param:.3g}")
    mics = runs[0].engine  # bf16, shard 1
    mics.save_checkpoint(tmp, tag="t")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t")
    masters = {
        n: mics.optimizer.masters[p._zero_state.ds_id].detach().float().cpu()
        for n, p in mics.module.named_parameters()
    }
    assert set(fp32) == set(masters) and all(torch.equal(fp32[n].reshape(-1), masters[n]) for n in fp32)
    assert mics.save_16bit_model(tmp, "model16.bin")
    if dist.get_rank() == 0:
        saved = torch.load(os.path.join(tmp, "model16.bin"))
        want = gathered(mics.module)
        assert all(torch.equal(saved[n].float(), want[n]) for n in want)
    dist.barrier()


def _refuses_other_partitioning() -> None:
    cfg = mics_case("refuse", 1).config()
    plain = {**cfg, "zero_optimization": {**cfg["zero_optimization"], "mics_shard_size": -1}}
    with deepspeed.zero.Init(config_dict_or_path=plain):
        model = zm.TokenMLP()
    with pytest.raises(
        ValueError, match=r"mics_shard_size=1: parameter 'embed.weight' is partitioned over ranks \[0, 1\]"
    ):
        deepspeed.initialize(model=model, config=cfg)
    with deepspeed.zero.MiCS_Init(config_dict_or_path=cfg):
        model = zm.TokenMLP()
    assert all(p._zero_state.world_size == 1 for p in model.parameters())
    with pytest.raises(
        ValueError, match="MiCS_Init: the config's zero_optimization.mics_shard_size is not set"
    ):
        deepspeed.zero.MiCS_Init(config_dict_or_path=plain)


class TestMiCSTwoRanks(DistributedTest):
    world_size = 2

    def test_parity_comm_and_checkpoints(self, tmp_path):
        # shard 1: pure replication (whole parameters everywhere, gradients all-reduced);
        # shard 2: one group of the whole world, plain ZeRO-3.
        _parity_grid((1, 2))
        _check_comm_sizes(1)
        _check_comm_sizes(2)
        _checkpoint_round_trip(str(tmp_path / "s1"), 1)
        os.environ[groups.RANKS_PER_NODE_ENV] = "1"  # two "nodes" of one rank: shard 2 spans both
        try:
            groups._TOPOLOGY.reset()
            _two_hop_parity(2, nodes=2, per_node=1)
        finally:
            del os.environ[groups.RANKS_PER_NODE_ENV]
        os.environ[groups.RANKS_PER_NODE_ENV] = "3"
        try:
            groups._TOPOLOGY.reset()
            with pytest.raises(ValueError, match="DEEPSPEED_RANKS_PER_NODE='3'"):
                groups.node_layout()
        finally:
            del os.environ[groups.RANKS_PER_NODE_ENV]
        groups._TOPOLOGY.reset()
        assert groups.node_layout() == (0, 0)  # one host
        with pytest.raises(ValueError, match="mics_shard_size=3"):
            groups.initialize_mics(3)

    def test_other_settings_exports_and_refusals(self, tmp_path):
        _other_settings(str(tmp_path))
        _refuses_other_partitioning()


@pytest.mark.slow
class TestMiCSFourRanks(DistributedTest):
    world_size = 4

    def test_two_nodes_of_two(self, tmp_path):
        os.environ[groups.RANKS_PER_NODE_ENV] = "2"
        try:
            groups._TOPOLOGY.reset()
            assert groups.node_layout() == (0, 0, 1, 1)
            assert (
                groups.ranks_on_node(1) == (2, 3) and groups.node_of(dist.get_rank()) == dist.get_rank() // 2
            )
            mics = groups.initialize_mics(2)
            assert mics.shard_ranks == tuple(r for r in range(4) if r // 2 == dist.get_rank() // 2)
            assert mics.replica_ranks == (dist.get_rank() % 2, dist.get_rank() % 2 + 2)
            _parity_grid((2,))
            _check_comm_sizes(2)
            _checkpoint_round_trip(str(tmp_path / "s2"), 2)
            _two_hop_parity(4, nodes=2, per_node=2)
            assert groups.initialize_mics(2, True).two_hop is None  # shard groups within a node: one hop
        finally:
            del os.environ[groups.RANKS_PER_NODE_ENV]


def _mics_config(stage: int = 3, **zero) -> dict:
    return {"train_batch_size": 1, "zero_optimization": {"stage": stage, **zero}}


def test_config_refusals_name_the_key():
    with pytest.raises(ValueError, match=r"mics_shard_size=2 \(MiCS\) needs stage 3"):
        DeepSpeedConfig(_mics_config(stage=2, mics_shard_size=2))
    with pytest.raises(ValueError, match="mics_shard_size"):
        DeepSpeedConfig(_mics_config(mics_shard_size=0))
    with pytest.raises(ValueError, match="mics_hierarchical_params_gather=True needs MiCS"):
        DeepSpeedConfig(_mics_config(mics_hierarchical_params_gather=True))
    zero = DeepSpeedConfig(_mics_config(mics_shard_size=2, mics_hierarchical_params_gather=True)).zero_config
    assert zero.mics_shard_size == 2 and zero.mics_hierarchical_params_gather
    assert DeepSpeedConfig(_mics_config()).zero_config.mics_shard_size == -1


def test_mics_init_needs_the_key():
    with pytest.raises(ValueError, match="config_dict_or_path"):
        deepspeed.zero.MiCS_Init()
