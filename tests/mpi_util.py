"""Run worker scripts and scenario modules under mpirun, torchrun or horovodrun with a hard
timeout, so a hang fails fast.

A scenario module (``tests/mpi_scripts/*_scenarios.py``) is a plain module of ``test_*``
functions that every rank runs with pytest (``scenario_runner.py``); ``run_scenarios`` launches
it once per rank count and ``ScenarioRun.check`` reports each scenario on its own.
"""
import ast
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pacmpi.launch.mpi import remove_session_dirs

__all__ = ["MPI_SCRIPTS", "SUITE_ENV", "ScenarioRun", "mpirun_argv", "netns_skip_reason",
           "run_bounded", "run_horovod_gloo", "run_mpi", "run_scenarios", "scenario_cases",
           "scenario_names", "scenario_run"]

# Set for the whole test session (conftest.py). Open MPI's libfabric transport (btl ofi) spends
# about a second of every MPI_Init probing this host's fabric providers, and one host never uses
# it: shared memory and TCP carry every message, as they would with it.
SUITE_ENV = {"OMPI_MCA_btl": "^ofi"}
MPI_SCRIPTS = Path(__file__).parent / "mpi_scripts"
RUNNER = Path(__file__).parent / "scenario_runner.py"


def _local_tool(name):
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def mpirun_argv(n):
    argv = [_local_tool("mpirun"), "--oversubscribe", "-n", str(n)]
    if os.geteuid() == 0:
        argv.insert(1, "--allow-run-as-root")
    return argv


def horovodrun_argv(n):
    """``horovodrun --gloo`` on ``n`` local ranks."""
    return [_local_tool("horovodrun"), "--gloo", "-np", str(n), "-H", f"localhost:{n}"]


def torchrun_argv(n):
    """``torchrun`` on one node (a free rendezvous port), running a command, not a script."""
    return [_local_tool("torchrun"), "--standalone", "--nproc-per-node", str(n), "--no-python"]


LAUNCHERS = {"mpirun": mpirun_argv, "horovodrun": horovodrun_argv, "torchrun": torchrun_argv}
# torchrun sets this itself, with a warning on every launch; saying it silences the warning.
LAUNCHER_ENV = {"torchrun": {"OMP_NUM_THREADS": "1"}}


def _session_members(sid):
    """The live (not zombie) processes of session ``sid``."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            if stat and stat.rpartition(")")[2].split()[0] != "Z" and os.getsid(int(entry)) == sid:
                members.append(int(entry))
        except OSError:
            pass  # gone meanwhile
    return members


def _kill_session(sid):
    """SIGKILL every process of session ``sid``. Not just the launcher's process group: Open
    MPI's launcher gives each rank a group of its own, which would outlive it. What a killed
    launcher leaves in the temporary directory goes too, or a later launch that gets its pid
    fails to start."""
    killed = set()
    for _ in range(10):  # again, in case a process forked meanwhile
        members = _session_members(sid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.1)
    remove_session_dirs(killed - set(_session_members(sid)))


def _communicate(argv, timeout, env):
    """``(returncode, stdout, stderr)`` of ``argv`` run in a session of its own, so a timeout
    (returncode ``None``) or an interrupted test kills the launcher and every rank."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:
        _kill_session(proc.pid)
        stdout, stderr = proc.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return None, stdout, stderr
    return proc.returncode, stdout, stderr


def run_bounded(argv, *, timeout, env, what):
    """Run ``argv`` to its end within ``timeout`` seconds; returns the CompletedProcess."""
    returncode, stdout, stderr = _communicate(argv, timeout, env)
    if returncode is None:
        raise AssertionError(f"{what} did not finish within {timeout}s (hang?)\n"
                             f"stdout: {stdout}\nstderr: {stderr}")
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def _script_path(script):
    return MPI_SCRIPTS / script if not os.path.isabs(script) else Path(script)


def _environment(extra):
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def _run_script(launcher, script, n, args, timeout, env):
    argv = LAUNCHERS[launcher](n) + [sys.executable, str(_script_path(script)), *map(str, args)]
    return run_bounded(argv, timeout=timeout, env=_environment(env),
                       what=f"{script} under {launcher} on {n} ranks")


def run_mpi(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` on ``n`` ranks; returns the CompletedProcess."""
    return _run_script("mpirun", script, n, args, timeout, env)


def run_horovod_gloo(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` under ``horovodrun --gloo`` on ``n`` local ranks."""
    return _run_script("horovodrun", script, n, args, timeout, env)


# ------------------------------------------------------------------------ scenario modules
def scenario_names(module):
    """The ``test_*`` functions of ``tests/mpi_scripts/<module>`` in file order, read without
    importing it: listing them needs neither MPI nor torch."""
    tree = ast.parse(_script_path(module).read_text(encoding="utf-8"))
    return [node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def scenario_cases(module, launches):
    """``pytest.param(*key, test)`` for each test of each launch: ``launches`` maps a key (what
    the outer test needs to start the launch, such as ``(ranks,)``) to the tuple of tests it
    runs, or ``None`` for all; ids such as ``2ranks-exact``."""
    def label(value):
        return f"{value}ranks" if isinstance(value, int) else str(value)

    return [pytest.param(*key, test, id="-".join([*map(label, key), test.removeprefix("test_")]))
            for key, only in launches.items() for test in scenario_names(module)
            if only is None or test in only]


class ScenarioRun:
    """The per-rank outcomes of one launch of a scenario module."""

    def __init__(self, module, ranks, what, records, problem, output):
        self.module, self.ranks, self.what = module, ranks, what
        self.records = records  # {rank: [record, ...]} as scenario_runner.py wrote them
        self.problem = problem  # why the launch itself failed, or None
        self.output = output

    def _status(self, rank, test):
        """``("passed" | "skipped" | "failed" | "missing", text)`` of ``test`` on ``rank``."""
        phases = [r for r in self.records.get(rank, []) if r.get("test") == test]
        failed = [f"({r['event']}) {r['text']}" for r in phases if r["outcome"] == "failed"]
        if failed:
            return "failed", "\n".join(failed)
        skipped = [r["text"] for r in phases if r["outcome"] == "skipped"]
        if skipped:
            return "skipped", skipped[0]
        if any(r["event"] == "call" for r in phases):
            return "passed", ""
        return "missing", ""

    def _launch_report(self):
        collected = {rank: next((r["tests"] for r in records if r["event"] == "collected"),
                                None) for rank, records in self.records.items()}
        lines = [self.problem or "the launch ended without a report of it"]
        if len({json.dumps(tests) for tests in collected.values()}) > 1:
            lines.append(f"ranks collected different tests: {collected}")
        lines += [f"rank {rank} could not collect:\n{r['text']}"
                  for rank, records in sorted(self.records.items()) for r in records
                  if r["event"] == "collect"]
        lines.append(f"--- launcher output (last 10000 characters) ---\n{self.output[-10000:]}")
        return "\n".join(lines)

    def check(self, test):
        """Pass if every rank passed ``test`` (skip if every rank skipped it) and the launch
        ended well; fail otherwise, naming the scenario, the ranks and their tracebacks, and
        for a launch that failed, how it ended and its output."""
        status = {rank: self._status(rank, test) for rank in range(self.ranks)}
        by = {kind: sorted(r for r, (k, _) in status.items() if k == kind)
              for kind in ("passed", "skipped", "failed", "missing")}
        if len(by["passed"]) == self.ranks and self.problem is None:
            return
        if len(by["skipped"]) == self.ranks and self.problem is None:
            pytest.skip(status[0][1])
        header = (f"scenario {self.module}::{test} on {self.ranks} ranks ({self.what}): "
                  f"passed on ranks {by['passed']}, failed on {by['failed']}, skipped on "
                  f"{by['skipped']}, not reported by {by['missing']}")
        details = [f"--- rank {rank} ---\n{status[rank][1]}" for rank in by["failed"]]
        if by["missing"] or self.problem:
            details.append(self._launch_report())
        pytest.fail("\n".join([header, *details]), pytrace=False)


def scenario_run(module, ranks, wrap, *, only=None, timeout, env=None, what):
    """Launch ``tests/mpi_scripts/<module>``'s scenarios (all, or those named in ``only``) on
    ``ranks`` ranks: ``wrap(command)`` returns the argv that starts ``command`` on every rank.
    A launch that crashes or times out keeps the outcomes reported before it."""
    names = [name for name in scenario_names(module) if only is None or name in only]
    path = _script_path(module)
    with tempfile.TemporaryDirectory(prefix="pacmpi-scenarios-") as report_dir:
        command = [sys.executable, str(RUNNER), report_dir, *(f"{path}::{n}" for n in names)]
        returncode, stdout, stderr = _communicate(wrap(command), timeout, _environment(env))
        records = {}
        for file in Path(report_dir).glob("rank*.jsonl"):
            lines = file.read_text(encoding="utf-8").splitlines()
            records[int(file.stem.removeprefix("rank"))] = [json.loads(line) for line in lines]
    problem = (f"the launch did not finish within {timeout}s (hang?)" if returncode is None
               else f"the launch exited with status {returncode}" if returncode not in (0, 1)
               else None)  # 1: pytest's "some tests failed", reported per test
    return ScenarioRun(module, ranks, what, records, problem,
                       f"stdout:\n{stdout}\nstderr:\n{stderr}")


@functools.cache
def run_scenarios(module, ranks, launcher="mpirun", only=None, timeout=240, env=()):
    """``scenario_run`` under ``launcher`` (``mpirun``, ``torchrun`` or ``horovodrun``), once
    per distinct call in a session: one launch serves all the scenarios it runs. ``only`` is a
    tuple of test names, ``env`` a tuple of ``(name, value)`` pairs (both hashable)."""
    return scenario_run(module, ranks, lambda command: LAUNCHERS[launcher](ranks) + command,
                        only=only, timeout=timeout,
                        env={**LAUNCHER_ENV.get(launcher, {}), **dict(env)},
                        what=f"{launcher} -n {ranks}")


def netns_skip_reason():
    """Why the network-namespace test bed cannot run here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "the test bed needs root"
    probe = f"pacmpi-probe-{os.getpid()}"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                              timeout=30)
    except FileNotFoundError:
        return "iproute2's ip is not installed"
    if done.returncode != 0:
        return f"`ip netns add` failed here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None
