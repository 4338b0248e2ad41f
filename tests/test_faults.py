"""Faults end the job instead of hanging it: exceptions, a killed rank, a stalled rank.

Multi-rank tests inject each fault under mpirun with a hard timeout and assert the exit
status, the message and a bound on the time to failure. In-process tests cover the pieces
(exit statuses, reports, the heartbeat side channel and the watchdog thread) with fake
communicators, so they need no MPI.
"""
import io
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from pacmpi import faults
from pacmpi.watchdog import StallWatchdog, heartbeat_directory

from mpi_util import MPI_SCRIPTS, mpirun_argv, run_mpi

HOST = socket.gethostname()
FAILURE_BOUND_S = 30  # the bound on time to failure


def timed_mpi(script, n, *args, timeout=60, env=None):
    start = time.monotonic()
    result = run_mpi(script, n, *args, timeout=timeout, env=env)
    return result, time.monotonic() - start


# ---------------------------------------------------------------------- in-process pieces
def test_importing_pacmpi_does_not_initialize_mpi():
    code = ("import sys, pacmpi, pacmpi.faults, pacmpi.watchdog; "
            "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("exc, status", [
    (SystemExit(None), 0), (SystemExit(0), 0), (SystemExit(3), 3), (SystemExit("bad"), 1),
    (KeyboardInterrupt(), 130), (RuntimeError("x"), 1)])
def test_exit_status(exc, status):
    assert faults.exit_status(exc) == status


def test_run_main_single_rank_returns_statuses(capsys):
    assert faults.run_main(lambda argv: None, []) == 0
    assert faults.run_main(lambda argv: len(argv), ["a", "b"]) == 2
    assert capsys.readouterr().err == ""

    def fails(argv):
        raise ValueError("bad input " + argv[0])

    assert faults.run_main(fails, ["x"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: bad input x" in err
    # Every line of the report carries the rank prefix, so interleaved ranks stay readable.
    assert all(line.startswith(f"[pacmpi rank 0/1 on {HOST}] ") for line in err.splitlines())

    def interrupted(argv):
        raise KeyboardInterrupt

    assert faults.run_main(interrupted, []) == 130
    assert "interrupted (KeyboardInterrupt)" in capsys.readouterr().err

    def exits(argv):
        sys.exit("usage: nope")

    assert faults.run_main(exits, []) == 1
    assert capsys.readouterr().err == "usage: nope\n"


def test_abort_on_exception_single_rank_propagates():
    @faults.abort_on_exception()
    def fails():
        raise RuntimeError("single rank")

    with pytest.raises(RuntimeError, match="single rank"):
        fails()
    with pytest.raises(SystemExit):
        with faults.abort_on_exception():
            sys.exit(0)


# ------------------------------------------------- abort on an unhandled exception, by default
@pytest.fixture
def hooks(monkeypatch):
    """Python's own hooks, no declared world, no opt-out in the environment; all restored."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(faults, "_declared_size", 1)
    monkeypatch.delenv(faults.ABORT_ENV, raising=False)
    return monkeypatch


def custom_hook(exc_type, exc, tb):
    pass


@pytest.mark.parametrize("how", ["argument", "0", "false", "off", "no", " OFF "])
def test_opting_out_leaves_the_hooks_untouched(hooks, how):
    thread_hook = threading.excepthook  # pytest's own while a test runs
    if how == "argument":
        assert faults.ensure_abort_on_error(False, size=4) is False
    else:
        hooks.setenv("PACMPI_ABORT_ON_ERROR", how)
        assert faults.ensure_abort_on_error(size=4) is False
    assert sys.excepthook is sys.__excepthook__
    assert threading.excepthook is thread_hook
    assert faults._declared_size == 1

    sys.excepthook = custom_hook  # a program's own hook stays too
    assert faults.ensure_abort_on_error(False, size=4) is False
    assert sys.excepthook is custom_hook


def test_one_rank_installs_nothing(hooks):
    assert faults.ensure_abort_on_error(size=1) is False
    assert faults.ensure_abort_on_error(True, size=1) is False
    assert sys.excepthook is sys.__excepthook__


def test_the_argument_wins_over_the_environment(hooks):
    hooks.setenv("PACMPI_ABORT_ON_ERROR", "0")
    assert faults.ensure_abort_on_error(True, size=2) is True
    assert getattr(sys.excepthook, "_pacmpi_abort", False)


def test_bad_settings_are_rejected(hooks):
    hooks.setenv("PACMPI_ABORT_ON_ERROR", "maybe")
    with pytest.raises(ValueError, match="PACMPI_ABORT_ON_ERROR='maybe'"):
        faults.ensure_abort_on_error(size=4)
    hooks.delenv("PACMPI_ABORT_ON_ERROR")
    with pytest.raises(TypeError, match="abort_on_error"):
        faults.ensure_abort_on_error("yes", size=4)
    for size in (0, -1, 2.0, None, True):
        with pytest.raises(ValueError, match="size"):
            faults.ensure_abort_on_error(size=size)
    assert sys.excepthook is sys.__excepthook__


def test_installing_is_idempotent_and_chained(hooks):
    sys.excepthook = custom_hook
    thread_hook = threading.excepthook
    assert faults.ensure_abort_on_error(size=4) is True
    installed, installed_thread = sys.excepthook, threading.excepthook
    assert installed._pacmpi_abort and installed.previous is custom_hook
    assert installed_thread._pacmpi_abort and installed_thread.previous is thread_hook
    assert faults._declared_size == 4
    for _ in range(3):  # e.g. one reducer per model, or a reducer inside PacTrainSync
        assert faults.ensure_abort_on_error(None, size=np.int64(2)) is True
        assert faults.install_excepthook() is custom_hook
    assert sys.excepthook is installed and threading.excepthook is installed_thread
    assert faults._declared_size == 4


HOOK_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pacmpi import faults

    mode, where = sys.argv[1], sys.argv[2]
    def custom(exc_type, exc, tb):
        print("CUSTOM-HOOK-RAN", exc_type.__name__, exc, file=sys.stderr, flush=True)
    sys.excepthook = custom
    atexit.register(print, "ATEXIT-RAN", flush=True)
    print("INSTALLED", faults.ensure_abort_on_error(None, size=int(mode)), flush=True)

    def fail():
        if where == "thread-exit":
            sys.exit(5)
        raise RuntimeError("boom in " + where)

    if where == "main":
        fail()
    worker = threading.Thread(target=fail, name="prefetch")
    worker.start()
    worker.join()
    time.sleep(0.5)
    print("MAIN-DONE", flush=True)
""")


def run_hook_script(size, where, env=None):
    env = dict({k: v for k, v in os.environ.items() if k != faults.ABORT_ENV}, **(env or {}))
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", HOOK_SCRIPT, str(size), where],
                            capture_output=True, text=True, timeout=60, env=env)
    return result, time.monotonic() - start


def test_hook_chains_reports_and_ends_the_process():
    # Without mpi4py's MPI (as under Horovod): the hook runs the custom hook first, reports
    # with the rank prefix and leaves by os._exit, skipping the finalization (atexit) that
    # would wait for the other ranks.
    result, _ = run_hook_script(2, "main")
    assert result.returncode == 1, result.stderr
    assert "INSTALLED True" in result.stdout
    assert "CUSTOM-HOOK-RAN RuntimeError boom in main" in result.stderr
    assert f"[pacmpi rank 0/1 on {HOST}] RuntimeError: boom in main" in result.stderr
    assert "ATEXIT-RAN" not in result.stdout


def test_hook_covers_threads():
    result, elapsed = run_hook_script(2, "thread")
    assert result.returncode == 1, result.stderr
    assert f"[pacmpi rank 0/1 on {HOST}] unhandled exception in thread 'prefetch'; " \
           "aborting the job" in result.stderr
    assert "RuntimeError: boom in thread" in result.stderr
    assert "MAIN-DONE" not in result.stdout and "ATEXIT-RAN" not in result.stdout


def test_a_threads_system_exit_ends_only_that_thread():
    result, _ = run_hook_script(2, "thread-exit")
    assert result.returncode == 0, result.stderr
    assert "MAIN-DONE" in result.stdout and "ATEXIT-RAN" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("size, env", [(1, None), (2, {"PACMPI_ABORT_ON_ERROR": "0"})])
def test_without_the_hook_python_behaves_as_usual(size, env):
    result, _ = run_hook_script(size, "main", env)
    assert result.returncode == 1, result.stderr
    assert "INSTALLED False" in result.stdout
    assert "CUSTOM-HOOK-RAN RuntimeError boom in main" in result.stderr
    assert "[pacmpi rank" not in result.stderr
    assert "ATEXIT-RAN" in result.stdout  # a normal exit


class FakeComm:
    """Rank and size only: enough for the watchdog when the job id comes from the env."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


@pytest.fixture
def job(monkeypatch, tmp_path):
    monkeypatch.setenv("PACMPI_JOB_ID", "test job/1")
    return tmp_path


def test_watchdog_rejects_bad_limits(job):
    with pytest.raises(ValueError, match="warn_after"):
        StallWatchdog(0, comm=FakeComm(0, 1), heartbeat_dir=job)
    with pytest.raises(ValueError, match="abort_after"):
        StallWatchdog(5, 1, comm=FakeComm(0, 1), heartbeat_dir=job)


def test_heartbeats_name_the_ranks_that_have_not_arrived(job):
    size = 3  # rank 2 never starts: it has no heartbeat file
    r0 = StallWatchdog(60, comm=FakeComm(0, size), heartbeat_dir=job)
    r1 = StallWatchdog(60, comm=FakeComm(1, size), heartbeat_dir=job)
    try:
        assert r0.directory == heartbeat_directory("test job/1", str(job))
        assert r0.directory.endswith("pacmpi-heartbeat-test_job_1")
        for _ in range(3):
            with r0.collective("Allreduce"):
                pass
        r1.collective("Iallreduce")
        beats = r0.heartbeats()
        assert beats[2] is None
        assert (beats[0].seq, beats[0].name, beats[0].waiting) == (3, "Allreduce", -1)
        assert (beats[1].seq, beats[1].name, beats[1].host) == (1, "Iallreduce", HOST)

        with r0.collective("Bcast"):
            assert r0.heartbeats()[0].waiting == 4
            should_print, line = r0.describe(4, "Bcast", 2.0)
        assert should_print
        assert f"not arrived: rank 1 on {HOST} (pid " in line
        assert "last entered #1 Iallreduce" in line
        assert "no heartbeat from rank(s) 2" in line
        assert "rank 0 on" not in line

        # Negative control: once every rank with a file has entered, nobody is named.
        for _ in range(3):
            r1.collective("Allreduce")
        _, line = r0.describe(4, "Bcast", 2.0)
        assert "not arrived" not in line
    finally:
        r0.close()
        r1.close()
    assert not (job / "pacmpi-heartbeat-test_job_1").exists()


def test_watchdog_thread_warns_once_then_reports_completion(job):
    out = [io.StringIO(), io.StringIO()]
    dogs = [StallWatchdog(0.2, comm=FakeComm(r, 2), heartbeat_dir=job, poll_interval=0.02,
                          stream=out[r]) for r in range(2)]
    try:
        with dogs[0].collective("Allreduce"):
            time.sleep(1.0)  # rank 1 never arrives
        with dogs[0].collective("Allreduce"):
            pass
        dogs[1].collective("Allreduce")
        dogs[1].collective("Allreduce")
        with dogs[0].collective("Allreduce"):
            time.sleep(0.1)  # below warn_after: no report
    finally:
        for dog in dogs:
            dog.close()
    lines = out[0].getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"[pacmpi watchdog rank 0/2 on {HOST}] collective #1 (Allreduce)")
    assert f"not arrived: rank 1 on {HOST}" in lines[0]
    assert re.search(r"collective #1 \(Allreduce\) completed after about \d\.\d s", lines[1])
    assert out[1].getvalue() == ""


# ---------------------------------------------------------------------- under mpirun
EXCEPTION_CASES = [
    # mechanism, where, ranks, expected message, expected exit status
    ("hook", "user", 2, "RuntimeError: injected failure on rank 1", 1),
    ("run_main", "user", 4, "RuntimeError: injected failure on rank 1", 1),
    ("context", "user", 2, "RuntimeError: injected failure on rank 1", 1),
    ("run_main", "exit", 2, "exited with status 3", 3),
    ("run_main", "pacmpi", 2, "TypeError: gradient 0 has dtype float32, expected float64", 1),
    ("hook", "pacmpi", 4, "TypeError: gradient 0 has dtype float32, expected float64", 1),
]


@pytest.mark.mpi
@pytest.mark.parametrize("mechanism, where, n, message, status", EXCEPTION_CASES)
def test_failure_on_one_rank_ends_the_job(mechanism, where, n, message, status):
    result, elapsed = timed_mpi("fault_exception.py", n, mechanism, where, 1, 20)
    assert result.returncode == status, result.stderr
    assert elapsed < FAILURE_BOUND_S
    assert f"[pacmpi rank 1/{n} on {HOST}] {message}" in result.stderr
    assert "MPI_ABORT was invoked on rank 1" in result.stderr
    assert "loop ended" not in result.stdout


DEFAULT_ABORT_CASES = [
    # where, ranks, expected report line
    ("main", 4, "RuntimeError: injected failure on rank 1 at step 20"),
    ("thread", 4, "unhandled exception in thread 'prefetch'; aborting the job"),
    ("custom", 2, "RuntimeError: injected failure on rank 1 at step 20"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("where, n, message", DEFAULT_ABORT_CASES)
def test_a_plain_script_ends_when_one_rank_fails(where, n, message):
    # No pacmpi.faults call in the script: creating the PacTrainReducer installed the hook.
    result, elapsed = timed_mpi("fault_default_abort.py", n, where, 1, 20)
    assert result.returncode == 1, result.stderr
    assert elapsed < FAILURE_BOUND_S
    assert result.stdout.count("hook installed: True") == n, result.stdout
    assert f"[pacmpi rank 1/{n} on {HOST}] {message}" in result.stderr
    assert "MPI_ABORT was invoked on rank 1" in result.stderr
    assert "loop ended" not in result.stdout
    if where == "custom":
        assert "CUSTOM-HOOK-RAN RuntimeError: injected failure on rank 1" in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_sigkilled_rank_ends_the_job_and_is_named(n):
    victim = n - 1
    result, elapsed = timed_mpi("fault_sigkill.py", n, victim, 30)
    assert result.returncode != 0
    assert elapsed < FAILURE_BOUND_S
    flat = " ".join(result.stderr.split())
    assert re.search(rf"process rank {victim} with PID \d+ on node \S+ exited on signal 9", flat), \
        result.stderr
    assert "loop ended" not in result.stdout


@pytest.mark.mpi
def test_sigkilled_rank_is_named_by_the_project_launcher():
    runner = pytest.importorskip("pacmpi.launch.runner")
    start = time.monotonic()
    argv = [sys.executable, str(MPI_SCRIPTS / "fault_sigkill.py"), "1", "30"]
    result = runner.run_command(argv, 2, mpirun=mpirun_argv(2)[0], oversubscribe=True,
                                capture=True, echo=False, timeout=60)
    assert time.monotonic() - start < FAILURE_BOUND_S
    assert result.returncode != 0 and not result.timed_out
    assert result.failure.rank == 1 and result.failure.signal == 9
    assert "rank 1" in result.failure_message and "SIGKILL" in result.failure_message


def watchdog_lines(stderr, collective=None):
    """The watchdog's lines, or only those about collective number ``collective``.

    mpirun merges every rank's stderr with its own messages, and a line can reach us behind a
    stray byte of the launcher's (a NUL after MPI_ABORT's help text was seen under load), so a
    line is taken from where the watchdog's prefix starts."""
    marker = "[pacmpi watchdog"
    lines = [line[line.index(marker):] for line in stderr.splitlines() if marker in line]
    if collective is None:
        return lines
    return [line for line in lines if f"] collective #{collective} (" in line]


# Ranks of an oversubscribed, loaded machine can be seconds apart at start-up, which the
# watchdog rightly reports too (and then reports completed); the assertions below look at
# the collective the injected stall is in.

@pytest.mark.mpi
def test_watchdog_names_the_stalled_rank_then_aborts(tmp_path):
    # Rank 2 of 4 sleeps 60 s before step 3; warn after 1 s, abort after 3 s.
    result, elapsed = timed_mpi("fault_stall.py", 4, 2, 3, 60, 1, 3, 20,
                                env={"PACMPI_HEARTBEAT_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert 3 <= elapsed < FAILURE_BOUND_S
    aborts = [line for line in watchdog_lines(result.stderr) if "; aborting the job" in line]
    assert aborts, result.stderr
    stalled = re.search(r"\] collective #(\d+) \(", aborts[0]).group(1)
    lines = watchdog_lines(result.stderr, stalled)
    warnings = [line for line in lines if "; aborting the job" not in line]
    assert warnings, result.stderr
    for line in lines:
        assert f"not arrived: rank 2 on {HOST} (pid " in line
        assert not re.search(r"rank [013] on .* \(pid", line.split("not arrived:")[1])
        assert float(re.search(r"has waited ([\d.]+) s", line).group(1)) >= 1.0
        assert not line.startswith("[pacmpi watchdog rank 2/")
    assert all("aborting the job after abort_after=3.0 s" in line for line in aborts)
    assert "STALL-DONE" not in result.stdout


@pytest.mark.mpi
def test_watchdog_reports_a_transient_stall_and_lets_the_job_finish(tmp_path):
    # Rank 1 of 2 sleeps 2.5 s before step 3; warn after 1 s, never abort.
    result, _ = timed_mpi("fault_stall.py", 2, 1, 3, 2.5, 1, "none", 10,
                          env={"PACMPI_HEARTBEAT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("STALL-DONE") == 2
    stalls = [match.group(1) for line in watchdog_lines(result.stderr) if (match := re.match(
        rf"\[pacmpi watchdog rank 0/2 on {re.escape(HOST)}\] collective #(\d+) "
        rf"\(\w+\) has waited [\d.]+ s; not arrived: rank 1 on {re.escape(HOST)} ", line))]
    assert stalls, result.stderr
    done = re.search(r"completed after about ([\d.]+) s$",
                     watchdog_lines(result.stderr, stalls[-1])[-1])
    assert done and float(done.group(1)) >= 1.0, result.stderr


@pytest.mark.mpi
def test_watchdog_is_silent_when_every_rank_arrives_in_time(tmp_path):
    # Negative control: a 0.2 s delay stays well below warn_after = 5 s.
    result, _ = timed_mpi("fault_stall.py", 2, 1, 3, 0.2, 5, 10, 100,
                          env={"PACMPI_HEARTBEAT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert watchdog_lines(result.stderr) == []
    assert result.stdout.count("STALL-DONE") == 2
    assert list(tmp_path.iterdir()) == []  # every rank removed its heartbeat file


@pytest.mark.mpi
def test_overhead_benchmark_runs(tmp_path):
    # Timing is not asserted (shared 2-core machines are too noisy); run it with larger counts
    # (e.g. 10000 9) to measure the per-call cost of the watchdog.
    result, _ = timed_mpi("fault_overhead.py", 2, 1000, 2,
                          env={"PACMPI_HEARTBEAT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    for variant in ("raw mpi4py", "watchdog=None", "watchdog on"):
        assert re.search(rf"OVERHEAD {variant}: \d+\.\d+ us/call", result.stdout), result.stdout
