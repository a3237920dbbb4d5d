"""host_malloc.py: an engine training on the CPU sets glibc's malloc thresholds, once per process.

Each case runs in its own interpreter: the thresholds are process-wide and set once. What they
buy is measured, not tested: how many page faults a step takes depends on where the kernel
placed the heap (the same script took 5 to 2,700 per step without them), see the note.
"""

import os
import subprocess
import sys

import pytest

from tests.unit.common import get_free_port

# Whether building a one-rank engine on the CPU set the thresholds.
_ENGINE_APPLIES = r"""
import torch
import deepspeed
from deepspeed.runtime import host_malloc

config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
deepspeed.initialize(model=torch.nn.Linear(8, 8), config=config)
print("APPLIED", host_malloc._applied)
"""


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(
        os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port())
    )
    for key in (
        "DEEPSPEED_HOST_MALLOC",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "GLIBC_TUNABLES",
    ):
        full_env.pop(key, None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the thresholds are glibc's (Linux)")
def test_an_engine_on_the_cpu_sets_them_unless_told_not_to():
    on = _run(_ENGINE_APPLIES)
    assert "APPLIED [None]" in on.stdout, on.stderr[-3000:]
    off = _run(_ENGINE_APPLIES, DEEPSPEED_HOST_MALLOC="0")
    assert "APPLIED ['DEEPSPEED_HOST_MALLOC=0']" in off.stdout, off.stderr[-3000:]


def test_thresholds_the_user_chose_are_left_alone_and_bad_values_refused():
    check = (
        "from deepspeed.runtime import host_malloc\n"
        "print('REASON', host_malloc.keep_freed_memory_for_reuse())\n"
    )
    chosen = _run(check, MALLOC_TRIM_THRESHOLD_="1000000")
    assert "REASON the process chose its own malloc settings (MALLOC_TRIM_THRESHOLD_)" in chosen.stdout, (
        chosen
    )
    tunables = _run(check, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert "(GLIBC_TUNABLES)" in tunables.stdout, tunables
    off = _run(check, DEEPSPEED_HOST_MALLOC="0")
    assert "REASON DEEPSPEED_HOST_MALLOC=0" in off.stdout, off
    bad = _run(_ENGINE_APPLIES, DEEPSPEED_HOST_MALLOC="yes")
    assert bad.returncode != 0 and "DEEPSPEED_HOST_MALLOC='yes' is neither 0 nor 1" in bad.stderr, bad.stderr[
        -2000:
    ]
