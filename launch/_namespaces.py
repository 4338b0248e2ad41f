"""The lifetime of the test beds' network namespaces: names that carry their owner's pid, ending
what runs in them, removing them in one command, and removing those whose owner died.

A run killed by SIGKILL (or a machine reset of its parent) cannot clean up: its namespaces, the
veth and ifb devices inside them, the ranks still running there and its work directory stay.
Every name carries the pid of the process that made it (``pacmpi-PID-K``, the node bed adds
``-sw``/``-nI``), so :func:`remove_stale` (run by every test bed on entry and by the test
session) tells a crashed run's leftovers from a live concurrent run, whose owner is alive and
which it never touches. A recycled pid makes a leftover look alive: it is kept, never a live
run removed. Names of any other form (another tool's, a probe's) are not ours to remove.
"""
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .mpi import remove_session_dirs

__all__ = ["new_name", "owner", "workdir", "pids_in", "end_processes", "delete", "remove_stale"]

NETNS_DIR = Path("/var/run/netns")  # where `ip netns add NAME` puts the name (iproute2)
_BED = re.compile(r"pacmpi-(\d+)-\d+")  # group 1: the owner's pid
_NAMESPACE = re.compile(rf"(?:{_BED.pattern})(?:-sw|-n\d+)?")
_serial = itertools.count()


def new_name():
    """A fresh test-bed name, ``pacmpi-PID-K``: unique per process and call, owned by this pid."""
    return f"pacmpi-{os.getpid()}-{next(_serial)}"


def owner(name):
    """The pid of the process that made the test-bed namespace or work directory ``name``, or
    ``None`` when ``name`` is not one."""
    match = _NAMESPACE.fullmatch(name)
    return int(match.group(1)) if match else None


def workdir(name):
    """Where the test bed ``name`` keeps its files (removed with it, or after its owner died)."""
    return Path(tempfile.gettempdir()) / name


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _stat_key(path):
    try:
        info = os.stat(path)
    except OSError:  # gone, or a zombie: its namespaces are already released
        return None
    return info.st_dev, info.st_ino


def pids_in(namespaces):
    """Pids of the processes in any of ``namespaces``, by the test `ip netns pids` makes for one
    (same namespace file) in one pass over /proc: no process started, cheap under load."""
    wanted = {_stat_key(NETNS_DIR / name) for name in namespaces} - {None}
    if not wanted:
        return []
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and _stat_key(f"/proc/{entry}/ns/net") in wanted]


def end_processes(namespaces, grace=3.0):
    """SIGTERM everything in ``namespaces``, SIGKILL what is still there after ``grace`` s.

    ``ip netns del`` only removes a name: a namespace, and the devices in it, live on while
    anything runs in it. Returns the pids still there after the SIGKILL's ``grace`` (none
    unless a process is stuck in the kernel)."""
    pids, killed = [], []
    for signum in (signal.SIGTERM, signal.SIGKILL):
        pids = pids_in(namespaces)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        killed += pids if signum == signal.SIGKILL else []
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = pids_in(namespaces)
        if not pids:
            break
    remove_session_dirs(set(killed) - set(pids))
    return pids


def delete(namespaces):
    """Remove the ``namespaces`` that exist, all with one ``ip -batch`` process."""
    present = [name for name in namespaces if (NETNS_DIR / name).exists()]
    if present:
        subprocess.run(["ip", "-force", "-batch", "-"], capture_output=True, text=True, timeout=30,
                       input="".join(f"netns del {name}\n" for name in present))


def _dead_owner(name):
    pid = owner(name)
    return pid is not None and not _alive(pid)


def remove_stale():
    """Remove what runs whose owner died left behind: their namespaces (after ending what still
    runs in them) and work directories. Returns the namespace names removed."""
    try:
        stale = sorted(name for name in os.listdir(NETNS_DIR) if _dead_owner(name))
    except FileNotFoundError:  # no namespace was ever named here
        stale = []
    if stale:
        end_processes(stale)
        delete(stale)
    for path in Path(tempfile.gettempdir()).glob("pacmpi-*"):
        if path.is_dir() and _BED.fullmatch(path.name) and _dead_owner(path.name):
            shutil.rmtree(path, ignore_errors=True)
    return stale
