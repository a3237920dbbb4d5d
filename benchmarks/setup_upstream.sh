#!/usr/bin/env bash
# Create benchmarks/.venv-upstream with upstream DeepSpeed 0.19.8 on the CPU build of torch 2.13.0,
# for side-by-side benchmarks (bench_train_step.py). Idempotent: a second run checks and exits.
#
#     bash benchmarks/setup_upstream.sh            # PYTHON=python3.11 to choose the interpreter
#
# Upstream then runs with DS_ACCELERATOR=cpu on gloo. Its first start JIT-compiles a small
# comm op with g++/ninja into TORCH_EXTENSIONS_DIR=benchmarks/.cache/torch_extensions, which
# the benchmark sets and later runs reuse. Nothing is installed into the project's .venv.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-upstream"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
DEEPSPEED_VERSION="0.19.8"

installed() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" -I - "$TORCH_VERSION" "$DEEPSPEED_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
want_torch, want_ds = sys.argv[1], sys.argv[2]
ok = version("torch").split("+")[0] == want_torch and version("deepspeed") == want_ds
sys.exit(0 if ok else 1)
EOF
}

if installed; then
    echo "setup_upstream: $VENV already has torch $TORCH_VERSION and deepspeed $DEEPSPEED_VERSION"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
# torch first, pinned: the CPU wheel lies on local disk; an unpinned torch would pull a CUDA build.
"${PIP[@]}" "torch==$TORCH_VERSION"
# What upstream imports at run time and what its build needs (its setup.py imports torch, so
# build without isolation against the torch above; DS_BUILD_OPS=0: ops compile on first use).
"${PIP[@]}" setuptools wheel ninja py-cpuinfo psutil "pydantic>=2" hjson msgpack packaging \
    numpy tqdm einops nvidia-ml-py
DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "torch==$TORCH_VERSION" "deepspeed==$DEEPSPEED_VERSION"

if ! installed; then
    echo "setup_upstream: install finished but the versions do not match; see pip's output above" >&2
    exit 1
fi
mkdir -p "$HERE/.cache/torch_extensions"
echo "setup_upstream: ready: $VENV/bin/python (torch $TORCH_VERSION, deepspeed $DEEPSPEED_VERSION)"
