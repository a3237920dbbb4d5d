"""Collectives through one host's shared memory, for gloo groups whose ranks share it.

[Note: shared-memory collectives]
gloo sends every byte through a loopback TCP socket even when all ranks run on one host.
Measured side by side (benchmarks/bench_collectives.py, 2 ranks, 2 cores): a 24 MB
all-gather takes about 10 ms through gloo and 3.4 ms through a shared buffer. So on a gloo
group whose ranks all map the same /dev/shm file, `deepspeed.comm` runs its
all-gather, reduce-scatter (sum), all-reduce (sum), all-to-all (equal slices), broadcast and barrier through a
`ShmChannel` instead; `DEEPSPEED_SHM_COMM=0` turns it off, and everything else (nccl,
groups spanning hosts, other ops and dtypes) keeps its gloo or nccl path.

Layout of the segment: a control page (each rank's arrival counter, its pid, the token
that proves the ranks mapped one file), then two halves of `world` slots of `SLOT_BYTES`.
A collective moves its data in chunks of at most one slot: each rank copies its part of
the chunk into its own slot of the current half, all ranks meet at a barrier, each reads
what it needs from the others' slots, and the next chunk uses the other half. One barrier
per chunk is enough: a rank writing half h again (two chunks later) has passed the barrier
in between, which every rank reached only after reading half h.

Every collective completes before the call returns (an `async_op` caller gets a finished
handle). Sums add the ranks' rows in rank order, so every rank gets the same bits, which
are also what the gloo path's all-to-all plus local sum computes.

The barrier: a rank bumps its counter after its writes and waits until every counter has
reached its own, yielding the CPU meanwhile. Beside the counter each rank posts what it is
doing (the op, dtype, element count, broadcast source), in the same half as the data, and
after the barrier every rank compares all posts: ranks that disagree (a rank skipped a
collective, or sizes differ, where gloo would report a mismatch) all raise at that barrier,
naming each rank's op, instead of reading slots laid out for another op. A peer that exited (checked about once a
second, when the ranks share a pid namespace) or the comm timeout turns the wait into an
error naming the missing ranks, and the channel refuses further use: a failure on one
rank does not become a silent hang on the others.

Memory ordering: x86-64 makes a rank's stores visible to other cores in program order,
so a counter that reached n means the data written before it is visible. Other
architectures need fences this Python code cannot issue; they keep gloo.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import os
import platform
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from typing import Optional

import torch

from deepspeed.utils.switches import switch_error, switched_off

ENV = "DEEPSPEED_SHM_COMM"  # "0": every collective goes through the process group's backend
SLOT_BYTES = 2 << 20  # one rank's share of one chunk (new channels read it when made)
MAX_WORLD = 128  # ranks a control page holds (counters, pids, token)
_CONTROL_BYTES = 8192
_PIDS_OFFSET = 8 * MAX_WORLD
_TOKEN_OFFSET = 16 * MAX_WORLD
_TOKEN_BYTES = 16
_POSTS_OFFSET = 4096  # int64 [2 halves, MAX_WORLD ranks, 2]: what each rank's chunk belongs to
_LIVENESS_CHECK_S = 1.0  # how often a waiting rank checks that the ranks it waits for exist
# How long a waiting rank yields the CPU in a loop before it sleeps between checks: a sleep
# wakes up late (timer slack), and a peer that arrives while this rank sleeps waits for it
# at the next barrier (a 4 MB gather after a barrier: 2.1 ms with 1000 yields, 0.8 ms with
# this; benchmarks/bench_gather.py).
_SPIN_S = 0.005
# Element types a sum may run on here (gloo's others, complex included, keep gloo).
SUMMABLE = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
}
SUMMABLE = frozenset(SUMMABLE)  # read-only from here on


_KINDS = ("barrier", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def _post(kind: str, dtype: Optional[torch.dtype], numel: int, src: int = -1) -> tuple:
    """What a rank posts for one chunk of a collective (see the barrier in the note)."""
    dtype_code = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 255 if dtype is not None else 0
    return _KINDS.index(kind) | dtype_code << 8 | (src + 1) << 16, numel


def _describe(post: tuple) -> str:
    code, numel = post
    kind = _KINDS[code & 0xFF] if code & 0xFF < len(_KINDS) else "?"
    if kind == "barrier":
        return "barrier"
    dtype_code = (code >> 8) & 0xFF
    dtype = str(_DTYPES[dtype_code - 1]).removeprefix("torch.") if 0 < dtype_code <= len(_DTYPES) else "other"
    src = (code >> 16) - 1
    return f"{kind} of {numel} {dtype}" + (f" from rank {src}" if src >= 0 else "")


def env_error() -> Optional[str]:
    """What is wrong with this process's `DEEPSPEED_SHM_COMM`, if anything."""
    return switch_error(
        ENV, "keep a one-host gloo group's collectives on gloo", "run them through shared memory"
    )


def unsupported_reason(world: int) -> Optional[str]:
    """Why this process cannot use a channel of `world` ranks (None: it can)."""
    if switched_off(ENV):
        return f"{ENV}=0"
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        return "no /dev/shm (shared-memory collectives need Linux)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} (shared-memory collectives rely on x86-64 store ordering)"
    if world > MAX_WORLD:
        return f"{world} ranks (at most {MAX_WORLD})"
    return None


def segment_bytes(world: int, slot_bytes: int) -> int:
    return _CONTROL_BYTES + 2 * world * slot_bytes


def create_segment(world: int, slot_bytes: int) -> tuple:
    """Rank 0: a fresh /dev/shm file for `world` ranks, its pages reserved; `(path, token)`.

    `posix_fallocate` reserves the pages now, so a full /dev/shm (a container's 64 MB
    default) is an OSError here rather than a SIGBUS at the first write.
    """
    token = secrets.token_bytes(_TOKEN_BYTES)
    path = f"/dev/shm/deepspeed-comm-{os.getpid()}-{token.hex()[:12]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(world, slot_bytes))
        os.pwrite(fd, token, _TOKEN_OFFSET)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, token


def pid_namespace() -> int:
    """An id of this process's pid namespace: pids are comparable only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


class ShmChannel:
    """One group's shared segment and the collectives over it (see the note above)."""

    world: int
    rank: int
    slot_bytes: int  # one rank's share of one chunk, a multiple of 64
    counts: dict  # kind -> [calls, bytes of this rank's output], for benchmarks and tests
    _mm: mmap.mmap
    _data: torch.Tensor  # uint8 [2 halves * world slots * slot_bytes], the shared data area
    _arrivals_view: ctypes.Array  # int64 [world], how many barriers each rank reached
    _posts_view: ctypes.Array  # int64 [2 * MAX_WORLD * 2], each rank's post per half
    _arrived: int  # how many barriers this rank reached
    _half: int  # the half the next chunk uses
    _peers: list  # pid of each rank, for the liveness check; empty: not checked
    _timeout_s: float
    _broken: Optional[str]  # why the channel refuses further use

    def __init__(
        self, path: str, token: bytes, world: int, rank: int, timeout_s: float, slot_bytes: int = SLOT_BYTES
    ) -> None:
        """Map the segment rank 0 made; ValueError when it is not the one rank 0 wrote."""
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes={slot_bytes} must be a positive multiple of 64")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        if self._mm[_TOKEN_OFFSET : _TOKEN_OFFSET + _TOKEN_BYTES] != token:
            self._mm.close()
            raise ValueError(f"{path} does not hold rank 0's token: the ranks do not share /dev/shm")
        self.world, self.rank, self.slot_bytes = world, rank, slot_bytes
        self.counts = {}
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_CONTROL_BYTES)
        # ctypes reads and writes each counter with one aligned 8-byte access: never torn.
        self._arrivals_view = (ctypes.c_int64 * world).from_buffer(self._mm)
        self._posts_view = (ctypes.c_int64 * (4 * MAX_WORLD)).from_buffer(self._mm, _POSTS_OFFSET)
        ctypes.c_int64.from_buffer(self._mm, _PIDS_OFFSET + 8 * rank).value = os.getpid()
        self._arrived = 0
        self._half = 0
        self._peers = []
        self._timeout_s = timeout_s
        self._broken = None
        self._fence = threading.Lock()

    @property
    def segment(self) -> torch.Tensor:
        """The shared data area (uint8): its storage is this channel's whole buffer."""
        return self._data

    def check_liveness_of(self, pids: list) -> None:
        """Name the ranks' pids, so a wait notices a peer that exited (same pid namespace only)."""
        self._peers = list(pids)

    # ------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        self._count("barrier", 0)
        self._meet(_post("barrier", None, 0))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """`out` (contiguous, `world * inp.numel()` elements) gets every rank's `inp` in rank order."""
        self._count("all_gather", out.numel() * out.element_size())
        dst = out.view(self.world, inp.numel())
        for start, k, slots in self._rounds("all_gather", inp.reshape(-1)):
            dst[:, start : start + k].copy_(slots[:, :k])

    def all_gather_columns(self, outputs: list, sizes: list, inp: Optional[torch.Tensor]) -> None:
        """An all-gather whose `[world, n]` rank-major result is split by columns into
        `outputs` (`[world, sizes[i]]` each, sizes summing to n), straight from the slots.
        `inp` None: this rank's part is row `rank` of the outputs, which is packed into the
        slot and not written (see `comm.all_gather_into_columns`). Outputs that lie back to
        back and are gathered into again and again take `all_gather_blocks` instead."""
        n, world, rank = sum(sizes), self.world, self.rank
        dtype = outputs[0].dtype if inp is None else inp.dtype
        itemsize = outputs[0].element_size() if inp is None else inp.element_size()
        self._count("all_gather", world * n * itemsize)
        step, post = self.slot_bytes // itemsize, _post("all_gather", dtype, n)
        ends = list(itertools.accumulate(sizes))
        others = [r for r in range(world) if r != rank] if inp is None else None
        for start in _chunk_starts(n, step):
            k = min(step, n - start)
            slots = self._slots(dtype)
            dests, widths = (outputs, sizes) if k == n else _column_views(outputs, sizes, ends, start, k)
            if inp is None:
                torch.cat([d[rank] for d in dests], out=slots[rank, :k])
            else:
                slots[rank, :k].copy_(inp.reshape(-1)[start : start + k])
            self._meet(post)
            copy_columns(slots[:, :k], widths, dests, others)

    def all_gather_blocks(self, plans: list, inp: torch.Tensor) -> None:
        """An all-gather into the blocks of `plans` ([Note: the block layout of a gather]):
        `inp` (1D, contiguous) holds this rank's columns of every block, plan after plan."""
        world, rank, dtype, itemsize = self.world, self.rank, inp.dtype, inp.element_size()
        capacity = self.slot_bytes // itemsize  # columns one half holds for every rank
        n = sum(plan.n for plan in plans)
        self._count("all_gather", world * n * itemsize)
        post, copy = _post("all_gather", dtype, n), _copy_pieces()
        packed: list = []  # (plan, unit, columns before it in the half, the plan's first column in inp)
        used, met, at = 0, False, 0
        for plan in plans:
            for unit in plan.units(world, rank, itemsize, capacity):
                if unit.table is None or used + unit.cols > capacity:
                    if packed:
                        self._gather_packed(packed, inp, post, copy)
                        packed, used, met = [], 0, True
                    if unit.table is None:  # one block wider than a half: by columns
                        self._gather_wide(plan, unit.first, inp, at, post)
                        met = True
                        continue
                packed.append((plan, unit, used, at))
                used += unit.cols
            at += plan.n
        if packed or not met:  # an empty gather still meets, so the ranks compare their ops
            self._gather_packed(packed, inp, post, copy)

    def _gather_packed(self, packed: list, inp: torch.Tensor, post: tuple, copy) -> None:
        world = self.world
        size = world * self.slot_bytes
        region = self._data[self._half * size : (self._half + 1) * size].view(inp.dtype)
        for _, unit, used, at in packed:
            unit.scatter(copy, region, world * used, inp, at)
        self._meet(post)
        for plan, unit, used, _ in packed:
            first = world * plan.starts[unit.first]
            plan.flat[first : first + world * unit.cols].copy_(
                region[world * used : world * (used + unit.cols)]
            )

    def _gather_wide(self, plan: BlockPlan, block: int, inp: torch.Tensor, at: int, post: tuple) -> None:
        size, world = plan.sizes[block], self.world
        first = plan.starts[block]
        out = plan.flat[world * first : world * (first + size)].view(world, size)
        src = inp[at + first : at + first + size]
        step = self.slot_bytes // inp.element_size()
        for start in _chunk_starts(size, step):
            k = min(step, size - start)
            slots = self._slots(inp.dtype)
            slots[self.rank, :k].copy_(src[start : start + k])
            self._meet(post)
            out[:, start : start + k].copy_(slots[:, :k])

    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """`out` (n elements) gets the sum over ranks of slice `rank` of `inp` (`world * n`)."""
        n, world = out.numel(), self.world
        self._count("reduce_scatter", out.numel() * out.element_size())
        step = self.slot_bytes // inp.element_size() // world
        src, dst, post = inp.reshape(world, n), out.view(-1), _post("reduce_scatter", inp.dtype, n)
        for start in _chunk_starts(n, step):
            k = min(step, n - start)
            slots = self._slots(inp.dtype)
            # This rank's slot holds its piece for every rank, destination-major: [world, k].
            slots[self.rank, : world * k].view(world, k).copy_(src[:, start : start + k])
            self._meet(post)
            mine = self.rank * k
            self._sum_rows([slots[r, mine : mine + k] for r in range(world)], dst[start : start + k])

    def reduce_scatter_columns(self, out: torch.Tensor, blocks: list, sizes: list, prescale: float) -> None:
        """`reduce_scatter_sum` of the `[world, n]` input that `blocks` (`[world, sizes[i]]`
        each) form side by side, packed straight into this rank's slot and multiplied there by
        `prescale` before the sum (no send buffer)."""
        n, world = out.numel(), self.world
        self._count("reduce_scatter", n * out.element_size())
        step = self.slot_bytes // out.element_size() // world
        dst, post = out.view(-1), _post("reduce_scatter", out.dtype, n)
        ends = list(itertools.accumulate(sizes))
        for start in _chunk_starts(n, step):
            k = min(step, n - start)
            slots = self._slots(out.dtype)
            mine = slots[self.rank, : world * k].view(world, k)  # destination-major, as above
            views, widths = (blocks, sizes) if k == n else _column_views(blocks, sizes, ends, start, k)
            if prescale == 1.0:
                torch.cat(views, dim=1, out=mine)
            else:  # scaled on the way in: one pass over the chunk, not a copy and a multiply
                for view, column in zip(views, mine.split(widths, dim=1)):
                    torch.mul(view, prescale, out=column)
            self._meet(post)
            at = self.rank * k
            self._sum_rows([slots[r, at : at + k] for r in range(world)], dst[start : start + k])

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Equal slices: slice `i` of `inp` (contiguous, `world` slices in flat order) goes to
        rank `i`, and slice `r` of `out` comes from rank `r`. Laid out in the slot as a
        reduce-scatter's ([world, k] destination-major); this rank's own slice never goes
        through it."""
        world, rank = self.world, self.rank
        n = inp.numel() // world
        self._count("all_to_all", inp.numel() * inp.element_size())
        step = self.slot_bytes // inp.element_size() // world
        src, dst, post = inp.reshape(world, n), out.view(world, n), _post("all_to_all", inp.dtype, n)
        for start in _chunk_starts(n, step):
            k = min(step, n - start)
            slots = self._slots(inp.dtype)
            mine = slots[rank, : world * k].view(world, k)
            for r in range(world):
                if r != rank:
                    mine[r].copy_(src[r, start : start + k])
            dst[rank, start : start + k].copy_(src[rank, start : start + k])
            self._meet(post)
            at = rank * k
            for r in range(world):
                if r != rank:
                    dst[r, start : start + k].copy_(slots[r, at : at + k])

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """`tensor` (contiguous) becomes the sum over ranks, the same bits on every rank."""
        self._count("all_reduce", tensor.numel() * tensor.element_size())
        flat = tensor.view(-1)
        for start, k, slots in self._rounds("all_reduce", flat):
            self._sum_rows([slots[r, :k] for r in range(self.world)], flat[start : start + k])

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` (contiguous) on every rank becomes group rank `src`'s."""
        self._count("broadcast", tensor.numel() * tensor.element_size())
        flat = tensor.view(-1)
        for start, k, slots in self._rounds("broadcast", flat, src):
            if self.rank != src:
                flat[start : start + k].copy_(slots[src, :k])

    # ------------------------------------------------------------------ internals

    def _rounds(self, kind: str, flat: torch.Tensor, src: int = -1) -> Iterator[tuple]:
        """The chunks of a collective whose rank contributes the 1D `flat`: for each, this rank
        copies its part into its slot (only rank `src`, for a broadcast), all ranks meet, and
        `(start, k, slots)` is yielded for the caller to read the chunk `[start, start + k)`."""
        n = flat.numel()
        step = self.slot_bytes // flat.element_size()
        post = _post(kind, flat.dtype, n, src)
        for start in _chunk_starts(n, step):
            k = min(step, n - start)
            slots = self._slots(flat.dtype)
            if src < 0 or self.rank == src:
                slots[self.rank, :k].copy_(flat[start : start + k])
            self._meet(post)
            yield start, k, slots

    def _count(self, kind: str, nbytes: int) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"shared-memory collectives of this group stopped after an error: {self._broken}"
            )
        row = self.counts.setdefault(kind, [0, 0])
        row[0] += 1
        row[1] += nbytes

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The current half as `[world, slot elements]` of `dtype`."""
        size = self.world * self.slot_bytes
        return self._data[self._half * size : (self._half + 1) * size].view(dtype).view(self.world, -1)

    @staticmethod
    def _sum_rows(rows: list, out: torch.Tensor) -> None:
        """`out = rows[0] + rows[1] + ...`, added in rank order."""
        if len(rows) == 1:
            out.copy_(rows[0])
            return
        torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)

    def _meet(self, post: tuple) -> None:
        """Post this chunk's op, announce this rank's writes, wait for every rank, compare posts."""
        half, posts = self._half, self._posts_view
        mine = 2 * (half * MAX_WORLD + self.rank)
        posts[mine], posts[mine + 1] = post
        with self._fence:  # a locked instruction: every store above is visible before the counter's
            self._arrived += 1
        target, arrivals = self._arrived, self._arrivals_view
        arrivals[self.rank] = target
        self._half ^= 1
        if min(arrivals) < target:
            self._wait_for(target)
        # The posts of this half stay until every rank passed the next barrier (as the data).
        first = 2 * half * MAX_WORLD
        everyone = [(posts[first + 2 * r], posts[first + 2 * r + 1]) for r in range(self.world)]
        if any(other != everyone[0] for other in everyone):
            self._broken = "the ranks called different collectives: " + ", ".join(
                f"rank {r}: {_describe(p)}" for r, p in enumerate(everyone)
            )
            raise RuntimeError(
                f"{self._broken} (every rank must make the same collectives in the same order with the same "
                "sizes; a rank that skipped one, or that took another code path, is the usual cause)"
            )

    def _wait_for(self, target: int) -> None:
        arrivals = self._arrivals_view
        started = time.monotonic()
        spin_until, next_check = started + _SPIN_S, started + _LIVENESS_CHECK_S
        while min(arrivals) < target:
            for _ in range(64):
                os.sched_yield()
                if min(arrivals) >= target:
                    return
            now = time.monotonic()
            if now < spin_until:
                continue
            time.sleep(0.0001)
            if now >= next_check:
                next_check = now + _LIVENESS_CHECK_S
                self._fail_if_stuck(target, now - started)

    def _fail_if_stuck(self, target: int, waited_s: float) -> None:
        missing = [r for r in range(self.world) if self._arrivals_view[r] < target]
        gone = [r for r in missing if self._peers and not _alive(self._peers[r])]
        if gone:
            why = (
                f"rank(s) {gone} (pid {[self._peers[r] for r in gone]}) exited while rank {self.rank} waited "
                "for them in a shared-memory collective; their own output says why"
            )
        elif waited_s > self._timeout_s:
            why = (
                f"rank {self.rank} waited {waited_s:.0f} s for rank(s) {missing} in a shared-memory collective "
                "(the comm timeout, DEEPSPEED_TIMEOUT minutes): they raised, hang, or took another code path"
            )
        else:
            return
        self._broken = why
        raise RuntimeError(why)


class BlockPlan:
    """One run of a gather's outputs, `[world, sizes[i]]` blocks back to back in `flat`, and
    how they travel through the segment (kept with them: a module's buffer is reused).

    [Note: the block layout of a gather]
    A gather's rank-major result `[world, n]` must end up split into per-parameter blocks.
    Copied out of the ranks' slots by columns, that is a piece per parameter and rank read
    from memory another core just wrote; at 10 KB a piece, the hardware prefetchers never get
    going and every line waits on the other core: 2 CPU ranks, 4 MB in 100 parameters, the
    copy out took 0.31-0.45 ms against 0.21 ms for the same bytes in 2 pieces (the pieces
    copied by torch.cat or by memcpy alike). So the pieces move on the write side instead:
    each rank copies its part of each block straight to where the block will lie in the
    current half, `[block 0: rank 0 | rank 1 | ...][block 1: ...]`, and after the barrier
    every rank reads the half back in one contiguous copy (0.18 ms). Writing 100 pieces
    from a rank's own shards costs about what one contiguous write does (0.17 ms); the whole
    collective took 0.38-0.40 ms against 0.41-0.44 for a raw all-gather of the same bytes,
    in one run. The pieces are copied by `shm_copy` (plain C, one call per half; torch's
    dispatch costs more per piece than the copy), or by torch where it cannot be built.

    Blocks are packed into units of at most a half (`capacity` columns for each rank), a
    unit never splitting a block; a block wider than a half alone goes by columns, as the
    slots carry it. Each unit keeps its copy table: bytes to, from and how many per piece.
    """

    __slots__ = ("flat", "sizes", "starts", "n", "_units", "_key")

    def __init__(self, flat: torch.Tensor, sizes: list) -> None:
        self.flat, self.sizes = flat, list(sizes)
        self.starts = [0, *itertools.accumulate(self.sizes)]  # column where each block starts; n last
        self.n = self.starts[-1]
        self._units: list = []
        self._key: Optional[tuple] = None

    def units(self, world: int, rank: int, itemsize: int, capacity: int) -> list:
        key = (world, rank, itemsize, capacity)
        if key != self._key:
            self._units, self._key = self._make_units(world, rank, itemsize, capacity), key
        return self._units

    def _make_units(self, world: int, rank: int, itemsize: int, capacity: int) -> list:
        units, starts, count, i = [], self.starts, len(self.sizes), 0
        while i < count:
            if self.sizes[i] > capacity:
                units.append(_Unit(i, i + 1, self.sizes[i], None))
                i += 1
                continue
            j = i + 1
            while j < count and starts[j + 1] - starts[i] <= capacity:
                j += 1
            to, source, length = [], [], []
            for b in range(i, j):
                if self.sizes[b]:
                    to.append((world * (starts[b] - starts[i]) + rank * self.sizes[b]) * itemsize)
                    source.append(starts[b] * itemsize)
                    length.append(self.sizes[b] * itemsize)
            table = torch.tensor([to, source, length], dtype=torch.int64, device="cpu")
            units.append(_Unit(i, j, starts[j] - starts[i], table))
            i = j
        return units


class _Unit:
    """Blocks `[first, last)` of a plan, `cols` columns, that travel through one half together
    (`table`: `[3, pieces]` int64, byte offsets to, from and lengths; None: one wide block by
    columns). It holds no reference to its plan: a cycle would keep the plan's output buffer
    alive until the garbage collector ran (a module's whole gathered memory)."""

    __slots__ = ("first", "last", "cols", "table")

    def __init__(self, first: int, last: int, cols: int, table: Optional[torch.Tensor]) -> None:
        self.first, self.last, self.cols, self.table = first, last, cols, table

    def scatter(self, copy, region: torch.Tensor, to: int, inp: torch.Tensor, at: int) -> None:
        """This rank's pieces of the unit from `inp` (its plan's columns from `at`) into
        `region` from element `to` on, each where its block's row lies."""
        pieces = self.table.shape[1]
        if copy is not None:
            table, item = self.table, inp.element_size()
            step = table.stride(0) * table.element_size()
            copy(pieces, region.data_ptr() + to * item, table.data_ptr(), inp.data_ptr() + at * item,
                 table.data_ptr() + step, table.data_ptr() + 2 * step)  # fmt: skip
            return
        item = inp.element_size()
        for dst, src, length in self.table.t().tolist():
            region[to + dst // item : to + (dst + length) // item].copy_(
                inp[at + src // item : at + (src + length) // item]
            )


def _copy_pieces():
    """`shm_copy`'s `copy_pieces`, or None where it cannot be built (one warning)."""
    from deepspeed.ops.op_builder import ALL_OPS

    native = ALL_OPS["shm_copy"].try_load()
    return None if native is None else native.copy_pieces


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share memory (an in-place collective: the input is a slice of the output)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (
        a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()
    )


def equal_slices(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, world: int) -> bool:
    """Whether an all-to-all moves equal slices the shared-memory channel can carry: one
    dtype, no aliasing, `world` equal slices along dim 0 (no split sizes, or equal ones)."""
    if world < 1 or out.dtype != inp.dtype or out.numel() != inp.numel() or inp.dim() == 0:
        return False
    rows = inp.shape[0]
    if rows % world or out.shape[0] != rows or overlaps(inp, out):
        return False
    even = [rows // world] * world
    return all(splits is None or list(splits) == even for splits in (out_splits, in_splits))


def copy_columns(source: torch.Tensor, sizes: list, outputs: list, rows: Optional[list] = None) -> None:
    """Split `source` (`[world, sum(sizes)]`) by columns into `outputs` (`[world, sizes[i]]`
    each); only the rows in `rows` when given."""
    if rows is None:
        torch.split_with_sizes_copy(source, sizes, dim=1, out=outputs)
        return
    for r in rows:
        torch.split_with_sizes_copy(source[r], sizes, dim=0, out=[out[r] for out in outputs])


def _column_views(tensors: list, sizes: list, ends: list, start: int, k: int) -> tuple:
    """`(views, widths)`: the parts of `tensors` (`[world, sizes[i]]` each, side by side;
    `ends`: the running sum of `sizes`) in columns `[start, start + k)`.

    Only the first and last tensor of the range are sliced; the ones between are whole. A
    collective calls this once per chunk, and slicing every tensor of a hundred-parameter
    module each time cost as much as the copy itself.
    """
    stop = start + k
    lo = bisect.bisect_right(ends, start)  # the first tensor that ends after `start`
    hi = bisect.bisect_left(ends, stop, lo) + 1  # one past the tensor that holds column `stop - 1`
    views, widths = tensors[lo:hi], sizes[lo:hi]  # new lists: the ends may be replaced below
    head = start - (ends[lo] - sizes[lo])  # columns of the first tensor before the chunk
    tail = ends[hi - 1] - stop  # columns of the last tensor after it
    if head:
        views[0], widths[0] = views[0][:, head:], widths[0] - head
    if tail:
        views[-1], widths[-1] = views[-1][:, : widths[-1] - tail], widths[-1] - tail
    return views, widths


def _chunk_starts(n: int, step: int) -> range:
    """Where each chunk of an `n`-element op starts: at least one, so an empty op still meets
    (and is compared with the other ranks' ops)."""
    return range(0, max(n, 1), step)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
