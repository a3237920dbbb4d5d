"""`deepspeed.initialize(model=PipelineModule(...))`: the pipeline engine's train_batch /
eval_batch interface over one stage, against a plain-PyTorch loop on the same data; and the
process topologies scripts build for it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)
from tests.unit.common import DistributedTest

DIM, CLASSES, SAMPLES = 8, 4, 32


def _layers() -> list:
    torch.manual_seed(7)
    return [LayerSpec(nn.Linear, DIM, 16), nn.ReLU(), LayerSpec(nn.Linear, 16, CLASSES)]


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, DIM, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    )


def _config(stage: int, gas: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1,
        **extra,
    }


def _reference(model: nn.Module, world: int, gas: int, steps: int) -> tuple:
    """Plain PyTorch on the whole batch each rank sees, in the pipeline loader's order:
    rank r reads samples r, r + world, ... (no shuffling), micro-batches of 2."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = _dataset()
    loss_fn = nn.CrossEntropyLoss()
    per_rank = [list(range(r, SAMPLES, world)) for r in range(world)]
    cursor, losses = 0, []
    for _ in range(steps):
        opt.zero_grad()
        step_losses = []
        for _ in range(gas):
            for r in range(world):
                idx = per_rank[r][cursor : cursor + 2]
                loss = loss_fn(model(data.tensors[0][idx]), data.tensors[1][idx])
                (loss / (gas * world)).backward()
                step_losses.append(loss.detach())
            cursor = (cursor + 2) % len(per_rank[0])
        opt.step()
        losses.append(torch.stack(step_losses).mean())
    return model, losses


class TestTrainBatch(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 3])
    def test_matches_plain_pytorch(self, stage):
        """train_batch() with training_data: the step, the returned loss (mean over micro-batches
        and ranks) and the weights equal plain PyTorch's; steps_per_print prints upstream's line."""
        module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
        plain = nn.Sequential(*(f for f in module.forward_funcs))
        reference, ref_losses = _reference(plain, self.world_size, gas=2, steps=5)
        engine, _, loader, _ = deepspeed.initialize(
            model=module,
            model_parameters=module.parameters(),
            training_data=_dataset(),
            config=_config(stage, 2),
        )
        assert isinstance(engine, deepspeed.PipelineEngine)
        assert isinstance(loader, deepspeed.utils.RepeatingLoader)
        # 5 steps x 2 micro-batches x 2 samples = 20 > the 16 each rank holds: the loader repeats
        losses = [engine.train_batch() for _ in range(5)]
        assert engine.global_steps == 5 and engine.micro_batches == 2
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want.item()) < 1e-6, (got, want)
        for name, param in reference.named_parameters():
            got = deepspeed.utils.safe_get_full_fp32_param(dict(engine.module.named_parameters())[name])
            torch.testing.assert_close(got, param.detach(), atol=1e-6, rtol=0)

    def test_data_iter_tuples_and_eval(self):
        """A data_iter of ((x, mask), labels) and a loss_fn over a tuple output; eval_batch's
        average, per-micro-batch list, logits and the module left in eval mode."""

        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(DIM, CLASSES)

            def forward(self, inputs):
                x, mask = inputs
                return self.lin(x * mask)

        module = PipelineModule(layers=[Masked()], num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=_config(2, 1)
        )
        x, y = _dataset().tensors
        mask = torch.ones_like(x)
        batches = [((x[i : i + 2], mask[i : i + 2]), y[i : i + 2]) for i in range(0, 8, 2)]
        loss = engine.train_batch(iter(batches[:1]))
        assert loss.shape == () and torch.isfinite(loss)
        with pytest.raises(StopIteration):  # the iterator is kept, and this one is exhausted
            engine.train_batch()
        expected = [nn.functional.cross_entropy(engine.module(b[0]), b[1]).detach() for b in batches[1:3]]
        mean = engine.eval_batch(iter(batches[1:3]), num_micro_batches=2)
        local = (expected[0] + expected[1]) / 2
        torch.distributed.all_reduce(local)
        assert abs(mean.item() - local.item() / self.world_size) < 1e-6
        assert mean.dtype == torch.float32 and not engine.module.training
        listed = engine.eval_batch(iter(batches[1:3]), num_micro_batches=2, reduce_output=None)
        torch.testing.assert_close(torch.stack(listed), torch.stack(expected))
        value, logits = engine.eval_batch(iter(batches[3:4]), num_micro_batches=1, return_logits=True)
        assert logits.shape == (2, CLASSES)
        outputs = engine.eval_batch(iter(batches[3:4]), num_micro_batches=1, compute_loss=False)
        torch.testing.assert_close(outputs * self.world_size, _summed(logits))

    def test_misuse_is_named(self):
        module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=_config(1, 1)
        )
        with pytest.raises(ValueError, match="no data to read"):
            engine.train_batch()
        with torch.no_grad(), pytest.raises(RuntimeError, match="Use eval_batch"):
            engine.train_batch(iter([]))
        x, y = _dataset().tensors
        with pytest.raises(ValueError, match=r"\(inputs, labels\)"):
            engine.train_batch(iter([x[:2]]))
        with pytest.raises(ValueError, match="has no labels"):
            engine.train_batch(iter([(x[:2],)]))
        with pytest.raises(ValueError, match="reduce_output='sum'"):
            engine.eval_batch(iter([(x[:2], y[:2])]), reduce_output="sum")

    def test_accumulation_stays_aligned(self):
        """A hand-called forward/backward/step before train_batch (upstream forbids them; here
        they work) does not move train_batch's step off its last micro-batch."""
        module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=_config(1, 2)
        )
        x, y = _dataset().tensors
        engine.backward(nn.functional.cross_entropy(engine(x[:2]), y[:2]))
        engine.step()  # half an accumulation
        assert engine.global_steps == 0
        engine.train_batch(iter([(x[:2], y[:2]), (x[2:4], y[2:4])]))
        assert engine.global_steps == 1

    def test_a_batch_cut_short_leaves_no_gradients(self):
        """An iterator that runs out mid-batch raises, and its micro-batch's gradients are
        discarded: the next batch steps exactly as on a fresh engine."""
        x, y = _dataset().tensors
        good = [(x[4:6], y[4:6]), (x[6:8], y[6:8])]
        runs = []
        for cut_short in (True, False):
            torch.manual_seed(7)
            module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
            engine, *_ = deepspeed.initialize(
                model=module, model_parameters=module.parameters(), config=_config(2, 2)
            )
            if cut_short:
                with pytest.raises(StopIteration):
                    engine.train_batch(iter([(x[:2], y[:2])]))
            engine.train_batch(iter(good))
            runs.append([deepspeed.utils.safe_get_full_fp32_param(p).clone() for p in module.parameters()])
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


class TestGrid(DistributedTest):
    world_size = 2

    def test_groups_follow_the_topology(self):
        """The grid's groups reduce over the ranks its topology says; the engine's grid is the
        one-stage layout (every rank on the data axis)."""
        rank = torch.distributed.get_rank()
        for topo in (
            PipeDataParallelTopology(num_pp=1, num_dp=2),
            PipeDataParallelTopology(num_pp=2, num_dp=1),
        ):
            grid = PipelineParallelGrid(topology=topo)
            for ranks, group in (
                (grid.dp_group, grid.get_data_parallel_group()),
                (grid.pp_group, grid.get_pipe_parallel_group()),
            ):
                value = torch.tensor([rank])
                torch.distributed.all_reduce(value, group=group)
                assert value.item() == sum(ranks)
            assert grid.stage_to_global(stage_id=0) == topo.get_rank(pipe=0, data=grid.data_parallel_id)
        assert PipelineParallelGrid().pipe_parallel_size == 2  # upstream's default: the first prime to pipe
        module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=_config(1, 1)
        )
        assert engine.grid.get_data_parallel_world_size() == 2 and engine.grid.get_stage_id() == 0
        assert engine.grid.is_first_stage and engine.grid.is_last_stage
        with pytest.raises(ValueError, match="spans 3 ranks"):
            PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=1, num_dp=3))


class TestTrainingDataOrder(DistributedTest):
    world_size = 2

    def test_ragged_data_is_padded_in_order(self):
        """As upstream's pipeline loader (torch's DistributedSampler, no shuffling): 5 samples on
        2 ranks, micro-batches of 2: rank 0 reads [0, 2], [4]; rank 1 [1, 3], [0] (padded)."""
        data = torch.utils.data.TensorDataset(
            torch.arange(5.0).unsqueeze(1), torch.zeros(5, dtype=torch.long)
        )
        module = PipelineModule(layers=[nn.Linear(1, 2)], num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), training_data=data, config=_config(1, 1)
        )
        seen = [next(engine.data_iterator)[0].flatten().tolist() for _ in range(3)]
        rank = torch.distributed.get_rank()
        assert seen == ([[0.0, 2.0], [4.0], [0.0, 2.0]] if rank == 0 else [[1.0, 3.0], [0.0], [1.0, 3.0]])


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    torch.distributed.all_reduce(t)
    return t


class TestBatchSizeSetters(DistributedTest):
    world_size = 2

    def test_set_train_batch_size(self):
        module = PipelineModule(layers=_layers(), num_stages=1, loss_fn=nn.CrossEntropyLoss())
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=_config(1, 1)
        )
        engine.set_train_batch_size(12)  # micro 2 x 2 ranks x 3 micro-batches
        assert engine.get_batch_info() == (12, 2, 3) and engine.micro_batches == 3
        with pytest.raises(ValueError, match="multiple of"):
            engine.set_train_batch_size(6)
        engine.set_train_micro_batch_size(1)
        assert engine.get_batch_info() == (6, 1, 3)
        x, y = _dataset().tensors
        engine.train_batch(iter([(x[i : i + 1], y[i : i + 1]) for i in range(3)]))
        assert engine.global_steps == 1


def test_topologies_lay_ranks_out_row_major():
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert topo.world_size() == 6 and topo.get_rank(x=1, y=1) == 4
    assert topo.get_coord(4) == topo.ProcessCoord(x=1, y=1)
    assert topo.get_dim("y") == 3 and topo.get_dim("z") == 0
    assert topo.get_axis_comm_lists("x") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("z") == []
    assert topo.filter_match(y=2) == [2, 5] and topo.get_axis_list("x", 1) == [3, 4, 5]
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.get_axis_names() == ["pipe", "data", "model"]
    assert three.get_rank_repr(rank=3) == "model_01"
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(x=0)
    with pytest.raises(ValueError, match="not found"):
        topo.get_coord(6)
    assert [_prime_factors(n) for n in (1, 2, 12, 29)] == [[], [2], [2, 2, 3], [29]]


def test_pipeline_module_refuses_what_is_not_built():
    with pytest.raises(ValueError, match="2 pipeline stages"):
        PipelineModule(layers=_layers(), topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    with pytest.raises(ValueError, match="2 model-parallel ranks"):
        PipelineModule(layers=_layers(), topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    module = PipelineModule(layers=_layers(), topology=PipeDataParallelTopology(num_pp=1, num_dp=1))
    assert module.topology().get_dim("data") == 1 and module.get_additional_losses() is None
    with pytest.raises(ValueError, match="partition_method='profile'"):
        PipelineModule(layers=_layers(), num_stages=1, partition_method="profile")


def test_initial_weights_follow_upstreams_random_draws():
    """partition_method "parameters" (the default) builds each LayerSpec once to count its
    parameters before building the model, as upstream; "uniform" does not. A seeded script
    then starts from upstream's weights."""
    specs = [LayerSpec(nn.Linear, 3, 3), LayerSpec(nn.Linear, 3, 2)]
    torch.manual_seed(5)
    counted = [spec.build() for spec in specs]  # the counting build, dropped
    built = [spec.build() for spec in specs]
    torch.manual_seed(5)
    by_parameters = PipelineModule(layers=specs, num_stages=1)
    torch.manual_seed(5)
    uniform = PipelineModule(layers=specs, num_stages=1, partition_method="uniform")
    for index in range(2):
        assert torch.equal(getattr(by_parameters, str(index)).weight, built[index].weight)
        assert torch.equal(getattr(uniform, str(index)).weight, counted[index].weight)


def test_seed_layers_reseeds_every_layer_of_every_forward():
    """seed_layers: layer i of the k-th forward runs under seed base_seed x (k + 1) + i, as
    upstream, here a dropout mask; a checkpointed chunk draws the same mask on recomputation."""
    from deepspeed.runtime.utils import set_random_seed

    for interval in (0, 1):
        layers = [nn.Linear(4, 4), nn.Dropout(0.5)]
        module = PipelineModule(
            layers=layers,
            num_stages=1,
            seed_layers=True,
            base_seed=7,
            activation_checkpoint_interval=interval,
        )
        x = torch.ones(3, 4, requires_grad=True)
        for forward in (1, 2):
            out = module(x)
            set_random_seed(7 * (forward + 1) + 1)
            expected = nn.functional.dropout(layers[0](x), 0.5)
            torch.testing.assert_close(out, expected)
            out.sum().backward()  # recomputation (interval 1) must agree with the forward's mask
            grad, x.grad = x.grad.clone(), None
            expected.sum().backward()
            torch.testing.assert_close(x.grad, grad)
            x.grad = None
