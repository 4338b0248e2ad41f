"""What the shaped test beds could leave on this host, counted before and after the whole session.

The session fixture :func:`testbed_leak_check` (autouse, imported by conftest.py) first removes
what crashed earlier runs left (namespaces whose owner pid is dead, see
``pacmpi.launch._namespaces``), then counts the test beds' network namespaces, all network
namespaces on the host (named, or only held by a process: a name removed while ranks still ran
in it) and the veth and ifb devices in every one of them. After the last test it counts again;
anything more is an error at the last test's teardown, which fails the run and names what was
left. Where namespaces cannot be made (not root, no iproute2) there is nothing to count and the
check does nothing.

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

__all__ = ["snapshot", "leaks", "testbed_leak_check"]

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


@pytest.fixture(scope="session", autouse=True)
def testbed_leak_check():
    """Remove what crashed runs left, then fail the session if it leaves anything itself."""
    if netns_skip_reason() is not None:
        yield
        return
    remove_stale()
    before = snapshot()
    yield
    deadline = time.monotonic() + _SETTLE_S
    while leaks(before, snapshot()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leaks(before, snapshot())
    assert not left, (f"the test session left test-bed resources behind: {'; '.join(left)}; "
                      f"before: {before}; after: {snapshot()}")

