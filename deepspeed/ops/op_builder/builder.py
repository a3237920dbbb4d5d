"""`OpBuilder`: find, JIT-compile, cache and load one native op.

A builder names its C++ sources relative to the `csrc` directory and compiles them with
`torch.utils.cpp_extension.load` into ``$TORCH_EXTENSIONS_DIR/<pyXY_cpu>/<NAME>`` (torch's
cache directory when the variable is unset). The loaded module is kept on the builder, so
each process compiles or loads an op once.

[Note: how is_built() knows without compiling]
After a successful load the builder writes a stamp next to the shared library: a hash of
the sources, the flags and the torch version. `is_built()` is true when the library exists
and its stamp matches what a build would produce now; ninja would then have nothing to do.

Nothing here imports `torch.utils.cpp_extension` (which pulls in setuptools) until a method
needs it, so `import deepspeed.ops` stays light.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Optional

from deepspeed.utils.logging import logger

STAMP_FILE = "ds_build_stamp.txt"
ERROR_LOG_FILE = "ds_build_error.log"


def csrc_candidates() -> list[Path]:
    """Where the C++ sources may live: inside the package (a wheel), then the repository top."""
    package_dir = Path(__file__).resolve().parents[2]  # .../deepspeed
    return [package_dir / "csrc", package_dir.parent / "csrc"]


@functools.cache
def compiler_accepts(compiler: str, flag: str, header: str = "") -> bool:
    """Whether `compiler` compiles and links a tiny program with `flag` (cached per process)."""
    program = (f"#include <{header}>\n" if header else "") + "int main() { return 0; }\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(program)
        cmd = [compiler, flag, str(src), "-o", str(Path(tmp) / "probe")]
        try:
            result = subprocess.run(cmd, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return result.returncode == 0


class OpBuilder:
    """Base class: one subclass per native op; the shared instances live in `ALL_OPS`."""

    NAME: str = ""  # the key in ALL_OPS and the name of the compiled extension module

    _module: Optional[ModuleType]  # set by the first successful load()
    _load_error: Optional[str]  # set by a failed load(); later loads re-raise it
    _warned: bool  # try_load() warns about a failure once per builder

    def __init__(self) -> None:
        if not self.NAME:
            raise TypeError(f"{type(self).__name__} must set NAME")
        self._module = None
        self._load_error = None
        self._warned = False

    # ---- what to build (subclasses override) ----------------------------------------------

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self) -> list[str]:
        """Source files, relative to the csrc directory."""
        raise NotImplementedError

    def headers(self) -> list[str]:
        """Headers the sources include, relative to the csrc directory (part of the fingerprint)."""
        return []

    def include_paths(self) -> list[str]:
        """Include directories, relative to the csrc directory."""
        return []

    def cxx_args(self) -> list[str]:
        # -ffp-contract=off: no implicit fused multiply-adds, so rounding follows the source.
        args = ["-O3", "-fno-math-errno", "-ffp-contract=off"]
        if self.openmp_supported():
            args.append("-fopenmp")
        return args

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"] if self.openmp_supported() else []

    # ---- where things are ------------------------------------------------------------------

    def csrc_root(self) -> Optional[Path]:
        """The first csrc directory that holds every source, or None."""
        for root in csrc_candidates():
            if all((root / src).is_file() for src in self.sources()):
                return root
        return None

    def compiler(self) -> Optional[str]:
        """The C++ compiler torch would use (``$CXX``, else ``c++``), if it is on PATH."""
        return shutil.which(os.environ.get("CXX", "c++"))

    def openmp_supported(self) -> bool:
        cxx = self.compiler()
        return cxx is not None and compiler_accepts(cxx, "-fopenmp", "omp.h")

    def build_directory(self) -> Path:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if not root:
            from torch.utils.cpp_extension import get_default_build_root

            root = get_default_build_root()
        import torch

        flavour = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}" / self.NAME

    def library_path(self) -> Path:
        suffix = ".pyd" if sys.platform == "win32" else ".so"
        return self.build_directory() / f"{self.NAME}{suffix}"

    # ---- status ----------------------------------------------------------------------------

    def incompatibility_reasons(self) -> list[str]:
        """Why this op cannot be built here; empty when it can."""
        reasons = []
        if self.compiler() is None:
            reasons.append(f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} is not on PATH (set CXX)")
        if shutil.which("ninja") is None:
            reasons.append("ninja is not on PATH (pip install ninja)")
        try:
            import torch.utils.cpp_extension  # noqa: F401
        except Exception as exc:  # any failure means JIT builds are unusable
            reasons.append(f"torch.utils.cpp_extension cannot be imported: {exc}")
        if self.csrc_root() is None:
            looked = ", ".join(str(p) for p in csrc_candidates())
            reasons.append(f"sources {self.sources()} not found under any of: {looked}")
        return reasons

    def is_compatible(self, verbose: bool = False) -> bool:
        reasons = self.incompatibility_reasons()
        if verbose:
            for reason in reasons:
                logger.warning(f"native op {self.NAME!r} is not compatible: {reason}")
        return not reasons

    def is_built(self) -> bool:
        """Loaded in this process, or compiled and cached with matching sources and flags."""
        if self._module is not None:
            return True
        if not self.is_compatible() or not self.library_path().is_file():
            return False
        stamp = self.build_directory() / STAMP_FILE
        return stamp.is_file() and stamp.read_text().strip() == self.fingerprint()

    def fingerprint(self) -> str:
        """A hash of everything that decides the compiled library (see the Note above)."""
        import torch

        digest = hashlib.sha256(f"{torch.__version__}|{sys.version}".encode())
        root = self.csrc_root()
        for src in self.sources() + self.headers():
            path = root / src if root is not None else None
            digest.update(src.encode())
            digest.update(path.read_bytes() if path is not None and path.is_file() else b"missing")
        for part in (self.cxx_args(), self.extra_ldflags(), self.include_paths()):
            digest.update(repr(part).encode())
        return digest.hexdigest()

    # ---- loading ---------------------------------------------------------------------------

    def load(self, verbose: bool = False) -> ModuleType:
        """Compile (first use only) and import the op; raises RuntimeError if it cannot."""
        if self._module is not None:
            return self._module
        if self._load_error is not None:
            raise RuntimeError(self._load_error)
        reasons = self.incompatibility_reasons()
        if reasons:
            self._load_error = f"native op {self.NAME!r} cannot be built here: " + "; ".join(reasons)
            raise RuntimeError(self._load_error)
        self._module = self._jit_load(verbose)
        return self._module

    def try_load(self) -> Optional[ModuleType]:
        """`load()`, or None with one logged warning per builder when the op is unavailable."""
        try:
            return self.load()
        except RuntimeError as exc:
            if not self._warned:
                self._warned = True
                logger.warning(f"{exc}. Falling back to the pure-torch implementation.")
            return None

    def _jit_load(self, verbose: bool) -> ModuleType:
        from torch.utils import cpp_extension

        root = self.csrc_root()
        assert root is not None, "incompatibility_reasons() checked the sources"
        build_dir = self.build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        if not self.is_built():
            logger.info(f"building native op {self.NAME!r} in {build_dir} (first use only)")
        try:
            module = cpp_extension.load(
                name=self.NAME,
                sources=[str(root / src) for src in self.sources()],
                extra_cflags=self.cxx_args(),
                extra_ldflags=self.extra_ldflags(),
                extra_include_paths=[str(root / inc) for inc in self.include_paths()],
                build_directory=str(build_dir),
                with_cuda=False,
                verbose=verbose,
            )
        except Exception as exc:  # compiler, linker, loader or ninja errors all land here
            self._load_error = self._record_failure(build_dir, exc)
            raise RuntimeError(self._load_error) from exc
        (build_dir / STAMP_FILE).write_text(self.fingerprint() + "\n")
        return module

    def _record_failure(self, build_dir: Path, exc: Exception) -> str:
        log_path = build_dir / ERROR_LOG_FILE
        try:
            log_path.write_text(f"{type(exc).__name__}: {exc}\n")
        except OSError:
            log_path = Path("<unwritable>")
        return (
            f"building native op {self.NAME!r} failed ({type(exc).__name__}); the compiler output is "
            f"in {log_path} (build directory {build_dir}). Fix the error shown there, or point "
            f"TORCH_EXTENSIONS_DIR at a writable directory and retry"
        )
