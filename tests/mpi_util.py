"""Run worker scripts under mpirun (or torchrun) with a hard timeout, so a hang fails fast."""
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["MPI_SCRIPTS", "assert_mismatch_reported", "mpirun_argv", "run_bounded", "run_mpi",
           "run_horovod_gloo", "run_torchrun", "netns_skip_reason"]

MPI_SCRIPTS = Path(__file__).parent / "mpi_scripts"


def _mpirun():
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def mpirun_argv(n):
    argv = [_mpirun(), "--oversubscribe", "-n", str(n)]
    if os.geteuid() == 0:
        argv.insert(1, "--allow-run-as-root")
    return argv


def run_bounded(argv, *, timeout, env, what):
    """Run ``argv`` in a session of its own, so a timeout kills the launcher and every rank."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{what} did not finish within {timeout}s (hang?)\n"
                             f"stdout: {stdout}\nstderr: {stderr}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _script_path(script):
    return MPI_SCRIPTS / script if not os.path.isabs(script) else Path(script)


def _environment(extra):
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def run_mpi(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` on ``n`` ranks; returns the CompletedProcess."""
    argv = mpirun_argv(n) + [sys.executable, str(_script_path(script)), *map(str, args)]
    return run_bounded(argv, timeout=timeout, env=_environment(env),
                       what=f"{script} on {n} ranks")


def run_horovod_gloo(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` under ``horovodrun --gloo`` on ``n`` local ranks."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    argv = [str(horovodrun), "--gloo", "-np", str(n), "-H", f"localhost:{n}",
            sys.executable, str(_script_path(script)), *map(str, args)]
    return run_bounded(argv, timeout=timeout, env=_environment(env),
                       what=f"{script} under horovodrun --gloo -np {n}")


def run_torchrun(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` under ``torchrun --standalone --nproc-per-node n``
    (one node, a free rendezvous port); a timeout kills torchrun and every worker."""
    local = Path(sys.executable).parent / "torchrun"
    torchrun = str(local) if local.exists() else shutil.which("torchrun")
    argv = [torchrun, "--standalone", "--nproc-per-node", str(n), str(_script_path(script)),
            *map(str, args)]
    return run_bounded(argv, timeout=timeout, env=_environment(dict({"OMP_NUM_THREADS": "1"},
                                                                    **(env or {}))),
                       what=f"{script} under torchrun --nproc-per-node {n}")


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


def assert_mismatch_reported(result, n, parameter):
    """Every one of ``n`` ranks stopped at step 2 with MaskMismatchError naming the last rank
    and ``parameter``, whose mask it moved; the job exited non-zero."""
    text = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode != 0, text
    for rank in range(n):
        assert f"rank {rank} finished step 1" in result.stdout, text
        assert f"rank {rank} finished step 2" not in result.stdout, text
        assert re.search(rf"rank {rank} raised MaskMismatchError: ranks disagree on mask\S* .*"
                         rf"at step 2; offending ranks: \[{n - 1}\]", result.stdout), text
    assert f"rank {n - 1} on " in result.stdout, text
    assert f"masks differ from rank 0's for [{parameter!r}]" in result.stdout, text


def assert_scenarios_passed(result, ranks, scenarios):
    """The job ended 0 and every rank printed ``OK <scenario> ...`` for every scenario."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for name in scenarios:
        passed = sum(line.startswith(f"OK {name} ") for line in result.stdout.splitlines())
        assert passed == ranks, f"scenario {name}: {passed}/{ranks} ranks passed\n{output}"
