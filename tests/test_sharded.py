"""Sharded PacTrain (pacmpi.sharded and pacmpi.adapters.sharded) across 2 and 4 real MPI ranks:
each scenario of mpi_scripts/sharded_scenarios.py reported on its own, one bounded launch per
rank count."""
import pytest

from mpi_util import run_scenarios, scenario_cases

MODULE = "sharded_scenarios.py"


@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, {(2,): None, (4,): None}))
def test_sharded_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks, timeout=240).check(scenario)
