"""Code written against upstream DeepSpeed's checkpoint files, run on this package.

Upstream copies its own `zero_to_fp32.py` into every checkpoint folder; run later where this
package is installed (an HF `checkpoint-N` folder, consolidated on another machine), that
script imports upstream's key names from `deepspeed.checkpoint.constants` and unpickles the
optimizer files with plain `torch.load`, which needs the classes they pickle by upstream's
paths. The other way round, the script this package writes runs whichever deepspeed is
installed. The upstream files are the fixtures upstream 0.19.8 wrote (tests/fixtures/upstream).
"""

import os
import pickle
import subprocess
import sys

import torch

from deepspeed.checkpoint import constants, layout
from deepspeed.utils.tensor_fragment import fragment_address

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "upstream")


def _load(fixture: str, name: str) -> dict:
    # weights_only=False: what upstream's script does, and what needs the pickled classes.
    return torch.load(os.path.join(FIXTURES, fixture, "global_step3", name), weights_only=False)


def test_upstream_stage_1_and_2_optimizer_files_unpickle_with_plain_torch_load():
    # Their optimizer state pickles a `fragment_address` per parameter: without a class at that
    # path the load raised "Can't get attribute 'fragment_address'".
    for fixture, prefix in (("fp32_ws2_stage1", ""), ("bf16_ws2_stage2", "bf16_")):
        sd = _load(fixture, f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt")
        optim = sd[constants.OPTIMIZER_STATE_DICT]
        assert optim[constants.ZERO_STAGE] in (1, 2)
        assert optim[constants.PARTITION_COUNT] == [2]  # one per param group at stages 1-2
        assert all(t.dtype == torch.float32 for t in optim[constants.SINGLE_PARTITION_OF_FP32_GROUPS])
        assert sd[constants.DS_VERSION] == "0.19.8"
        addresses = [a for group in optim["param_slice_mappings"] for a in group.values()]
        assert addresses and all(isinstance(a, fragment_address) and a.numel > 0 for a in addresses)


def test_constants_name_the_keys_of_upstream_and_our_files(tmp_path):
    model = _load("fp32_ws2", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    optim = _load("fp32_ws2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")[constants.OPTIMIZER_STATE_DICT]
    for key in (
        constants.PARAM_SHAPES,
        constants.BUFFER_NAMES,
        constants.FROZEN_PARAM_SHAPES,
        constants.DS_VERSION,
    ):
        assert key in model, key
    assert constants.FP32_FLAT_GROUPS in optim and optim[constants.ZERO_STAGE] == 3
    assert layout.model_states_name(0) == (
        f"{constants.ZERO_FILE_PREFIX}0_{constants.MODEL_FILE_PREFIX}00{constants.MODEL_FILE_SUFFIX}"
    )
    assert layout.optim_states_name(1).endswith(constants.OPTIM_FILE_SUFFIX)
    assert constants.BF16_ZERO_FILE_PREFIX + "0_mp_rank_00_optim_states.pt" in os.listdir(
        os.path.join(FIXTURES, "bf16_ws2", "global_step3")
    )


def test_fragment_address_pickles_under_upstreams_path():
    blob = pickle.dumps(fragment_address(numel=6, start=4))
    assert b"deepspeed.utils.tensor_fragment" in blob and b"fragment_address" in blob
    assert pickle.loads(blob) == fragment_address(6, 4)


def test_saved_script_runs_the_installed_packages_command(tmp_path):
    # Upstream's `deepspeed.utils.zero_to_fp32` has no `main()`: only its `__main__` block.
    # A stand-in with just that block must be what the script runs, with its arguments.
    stub = tmp_path / "stub" / "deepspeed" / "utils"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("")
    (stub / "zero_to_fp32.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('ran with', sys.argv[1:])\n    sys.exit(3)\n"
    )
    folder = tmp_path / "ckpt"
    folder.mkdir()
    script = layout.write_recovery_script(str(folder))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    done = subprocess.run(
        [sys.executable, script, ".", "out"], cwd=folder, env=env, capture_output=True, text=True
    )
    assert done.returncode == 3 and "ran with ['.', 'out']" in done.stdout, done.stderr
