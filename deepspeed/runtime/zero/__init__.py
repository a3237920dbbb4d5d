"""ZeRO stage 3: partitioned parameters, Init, GatheredParameters, and the stage-3 optimizer.

Kept empty of imports so that light submodules (``zero.config``) import without the heavy ones.
"""
