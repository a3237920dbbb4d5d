"""Developer tools that ship with the package (run them with `python -m deepspeed.tools.<name>`).

- `zero_codemod`: rewrites duplicated `if zero3: with GatheredParameters(...): X else: X` blocks
  (and the `zero.Init` equivalent) into one body with `start()` / `stop()`.
"""
