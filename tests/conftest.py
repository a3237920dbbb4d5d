import os

# Tests run on the CPU with gloo unless a GPU machine says otherwise; keep thread counts low
# so that spawned ranks do not fight over the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
