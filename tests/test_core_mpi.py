"""PacTrainReducer across 2 and 4 real MPI ranks (each run bounded by a timeout)."""
import pytest

from mpi_util import run_mpi

SCENARIOS = ["exact", "ternary", "mismatch", "resync", "layout", "bad_input", "edges",
             "mask_change", "state"]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_core_scenarios(ranks):
    result = run_mpi("core_scenarios.py", ranks, *SCENARIOS, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for name in SCENARIOS:
        passed = sum(line.startswith(f"OK {name} ") for line in result.stdout.splitlines())
        assert passed == ranks, f"scenario {name}: {passed}/{ranks} ranks passed\n{output}"
