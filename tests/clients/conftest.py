import os

# Tiny models are built from configs in code; nothing may be downloaded. Set before the rank
# processes are spawned, so that they inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
