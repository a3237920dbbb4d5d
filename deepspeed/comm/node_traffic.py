"""Counting the bytes each collective moves across node boundaries and within nodes.

[Note: counting cross-node bytes]
While counting (`deepspeed.comm.count_node_traffic(nodes)`, `nodes` the node index of every global rank, e.g.
`deepspeed.utils.groups.node_layout()`), every collective of `deepspeed.comm` adds to this
rank's tally the bytes **this rank receives**, split by whether the sender lies on another
node ("cross") or on this rank's node ("within"). The model is direct exchange: each rank
receives each piece straight from the rank that holds it, so the figures depend only on the
group's membership and the node layout, never on the transport (ring, tree, shared memory):

- all-gather of `k` bytes per rank over a group: `k` from every other member;
- reduce-scatter whose input is `g * k` bytes (group of `g`): `k` from every other member
  (its slice of this rank's shard);
- all-reduce of `N` bytes: a reduce-scatter then an all-gather, `2 * N / g` from every
  other member;
- broadcast of `N` bytes: `N` from the source (nothing on the source);
- reduce of `N` bytes: `N` from every other member on the destination;
- all-to-all (`all_to_all_single`): from every other member, the slice of the output it
  fills (`N / g` of the `N` input bytes for equal slices; the `output_split_sizes` rows
  otherwise);
- a group with a two-hop plan ([Note: the two-hop all-gather]) counts its two hops: `k`
  from each of the `n - 1` ranks at this rank's position on the other nodes (cross), then
  `n * k` from each of the `p - 1` other ranks on this node (within).

Barriers and object collectives count nothing. Summed over the ranks, "cross" is the
traffic that crosses node boundaries. Counting needs no synchronization (it does not time
anything); the collectives inside a counted one (the two hops, gloo's broadcasts) are not
counted again. `deepspeed.comm.count_node_traffic(nodes)` starts a fresh tally (`None`
stops); `totals()` answers `{op: {"count", "cross_bytes", "within_bytes"}}` since then.
"""

from __future__ import annotations

from typing import Optional

from deepspeed import process_state


class NodeTraffic:
    """This rank's tally (see the note)."""

    def __init__(self) -> None:
        self.nodes: Optional[tuple] = None  # node index of every global rank while counting
        self.tally: dict = {}  # op -> [count, cross_bytes, within_bytes]

    @property
    def on(self) -> bool:
        return self.nodes is not None

    def count(self, op: str, args: tuple, ranks: list, me: int, nbytes: int, two_hop=None) -> None:
        """Count one collective `op` (its own name; `args` as the comm function got them) over
        global `ranks`, this rank being `me`, of `nbytes` (what the communication logger records)."""
        row = self.tally.setdefault(op, [0, 0, 0])
        row[0] += 1
        for sender, nbytes_from in self._senders(op, args, ranks, me, nbytes, two_hop):
            row[1 if self.nodes[sender] != self.nodes[me] else 2] += nbytes_from

    @staticmethod
    def _senders(op: str, args: tuple, ranks: list, me: int, nbytes: int, two_hop) -> list:
        """(sender, bytes this rank receives from it) for one collective (see the note)."""
        g, others = len(ranks), [r for r in ranks if r != me]
        if op.startswith("all_gather") and two_hop is not None:
            n, p = two_hop.nodes, two_hop.per_node
            at = ranks.index(me)
            across = [ranks[i * p + at % p] for i in range(n) if i != at // p]
            within = [ranks[at // p * p + j] for j in range(p) if j != at % p]
            return [(r, nbytes) for r in across] + [(r, n * nbytes) for r in within]
        if op.startswith("all_gather"):
            return [(r, nbytes) for r in others]
        if op.startswith("reduce_scatter"):
            return [(r, nbytes // g) for r in others]
        if op == "all_reduce":
            return [(r, 2 * nbytes // g) for r in others]
        if op == "all_to_all_single":  # args: (output, input, output_split_sizes, ...)
            output, splits = args[0], args[2]
            if not splits:
                return [(r, nbytes // g) for r in others]
            row_bytes = output[0].numel() * output.element_size() if output.dim() else output.element_size()
            return [(r, splits[ranks.index(r)] * row_bytes) for r in others]
        if op == "broadcast":  # args: (tensor, src, ...), src a global rank
            return [(args[1], nbytes)] if me != args[1] and g > 1 else []
        if op == "reduce":  # args: (tensor, dst, ...)
            return [(r, nbytes) for r in others] if me == args[1] else []
        return []  # barrier and anything else: nothing counted

    def totals(self) -> dict:
        return {op: {"count": c, "cross_bytes": x, "within_bytes": w} for op, (c, x, w) in self.tally.items()}


COUNTER = process_state.register(
    "deepspeed.comm.node_traffic.COUNTER", NodeTraffic(), lambda: COUNTER.__init__()
)


def totals() -> dict:
    """The tally since counting started (see the note)."""
    return COUNTER.totals()


def cross_and_within(tally: dict, prefix: str = "") -> tuple:
    """(cross, within) bytes summed over the ops of `tally` whose names start with `prefix`."""
    rows = [v for op, v in tally.items() if op.startswith(prefix)]
    return sum(v["cross_bytes"] for v in rows), sum(v["within_bytes"] for v in rows)
