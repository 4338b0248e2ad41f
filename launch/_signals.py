"""Turn SIGINT/SIGTERM into exceptions for a while, so ``finally``/``__exit__`` clean-up runs,
and hold them off while that clean-up itself runs.

Python's default SIGTERM action kills the process on the spot, skipping every ``finally``
block; a launcher that dies like that leaves its ranks running and its network namespace
behind. Inside :func:`unwind_on_signals` a SIGTERM raises ``SystemExit(143)`` instead, and a
SIGINT whatever the previous handler does (by default ``KeyboardInterrupt``), so the stack
unwinds through the clean-up code. Inside :func:`signals_held` (the clean-up) they are noted
and raised again at its end, so a second Ctrl-C cannot stop a removal half way. The previous
handlers are restored on exit.

Both only act in the main thread (the only one that may set handlers; elsewhere they do
nothing, and the caller's ``finally`` and ``atexit`` clean-up still cover normal exits and
exceptions). A handler set outside Python (``getsignal()`` gives ``None``) could not be
restored afterwards, so such a signal is left alone.
"""
import contextlib
import signal
import threading

__all__ = ["unwind_on_signals", "signals_held"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What a Python program does with each signal when it inherited nothing special.
_PYTHON_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def _handler_for(previous):
    def handle(signum, frame):
        if previous == signal.SIG_IGN:
            return  # whoever installed SIG_IGN asked for the signal to be ignored
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
            return
        raise SystemExit(128 + signum)  # SIG_DFL would end the process without clean-up
    return handle


def _current_handlers():
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    return {signum: handler for signum, handler in handlers.items() if handler is not None}


@contextlib.contextmanager
def _handlers(replacements, previous):
    for signum, handler in replacements.items():
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def unwind_on_signals(*, even_if_ignored=False):
    """Within the block, SIGINT/SIGTERM unwind the stack instead of killing the process.

    A signal the process ignores stays ignored, unless ``even_if_ignored``: then it acts as in
    a plain Python program (SIGINT raises ``KeyboardInterrupt``, SIGTERM ``SystemExit(143)``).
    That is for a program whose contract is to stop on these signals, as ``pacmpi-run``'s is:
    a non-interactive shell starts a background job (``make test &``, many CI runners) with
    SIGINT ignored, as POSIX asks, Python keeps it ignored, and such a program would never
    stop on SIGINT.
    """
    previous = _current_handlers()
    acting = {signum: _PYTHON_DEFAULTS[signum] if even_if_ignored and handler == signal.SIG_IGN
              else handler for signum, handler in previous.items()}
    with _handlers({signum: _handler_for(handler) for signum, handler in acting.items()},
                   previous):
        yield


@contextlib.contextmanager
def signals_held():
    """Within the block, SIGINT/SIGTERM are noted, not acted on; on leaving it the first one
    noted is raised again, so it acts (through the handlers restored by then) as if it had
    arrived just after the block. For clean-up code, which must run to its end."""
    previous = _current_handlers()
    noted = []
    try:
        with _handlers({signum: lambda signum, frame: noted.append(signum)
                        for signum in previous}, previous):
            yield
    finally:
        if noted:
            signal.raise_signal(noted[0])
