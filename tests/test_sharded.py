"""Sharded PacTrain (pacmpi.sharded and pacmpi.adapters.sharded) across 2 and 4 real MPI ranks:
each scenario of mpi_scripts/sharded_scenarios.py (mpi4py, the all-reduce fallback and
torch.distributed transports) and of mpi_scripts/hvd_sharded_scenarios.py (Horovod's) reported
on its own, one bounded launch per module and rank count."""
import importlib.util

import pytest

from mpi_util import run_scenarios, scenario_cases

MODULE = "sharded_scenarios.py"
HOROVOD = "hvd_sharded_scenarios.py"
RANKS = {(2,): None, (4,): None}


@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, RANKS))
def test_sharded_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks, timeout=240).check(scenario)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="needs Horovod")
@pytest.mark.parametrize("ranks, scenario", scenario_cases(HOROVOD, RANKS))
def test_horovod_sharded_scenario(ranks, scenario):
    run_scenarios(HOROVOD, ranks, timeout=180).check(scenario)
