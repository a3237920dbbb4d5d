"""`TiledLinear`: a linear layer cut into a grid of smaller ones, for huge layers under ZeRO-3.

[Note: tiles]
A `TiledLinear(in_features, out_features, in_splits=I, out_splits=O)` holds O x I linear
modules ("tiles"): tile (o, i) maps input columns `in_parts[i]:in_parts[i+1]` to output
columns `out_parts[o]:out_parts[o+1]`, and only the last tile of each output row has a bias.
The forward computes output part o as the sum over i of tile (o, i) applied to input part i
(in order of i), then joins the output parts along the last dimension. The numbers are the
ones `torch.nn.Linear` with the same weight gives, up to the order of the sums. Under ZeRO-3
each tile is its own module, so only one tile's weight is gathered at a time: a layer too big
to gather whole still runs. The parts are as even as they go, the first ones one wider when
the features do not divide (upstream's layout, so tiles line up with a checkpoint made there).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed.runtime.zero.partition_parameters import GatheredParameters


def _boundaries(items: int, parts: int) -> list:
    """`parts + 1` offsets splitting `items` as evenly as possible, the first parts one larger."""
    base, extra = divmod(items, parts)
    offsets = [0]
    for index in range(parts):
        offsets.append(offsets[-1] + base + (1 if index < extra else 0))
    return offsets


def _sizes(offsets: list) -> list:
    return [stop - start for start, stop in zip(offsets, offsets[1:])]


class TiledLinear(nn.Module):
    """`torch.nn.Linear` as a grid of `out_splits` x `in_splits` tiles (see the note).

    `input_is_already_split`: `forward` takes a sequence of `in_splits` tensors instead of one.
    `combine_out_splits=False`: `forward` returns the list of output parts. `linear_cls` builds
    each tile (called as `linear_cls(in_dim, out_dim, bias=..., **kwargs)`); `init_linear`, a
    linear layer of the full shape, gives the initial weights (`copy_params_from`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: Any = nn.Linear,
        init_linear: Optional[nn.Module] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(
                f"TiledLinear: in_splits={in_splits} must be in [1, in_features={in_features}]"
            )
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(
                f"TiledLinear: out_splits={out_splits} must be in [1, out_features={out_features}]"
            )
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = _boundaries(in_features, in_splits)
        self.out_parts = _boundaries(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(width_in, width_out, bias=bias and column == in_splits - 1, **kwargs)
                for column, width_in in enumerate(_sizes(self.in_parts))
            )
            for width_out in _sizes(self.out_parts)
        )
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: got {len(inputs)} input parts, built for in_splits={self.in_splits}"
                )
        else:
            inputs = self._split_global_input(input_, _sizes(_boundaries(input_.shape[-1], self.in_splits)))
        outputs = []
        for row in self.linears:
            total = None
            for column, (tile, part) in enumerate(zip(row, inputs)):
                total = self._reduce_local_output(column, len(outputs), total, tile(part))
            outputs.append(total)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    # The three steps a subclass may change (upstream's hooks, same names and arguments).

    def _split_global_input(self, input: torch.Tensor, split_sizes: list) -> list:  # noqa: A002
        return list(torch.split(input, split_sizes, dim=-1))

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        del in_id, out_id  # the sum does not depend on where the part came from
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list) -> Any:
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Set every tile from `other`, a linear layer of the full shape (its `weight`, `bias`).

        Under ZeRO-3 a collective: tiles (and `other`, if partitioned) are gathered, and rank
        0's values are what every rank keeps.
        """
        weight, bias = getattr(other, "weight", None), getattr(other, "bias", None)
        shape = tuple(getattr(weight, "ds_shape", None) or weight.shape) if weight is not None else None
        if shape != (self.out_features, self.in_features):
            raise ValueError(
                f"TiledLinear.copy_params_from: needs a weight of shape ({self.out_features}, {self.in_features}), "
                f"got {shape}"
            )
        if self.use_bias != (bias is not None):
            raise ValueError(
                f"TiledLinear.copy_params_from: this layer has bias={self.use_bias}, the source "
                f"{'has' if bias is not None else 'has no'} bias"
            )
        sources = [p for p in (weight, bias) if p is not None]
        with GatheredParameters(sources):
            for row, (top, bottom) in zip(self.linears, zip(self.out_parts, self.out_parts[1:])):
                for tile, (left, right) in zip(row, zip(self.in_parts, self.in_parts[1:])):
                    targets = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(targets, modifier_rank=0):
                        tile.weight.copy_(weight[top:bottom, left:right])
                        if tile.bias is not None:
                            tile.bias.copy_(bias[top:bottom])


class TiledLinearReturnBias(TiledLinear):
    """`TiledLinear` over tiles that return `(output, bias)` (Megatron's linear with
    `skip_bias_add`): outputs are summed, biases passed through, and `forward` returns
    `(output, bias)` with each joined along the last dimension (bias None if no tile has one)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError(
                "TiledLinearReturnBias: each tile must return (output, bias); use TiledLinear for plain tiles"
            )
        output, bias = new_out
        total, kept = current_out if current_out is not None else (None, None)
        return super()._reduce_local_output(in_id, out_id, total, output), (
            bias if bias is not None else kept
        )

    def _combine_output_splits(self, outputs: list) -> Any:
        output = super()._combine_output_splits([o for o, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return output, (super()._combine_output_splits(biases) if biases else None)
