"""Turn SIGINT/SIGTERM into exceptions for a while, so ``finally``/``__exit__`` clean-up runs.

Python's default SIGTERM action kills the process on the spot, skipping every ``finally``
block; a launcher that dies like that leaves its ranks running and its network namespace
behind. Inside :func:`unwind_on_signals` a SIGTERM raises ``SystemExit(143)`` instead, and a
SIGINT whatever the previous handler does (by default ``KeyboardInterrupt``), so the stack
unwinds through the clean-up code. The previous handlers are restored on exit.
"""
import contextlib
import signal
import threading

__all__ = ["unwind_on_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _handler_for(previous):
    def handle(signum, frame):
        if previous == signal.SIG_IGN:
            return  # whoever installed SIG_IGN asked for the signal to be ignored
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
            return
        raise SystemExit(128 + signum)  # SIG_DFL would end the process without clean-up
    return handle


@contextlib.contextmanager
def unwind_on_signals():
    """Within the block, SIGINT/SIGTERM unwind the stack instead of killing the process.

    Signal handlers can only be set from the main thread; elsewhere this does nothing (the
    caller's ``finally`` and ``atexit`` clean-up still cover normal exits and exceptions).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # getsignal() returns None for a handler set outside Python, which could not be restored
    # afterwards; such signals are left alone.
    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    previous = {signum: handler for signum, handler in previous.items() if handler is not None}
    for signum, handler in previous.items():
        signal.signal(signum, _handler_for(handler))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
