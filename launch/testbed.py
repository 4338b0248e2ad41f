"""A bandwidth-limited link on one machine: a network namespace whose loopback is shaped by tbf.

All ranks run inside a private network namespace and talk TCP over its ``lo``, which a token
bucket filter limits to the nominal rate. Every byte any rank sends crosses that one queue, so
the test bed models ONE shared bottleneck link (like several workers behind one slow uplink),
not a private link per rank.

Set-up (needs root, iproute2 and the kernel's tbf qdisc)::

    ip netns add NAME
    ip netns exec NAME ip link set lo up
    ip netns exec NAME ip link set lo mtu 9000
    ip netns exec NAME tc qdisc add dev lo root tbf rate RATE burst 64kb latency 200ms

The namespace is removed, and processes left in it are ended, on every exit path: leaving the
``with`` block (normally or by exception), ``atexit``, and SIGINT/SIGTERM (which unwind the
stack into ``__exit__``; see :mod:`._signals`).

Calibration (:meth:`LinkTestbed.calibrate`) times a dense float32 all-reduce of S bytes on n
ranks with the ring algorithm pinned. A ring all-reduce makes each rank send 2(n-1)/n * S
bytes, so 2(n-1) * S bytes cross the shared link per call and::

    link_bps  = 2 * (n - 1) * S * 8 / t      (compared with the nominal rate)
    algbw_bps = S * 8 / t
    busbw_bps = algbw_bps * 2 * (n - 1) / n  (= link_bps / n: the link is shared by n ranks)

Measured here (Open MPI 5.0.11, 2 cores, ~0.5 s per call) link_bps is 98-99% of nominal at
100mbit and 1gbit with 2 and 4 ranks. Without the ring pinned Open MPI picked another
algorithm for 3 ranks that moves more bytes (88% by this model), hence the pin.
"""
import atexit
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ._signals import unwind_on_signals
from .mpi import build_mpirun_command, detect_mpi, ring_allreduce_settings

__all__ = [
    "TestbedError",
    "CalibrationError",
    "parse_rate",
    "format_rate",
    "link_model",
    "LinkTestbed",
    "probe_testbed",
]

INTERFACE = "lo"
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_names = itertools.count()


class TestbedError(RuntimeError):
    """The test bed cannot be set up or used (missing root, tools, kernel support, ...)."""

    __test__ = False  # not a pytest test class despite the name


class CalibrationError(RuntimeError):
    """Calibration measured a link rate too far from the nominal one; ``result`` holds the
    measurement (the same dict :meth:`LinkTestbed.calibrate` would have returned)."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


def parse_rate(rate):
    """Parse a tc-style rate such as ``"100mbit"`` or ``"1gbit"`` into bits per second (int).

    Units are decimal (``kbit`` = 1000 bit/s, as in tc). Byte units are refused on purpose:
    tc reads ``mbps`` as megaBYTES per second, a factor-8 trap.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(rate).lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(
            f"bad link rate {rate!r}: expected a number and one of the units "
            f"{', '.join(_UNITS)} (e.g. 100mbit, 1gbit); byte units like 'mbps' are not accepted")
    bps = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bps <= 0:
        raise ValueError(f"bad link rate {rate!r}: must be above zero")
    return bps


def format_rate(bps):
    """``100000000`` -> ``"100.0 Mbit/s"``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def link_model(n, nbytes, seconds):
    """Rates implied by one ring all-reduce of ``nbytes`` on ``n`` ranks taking ``seconds``."""
    algbw = nbytes * 8 / seconds
    return {"link_bps": 2 * (n - 1) * algbw, "algbw_bps": algbw, "busbw_bps": algbw * 2 * (n - 1) / n}


def _run(cmd, what, timeout=30):
    """Run a set-up command; raise TestbedError naming ``what`` and tc/ip's own message."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{what}: `{' '.join(cmd)}` did not finish within {timeout} s") from exc
    if done.returncode != 0:
        raise TestbedError(f"{what}: `{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class LinkTestbed:
    """Context manager for the shaped-loopback namespace.

    Knobs: ``rate`` (tc rate, e.g. ``"100mbit"``), ``burst`` and ``latency`` (tbf bucket size
    and queue bound; the defaults keep measured rates within 2% of nominal up to 1gbit),
    ``mtu`` of the namespace's ``lo`` (9000 like a jumbo-frame LAN; smaller means more packets
    per byte and more CPU), ``mpirun`` (the launcher calibration uses; ``None``: see
    :func:`~.launchers.find_launcher`).

    ``name`` is unique per process and instance (``pacmpi-PID-K``) so concurrent test beds and
    leftovers from a crashed run never collide.
    """

    def __init__(self, rate, *, burst="64kb", latency="200ms", mtu=9000, mpirun=None):
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.burst, self.latency, self.mtu, self.mpirun = burst, latency, mtu, mpirun
        self.name = f"pacmpi-{os.getpid()}-{next(_names)}"
        self.active = False
        self._signals = None

    def check_preconditions(self):
        """Raise :class:`TestbedError` saying what is missing: root, ``ip`` or ``tc``."""
        if os.geteuid() != 0:
            raise TestbedError(
                "--link needs root: it creates a network namespace and a tc qdisc "
                "(run as root or under sudo, or leave out --link)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise TestbedError(
                    f"--link needs iproute2's `{tool}` on PATH (Debian/Ubuntu: apt-get install iproute2)")

    def setup_commands(self):
        """The commands :meth:`__enter__` runs, in order (also shown by ``--dry-run``)."""
        inside = ["ip", "netns", "exec", self.name]
        return [
            ["ip", "netns", "add", self.name],
            inside + ["ip", "link", "set", INTERFACE, "up"],
            inside + ["ip", "link", "set", INTERFACE, "mtu", str(self.mtu)],
            inside + ["tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf", "rate",
                      f"{self.rate_bps}bit", "burst", self.burst, "latency", self.latency],
        ]

    def wrap(self, cmd):
        """Return ``cmd`` prefixed so that it runs inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def __enter__(self):
        self.check_preconditions()
        self._signals = unwind_on_signals()
        self._signals.__enter__()
        atexit.register(self.cleanup)
        self.active = True
        try:
            add, up, mtu, qdisc = self.setup_commands()
            _run(add, "could not create the network namespace (is this a container without "
                      "CAP_SYS_ADMIN?)")
            _run(up, "could not bring up lo in the namespace")
            _run(mtu, f"could not set lo's MTU to {self.mtu}")
            _run(qdisc, "could not attach the tbf qdisc (kernel without sch_tbf, or a bad "
                        "burst/latency value?)")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc_info):
        self.cleanup()

    def cleanup(self):
        """End processes left in the namespace, delete it, drop the atexit and signal hooks.

        Idempotent, and safe to call from ``atexit``. Processes are ended first because
        ``ip netns del`` only removes the name: a namespace lives on while anything runs in it.
        """
        if not self.active:
            return
        self.active = False
        try:
            self._end_processes()
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        finally:
            atexit.unregister(self.cleanup)
            signals, self._signals = self._signals, None
            if signals is not None:
                signals.__exit__(None, None, None)

    def _pids(self):
        done = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True,
                              timeout=30)
        return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []

    def _end_processes(self, grace=3.0):
        """SIGTERM everything in our namespace, then SIGKILL what is still there after ``grace``."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            pids = self._pids()
            for pid in pids:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = self._pids()
            if not pids:
                return

    def mpirun_command(self, flavor, n, argv, **options):
        """``build_mpirun_command`` with TCP pinned to the namespace's shaped ``lo``, wrapped."""
        return self.wrap(build_mpirun_command(flavor, n, argv, tcp_only_interface=INTERFACE,
                                              **options))

    def calibrate(self, n=4, nbytes=None, repeats=3, *, tolerance=0.15, seconds_per_call=0.5,
                  timeout=120):
        """Measure the shared link with a dense all-reduce; return the result dict.

        ``nbytes`` defaults to the size whose ring all-reduce takes ``seconds_per_call`` at the
        nominal rate (clamped to 1 MiB..256 MiB), long enough that connection set-up, tbf's
        burst and per-step latency stay around 1%. The median of ``repeats`` timed calls
        (after one warm-up) is used. Raises :class:`CalibrationError` when ``link_bps`` is more
        than ``tolerance`` (fraction) away from the nominal rate, and :class:`TestbedError`
        when the benchmark itself fails or exceeds ``timeout`` seconds.
        """
        if not self.active:
            raise TestbedError("calibrate() needs an active test bed (use it inside `with`)")
        if n < 2:
            raise ValueError("calibration needs at least 2 ranks (one rank sends nothing)")
        if nbytes is None:
            nbytes = self.rate_bps * seconds_per_call / (8 * 2 * (n - 1))
            nbytes = int(min(max(nbytes, 2**20), 2**28)) // 4 * 4
        flavor = detect_mpi(self.mpirun)
        mca, env = ring_allreduce_settings(flavor)
        script = Path(__file__).with_name("_calibrate.py")
        # Oversubscribe: the ranks mostly wait on the link, so more ranks than cores is fine.
        cmd = self.mpirun_command(flavor, n, [sys.executable, str(script), str(nbytes), str(repeats)],
                                  oversubscribe=True, tag_output=False, extra_mca=mca,
                                  env_forward=env)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(f"calibration did not finish within {timeout} s") from exc
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise TestbedError(f"calibration run failed (exit status {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        measured = json.loads(lines[-1])
        seconds = statistics.median(measured["times"])
        result = {
            "rate": self.rate, "nominal_bps": self.rate_bps, "n": n,
            "nbytes": measured["nbytes"], "repeats": repeats, "times_s": measured["times"],
            "time_s": seconds, **link_model(n, measured["nbytes"], seconds),
            "algorithm": "ring" if mca or env else "implementation default",
            "mpi": flavor.describe(), "tolerance": tolerance,
        }
        result["ratio"] = result["link_bps"] / self.rate_bps
        if abs(result["ratio"] - 1) > tolerance:
            raise CalibrationError(
                f"calibration refused: the shared link carried {format_rate(result['link_bps'])}, "
                f"{result['ratio']:.0%} of the nominal {format_rate(self.rate_bps)} "
                f"(allowed: within {tolerance:.0%}); results on this test bed would be wrong", result)
        return result


def probe_testbed():
    """Why this user cannot build the shaped test bed here, or ``None`` when it can.

    Builds a real one (namespace, ``lo`` up, MTU, tbf qdisc) and removes it, so every
    requirement is checked the way ``pacmpi-run --link`` needs it: root, iproute2's ``ip``
    and ``tc``, network namespaces (CAP_SYS_ADMIN) and the kernel's tbf qdisc.
    """
    try:
        with LinkTestbed("1gbit"):
            return None
    except TestbedError as exc:
        return str(exc)
