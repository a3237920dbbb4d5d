#!/usr/bin/env bash
# The GPU benchmark in one command, on a machine with one CUDA GPU and no network:
#
#     bash benchmarks/gpu/run.sh              # ~8 min; writes benchmarks/results/gpu-latest.{json,md}
#     bash benchmarks/gpu/run.sh --dry-run    # on the CPU, tiny models, ~30 s: checks that it all builds
#
# Expects: `python3` with a CUDA build of torch (the GPU image's, CPython 3.12), nvcc and ninja
# (upstream's ops JIT-build there), and benchmarks/.gpu-wheels from benchmarks/gpu/prepare.sh
# (run where pip reaches PyPI, then carried). Installs nothing into python3: ours' extra
# packages go to $GPU_BENCH_WORK/site-ours, upstream DeepSpeed 0.19.8 (built from its sdist
# against this torch, DS_BUILD_OPS=0) to $GPU_BENCH_WORK/site-upstream, its JIT builds to
# $GPU_BENCH_WORK/torch_extensions. Other arguments go to bench_gpu.py (--budget-s, --only, ...).
# The dry run needs none of that: it runs with $PYTHON (default .venv/bin/python) and takes
# upstream from benchmarks/.venv-upstream when there is one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = "--dry-run" ]; then
    [ -x "$ROOT/.venv/bin/python" ] && PYTHON="${PYTHON:-$ROOT/.venv/bin/python}" || PYTHON="${PYTHON:-python3}"
    exec "$PYTHON" benchmarks/gpu/bench_gpu.py "$@"
fi

PYTHON="${PYTHON:-python3}"
WORK="${GPU_BENCH_WORK:-/tmp/gpu-bench}"
WHEELS="$ROOT/benchmarks/.gpu-wheels"
if [ ! -f "$WHEELS/deepspeed-0.19.8.tar.gz" ]; then
    echo "run.sh: $WHEELS/deepspeed-0.19.8.tar.gz missing: run 'bash benchmarks/gpu/prepare.sh'" \
        "where pip reaches PyPI and carry benchmarks/.gpu-wheels" >&2
    exit 2
fi
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "run.sh: $PYTHON's torch sees no CUDA device; use --dry-run on a CPU machine" >&2
    exit 2
}
PIP=("$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile
    --no-cache-dir --upgrade)
PYDANTIC=("$WHEELS"/pydantic-*.whl "$WHEELS"/pydantic_core-*.whl "$WHEELS"/annotated_types-*.whl
    "$WHEELS"/typing_inspection-*.whl "$WHEELS"/typing_extensions-*.whl)
began=$(date +%s)
if [ ! -d "$WORK/site-ours/pydantic" ]; then
    "${PIP[@]}" --target "$WORK/site-ours" "${PYDANTIC[@]}" "$WHEELS"/transformers-*.whl
fi
if [ ! -d "$WORK/site-upstream/deepspeed" ]; then
    "${PIP[@]}" --target "$WORK/site-upstream" "${PYDANTIC[@]}" "$WHEELS"/hjson-*.whl
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation --target "$WORK/site-upstream" \
        "$WHEELS/deepspeed-0.19.8.tar.gz"
fi
echo "run.sh: packages ready in $(( $(date +%s) - began )) s under $WORK"
mkdir -p "$WORK/torch_extensions"
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu/bench_gpu.py \
    --ours-path "$WORK/site-ours" \
    --upstream-python "$PYTHON" --upstream-path "$WORK/site-upstream" \
    --torch-extensions-dir "$WORK/torch_extensions" "$@"
