"""Ctrl-C held back while a step runs (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Holds SIGINT (Ctrl-C) back until the block ends, then raises its KeyboardInterrupt.

    NOTE: an interrupt between a donated call and the rebinding of its result would leave the
    KV cache deleted; a step is short, so it runs whole. Only the main thread receives signals,
    and only Python's own handler is replaced: elsewhere this changes nothing.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
