"""The README's training-script snippet runs as written, on 2 ranks."""
import pytest

from mpi_util import run_mpi


@pytest.mark.mpi
def test_readme_training_snippet_runs_on_two_ranks():
    result = run_mpi("readme_quickstart.py", 2, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("OK readme") == 2
