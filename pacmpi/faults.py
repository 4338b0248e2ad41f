"""End the whole MPI job when one rank fails, instead of leaving the others blocked.

An MPI rank that raises and exits normally runs ``MPI_Finalize`` at interpreter exit, which
waits for ranks that are themselves blocked in a collective waiting for it: the job hangs. The
tools here print the failure (traceback, prefixed with the rank and host, on stderr, flushed)
and then call ``MPI_Abort`` on ``COMM_WORLD``, which makes the launcher end every rank and exit
non-zero, as ``python -m mpi4py`` does.

- :func:`run_main` wraps a command-line entry point: ``sys.exit(run_main(main, argv))``.
- :func:`abort_on_exception` is a context manager and decorator for user code.
- :func:`install_excepthook` covers every unhandled exception of a script, in its main thread
  and in other threads.
- :func:`ensure_abort_on_error` installs that hook by default: pacmpi's transports' users
  (``PacTrainReducer``, ``PacTrainSync``, ``PacTrainCompressor``) call it with their world
  size, so a plain ``mpirun -n 4 python train.py`` ends when one rank raises.

They abort only when it is needed: more than one rank, known from MPI (initialized through
mpi4py, not finalized) or declared by :func:`ensure_abort_on_error`. Otherwise the exception
propagates (or, in :func:`run_main`, becomes an exit status) as usual. Nothing here imports
mpi4py, so importing this module never initializes MPI.
"""
import contextlib
import operator
import os
import socket
import sys
import threading
import traceback

__all__ = ["world", "abort_job", "abort_on_exception", "install_excepthook",
           "ensure_abort_on_error", "run_main"]

ABORT_ENV = "PACMPI_ABORT_ON_ERROR"
_ENV_OFF = ("0", "false", "no", "off")
_ENV_ON = ("", "1", "true", "yes", "on")

# The largest world size declared through ensure_abort_on_error: a transport that is not
# mpi4py's (Horovod over Gloo or its own MPI) still makes a failing rank worth aborting.
_declared_size = 1

# Where launchers put the rank and world size before MPI is initialized (Open MPI, PMIx,
# MPICH/Hydra and Intel MPI, Slurm's srun, torchrun).
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "RANK")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE")


def _live_mpi():
    """mpi4py's ``MPI`` module when MPI is usable now, else ``None`` (never imports it)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI


def _env_int(names):
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def world():
    """``(rank, size, mpi_live)`` of this process in ``COMM_WORLD``.

    From MPI when it is initialized (``mpi_live`` true), else from the launcher's environment,
    else ``(0, 1, False)``.
    """
    MPI = _live_mpi()
    if MPI is not None:
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), True
    rank, size = _env_int(_RANK_VARS), _env_int(_SIZE_VARS)
    return (rank or 0), (size or 1), False


def rank_prefix():
    """``"[pacmpi rank R/N on HOST] "``, to make interleaved output of many ranks attributable."""
    rank, size, _ = world()
    return f"[pacmpi rank {rank}/{size} on {socket.gethostname()}] "


def report_exception(exc, *, stream=None):
    """Write ``exc``'s traceback to ``stream`` (stderr), every line prefixed by the rank; flush.

    ``SystemExit`` and ``KeyboardInterrupt`` are reported in one line, without a traceback.
    """
    stream = sys.stderr if stream is None else stream
    prefix = rank_prefix()
    if isinstance(exc, SystemExit):
        lines = [f"exited with status {exc.code!r}\n"]
    elif isinstance(exc, KeyboardInterrupt):
        lines = ["interrupted (KeyboardInterrupt)\n"]
    else:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines)
    try:
        sys.stdout.flush()
        stream.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
        stream.flush()
    except (OSError, ValueError):  # closed or broken stream: still abort below
        pass


def abort_job(code=1):
    """End the whole job with status ``code`` (never returns).

    ``MPI_Abort`` on ``COMM_WORLD`` when MPI is live, so the launcher ends every rank; otherwise
    (or should Abort return) ``os._exit``, which skips ``MPI_Finalize`` and its wait for peers.
    """
    code = int(code) or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    MPI = _live_mpi()
    if MPI is not None:
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def exit_status(exc):
    """The process exit status an exception stands for.

    ``SystemExit``: its code (``None`` is 0; a non-integer, such as a message, is 1);
    ``KeyboardInterrupt``: 130 (128 + SIGINT, as shells report it); anything else: 1.
    """
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _must_abort(status):
    # A non-zero status on one rank is indistinguishable from that rank failing alone, and its
    # MPI_Finalize would then wait for peers blocked in a collective: abort. A zero status is a
    # normal exit, which every rank takes together.
    if status == 0:
        return False
    _, size, live = world()
    return (live and size > 1) or _declared_size > 1


class abort_on_exception(contextlib.ContextDecorator):
    """Context manager / decorator: an exception escaping the block aborts the whole job.

    With several ranks and MPI live, the exception is reported (traceback with rank prefix on
    stderr) and the job aborted with :func:`exit_status` of it (``SystemExit(0)`` passes
    through). With one rank, or MPI not initialized, the exception propagates unchanged.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not _must_abort(exit_status(exc)):
            return False
        report_exception(exc)
        abort_job(exit_status(exc))


def _run_previous(previous, default, *args):
    """Run the hook that was installed before ours, unless it is Python's default, whose
    output the rank-prefixed report replaces; a failure in it must not prevent the abort."""
    if previous is default:
        return
    try:
        previous(*args)
    except BaseException:  # noqa: B902 - abort anyway
        pass


def install_excepthook(*, threads=True):
    """Make an unhandled exception abort the job when it has several ranks.

    Chained to the hooks installed before: ``sys.excepthook`` for the main thread and, with
    ``threads`` (default), ``threading.excepthook`` for other threads. On one rank the
    previous hook alone runs, so behaviour is Python's own. On several ranks the previous hook
    runs first (a custom one: logging, error trackers; Python's default is replaced by the
    same traceback, prefixed with the rank), then the job is aborted with
    :func:`exit_status` of the exception. A thread's ``SystemExit`` ends only that thread, as
    in Python, and aborts nothing. Idempotent: installing again leaves one hook of each kind.
    Returns the ``sys.excepthook`` that was installed before.
    """
    previous = sys.excepthook
    if not getattr(previous, "_pacmpi_abort", False):
        def hook(exc_type, exc, tb):
            if not _must_abort(exit_status(exc)):
                return previous(exc_type, exc, tb)
            _run_previous(previous, sys.__excepthook__, exc_type, exc, tb)
            report_exception(exc)
            abort_job(exit_status(exc))

        hook._pacmpi_abort = True
        hook.previous = previous
        sys.excepthook = hook
    if threads and not getattr(threading.excepthook, "_pacmpi_abort", False):
        _install_thread_hook()
    return previous.previous if getattr(previous, "_pacmpi_abort", False) else previous


def _install_thread_hook():
    previous = threading.excepthook

    def thread_hook(args):
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        if issubclass(args.exc_type, SystemExit) or not _must_abort(exit_status(exc)):
            return previous(args)
        _run_previous(previous, threading.__excepthook__, args)
        name = getattr(args.thread, "name", None) or "unknown"
        try:
            sys.stderr.write(f"{rank_prefix()}unhandled exception in thread {name!r}; "
                             "aborting the job\n")
        except (OSError, ValueError, AttributeError):
            pass
        report_exception(exc)
        abort_job(exit_status(exc))

    thread_hook._pacmpi_abort = True
    thread_hook.previous = previous
    threading.excepthook = thread_hook


def ensure_abort_on_error(abort_on_error=None, *, size):
    """Make a failing rank end the whole job, unless opted out; ``True`` if the hook is on.

    pacmpi's users of a transport (``PacTrainReducer``, ``PacTrainSync``,
    ``PacTrainCompressor``) call this with their world ``size``. Without it, a plain
    ``mpirun -n 4 python train.py`` in which one rank raises hangs: the other ranks wait in
    an all-reduce for it, and it waits for them in ``MPI_Finalize``. So when ``size > 1`` this
    installs :func:`install_excepthook`: an exception nobody catches, in the main thread or in
    another thread (a data-prefetch thread that dies leaves the main thread waiting for it
    just as surely), is reported with the rank prefix after any custom hook installed before
    has run, and the job is aborted (``MPI_Abort`` when mpi4py's MPI is live, else
    ``os._exit``, which skips the finalization that would wait for the other ranks; the
    launcher then ends them). The launcher's exit status is non-zero.

    What stays as in Python: exceptions the program catches are untouched; ``sys.exit(0)``
    and a thread's ``SystemExit`` abort nothing; on one rank nothing is installed.

    ``abort_on_error``: ``None`` (default) reads ``$PACMPI_ABORT_ON_ERROR`` (``0``, ``false``,
    ``no``, ``off`` opt out; unset, ``1``, ``true``, ``yes``, ``on`` opt in); ``True`` or
    ``False`` decide regardless of the variable. Opting out leaves ``sys.excepthook`` and
    ``threading.excepthook`` untouched, but does not remove a hook already installed (by an
    earlier object, or by the program). Installing is idempotent: one hook of each kind.
    """
    if abort_on_error is None:
        value = os.environ.get(ABORT_ENV, "").strip().lower()
        if value not in _ENV_OFF + _ENV_ON:
            raise ValueError(f"{ABORT_ENV}={value!r}: use 1 (abort the job on an unhandled "
                             "exception, the default) or 0")
        abort_on_error = value in _ENV_ON
    elif not isinstance(abort_on_error, bool):
        raise TypeError(f"abort_on_error must be None, True or False, got {abort_on_error!r}")
    try:
        valid = not isinstance(size, bool) and operator.index(size) >= 1
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    size = operator.index(size)
    if not abort_on_error or size <= 1:
        return False
    global _declared_size
    _declared_size = max(_declared_size, size)
    install_excepthook(threads=True)
    return True


def run_main(main, argv=None):
    """Call ``main(argv)`` and return its exit status; a failure on one rank ends the job.

    ``main`` returns ``None``/``0`` on success or an integer status. An exception (including
    ``KeyboardInterrupt``) or a non-zero status is reported on stderr with the rank prefix;
    with several ranks and MPI live the job is then aborted with that status (every rank ends,
    the launcher exits non-zero), otherwise the status is returned (1 for an exception, 130
    for ``KeyboardInterrupt``, ``SystemExit``'s code). Use as ``sys.exit(run_main(main))``.
    """
    try:
        result = main(argv)
        status = 0 if result is None else int(result)
        if _must_abort(status):
            report_exception(SystemExit(status))
            abort_job(status)
        return status
    except BaseException as exc:  # noqa: B902 - every failure must end the job
        status = exit_status(exc)
        if status == 0:
            return 0
        if isinstance(exc, SystemExit) and not _must_abort(status):
            # argparse and sys.exit("message") already told the user; keep their output.
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
            return status
        report_exception(exc)
        if _must_abort(status):
            abort_job(status)
        return status
