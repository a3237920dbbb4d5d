"""`shm_copy` (csrc/comm/copy_pieces.c): the plain-C library the shared-memory gather copies its
pieces with ([Note: the block layout of a gather] in deepspeed/comm/shm.py), built with the C
compiler on first use and loaded with ctypes; where it cannot be built, the gather copies
with torch (tests/unit/test_comm.py runs both)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from deepspeed.ops.op_builder import ShmCopyBuilder, builder

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def _table(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).t().contiguous()  # [3, pieces]: to, from, length


@needs_cc
def test_builds_in_seconds_and_copies_each_piece(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    op = ShmCopyBuilder()
    assert op.is_compatible() and not op.is_built()
    began = time.monotonic()
    native = op.load()
    assert time.monotonic() - began < 60 and op.is_built()
    assert ShmCopyBuilder().is_built()  # the stamp tells a new process it need not build

    src = torch.arange(100, dtype=torch.float32)
    dst = torch.full((100,), -1.0)
    pieces = [(0, 40, 12), (48, 0, 8), (60, 88, 40)]  # bytes: to, from, length
    table = _table(pieces)
    step = table.stride(0) * table.element_size()
    native.copy_pieces(3, dst.data_ptr(), table.data_ptr(), src.data_ptr(), table.data_ptr() + step,
                       table.data_ptr() + 2 * step)  # fmt: skip
    want = torch.full((100,), -1.0)
    want[0:3], want[12:14], want[15:25] = src[10:13], src[0:2], src[22:32]
    assert torch.equal(dst, want)


def test_without_a_compiler_or_a_writable_folder_it_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "ds-test-no-such-cc")
    op = ShmCopyBuilder()
    assert not op.is_compatible()
    with pytest.raises(RuntimeError, match="no C compiler: 'ds-test-no-such-cc'.*set CC"):
        op.load()
    warnings = []
    monkeypatch.setattr(builder.logger, "warning", lambda msg: warnings.append(msg))
    assert op.try_load() is None and op.try_load() is None
    assert len(warnings) == 1 and "pure-torch" in warnings[0]

    monkeypatch.delenv("CC")
    if shutil.which("cc") is None:
        return
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker))  # a file: no folder can be made under it
    with pytest.raises(RuntimeError, match="cannot be made .* TORCH_EXTENSIONS_DIR"):
        ShmCopyBuilder().load()


@needs_cc
def test_a_failed_build_names_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "copy_pieces.c").write_text("this is not C\n")
    op = ShmCopyBuilder()
    monkeypatch.setattr(op, "csrc_root", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="shm_copy") as info:
        op.load()
    log = op.build_directory() / builder.ERROR_LOG_FILE
    assert str(log) in str(info.value) and "this is not C" in log.read_text()
    assert not op.library_path().exists() and not list(op.build_directory().glob(".lib*"))
