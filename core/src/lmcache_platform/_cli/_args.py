"""argparse types the subcommands share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts and sizes: a positive integer, or a usage error."""
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
