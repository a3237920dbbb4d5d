"""The comm facade on real spawned process groups (gloo on CPU), and the harness's failure paths."""

import contextlib
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from tests.unit.common import DistributedTest, _run_distributed, get_free_port


def gloo_only():
    """Collectives of this block take the process group's own path, not shared memory."""
    from deepspeed.comm import comm as facade

    return mock.patch.object(facade, "_shm_channel", lambda group, *tensors: None)


class TestCollectives(DistributedTest):
    world_size = [1, 2, 4]

    def test_facade_collectives(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        assert dist.is_initialized()
        assert int(os.environ["RANK"]) == rank and dist.get_local_rank() == rank
        assert dist.get_backend() in ("gloo", "nccl")

        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(sum(range(size)))))

        t = torch.full((2,), float(rank))
        dist.broadcast(t, src=size - 1)
        assert torch.equal(t, torch.full((2,), float(size - 1)))

        shard = torch.arange(3, dtype=torch.float32) + 10 * rank
        full = torch.empty(3 * size)
        handle = dist.all_gather_into_tensor(full, shard, async_op=True)
        handle.wait()
        handle.wait()  # waiting twice is harmless
        expected = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(size)])
        assert torch.equal(full, expected)

        contrib = torch.arange(2 * size, dtype=torch.float32) * (rank + 1)
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, contrib).wait()
        scale = sum(r + 1 for r in range(size))
        assert torch.equal(out, torch.arange(2 * size, dtype=torch.float32)[2 * rank : 2 * rank + 2] * scale)

        out_async = torch.empty(2)
        send = contrib.clone()
        handle = dist.reduce_scatter_tensor(out_async, send, async_op=True, input_reusable=True)
        handle.wait()
        assert torch.equal(out_async, out)

        gathered = [torch.empty(1) for _ in range(size)]
        dist.all_gather(gathered, torch.tensor([float(rank)]))
        assert [g.item() for g in gathered] == list(range(size))

        objs = [None] * size
        dist.all_gather_object(objs, {"rank": rank})
        assert [o["rank"] for o in objs] == list(range(size))
        dist.barrier()

    def test_all_gather_both_gloo_paths(self):
        """Below and above GLOO_BROADCAST_MIN_BYTES (one broadcast per rank), sync and async,
        out of place, in place (the input is this rank's chunk of the output) and on a subgroup."""
        with gloo_only():
            self._all_gather_cases()

    def _all_gather_cases(self):
        from deepspeed.comm import comm as facade

        rank, size = dist.get_rank(), dist.get_world_size()
        big = facade.GLOO_BROADCAST_MIN_BYTES // 4 // size + 5  # elements per rank: over the threshold
        for per_rank in (7, big):
            expected = torch.cat([torch.arange(per_rank, dtype=torch.float32) * (r + 1) for r in range(size)])
            mine = torch.arange(per_rank, dtype=torch.float32) * (rank + 1)
            for async_op in (False, True):
                full = torch.full((per_rank * size,), -1.0)
                dist.all_gather_into_tensor(full, mine, async_op=async_op).wait()
                assert torch.equal(full, expected), (per_rank, async_op)
                in_place = torch.full((per_rank * size,), -1.0)
                in_place.view(size, per_rank)[rank].copy_(mine)
                dist.all_gather_into_tensor(
                    in_place, in_place.view(size, per_rank)[rank], async_op=async_op
                ).wait()
                assert torch.equal(in_place, expected), ("in place", per_rank, async_op)
            with pytest.raises(ValueError, match="not .* ranks x the input"):
                dist.all_gather_into_tensor(torch.empty(per_rank * size + size), mine)
        if size == 1:
            return
        odds = list(range(1, size, 2))
        group = dist.new_group(odds)  # every rank calls new_group
        if rank in odds:
            me = dist.get_rank(group)
            mine = torch.full((big,), float(rank))
            full = torch.empty(big * len(odds))
            dist.all_gather_into_tensor(full, mine, group=group)
            assert torch.equal(full, torch.cat([torch.full((big,), float(r)) for r in odds])), me

    def test_reduce_scatter_paths(self):
        """A sum on gloo is an all-to-all plus a local add in rank order (comm.py's note): into a
        caller's scratch or not, async, bf16, odd sizes; other ops all-reduce and keep the slice."""
        with gloo_only():
            self._reduce_scatter_cases()

    def _reduce_scatter_cases(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        n = 1001  # odd: no size is a multiple of a vector width
        contribs = [torch.randn(size * n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
        mine = contribs[rank]
        expected = contribs[0][rank * n : (rank + 1) * n].clone()
        for c in contribs[1:]:
            expected += c[rank * n : (rank + 1) * n]  # rank order: bitwise what ours computes
        for scratch in (None, torch.full((size * n + 7,), float("nan"))):
            for async_op in (False, True):
                out = torch.full((n,), -1.0)
                handle = dist.reduce_scatter_tensor(out, mine.clone(), async_op=async_op, scratch=scratch)
                handle.wait()
                assert torch.equal(out, expected), (scratch is None, async_op)
        out16 = torch.empty(n, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out16, mine.to(torch.bfloat16))
        torch.testing.assert_close(out16.float(), expected, rtol=2e-2, atol=2e-2 * size)
        out_max = torch.empty(n)
        dist.reduce_scatter_tensor(out_max, mine, op=dist.ReduceOp.MAX)
        maxed = torch.stack(contribs).amax(0)[rank * n : (rank + 1) * n]
        assert torch.equal(out_max, maxed)
        with pytest.raises(ValueError, match="not .* ranks x the output"):
            dist.reduce_scatter_tensor(torch.empty(n + 1), mine)
        if dist.get_backend() == "gloo":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                dist.reduce_scatter_tensor(torch.empty(n), mine)
            names = {e.name for e in prof.events()}
            assert any("all_to_all" in name or "alltoall" in name for name in names), sorted(names)
            assert not any("all_reduce" in name or "allreduce" in name for name in names), sorted(names)

    def test_groups(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        evens = list(range(0, size, 2))
        group = dist.new_group(evens)  # every rank must call new_group, members or not
        if rank in evens:
            assert dist.get_world_size(group) == len(evens)
            assert dist.get_global_rank(group, dist.get_rank(group)) == rank
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            assert t.item() == len(evens)
        assert dist.get_all_ranks_from_group() == list(range(size))
        assert deepspeed.utils.groups._get_data_parallel_world_size() == size

    def test_no_future_warnings_from_our_calls(self):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            full = torch.empty(dist.get_world_size())
            dist.all_gather_into_tensor(full, torch.ones(1))
            dist.reduce_scatter_tensor(torch.empty(1), torch.ones(dist.get_world_size()))

    def test_the_rest_of_upstreams_surface(self):
        """Point-to-point, gather/scatter, list forms, aliases, coalesced calls and probes (code
        written for upstream's deepspeed.comm calls them), upstream's `tensor=` keyword, and a
        rank outside a subgroup: torch's warning and return (it was a TypeError here)."""
        rank, size = dist.get_rank(), dist.get_world_size()
        assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
        assert dist.has_all_reduce_coalesced() and isinstance(dist.has_coalescing_manager(), bool)
        if size > 1:  # a ring: send to the next rank, receive from the previous
            got = torch.empty(2)
            if rank % 2 == 0:
                dist.send(torch.full((2,), float(rank)), (rank + 1) % size)
                assert dist.recv(got, (rank - 1) % size) == (rank - 1) % size
            else:
                assert dist.recv(got) == (rank - 1) % size  # any sender
                dist.send(torch.full((2,), float(rank)), (rank + 1) % size)
            assert torch.equal(got, torch.full((2,), float((rank - 1) % size)))
            handles = [dist.isend(torch.full((1,), float(rank)), (rank + 1) % size), dist.irecv(got[:1])]
            for handle in handles:
                handle.wait()
            assert got[0].item() == float((rank - 1) % size)
        everyone = [torch.empty(2) for _ in range(size)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank)), everyone, dst=0)
        if rank == 0:
            assert [t[0].item() for t in everyone] == [float(r) for r in range(size)]
        mine = torch.empty(3)
        dist.scatter(mine, [torch.full((3,), float(r)) for r in range(size)] if rank == 0 else None, src=0)
        assert torch.equal(mine, torch.full((3,), float(rank)))
        outs = [torch.empty(1) for _ in range(size)]
        dist.all_to_all(outs, [torch.full((1,), float(10 * rank + r)) for r in range(size)])
        assert [t.item() for t in outs] == [float(10 * r + rank) for r in range(size)]
        summed = torch.empty(2)
        dist.reduce_scatter(summed, [torch.full((2,), float(r + rank)) for r in range(size)])
        assert torch.equal(summed, torch.full((2,), float(sum(rank + r for r in range(size)))))
        full = torch.empty(size)
        dist.allgather_fn(full, torch.full((1,), float(rank)))
        assert full.tolist() == [float(r) for r in range(size)]
        dist.all_gather_into_tensor(full, tensor=torch.full((1,), float(rank)))  # upstream's keyword
        out = torch.empty(1)
        dist.reduce_scatter_fn(out, torch.ones(size))
        assert out.item() == float(size)
        dist.reduce_scatter_tensor(out, tensor=torch.ones(size))
        dist.all_to_all_single(torch.empty(size), tensor=torch.ones(size))
        t = torch.ones(3)
        dist.inference_all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(size)))
        pieces = [torch.ones(2, 2), torch.arange(3), torch.full((1,), 2.0)]
        for async_op in (False, True):
            values = [p.clone() for p in pieces]
            handle = dist.all_reduce_coalesced(values, async_op=async_op)
            handle.wait()
            assert all(torch.equal(v, p * size) for v, p in zip(values, pieces)), async_op
        outs = [torch.empty(size), torch.empty(2 * size, dtype=torch.int64)]
        dist.all_gather_coalesced(
            outs, [torch.full((1,), float(rank)), torch.full((2,), rank)], async_op=True
        ).wait()
        assert outs[1].tolist() == [r for r in range(size) for _ in range(2)]
        first = dist.new_group([0])
        if rank != 0:  # outside the group: torch warns and returns, for each collective
            with pytest.warns(UserWarning, match="does not belong to the given group"):
                dist.barrier(group=first)
                dist.all_reduce(torch.ones(1), group=first)
                dist.all_gather_into_tensor(torch.empty(1), torch.ones(1), group=first)
                dist.reduce_scatter_tensor(torch.empty(1), torch.ones(1), group=first)
                dist.broadcast(torch.ones(1), 0, group=first)
        else:
            dist.all_reduce(torch.ones(1), group=first)
        dist.barrier()

    def test_init_distributed_is_noop_when_initialized(self):
        dist.init_distributed(dist_backend="gloo", verbose=False)
        assert dist.is_initialized()


def _values(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(100 + seed)) * 10).to(dtype)


class TestSharedMemoryCollectives(DistributedTest):
    """[Note: shared-memory collectives] (comm/shm.py): on a gloo group of one host, the
    facade's all-gather, reduce-scatter, all-reduce, broadcast and barrier go through a
    shared segment; each must give exactly the reference's bits."""

    world_size = [2, 4]

    def test_every_op_gives_the_reference_bits_across_chunks(self):
        from deepspeed.comm import comm as facade
        from deepspeed.comm import shm

        rank, size = dist.get_rank(), dist.get_world_size()
        with mock.patch.object(shm, "SLOT_BYTES", 256):  # a new group's channel: tiny chunks
            group = dist.new_group(list(range(size)))
            channel = facade._shm_channel(group, torch.zeros(1))
        assert channel is not None and channel.slot_bytes == 256
        cases = [
            (dtype, n)
            for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64)
            for n in (1, 63, 1001)
        ]
        for dtype, n in cases:
            others = [_values(r, n, dtype) for r in range(size)]
            full = torch.empty(size * n, dtype=dtype)
            dist.all_gather_into_tensor(full, others[rank], group=group)
            assert torch.equal(full, torch.cat(others)), (dtype, n)
            in_place = torch.zeros(size * n, dtype=dtype)
            in_place.view(size, n)[rank].copy_(others[rank])
            dist.all_gather_into_tensor(
                in_place, in_place.view(size, n)[rank], group=group, async_op=True
            ).wait()
            assert torch.equal(in_place, full), ("in place", dtype, n)
            # Checked on this path too, on every rank alike, before anything is sent.
            with pytest.raises(
                ValueError, match=f"output has {size * n + 1} elements, which is not {size} ranks"
            ):
                dist.all_gather_into_tensor(torch.empty(size * n + 1, dtype=dtype), others[rank], group=group)

            contribs = [_values(r, size * n, dtype) for r in range(size)]
            expected = contribs[0][rank * n : (rank + 1) * n].clone()
            for c in contribs[1:]:
                expected += c[rank * n : (rank + 1) * n]  # rank order, as the channel adds
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, contribs[rank], group=group, async_op=True).wait()
            assert torch.equal(out, expected), ("reduce-scatter", dtype, n)

            total = others[0].clone()
            for other in others[1:]:
                total += other
            summed = others[rank].clone()
            dist.all_reduce(summed, group=group)
            assert torch.equal(summed, total), ("all-reduce", dtype, n)

            sent = others[rank].clone()
            dist.broadcast(sent, src=size - 1, group=group)
            assert torch.equal(sent, others[size - 1]), ("broadcast", dtype, n)

            # Slice i of rank r's input lands in slice r of rank i's output (rows of 2 here).
            swapped = torch.empty(size * n, 2, dtype=dtype)
            sends = [_values(r, size * n * 2, dtype).view(size * n, 2) for r in range(size)]
            dist.all_to_all_single(swapped, sends[rank], group=group, async_op=True).wait()
            expected = torch.cat([sends[r].view(size, n, 2)[rank] for r in range(size)])
            assert torch.equal(swapped, expected), ("all-to-all", dtype, n)
        # qgZ's payloads are int8; split sizes given, when equal, take the channel too.
        payloads = [
            torch.arange(size * 300, dtype=torch.int64).add(r * 7).remainder(251).to(torch.uint8)
            for r in range(size)
        ]
        got = torch.empty(size * 300, dtype=torch.uint8)
        dist.all_to_all_single(got, payloads[rank], [300] * size, [300] * size, group=group)
        assert torch.equal(got, torch.cat([p[rank * 300 : (rank + 1) * 300] for p in payloads]))
        dist.barrier(group=group)
        calls = {kind: row[0] for kind, row in channel.counts.items()}
        assert calls == {
            "all_gather": 2 * len(cases),
            "reduce_scatter": len(cases),
            "all_reduce": len(cases),
            "broadcast": len(cases),
            "all_to_all": len(cases) + 1,
            "barrier": 1,
        }, calls
        if size > 1:  # unequal slices keep gloo's path, which the channel does not count
            splits = [1 + rank + i for i in range(size)]  # rank r sends 1 + r + i to rank i
            out = torch.empty(sum(splits), dtype=torch.float32)
            dist.all_to_all_single(out, torch.full((sum(splits),), float(rank)), splits, splits, group=group)
            assert torch.equal(out, torch.cat([torch.full((k,), float(r)) for r, k in enumerate(splits)]))
            assert "all_to_all" not in channel.counts or channel.counts["all_to_all"][0] == len(cases) + 1

    def test_all_gather_into_columns_on_both_paths(self):
        """Each output gets its column block of the rank-major result, whether the columns go
        straight from the slots (across chunk boundaries, into strided views) or through gloo."""
        from deepspeed.comm import comm as facade
        from deepspeed.comm import shm

        rank, size = dist.get_rank(), dist.get_world_size()
        with mock.patch.object(shm, "SLOT_BYTES", 256):  # 64 fp32 per chunk: outputs straddle chunks
            group = dist.new_group(list(range(size)))
            assert facade.completes_on_issue(group, torch.zeros(1))
        sizes = [1, 70, 5, 64, 3]
        everyone = [_values(r, sum(sizes), torch.float32) for r in range(size)]
        expected = list(torch.cat(everyone).view(size, -1).split(sizes, dim=1))
        for path in ("shm", "gloo"):
            with gloo_only() if path == "gloo" else contextlib.nullcontext():
                wide = torch.full((size, 200), -1.0)  # one output is a strided view of a wider tensor
                outputs = [torch.full((size, n), -1.0) for n in sizes]
                outputs[3] = wide[:, 10:74]
                scratch = None if path == "shm" else torch.empty(size * sum(sizes) + 3)
                facade.all_gather_into_columns(outputs, sizes, everyone[rank], group=group, scratch=scratch)
                for got, want in zip(outputs, expected):
                    assert torch.equal(got, want), path
                assert (wide[:, :10] == -1).all() and (wide[:, 74:] == -1).all(), path

                # In place (stages 1 and 2 after a step): each output's own row is this rank's
                # part; it is read, never written, and only the other ranks' rows are copied.
                wide = torch.full((size, 200), -1.0)
                outputs = [torch.full((size, n), -1.0) for n in sizes]
                outputs[3] = wide[:, 10:74]
                for out, part in zip(outputs, everyone[rank].split(sizes)):
                    out[rank] = part
                with mock.patch.object(shm, "copy_columns", wraps=shm.copy_columns) as copy_columns:
                    facade.all_gather_into_columns(outputs, sizes, None, group=group, scratch=scratch)
                copied = [c.args[3] for c in copy_columns.call_args_list]
                for got, want in zip(outputs, expected):
                    assert torch.equal(got, want), path
                assert (wide[:, :10] == -1).all() and (wide[:, 74:] == -1).all(), path
                assert copied and all(rows == [r for r in range(size) if r != rank] for rows in copied), (
                    path,
                    copied,
                )
                # Outputs back to back in flat tensors, with block plans kept across gathers:
                # two runs, blocks packed into halves of 64 columns, one wider than a half.
                for native in (True, False):
                    flats = [
                        torch.full((size * sum(sizes[:3]),), -1.0),
                        torch.full((size * sum(sizes[3:]),), -1.0),
                    ]
                    runs = [sizes[:3], sizes[3:]]
                    plans = [shm.BlockPlan(f, r) for f, r in zip(flats, runs)]
                    outputs = [
                        b.view(size, n)
                        for f, r in zip(flats, runs)
                        for b, n in zip(f.split([size * n for n in r]), r)
                    ]
                    unbuilt = mock.patch.object(shm, "_copy_pieces", lambda: None)
                    for again in range(2):
                        for f in flats:
                            f.fill_(-1.0)
                        with contextlib.nullcontext() if native else unbuilt:
                            facade.all_gather_into_columns(
                                outputs, sizes, everyone[rank], group=group, plans=plans
                            )
                        for got, want in zip(outputs, expected):
                            assert torch.equal(got, want), (path, native, again)
                    if path == "shm":  # [1, 70 (wide), 5] then [64, 3]: 70 and 64+3 cannot share a half
                        kinds = [[(u.first, u.last, u.table is None) for u in p._units] for p in plans]
                        assert kinds == [
                            [(0, 1, False), (1, 2, True), (2, 3, False)],
                            [(0, 1, False), (1, 2, False)],
                        ]
        with pytest.raises(ValueError, match="do not split"):
            facade.all_gather_into_columns(outputs, [1, 2], everyone[rank], group=group)

    def test_reduce_scatter_columns_packs_blocks_into_the_slot(self):
        """The blocks' columns, across chunk boundaries and as strided views, reduce to what
        reduce_scatter_tensor gives for their concatenation, prescaled before the sum."""
        from deepspeed.comm import comm as facade
        from deepspeed.comm import shm

        rank, size = dist.get_rank(), dist.get_world_size()
        with mock.patch.object(shm, "SLOT_BYTES", 256):
            group = dist.new_group(list(range(size)))
        sizes = [1, 40, 5, 33]
        n = sum(sizes)
        contribs = [_values(r, size * n, torch.float32) for r in range(size)]
        expected = (contribs[0].view(size, n)[rank] * 0.25).clone()
        for c in contribs[1:]:
            expected += c.view(size, n)[rank] * 0.25  # each rank scales first, then the rank-order sum
        wide = torch.zeros(size, 100)
        blocks = list(contribs[rank].view(size, n).split(sizes, dim=1))
        wide[:, 7:47] = blocks[1]
        blocks[1] = wide[:, 7:47]  # a strided view
        out = torch.empty(n)
        facade.reduce_scatter_columns(out, blocks, group=group, prescale=0.25)
        assert torch.equal(out, expected)
        with pytest.raises(ValueError, match="do not form"):
            facade.reduce_scatter_columns(torch.empty(n + 1), blocks, group=group)
        with gloo_only(), pytest.raises(RuntimeError, match="do not complete on issue"):
            facade.reduce_scatter_columns(out, blocks, group=group)

    def test_subgroups_gloo_in_flight_and_switching_off(self):
        """A subgroup's broadcast takes a global source rank; an asynchronous gloo collective
        in flight meanwhile is undisturbed; DEEPSPEED_SHM_COMM=0 keeps a new group on gloo."""
        from deepspeed.comm import comm as facade

        rank, size = dist.get_rank(), dist.get_world_size()
        odds = list(range(1, size, 2)) if size > 2 else [0, 1]
        group = dist.new_group(odds)
        if rank in odds:
            t = torch.full((5,), float(rank))
            dist.broadcast(t, src=odds[-1], group=group)
            assert torch.equal(t, torch.full((5,), float(odds[-1])))
            assert facade._shm_channel(group, t) is not None

        peak = torch.tensor([float(rank)])
        handle = dist.all_reduce(peak, op=dist.ReduceOp.MAX, async_op=True)  # not a sum: gloo
        ones = torch.ones(3)
        dist.all_reduce(ones)
        handle.wait()
        assert peak.item() == size - 1 and torch.equal(ones, torch.full((3,), float(size)))

        with mock.patch.dict(os.environ, {"DEEPSPEED_SHM_COMM": "0"}):
            plain = dist.new_group(list(range(size)))
            t = torch.ones(2)
            dist.all_reduce(t, group=plain)
            assert facade._shm_channel(plain, t) is None
        assert torch.equal(t, torch.full((2,), float(size)))

        # A value that means neither: every rank raises, naming the rank that has it.
        with mock.patch.dict(os.environ, {"DEEPSPEED_SHM_COMM": "off"} if rank == size - 1 else {}):
            odd = dist.new_group(list(range(size)))
            with pytest.raises(
                ValueError, match=rf"rank {size - 1}: DEEPSPEED_SHM_COMM='off' is neither 0 nor 1"
            ):
                dist.all_reduce(torch.ones(2), group=odd)

    def test_ranks_that_disagree_all_raise_naming_each_ones_op(self):
        """Sizes that differ (gloo would report a mismatch) or a rank that makes another
        collective: every rank raises at the same barrier instead of reading the slots wrongly."""
        rank, size = dist.get_rank(), dist.get_world_size()
        group = dist.new_group(list(range(size)))
        n = 8 if rank == 0 else 6
        with pytest.raises(
            RuntimeError, match="rank 0: all_gather of 8 float32, rank 1: all_gather of 6 float32"
        ):
            dist.all_gather_into_tensor(torch.empty(size * n), torch.ones(n), group=group)
        with pytest.raises(RuntimeError, match="stopped after an error"):
            dist.barrier(group=group)  # a group whose ranks fell out of step stays refused

        group = dist.new_group(list(range(size)))
        with pytest.raises(RuntimeError, match="rank 0: all_reduce of 3 float32, rank 1: barrier"):
            if rank == 0:
                dist.all_reduce(torch.ones(3), group=group)
            else:
                dist.barrier(group=group)


def _lone_channel(timeout_s: float):
    """Rank 0 of a 2-rank channel whose rank 1 never comes."""
    from deepspeed.comm import shm

    path, token = shm.create_segment(2, 64)
    try:
        return shm.ShmChannel(path, token, 2, 0, timeout_s, slot_bytes=64)
    finally:
        os.unlink(path)


def test_shm_wait_names_a_peer_that_exited_and_the_channel_refuses_after():
    channel = _lone_channel(timeout_s=600)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    channel.check_liveness_of([os.getpid(), gone.pid])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[1\] \(pid \[{gone.pid}\]\) exited"):
        channel.all_reduce_sum(torch.ones(3))
    assert time.monotonic() - start < 10  # about a second, not the 600 s timeout
    with pytest.raises(RuntimeError, match="stopped after an error"):
        channel.barrier()


def test_shm_wait_times_out_naming_the_missing_rank():
    channel = _lone_channel(timeout_s=0.5)
    with pytest.raises(RuntimeError, match=r"waited \d+ s for rank\(s\) \[1\]"):
        channel.all_gather(torch.empty(4), torch.ones(2))


def test_shm_refuses_a_segment_rank_0_did_not_write():
    from deepspeed.comm import shm

    path, _ = shm.create_segment(2, 64)
    try:
        with pytest.raises(ValueError, match="do not share /dev/shm"):
            shm.ShmChannel(path, b"x" * 16, 2, 1, 60.0, slot_bytes=64)
    finally:
        os.unlink(path)
    with mock.patch.dict(os.environ, {"DEEPSPEED_SHM_COMM": "0"}):
        assert shm.unsupported_reason(2) == "DEEPSPEED_SHM_COMM=0"


def test_shm_column_views_match_slicing_every_tensor():
    """A chunk's views of side-by-side blocks (only the range's end blocks sliced) equal
    slicing each block that overlaps the chunk, zero-width blocks and every chunk edge included."""
    import itertools

    from deepspeed.comm.shm import _column_views

    sizes = [3, 0, 7, 1, 0, 5, 9]
    ends = list(itertools.accumulate(sizes))
    blocks = [torch.arange(2 * n).view(2, n) + 100 * i for i, n in enumerate(sizes)]
    whole = torch.cat(blocks, dim=1)
    n = ends[-1]
    for start in range(n):
        for k in range(1, n - start + 1):
            views, widths = _column_views(blocks, sizes, ends, start, k)
            assert widths == [v.shape[1] for v in views], (start, k)
            assert torch.equal(torch.cat(views, dim=1), whole[:, start : start + k]), (start, k)
            assert views[0].shape[1] > 0 and views[-1].shape[1] > 0, (start, k)


class TestFileInit(DistributedTest):
    world_size = [2]
    reuse_dist_env = False
    init_distributed = False

    def test_file_init(self, tmp_path):
        rank = int(os.environ["RANK"])
        dist.init_distributed(
            dist_backend="gloo",
            init_method=f"file://{tmp_path}/rendezvous",
            rank=rank,
            world_size=2,
            verbose=False,
        )
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()


class TestDeadPeerTimesOut(DistributedTest):
    world_size = [2]
    reuse_dist_env = False
    init_distributed = False

    def test_missing_rank_becomes_error(self):
        os.environ["DEEPSPEED_TIMEOUT"] = "0.05"  # 3 seconds
        dist.init_distributed(dist_backend="gloo", verbose=False)
        if dist.get_rank() == 0:
            start = time.monotonic()
            with pytest.raises(RuntimeError):
                dist.all_reduce(torch.ones(1))  # rank 1 never joins
            assert time.monotonic() - start < 60
            # the shared-memory set-up that waited for rank 1 left no segment behind
            assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"deepspeed-comm-{os.getpid()}-")]
        else:
            time.sleep(8)  # stay alive past rank 0's timeout, without joining


def test_single_process_init_without_env(monkeypatch):
    """A plain script (no launcher env) initializes as rank 0 of 1 in a child process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(get_free_port())
    code = "import deepspeed; deepspeed.init_distributed(verbose=False); import deepspeed.comm as d; print(d.get_rank(), d.get_world_size())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]


def test_single_process_init_takes_a_free_port_when_its_port_is_busy():
    """A lone process has no peer to agree on a port with: a busy `distributed_port` (another
    job's rendezvous on 29500) must not fail it; an explicit MASTER_PORT is still taken as set."""
    import socket

    from deepspeed.launcher.launch import lone_rendezvous_port

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert lone_rendezvous_port(port) != port
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
        }
        code = (
            f"import deepspeed, os; deepspeed.init_distributed(distributed_port={port}, verbose=False); "
            "import deepspeed.comm as d; print(d.get_world_size(), os.environ['MASTER_PORT'])"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        world, used = out.stdout.split()
        assert world == "1" and int(used) != port
    free = get_free_port()
    assert lone_rendezvous_port(free) == free


@pytest.mark.parametrize("call", ["get_rank", "get_world_size"])
def test_rank_queries_before_init_raise(monkeypatch, call):
    """Before the group exists the answer would be a guess (every launched process would think
    it is rank 0 of 1): raise, naming the fix, as upstream does."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(
        RuntimeError, match=rf"deepspeed.comm.{call}\(\) was called before .*init_distributed"
    ):
        getattr(dist, call)()


def test_init_distributed_rejects_half_env(monkeypatch):
    # Another test in this process may have left a single-rank group up, which init_distributed
    # would wrap as it is; the check under test runs on the way to making one.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        dist.init_distributed(verbose=False)


def test_bad_timeout_env(monkeypatch):
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT='soon'"):
        dist.default_timeout()


# ----------------------------------------------------------------------------- the harness itself


class _HarnessCases(DistributedTest):
    """Not collected (no `Test` prefix): driven by the tests below to check failure reporting."""

    world_size = 2
    timeout_s = 6
    reuse_dist_env = False

    def test_hang(self):
        if dist.get_rank() == 0:
            time.sleep(60)

    def test_one_rank_raises(self):
        if dist.get_rank() == 1:
            raise ValueError("rank one is broken")
        dist.barrier()  # rank 0 waits for a peer that never comes


def test_harness_turns_hang_into_failure_with_stacks():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        _run_distributed(_HarnessCases, "test_hang", 2, {})
    text = str(info.value)
    assert "ranks [0] did not finish" in text and "test_hang" in text
    assert time.monotonic() - start < 45


def test_harness_reports_failing_rank_and_blocked_peer():
    with pytest.raises(AssertionError) as info:
        _run_distributed(_HarnessCases, "test_one_rank_raises", 2, {})
    text = str(info.value)
    assert "rank 1 raised" in text and "rank one is broken" in text
    assert "ranks [0] did not finish" in text


def test_init_distributed_configures_the_comms_logger():
    """Upstream reads only the comms_logger section from `init_distributed(config=...)`."""
    from deepspeed.comm import comm as facade

    logger = facade.comms_logger
    block = {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "verbose": True, "debug": True}
    try:
        facade.init_distributed(config={"comms_logger": block}, dist_init_required=False)
        assert (logger.enabled, logger.prof_all, logger.prof_ops, logger.verbose, logger.debug) == (
            True,
            False,
            ["all_reduce"],
            True,
            True,
        )
        facade.init_distributed(config={"train_batch_size": 1}, dist_init_required=False)
        assert logger.enabled and logger.prof_ops == ["all_reduce"]  # no block: left as it was
        facade.init_distributed(config={"comms_logger": {"enabled": False}}, dist_init_required=False)
        assert not logger.enabled and logger.prof_all and not logger.verbose  # the block's defaults
        with pytest.raises(ValueError, match="comms_logger"):
            facade.init_distributed(config={"comms_logger": {"prof_ops": 3}}, dist_init_required=False)
    finally:
        logger.reset()


@pytest.mark.parametrize("made_by", ["deepspeed", "client"])
def test_the_group_is_destroyed_before_interpreter_teardown(made_by):
    """Whoever made the default group (init_distributed, or a client such as accelerate before
    it), it is destroyed at exit while the interpreter is alive: a gloo group left to teardown
    can abort a finished run. The script's own exit handler, registered first, runs last."""
    port = get_free_port()
    code = (
        "import atexit, os, torch.distributed as td\n"
        "atexit.register(lambda: print('initialized at exit:', td.is_initialized(), flush=True))\n"
        "import deepspeed\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', RANK='0', WORLD_SIZE='1')\n"
        + ("td.init_process_group('gloo')\n" if made_by == "client" else "")
        + "deepspeed.init_distributed('gloo')\n"
        "assert td.is_initialized()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "initialized at exit: False" in out.stdout, out.stdout


def test_a_group_destroyed_by_torch_leaves_no_gloo_threads():
    """A client that destroys the group with torch's own destroy_process_group (accelerate
    does) frees it: the channel table must not keep the group, and gloo's threads, alive
    into interpreter teardown."""
    port = get_free_port()
    code = (
        "import gc, os, torch, torch.distributed as td\n"
        "import deepspeed.comm as dist\n"
        "def gloo_threads():\n"
        "    tasks = os.listdir('/proc/self/task')\n"
        "    return [n for n in (open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks) if 'gloo' in n]\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', RANK='0', WORLD_SIZE='1')\n"
        "td.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(2))\n"
        "assert gloo_threads()\n"
        "td.destroy_process_group()\n"
        "gc.collect()\n"
        "print('left:', gloo_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "left: []" in out.stdout, out.stdout
