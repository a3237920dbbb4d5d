"""The `deepspeed` launcher: `runner` parses the command line and picks the mode, `hostfile`
selects hosts and devices, `multinode_runner` builds the pdsh / ssh / MPI / Slurm command
lines, and `launch` starts and supervises one node's ranks (docs/launcher.md).

The launcher runs each rank as a plain subprocess and stays out of the comm layer; the ranks
set up their process group themselves (`deepspeed.comm`).
"""

from deepspeed import _lazy_attributes

__getattr__ = _lazy_attributes(__name__, globals())
