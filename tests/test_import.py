import subprocess
import sys


def test_import_pacmpi_loads_no_framework():
    code = ("import sys, pacmpi, pacmpi.bench.allreduce; "
            "bad = [m for m in ('torch', 'horovod', 'cupy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_pacmpi_does_not_initialize_mpi():
    code = "import sys, pacmpi; sys.exit(1 if 'mpi4py.MPI' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
