"""The scripts' checks of their command-line flags, before any work: a file a flag writes
(`check_output`), a count (`at_least`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def check_output(flag: str, path: str | Path | None) -> None:
    """Raises ValueError where `path`, the file a command-line `flag` writes, cannot be one: its
    directory missing, or a directory itself; for before the work (None or "": no output)."""
    if not path:
        return
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: a directory, not a file")
    if not Path(path).absolute().parent.is_dir():
        raise ValueError(f"{flag} {path}: no such directory")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: an integer of at least `minimum`; anything else is the flag's usage
    error (exit 2), before any work."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse
