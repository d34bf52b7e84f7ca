# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""`python -m nprf_hf.cli` and `nprf_hf.cli.main`: the command line itself is the top-level module
`nprf_hf_cli` (beside the package, so that `nprf-hf --help` does not import torch)."""

import sys

from nprf_hf_cli import (
    SUBCOMMANDS,
    add_card_parser,
    add_convert_parser,
    build_parser,
    main,
    run_card,
    run_convert,
)


__all__ = ["SUBCOMMANDS", "add_card_parser", "add_convert_parser", "build_parser", "main",
           "run_card", "run_convert"]

if __name__ == "__main__":
    sys.exit(main())
