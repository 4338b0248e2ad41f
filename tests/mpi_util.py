"""Run worker scripts under mpirun with a hard timeout, so a hang fails fast."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["MPI_SCRIPTS", "mpirun_argv", "run_mpi"]

MPI_SCRIPTS = Path(__file__).parent / "mpi_scripts"


def _mpirun():
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def mpirun_argv(n):
    argv = [_mpirun(), "--oversubscribe", "-n", str(n)]
    if os.geteuid() == 0:
        argv.insert(1, "--allow-run-as-root")
    return argv


def run_mpi(script, n, *args, timeout=120, env=None):
    """Run ``tests/mpi_scripts/<script>`` on ``n`` ranks; returns the CompletedProcess."""
    path = MPI_SCRIPTS / script if not os.path.isabs(script) else Path(script)
    merged = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    merged.update(env or {})
    argv = mpirun_argv(n) + [sys.executable, str(path), *map(str, args)]
    # A session of its own, so a timeout kills mpirun and every rank, not mpirun alone.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=merged, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{script} on {n} ranks did not finish within {timeout}s (hang?)\n"
            f"stdout: {stdout}\nstderr: {stderr}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
