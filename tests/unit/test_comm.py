"""The comm facade on real spawned process groups (gloo on CPU), and the harness's failure paths."""

import os
import time

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from tests.unit.common import DistributedTest, _run_distributed, get_free_port


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

    def test_init_distributed_is_noop_when_initialized(self):
        dist.init_distributed(dist_backend="gloo", verbose=False)
        assert dist.is_initialized()


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


def test_init_distributed_rejects_half_env(monkeypatch):
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


def test_init_distributed_refuses_an_enabled_comms_logger():
    from deepspeed.comm import comm as facade

    with pytest.raises(ValueError, match="comms_logger.enabled=true"):
        facade._refuse_comms_logger({"comms_logger": {"enabled": True}})
    facade._refuse_comms_logger({"comms_logger": {"enabled": False}, "train_batch_size": 1})
    facade._refuse_comms_logger(None)
