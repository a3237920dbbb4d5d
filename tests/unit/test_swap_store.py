"""The NVMe swap store: reserved files, async round trips, a full disk named, scratch removed."""

import os
import subprocess
import sys

import pytest
import torch

from deepspeed.runtime.swap_tensor.swap_store import AioSettings, PinnedBufferPool, SwapSpaceError, SwapStore


def test_round_trip_through_pool_buffers(tmp_path):
    store = SwapStore(tmp_path, "optimizer", AioSettings(block_size=8192, thread_count=2))
    pool = PinnedBufferPool(2, 40_000)
    i, buf = pool.acquire(40_000)
    src = PinnedBufferPool.as_tensor(buf, 10_000, torch.float32)
    src.copy_(torch.randn(10_000))
    store.reserve("exp_avg", src.numel() * 4)
    store.write("exp_avg", src, async_op=True)
    assert store.wait_writes() == 1
    j, buf2 = pool.acquire(40_000)
    dst = PinnedBufferPool.as_tensor(buf2, 10_000, torch.float32)
    store.read("exp_avg", dst, async_op=True)
    assert store.wait_reads() == 1
    assert torch.equal(dst, src)
    with pytest.raises(RuntimeError, match="raise buffer_count"):
        pool.acquire(1)
    pool.release(i)
    with pytest.raises(ValueError, match="not out of the pool"):
        pool.release(i)
    with pytest.raises(ValueError, match="raise buffer_size"):
        pool.acquire(pool.nbytes + 1)
    # Reserved sizes are whole 4096-byte pages, so whole-buffer transfers can go O_DIRECT.
    assert os.path.getsize(store.path("exp_avg")) == 40_960
    with pytest.raises(ValueError, match="do not fit"):
        store.write("exp_avg", torch.zeros(20_000))
    with pytest.raises(KeyError, match="never reserved"):
        store.read("missing", dst)
    folder = store.folder.parent
    store.close()
    assert not folder.exists()


def test_full_disk_is_named_at_reserve(tmp_path):
    store = SwapStore(tmp_path, "params")
    with pytest.raises(
        SwapSpaceError, match=r"needs \d+ more bytes under .*point nvme_path at a larger drive"
    ) as e:
        store.reserve("huge", 1 << 55)
    assert e.value.errno == 28
    store.close()


def test_bad_nvme_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvme_path .*missing"):
        SwapStore(tmp_path / "missing", "params")


def test_killed_process_folder_is_removed_by_next_store(tmp_path):
    # A process killed before close() leaves its folder; the next store on this host removes it.
    code = (
        "import os, sys; from deepspeed.runtime.swap_tensor.swap_store import SwapStore; "
        f"s = SwapStore({str(tmp_path)!r}, 'p'); s.reserve('x', 10); print(s.folder.parent, flush=True); os._exit(0)"
    )
    left = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert os.path.isdir(left)
    live = SwapStore(tmp_path, "p")
    assert not os.path.exists(left)
    assert live.folder.exists()
    live.close()
