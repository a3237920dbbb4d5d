"""Tiny models for the zoo, each with a micro-batch maker and a loss function.

Every builder takes no arguments and draws its initial weights from torch's global RNG, so
`torch.manual_seed(s); build()` twice gives two identical copies. The HF models come from
configs written here (no downloads), with dropout off and eager attention.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
WIDTH = 32
SEQ = 8
CLASSES = 10


# ----------------------------------------------------------------------------- micro-batches


def token_batch(gen: torch.Generator, rows: int = 2) -> tuple:
    """(ids, next-token labels): random tokens in [2, VOCAB), 0 and 1 kept for pad / eos."""
    ids = torch.randint(2, VOCAB, (rows, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def padded_token_batch(gen: torch.Generator, rows: int = 2) -> tuple:
    """Token batch whose ids contain the padding id 0 in a random quarter of the positions."""
    ids, labels = token_batch(gen, rows)
    pad = torch.rand(ids.shape, generator=gen) < 0.25
    return ids.masked_fill(pad, 0), labels


def image_batch(gen: torch.Generator, rows: int = 4) -> tuple:
    return torch.randn(rows, 3, 8, 8, generator=gen), torch.randint(0, CLASSES, (rows,), generator=gen)


def lm_loss(model, batch) -> torch.Tensor:
    """Loss of a model that maps ids to [rows, seq, VOCAB] logits."""
    ids, labels = batch
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def classifier_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# ----------------------------------------------------------------------------- ResNet-style CNN


class BasicBlock(nn.Module):
    """torchvision's BasicBlock shape: in-place ReLU and `out += identity` on a hooked output."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


# ----------------------------------------------------------------------------- ViT-style


class ViTBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.heads = 2

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """timm's ViT habit: the parent's `__init__` re-initialises its children's weights."""

    def __init__(self) -> None:
        super().__init__()
        dim, patches = WIDTH, 4
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, dim))
        self.blocks = nn.Sequential(ViTBlock(dim), ViTBlock(dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)
        nn.init.trunc_normal_(self.pos_embed, std=0.2)
        nn.init.trunc_normal_(self.cls_token, std=0.2)
        for module in self.modules():  # children's parameters, written after they were built
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.2)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.normal_(module.bias, std=0.1)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


# ----------------------------------------------------------------------------- torch layers


class MHAModel(nn.Module):
    """nn.MultiheadAttention reads its `out_proj` child's weight without calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        mask = torch.triu(
            torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device), diagonal=1
        )
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return self.head(self.norm(h + a))


class DoraLikeModel(nn.Module):
    """A parent that reads its children's weights before (or without) calling them, as peft's
    DoRA does: an identity sized by `down.weight.shape[1]` is run through `down` and `up`, and
    the head's weight is used through `.T`. Under ZeRO-3 the children are partitioned when
    the parent's forward starts (parameter.py's note on parameters used outside their module)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.down = nn.Linear(WIDTH, 4, bias=False)
        self.up = nn.Linear(4, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        weight = self.down.weight
        assert weight.shape == (4, WIDTH) and weight.size(1) == WIDTH and weight.size() == (4, WIDTH)
        assert weight.dim() == 2 and weight.numel() == 4 * WIDTH
        assert weight.stride() == (WIDTH, 1) and weight.stride(0) == WIDTH and weight.stride(-1) == 1
        eye = torch.eye(weight.shape[1], device=h.device)
        delta = self.up(self.down(eye)).T  # (WIDTH, WIDTH): the low-rank update, as DoRA builds it
        h = h + torch.tanh(h @ delta)
        return h @ self.head.weight.T + self.head.bias


class DenseReturningBias(nn.Module):
    """Megatron's linear with `skip_bias_add`: returns its bias for the caller to add (fused later)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.1)
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, width))

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class ReturnBiasModel(nn.Module):
    """The caller adds a child's returned parameter: under ZeRO-3 it must arrive gathered, from
    the first forward on (upstream's test_ext_param_return checks the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.dense = DenseReturningBias(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h, bias = self.dense(self.embed(ids))
        status = getattr(bias, "ds_status", None)
        assert status is None or status.name == "AVAILABLE", f"returned bias arrived {status.name}"
        return self.head(torch.tanh(h + bias))


class PassingOnBias(nn.Module):
    """Returns its child's bias untouched to its own caller (upstream's test_ext_param_return
    nests the same way): it never computes with the bias, it only passes it on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = DenseReturningBias(width)

    def forward(self, x):
        h, bias = self.dense(x)
        return torch.tanh(h), bias


class PassedOnBiasModel(nn.Module):
    """The bias reaches the module that adds it through a module that only passes it on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = PassingOnBias(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h, bias = self.block(self.embed(ids))
        return self.head(h + bias * bias.sum())


class RNNModel(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        rnn_cls = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn_cls(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


class PaddedEmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)  # odd sizes exercise shard padding
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """Embedding, residual MLP blocks, head; optionally each block under activation checkpointing."""

    def __init__(self, blocks: int = 2, use_reentrant=None) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant  # None: no checkpointing
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MLPBlock(WIDTH) for _ in range(blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            if self.use_reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(self.norm(h))


def frozen_token_mlp() -> TokenMLP:
    """Embedding, the first block's LayerNorm and its `up` bias frozen."""
    model = TokenMLP()
    model.embed.weight.requires_grad_(False)
    model.blocks[0].norm.requires_grad_(False)
    model.blocks[0].up.bias.requires_grad_(False)
    return model


class Student(nn.Module):
    """Distillation: a teacher (an engine, or a plain model) is called inside forward.

    The teacher is held in a list so that it is not registered as a submodule: the
    student's engine must not partition or hook it.
    """

    def __init__(self, teacher) -> None:
        super().__init__()
        self._teacher = [teacher]
        self.body = TokenMLP(blocks=1)

    def forward(self, ids, labels):
        with torch.no_grad():
            target = self._teacher[0](ids)
        logits = self.body(ids)
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        # a child's parameter used in the parent's forward, after the teacher returned
        tied = F.linear(torch.tanh(self.body.embed(ids)), self.body.embed.weight)
        return ce + F.mse_loss(logits, target.float()) + 0.1 * tied.square().mean()


# ----------------------------------------------------------------------------- HF transformers


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(**overrides) -> nn.Module:
    tf = _quiet_transformers()
    cfg = dict(
        vocab_size=VOCAB,
        n_embd=WIDTH,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    cfg.update(overrides)
    return tf.GPT2LMHeadModel(tf.GPT2Config(**cfg))


# The tiny Llama-family decoder shape both llama() and mixtral() build from.
_LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=2 * WIDTH,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=1,
    pad_token_id=0,
    attn_implementation="eager",
)


def llama() -> nn.Module:
    tf = _quiet_transformers()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_LLAMA_SHAPE, tie_word_embeddings=True))


def mixtral() -> nn.Module:
    """A sparse mixture of experts: each token's router picks 2 of 4 experts, so each rank's
    data reaches experts the other's may not. Its MoE block is a leaf module by default."""
    tf = _quiet_transformers()
    experts = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(**_LLAMA_SHAPE, **experts))


def bert_mlm() -> nn.Module:
    tf = _quiet_transformers()
    cfg = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * WIDTH,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return tf.BertForMaskedLM(cfg)


def t5() -> nn.Module:
    tf = _quiet_transformers()
    cfg = tf.T5Config(
        vocab_size=VOCAB,
        d_model=WIDTH,
        d_kv=WIDTH // 2,
        d_ff=2 * WIDTH,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return tf.T5ForConditionalGeneration(cfg)


def hf_causal_loss(model, batch) -> torch.Tensor:
    ids, _ = batch
    return model(input_ids=ids, labels=ids).loss


MASK_ID = 3


def mlm_batch(gen: torch.Generator, rows: int = 2) -> tuple:
    """(masked ids, labels): about 30% of positions masked (at least one), others labelled -100."""
    ids = torch.randint(4, VOCAB, (rows, SEQ), generator=gen)
    masked = torch.rand(ids.shape, generator=gen) < 0.3
    masked[:, 0] = True
    return ids.masked_fill(masked, MASK_ID), ids.masked_fill(~masked, -100)


def hf_mlm_loss(model, batch) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def seq2seq_batch(gen: torch.Generator, rows: int = 2) -> tuple:
    return (
        torch.randint(2, VOCAB, (rows, SEQ), generator=gen),
        torch.randint(2, VOCAB, (rows, SEQ // 2), generator=gen),
    )


def hf_seq2seq_loss(model, batch) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss
