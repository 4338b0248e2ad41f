"""PacTrainReducer across 2 and 4 real MPI ranks (each run bounded by a timeout)."""
import pytest

from mpi_util import assert_scenarios_passed, run_mpi

SCENARIOS = ["exact", "ternary", "mismatch", "resync", "layout", "bad_input", "edges",
             "mask_change", "state"]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_core_scenarios(ranks):
    result = run_mpi("core_scenarios.py", ranks, *SCENARIOS, timeout=240)
    assert_scenarios_passed(result, ranks, SCENARIOS)
