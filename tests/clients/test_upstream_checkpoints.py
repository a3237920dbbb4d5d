"""Checkpoints written by upstream DeepSpeed 0.19.8 load here on another number of ranks.

The fixtures in tests/fixtures/upstream/ were written by upstream itself, in its own virtual
environment (`make_fixtures.py` there says how), on 1 and 2 CPU ranks, in fp32 and bf16. Each
holds upstream's own consolidation of the save (`get_fp32_state_dict_from_zero_checkpoint`)
and every parameter's fp32 master after one more step on a batch every rank saw. Here the same
`TinyNet` loads each of them on 1 and 2 ranks (1 -> 1, 1 -> 2, 2 -> 1, 2 -> 2):

- the gathered weights equal upstream's consolidated ones exactly (bf16: the weights are the
  fp32 masters cast), the buffers and client state come back, the step counters too;
- one more step on the same batch gives upstream's loss and learning rate, and the weights
  plain PyTorch AdamW computes from the moments, step count and hyperparameters in upstream's
  files (so all of them were restored); re-saved by our engine, consolidated by our
  `zero_to_fp32`. (Upstream's own step from that state lands up to 4e-3 away from plain
  PyTorch's at lr 1e-2, in its continuing run and in its own resume alike, so its recorded
  `after_step` weights are kept in the fixture but not compared.);
- our `zero_to_fp32` reads the upstream folders directly, with no process group.

Upstream's stage 1 (fp32) and stage 2 (bf16) saves on 2 ranks, in its stage 0-2 layout, load
here on 1 and 2 ranks at their own stage and at stage 3, with the same checks (upstream's own
step after its resume is the same distance from plain PyTorch's as at stage 3, so the next
step is again checked against plain PyTorch from the moments in upstream's files).

When benchmarks/.venv-upstream exists, upstream's own `zero_to_fp32` also reads a checkpoint
written by this package (the other direction); without it that test is skipped.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "upstream")
UPSTREAM_PYTHON = os.path.join(REPO, "benchmarks", ".venv-upstream", "bin", "python")
NAMES = ("fp32_ws1", "fp32_ws2", "bf16_ws1", "bf16_ws2")
# Upstream's stage 0-2 layout (one model file, flat per-group fp32 partitions), saved on 2 ranks.
REPLICATED_NAMES = ("fp32_ws2_stage1", "bf16_ws2_stage2")


def saving_ranks(name: str) -> int:
    return int(name.split("_")[1][len("ws") :])


def saved_stage(name: str) -> int:
    return int(name.split("stage")[1]) if "stage" in name else 3


def fixture_module():
    """make_fixtures.py, imported by path: TinyNet, config, trainable, TAG, TRAIN_STEPS."""
    spec = importlib.util.spec_from_file_location(
        "upstream_make_fixtures", os.path.join(FIXTURES, "make_fixtures.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference(name: str) -> dict:
    return torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=True)


def build(fx, dtype: str, stage: int = 3):
    import deepspeed

    cfg = fx.config(dtype, stage)
    torch.manual_seed(99)  # other initial weights than upstream's: all must come from the file
    model = fx.build(cfg)  # under zero.Init at stage 3 only, with this package's deepspeed
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=fx.trainable(model), config=cfg)
    return engine


def gathered(module: torch.nn.Module) -> dict:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return {n: p.data.detach().clone() for n, p in module.named_parameters()}


def with_frozen_weights(name: str, consolidated: dict) -> dict:
    """Upstream's consolidation, plus the frozen weights its stage-1 save leaves out of it.

    At stage 1 upstream writes no `frozen_param_shapes`, and its `zero_to_fp32` then omits the
    frozen `norm.weight`; the weight is in the model file's module, which is where ours reads
    it from (at stage 2 upstream records it, and both include it).
    """
    if "norm.weight" in consolidated or saved_stage(name) == 3:
        return consolidated
    from deepspeed.checkpoint.safe_load import load_checkpoint_file

    fx = fixture_module()
    model_sd = load_checkpoint_file(os.path.join(FIXTURES, name, fx.TAG, "mp_rank_00_model_states.pt"))
    return {**consolidated, "norm.weight": model_sd["module"]["norm.weight"].float()}


def check_loaded(engine, ref: dict, name: str, client_state: dict, fx) -> None:
    expected = with_frozen_weights(name, ref["consolidated"])
    got = gathered(engine.module)
    assert set(got) | {"out.weight"} == set(expected) - {"temperature"}, name
    for key, value in got.items():
        want = expected[key].to(value.dtype)  # bf16: the fp32 masters, cast as the step casts them
        assert torch.equal(value, want), f"{name}: {key}"
    assert torch.equal(expected["out.weight"], expected["embed.weight"])  # tied in upstream's output
    assert torch.equal(engine.module.temperature.float(), expected["temperature"])
    assert client_state == ref["client_state"], name
    assert engine.global_steps == fx.TRAIN_STEPS
    assert engine.global_samples == 2 * saving_ranks(name) * fx.TRAIN_STEPS  # micro batch 2 per saving rank


def saved_moments(name: str, fx) -> tuple:
    """`(trainable names, {name: {exp_avg, exp_avg_sq}}, step, hyperparameters)` read straight
    from upstream's rank files by `param_shapes` order (the flat layouts of upstream.py's
    notes): stage 3 concatenates each parameter's shard per rank; stages 0-2 cut the group's
    flat vector, whose equal parts the ranks hold, parameter after parameter."""
    from deepspeed.checkpoint.safe_load import load_checkpoint_file
    from deepspeed.checkpoint.upstream import upstream_optim_path

    tag_dir = os.path.join(FIXTURES, name, fx.TAG)
    ranks = saving_ranks(name)
    replicated = saved_stage(name) < 3
    model_file = "mp_rank_00_model_states.pt" if replicated else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model_sd = load_checkpoint_file(os.path.join(tag_dir, model_file))
    zero_sds = [
        load_checkpoint_file(upstream_optim_path(tag_dir, r))["optimizer_state_dict"] for r in range(ranks)
    ]
    shapes = model_sd["param_shapes"][0]
    names = list(shapes)
    torch_sd = zero_sds[0]["base_optimizer_state" if replicated else "optimizer_state_dict"]
    moments = {n: {} for n in names}
    for key in ("exp_avg", "exp_avg_sq"):
        key_of = "base_optimizer_state" if replicated else "optimizer_state_dict"
        if replicated:
            flat = torch.cat([z[key_of]["state"][0][key] for z in zero_sds])
            start = 0
            for n in names:
                numel = math.prod(shapes[n])
                moments[n][key] = flat[start : start + numel].view(shapes[n]).clone()
                start += numel
        else:
            start = 0
            for n in names:
                numel = math.prod(shapes[n])
                size = -(-numel // ranks)  # each rank's shard, padding included
                flat = torch.cat([z[key_of]["state"][0][key][start : start + size] for z in zero_sds])
                moments[n][key] = flat[:numel].view(shapes[n]).clone()
                start += size
    group = torch_sd["param_groups"][0]
    hyper = {k: v for k, v in group.items() if k in ("lr", "betas", "eps", "weight_decay")}
    return names, moments, torch_sd["state"][0]["step"].clone(), hyper


def plain_next_step(name: str, ref: dict, fx) -> dict:
    """The extra step in plain PyTorch from upstream's files: AdamW with the saved moments, step
    count, hyperparameters and learning rate (`saved_moments`), on the consolidated weights."""
    names, moments, step, hyper = saved_moments(name, fx)
    consolidated = with_frozen_weights(name, ref["consolidated"])
    model = fx.TinyNet()
    model.load_state_dict(consolidated, strict=False)
    if name.startswith("bf16"):
        model = model.to(torch.bfloat16)  # the gradient as the bf16 model computes it
    params = dict(model.named_parameters())
    ids, targets = ref["batches"][fx.TRAIN_STEPS]
    model(ids, targets).backward()
    masters = {n: consolidated[n].detach().clone().requires_grad_(True) for n in names}
    for n in names:
        masters[n].grad = params[n].grad.float()
    # Upstream clips at 1.0 unless the config says otherwise (the fixtures' config does not).
    clip = fx.config("fp32").get("gradient_clipping", 1.0)
    torch.nn.utils.clip_grad_norm_([masters[n] for n in names], clip)
    opt = torch.optim.AdamW([masters[n] for n in names], **hyper)
    for n in names:
        opt.state[masters[n]] = {**moments[n], "step": step.clone()}
    opt.step()
    return {n: m.detach() for n, m in masters.items()}


def check_next_step(engine, ref: dict, name: str, save_dir: str, fx, bf16: bool) -> None:
    """One more step from the loaded state equals plain PyTorch's from upstream's files; saved
    by us and consolidated by our zero_to_fp32."""
    from deepspeed import comm as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ids, targets = ref["batches"][fx.TRAIN_STEPS]
    loss = engine(ids, targets)
    engine.backward(loss)
    engine.step()
    assert float(loss.detach()) == pytest.approx(ref["resumed_loss"], rel=1e-2 if bf16 else 1e-6)
    assert engine.get_lr() == pytest.approx(ref["lr_after_resume_step"])
    engine.save_checkpoint(save_dir)
    if dist.get_rank() == 0:
        ours = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        tol = dict(rtol=0, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
        for key, value in plain_next_step(name, ref, fx).items():
            torch.testing.assert_close(ours[key], value, **tol, msg=lambda m, k=key, n=name: f"{n}: {k}: {m}")
    dist.barrier()


class TestUpstreamCheckpoints(DistributedTest):
    world_size = [1, 2]

    def test_load_on_any_number_of_ranks(self, tmp_path):
        fx = fixture_module()
        for name in NAMES:
            dtype = name.split("_")[0]
            ref = reference(name)
            engine = build(fx, dtype)
            path, client_state = engine.load_checkpoint(os.path.join(FIXTURES, name))
            assert path is not None and path.endswith("_model_states.pt"), name
            check_loaded(engine, ref, name, client_state, fx)
            check_next_step(engine, ref, name, str(tmp_path / f"resaved_{name}"), fx, dtype == "bf16")
            engine.destroy()


class TestUpstreamStage0To2Checkpoints(DistributedTest):
    """Upstream's stage 1 and 2 saves (2 ranks) resume here on 1 and 2 ranks, at the saved stage
    and at stage 3, with the same checks as the stage-3 saves above."""

    world_size = [1, 2]

    def test_resume_like_upstream(self, tmp_path):
        fx = fixture_module()
        for name in REPLICATED_NAMES:
            dtype, ref = name.split("_")[0], reference(name)
            bf16 = dtype == "bf16"
            for stage in (saved_stage(name), 3):
                engine = build(fx, dtype, stage)
                path, client_state = engine.load_checkpoint(os.path.join(FIXTURES, name))
                assert path is not None, name
                check_loaded(engine, ref, name, client_state, fx)
                check_next_step(engine, ref, name, str(tmp_path / f"resaved_{name}_stage{stage}"), fx, bf16)
                engine.destroy()


@pytest.mark.parametrize("name", NAMES + REPLICATED_NAMES)
def test_zero_to_fp32_reads_upstream_folders(name, tmp_path):
    from deepspeed.utils import zero_to_fp32

    expected = with_frozen_weights(name, reference(name)["consolidated"])
    state_dict = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, name))
    assert set(state_dict) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state_dict[key], value), key
    out = tmp_path / "model.bin"
    assert zero_to_fp32.main([os.path.join(FIXTURES, name), str(out)]) == 0
    assert set(torch.load(out, weights_only=True)) == set(expected)


def test_upstream_pickled_classes_load_as_plain_data():
    from deepspeed.checkpoint.safe_load import load_checkpoint_file

    tag_dir = os.path.join(FIXTURES, "bf16_ws2", "global_step3")
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(
        os.path.join(tag_dir, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in unsafe  # what upstream pickles
    sd = load_checkpoint_file(os.path.join(tag_dir, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    zero_sd = sd["optimizer_state_dict"]
    assert type(zero_sd["zero_stage"]) is int and zero_sd["zero_stage"] == 3
    assert zero_sd["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}


class _Planted:
    """Pickles as a call of `os.system("touch <marker>")`, as a malicious file's entry would."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_a_planted_upstream_file_is_refused_by_the_same_allowlist(tmp_path):
    """Upstream's LossScaler / ZeroStageEnum pass as plain data; anything else is refused, unrun."""
    import shutil

    from deepspeed.checkpoint.errors import UnsafeCheckpointError
    from deepspeed.utils import zero_to_fp32

    folder = tmp_path / "bf16_ws2"
    shutil.copytree(os.path.join(FIXTURES, "bf16_ws2"), folder)
    marker = tmp_path / "MARKER"
    path = folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(path, weights_only=True)
    sd["planted"] = _Planted(str(marker))  # beside the client state, where a hub file would put it
    torch.save(sd, path)
    with pytest.raises(UnsafeCheckpointError) as info:
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder))
    message = str(info.value)
    assert str(path) in message and f"{os.system.__module__}.system" in message, message
    assert "LossScaler" not in message  # upstream's own classes are allowlisted as stand-ins
    assert zero_to_fp32.main([str(folder), str(tmp_path / "out.bin")]) == 1
    assert not marker.exists() and not (tmp_path / "out.bin").exists()


def test_a_stage_2_or_foreign_file_is_refused_by_name(tmp_path):
    from deepspeed.checkpoint.errors import CheckpointError
    from deepspeed.checkpoint.sharded import ShardedCheckpoint

    tag = tmp_path / "t"
    tag.mkdir()
    torch.save({"hello": 1}, tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_model_states.pt: not a sharded"):
        ShardedCheckpoint.open(str(tag))


@pytest.mark.parametrize("name", ["fp32_ws2", "fp32_ws2_stage1"])
def test_upstream_counters_come_across(name):
    """Upstream's `skipped_steps` (fp16 overflows) is the engine's count after a load, at every stage."""
    from deepspeed.checkpoint.safe_load import load_checkpoint_file
    from deepspeed.checkpoint.upstream import (
        normalize_upstream,
        stage_0_to_2_as_stage_3,
        upstream_optim_path,
    )

    fx = fixture_module()
    tag = os.path.join(FIXTURES, name, fx.TAG)
    optim_paths = [upstream_optim_path(tag, r) for r in range(2)]
    optim_sds = [load_checkpoint_file(path) for path in optim_paths]
    if saved_stage(name) == 3:
        model_sds = [
            load_checkpoint_file(os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
            for r in range(2)
        ]
    else:
        model_sd = load_checkpoint_file(os.path.join(tag, "mp_rank_00_model_states.pt"))
        model_sds, optim_sds = stage_0_to_2_as_stage_3(model_sd, optim_sds, optim_paths)
    for sd in model_sds:
        sd["skipped_steps"] = 3  # as an fp16 run that overflowed three times writes it
    model_states, _ = normalize_upstream(tag, model_sds, optim_sds, [(p, p) for p in optim_paths])
    assert [m["skipped_steps"] for m in model_states] == [3, 3]
    assert [m["global_steps"] for m in model_states] == [fx.TRAIN_STEPS] * 2


def test_round_robin_saves_are_read_in_the_recorded_order():
    """Upstream writes `param_shapes` and the alignment paddings in the flat (round-robin) order, so
    a save made with `round_robin_gradients` reads like any other (as upstream's zero_to_fp32 does)."""
    from deepspeed.checkpoint.safe_load import load_checkpoint_file
    from deepspeed.checkpoint.upstream import stage_0_to_2_as_stage_3, upstream_optim_path

    fx = fixture_module()
    tag = os.path.join(FIXTURES, "fp32_ws2_stage1", fx.TAG)
    model_sd = load_checkpoint_file(os.path.join(tag, "mp_rank_00_model_states.pt"))
    model_sd["ds_config"]["zero_optimization"]["round_robin_gradients"] = True
    paths = [upstream_optim_path(tag, r) for r in range(2)]
    model_sds, optim_sds = stage_0_to_2_as_stage_3(model_sd, [load_checkpoint_file(p) for p in paths], paths)
    assert len(model_sds) == len(optim_sds) == 2


def test_an_upstream_stage_0_save_is_named(tmp_path):
    from deepspeed.checkpoint.errors import CheckpointError
    from deepspeed.checkpoint.sharded import ShardedCheckpoint
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # Upstream's stage 0: one file with the whole module and torch optimizer state, no ZeRO files.
    tag = tmp_path / "global_step1"
    tag.mkdir()
    model = {
        "module": {"w": torch.zeros(2)},
        "optimizer": {"state": {}, "param_groups": []},
        "param_shapes": None,
    }
    torch.save({**model, "dp_world_size": 2, "mp_world_size": 1}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="stage-0 layout .* load its 'module' state dict"):
        ShardedCheckpoint.open(str(tag))
    with pytest.raises(CheckpointError, match="stage-0 layout"):
        get_fp32_state_dict_from_zero_checkpoint(str(tag))  # a tag folder without `latest` above it


def test_zero_to_fp32_takes_an_upstream_stage_0_to_2_tag_folder():
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fx = fixture_module()
    expected = with_frozen_weights("fp32_ws2_stage1", reference("fp32_ws2_stage1")["consolidated"])
    got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, "fp32_ws2_stage1", fx.TAG))
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())


def test_an_upstream_stage_0_to_2_folder_missing_a_rank_names_it(tmp_path):
    import shutil

    from deepspeed.checkpoint.errors import CheckpointError
    from deepspeed.checkpoint.sharded import ShardedCheckpoint

    fx = fixture_module()
    tag = tmp_path / fx.TAG
    shutil.copytree(os.path.join(FIXTURES, "fp32_ws2_stage1", fx.TAG), tag)
    os.remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"stage 0-2 checkpoint of 2 ranks without .* rank\(s\) \[1\]"):
        ShardedCheckpoint.open(str(tag))


class _SaveOurs(DistributedTest):
    """Not collected: run by the test below at world size 2."""

    world_size = 2

    def test_save(self, path):
        fx = fixture_module()
        engine = build(fx, "fp32")
        for ids, targets in fx.make_batches(2):
            engine.backward(engine(ids, targets))
            engine.step()
        engine.save_checkpoint(path, client_state={"epoch": 1})


@pytest.mark.skipif(not os.path.exists(UPSTREAM_PYTHON), reason="no benchmarks/.venv-upstream")
def test_upstream_zero_to_fp32_reads_our_checkpoint(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tests.unit.common import _run_distributed

    ckpt = str(tmp_path / "ours")
    _run_distributed(_SaveOurs, "test_save", 2, {"path": ckpt})
    out = str(tmp_path / "upstream_consolidated.bin")
    script = (
        "import sys, torch\n"
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as get\n"
        "torch.save(dict(get(sys.argv[1])), sys.argv[2])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(
        [UPSTREAM_PYTHON, "-c", script, ckpt, out], env=env, cwd=str(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(out, weights_only=True)
    ours = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert set(theirs) == set(ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
