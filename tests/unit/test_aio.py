"""deepspeed.ops.aio: the async I/O engine (csrc/aio/) against plain Python file I/O.

Every round trip writes bytes with the handle, reads them back with plain `open().read()` (and
the handle), and compares bytes. The op is JIT-compiled once per session (about 30 s the first
time on 2 cores) and cached in $TORCH_EXTENSIONS_DIR. The bandwidth test prints figures and
asserts only that the bytes are right.
"""

import errno
import os
import time

import pytest
import torch

from deepspeed.ops.aio import AsyncIOBuilder
from deepspeed.ops.op_builder import ALL_OPS

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="async_io cannot be built here")

BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def aio():
    return ALL_OPS["async_io"].load()


def random_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def file_bytes(path):
    with open(path, "rb") as f:
        data = f.read()
    return (
        torch.tensor(list(data), dtype=torch.uint8)
        if not data
        else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    )


def test_handle_reports_its_settings(aio):
    h = aio.aio_handle(BLOCK, 4, True, True, 3)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit()) == (BLOCK, 4, True)
    assert (h.get_overlap_events(), h.get_thread_count(), h.get_intra_op_parallelism()) == (True, 3, 3)
    d = aio.aio_handle()  # upstream's defaults
    assert (d.get_block_size(), d.get_queue_depth(), d.get_thread_count()) == (1 << 20, 128, 1)
    assert aio.aio_handle(intra_op_parallelism=2).get_thread_count() == 2  # upstream's newer name
    assert h.get_backend() == aio.backend == "thread_pool"
    with pytest.raises(ValueError, match="thread_count must be > 0, got 0"):
        aio.aio_handle(BLOCK, 4, False, False, 0)


# sizes: empty, one byte, odd, exactly one block, aligned many blocks, unaligned many blocks
@pytest.mark.parametrize("nbytes", [0, 1, 4097, BLOCK, 16 * BLOCK, 16 * BLOCK + 123])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("async_op", [False, True])
def test_round_trip(aio, tmp_path, nbytes, threads, async_op):
    h = aio.aio_handle(BLOCK, 2, False, False, threads)
    path = str(tmp_path / "x.bin")
    src = random_bytes(nbytes, seed=nbytes + threads)
    dst = torch.zeros_like(src)
    if async_op:
        assert h.async_pwrite(src, path) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pwrite(src, path) == 1
    assert torch.equal(file_bytes(path), src)  # plain Python sees what the handle wrote
    if async_op:
        h.async_pread(dst, path)
        assert h.wait() == 1
    else:
        assert h.sync_pread(dst, path) == 1
    assert torch.equal(dst, src)
    stats = h.io_stats()
    assert stats["bytes_written"] == stats["bytes_read"] == nbytes and stats["pending_ops"] == 0


def test_locked_tensors_use_o_direct_and_other_dtypes_round_trip(aio, tmp_path):
    h = aio.aio_handle(BLOCK, 8, False, False, 2)
    src = h.new_cpu_locked_tensor(8 * BLOCK // 4, torch.empty(0, dtype=torch.float32))
    assert src.dtype == torch.float32 and src.data_ptr() % 4096 == 0
    src.copy_(torch.randn(src.numel(), generator=torch.Generator().manual_seed(1)))
    dst = h.new_cpu_locked_tensor(src.numel(), src)
    h.sync_pwrite(src, str(tmp_path / "f.bin"))
    h.sync_pread(dst, str(tmp_path / "f.bin"))
    assert torch.equal(dst, src)
    stats = h.io_stats()
    # aligned buffer, size and offset: O_DIRECT (unless the file system refuses it, e.g. tmpfs)
    assert stats["direct_ops"] + stats["buffered_ops"] == 2
    assert h.free_cpu_locked_tensor(src) and not h.free_cpu_locked_tensor(torch.zeros(3))
    # an unaligned slice of a locked tensor goes through the page cache and is still right
    part = dst[1:-3]
    h.sync_pwrite(part, str(tmp_path / "g.bin"))
    assert h.io_stats()["buffered_ops"] >= 1
    assert torch.equal(file_bytes(str(tmp_path / "g.bin")), part.view(torch.uint8))


def test_many_requests_in_flight_and_offsets(aio, tmp_path):
    """40 async writes into one file at their own offsets (queue_depth 2 makes submits wait)."""
    h = aio.aio_handle(4096, 2, False, False, 4)
    path = str(tmp_path / "many.bin")
    parts = [random_bytes(3 * 4096 + (i % 2) * 4096, seed=i) for i in range(40)]
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += p.numel()
    for p, off in zip(parts, offsets):
        h.async_pwrite(p, path, off)
    assert h.wait() == 40
    whole = torch.cat(parts)
    assert torch.equal(file_bytes(path), whole)
    back = [torch.empty_like(p) for p in parts]
    for b, off in zip(back, offsets):
        h.async_pread(b, path, file_offset=off)
    assert h.wait() == 40
    assert all(torch.equal(b, p) for b, p in zip(back, parts))
    # a read at an offset that is not a multiple of anything
    odd = torch.empty(1000, dtype=torch.uint8)
    h.sync_pread(odd, path, 777)
    assert torch.equal(odd, whole[777:1777])


def test_missing_file_and_short_file_name_the_path_and_bytes(aio, tmp_path):
    h = aio.aio_handle(BLOCK, 4, False, False, 2)
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(
        aio.AsyncIOError, match=rf"reading 100 bytes from '{missing}' at file offset 0: cannot open"
    ) as e:
        h.async_pread(torch.empty(100, dtype=torch.uint8), missing)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOENT
    assert h.wait() == 0  # nothing was queued
    short = str(tmp_path / "short.bin")
    with open(short, "wb") as f:
        f.write(b"x" * 50)
    with pytest.raises(OSError, match=r"the file holds only 50 bytes, 110 are needed"):
        h.sync_pread(torch.empty(100, dtype=torch.uint8), short, 10)


def test_failed_async_write_surfaces_at_wait(aio):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to fill")
    h = aio.aio_handle(4096, 4, False, False, 2)
    buf = random_bytes(5 * 4096)
    assert h.async_pwrite(buf, "/dev/full") == 0  # the submit succeeds; the disk is "full"
    with pytest.raises(
        aio.AsyncIOError, match=r"writing 20480 bytes to '/dev/full' .*failed at byte \d+ of 20480"
    ) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC
    assert h.wait() == 0 and h.io_stats()["pending_ops"] == 0  # the error was reported once


def test_bad_buffers_are_refused(aio, tmp_path):
    h = aio.aio_handle()
    path = str(tmp_path / "b.bin")
    with pytest.raises(ValueError, match="must be contiguous"):
        h.sync_pwrite(torch.zeros(4, 4).t(), path)
    with pytest.raises(ValueError, match="file offset must be >= 0"):
        h.sync_pwrite(torch.zeros(4), path, -1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass a CPU tensor"):
            h.sync_pwrite(torch.zeros(4, device="cuda"), path)


def test_buffer_outlives_the_caller_until_wait(aio, tmp_path):
    """The handle holds the tensor: dropping the caller's reference mid-write is safe."""
    h = aio.aio_handle(4096, 4, False, False, 2)
    path = str(tmp_path / "kept.bin")
    src = random_bytes(1 << 20, seed=5)
    expected = src.clone()
    h.async_pwrite(src, path)
    del src
    assert h.wait() == 1
    assert torch.equal(file_bytes(path), expected)


def _rate(nbytes, seconds):
    return f"{nbytes / seconds / 2**20:8.0f} MiB/s"


def test_bandwidth_against_plain_python(aio, tmp_path):
    """Prints write and read bandwidth (ours vs plain Python) for one 256 MiB file; no assertion on speed."""
    nbytes = 256 << 20
    h = aio.aio_handle(1 << 20, 32, False, False, 4)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.copy_(random_bytes(nbytes, seed=9))
    ours, plain = str(tmp_path / "ours.bin"), str(tmp_path / "plain.bin")
    data = buf.numpy().tobytes()
    rows = []
    t = time.perf_counter()
    h.sync_pwrite(buf, ours)
    os.sync()
    rows.append(("write", "aio_handle", time.perf_counter() - t))
    t = time.perf_counter()
    with open(plain, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    rows.append(("write", "python", time.perf_counter() - t))
    back = h.new_cpu_locked_tensor(nbytes, buf)
    t = time.perf_counter()
    h.sync_pread(back, ours)
    rows.append(("read", "aio_handle", time.perf_counter() - t))
    with open(plain, "rb") as f:  # evict the file from the page cache so both reads hit the disk
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t = time.perf_counter()
    with open(plain, "rb") as f:
        got = f.read()
    rows.append(("read", "python", time.perf_counter() - t))
    print(f"\nasync_io bandwidth, {nbytes >> 20} MiB file ({h.io_stats()['direct_ops']} of 2 ops O_DIRECT):")
    for op, who, sec in rows:
        print(f"  {op:<5} {who:<10} {_rate(nbytes, sec)}")
    assert torch.equal(back, buf) and got == data


def test_dropping_a_handle_with_pending_ops_finishes_them(aio, tmp_path):
    """No wait(): deleting the handle lets the write finish (and does not hang)."""
    path = str(tmp_path / "dropped.bin")
    src = random_bytes(4 << 20, seed=7)
    h = aio.aio_handle(64 * 1024, 2, False, False, 3)
    h.async_pwrite(src, path)
    del h
    assert torch.equal(file_bytes(path), src)
