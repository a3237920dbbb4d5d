"""deepspeed.ops.aio: the async I/O engine (csrc/aio/), each backend, against plain Python file I/O.

Every round trip writes bytes with the handle, reads them back with plain `open().read()` (and
the handle), and compares bytes. Every test runs against both backends (`backend` fixture:
io_uring, skipped only where the kernel refuses it, and the thread pool). The op is
JIT-compiled once per session (about 30 s the first time on 2 cores) and cached in
$TORCH_EXTENSIONS_DIR. Bandwidth is measured by benchmarks/bench_aio.py, not here.
"""

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepspeed.ops.aio import AsyncIOBuilder
from deepspeed.ops.op_builder import ALL_OPS
from deepspeed.runtime import huge_pages

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="async_io cannot be built here")

BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def aio():
    return ALL_OPS["async_io"].load()


@pytest.fixture(params=["io_uring", "thread_pool"])
def backend(request, aio, monkeypatch):
    monkeypatch.delenv("DS_AIO_BACKEND", raising=False)
    if request.param == "io_uring" and aio.io_uring_unavailable_reason:
        pytest.skip(f"io_uring is not usable here: {aio.io_uring_unavailable_reason}")
    return request.param


def handle(aio, backend, *args, **kwargs):
    h = aio.aio_handle(*args, backend=backend, **kwargs)
    assert h.get_backend() == backend
    return h


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


def test_handle_reports_its_settings(aio, backend):
    h = handle(aio, backend, BLOCK, 4, True, True, 3)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit()) == (BLOCK, 4, True)
    assert (h.get_overlap_events(), h.get_thread_count(), h.get_intra_op_parallelism()) == (True, 3, 3)
    assert "asked for" in h.get_backend_reason()
    d = aio.aio_handle()  # upstream's defaults; the backend the module chose at import
    assert (d.get_block_size(), d.get_queue_depth(), d.get_thread_count()) == (1 << 20, 128, 1)
    assert d.get_backend() == aio.backend
    assert (
        aio.aio_handle(intra_op_parallelism=2, backend=backend).get_thread_count() == 2
    )  # upstream's newer name
    with pytest.raises(ValueError, match="thread_count must be > 0, got 0"):
        aio.aio_handle(BLOCK, 4, False, False, 0, backend=backend)


def test_backend_choice_by_argument_and_environment(aio, monkeypatch):
    monkeypatch.setenv("DS_AIO_BACKEND", "thread_pool")
    assert aio.aio_handle().get_backend() == "thread_pool"
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'io_uring' or 'thread_pool', got 'uring'"):
        aio.aio_handle(backend="uring")
    monkeypatch.setenv("DS_AIO_BACKEND", "libaio")
    with pytest.raises(ValueError, match=r"got 'libaio' \(from the backend= argument or DS_AIO_BACKEND\)"):
        aio.aio_handle()
    monkeypatch.setenv("DS_AIO_BACKEND", "auto")
    h = aio.aio_handle()
    expected = "thread_pool" if aio.io_uring_unavailable_reason else "io_uring"
    assert h.get_backend() == expected and h.get_backend_reason().startswith("auto")


# sizes: empty, one byte, odd, exactly one block, aligned many blocks, unaligned many blocks
@pytest.mark.parametrize("nbytes", [0, 1, 4097, BLOCK, 16 * BLOCK, 16 * BLOCK + 123])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("async_op", [False, True])
def test_round_trip(aio, backend, tmp_path, nbytes, threads, async_op):
    h = handle(aio, backend, BLOCK, 2, False, False, threads)
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


def test_locked_tensors_use_o_direct_and_other_dtypes_round_trip(aio, backend, tmp_path):
    h = handle(aio, backend, BLOCK, 8, False, False, 2)
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


def test_large_locked_tensors_are_in_huge_pages(aio, tmp_path):
    """A locked buffer of at least 2 MiB starts on a 2 MiB boundary and, where transparent huge
    pages work, is backed by them ([Note: locked buffers in huge pages] in py_aio.cpp)."""
    h = handle(aio, "thread_pool", BLOCK, 8, False, False, 2)
    small = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float32))
    assert small.data_ptr() % 4096 == 0 and small.numel() == 1000
    before = huge_pages.anon_huge_page_bytes()
    big = h.new_cpu_locked_tensor((16 << 20) + 12345, torch.empty(0, dtype=torch.uint8))  # 8 pages + a tail
    assert big.numel() == (16 << 20) + 12345 and big.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    big.fill_(7)  # faults in whatever mlock did not (the memlock limit may refuse it)
    if huge_pages.huge_pages_available():
        grown = huge_pages.anon_huge_page_bytes() - before
        # The kernel falls back to small pages when it finds no free 2 MiB block; most must be huge.
        assert grown >= 4 * huge_pages.HUGE_PAGE_BYTES, grown
    path = str(tmp_path / "big.bin")
    h.sync_pwrite(big, path)
    back = h.new_cpu_locked_tensor(big.numel(), big)
    h.sync_pread(back, path)
    assert torch.equal(back, big) and torch.equal(file_bytes(path), big)


def test_many_requests_in_flight_and_offsets(aio, backend, tmp_path):
    """40 async writes into one file at their own offsets (queue_depth 2 makes submits wait)."""
    h = handle(aio, backend, 4096, 2, False, False, 4)
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


def test_unaligned_sizes_and_offsets(aio, backend, tmp_path):
    """Odd lengths at odd offsets, written out of order, spanning chunk borders (block 4096)."""
    h = handle(aio, backend, 4096, 3, False, True, 2)
    path = str(tmp_path / "odd.bin")
    pieces = [(5, 10_000), (10_005, 1), (10_006, 4095), (14_101, 8193), (0, 5)]
    data = random_bytes(sum(n for _, n in pieces), seed=3)
    for off, n in pieces:
        h.async_pwrite(data[off : off + n], path, off)
    assert h.wait() == len(pieces)
    assert torch.equal(file_bytes(path), data)
    for off, n in [(1, 4096), (4095, 2), (4097, 9999), (3, data.numel() - 3)]:
        got = torch.empty(n, dtype=torch.uint8)
        h.sync_pread(got, path, off)
        assert torch.equal(got, data[off : off + n]), (off, n)
    assert h.io_stats()["direct_ops"] == 0  # nothing here is 4096-aligned


@pytest.mark.parametrize("threads", [1, 2])
def test_large_file_many_chunks_small_queue_depth(aio, backend, tmp_path, threads):
    """8 MiB in 4 KiB chunks (2048 of them) with queue_depth 3: the lanes recycle their slots."""
    h = handle(aio, backend, 4096, 3, False, True, threads)
    src = h.new_cpu_locked_tensor(8 << 20, torch.empty(0, dtype=torch.uint8))
    src.copy_(random_bytes(src.numel(), seed=11))
    path = str(tmp_path / "big.bin")
    h.sync_pwrite(src, path)
    dst = h.new_cpu_locked_tensor(src.numel(), src)
    h.sync_pread(dst, path)
    assert torch.equal(dst, src) and torch.equal(file_bytes(path), src)
    assert h.io_stats()["bytes_read"] == 8 << 20


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [False, True])
def test_single_submit_and_overlap_events_shape_the_submissions(aio, tmp_path, single_submit, overlap_events):
    """io_uring: single_submit hands each request over in its own io_uring_enter; otherwise a
    batch goes in one call; without overlap_events a batch of queue_depth requests completes
    before the next is submitted (so 64 chunks at depth 4 take exactly 16 calls)."""
    if aio.io_uring_unavailable_reason:
        pytest.skip(f"io_uring is not usable here: {aio.io_uring_unavailable_reason}")
    h = aio.aio_handle(4096, 4, single_submit, overlap_events, 1, backend="io_uring")
    src = random_bytes(64 * 4096, seed=2)
    h.sync_pwrite(src, str(tmp_path / "s.bin"))
    stats = h.io_stats()
    assert stats["short_transfers"] == 0 and torch.equal(file_bytes(str(tmp_path / "s.bin")), src)
    calls = stats["submit_calls"]
    if single_submit:
        assert calls == 64
    elif not overlap_events:
        assert calls == 16
    else:
        assert 16 <= calls <= 64  # refills as completions arrive: as many calls as reaps
    pool = aio.aio_handle(4096, 4, single_submit, overlap_events, 1, backend="thread_pool")
    pool.sync_pwrite(src, str(tmp_path / "p.bin"))
    assert pool.io_stats()["submit_calls"] == 0  # the knobs mean nothing to the thread pool


@pytest.mark.parametrize("direct", [False, True])
def test_short_transfers_ask_for_the_rest(aio, backend, tmp_path, monkeypatch, direct):
    """Every transfer asks for half of what is left (DS_AIO_SPLIT_TRANSFERS_FOR_TESTS), so each
    chunk completes in several short pieces, each re-asked from where the last one stopped."""
    monkeypatch.setenv("DS_AIO_SPLIT_TRANSFERS_FOR_TESTS", "1")
    h = handle(aio, backend, BLOCK, 2, False, True, 2)
    n = 8 * BLOCK
    if direct:
        src = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
        src.copy_(random_bytes(n, seed=4))
        dst = h.new_cpu_locked_tensor(n, src)
    else:
        src, dst = random_bytes(n + 7, seed=4), torch.empty(n + 7, dtype=torch.uint8)
    path = str(tmp_path / "split.bin")
    h.sync_pwrite(src, path)
    h.sync_pread(dst, path)
    assert torch.equal(dst, src) and torch.equal(file_bytes(path), src)
    assert h.io_stats()["short_transfers"] >= 2 * 8  # at least one per chunk, each way


def test_missing_file_and_short_file_name_the_path_and_bytes(aio, backend, tmp_path):
    h = handle(aio, backend, BLOCK, 4, False, False, 2)
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


def _failure(h, call, *args):
    with pytest.raises(OSError) as e:
        call(*args)
        h.wait()
    return e.value


def test_end_of_file_during_the_transfer_is_reported_alike(aio, tmp_path):
    """A read that meets the end of a file the size check cannot see (a device) fails at wait
    with the same message and errno from both backends."""
    errors = {}
    for name in ("io_uring", "thread_pool"):
        if name == "io_uring" and aio.io_uring_unavailable_reason:
            continue
        h = aio.aio_handle(4096, 2, False, True, 1, backend=name)
        errors[name] = _failure(h, h.async_pread, torch.empty(3 * 4096, dtype=torch.uint8), "/dev/null", 4096)
        assert h.wait() == 0
    want = (
        "reading 12288 bytes from '/dev/null' at file offset 4096: failed at byte 0 of 12288 "
        "(file offset 4096): unexpected end of file"
    )
    assert {str(e) for e in errors.values()} == {f"[Errno 0] {want}"}, errors
    assert all(isinstance(e, aio.AsyncIOError) for e in errors.values())


def test_errors_during_the_transfer_name_the_path_offset_and_errno(aio, backend, tmp_path):
    h = handle(aio, backend, 4096, 2, False, False, 1)
    folder = tmp_path / "a_directory"
    folder.mkdir()
    e = _failure(h, h.sync_pread, torch.empty(100, dtype=torch.uint8), str(folder), 8)
    assert isinstance(e, aio.AsyncIOError) and e.errno == errno.EISDIR
    assert (
        f"reading 100 bytes from '{folder}' at file offset 8: failed at byte 0 of 100 (file offset 8)"
        in str(e)
    )
    not_a_dir = tmp_path / "plain.bin"
    not_a_dir.write_bytes(b"x")
    e = _failure(h, h.sync_pwrite, torch.zeros(10, dtype=torch.uint8), str(not_a_dir / "x.bin"))
    assert e.errno == errno.ENOTDIR and f"'{not_a_dir / 'x.bin'}'" in str(e) and "cannot open" in str(e)


def test_a_write_past_the_end_is_laid_out_before_any_chunk_goes(aio, backend, tmp_path):
    """The range a write extends its file by is allocated first (csrc/aio/aio_engine.cpp's note:
    an extending O_DIRECT write is serialised per file): so a write that cannot have its room
    fails before it writes anything, here past a 64 KiB file-size limit (RLIMIT_FSIZE)."""
    import resource
    import signal

    h = handle(aio, backend, 4096, 4, False, False, 2)
    path = tmp_path / "limited.bin"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    try:
        e = _failure(h, h.sync_pwrite, random_bytes(32 * 4096), str(path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert e.errno == errno.EFBIG and "cannot reserve room for the write" in str(e) and str(path) in str(e)
    assert path.stat().st_size == 0, "chunks were written before the write's room was known"
    data = random_bytes(32 * 4096, seed=3)  # with room, the same write lands whole
    h.sync_pwrite(data, str(path))
    assert path.stat().st_size == 32 * 4096 and torch.equal(file_bytes(path), data)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores a directory's permissions")
def test_read_only_directory_names_the_path(aio, backend, tmp_path):
    h = handle(aio, backend)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        e = _failure(h, h.sync_pwrite, torch.zeros(10, dtype=torch.uint8), str(ro / "x.bin"))
    finally:
        ro.chmod(0o755)
    assert e.errno == errno.EACCES and str(ro / "x.bin") in str(e)


def test_failed_async_write_surfaces_at_wait(aio, backend):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to fill")
    h = handle(aio, backend, 4096, 4, False, False, 2)
    buf = random_bytes(5 * 4096)
    assert h.async_pwrite(buf, "/dev/full") == 0  # the submit succeeds; the disk is "full"
    with pytest.raises(
        aio.AsyncIOError, match=r"writing 20480 bytes to '/dev/full' .*failed at byte \d+ of 20480"
    ) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC
    assert h.wait() == 0 and h.io_stats()["pending_ops"] == 0  # the error was reported once


def test_bad_buffers_are_refused(aio, backend, tmp_path):
    h = handle(aio, backend)
    path = str(tmp_path / "b.bin")
    with pytest.raises(ValueError, match="must be contiguous"):
        h.sync_pwrite(torch.zeros(4, 4).t(), path)
    with pytest.raises(ValueError, match="file offset must be >= 0"):
        h.sync_pwrite(torch.zeros(4), path, -1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass a CPU tensor"):
            h.sync_pwrite(torch.zeros(4, device="cuda"), path)


def test_buffer_outlives_the_caller_until_wait(aio, backend, tmp_path):
    """The handle holds the tensor: dropping the caller's reference mid-write is safe."""
    h = handle(aio, backend, 4096, 4, False, False, 2)
    path = str(tmp_path / "kept.bin")
    src = random_bytes(1 << 20, seed=5)
    expected = src.clone()
    h.async_pwrite(src, path)
    del src
    assert h.wait() == 1
    assert torch.equal(file_bytes(path), expected)


def test_dropping_a_handle_with_pending_ops_finishes_them(aio, backend, tmp_path):
    """No wait(): deleting the handle lets the write finish (and does not hang)."""
    path = str(tmp_path / "dropped.bin")
    src = random_bytes(4 << 20, seed=7)
    h = handle(aio, backend, 64 * 1024, 2, False, False, 3)
    h.async_pwrite(src, path)
    del h
    assert torch.equal(file_bytes(path), src)


# A process that io_uring is blocked in, as a container's default seccomp profile does: a
# filter makes io_uring_setup (425 on every architecture) fail with EPERM.
SECCOMP_CHILD = textwrap.dedent(
    """
    import ctypes, os, struct, sys, warnings
    libc = ctypes.CDLL(None, use_errno=True)
    def stmt(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = b"".join([
        stmt(0x20, 0),                       # load the syscall number
        stmt(0x15, 425, 0, 1),               # io_uring_setup?
        stmt(0x06, 0x00050000 | 1),          # then fail it with EPERM
        stmt(0x06, 0x7FFF0000),              # else allow
    ])
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):
        print("SECCOMP-UNAVAILABLE", ctypes.get_errno()); sys.exit(0)
    import torch
    from deepspeed.ops.op_builder import ALL_OPS
    aio = ALL_OPS["async_io"].load()
    print("REASON", aio.io_uring_unavailable_reason)
    print("MODULE", aio.backend)
    print("NOTE", ALL_OPS["async_io"].backend_note())  # what ds_report prints
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = aio.aio_handle(4096, 4, False, False, 2)
        h2 = aio.aio_handle(4096, 4, False, False, 2)
    print("WARNINGS", len(caught), caught[0].message if caught else "")
    print("BACKEND", h.get_backend(), h2.get_backend(), "|", h.get_backend_reason())
    path = os.path.join(sys.argv[1], "f.bin")
    src = torch.arange(10000, dtype=torch.int32)
    h.sync_pwrite(src, path)
    dst = torch.empty_like(src)
    h.sync_pread(dst, path)
    print("ROUNDTRIP", bool(torch.equal(src, dst)))
    try:
        aio.aio_handle(backend="io_uring")
    except aio.AsyncIOError as e:
        print("FORCED", e)
    """
)


def test_blocked_io_uring_falls_back_to_the_thread_pool_with_one_warning(aio, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("DS_AIO_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", SECCOMP_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "SECCOMP-UNAVAILABLE" in proc.stdout:
        pytest.skip(f"cannot install a seccomp filter here: {proc.stdout}")
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}
    assert lines["REASON"].startswith("io_uring_setup failed: Operation not permitted (errno 1)"), proc.stdout
    assert "seccomp" in lines["REASON"] and lines["MODULE"] == "thread_pool"
    assert lines["NOTE"].startswith(
        "thread_pool: io_uring is not usable (io_uring_setup failed: Operation not"
    )
    count, message = lines["WARNINGS"].split(" ", 1)
    assert count == "1", proc.stdout  # one warning per process, not per handle
    assert "io_uring is not usable here (io_uring_setup failed: Operation not permitted" in message
    assert "DS_AIO_BACKEND=thread_pool" in message
    assert lines["BACKEND"].startswith("thread_pool thread_pool | auto fell back to the thread pool")
    assert lines["ROUNDTRIP"] == "True"
    assert (
        "backend 'io_uring' was asked for but io_uring_setup failed: Operation not permitted"
        in lines["FORCED"]
    )
