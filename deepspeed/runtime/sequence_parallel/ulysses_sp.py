"""Ulysses sequence parallelism for HF transformers models (upstream's ALST API).

`UlyssesSPAttentionHF.register_with_transformers(model, sequence_parallel_size=sp, ...)` creates
the sequence-parallel groups and routes the model's attention through `UlyssesSPAttentionHF`:
q, k, v arrive sequence-sharded ([b, h, s/sp, d], the HF layout), one all-to-all per tensor
makes them head-sharded over the whole sequence ([b, h/sp, s, d]), the core attention (eager
or sdpa) runs causally over the whole sequence, and one all-to-all brings its output back to
the sequence shard ([b, s/sp, h, d], what HF's attention functions return). It returns the mpu
to pass to `deepspeed.initialize`. `UlyssesSPDataLoaderAdapter` feeds each rank its shard of
every sequence. docs/sequence_parallel.md shows the loss that makes the gradients exact.

[Note: grouped-query attention under Ulysses]
Each rank must hold whole heads after the all-to-all: the query heads must divide by sp. The
key/value heads either divide by sp (each rank gets kv/sp of them, with the query heads that
use them: head h of the queries uses kv head h // (q/kv), and both split in the same order), or
sp divides by them: then each kv head is repeated sp/kv times before the all-to-all, so rank r
receives kv head r * kv / sp, the one all of its q/sp query heads use (as upstream documents:
kv heads fewer than sp are replicated). Anything else is refused, naming the counts. In the
repeated case the core attention sees q/sp query heads to one kv head, not the model's ratio,
so it gets a view of the attention module whose `num_key_value_groups` says so.

[Note: the mask under Ulysses]
The mask the model built covers only its local shard, so the core attention gets none of it:
sdpa runs with `is_causal` over the whole sequence, eager with a full causal mask. Padding is
therefore not masked inside attention; the data-loader adapter accepts right padding only
(a causal attention never lets a real token see the padding after it) and masks the padding's
labels with -100, so the loss is the unpadded one.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from deepspeed import comm as dist
from deepspeed import process_state
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.tiled import (  # noqa: F401 (upstream's import path for them)
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from deepspeed.sequence.layer import seq_all_to_all

CORE_IMPLEMENTATIONS = ("sdpa", "eager")
KEY_PREFIX = "ulysses_sp_"  # the attention implementation a registered model runs: ulysses_sp_<core>


def _check_heads(attn_head_count: int, kv_head_count: int, sp: int) -> None:
    """[Note: grouped-query attention under Ulysses]: raise unless the heads split over sp."""
    if attn_head_count % sp != 0:
        raise ValueError(
            f"Ulysses sequence parallelism: the model's {attn_head_count} attention heads are not divisible by "
            f"sequence_parallel_size={sp}; choose a sequence_parallel_size that divides {attn_head_count}"
        )
    if kv_head_count % sp != 0 and sp % kv_head_count != 0:
        raise ValueError(
            f"Ulysses sequence parallelism: the model's {kv_head_count} key/value heads neither divide by nor "
            f"divide sequence_parallel_size={sp}; choose a sequence_parallel_size that {kv_head_count} divides, "
            "or a divisor of it"
        )


class _LocalHeads:
    """A view of an attention module whose `num_key_value_groups` is the local ratio of query
    to key/value heads ([Note: grouped-query attention under Ulysses])."""

    def __init__(self, module: Any, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _eager_of(module: Any) -> Callable:
    """The model's own eager attention: `eager_attention_forward` of the module defining its class."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"Ulysses sequence parallelism with core_attn_implementation='eager': {type(module).__module__} has no "
            "eager_attention_forward to call; use core_attn_implementation='sdpa'"
        )
    return fn


class UlyssesSPAttentionHF(torch.nn.Module):
    """An HF attention function (`attn(module, q, k, v, attention_mask, **kwargs)`) run over the
    whole sequence with the heads split over the sequence-parallel group `process_group`.

    `attn`: the core function, or None for the model's own eager attention. The head counts
    come from the model config; `batch_size`, `num_hidden_layers`, `local_seq_length`,
    `global_seq_length` and `seq_length_is_variable` are upstream's arguments and accepted for
    compatibility: shapes are read from the tensors at every call. `disable_in_eval=True`
    calls the core attention unchanged while the attention module is in eval mode.
    """

    def __init__(
        self,
        attn: Optional[Callable],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = True,
        local_seq_length: Optional[int] = None,
        global_seq_length: Optional[int] = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        _check_heads(attn_head_count, kv_head_count, self.world_size)
        # [Note: grouped-query attention under Ulysses]: kv heads repeated this many times
        self.kv_repeat = 1 if kv_head_count % self.world_size == 0 else self.world_size // kv_head_count
        self._causal: Optional[torch.Tensor] = None  # eager's full causal mask, kept for the next layer

    def _core(self, module: Any) -> Callable:
        return self.attn if self.attn is not None else _eager_of(module)

    def _causal_mask(self, query: torch.Tensor) -> torch.Tensor:
        """[1, 1, s, s] additive causal mask in the query's dtype ([Note: the mask under Ulysses])."""
        s = query.shape[2]
        mask = self._causal
        if mask is None or mask.shape[-1] != s or mask.dtype != query.dtype or mask.device != query.device:
            mask = torch.full((s, s), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
            mask = mask.triu(1).view(1, 1, s, s)
            self._causal = mask
        return mask

    def forward(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple:
        core = self._core(module)
        if self.world_size == 1 or (self.disable_in_eval and not module.training):
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[1] != self.attn_head_count or key.shape[1] != self.kv_head_count:
            raise ValueError(
                f"UlyssesSPAttentionHF: got {query.shape[1]} query and {key.shape[1]} key/value heads, configured "
                f"for {self.attn_head_count} and {self.kv_head_count}"
            )
        if self.kv_repeat > 1:
            key = key.repeat_interleave(self.kv_repeat, dim=1)
            value = value.repeat_interleave(self.kv_repeat, dim=1)
        group = self.process_group
        # [b, h, s/sp, d] -> [b, h/sp, s, d]: scatter the heads (1), gather the sequence (2)
        q, k, v = (seq_all_to_all(t, 1, 2, group) for t in (query, key, value))
        view = module
        if self.kv_repeat > 1:
            view = _LocalHeads(module, q.shape[1] // k.shape[1])
        kwargs.pop("is_causal", None)
        if self.attn is None:  # the model's eager attention: a full causal mask
            output, _weights = core(view, q, k, v, self._causal_mask(q), *args, **kwargs)
        else:
            output, _weights = core(view, q, k, v, None, *args, is_causal=True, **kwargs)
        # core output [b, s, h/sp, d] -> [b, s/sp, h, d]: scatter the sequence (1), gather the heads (2)
        return seq_all_to_all(output, 1, 2, group), None

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str = "sdpa",
        sequence_parallel_size: int = 1,
        micro_batch_size: int = 1,
        seq_length: Optional[int] = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
    ) -> Any:
        """Set up the sequence-parallel groups and route the model's attention through Ulysses.

        `model_name_or_path`: an HF model (its attention implementation becomes
        `ulysses_sp_<core>`) or a name/path whose config gives the heads (then every model
        loaded with `attn_implementation=core_attn_implementation` in this process runs
        Ulysses, as upstream). Returns the mpu (`parallel_state_sp`) for `deepspeed.initialize`.
        """
        core_attn_implementation = core_attn_implementation or "sdpa"  # accelerate passes None: its default
        if core_attn_implementation not in CORE_IMPLEMENTATIONS:
            raise ValueError(
                f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} is not supported "
                f"here; use one of {CORE_IMPLEMENTATIONS}"
            )
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        config = _model_config(model_name_or_path)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        uattn = cls(
            attn=None if core_attn_implementation == "eager" else _registry()[core_attn_implementation],
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
            kv_head_count=kv_heads,
            num_hidden_layers=config.num_hidden_layers,
            process_group=parallel_state_sp.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            global_seq_length=seq_length,
            disable_in_eval=disable_in_eval,
        )
        _route_attention(model_name_or_path, core_attn_implementation, uattn)
        return parallel_state_sp


def _registry() -> Any:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as err:
        raise ImportError(
            "Ulysses sequence parallelism for HF models needs transformers: pip install transformers"
        ) from err
    return ALL_ATTENTION_FUNCTIONS


def _model_config(model_name_or_path: Any) -> Any:
    if isinstance(model_name_or_path, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name_or_path)
    else:
        config = getattr(model_name_or_path, "config", None)
        if config is None:
            raise ValueError(
                "register_with_transformers: the model has no `config`; pass an HF transformers model or its name"
            )
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class _Routes:
    """The transformers registry entries this process added or replaced, and how to undo them."""

    def __init__(self) -> None:
        self.undos: dict = {}  # (mapping id, key) -> a function putting the entry back

    def set(self, mapping: dict, key: str, fn: Callable) -> None:
        """Set `mapping[key] = fn` (a registry's `_local_mapping` or `_global_mapping`)."""
        if (id(mapping), key) not in self.undos:
            missing = key not in mapping
            previous = mapping.get(key)
            self.undos[(id(mapping), key)] = (
                (lambda: mapping.pop(key, None)) if missing else (lambda: mapping.__setitem__(key, previous))
            )
        mapping[key] = fn

    def undo(self) -> None:
        for put_back in self.undos.values():
            put_back()
        self.undos.clear()


_ROUTES = process_state.register(
    "transformers attention registries' entries routed through Ulysses (ulysses_sp._ROUTES)",
    _Routes(),
    lambda: _ROUTES.undo(),
)


def _route_attention(model_name_or_path: Any, core: str, uattn: UlyssesSPAttentionHF) -> None:
    """A model object runs `ulysses_sp_<core>` (whose mask is the core's); a name reroutes `core`
    itself in the registry, for every model of the process (upstream's behaviour)."""
    registry = _registry()
    if isinstance(model_name_or_path, str):
        _ROUTES.set(registry._local_mapping, core, uattn)
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    key = KEY_PREFIX + core
    _ROUTES.set(registry._local_mapping, key, uattn)
    # transformers builds a mask only for implementations in the mask registry's global mapping;
    # the core's one is used when `disable_in_eval` passes an eval forward through unchanged.
    masks = type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping
    _ROUTES.set(masks, key, masks[core])
    model = model_name_or_path
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(key)
    else:
        model.config._attn_implementation = key


# ----------------------------------------------------------------------------------------
# The data: each rank's shard of every sequence

IGNORE_INDEX = -100  # labels the loss skips (torch's cross_entropy default, HF's convention)


def _right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a 0/1 attention mask is ones followed by zeros."""
    mask = mask.to(torch.int64)
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _pad_to(t: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """`t` ([b, s, ...]) extended along dim 1 to `length` with `value`."""
    extra = length - t.shape[1]
    if extra == 0:
        return t
    fill = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, fill], dim=1)


def prepare_sp_batch(batch: dict, sp_world_size: int) -> dict:
    """A whole-sequence batch made ready to shard: `shift_labels` from `labels` (computed on the
    whole sequence, so no shard loses the label of its last token), `position_ids` if missing,
    the sequence padded to a multiple of `sp_world_size`, and the attention mask dropped.

    [Note: padding for Ulysses]
    A length that `sp_world_size` does not divide is padded at the end: `input_ids` with 0,
    `shift_labels` with -100 (so the padded positions add nothing to the loss), `position_ids`
    counting on, other sequence tensors with 0. Attention is causal ([Note: the mask under
    Ulysses]), so no real token sees the padding. An `attention_mask` must be right padding
    (ones, then zeros, per row): its zeros must already carry -100 labels, as HF collators
    set them; any other mask is refused, since it cannot be applied under Ulysses. `labels`
    is replaced by `shift_labels` (pass it to the loss as `shift_labels`, or as `labels` to
    HF's loss, which uses `shift_labels` as given).
    """
    if "input_ids" not in batch:
        raise ValueError(f"UlyssesSPDataLoaderAdapter: a batch needs input_ids; got the keys {sorted(batch)}")
    ids = batch["input_ids"]
    bs, length = ids.shape[0], ids.shape[1]
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if mask is not None and not _right_padded(mask):
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: the attention_mask is not right padding (ones, then zeros, in every row); "
            "Ulysses attention is causal over the whole sequence and cannot apply other masks: pad on the right "
            "and set the padding's labels to -100"
        )
    if "labels" in out and "shift_labels" not in out:
        labels = out.pop("labels")
        out["shift_labels"] = _pad_to(labels[:, 1:], length, IGNORE_INDEX)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(bs, length).clone()
    padded = -(-length // sp_world_size) * sp_world_size
    for key, value in out.items():
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length):
            continue
        if key == "position_ids":
            steps = torch.arange(1, padded - length + 1, device=value.device, dtype=value.dtype)
            out[key] = torch.cat([value, value[:, -1:] + steps], dim=1)
        else:
            out[key] = _pad_to(value, padded, IGNORE_INDEX if key in ("shift_labels", "labels") else 0)
    return out


def shard_sp_batch(batch: dict, sp_rank: int, sp_world_size: int) -> dict:
    """This rank's slice along dim 1 of every sequence tensor of a `prepare_sp_batch` batch."""
    length = batch["input_ids"].shape[1]
    chunk = length // sp_world_size
    window = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return {
        key: value[:, window].contiguous()
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length
        else value
        for key, value in batch.items()
    }


def _to(batch: dict, device: Any) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class UlyssesSPDataLoaderAdapter:
    """Wraps a data loader whose batches are dicts of [batch, seq, ...] tensors (upstream's API).

    Every rank's loader yields its own batches (a sampler over all ranks, as accelerate and
    HF Trainer set up). Each of this adapter's steps takes one batch from the wrapped loader on
    every rank of the sequence-parallel group, shares them (an all-gather over `sp_group`), and
    then yields, one per step, this rank's shard of each of them, in rank order: the group
    trains on rank 0's batch, then rank 1's, and so on, every rank holding 1/sp of each sequence
    (`prepare_sp_batch` and [Note: padding for Ulysses] say how). `len()` is the wrapped
    loader's length times sp. The shards are moved to `device` as they are yielded. Every rank
    of the group must see loaders of the same length.
    """

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self._iter: Optional[Any] = None
        self._pending: list = []  # this rank's shards of the gathered batches, not yet yielded

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        self._iter = iter(self.dl)
        self._pending = []
        return self

    def __next__(self) -> dict:
        if self._iter is None:
            self._iter = iter(self.dl)
        if not self._pending:
            self._refill()
        return _to(self._pending.pop(0), self.device)

    def _refill(self) -> None:
        batch = next(self._iter)  # StopIteration ends the adapter too
        if not isinstance(batch, dict):
            raise TypeError(
                f"UlyssesSPDataLoaderAdapter: batches must be dicts of tensors (input_ids, labels, ...); got "
                f"{type(batch).__name__}"
            )
        gathered = [None] * self.sp_world_size
        dist.all_gather_object(gathered, _to(batch, "cpu"), group=self.sp_group)
        for whole in gathered:
            prepared = prepare_sp_batch(whole, self.sp_world_size)
            self._pending.append(shard_sp_batch(prepared, self.sp_rank, self.sp_world_size))
