"""Run a command on n ranks (``mpirun`` or ``horovodrun``), optionally on the shaped test bed.

:func:`run_command` is the programmatic entry point behind ``pacmpi-run``. It streams the
launcher's output through (optionally capturing it), bounds the run by a timeout, ends the
launcher on Ctrl-C/SIGTERM, and when the launcher fails names the failed rank in one line
(see :mod:`.failure`).
"""
import collections
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from ._signals import unwind_on_signals
from .failure import describe_failure, parse_rank_failure
from .mpi import build_horovodrun_command, build_mpirun_command, detect_mpi
from .testbed import INTERFACE, LinkTestbed, format_rate

__all__ = ["RunResult", "run_command", "TIMEOUT_EXIT"]

TIMEOUT_EXIT = 124  # what coreutils' timeout(1) returns; scripts already know it
_TAIL_LINES = 400  # enough of the launcher's output to find its failure report


@dataclass
class RunResult:
    """Outcome of :func:`run_command`.

    ``returncode``: the launcher's exit status (``TIMEOUT_EXIT`` after a timeout, 0 for a dry
    run); ``command``: what was (or, for a dry run, would be) executed; ``stdout``/``stderr``:
    the full output when ``capture=True``, else ``None``; ``failure``: the parsed
    :class:`~.failure.RankFailure` (or ``None``); ``failure_message``: the line printed about
    it; ``calibration``: the test bed's calibration dict; ``timed_out``: the timeout fired;
    ``setup_commands``: the test bed's set-up commands (shown by a dry run).
    """

    returncode: int
    command: list
    stdout: str = None
    stderr: str = None
    failure: object = None
    failure_message: str = None
    calibration: dict = None
    timed_out: bool = False
    setup_commands: list = field(default_factory=list)


def _pump(stream, sink, keep, echo):
    """Copy a child's output line by line to ``sink`` (when ``echo``) and into ``keep``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        keep.append(line)
        if echo:
            sink.write(line)
            sink.flush()
    stream.close()


def _end(proc, grace):
    """Ask the launcher to stop (it then ends its ranks), then kill its process group."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # Runs also when a second Ctrl-C interrupts the grace period.
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def _execute(cmd, *, env, timeout, capture, echo, grace):
    """Run ``cmd``; return (returncode, stdout lines, stderr lines, timed_out)."""
    keep = (lambda: []) if capture else (lambda: collections.deque(maxlen=_TAIL_LINES))
    out, err = keep(), keep()
    # Own session: the launcher survives nothing we do not tell it, and killpg() reaches
    # everything it started locally. stdin is not forwarded (training jobs do not read it).
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, out, echo), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, err, echo), daemon=True)]
    for pump in pumps:
        pump.start()
    timed_out = False
    try:
        with unwind_on_signals():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if proc.poll() is None:
            _end(proc, grace)
        for pump in pumps:
            pump.join(timeout=10)
    return (TIMEOUT_EXIT if timed_out else proc.returncode), list(out), list(err), timed_out


def _say(message):
    sys.stderr.write(f"pacmpi-run: {message}\n")
    sys.stderr.flush()


def run_command(argv, n, *, link=None, horovod=False, oversubscribe=False, hostfile=None,
                env=(), calibrate=True, tolerance=0.15, timeout=None, capture=False, echo=True,
                dry_run=False, mpirun="mpirun", tag_output=True, extra_mca=None, grace=10.0):
    """Run ``argv`` on ``n`` ranks and return a :class:`RunResult`.

    Knobs:
      ``link``           tc rate like ``"100mbit"`` to run on the shaped test bed (needs
                         root); ``None``/``"none"`` runs on the host's network as usual.
      ``horovod``        launch with ``horovodrun --gloo`` instead of ``mpirun``.
      ``oversubscribe``, ``hostfile``, ``tag_output``, ``extra_mca``: see
                         :func:`~.mpi.build_mpirun_command`.
      ``env``            entries ``NAME`` (forward) or ``NAME=VALUE`` (set) for every rank.
      ``calibrate``      on the test bed, measure the link first (with ``max(n, 2)`` ranks)
                         and refuse to run (``CalibrationError``) when it is more than
                         ``tolerance`` off nominal.
      ``timeout``        seconds before the launcher is ended; the result then has
                         ``returncode == TIMEOUT_EXIT`` and ``timed_out``.
      ``capture``        keep the full output in the result; ``echo`` also prints it live.
      ``dry_run``        build the command (and test-bed set-up) without running anything.
      ``grace``          seconds the launcher gets to end its ranks before SIGKILL.

    Raises ``TestbedError``/``CalibrationError`` (test bed), ``MPIDetectionError`` (no usable
    ``mpirun``) and ``ValueError`` (bad arguments). Ctrl-C and SIGTERM end the launcher, remove
    the test bed and then propagate (``KeyboardInterrupt`` / ``SystemExit(143)``).
    """
    argv = list(argv)
    testbed = None if link in (None, "none") else LinkTestbed(link, mpirun=mpirun)
    child_env = dict(os.environ)
    for entry in env:
        name, sep, value = entry.partition("=")
        if sep:
            child_env[name] = value
    if horovod:
        cmd = build_horovodrun_command(n, argv, network_interface=INTERFACE if testbed else None)
    else:
        cmd = build_mpirun_command(detect_mpi(mpirun), n, argv, oversubscribe=oversubscribe,
                                   env_forward=env, tag_output=tag_output, hostfile=hostfile,
                                   extra_mca=extra_mca,
                                   tcp_only_interface=INTERFACE if testbed else None)
    if testbed:
        cmd = testbed.wrap(cmd)
    setup = testbed.setup_commands() if testbed else []
    if dry_run:
        return RunResult(0, cmd, setup_commands=setup)

    calibration = None
    launcher = "horovodrun" if horovod else "mpirun"
    if testbed:
        with testbed:
            if calibrate:
                calibration = testbed.calibrate(max(n, 2), tolerance=tolerance)
                if echo:
                    _say(f"calibration: {calibration['n']} ranks, {calibration['nbytes']} B "
                         f"{calibration['algorithm']} all-reduce in {calibration['time_s']:.3f} s: "
                         f"link {format_rate(calibration['link_bps'])} = "
                         f"{calibration['ratio']:.1%} of nominal {format_rate(calibration['nominal_bps'])}, "
                         f"bus bw {format_rate(calibration['busbw_bps'])}")
            rc, out, err, timed_out = _execute(cmd, env=child_env, timeout=timeout,
                                               capture=capture, echo=echo, grace=grace)
    else:
        rc, out, err, timed_out = _execute(cmd, env=child_env, timeout=timeout, capture=capture,
                                           echo=echo, grace=grace)

    result = RunResult(rc, cmd, calibration=calibration, timed_out=timed_out, setup_commands=setup)
    if capture:
        result.stdout, result.stderr = "".join(out), "".join(err)
    if timed_out:
        result.failure_message = f"pacmpi-run: {launcher} ended after the {timeout} s timeout"
    elif rc != 0:
        result.failure = parse_rank_failure("".join(err) + "".join(out))
        result.failure_message = describe_failure(result.failure, rc, launcher)
    if result.failure_message and echo:
        sys.stderr.write(result.failure_message + "\n")
        sys.stderr.flush()
    return result

