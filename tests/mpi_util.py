"""Run worker scripts and scenario modules under mpirun, torchrun or horovodrun with a hard
timeout, so a hang fails fast.

A scenario module (``tests/mpi_scripts/*_scenarios.py``) is a plain module of ``test_*``
functions that every rank runs with pytest (``scenario_runner.py``); ``run_scenarios`` launches
it once per rank count (with the other modules of ``SHARED_LAUNCHES``, in one launch) and
``ScenarioRun.check`` reports each scenario on its own.
"""
import ast
import atexit
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

__all__ = ["MPI_SCRIPTS", "SHARED_LAUNCHES", "SHARED_TIMEOUT", "SUITE_ENV", "ScenarioRun",
           "mpirun_argv", "netns_skip_reason", "run_bounded", "run_horovod_gloo", "run_mpi",
           "run_scenarios", "scenario_cases", "scenario_names", "scenario_run",
           "shared_launches", "shared_workdir"]

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
# Scenario modules that share one launch per rank count: every rank of a launch spends about
# 6 s of CPU on its imports (torch; torch._dynamo, which the first optimizer imports; Numba)
# before its first scenario, and the suite's ranks share 2 cores, so one launch for several
# modules instead of one each saves about a minute at 4 ranks. A module belongs to a group when
# it needs no environment of its own and leaves the process fit for the next: the torchrun
# modules join one default process group (mpi_scripts/torch_world.py), Horovod's modules one
# hvd.init() (a second call does nothing), whose background thread the mpi4py modules are
# spared. Each module maps a rank count to the scenarios it runs there (None: all); its test
# file takes them from here (``shared_launches``). The modules of a launch share one scratch
# folder, $PACMPI_TEST_WORKDIR, for the session (the training jobs' pretrained models).
SHARED_LAUNCHES = (
    ("mpirun", {**{module: {2: None, 4: None} for module in (
        "baselines_scenarios.py", "core_scenarios.py", "device_scenarios.py",
        "outer_scenarios.py", "pruning_scenarios.py", "recipe_scenarios.py",
        "sharded_scenarios.py", "sync_scenarios.py")}, **{module: {2: None} for module in (
            "outer_train_scenarios.py", "train_baselines_scenarios.py",
            "train_e2e_scenarios.py")},
        # two nodes of half the ranks each (its other splits need an environment of their own)
        "hierarchical_scenarios.py": {
            2: ("test_exact", "test_ternary", "test_mismatch", "test_bad_node_comm"),
            4: ("test_exact", "test_ternary", "test_ternary_scales_per_tensor", "test_state",
                "test_mismatch", "test_resync", "test_bad_node_comm")},
        "bench_masks_scenarios.py": {2: None, 4: None},
        "bench_allreduce_scenarios.py": {2: None, 4: None},
        "readme_scenarios.py": {2: None},
        # the checkpoint it saves at 4 ranks, in the shared folder, is resumed at 2 ranks by a
        # launch of its own, after this one (tests/test_torch_sync.py)
        "sync_checkpoint_scenarios.py": {4: ("test_save_at_4_ranks",)}}),
    ("mpirun", {
        "hvd_compressor.py": {2: None, 4: ("test_ternary", "test_reducer", "test_bf16",
                                           "test_mismatch")},
        "hvd_sharded_scenarios.py": {2: None, 4: None},
        "readme_hvd_scenarios.py": {2: None},
    }),
    ("torchrun", {
        "amp_scenarios.py": {2: None, 4: None},
        "bf16_scenarios.py": {2: None, 4: None},
        "ddp_scenarios.py": {2: None, 4: ("test_match", "test_ternary", "test_unbiased",
                                          "test_checkpoint", "test_errors", "test_mismatch")},
        "ddp_train_scenarios.py": {2: None},
        "sharded_ddp_scenarios.py": {2: None, 4: None},
        "readme_ddp_scenarios.py": {2: None},
        "huggingface_scenarios.py": {2: None},  # last: Accelerate joins the group as it is
    }),
)
# A shared launch's bound (a hang fails within it), below the suite's 300 s per test: a test
# that pytest-timeout stopped would leave the launch uncached, and every later scenario of it
# would start it again.
SHARED_TIMEOUT = 270


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


def _shared_group(module, launcher):
    """The modules launched with ``module`` under ``launcher`` (itself included), or {}."""
    return next((group for name, group in SHARED_LAUNCHES
                 if name == launcher and module in group), {})


@functools.cache
def shared_workdir():
    """$PACMPI_TEST_WORKDIR of the shared launches: one folder for the session."""
    path = tempfile.mkdtemp(prefix="pacmpi-shared-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def shared_launches(module, launcher="mpirun"):
    """``{(ranks,): tests or None}`` of ``module``'s shared launches, for ``scenario_cases``."""
    return {(ranks,): only for ranks, only in _shared_group(module, launcher)[module].items()}


class ScenarioRun:
    """The per-rank outcomes of one launch of one or more scenario modules, read for one of
    them (``part``)."""

    def __init__(self, modules, ranks, what, records, problem, output):
        self.modules, self.ranks, self.what = tuple(modules), ranks, what
        self.module = self.modules[0]
        self.records = records  # {rank: [record, ...]} as scenario_runner.py wrote them
        self.problem = problem  # why the launch itself failed, or None
        self.output = output

    def part(self, module):
        """The same outcomes, read for ``module``'s scenarios."""
        if module not in self.modules:
            raise ValueError(f"{module} was not run by this launch ({', '.join(self.modules)})")
        part = ScenarioRun(self.modules, self.ranks, self.what, self.records, self.problem,
                           self.output)
        part.module = module
        return part

    def _status(self, rank, test):
        """``("passed" | "skipped" | "failed" | "missing", text)`` of ``test`` on ``rank``."""
        phases = [r for r in self.records.get(rank, [])
                  if r.get("module") == self.module and r.get("test") == test]
        failed = [f"({r['event']}) {r['text']}" for r in phases if r["outcome"] == "failed"]
        if failed:
            return "failed", "\n".join(failed)
        skipped = [r["text"] for r in phases if r["outcome"] == "skipped"]
        if skipped:
            return "skipped", skipped[0]
        if any(r["event"] == "call" for r in phases):
            return "passed", ""
        return "missing", ""

    def _went_on(self, rank):
        """Whether ``rank`` reported a scenario of a later module: what ended the launch badly
        came after this module's scenarios."""
        later = self.modules[self.modules.index(self.module) + 1:]
        return any(r.get("module") in later for r in self.records.get(rank, []))

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
        ended well, or went on to a later module on every rank; fail otherwise, naming the
        scenario, the ranks and their tracebacks, and for a launch that failed, how it ended
        and its output."""
        status = {rank: self._status(rank, test) for rank in range(self.ranks)}
        by = {kind: sorted(r for r, (k, _) in status.items() if k == kind)
              for kind in ("passed", "skipped", "failed", "missing")}
        ended_well = self.problem is None or all(map(self._went_on, range(self.ranks)))
        if len(by["passed"]) == self.ranks and ended_well:
            return
        if len(by["skipped"]) == self.ranks and ended_well:
            pytest.skip(status[0][1])
        header = (f"scenario {self.module}::{test} on {self.ranks} ranks ({self.what}): "
                  f"passed on ranks {by['passed']}, failed on {by['failed']}, skipped on "
                  f"{by['skipped']}, not reported by {by['missing']}")
        details = [f"--- rank {rank} ---\n{status[rank][1]}" for rank in by["failed"]]
        if by["missing"] or not ended_well:
            details.append(self._launch_report())
        pytest.fail("\n".join([header, *details]), pytrace=False)


def scenario_run(modules, ranks, wrap, *, timeout, env=None, what):
    """Launch the scenarios of ``modules`` (``{module: tests or None}``, a module's tests or
    all of them; modules run in this order) on ``ranks`` ranks: ``wrap(command)`` returns the
    argv that starts ``command`` on every rank. A launch that crashes or times out keeps the
    outcomes reported before it."""
    targets = [f"{_script_path(module)}::{name}" for module, only in modules.items()
               for name in scenario_names(module) if only is None or name in only]
    with tempfile.TemporaryDirectory(prefix="pacmpi-scenarios-") as report_dir:
        command = [sys.executable, str(RUNNER), report_dir, *targets]
        returncode, stdout, stderr = _communicate(wrap(command), timeout, _environment(env))
        records = {}
        for file in Path(report_dir).glob("rank*.jsonl"):
            lines = file.read_text(encoding="utf-8").splitlines()
            records[int(file.stem.removeprefix("rank"))] = [json.loads(line) for line in lines]
    problem = (f"the launch did not finish within {timeout}s (hang?)" if returncode is None
               else f"the launch exited with status {returncode}" if returncode not in (0, 1)
               else None)  # 1: pytest's "some tests failed", reported per test
    return ScenarioRun(modules, ranks, what, records, problem,
                       f"stdout:\n{stdout}\nstderr:\n{stderr}")


@functools.cache
def _launch(modules, ranks, launcher, timeout, env):
    """``scenario_run`` of ``modules`` (``((module, tests or None), ...)``) under
    ``launcher``, once per distinct call in a session."""
    others = [module for module, _ in modules[1:]]
    what = f"{launcher} -n {ranks}" + (f", shared with {', '.join(others)}" if others else "")
    return scenario_run(dict(modules), ranks,
                        lambda command: LAUNCHERS[launcher](ranks) + command, timeout=timeout,
                        env={**LAUNCHER_ENV.get(launcher, {}), **dict(env)}, what=what)


def run_scenarios(module, ranks, launcher="mpirun", only=None, timeout=240, env=()):
    """``module``'s scenarios (all, or the tuple of names ``only``) on ``ranks`` ranks under
    ``launcher`` (``mpirun``, ``torchrun`` or ``horovodrun``), launched once per distinct call
    in a session: one launch serves all the scenarios it runs. ``env`` is a tuple of ``(name,
    value)`` pairs. A module of ``SHARED_LAUNCHES`` called without ``env`` runs in its shared
    launch, bounded by ``SHARED_TIMEOUT`` instead of ``timeout``; with ``env``, in its own."""
    shared = _shared_group(module, launcher)
    if ranks in shared.get(module, {}) and not env:
        if only != shared[module][ranks]:
            raise ValueError(f"{module} on {ranks} ranks shares a launch that runs "
                             f"{shared[module][ranks] or 'all its scenarios'}, not {only}")
        members = tuple((name, tests[ranks]) for name, tests in shared.items() if ranks in tests)
        return _launch(members, ranks, launcher, SHARED_TIMEOUT,
                       (("PACMPI_TEST_WORKDIR", shared_workdir()),)).part(module)
    return _launch(((module, only),), ranks, launcher, timeout, env)


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
