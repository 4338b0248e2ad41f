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
stack into ``__exit__``; see :mod:`._signals`). A run killed by SIGKILL cannot do it: the next
test bed to start removes what it left (see :mod:`._namespaces`).

Calibration (:meth:`LinkTestbed.calibrate`) times a dense float32 all-reduce of S bytes on n
ranks with the ring algorithm pinned. A ring all-reduce makes each rank send 2(n-1)/n * S
bytes, so 2(n-1) * S bytes cross the shared link per call and::

    link_bps  = 2 * (n - 1) * S * 8 / t      (compared with the nominal rate)
    algbw_bps = S * 8 / t
    busbw_bps = algbw_bps * 2 * (n - 1) / n  (= link_bps / n: the link is shared by n ranks)

Measured here (Open MPI 5.0.11, 2 cores, ~0.5 s per call) link_bps is 98-99% of nominal at
100mbit and 1gbit with 2 and 4 ranks. Without the ring pinned Open MPI picked another
algorithm for 3 ranks that moves more bytes (88% by this model), hence the pin.

:class:`NamespaceBed` holds what this bed shares with the multi-node one (:mod:`.nodes`):
set-up steps, clean-up of every namespace on every exit path, and the calibration run.
"""
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from pacmpi.costmodel import ring_factor, ring_seconds
from pacmpi.units import format_rate, parse_rate

from ._namespaces import delete, end_processes, new_name, remove_stale, workdir
from ._signals import signals_held, unwind_on_signals
from .mpi import build_mpirun_command, detect_mpi, ring_collectives_env

__all__ = ["TestbedError", "CalibrationError", "tbf_command", "NamespaceBed", "LinkTestbed",
           "probe_testbed"]

INTERFACE = "lo"
TOPOLOGIES = ("shared", "star")


class TestbedError(RuntimeError):
    """The test bed cannot be set up or used (missing root, tools, kernel support, ...)."""

    __test__ = False  # not a pytest test class despite the name


class CalibrationError(RuntimeError):
    """Calibration measured a link rate too far from the nominal one; ``result`` holds the
    measurement (the same dict :meth:`LinkTestbed.calibrate` would have returned)."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


def link_model(n, nbytes, seconds, topology="shared"):
    """Rates implied by one ring all-reduce of ``nbytes`` on ``n`` ranks taking ``seconds``.

    Each rank sends 2(n-1)/n of the buffer. ``"shared"``: all of it, 2(n-1) buffers, crosses
    one link; ``"star"``: each rank (node) has a private full-duplex link that carries only its
    own 2(n-1)/n buffers, so ``link_bps`` equals the bus bandwidth.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"bad topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}")
    algbw = nbytes * 8 / seconds
    return {"link_bps": algbw * ring_factor(n, topology), "algbw_bps": algbw,
            "busbw_bps": algbw * ring_factor(n, "star")}


def run_setup(cmd, what, timeout=30):
    """Run a set-up command; raise TestbedError naming ``what`` and tc/ip's own message."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{what}: `{' '.join(cmd)}` did not finish within {timeout} s") from exc
    if done.returncode != 0:
        raise TestbedError(f"{what}: `{' '.join(cmd)}` failed: "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def tbf_command(rate_bps, device, burst, latency, namespace):
    """``tc`` command that shapes ``device``'s egress in ``namespace`` to ``rate_bps``."""
    return ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{rate_bps}bit", "burst", burst, "latency", latency]


class NamespaceBed:
    """What every shaped test bed shares: network namespaces made by a list of set-up steps,
    removed (with anything left running in them) on every exit path, and a calibration that
    times a ring all-reduce and compares the link rate it implies with the nominal one.

    Subclasses give ``namespaces`` (all they create), ``_setup_steps()`` (``(command, what
    went wrong)`` pairs), ``mpirun_command`` and ``topology``; ``option`` names the CLI option
    in error messages; ``tools`` the commands that must be on ``PATH``. Files a bed needs go
    under ``workdir`` (created by ``_prepare`` when needed), removed with the namespaces.

    ``name`` (``pacmpi-PID-K``) is unique per process and instance and carries the owner's
    pid: entering a bed first removes what runs whose owner died (SIGKILL) left behind, never
    a live run's (see :mod:`._namespaces`).
    """

    option = "--link"
    tools = (("ip", "iproute2"), ("tc", "iproute2"))
    topology = "shared"
    namespaces = ()

    def __init__(self, rate, *, burst="64kb", latency="200ms", mtu=9000, mpirun=None):
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.burst, self.latency, self.mtu, self.mpirun = burst, latency, mtu, mpirun
        self.name = new_name()
        self.workdir = workdir(self.name)
        self.active = False
        self._signals = None

    def check_preconditions(self):
        """Raise :class:`TestbedError` saying what is missing: root, or a tool from ``tools``."""
        if os.geteuid() != 0:
            raise TestbedError(
                f"{self.option} needs root: it creates network namespaces and tc qdiscs "
                f"(run as root or under sudo, or leave out {self.option})")
        for tool, package in self.tools:
            if shutil.which(tool) is None:
                raise TestbedError(
                    f"{self.option} needs {package}'s `{tool}` on PATH (Debian/Ubuntu: "
                    f"apt-get install {package})")

    def setup_commands(self):
        """The commands :meth:`__enter__` runs, in order (also shown by ``--dry-run``)."""
        return [cmd for cmd, _ in self._setup_steps()]

    def _setup_steps(self):
        raise NotImplementedError

    def _prepare(self):
        """Hook run before the set-up commands (e.g. to write files the launch needs)."""

    def __enter__(self):
        self.check_preconditions()
        remove_stale()
        self.active = True
        try:
            self._signals = unwind_on_signals()
            self._signals.__enter__()
            atexit.register(self.cleanup)
            self._prepare()
            for cmd, what in self._setup_steps():
                run_setup(cmd, what)
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc_info):
        self.cleanup()

    def cleanup(self):
        """End processes left in the namespaces, delete them and ``workdir``, drop the atexit
        and signal hooks.

        Idempotent, and safe to call from ``atexit``. SIGINT/SIGTERM arriving meanwhile act
        once it is done. Processes are ended first because ``ip netns del`` only removes the
        name: a namespace lives on while anything runs in it. Bounded: at most 2 x 3 s to end
        the processes, then one ``ip`` process for all the namespaces.
        """
        if not self.active:
            return
        self.active = False
        try:
            with signals_held():
                end_processes(self.namespaces)
                delete(self.namespaces)
                shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            atexit.unregister(self.cleanup)
            signals, self._signals = self._signals, None
            if signals is not None:
                signals.__exit__(None, None, None)

    def mpirun_command(self, flavor, n, argv, **options):
        raise NotImplementedError

    def calibrate_ranks(self, n, nbytes, repeats, *, tolerance, seconds_per_call, timeout):
        """Time a ring all-reduce on ``n`` ranks; see :meth:`LinkTestbed.calibrate`."""
        if not self.active:
            raise TestbedError("calibrate() needs an active test bed (use it inside `with`)")
        if n < 2:
            raise ValueError("calibration needs at least 2 ranks (one rank sends nothing)")
        if nbytes is None:
            nbytes = self.rate_bps * seconds_per_call / (8 * ring_factor(n, self.topology))
            nbytes = int(min(max(nbytes, 2**20), 2**28)) // 4 * 4
        flavor = detect_mpi(self.mpirun)
        ring = ring_collectives_env(flavor)
        script = Path(__file__).with_name("_calibrate.py")
        # Oversubscribe: the ranks mostly wait on the link, so more ranks than cores is fine.
        cmd = self.mpirun_command(flavor, n,
                                  [sys.executable, str(script), str(nbytes), str(repeats)],
                                  oversubscribe=True, tag_output=False, env_forward=ring)
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
            "rate": self.rate, "nominal_bps": self.rate_bps, "n": n, "topology": self.topology,
            "nbytes": measured["nbytes"], "repeats": repeats, "times_s": measured["times"],
            "time_s": seconds, **link_model(n, measured["nbytes"], seconds, self.topology),
            "model_time_s": ring_seconds(measured["nbytes"], n, self.rate_bps / 8,
                                         self.topology),
            "algorithm": "ring" if ring else "implementation default",
            "mpi": flavor.describe(), "tolerance": tolerance,
        }
        result["ratio"] = result["link_bps"] / self.rate_bps
        if abs(result["ratio"] - 1) > tolerance:
            which = "each node's link" if self.topology == "star" else "the shared link"
            raise CalibrationError(
                f"calibration refused: {which} carried {format_rate(result['link_bps'])}, "
                f"{result['ratio']:.0%} of the nominal {format_rate(self.rate_bps)} "
                f"(allowed: within {tolerance:.0%}); results on this test bed would be wrong",
                result)
        return result


class LinkTestbed(NamespaceBed):
    """Context manager for the shaped-loopback namespace.

    Knobs: ``rate`` (tc rate, e.g. ``"100mbit"``), ``burst`` and ``latency`` (tbf bucket size
    and queue bound; the defaults keep measured rates within 2% of nominal up to 1gbit),
    ``mtu`` of the namespace's ``lo`` (9000 like a jumbo-frame LAN; smaller means more packets
    per byte and more CPU), ``mpirun`` (the launcher calibration uses; ``None``: see
    :func:`~.launchers.find_launcher`).

    ``name`` is unique per process and instance (``pacmpi-PID-K``) so concurrent test beds and
    leftovers from a crashed run never collide.
    """

    @property
    def namespaces(self):
        return (self.name,)

    def _setup_steps(self):
        inside = ["ip", "netns", "exec", self.name]
        return [
            (["ip", "netns", "add", self.name],
             "could not create the network namespace (is this a container without "
             "CAP_SYS_ADMIN?)"),
            (inside + ["ip", "link", "set", INTERFACE, "up"],
             "could not bring up lo in the namespace"),
            (inside + ["ip", "link", "set", INTERFACE, "mtu", str(self.mtu)],
             f"could not set lo's MTU to {self.mtu}"),
            (tbf_command(self.rate_bps, INTERFACE, self.burst, self.latency, self.name),
             "could not attach the tbf qdisc (kernel without sch_tbf, or a bad burst/latency "
             "value?)"),
        ]

    def wrap(self, cmd):
        """Return ``cmd`` prefixed so that it runs inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

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
        return self.calibrate_ranks(n, nbytes, repeats, tolerance=tolerance,
                                    seconds_per_call=seconds_per_call, timeout=timeout)


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
