"""`deepspeed.add_config_arguments`: the command-line flags upstream adds to a client's parser."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed`, `--deepspeed_config` (and the deprecated `--deepscale*` spellings).

    Returns the parser, as upstream does, so calls chain: `args = add_config_arguments(p).parse_args()`.
    `deepspeed.initialize(args=args)` reads `args.deepspeed_config` when no `config` is passed.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (helper flag for user code)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config"
    )
    return parser
