"""What the shaped test beds could leave on this host, counted before and after the whole session.

The session hooks (imported by conftest.py) first remove what crashed earlier runs left
(namespaces whose owner pid is dead, see ``pacmpi.launch._namespaces``), then count the test
beds' network namespaces, all network namespaces on the host (named, or only held by a process:
a name removed while ranks still ran in it) and the veth and ifb devices in every one of them.
After the last test they count again; anything more fails the run (exit status 1) and names what
was left. Under pytest-xdist the controller counts, before its workers start and after they have
all ended, so one worker's beds are never another's leak. Where namespaces cannot be made (not
root, no iproute2) there is nothing to count and the check does nothing.

Left out: test beds of concurrent runs (their owner is alive and not this session's process
or one of its descendants), which come and go on their own; and the ifb devices of the host's
own namespace, where loading the ifb module (which the first ``--topology shared`` bed does)
creates ``ifb0``/``ifb1`` (the beds make theirs inside their switch namespace).
"""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from pacmpi.launch._namespaces import NETNS_DIR, owner, remove_stale

from mpi_util import netns_skip_reason

__all__ = ["bed_names", "snapshot", "leaks", "pytest_sessionstart", "pytest_sessionfinish"]

PREFIX = "pacmpi-"
KINDS = ("veth", "ifb")
_SETTLE_S = 5.0  # the last test's processes may still be exiting when the session ends


def _key(path):
    try:
        info = os.stat(path)
    except OSError:  # gone meanwhile
        return None
    return info.st_dev, info.st_ino


def _this_session():
    """This process and its descendants."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        children.setdefault(int(stat.rpartition(b")")[2].split()[1]), []).append(int(entry))
    found, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _concurrent(name, session):
    pid = owner(name)
    return pid is not None and pid not in session and Path(f"/proc/{pid}").exists()


def bed_names():
    """The network namespaces on this host less the test beds of concurrent runs (another pytest
    worker's, say): what a test may compare before and after its own beds come and go."""
    session = _this_session()
    return {path.name for path in NETNS_DIR.glob("*") if not _concurrent(path.name, session)}


def _devices(path, host):
    cmd = ["ip", "-j", "-d", "link", "show"]
    done = subprocess.run(cmd if host else ["nsenter", f"--net={path}", *cmd],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return []  # the namespace went away meanwhile
    return [(link.get("linkinfo") or {}).get("info_kind") for link in json.loads(done.stdout)]


def snapshot():
    """The test beds' namespaces by name, and counts of network namespaces and devices."""
    session = _this_session()
    named = sorted(path.name for path in NETNS_DIR.glob("*"))
    concurrent = [name for name in named if _concurrent(name, session)]
    paths = ["/proc/self/ns/net", *(NETNS_DIR / name for name in named)]
    paths += [f"/proc/{entry}/ns/net" for entry in os.listdir("/proc") if entry.isdigit()]
    namespaces = {}  # (dev, inode) -> a path to enter it; the host's own first
    for path in paths:
        namespaces.setdefault(_key(path), path)
    for key in {None, *(_key(NETNS_DIR / name) for name in concurrent)}:
        namespaces.pop(key, None)
    counts = dict.fromkeys(KINDS, 0)
    for index, path in enumerate(namespaces.values()):
        for kind in _devices(path, host=index == 0):
            if kind in counts and not (kind == "ifb" and index == 0):
                counts[kind] += 1
    return {"test-bed namespaces": [name for name in named if name.startswith(PREFIX)
                                    and name not in concurrent],
            "network namespaces": len(namespaces), **counts}


def leaks(before, after):
    """What ``after`` holds beyond ``before``, in words (empty: nothing was left)."""
    found = [f"network namespace {name} left behind"
             for name in after["test-bed namespaces"] if name not in before["test-bed namespaces"]]
    found += [f"{after[key] - before[key]} more {key} ({before[key]} -> {after[key]})"
              for key in ("network namespaces", *KINDS) if after[key] > before[key]]
    return found


_BEFORE = pytest.StashKey[dict]()


def _checks(config):
    """Whether this process checks: a plain run, or xdist's controller (not its workers)."""
    return not hasattr(config, "workerinput") and netns_skip_reason() is None


def pytest_sessionstart(session):
    """Remove what crashed runs left, then count what is there before the first test."""
    if _checks(session.config):
        remove_stale()
        session.config.stash[_BEFORE] = snapshot()


@pytest.hookimpl(trylast=True)  # after xdist has ended its workers
def pytest_sessionfinish(session):
    """Fail the session if it left anything itself, naming what."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    deadline = time.monotonic() + _SETTLE_S
    while leaks(before, snapshot()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leaks(before, snapshot())
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line("")
        reporter.write_line(f"the test session left test-bed resources behind: {'; '.join(left)};"
                            f" before: {before}; after: {snapshot()}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
