"""PacTrainReducer across 2 and 4 real MPI ranks: each scenario of
mpi_scripts/core_scenarios.py reported on its own, one bounded launch per rank count."""
import pytest

from mpi_util import run_scenarios, scenario_cases

MODULE = "core_scenarios.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, {(2,): None, (4,): None}))
def test_core_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks, timeout=240).check(scenario)
