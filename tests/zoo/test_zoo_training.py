"""Model zoo, training features: checkpointing, optimizers, accumulation, clipping, nested use.

All methods run in one pooled 2-rank group. Numbers per case go to the results file
(see tests/zoo/harness.py).
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.unit.common import DistributedTest, fit_world_size
from tests.zoo import models as zm
from tests.zoo.harness import (
    SEED,
    Case,
    Run,
    build,
    check_parity,
    compare,
    device,
    gathered,
    initialize,
    max_abs_diff,
    on_device,
    record,
    recorded,
    run_engine,
    run_reference,
    zero_config,
)

pytestmark = pytest.mark.zoo
# Cases whose parameters are not built under zero.Init nor edited through GatheredParameters
# run at each stage (stages 1-2 keep full parameters), with and without optimizer offload.
ALL_STAGES = pytest.mark.parametrize("stage", [1, 2, 3])
AND_OFFLOAD = pytest.mark.parametrize("offload", [False, True])


def token_mlp_case(name, **kwargs) -> Case:
    return Case(name, kwargs.pop("build", zm.TokenMLP), zm.token_batch, zm.lm_loss, **kwargs)


def initial_params(case: Case) -> dict:
    return {n: p.detach().cpu().clone() for n, p in build(case, zero=False).named_parameters()}


def head_only(model):
    return torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)


def decay_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "lr": 0.05, "weight_decay": 0.1},
        {"params": no_decay, "lr": 0.2, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def eval_and_generate(model, step):
    """An eval forward and a greedy `generate`, called on the module directly, between steps."""
    ids = on_device(torch.arange(2, 2 + 2 * zm.SEQ).reshape(2, zm.SEQ) % zm.VOCAB)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    return torch.cat([logits.flatten().float(), tokens.flatten().float()])


class TestZooTraining(DistributedTest):
    world_size = fit_world_size(2)  # one rank on a one-GPU machine
    timeout_s = 240.0

    @ALL_STAGES
    def test_activation_checkpoint_reentrant(self, stage):
        build_fn = lambda: zm.TokenMLP(use_reentrant=True)  # noqa: E731
        check_parity(token_mlp_case("act_ckpt_reentrant", build=build_fn, steps=4, stage=stage))

    @ALL_STAGES
    @AND_OFFLOAD
    def test_activation_checkpoint_non_reentrant(self, stage, offload):
        build_fn = lambda: zm.TokenMLP(use_reentrant=False)  # noqa: E731
        check_parity(
            token_mlp_case("act_ckpt_non_reentrant", build=build_fn, steps=4, stage=stage, offload=offload)
        )

    @ALL_STAGES
    @AND_OFFLOAD
    def test_frozen_parameters(self, stage, offload):
        case = token_mlp_case("frozen_params", build=zm.frozen_token_mlp, stage=stage, offload=offload)
        got, _ = check_parity(case)
        init, final = initial_params(case), gathered(got.model)
        frozen = [n for n, p in got.model.named_parameters() if not p.requires_grad]
        assert frozen and all(torch.equal(final[n], init[n]) for n in frozen)

    @ALL_STAGES
    @AND_OFFLOAD
    def test_client_optimizer_on_a_subset(self, stage, offload):
        case = token_mlp_case("client_optimizer_subset", optimizer=head_only, stage=stage, offload=offload)
        got, _ = check_parity(case)
        init, final = initial_params(case), gathered(got.model)
        moved = [n for n in init if not n.startswith("head.") and not torch.equal(final[n], init[n])]
        assert not moved, f"parameters outside the client optimizer changed: {moved}"
        assert not torch.equal(final["head.weight"], init["head.weight"])
        # parameters no optimizer holds must not keep a full gradient around
        kept = [n for n, p in got.model.named_parameters() if p.grad is not None]
        assert not kept, f"full .grad kept on {kept}"

    @ALL_STAGES
    @AND_OFFLOAD
    def test_two_param_groups_lr_and_weight_decay(self, stage, offload):
        got, _ = check_parity(
            token_mlp_case("two_param_groups", optimizer=decay_groups, stage=stage, offload=offload)
        )
        lrs = sorted(g["lr"] for g in got.engine.optimizer.param_groups)
        assert lrs == [0.05, 0.2]

    @ALL_STAGES
    @AND_OFFLOAD
    def test_gradient_accumulation_2(self, stage, offload):
        got, _ = check_parity(token_mlp_case("grad_accum_2", gas=2, stage=stage, offload=offload))
        assert got.engine.global_steps == 3 and got.engine.micro_steps == 6

    @ALL_STAGES
    def test_gradient_accumulation_4(self, stage):
        got, _ = check_parity(token_mlp_case("grad_accum_4", gas=4, stage=stage))
        assert got.engine.global_steps == 3 and got.engine.micro_steps == 12

    @ALL_STAGES
    @AND_OFFLOAD
    def test_gradient_clipping(self, stage, offload):
        case = token_mlp_case("grad_clipping", clip=0.05, stage=stage, offload=offload)
        got, ref = check_parity(case)
        assert min(ref.grad_norms) > case.clip  # clipping triggered at every step
        torch.testing.assert_close(
            torch.tensor(got.grad_norms), torch.tensor(ref.grad_norms), rtol=1e-4, atol=0
        )

    @ALL_STAGES
    def test_eval_and_generate_between_steps(self, stage):
        case = Case(
            "eval_generate_between",
            zm.gpt2,
            zm.token_batch,
            zm.hf_causal_loss,
            between=eval_and_generate,
            stage=stage,
        )
        check_parity(case)

    def test_teacher_engine_inside_student_forward(self):
        case = Case("teacher_in_student", None, zm.token_batch, lambda m, b: m(*b))
        with recorded(case.name):
            data = case.micro_batches(dist.get_world_size())
            teachers = []
            for _copy in ("reference", "engine"):
                torch.manual_seed(7)
                teachers.append(zm.TokenMLP(blocks=1))
            # an inference engine: no optimizer in the config, none passed
            teacher_engine, opt, _, _ = deepspeed.initialize(model=teachers[1], config=zero_config(micro=2))
            assert opt is None
            torch.manual_seed(SEED)
            # the student keeps its teacher out of its children: move it too
            ref = run_reference(case, data, model=zm.Student(teachers[0].to(device())))
            torch.manual_seed(SEED)
            got = run_engine(case, data, engine=initialize(case, zm.Student(teacher_engine)))
            compare(case, got, ref)
            t_ref = {n: p.detach() for n, p in teachers[0].named_parameters()}
            diff, where = max_abs_diff(gathered(teacher_engine.module), t_ref)
            assert diff == 0, f"the teacher changed: {where} by {diff}"

    def test_gathered_parameters_held_across_step(self):
        """A gather started before step() sees the updated values after it, and so does the next forward."""
        snapshots = []

        def snapshot(model, step):
            snapshots.append({n: p.detach().clone().float() for n, p in model.named_parameters()})

        case = token_mlp_case("gather_across_step", between=snapshot)
        with recorded(case.name):
            rank = dist.get_rank()
            data = case.micro_batches(dist.get_world_size())
            ref = run_reference(case, data)
            engine = initialize(case, build(case, zero=True))
            module, losses, held_diffs = engine.module, [], []
            held = None
            for s, step in enumerate(data):
                loss = case.loss_fn(engine, on_device(step[0][rank]))
                losses.append(loss.item())
                engine.backward(loss)
                if s == 1:
                    held = deepspeed.zero.GatheredParameters(list(module.parameters())).start()
                engine.step()
                if held is not None:  # steps 1 and 2 run while the gather is held
                    now = {n: p.detach().clone().float() for n, p in module.named_parameters()}
                    held_diffs.append(max_abs_diff(now, snapshots[s]))
                if s == 2:
                    held.stop()
                    held = None
            got = Run(
                module, losses, {n: b.detach().clone() for n, b in module.named_buffers()}, engine=engine
            )
            worst = max(held_diffs)
            record(case.name + ":held", "ok" if worst[0] <= 5e-5 else "FAIL", held_param=worst[0])
            compare(case, got, ref)
            assert worst[0] <= 5e-5, (
                f"gathered values after step() are stale: {worst[1]} off by {worst[0]:.3g}"
            )

    def test_bf16_edit_then_save_without_step(self, tmp_path):
        """An edit written back after some steps reaches the checkpoint, zero_to_fp32, the 16-bit
        model and a fresh engine that loads the checkpoint, with no step in between."""
        case = token_mlp_case(
            "bf16_edit_save",
            bf16=True,
            config_extra={"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}},
        )
        with recorded(case.name):
            rank = dist.get_rank()
            ckpt, out16 = str(tmp_path / "ckpt"), str(tmp_path / "model16")
            data = case.micro_batches(dist.get_world_size())
            engine = run_engine(case, data[:2]).engine
            head = engine.module.head
            with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=0):
                if rank == 0:
                    head.weight.data[0].fill_(0.25)  # exact in bf16
            engine.save_checkpoint(ckpt)
            engine.save_16bit_model(out16)
            dist.barrier()
            live = gathered(engine.module)
            fp32 = {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt).items()}
            sd16 = {k: v.float() for k, v in torch.load(f"{out16}/pytorch_model.bin").items()}
            torch.manual_seed(SEED + 1)  # different initial weights: the load must overwrite them
            fresh = deepspeed.initialize(model=case.build(), config=case.config())[0]
            fresh.load_checkpoint(ckpt)
            loaded = gathered(fresh.module)
            names = list(live)
            views = {"zero_to_fp32": fp32, "save_16bit_model": sd16, "load_checkpoint": loaded}
            edits = {
                k: v["head.weight"][0].eq(0.25).all().item() for k, v in views.items() if "head.weight" in v
            }
            # bf16 values against the fp32 master: at most half a bf16 ulp (2^-9 relative) apart
            diffs = {k: max_abs_diff({n: live[n] for n in names}, v)[0] for k, v in views.items()}
            ids, _ = on_device(data[2][0][rank])
            with torch.no_grad():
                same_loss = abs(engine(ids).float().sum().item() - fresh(ids).float().sum().item())
            record(case.name, "ok", **{f"{k}_vs_live": v for k, v in diffs.items()}, next_fwd=same_loss)
            assert edits == dict.fromkeys(views, True), f"the edit is missing from: {edits}"
            assert diffs["save_16bit_model"] == 0 and diffs["load_checkpoint"] == 0, diffs
            assert diffs["zero_to_fp32"] <= 2**-8, diffs
            assert same_loss == 0
