"""Run a command on n ranks (``mpirun``, ``horovodrun`` or ``torchrun``), optionally on the
shaped test bed: one shared link (``link``) or K simulated nodes (``nodes``, ``mpirun`` only).

:func:`run_command` is the programmatic entry point behind ``pacmpi-run``. It streams the
launcher's output through (optionally capturing it), bounds the run by a timeout, ends the
launcher on Ctrl-C/SIGTERM, and when the launcher fails names the failed rank in one line
(see :mod:`.failure`; torchrun's own report by :func:`parse_torchrun_failure`).
"""
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ._signals import signals_held, unwind_on_signals
from .failure import RankFailure, describe_failure, parse_rank_failure
from .launchers import LauncherNotFoundError, find_launcher, python_env_bin
from .mpi import (
    OPENMPI,
    PMIX_LISTENER_FAILED,
    MPIDetectionError,
    allreduce_pin,
    build_horovodrun_command,
    build_mpirun_command,
    build_torchrun_command,
    detect_mpi,
    remove_session_dirs,
    session_dir,
)
from .nodes import NodeTestbed, describe_daemon_failure, parse_daemon_failure
from .testbed import INTERFACE, LinkTestbed, format_rate

__all__ = ["RunResult", "run_command"]

TIMEOUT_EXIT = 124  # what coreutils' timeout(1) returns; scripts already know it
_TAIL_LINES = 400  # enough of the launcher's output to find its failure report
_KILLED_S = 5.0  # for a SIGKILLed process to end: it only has to be scheduled once
_OUTPUT_DRAIN_S = 5.0  # once everything the launcher started is gone, its pipes are at EOF


@dataclass
class RunResult:
    """Outcome of :func:`run_command`.

    ``returncode``: the launcher's exit status (``TIMEOUT_EXIT`` after a timeout, 0 for a dry
    run); ``command``: what was (or, for a dry run, would be) executed; ``stdout``/``stderr``:
    the full output when ``capture=True``, else ``None``; ``failure``: the parsed
    :class:`~.failure.RankFailure` (or ``None``); ``failure_message``: the line printed about
    it; ``calibration``: the test bed's calibration dict; ``timed_out``: the timeout fired;
    ``setup_commands``: the test bed's set-up commands (shown by a dry run); ``notes``: what
    ``run_command`` decided on the user's behalf (also shown by a dry run); ``nodes``: on the
    node test bed, one ``{"host", "namespace", "address"}`` dict per node.
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
    notes: list = field(default_factory=list)
    nodes: list = None


def _pump(stream, sink, keep, echo):
    """Copy a child's output line by line to ``sink`` (when ``echo``) and into ``keep``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        keep.append(line)
        if echo:
            sink.write(line)
            sink.flush()
    stream.close()


def _session(sid):
    """Pids of the live processes (not zombies) in session ``sid``, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
                fields = stat.read().rpartition(b")")[2].split()
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            pids.append(int(entry))
    return pids


def _exited(proc):
    """Whether the launcher has ended, leaving it unreaped (its pid stays taken)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile
        return True


def _end(proc, grace):
    """Ask the launcher to stop (it then ends its ranks); after ``grace`` s kill all it started.

    The launcher runs in a session of its own, and the SIGKILL goes to every process in it, not
    only to its process group: Open MPI puts each rank in a process group of its own, so
    ``killpg`` would leave the ranks running. The session id is the launcher's pid, which the
    kernel does not hand out again while the launcher is unreaped or any process of the
    session is left, so no stranger is hit: the launcher is reaped last. Returns once they
    have ended (a few seconds at most after ``grace``, even on a loaded machine).
    """
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not _exited(proc):
        time.sleep(0.05)
    left, killed = _session(proc.pid), set()
    deadline = time.monotonic() + _KILLED_S
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
        left = _session(proc.pid)
    proc.wait(timeout=_KILLED_S)  # SIGKILL cannot be refused: this only reaps the launcher
    remove_session_dirs(killed)


def _execute(cmd, *, env, timeout, capture, echo, grace):
    """Run ``cmd``; return (returncode, stdout lines, stderr lines, timed_out, pid)."""
    keep = (lambda: []) if capture else (lambda: collections.deque(maxlen=_TAIL_LINES))
    out, err = keep(), keep()
    proc, pumps, timed_out = None, [], False
    try:
        with unwind_on_signals():
            with signals_held():  # a signal acts once there is a launcher to end
                # Own session: the launcher survives nothing we do not tell it, and _end()
                # reaches everything it started locally. stdin is not forwarded (training
                # jobs do not read it).
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
                pumps = [threading.Thread(target=_pump, args=(stream, sink, keep, echo),
                                          daemon=True)
                         for stream, sink, keep in ((proc.stdout, sys.stdout, out),
                                                    (proc.stderr, sys.stderr, err))]
                for pump in pumps:
                    pump.start()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        with signals_held():  # a second Ctrl-C acts once the ranks are ended
            if proc is not None and proc.poll() is None:
                _end(proc, grace)
            drained = time.monotonic() + _OUTPUT_DRAIN_S
            for pump in pumps:
                pump.join(timeout=max(0.0, drained - time.monotonic()))
    return ((TIMEOUT_EXIT if timed_out else proc.returncode), list(out), list(err), timed_out,
            proc.pid)


# torchrun's ChildFailedError summary: the "Root Cause (first observed failure)" entry reads
#   host : NODE   rank : R (local_rank: L)   exitcode : C (pid: P)   [(SIGNAME)]
# with C = -S when the rank died of signal S.
_TORCHRUN_ROOT = re.compile(
    r"Root Cause \(first observed failure\):.*?host\s*:\s*(\S+)\s+rank\s*:\s*(\d+)"
    r".*?exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_TORCHRUN_AGENT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# Open MPI's --tag-output prefix, which each line of a torchrun started by mpirun (the node
# test bed: a torchrun per node) carries.
_MPI_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>: ?", re.MULTILINE)


def parse_torchrun_failure(text):
    """The :class:`~.failure.RankFailure` that torchrun's failure summary names as the root
    cause (global rank, signal or exit code, pid, host), else the agent's log line
    ``failed (exitcode: C) local_rank: L (pid: P)`` (a local rank: the same on one node),
    else ``None``."""
    flat = " ".join(_MPI_TAG.sub("", text).split())
    match = _TORCHRUN_ROOT.search(flat)
    if match:
        node, rank, code, pid = match.groups()
        rank, code, pid = int(rank), int(code), int(pid)
    else:
        match = _TORCHRUN_AGENT.search(flat)
        if not match:
            return None
        node, (code, rank, pid) = None, map(int, match.groups())
    if code < 0:
        return RankFailure(rank=rank, signal=-code, pid=pid, node=node)
    return RankFailure(rank=rank, exit_code=code, pid=pid, node=node)


def _testbed(link, nodes, topology, mpirun, horovod, hostfile):
    """The test bed ``run_command`` was asked for (``None``: the host's network), or ValueError."""
    if nodes is None:
        if topology is not None:
            raise ValueError("--topology applies to --nodes K (one link per node)")
        return None if link in (None, "none") else LinkTestbed(link, mpirun=mpirun)
    if link in (None, "none"):
        raise ValueError("--nodes needs --link RATE: the rate of every node's link")
    if horovod:
        raise ValueError("--nodes starts one Open MPI daemon per node with mpirun; "
                         "not with --horovod (--torchrun runs one torchrun per node)")
    if hostfile:
        raise ValueError("--nodes writes its own host file; leave out --hostfile")
    return NodeTestbed(nodes, link, topology=topology or "star", mpirun=mpirun)


def _mpi_flavor(mpirun, required):
    """The MPI behind ``mpirun``; ``None`` when not ``required`` (a torchrun or horovodrun job,
    whose own all-reduce is Gloo's) and there is none."""
    try:
        return detect_mpi(mpirun)
    except (LauncherNotFoundError, MPIDetectionError):
        if required:
            raise
        return None


def describe_calibration(calibration, nodes=False):
    """One line about a calibration dict; ``nodes``: it came from the node test bed."""
    who = f"{calibration['n']} nodes x 1 rank" if nodes else f"{calibration['n']} ranks"
    link = "per-node link" if calibration["topology"] == "star" else "link"
    return (f"calibration: {who}, {calibration['nbytes']} B {calibration['algorithm']} "
            f"all-reduce in {calibration['time_s']:.3f} s "
            f"(model {calibration['model_time_s']:.3f} s): "
            f"{link} {format_rate(calibration['link_bps'])} = {calibration['ratio']:.1%} "
            f"of nominal {format_rate(calibration['nominal_bps'])}, "
            f"bus bw {format_rate(calibration['busbw_bps'])}")


def _say(message):
    sys.stderr.write(f"pacmpi-run: {message}\n")
    sys.stderr.flush()


def run_command(argv, n, *, link=None, nodes=None, topology=None, horovod=False, torchrun=False,
                oversubscribe=False, hostfile=None,
                env=(), calibrate=True, tolerance=0.15, timeout=None, capture=False, echo=True,
                dry_run=False, mpirun=None, tag_output=True, extra_mca=None, grace=10.0,
                allreduce="auto"):
    """Run ``argv`` on ``n`` ranks and return a :class:`RunResult`.

    Knobs:
      ``link``           tc rate like ``"100mbit"`` to run on the shaped test bed (needs
                         root); ``None``/``"none"`` runs on the host's network as usual.
                         Every rank then runs on this host, so Open MPI oversubscription
                         is switched on (more ranks than cores is the point of the test bed).
      ``horovod``        launch with ``horovodrun --gloo`` instead of ``mpirun``.
      ``torchrun``       launch with ``torchrun --standalone --nproc-per-node n --no-python``
                         (one node; see :func:`~.mpi.build_torchrun_command`), found as
                         ``find_launcher("torchrun")`` (``$PACMPI_TORCHRUN``, ...). On the
                         test bed torchrun and its ranks run in the namespace with gloo pinned
                         to its shaped ``lo``; calibration still uses ``mpirun``. With
                         ``nodes``, Open MPI's ``mpirun`` starts one torchrun per node
                         (:meth:`~.nodes.NodeTestbed.torchrun_command`: a K-node job with
                         gloo on the node links). ``oversubscribe`` does not apply, nor
                         ``tag_output`` off the node test bed; no ``hostfile``.
      ``nodes``          K: run on K simulated nodes (:class:`~.nodes.NodeTestbed`), each its
                         own namespace and Open MPI daemon, with a ``link``-rate link to a
                         switch; ``n`` must be a multiple of K (rank r on node r // (n/K)).
                         Open MPI's ``mpirun`` (or ``torchrun`` started by it); no
                         ``hostfile`` (one is generated).
      ``topology``       with ``nodes``: ``"star"`` (default; a private link per node) or
                         ``"shared"`` (one queue for all traffic).
      ``mpirun``         the MPI launcher, a path or a bare name; ``None``: ``$PACMPI_MPIRUN``,
                         then the running Python's ``bin``, then ``PATH``
                         (:func:`~.launchers.find_launcher`; ``horovodrun`` is found the same
                         way, with ``$PACMPI_HOROVODRUN``).
      ``oversubscribe``, ``hostfile``, ``tag_output``, ``extra_mca``: see
                         :func:`~.mpi.build_mpirun_command`.
      ``env``            entries ``NAME`` (forward) or ``NAME=VALUE`` (set) for every rank.
                         Local ranks also get the running venv/conda env's ``bin`` first on
                         ``PATH``, as if it were activated.
      ``allreduce``      the job's MPI all-reduce algorithm: ``"auto"`` (the ring the test
                         bed's calibration measured, as environment variables for every rank
                         under every launcher, unless ``env``, ``extra_mca`` or the
                         environment already choose one; nothing off the test bed), ``"ring"``
                         (also off the test bed) or ``"default"`` (the library's own choice);
                         see :func:`~.mpi.allreduce_pin`. A note says what was done.
      ``calibrate``      on the test bed, measure the link first (with ``max(n, 2)`` ranks;
                         with ``nodes``, one rank per node) and refuse to run
                         (``CalibrationError``) when it is more than ``tolerance`` off nominal.
      ``timeout``        seconds before the launcher is ended; the result then has
                         ``returncode == TIMEOUT_EXIT`` and ``timed_out``.
      ``capture``        keep the full output in the result; ``echo`` also prints it live.
      ``dry_run``        build the command (and test-bed set-up) without running anything.
      ``grace``          seconds the launcher gets to end its ranks before SIGKILL.

    Raises ``TestbedError``/``CalibrationError`` (test bed), ``LauncherNotFoundError`` (no
    launcher), ``MPIDetectionError`` (an ``mpirun`` of unknown kind) and ``ValueError`` (bad
    arguments). Ctrl-C and SIGTERM end the launcher, remove the test bed and then propagate
    (``KeyboardInterrupt`` / ``SystemExit(143)``).
    """
    argv = list(argv)
    if horovod and torchrun:
        raise ValueError("choose one launcher: horovod or torchrun")
    if torchrun and hostfile:
        raise ValueError("--hostfile is for mpirun; torchrun runs on one node here (multi-node: "
                         "start torchrun on every node with --rdzv-endpoint HOST:PORT)")
    other_launcher = horovod or torchrun
    testbed = _testbed(link, nodes, topology, mpirun, horovod, hostfile)
    on_nodes = isinstance(testbed, NodeTestbed)
    flavor = (_mpi_flavor(mpirun, required=not other_launcher or on_nodes)
              if not other_launcher or testbed or allreduce == "ring" else None)
    pin, why = allreduce_pin(flavor, allreduce, testbed=testbed is not None, env_entries=env,
                             extra_mca=extra_mca)
    env = [*env, *pin]
    child_env = dict(os.environ)
    env_bin = python_env_bin()
    if env_bin is not None:
        # As if the env were activated: `-- python ...` or `-- pacmpi train` then start this
        # env's programs on local ranks, not whatever comes first on the user's PATH.
        child_env["PATH"] = os.pathsep.join([str(env_bin), child_env.get("PATH", "")])
    for entry in env:
        name, sep, value = entry.partition("=")
        if sep:
            child_env[name] = value
    notes = []
    if torchrun and on_nodes:
        cmd = testbed.torchrun_command(flavor, n, argv, torchrun=find_launcher("torchrun"),
                                       env_forward=env, tag_output=tag_output,
                                       extra_mca=extra_mca)
        notes += testbed.notes(n, torchrun=True)
    elif torchrun:
        cmd = build_torchrun_command(n, argv, torchrun=find_launcher("torchrun"),
                                     env_forward=env,
                                     socket_ifname=INTERFACE if testbed else None)
    elif horovod:
        cmd = build_horovodrun_command(n, argv, network_interface=INTERFACE if testbed else None,
                                       horovodrun=find_launcher("horovodrun"))
    else:
        if isinstance(testbed, LinkTestbed) and not oversubscribe and flavor.kind == OPENMPI:
            # The namespace holds one host, so every rank lands on it whatever the core count;
            # Open MPI would refuse N > cores ("not enough slots").
            oversubscribe = True
            notes.append(f"--link runs all {n} ranks on this host: --oversubscribe added")
        options = dict(oversubscribe=oversubscribe, env_forward=env, tag_output=tag_output,
                       hostfile=hostfile, extra_mca=extra_mca)
        cmd = (testbed.mpirun_command(flavor, n, argv, **options) if testbed else
               build_mpirun_command(flavor, n, argv, **options))
        if on_nodes:
            notes += testbed.notes(n)
    if testbed and other_launcher and not on_nodes:
        cmd = testbed.wrap(cmd)
    notes += [why] if why else []
    setup = testbed.setup_commands() if testbed else []
    node_table = ([{"host": host, "namespace": namespace, "address": address}
                   for host, namespace, address in zip(testbed.hosts, testbed.node_namespaces,
                                                       testbed.addresses)]
                  if on_nodes else None)
    if dry_run:
        return RunResult(0, cmd, setup_commands=setup, notes=notes, nodes=node_table)

    calibration = None
    launcher = "torchrun" if torchrun else "horovodrun" if horovod else "mpirun"
    if testbed:
        with testbed:
            if calibrate:
                calibration = (testbed.calibrate(tolerance=tolerance) if node_table else
                               testbed.calibrate(max(n, 2), tolerance=tolerance))
                if echo:
                    _say(describe_calibration(calibration, nodes=bool(node_table)))
            rc, out, err, timed_out, pid = _execute(cmd, env=child_env, timeout=timeout,
                                                    capture=capture, echo=echo, grace=grace)
    else:
        rc, out, err, timed_out, pid = _execute(cmd, env=child_env, timeout=timeout,
                                                capture=capture, echo=echo, grace=grace)

    result = RunResult(rc, cmd, calibration=calibration, timed_out=timed_out, setup_commands=setup,
                       notes=notes, nodes=node_table)
    if capture:
        result.stdout, result.stderr = "".join(out), "".join(err)
    if timed_out:
        result.failure_message = f"pacmpi-run: {launcher} ended after the {timeout} s timeout"
    elif rc != 0:
        text = "".join(err) + "".join(out)
        result.failure = parse_torchrun_failure(text) if torchrun else parse_rank_failure(text)
        host = parse_daemon_failure(text) if node_table and result.failure is None else None
        result.failure_message = (describe_daemon_failure(host, rc, launcher) if host else
                                  describe_failure(result.failure, rc, launcher))
        if result.failure is None and host is None and PMIX_LISTENER_FAILED in text:
            # A launcher SIGKILLed earlier with this pid left its session directory; ours has
            # ended, so the directory is nobody's now, and the next run can start.
            remove_session_dirs([pid])
            result.failure_message = (
                f"pacmpi-run: {launcher} could not start its PMIx server (status {rc}): a "
                f"launcher killed earlier with the same pid ({pid}) had left its session "
                f"directory {session_dir(pid)}; it is removed: run the command again")
    if result.failure_message and echo:
        sys.stderr.write(result.failure_message + "\n")
        sys.stderr.flush()
    return result

