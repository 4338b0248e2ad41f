"""PacTrainReducer across 2 and 4 real MPI ranks: each scenario of
mpi_scripts/core_scenarios.py reported on its own, one bounded launch per rank count (shared
with other modules: mpi_util.SHARED_LAUNCHES)."""
import pytest

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

MODULE = "core_scenarios.py"


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, shared_launches(MODULE)))
def test_core_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks).check(scenario)
