"""Upstream's path of `zero_to_fp32` (its command, `python -m`, and the script saved beside
every checkpoint import it); the code is `deepspeed/checkpoint/zero_to_fp32.py`.

Imported, this name is that very module (one object: a patch of either path patches both).
"""

import sys

from deepspeed.checkpoint import zero_to_fp32 as _module

if __name__ == "__main__":  # python -m deepspeed.utils.zero_to_fp32
    sys.exit(_module.main())
sys.modules[__name__] = _module
