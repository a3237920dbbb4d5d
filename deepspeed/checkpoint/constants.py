"""Upstream DeepSpeed's names for the keys and file names of its checkpoints (its module path).

The `zero_to_fp32.py` that upstream copies beside every checkpoint imports its key names from
here, so that script runs on this package too; this package's files carry the same keys
where they hold the same things (layout.py describes them).
"""

# The optimizer-states file (`*_optim_states.pt`): what its `optimizer_state_dict` holds.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"  # stage 3: each param group's fp32 partition, flat
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # stages 1-2: the same
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"

# The model-states file (`*_model_states.pt`).
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"

# File names: `{ZERO_FILE_PREFIX}{r}_{MODEL_FILE_PREFIX}00{MODEL_FILE_SUFFIX}` and so on.
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX  # upstream's bf16 optimizer files (read here too)
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

# Model-parallel degrees recorded with a checkpoint.
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"

# Upstream's automatic expert parallelism (not built here): keys its newer zero_to_fp32.py
# imports, and looks for in a checkpoint. This package's checkpoints never carry them.
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
