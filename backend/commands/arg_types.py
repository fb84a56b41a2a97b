"""argparse value types shared by the commands, so a bad value is refused before anything loads, naming its flag."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """An integer >= 1: a number of requests, prompts, streams, tokens ..."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value
