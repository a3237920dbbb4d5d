#!/usr/bin/env bash
# Fill benchmarks/.gpu-wheels with what benchmarks/gpu/run.sh installs on a GPU machine that has
# no network (run it here, where pip reaches PyPI; about 19 MB, idempotent):
#
#     bash benchmarks/gpu/prepare.sh
#
# The GPU machine's image already holds torch (CUDA), numpy, psutil, py-cpuinfo, ninja, msgpack,
# einops, nvidia-ml-py, tqdm, packaging, huggingface-hub, tokenizers and safetensors for
# CPython 3.12; what it lacks is pydantic (ours and upstream), hjson (upstream), DeepSpeed 0.19.8
# itself (its sdist: run.sh builds it there against that machine's torch, DS_BUILD_OPS=0, so its
# ops JIT-build with nvcc on first use) and transformers 5.24.0 (the zoo's pin; the image's is older).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="$HERE/../.gpu-wheels"
PYTHON="${PYTHON:-python3}"
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 hjson==3.1.0 transformers==5.24.0)
mkdir -p "$DEST"
"$PYTHON" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"
"$PYTHON" -m pip download --disable-pip-version-check --no-deps --no-binary=:all: -d "$DEST" \
    deepspeed==0.19.8
echo "prepare: $(du -sh "$DEST" | cut -f1) in $DEST; carry benchmarks/.gpu-wheels to the GPU machine"
ls "$DEST"
