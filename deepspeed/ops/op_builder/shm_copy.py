"""Builder for `shm_copy` (`csrc/comm/copy_pieces.c`): many byte ranges copied in one call.

Unlike the other ops it is plain C without torch headers: compiled with the C compiler
(``$CC``, else ``cc``) in well under a second, and loaded with ctypes rather than as a
Python extension, because the shared-memory gather asks for it on its first use, inside a
collective, where a torch extension's minute-long first build would hold every rank.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Optional

from deepspeed.ops.op_builder.builder import STAMP_FILE, OpBuilder
from deepspeed.utils.logging import logger


class ShmCopyBuilder(OpBuilder):
    """The `shm_copy` library: `copy_pieces(n, dst, dst_off, src, src_off, len)` (raw pointers)."""

    NAME = "shm_copy"

    def sources(self) -> list[str]:
        return ["comm/copy_pieces.c"]

    def cxx_args(self) -> list[str]:
        return ["-O2", "-shared", "-fPIC"]

    def extra_ldflags(self) -> list[str]:
        return []

    def compiler(self) -> Optional[str]:
        """The C compiler (``$CC``, else ``cc``), if it is on PATH."""
        return shutil.which(os.environ.get("CC", "cc"))

    def library_path(self) -> Path:
        return self.build_directory() / f"lib{self.NAME}.so"

    def incompatibility_reasons(self) -> list[str]:
        reasons = []
        if self.compiler() is None:
            reasons.append(f"no C compiler: {os.environ.get('CC', 'cc')!r} is not on PATH (set CC)")
        if self.csrc_root() is None:
            reasons.append(f"sources {self.sources()} not found under the csrc directories")
        return reasons

    def _jit_load(self, verbose: bool) -> ModuleType:
        build_dir = self.build_directory()
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a load failure, as any other: the caller falls back to torch
            self._load_error = (
                f"native op {self.NAME!r} cannot be built: {build_dir} cannot be made ({exc}); point "
                "TORCH_EXTENSIONS_DIR at a writable directory"
            )
            raise RuntimeError(self._load_error) from exc
        path = self.library_path()
        if not self.is_built():
            logger.info(f"building native op {self.NAME!r} in {build_dir} (first use only)")
            # Every rank may build at once: each into its own file, then an atomic rename.
            partial = build_dir / f".{path.name}.{os.getpid()}"
            cmd = [
                self.compiler(),
                *self.cxx_args(),
                str(self.csrc_root() / self.sources()[0]),
                "-o",
                str(partial),
            ]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                os.replace(partial, path)
            except (OSError, subprocess.SubprocessError) as exc:
                partial.unlink(missing_ok=True)
                detail = getattr(exc, "stderr", "") or ""
                self._load_error = self._record_failure(build_dir, RuntimeError(f"{' '.join(cmd)}\n{detail}"))
                raise RuntimeError(self._load_error) from exc
            (build_dir / STAMP_FILE).write_text(self.fingerprint() + "\n")
        try:
            library = ctypes.CDLL(str(path))
        except OSError as exc:
            self._load_error = self._record_failure(build_dir, exc)
            raise RuntimeError(self._load_error) from exc
        copy = library.ds_copy_pieces
        copy.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5
        copy.restype = None
        module = ModuleType(self.NAME)
        module.copy_pieces = copy
        module.library_path = str(path)
        return module
