"""HF transformers on our ZeRO-3, 2 CPU ranks: construction, resize, loading, generation.

Each case builds the same tiny model twice, plainly and under ZeRO-3 (`HfDeepSpeedConfig`
makes transformers enter `deepspeed.zero.Init`), and compares the gathered parameters or the
outputs with the plain model's.
"""

import pytest
import torch

from tests.clients import helpers
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

# Threshold 0: no parameter of these tiny models stays whole as "persistent" after initialize.
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
MODELS = {"llama": helpers.tiny_llama_config, "gpt2": helpers.tiny_gpt2_config}


def _plain_and_zero3(make_config, seed=0):
    """(plain model, ZeRO-3 model, HfDeepSpeedConfig keeping ZeRO-3 on) built from one seed."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(seed)
    plain = AutoModelForCausalLM.from_config(make_config())
    hf_ds = HfDeepSpeedConfig(dict(ZERO3))
    torch.manual_seed(seed)
    zero = AutoModelForCausalLM.from_config(make_config())
    return plain, zero, hf_ds


class TestTransformers(DistributedTest):
    world_size = 2

    def test_from_config_partitions_every_parameter(self):
        helpers.reset_clients()
        for name, make_config in MODELS.items():
            plain, zero, hf_ds = _plain_and_zero3(make_config)
            plain_shapes = {n: p.shape for n, p in plain.named_parameters()}
            zero_params = dict(zero.named_parameters())
            assert sorted(zero_params) == sorted(plain_shapes), name
            for pname, param in zero_params.items():
                assert hasattr(param, "ds_id"), f"{name}.{pname} was not partitioned"
                assert param.ds_numel == plain_shapes[pname].numel(), f"{name}.{pname}: ds_numel"
                assert tuple(param.ds_shape) == tuple(plain_shapes[pname]), f"{name}.{pname}: ds_shape"
                assert param.data.numel() == 0, f"{name}.{pname}: data not empty"
            del hf_ds
            helpers.reset_clients()

    def test_resize_token_embeddings_keeps_old_rows(self):
        import deepspeed

        helpers.reset_clients()
        for name, make_config in MODELS.items():
            _, zero, hf_ds = _plain_and_zero3(make_config)
            before = helpers.full_params(zero)
            zero.resize_token_embeddings(helpers.VOCAB + 8)
            after = helpers.full_params(zero)
            assert zero.config.vocab_size == helpers.VOCAB + 8, name
            emb = "model.embed_tokens.weight" if name == "llama" else "transformer.wte.weight"
            resized = [emb] + (["lm_head.weight"] if name == "llama" else [])
            for pname in resized:
                assert after[pname].shape[0] == helpers.VOCAB + 8, f"{name}.{pname} not resized"
                assert torch.equal(after[pname][: helpers.VOCAB], before[pname]), (
                    f"{name}.{pname}: old rows changed"
                )
            for pname in set(before) - set(resized):
                assert torch.equal(after[pname], before[pname]), f"{name}.{pname} changed"
            # transformers swaps in a plain, whole embedding (as upstream), whose new rows each
            # rank drew for itself; the engine partitions it, keeping rank 0's values.
            engine, *_ = deepspeed.initialize(model=zero, config=dict(ZERO3))
            for pname, param in engine.module.named_parameters():
                assert param.data.numel() == 0, f"{name}.{pname} not partitioned by initialize"
            for tensor in after.values():
                deepspeed.comm.broadcast(tensor, src=0)
            helpers.assert_same_tensors(helpers.full_params(engine.module), after, f"{name} after initialize")
            del engine, hf_ds
            helpers.reset_clients()

    def test_from_pretrained_of_plain_save(self, tmp_path):
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        helpers.reset_clients()
        for name, make_config in MODELS.items():
            torch.manual_seed(1)
            plain = AutoModelForCausalLM.from_config(make_config())
            path = tmp_path / name
            if helpers.rank() == 0:
                plain.save_pretrained(path)
            helpers.barrier()
            hf_ds = HfDeepSpeedConfig(dict(ZERO3))
            zero = AutoModelForCausalLM.from_pretrained(path)
            assert all(p.data.numel() == 0 for p in zero.parameters()), f"{name}: not partitioned"
            expected = {n: p.detach().float() for n, p in plain.named_parameters()}
            helpers.assert_same_tensors(helpers.full_params(zero), expected, f"{name} from_pretrained")
            del hf_ds
            helpers.reset_clients()

    def test_generate_synced_gpus_with_unequal_ranks(self):
        """Rank 0 and rank 1 ask for different prompt lengths and token counts; both finish,
        and each rank's greedy output equals the plain model's."""
        import deepspeed

        helpers.reset_clients()
        for name, make_config in MODELS.items():
            plain, zero, hf_ds = _plain_and_zero3(make_config, seed=2)
            weights = helpers.full_params(zero)  # the plain model takes ZeRO's weights, whatever Init did
            with torch.no_grad():
                for pname, param in plain.named_parameters():
                    param.copy_(weights[pname])
            engine, *_ = deepspeed.initialize(model=zero, config=dict(ZERO3))
            engine.module.eval()
            plain.eval()
            r = helpers.rank()
            prompt = torch.arange(3 + 2 * r).unsqueeze(0) % helpers.VOCAB + 1
            kwargs = dict(max_new_tokens=3 + 4 * r, do_sample=False, pad_token_id=0, eos_token_id=None)
            with torch.no_grad():
                got = engine.module.generate(prompt, synced_gpus=True, **kwargs)
                want = plain.generate(prompt, **kwargs)
            assert got.shape == want.shape, (
                f"{name}: rank {r} got {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            assert torch.equal(got, want), f"{name}: rank {r} generated {got.tolist()}, plain {want.tolist()}"
            del engine, hf_ds
            helpers.reset_clients()
