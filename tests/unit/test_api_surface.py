"""The upstream API surface clients and upstream's own tests reach (issue 11).

Single-process checks first (imports, checkpointing API, FusedAdam, estimators, build
facts, MoE and pipeline layers), then the distributed behaviours on spawned gloo ranks
(leaf modules, safe_get/set, engine queries, MoE and PipelineModule training under ZeRO-3).
"""

import argparse
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from tests.unit.common import DistributedTest

# ============================================================================ import surface

NAMES = [
    "runtime.lr_schedules.VALID_LR_SCHEDULES",
    "runtime.zero.partition_parameters.get_accelerator",
    "runtime.zero.partition_parameters.partitioned_param_data_shape",
    "runtime.zero.GatheredParameters",
    "runtime.zero.TiledLinear",
    "runtime.zero.tiling.TiledLinearReturnBias",
    "zero.TiledLinear",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "runtime.zero.estimators.estimate_zero2_model_states_mem_needs_all_live",
    "runtime.base_optimizer.DeepSpeedOptimizer",
    "checkpointing.configure",
    "checkpointing.checkpoint",
    "checkpointing.is_configured",
    "checkpointing.reset",
    "checkpointing.get_cuda_rng_tracker",
    "checkpointing.model_parallel_cuda_manual_seed",
    "utils.set_z3_leaf_modules",
    "utils.get_z3_leaf_modules",
    "utils.unset_z3_leaf_modules",
    "utils.set_z3_leaf_modules_by_name",
    "utils.set_z3_leaf_modules_by_suffix",
    "utils.safe_update_full_grad_vectorized",
    "utils.is_initialized",
    *[
        f"utils.safe_{v}_{s}_{w}"
        for v in ("get", "set")
        for s in ("full", "local")
        for w in ("fp32_param", "grad", "optimizer_state")
    ],
    "add_config_arguments",
    "get_accelerator",
    "tp_model_init",
    "init_inference",
    "launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
    "ops.adam.FusedAdam",
    "ops.adam.DeepSpeedCPUAdam",
    "ops.__compatible_ops__",
    "git_version_info.version",
    "git_version_info.git_hash",
    "git_version_info.installed_ops",
    "git_version_info.torch_info",
    "pipe.PipelineModule",
    "pipe.LayerSpec",
    "moe.layer.MoE",
    "DeepSpeedConfigError",
    "DeepSpeedDataLoader",
    "PipelineModule",
    "logger",
    "log_dist",
    "OnDevice",
    "utils.OnDevice",
    "git_hash",
    "git_branch",
    "__git_hash__",
    "__git_branch__",
    "runtime.zero.unwrap_model_for_generation",
    "runtime.zero.ZeroParamType",
    "runtime.zero.utils.is_zero_param",
    "runtime.utils.see_memory_usage",
    "runtime.utils.move_to_device",
    "utils.timer.SynchronizedWallClockTimer",
    "runtime.config.ADAM_OPTIMIZER",
]


def test_required_torch_version_and_optimizer_names():
    from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER
    from deepspeed.utils.torch import required_torch_version

    installed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert required_torch_version(min_version="1.13") and required_torch_version(
        min_version=f"{installed[0]}.{installed[1]}"
    )
    assert not required_torch_version(min_version=f"{installed[0] + 1}.0")
    assert required_torch_version(max_version=f"{installed[0] + 1}.0") and not required_torch_version(
        max_version="1.13"
    )
    assert required_torch_version(min_version="1.13", max_version=f"{installed[0]}.{installed[1]}")
    with pytest.raises(ValueError, match="min_version, max_version or both"):
        required_torch_version()
    assert (ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER) == ("adam", "adamw", "lamb")


def test_every_name_resolves_after_a_bare_import():
    # A fresh interpreter: nothing but `import deepspeed` may have loaded the modules.
    code = (
        "import deepspeed, functools\n"
        f"for name in {NAMES!r}:\n"
        "    functools.reduce(getattr, name.split('.'), deepspeed)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_leaf_function_keeps_its_name_beside_its_module():
    # The function z3_leaf_module shares its module's name; importing a sibling first (as
    # upstream's own tests do) must still leave the function under that name.
    code = (
        "from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module\n"
        "from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules\n"
        "import torch\n"
        "assert callable(z3_leaf_module) and z3_leaf_module(torch.nn.Linear(1, 1)) is False\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_leaf_modules_by_name_and_suffix():
    from deepspeed.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules_by_name,
        set_z3_leaf_modules_by_suffix,
        z3_leaf_parameter,
    )

    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    marked, missing = set_z3_leaf_modules_by_name(net, ["1", "nope"], raise_if_not_found=False)
    assert marked == [net[1]] and missing == ["nope"] and z3_leaf_parameter(net[1][0].weight)
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(net, ["nope"])
    marked, missing = set_z3_leaf_modules_by_suffix(net, [".1"])
    assert marked == [net[1][1]] and missing == []
    assert get_z3_leaf_modules(net) == [net[1], net[1][1]]
    set_z3_leaf_modules_by_name(net, ["1", "1.1"], flag=False)
    assert get_z3_leaf_modules(net) == [] and not z3_leaf_parameter(net[1][0].weight)


class _FineBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleList(
            nn.Linear(2, 2) for _ in range(3)
        )  # 18 parameters, 4 layers with the block

    def forward(self, x):
        head, tail = x[:, :2], x[:, 2:]
        for part in self.parts:
            head = torch.tanh(part(head))
        return torch.cat([head, tail], dim=1)


class _GranularNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)  # 42 parameters
        self.fine = _FineBlock()
        self.out = nn.Linear(WIDTH, 1)  # 7: the net has 67 parameters in 7 layers, 9 per layer

    def forward(self, x):
        return self.out(self.fine(torch.relu(self.inp(x))))


def test_leaf_modules_by_granularity():
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_granularity

    assert set_z3_leaf_modules_by_granularity(_GranularNet(), 3)[0] == []  # finest is 18 // 4 = 4
    assert set_z3_leaf_modules_by_granularity(_GranularNet(), 3)[1] == 4
    net = _GranularNet()
    assert set_z3_leaf_modules_by_granularity(net, 5)[0] == [net.fine]  # the net itself is 9
    net = _GranularNet()
    assert set_z3_leaf_modules_by_granularity(net, 9)[0] == [net]  # from the root down: the first that fits


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError):
        deepspeed.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError):
        deepspeed.runtime.zero.no_such_module  # noqa: B018
    with pytest.raises(AttributeError):
        deepspeed.utils.no_such_helper  # noqa: B018


def test_separate_products_raise_saying_so():
    for fn in (deepspeed.init_inference, deepspeed.tp_model_init):
        with pytest.raises(NotImplementedError, match="separate product"):
            fn(nn.Linear(2, 2))


def test_add_config_arguments():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepspeed is False


def test_initialize_reads_the_config_from_args_and_refuses_a_missing_group():
    from deepspeed.runtime.initialize import _pick_config

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    assert _pick_config(parser.parse_args(["--deepspeed_config", "a.json"]), None, None) == "a.json"
    assert _pick_config(parser.parse_args(["--deepscale_config", "old.json"]), None, None) == "old.json"
    with pytest.raises(ValueError, match="both set"):
        _pick_config(
            parser.parse_args(["--deepspeed_config", "a.json", "--deepscale_config", "b.json"]), None, None
        )
    # In a fresh interpreter, which has no process group (the test process may have one).
    code = (
        "import torch, deepspeed\n"
        "try:\n"
        "    deepspeed.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 1},\n"
        "                         dist_init_required=False)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "dist_init_required=False): torch.distributed is not initialized" in out.stdout, out.stderr


def test_launcher_environment_file_name():
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME

    assert DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env")


def test_partition_parameters_names():
    import deepspeed.runtime.zero.partition_parameters as pp
    from deepspeed.accelerator import get_accelerator

    assert pp.partitioned_param_data_shape == [0]
    # transformers' prevent_arange_dtype_change calls exactly this.
    assert pp.get_accelerator().device_name("0") == get_accelerator().device_name(0)


def test_git_version_info_facts():
    from deepspeed import git_version_info as info
    from deepspeed.ops.op_builder import ALL_OPS

    assert info.version == deepspeed.__version__
    # Upstream's integer parts of the version, which its tests and tools read.
    parts = (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__)
    assert ".".join(map(str, parts)) == deepspeed.__version__ and all(type(p) is int for p in parts)
    head = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(__file__),
    )
    if head.returncode == 0:
        assert info.git_hash == head.stdout.strip()
    assert info.compatible_ops == {n: b.is_compatible() for n, b in ALL_OPS.items()}
    assert info.installed_ops == {n: b.is_built() for n, b in ALL_OPS.items()}
    assert deepspeed.ops.__compatible_ops__ == info.compatible_ops
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])


# ============================================================================ checkpointing


@pytest.fixture
def ckpt():
    from deepspeed.runtime.activation_checkpointing import checkpointing

    checkpointing.reset()
    yield checkpointing
    checkpointing.reset()


class _MP:
    def __init__(self, size):
        self.size = size

    def get_model_parallel_world_size(self):
        return self.size

    def get_model_parallel_rank(self):
        return 0


def test_checkpointing_configure_records_and_resets(ckpt):
    assert deepspeed.checkpointing is ckpt
    assert not ckpt.is_configured()
    # Lightning's call: every option may be None ("not given").
    ckpt.configure(
        None, partition_activations=None, contiguous_checkpointing=None, checkpoint_in_cpu=None, profile=None
    )
    assert ckpt.is_configured()
    ckpt.configure(
        None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}
    )
    assert ckpt.SETTINGS.checkpoint_in_cpu and ckpt.SETTINGS.profile
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}}, profile=False)
    assert not ckpt.SETTINGS.profile  # an explicit argument wins over the config
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['partitioned_activations'\].*partition_activations"
    ):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partitioned_activations": True}})
    ckpt.reset()
    assert not ckpt.is_configured()


def test_checkpointing_refuses_model_parallel_partitioning(ckpt):
    ckpt.configure(_MP(1), partition_activations=True)  # one model-parallel rank: nothing to split
    with pytest.raises(ValueError, match="partition_activations"):
        ckpt.configure(_MP(2), partition_activations=True)


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.GELU(), nn.Linear(6, 2))


def test_checkpoint_recomputes_with_equal_gradients(ckpt, monkeypatch):
    x = torch.randn(4, 6)
    plain = _block()
    torch.manual_seed(1)
    plain(x).sum().backward()
    wrapped = _block()
    calls = []
    wrapped.register_forward_pre_hook(lambda m, a: calls.append(1))
    syncs = []
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, i=None: syncs.append(1))
    offloads = []
    real_save_on_cpu = torch.autograd.graph.save_on_cpu

    def counting_save_on_cpu(*a, **k):
        offloads.append(1)
        return real_save_on_cpu(*a, **k)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", counting_save_on_cpu)
    ckpt.configure(None, checkpoint_in_cpu=True, synchronize=True)
    torch.manual_seed(1)
    x_in = x.clone().requires_grad_(False)  # parameters still get gradients (non-reentrant)
    deepspeed.checkpointing.checkpoint(wrapped, x_in).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    assert len(syncs) == 4 and len(offloads) == 1
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad)  # same dropout mask in the recomputation


def test_rng_tracker_forks_a_separate_stream(ckpt):
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device = accelerator.device_name()  # the tracker forks the accelerator's generator
    ckpt.model_parallel_cuda_manual_seed(123)
    tracker = ckpt.get_cuda_rng_tracker()
    with tracker.fork():
        a = torch.rand(3, device=device)
    outside = torch.rand(3, device=device)
    ckpt.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        b = torch.rand(3, device=device)
    torch.testing.assert_close(a, b)
    accelerator.manual_seed(123)
    torch.testing.assert_close(outside, torch.rand(3, device=device))  # the default stream was not disturbed
    with pytest.raises(ValueError, match="already"):
        tracker.add("other", 123 + 2718)


def test_checkpointed_dropout_in_a_tracker_fork_recomputes_the_same_mask(ckpt):
    """Megatron-style model-parallel dropout forks the tracker's stream inside a checkpointed
    layer: the recomputation must draw the forward's mask (the fork had advanced the stream,
    so it drew another and the gradients were wrong), and the stream the backward reached is
    kept. Keyword arguments reach the function, and upstream's names for the tracker exist."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().device_name()
    layer = nn.Linear(8, 8).to(device)

    def region(h, scale):
        with ckpt.get_cuda_rng_tracker().fork():
            return nn.functional.dropout(layer(h), 0.5) * scale

    x = torch.randn(4, 8, device=device)
    grads, streams = [], []
    for checkpointed in (False, True):
        ckpt.model_parallel_cuda_manual_seed(7)
        layer.zero_grad()
        out = ckpt.checkpoint(region, x, scale=2.0) if checkpointed else region(x, scale=2.0)
        out.sum().backward()
        grads.append(layer.weight.grad.clone())
        streams.append(ckpt.get_cuda_rng_tracker().get_states()[ckpt._MODEL_PARALLEL_RNG_TRACKER_NAME])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert torch.equal(streams[1], streams[0])  # one fork's worth of draws, as without checkpointing
    assert ckpt._CUDA_RNG_STATE_TRACKER is ckpt.get_cuda_rng_tracker()
    assert isinstance(ckpt.get_cuda_rng_tracker(), ckpt.CudaRNGStatesTracker)
    state = get_accelerator().get_rng_state()
    first = torch.rand(2, device=device)
    ckpt._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(2, device=device), first)


# ============================================================================ FusedAdam


@pytest.mark.parametrize("adam_w_mode, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_matches_torch(adam_w_mode, reference):
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    a = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    b = reference(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert set(a.state[ours[0]]) == set(b.state[theirs[0]])


def test_fused_adam_without_bias_correction_and_refusals():
    from deepspeed.ops.adam import FusedAdam

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    FusedAdam([p], lr=0.1, bias_correction=False, betas=(0.9, 0.99), eps=0.0).step()
    m, v = 0.1 * 2.0, 0.01 * 4.0  # first moments, uncorrected
    torch.testing.assert_close(p.detach(), torch.full((3,), 1.0 - 0.1 * m / math.sqrt(v)))
    with pytest.raises(RuntimeError, match="amsgrad"):
        FusedAdam([p], amsgrad=True)


# ============================================================================ estimators


def test_zero3_estimates_follow_the_documented_formulas(capsys):
    from deepspeed.runtime.zero.estimators import estimate_zero3_model_states_mem_needs_all_cold

    total, largest = 60_506_624, 16_449_536  # upstream's documented t5-small example
    rows = estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=1)
    gb = [(round(r["cpu_mem"] / 2**30, 2), round(r["gpu_mem"] / 2**30, 2)) for r in rows]
    assert gb == [(1.52, 0.06), (1.52, 0.06), (1.35, 0.17), (1.35, 0.17), (0.09, 1.08), (0.34, 1.08)]
    assert "61M total params, 16M largest layer params" in capsys.readouterr().out


def test_live_estimates_count_the_model():
    from deepspeed.runtime.zero.estimators import (
        estimate_zero2_model_states_mem_needs_all_live,
        estimate_zero3_model_states_mem_needs_all_live,
        model_to_params,
    )

    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5))
    assert model_to_params(model) == (325, 220)
    z2 = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert z2[0]["gpu_mem"] == 2 * 325 and z2[0]["cpu_mem"] == int(325 * 16 * 1.5)
    assert z2[1]["gpu_mem"] == 2 * 325 + int(18 * 325 / 2) and z2[1]["cpu_mem"] == int(325 * 4 * 2 * 1.5)
    z3 = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert z3[4]["gpu_mem"] == 4 * 220 + int(18 * 325 / 2)


def test_estimates_match_upstreams_numbers():
    """The figures upstream 0.19.8 gives (read off its functions): per node, offloaded state is
    split over the nodes; ZeRO-2 keeps 16-bit parameters whole and shares the 18 bytes."""
    from deepspeed.runtime.zero.estimators import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs,
    )

    p, layer = 10**9, 10**7
    assert estimate_zero3_model_states_mem_needs(p, layer, 8, 2) == (13_500_000_000, 40_000_000, 40_000_000)
    assert estimate_zero3_model_states_mem_needs(p, layer, 8, 2, True, False) == (
        12_000_000_000,
        40_000_000 + 125_000_000,
        40_000_000,
    )
    assert estimate_zero3_model_states_mem_needs(p, layer, 8, 2, zero_init=False)[0] == 48_000_000_000
    assert estimate_zero2_model_states_mem_needs(p, 8, 2, cpu_offload=False) == (
        48_000_000_000,
        3_125_000_000,
    )


# ============================================================================ MoE and pipeline layers


def test_moe_shapes_aux_loss_and_capacity():
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(8, nn.Linear(8, 8), num_experts=4, k=1, use_rts=False, min_capacity=1)
    x = torch.randn(2, 6, 8)
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and counts.shape == (4,) and counts.sum() == 12
    gates = torch.softmax(moe.deepspeed_moe.gate.wg(x.reshape(-1, 8)), dim=1)
    first = nn.functional.one_hot(gates.argmax(1), 4).float()
    torch.testing.assert_close(l_aux, 4 * (gates.mean(0) * first.mean(0)).sum())
    # capacity 1 per expert (factor 1/3 of 12/4 tokens): all but the first token per expert is dropped.
    tight = MoE(8, nn.Linear(8, 8), num_experts=4, k=1, capacity_factor=1 / 3, use_rts=False, min_capacity=1)
    tight.load_state_dict(moe.state_dict())
    out_tight, _, _ = tight(x)
    kept = (out_tight.reshape(-1, 8).abs().sum(1) > 0).sum().item()
    assert kept == int((counts > 0).sum())
    top2 = MoE(8, nn.Linear(8, 8), num_experts=4, k=2)
    out2, l_aux2, counts2 = top2(x)
    assert out2.shape == x.shape and counts2.sum() == 24 and l_aux2 > 0


def test_moe_refuses_expert_parallelism():
    from deepspeed.moe.layer import MoE

    with pytest.raises(ValueError, match="ep_size=2"):
        MoE(8, nn.Linear(8, 8), num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="k=3"):
        MoE(8, nn.Linear(8, 8), num_experts=4, k=3)


def test_pipeline_module_single_stage_is_sequential():
    from deepspeed.pipe import LayerSpec, PipelineModule

    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=2)
    with pytest.raises(TypeError, match="nn.Module"):
        LayerSpec(len)
    torch.manual_seed(0)
    pipe = PipelineModule(  # "uniform": no counting build (see test_pipeline_engine.py), seq's draws
        [LayerSpec(nn.Linear, 4, 8), nn.ReLU(), lambda t: t * 2, LayerSpec(nn.Linear, 8, 3)],
        num_stages=1,
        partition_method="uniform",
    )
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    torch.testing.assert_close(pipe(x), seq[2](seq[1](seq[0](x)) * 2))


def test_mp_world_size_from_the_mpu():
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    size = DeepSpeedEngine.mp_world_size.fget
    assert size(SimpleNamespace(mpu=None)) == 1
    assert size(SimpleNamespace(mpu=SimpleNamespace(get_model_parallel_world_size=lambda: 4))) == 4
    assert (
        size(SimpleNamespace(mpu=SimpleNamespace(get_data_parallel_world_size=lambda: 2))) == 1
    )  # data parallel only


def test_engine_optimizer_base_class():
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from deepspeed.runtime.zero.stage3 import ZeroStage3Optimizer

    assert issubclass(ZeroStage3Optimizer, ZeROOptimizer) and issubclass(ZeROOptimizer, DeepSpeedOptimizer)


# ============================================================================ distributed behaviours

WIDTH = 6


def _cfg(gas=1, **zero):
    micro = 4 // (dist.get_world_size() * gas)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # the plain references do not clip (the default clips at 1.0)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _rank_slice(t):
    per = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def _reference_train(build, data, loss_of, lr=1e-2):
    """Plain PyTorch: each step's loss is the mean of the per-rank-slice losses (what the engine averages)."""
    torch.manual_seed(7)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ws = dist.get_world_size()
    for x in data:
        opt.zero_grad()
        per = x.shape[0] // ws
        loss = sum(loss_of(model, x[r * per : (r + 1) * per]) for r in range(ws)) / ws
        loss.backward()
        opt.step()
    return model


def _engine_train(build, data, loss_of, **zero):
    torch.manual_seed(7)
    model = build()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(**zero))
    for x in data:
        loss = loss_of(engine, _rank_slice(x))
        engine.backward(loss)
        engine.step()
    return engine


def _assert_same_params(engine, reference, atol=1e-5):
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=atol, msg=name)


class Router(nn.Module):
    """Runs one child or the other depending on the data: ranks may take different branches."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class LeafNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.router = Router()
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.out(self.router(torch.relu(self.inp(x))))


def _leaf_loss(model, x):
    return model(x).pow(2).mean()


def _data(steps, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, WIDTH, generator=gen) for _ in range(steps)]


class RoutedExperts(nn.Module):
    """A mixture of experts whose routing is data-dependent: the last input column names each
    row's expert, so one rank's rows reach experts another rank's do not, and expert 3 none."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return x + out


class RoutedMoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.moe = RoutedExperts()
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.out(self.moe(torch.tanh(self.inp(x[:, :WIDTH])), x[:, WIDTH].long()))


def _moe_data(steps, micro_steps, world):
    """Each rank's rows route to experts {rank, rank + 1} (expert 3 to none with 2 ranks)."""
    gen = torch.Generator().manual_seed(5)
    data = []
    for _ in range(steps * micro_steps):
        rows = []
        for rank in range(world):
            x = torch.randn(2, WIDTH, generator=gen)
            route = torch.tensor([[rank], [rank + 1]], dtype=torch.float32)
            rows.append(torch.cat([x, route], dim=1))
        data.append(torch.cat(rows))
    return data


class TestApiSurfaceDistributed(DistributedTest):
    world_size = [1, 2]

    def test_routed_experts_in_a_leaf_train_like_plain_pytorch_at_every_stage(self, monkeypatch):
        """Ranks run different experts of a leaf-marked MoE; the leaf's gradients are reduced
        as one zero-filled unit (leaf_grads.py), so every stage trains as plain PyTorch, and an
        expert no rank ran is skipped by the optimizer (weight decay would move a zero-filled one)."""
        from deepspeed.runtime.zero.leaf_grads import LeafGradients
        from deepspeed.utils import set_z3_leaf_modules

        world, gas, steps = dist.get_world_size(), 2, 3
        data = _moe_data(steps, gas, world)
        torch.manual_seed(11)
        reference = RoutedMoENet()
        initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(steps):
            opt.zero_grad()
            for micro in range(gas):
                x = data[step * gas + micro]
                per = x.shape[0] // world
                loss = sum(_leaf_loss(reference, x[r * per : (r + 1) * per]) for r in range(world)) / world
                (loss / gas).backward()
            opt.step()
        done_at_leaf_exit = []
        real = LeafGradients.leaf_backward_done
        monkeypatch.setattr(
            LeafGradients, "leaf_backward_done", lambda s, m, r: done_at_leaf_exit.append(m) or real(s, m, r)
        )
        # MiCS with one rank per shard group (2 ranks: two replicas): each replica's rank runs
        # experts the other's does not, and both must step every expert that either ran.
        layouts = [(1, {}), (2, {}), (3, {})] + ([(3, {"mics_shard_size": 1})] if world == 2 else [])
        for stage, layout in layouts:
            torch.manual_seed(11)
            model = RoutedMoENet()
            set_z3_leaf_modules(model, [RoutedExperts])
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": gas,
                "gradient_clipping": 0.0,
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True},
                },
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **layout},
            }
            engine, *_ = deepspeed.initialize(model=model, config=config)
            done_at_leaf_exit.clear()
            for x in data:
                engine.backward(_leaf_loss(engine, _rank_slice(x)))
                engine.step()
            # Stage 3 reduces the unit when the leaf's backward ends, the others at the end of backward.
            assert len(done_at_leaf_exit) == (len(data) if stage == 3 else 0), stage
            _assert_same_params(engine, reference)
            with deepspeed.zero.GatheredParameters(list(engine.module.moe.experts[3].parameters())):
                assert torch.equal(engine.module.moe.experts[3].weight, initial["moe.experts.3.weight"]), (
                    stage
                )

    def test_leaf_module_is_fetched_as_one_unit(self, monkeypatch):
        from deepspeed.runtime.zero import gather
        from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

        data = _data(4)
        reference = _reference_train(LeafNet, data, _leaf_loss)

        def build():
            net = LeafNet()
            assert set_z3_leaf_modules(net, [Router]) == [net.router]
            return net

        fetches = []
        real = gather.fetch_states

        def counting(states, owner, async_op=False, **kwargs):
            module = getattr(owner, "module", None)
            if module is not None and states:
                fetches.append((type(module).__name__, getattr(owner, "phase", ""), len(states)))
            return real(states, owner, async_op=async_op, **kwargs)

        monkeypatch.setattr(gather, "fetch_states", counting)
        engine = _engine_train(build, data, _leaf_loss, stage3_prefetch_bucket_size=0)
        _assert_same_params(engine, reference)
        router = [f for f in fetches if f[0] == "Router"]
        # One fetch of the whole subtree (a and b[0]: 4 parameters) per forward and per backward.
        assert router == [("Router", "forward", 4), ("Router", "backward", 4)] * len(data)
        assert not [f for f in fetches if f[0] in ("Sequential", "Tanh")]
        linears = [f for f in fetches if f[0] == "Linear"]
        assert len(linears) == 2 * 2 * len(data)  # inp and out only (a and b[0] fetch nothing), fwd + bwd
        assert get_z3_leaf_modules(engine.module) == [engine.module.router]
        unset_z3_leaf_modules(engine.module, ["Router"])  # by class name, after initialize
        fetches.clear()
        engine.backward(_leaf_loss(engine, _rank_slice(data[0])))
        engine.step()
        assert not [f for f in fetches if f[0] == "Router"]  # unmarked: children fetch their own

    def test_granularity_threshold_fetches_fine_blocks_as_one_unit(self):
        from deepspeed.utils import get_z3_leaf_modules

        data = _data(3)
        reference = _reference_train(_GranularNet, data, _leaf_loss)
        engine = _engine_train(_GranularNet, data, _leaf_loss, stage3_module_granularity_threshold=5)
        assert get_z3_leaf_modules(engine.module) == [engine.module.fine]
        _assert_same_params(engine, reference)

    def test_leaf_marked_after_initialize_counts_from_next_pass(self, monkeypatch):
        from deepspeed.runtime.zero import gather
        from deepspeed.utils import set_z3_leaf_modules

        engine, *_ = deepspeed.initialize(model=LeafNet(), config=_cfg())
        x = _rank_slice(_data(1)[0])
        set_z3_leaf_modules(engine.module, [Router])
        owners = []
        real = gather.fetch_states
        monkeypatch.setattr(
            gather,
            "fetch_states",
            lambda s, o, async_op=False, **kw: (
                owners.append(getattr(o, "module", None)) or real(s, o, async_op, **kw)
            ),
        )
        engine.backward(_leaf_loss(engine, x))
        engine.step()
        assert engine.module.router in owners and engine.module.router.a not in owners

    def test_safe_get_full_grad_between_micro_steps_at_every_stage(self):
        from deepspeed.utils import safe_get_full_grad, safe_update_full_grad_vectorized

        x = torch.ones(2, WIDTH) * (dist.get_rank() + 1)  # each rank its own gradient
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            model = nn.Linear(WIDTH, 1)
            config = _cfg(gas=2, stage=stage)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.backward(engine(x).pow(2).mean())  # micro-step 1 of 2: no step yet
            got = safe_get_full_grad(model.weight)
            assert got is not None and got.shape == (1, WIDTH), stage
            if stage < 2:  # not reduced yet: this rank's gradient so far, as upstream
                assert torch.equal(got, model.weight.grad.float()), stage
            else:  # reduced as it was produced: the ranks' average so far, the same everywhere
                others = [torch.empty_like(got) for _ in range(dist.get_world_size())]
                dist.all_gather(others, got)
                assert all(torch.equal(o, got) for o in others), stage
            # Updated where it was read: the whole gradient so far (stages 0-1) or the reduced shards.
            safe_update_full_grad_vectorized([model.weight, model.bias], lambda grad, param: grad * 3 + 1)
            torch.testing.assert_close(safe_get_full_grad(model.weight), got * 3 + 1, msg=str(stage))
            engine.step()

    def test_safe_get_and_set_match_the_reference(self):
        from deepspeed.utils import (
            safe_get_full_fp32_param,
            safe_get_full_grad,
            safe_get_full_optimizer_state,
            safe_get_local_fp32_param,
            safe_get_local_grad,
            safe_get_local_optimizer_state,
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        data = _data(2, seed=5)
        build = lambda: nn.Sequential(nn.Linear(WIDTH, 5), nn.Tanh(), nn.Linear(5, 1))  # noqa: E731
        loss_of = lambda m, x: m(x).pow(2).mean()  # noqa: E731
        torch.manual_seed(7)
        ref = build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        engine = _engine_train(build, [], loss_of)
        ws = dist.get_world_size()
        for x in data:
            per = x.shape[0] // ws
            ref_opt.zero_grad()
            (sum(loss_of(ref, x[r * per : (r + 1) * per]) for r in range(ws)) / ws).backward()
            engine.backward(loss_of(engine, _rank_slice(x)))
            for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
                torch.testing.assert_close(safe_get_full_grad(p), q.grad, atol=1e-6, rtol=0, msg=name)
                local = safe_get_local_grad(p)
                assert local.shape == (p.partition_numel(),)
            engine.step()
            ref_opt.step()
        weight, ref_weight = engine.module[0].weight, ref[0].weight
        assert safe_get_full_grad(weight) is None  # the step consumed it
        torch.testing.assert_close(safe_get_full_fp32_param(weight), ref_weight.detach(), atol=1e-6, rtol=0)
        exp_avg = ref_opt.state[ref_weight]["exp_avg"]
        torch.testing.assert_close(
            safe_get_full_optimizer_state(weight, "exp_avg"), exp_avg, atol=1e-7, rtol=0
        )
        local_m = safe_get_local_optimizer_state(weight, "exp_avg")
        start = dist.get_rank() * weight.partition_numel()
        flat = torch.cat([exp_avg.reshape(-1), torch.zeros(weight.padding_size())])
        torch.testing.assert_close(local_m, flat[start : start + weight.partition_numel()])
        # setters: full values on every rank; then the engine trains from them
        new = torch.full_like(ref_weight, 0.25)
        safe_set_full_fp32_param(weight, new)
        safe_set_full_optimizer_state(weight, torch.zeros_like(exp_avg), "exp_avg")
        torch.testing.assert_close(safe_get_full_fp32_param(weight), new)
        with deepspeed.zero.GatheredParameters(weight):
            torch.testing.assert_close(weight.detach(), new)  # the training shard follows
        assert safe_get_full_optimizer_state(weight, "exp_avg").abs().sum() == 0
        safe_set_local_fp32_param(weight, safe_get_local_fp32_param(weight) * 2)
        safe_set_local_optimizer_state(weight, torch.ones(weight.partition_numel()), "exp_avg")
        torch.testing.assert_close(safe_get_full_fp32_param(weight), new * 2)
        torch.testing.assert_close(safe_get_full_optimizer_state(weight, "exp_avg"), torch.ones_like(exp_avg))
        with pytest.raises(ValueError, match="elements"):
            safe_set_full_fp32_param(weight, torch.zeros(3))

    def test_the_activation_checkpointing_block_configures_the_api(self):
        from deepspeed.runtime.activation_checkpointing import checkpointing

        checkpointing.reset()
        cfg = _cfg()
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True, "profile": True}
        try:
            deepspeed.initialize(model=LeafNet(), config=cfg)
            assert checkpointing.SETTINGS.checkpoint_in_cpu and checkpointing.SETTINGS.profile
            checkpointing.configure(None, checkpoint_in_cpu=False)  # a script's own call...
            deepspeed.initialize(model=LeafNet(), config=cfg)
            assert not checkpointing.SETTINGS.checkpoint_in_cpu  # ...stays in force
            cfg["activation_checkpointing"] = {"partitioned_activations": True}  # a misspelt key
            with pytest.raises(ValueError, match="activation_checkpointing.*partition_activations, "):
                deepspeed.initialize(model=LeafNet(), config=cfg)
        finally:
            checkpointing.reset()

    def test_the_engine_data_loader_shards_the_data_set(self):
        from torch.utils.data import TensorDataset

        data = TensorDataset(torch.arange(11).float().unsqueeze(1))  # 11: a ragged tail at 2 ranks
        ws = dist.get_world_size()
        for drop_last in (False, True):
            cfg = dict(_cfg(), train_micro_batch_size_per_gpu=2, dataloader_drop_last=drop_last)
            cfg["gradient_accumulation_steps"] = 1
            _, _, loader, _ = deepspeed.initialize(model=LeafNet(), config=cfg, training_data=data)
            batches = [b[0].reshape(-1) for b in loader]
            per_rank = 11 // ws
            sizes = [2] * (per_rank // 2) + ([] if drop_last or per_rank % 2 == 0 else [1])
            assert [len(b) for b in batches] == sizes and len(loader) == len(sizes), (drop_last, batches)
            mine = torch.cat(batches) if batches else torch.empty(0)
            everyone = [torch.empty_like(mine) for _ in range(ws)]
            dist.all_gather(everyone, mine)
            seen = torch.cat(everyone).tolist()
            assert len(seen) == len(set(seen)) == ws * sum(sizes)  # disjoint shares, equal on every rank
            # Upstream's attributes, which tutorial scripts read.
            assert (loader.batch_size, loader.dataloader_drop_last, loader.dataset) == (2, drop_last, data)
            assert loader.data_sampler is loader.sampler and len(loader.data_sampler) == per_rank
            assert (loader.num_local_io_workers, loader.pin_memory, loader.collate_fn is not None) == (
                0,
                False,
                True,
            )
        engine = deepspeed.initialize(model=LeafNet(), config=_cfg())[0]
        ordered = engine.deepspeed_io(data, batch_size=3, route="eval")  # in order, still this rank's share
        assert torch.cat([b[0].reshape(-1) for b in ordered]).tolist() == [
            float(i) for i in range(dist.get_rank(), (11 // ws) * ws, ws)
        ]
        everything = engine.deepspeed_io(data, batch_size=4, data_sampler=range(11))  # the caller's sampler
        assert [len(b[0]) for b in everything] == [4, 4, 3]
        repeating = deepspeed.utils.RepeatingLoader(everything)
        assert [len(next(repeating)[0]) for _ in range(5)] == [4, 4, 3, 4, 4]  # starts again when exhausted
        with pytest.raises(ValueError, match="route='test'"):
            engine.deepspeed_io(data, route="test")
        if ws > 1:  # an empty epoch on every rank would train on nothing, silently
            with pytest.raises(ValueError, match=f"1 samples, fewer than the {ws} ranks"):
                engine.deepspeed_io(TensorDataset(torch.zeros(1, 1)))

    def test_steps_per_print_logs_from_step(self):
        from deepspeed.utils.logging import logger

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            net = LeafNet()
            cfg = dict(_cfg(), steps_per_print=2)
            engine, *_ = deepspeed.initialize(model=net, config=cfg)
            x = torch.randn(4 // dist.get_world_size(), WIDTH)
            for _ in range(4):  # the last step is followed by no forward: it still logs
                engine.backward(_leaf_loss(engine, x))
                engine.step()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        said = [r.getMessage() for r in records if "step=" in r.getMessage()]
        if dist.get_rank() == 0:
            assert [m.split("step=")[1].split(",")[0] for m in said] == ["2", "4"] and "skipped=0" in said[0]
        else:
            assert said == []

    def test_a_passed_optimizer_wins_over_the_config_block_and_says_so(self):
        from deepspeed.utils.logging import logger

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            net = LeafNet()
            client = torch.optim.SGD(net.parameters(), lr=0.1)
            _, optimizer, *_ = deepspeed.initialize(
                model=net, optimizer=client, config=_cfg()
            )  # config: AdamW
        finally:
            logger.removeHandler(handler)
        assert optimizer.optimizer is client
        said = " ".join(r.getMessage() for r in records)
        if dist.get_rank() == 0:
            assert (
                "optimizer passed in (SGD) is used and the config's 'optimizer' block (type 'adamw')" in said
            )
        else:
            assert "passed in" not in said

    def test_engine_queries(self):
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
        from deepspeed.runtime.zero.lifecycle import ZeroParamStatus

        net = LeafNet()
        net.custom_flag = "from the model"
        cfg = _cfg(gas=2, stage3_param_persistence_threshold=10_000)
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}
        cfg["communication_data_type"] = "fp32"
        engine, optimizer, *_ = deepspeed.initialize(model=net, config=cfg)
        assert isinstance(optimizer, DeepSpeedOptimizer)
        assert engine.custom_flag == "from the model"  # forwarded to the wrapped module
        assert engine.inp is net.inp  # submodules of the wrapped module too
        with pytest.raises(AttributeError, match="missing_attr"):
            engine.missing_attr  # noqa: B018
        assert engine.global_rank == dist.get_rank()
        assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
        assert engine.communication_data_type == torch.float32
        assert engine.zero_offload_optimizer() is None and engine.zero_offload_param() is None
        assert engine.get_mom() == [(0.8, 0.9)]
        assert engine.skipped_steps == 0
        # Upstream's config queries and attributes, answered from this config.
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        assert type(optimizer) is DeepSpeedZeroOptimizer_Stage3
        assert not optimizer.dynamic_loss_scale and optimizer.clip_grad == 0.0 and not optimizer.cpu_offload
        assert optimizer.partition_count == dist.get_world_size()
        assert dist.get_world_size(optimizer.dp_process_group) == dist.get_world_size()
        assert engine.client_optimizer is None and engine.client_lr_scheduler is None
        assert engine.optimizer_name() == "adam"  # lower-cased, as upstream
        assert engine.optimizer_params() == {"lr": 1e-3, "betas": [0.8, 0.9]}
        assert engine.scheduler_name() is None and engine.scheduler_params() is None
        assert engine.gradient_clipping() == 0.0 and engine.steps_per_print() == 10
        assert not engine.dynamic_loss_scale() and engine.loss_scale() == 0
        assert engine.get_batch_info() == (4, 4 // (2 * dist.get_world_size()), 2)
        assert engine.get_data_types() == (torch.float32, torch.float32)
        assert not engine.zero_cpu_offload() and not engine.zero_use_cpu_optimizer()
        assert engine.zero_reduce_bucket_size() == 500_000_000 == engine.zero_allgather_bucket_size()
        assert engine.zero_overlap_comm() is not None and engine.zero_contiguous_gradients() is not None
        assert engine.dp_world_size == dist.get_world_size() and engine.mp_world_size == 1
        assert dist.get_world_size(engine.data_parallel_group) == dist.get_world_size()
        assert engine.postscale_gradients() and engine.gradient_predivide_factor() == 1.0
        assert not engine.wall_clock_breakdown() and not engine.memory_breakdown()
        assert set(engine.module_state_dict()) == set(net.state_dict())
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible .* ZeRO stage 3"):
            with engine.no_sync():
                pass
        x = _rank_slice(_data(1)[0])
        engine.backward(_leaf_loss(engine, x[:1]))
        engine.step()
        assert not engine.was_step_applied()  # not an accumulation boundary
        engine.backward(_leaf_loss(engine, x[1:]))
        engine.step()
        assert engine.was_step_applied()
        persistent = [p for p in engine.module.parameters() if p.ds_persist]
        assert persistent and all(p.ds_status is ZeroParamStatus.AVAILABLE for p in persistent)
        engine.empty_partition_cache()
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        # ... and their gathered memory is gone too: no state keeps the buffer it was a view of
        assert all(p._zero_state.full_buffer is None for p in engine.module.parameters())
        engine.eval()
        with torch.no_grad():
            out = engine(x)  # gathered again on demand
        assert out.shape == (x.shape[0], 1)

    def test_moe_trains_under_zero3_like_plain_pytorch(self):
        from deepspeed.moe.layer import MoE

        class MoENet(nn.Module):
            def __init__(self):
                super().__init__()
                self.moe = MoE(
                    WIDTH, nn.Linear(WIDTH, WIDTH), num_experts=3, k=1, use_rts=False, drop_tokens=False
                )
                self.head = nn.Linear(WIDTH, 1)

            def forward(self, x):
                h, l_aux, _ = self.moe(x)
                return self.head(h).pow(2).mean() + 0.01 * l_aux

        data = [torch.randn(4, 3, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        reference = _reference_train(MoENet, data, lambda m, x: m(x))
        engine = _engine_train(MoENet, data, lambda m, x: m(x))
        _assert_same_params(engine, reference)
        # Upstream's tutorial: a client optimizer over groups with the experts split out.
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        torch.manual_seed(7)
        model = MoENet()
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"}
        )
        assert [g["name"] for g in groups] == ["dense", "ep_size_1"] and groups[1]["moe"]
        client = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=_cfg())
        for x in data:
            engine.backward(engine(_rank_slice(x)))
            engine.step()
        _assert_same_params(engine, reference)

    def test_pipeline_module_trains_like_sequential(self):
        from deepspeed.pipe import LayerSpec, PipelineModule

        def pipe():
            return PipelineModule(
                [LayerSpec(nn.Linear, WIDTH, 8), LayerSpec(nn.GELU), LayerSpec(nn.Linear, 8, 1)],
                num_stages=1,
                partition_method="uniform",  # seq()'s random draws
            )

        def seq():
            return nn.Sequential(nn.Linear(WIDTH, 8), nn.GELU(), nn.Linear(8, 1))

        data = _data(3, seed=9)
        reference = _reference_train(seq, data, _leaf_loss)
        engine = _engine_train(pipe, data, _leaf_loss)
        _assert_same_params(engine, reference)

    def test_skip_init_under_zero_init(self):
        init = deepspeed.zero.Init(config_dict_or_path=_cfg()).start()
        try:
            layer = torch.nn.utils.skip_init(nn.Linear, 4, 3)
            kept = nn.Linear(4, 3)
        finally:
            init.stop()
        # skip_init builds on meta, then to_empty: partitioned there, as upstream does.
        assert hasattr(layer.weight, "ds_id") and hasattr(layer.bias, "ds_id")
        assert hasattr(kept.weight, "ds_id")
        with deepspeed.zero.GatheredParameters([layer.weight, layer.bias], modifier_rank=0):
            with torch.no_grad():
                layer.weight.fill_(0.5)
                layer.bias.zero_()
        engine, *_ = deepspeed.initialize(model=layer, config=_cfg())
        assert engine.module.weight is layer.weight
        with deepspeed.zero.GatheredParameters(engine.module.weight):
            assert torch.all(engine.module.weight == 0.5)
        init = deepspeed.zero.Init(config_dict_or_path=_cfg()).start()
        try:
            meta = nn.Linear(4, 3, device="meta")
        finally:
            init.stop()
        assert meta.weight.is_meta and not hasattr(meta.weight, "ds_id")


# ============================================================================ HF transformers through HfDeepSpeedConfig


class TestHfLlamaUnderZeroInit(DistributedTest):
    world_size = [2]

    def test_llama_builds_partitioned_with_fp32_rope(self):
        os.environ["HF_HUB_OFFLINE"] = "1"
        transformers = pytest.importorskip("transformers")
        from transformers.integrations import HfDeepSpeedConfig

        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
        }
        keep = HfDeepSpeedConfig(cfg)  # noqa: F841 - transformers reads it through a weak reference
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert all(hasattr(p, "ds_id") and p.data.shape == torch.Size([0]) for p in model.parameters())
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE kept out of the bf16 cast
        assert next(model.parameters()).dtype == torch.bfloat16


def test_client_wrapper_without_target_device_still_binds(monkeypatch):
    """An older two-argument factory wrapper (no target_device keyword) is called as such."""
    import deepspeed.runtime.zero.partition_parameters as pp
    from deepspeed.runtime.zero.patching import ORIGINAL_FACTORIES, FactoryPatches

    seen = []

    def two_args(fn, dtype):
        seen.append(dtype)
        return fn

    patches = FactoryPatches()
    try:
        patches.bind(two_args, torch.bfloat16, torch.device("cpu"))
    finally:
        patches.unbind()
    assert len(seen) == len(ORIGINAL_FACTORIES)
    received = {}

    def with_device(fn, dtype, **kwargs):
        received.update(kwargs)
        return pp.zero_wrapper_for_fp_tensor_constructor(fn, dtype, **kwargs)

    try:
        patches.bind(with_device, torch.bfloat16, torch.device("cpu"))
        assert torch.zeros(2).dtype == torch.bfloat16
    finally:
        patches.unbind()
    assert received == {"target_device": torch.device("cpu")}
